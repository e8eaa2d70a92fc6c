"""Immutable description of how a global tensor is cut into blocks over a process grid."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, cast

from .._util.ints import is_int
from .blocks import block_cuts, block_sizes, check_cuts

__all__ = ["Layout", "normalize_split", "grid_coords", "grid_rank"]

Split = tuple["int | None", ...]


def grid_coords(rank: int, grid_dims: Sequence[int]) -> tuple[int, ...]:
    """Local. Row-major Cartesian coordinates of ``rank`` (MPI's ``Cart_create`` order)."""
    coords = []
    for d in reversed(grid_dims):
        rank, c = divmod(rank, d)
        coords.append(c)
    return tuple(reversed(coords))


def grid_rank(coords: Sequence[int], grid_dims: Sequence[int]) -> int:
    """Local. Row-major rank of Cartesian ``coords`` on a grid of shape ``grid_dims``."""
    r = 0
    for c, d in zip(coords, grid_dims):
        r = r * d + c
    return r


def normalize_split(split: object, ndim: int, grid_ndim: int) -> tuple[int | None, ...]:
    """Local. Validate a split specification and return it as a tuple of length ``ndim``.

    ``split[d]`` is the grid axis that tensor dimension ``d`` is divided over, or ``None``
    for a dimension that is not divided. A plain ``None`` means fully replicated; an int
    ``g`` is shorthand for "dimension 0 over grid axis g" only when ``ndim == 1``.

    Raises
    ------
    ValueError
        If the length is wrong, an axis is out of range, or a grid axis is used twice.
    TypeError
        If an entry is neither an int nor None.
    """
    if split is None:
        return (None,) * ndim
    if is_int(split):
        if ndim != 1:
            raise ValueError(
                f"split={split!r} is a single int but the tensor has {ndim} dims; give one "
                f"entry per tensor dim, e.g. split={tuple([split] + [None] * (ndim - 1))}"
            )
        split = (int(split),)
    try:
        items = tuple(cast(Iterable[Any], split))
    except TypeError:
        raise TypeError(f"split must be None, an int or a sequence of int/None, got {type(split).__name__}") from None
    if len(items) != ndim:
        raise ValueError(
            f"split={items} has {len(items)} entries but the tensor has {ndim} dims; "
            f"give one grid axis (or None) per tensor dim"
        )
    out: list[int | None] = []
    for d, g in enumerate(items):
        if g is None:
            out.append(None)
            continue
        if not is_int(g):
            raise TypeError(f"split[{d}] must be an int grid axis or None, got {g!r}")
        if not 0 <= g < grid_ndim:
            raise ValueError(
                f"split[{d}]={g} is out of range for a {grid_ndim}-D process grid "
                f"(valid grid axes: 0..{grid_ndim - 1}, or None)"
            )
        g = int(g)
        if g in out:
            raise ValueError(
                f"split={items} uses grid axis {g} for more than one tensor dim; each grid "
                f"axis may divide at most one tensor dim"
            )
        out.append(g)
    return tuple(out)


@dataclass(frozen=True)
class Layout:
    """Local. Immutable map from a global tensor to the blocks held by each grid coordinate.

    Tensor dimension ``d`` is cut into ``grid_dims[split[d]]`` blocks along grid axis
    ``split[d]``; ``split[d] is None`` means the dimension is whole on every rank. Grid
    axes that divide no dimension hold replicas. Blocks are balanced (:func:`block_range`)
    unless explicit ``cuts`` are given, e.g. by :func:`hpctp.from_local`.

    Parameters
    ----------
    global_shape : sequence of int
        Shape of the global tensor.
    grid_dims : sequence of int
        Shape of the process grid.
    split : sequence of (int or None), int or None
        Grid axis per tensor dimension (see :func:`normalize_split`).
    cuts : sequence of (sequence of int or None), optional
        Explicit block boundaries per tensor dimension (``None``: balanced).

    Raises
    ------
    ValueError
        On negative sizes, invalid split or cuts.
    """

    global_shape: tuple[int, ...]
    grid_dims: tuple[int, ...]
    split: tuple[int | None, ...]
    cuts: tuple[tuple[int, ...] | None, ...] = field(default=())

    def __post_init__(self) -> None:
        if not all(is_int(s) for s in self.global_shape):
            raise TypeError(f"global_shape={tuple(self.global_shape)!r} must hold ints (sizes are not truncated)")
        shape = tuple(int(s) for s in self.global_shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"global_shape={shape} has a negative size")
        if not all(is_int(g) for g in self.grid_dims):
            raise TypeError(f"grid_dims={tuple(self.grid_dims)!r} must hold ints")
        dims = tuple(int(g) for g in self.grid_dims)
        if not dims or any(g < 1 for g in dims):
            raise ValueError(f"grid_dims={dims} must be a non-empty tuple of positive ints")
        split = normalize_split(self.split, len(shape), len(dims))
        raw_cuts = self.cuts if self.cuts else (None,) * len(shape)
        if len(raw_cuts) != len(shape):
            raise ValueError(f"cuts has {len(raw_cuts)} entries, expected {len(shape)}")
        cuts: list[tuple[int, ...] | None] = []
        for d, c in enumerate(raw_cuts):
            parts = 1 if split[d] is None else dims[split[d]]  # type: ignore[index]
            if c is None:
                cuts.append(None)
                continue
            c = check_cuts(c, shape[d], parts, f"cuts[{d}]")
            cuts.append(None if c == block_cuts(shape[d], parts) else c)
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "grid_dims", dims)
        object.__setattr__(self, "split", split)
        object.__setattr__(self, "cuts", tuple(cuts))

    # ------------------------------------------------------------------ basic facts
    @property
    def ndim(self) -> int:
        """Number of tensor dimensions."""
        return len(self.global_shape)

    @property
    def nranks(self) -> int:
        """Number of grid positions (ranks)."""
        return math.prod(self.grid_dims)

    @property
    def replicated_axes(self) -> tuple[int, ...]:
        """Grid axes that divide no tensor dimension (the tensor is replicated along them)."""
        return tuple(g for g in range(len(self.grid_dims)) if g not in self.split)

    @property
    def is_balanced(self) -> bool:
        """True when every dimension uses the balanced decomposition."""
        return all(c is None for c in self.cuts)

    def parts(self, d: int) -> int:
        """Number of blocks tensor dimension ``d`` is cut into."""
        g = self.split[d]
        return 1 if g is None else self.grid_dims[g]

    @cached_property
    def dim_cuts(self) -> tuple[tuple[int, ...], ...]:
        """Block boundaries of every tensor dimension (length ``parts(d) + 1`` each)."""
        return tuple(
            c if c is not None else block_cuts(n, self.parts(d))
            for d, (n, c) in enumerate(zip(self.global_shape, self.cuts))
        )

    def with_split(self, split: object) -> Layout:
        """Same tensor and grid, balanced blocks with another ``split``."""
        return Layout(self.global_shape, self.grid_dims, split)  # type: ignore[arg-type]

    def with_size(self, d: int, n: int) -> Layout:
        """Local. The same layout with ``n`` items along dimension ``d``, which no grid axis divides (e.g. a
        layer's output channels). Remembered per ``(d, n)``: a layer called every step reuses one layout.

        Parameters
        ----------
        d : int
            The dimension.
        n : int
            Its new size.

        Returns
        -------
        Layout

        Raises
        ------
        ValueError
            If ``d`` is not a dimension, ``n`` is negative, or ``d`` is cut into more than one block.
        """
        memo: dict[tuple[int, int], Layout] = self.__dict__.setdefault("_resized", {})
        hit = memo.get((d, n))
        if hit is None:
            if not 0 <= d < self.ndim:
                raise ValueError(f"dimension {d} is not one of the {self.ndim} of {self}")
            if self.parts(d) > 1:
                raise ValueError(f"dimension {d} of {self} is cut into {self.parts(d)} blocks; its size cannot change")
            shape = self.global_shape[:d] + (int(n),) + self.global_shape[d + 1 :]
            hit = memo[(d, n)] = Layout(shape, self.grid_dims, self.split, self.cuts)
        return hit

    # ------------------------------------------------------------------ per coordinate
    def _check_coords(self, coords: Sequence[int]) -> tuple[int, ...]:
        coords = tuple(int(c) for c in coords)
        if len(coords) != len(self.grid_dims) or any(not 0 <= c < g for c, g in zip(coords, self.grid_dims)):
            raise ValueError(f"coords={coords} is not a position on a grid of dims {self.grid_dims}")
        return coords

    def block_index(self, coords: Sequence[int]) -> tuple[int, ...]:
        """Block index per tensor dimension held at grid ``coords`` (0 for undivided dims)."""
        coords = self._check_coords(coords)
        return tuple(0 if g is None else coords[g] for g in self.split)

    def local_ranges(self, coords: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` per tensor dimension of the block held at grid ``coords``.

        Remembered per position (a layout is immutable): every DistTensor built on this
        layout checks its block against them, so layers that run on small blocks pay once.
        """
        key = tuple(coords)
        memo: dict[tuple[int, ...], tuple[tuple[int, int], ...]] = self.__dict__.setdefault("_ranges", {})
        hit = memo.get(key)
        if hit is None:
            idx = self.block_index(coords)
            hit = memo[key] = tuple((c[i], c[i + 1]) for c, i in zip(self.dim_cuts, idx))
        return hit

    def local_slices(self, coords: Sequence[int]) -> tuple[slice, ...]:
        """Global index slices of the block held at grid ``coords``."""
        return tuple(slice(a, b) for a, b in self.local_ranges(coords))

    def local_shape(self, coords: Sequence[int]) -> tuple[int, ...]:
        """Shape of the block held at grid ``coords``."""
        return tuple(b - a for a, b in self.local_ranges(coords))

    def check_block(self, shape: Sequence[int], grid_dims: Sequence[int], coords: Sequence[int], what: str) -> None:
        """Raise ValueError unless this layout is on a grid of ``grid_dims`` and its block at
        ``coords`` has ``shape``; ``what`` names the block in the message."""
        if self.grid_dims != tuple(grid_dims):
            raise ValueError(
                f"{what}: {self} is for grid dims {self.grid_dims}, but the grid has dims {tuple(grid_dims)}"
            )
        want = self.local_shape(coords)
        if tuple(shape) != want:
            raise ValueError(
                f"{what} has shape {tuple(shape)} but {self} expects {want} at grid coords {tuple(coords)}"
            )

    def block_sizes(self, d: int) -> tuple[int, ...]:
        """Sizes of the blocks of tensor dimension ``d``."""
        return block_sizes(self.dim_cuts[d])

    def is_primary(self, coords: Sequence[int]) -> bool:
        """True for the one replica of each block at coordinate 0 of all replicated axes."""
        coords = self._check_coords(coords)
        return all(coords[g] == 0 for g in self.replicated_axes)

    def __str__(self) -> str:
        uneven = "" if self.is_balanced else ", custom cuts"
        return f"Layout(shape={self.global_shape}, grid={self.grid_dims}, split={self.split}{uneven})"
