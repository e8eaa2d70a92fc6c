"""The one input path of the spatial layers: the caller's input as a block, a layout and a way back.

Every spatial layer (conv, transposed conv, pooling, upsampling, the norms, the Fourier
layers) takes a plain local ``torch.Tensor`` block or a :class:`~hpctp.DistTensor`, and
returns a result of the same kind. :func:`field_input` turns the input into a
:class:`FieldInput` (the torch block, its global layout, the layer's split) after the
local checks; for a plain block the layout is inferred or checked collectively, in the
same message that raises a failed check on every rank. :meth:`FieldInput.wrap` hands a
result block back in the caller's kind.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from ... import comm as C
from ..._util.ints import is_int
from ...comm import ProcessGrid
from ...layout import Layout, normalize_split
from ...tensor.core import DistTensor
from ...tensor.infer import infer_layout

__all__ = [
    "FieldInput",
    "InputGridError",
    "InputSplitError",
    "block_checker",
    "field_axes",
    "field_input",
    "full_split",
    "resolve_layout",
    "split_items",
]


class InputSplitError(ValueError):
    """Local. A DistTensor input split otherwise than the layer (``given``, ``wanted``: full splits)."""

    def __init__(self, message: str, given: tuple[int | None, ...], wanted: tuple[int | None, ...]) -> None:
        super().__init__(message)
        self.given, self.wanted = given, wanted


class InputGridError(ValueError):
    """Local. A DistTensor input on a grid of other dims than the layer's (``given``, ``wanted``: the dims)."""

    def __init__(self, message: str, given: tuple[int, ...], wanted: tuple[int, ...]) -> None:
        super().__init__(message)
        self.given, self.wanted = given, wanted


@dataclass(frozen=True)
class FieldInput:
    """Local. A spatial layer's input: this rank's torch block of a field ``[N, C, *spatial]``.

    ``layout`` is the global layout (None only where a purely local layer had a plain block
    and no layout), ``grid`` the layer's grid, ``split`` the full split
    ``(None, None, *spatial)`` and ``home`` the grid of the caller's DistTensor (None for a
    plain block), onto which :meth:`wrap` puts results.
    """

    block: torch.Tensor
    layout: Layout | None
    grid: ProcessGrid
    split: tuple[int | None, ...]
    home: ProcessGrid | None

    @property
    def global_layout(self) -> Layout:
        """Local. ``layout``, which :func:`field_input` always gives the collective layers."""
        if self.layout is None:
            raise RuntimeError("this layer's input has no layout: field_input(..., collective=False) left it unknown")
        return self.layout

    @property
    def axes(self) -> tuple[int, ...]:
        """Local. The sorted grid axes that split the field's spatial dims."""
        return tuple(sorted(g for g in self.split if g is not None))

    def wrap(self, y: torch.Tensor, layout: Layout | None = None) -> Any:
        """Local. ``y`` in the caller's kind: a DistTensor of ``layout`` (default: the input's) for a
        DistTensor input, else the block itself."""
        if self.home is None:
            return y
        return DistTensor(y, self.home, self.global_layout if layout is None else layout)


def split_items(split: object) -> tuple[Any, ...] | None:
    """Local. A split specification as a tuple (an int is one grid axis; None stays None).

    Raises
    ------
    TypeError
        If ``split`` is neither None, an int nor a sequence.
    """
    if split is None:
        return None
    if is_int(split):
        return (int(split),)
    try:
        return tuple(split)  # type: ignore[call-overload, arg-type]
    except TypeError:
        raise TypeError(f"split must be a sequence of grid axes (or None), got {split!r}") from None


def block_checker(nd: int, channels: int, name: str = "channels") -> Callable[[torch.Tensor], None]:
    """Local. The check of a layer's input block ``(N, C, *spatial)``: ``nd`` spatial dims, ``channels`` in dim 1
    (``name``: what the layer calls them), for :func:`field_input`'s ``check``."""

    def check(x: torch.Tensor) -> None:
        if x.dim() != nd + 2:
            raise ValueError(
                f"expected a batched {nd + 2}-D block (N, C, *spatial) (channels first), got {x.dim()} dims"
            )
        if x.shape[1] != channels:
            raise ValueError(f"expected {channels} {name} in dim 1, got {x.shape[1]}")

    return check


def full_split(split: object, nd: int, grid_ndim: int) -> tuple[int | None, ...]:
    """Local. ``(None, None, *spatial)`` from a spatial split (length ``nd``) or a full one.

    None means spatial dim ``i`` over grid axis ``i``, as far as the grid has axes.

    Raises
    ------
    ValueError
        On a split that is not a sequence, of another length, splitting the batch or
        channel dim, or naming grid axes out of range or twice.
    """
    if split is None:
        return (None, None) + tuple(i if i < grid_ndim else None for i in range(nd))
    try:
        items: tuple[Any, ...] = tuple(split)  # type: ignore[call-overload, arg-type]
    except TypeError:
        raise ValueError(f"split must be a sequence of grid axes (or None) per spatial dim, got {split!r}") from None
    if len(items) == nd + 2:
        if items[0] is not None or items[1] is not None:
            raise ValueError(f"split={items}: batch and channel dims cannot be split by these layers")
        items = items[2:]
    if len(items) != nd:
        raise ValueError(f"split={items} must have one entry per spatial dim ({nd}) or per dim ({nd + 2})")
    return normalize_split((None, None) + items, nd + 2, grid_ndim)


def field_axes(grid: ProcessGrid, split: object, n_spatial: int) -> tuple[tuple[int | None, ...], tuple[int, ...]]:
    """Local. Validate a spatial ``split`` and return it with the grid axes it uses.

    Parameters
    ----------
    grid : ProcessGrid
    split : int, sequence of (int or None), or None
        Grid axis per spatial dim (None entry: the dim is whole on every rank), or per dim
        of the block ``(None, None, *spatial)``. None: spatial dim ``i`` over grid axis
        ``i`` (as far as the grid has axes), like the conv layers.
    n_spatial : int
        Number of spatial dims.

    Returns
    -------
    (split, axes)
        The spatial split (length ``n_spatial``) and the sorted grid axes it uses. Ranks
        along grid axes not in ``axes`` must hold replicas of the same block.

    Raises
    ------
    ValueError, TypeError
        On an invalid split.
    """
    sp = full_split(split_items(split), n_spatial, grid.ndim)[2:]
    return sp, tuple(sorted(g for g in sp if g is not None))


def resolve_layout(
    shape: Sequence[int], grid: ProcessGrid, split: tuple[int | None, ...], layout: Layout | None,
    error: Exception | None = None,
) -> Layout:  # fmt: skip
    """Collective over grid. The layout of blocks of ``shape``: inferred when ``layout`` is None,
    else checked against the block on every rank (a block that does not match on one rank
    raises everywhere: none is left waiting); ``error``, a failed earlier local check, is raised
    the same way (in the inference's one message when there is no ``layout``).

    Raises
    ------
    ValueError, TypeError
        On every rank: ``error``, blocks that do not tile, or a ``layout`` that does not
        describe them.
    """
    if layout is None:
        return infer_layout(tuple(shape), grid, split, error)
    try:
        if error is not None:
            raise error
        _check_layout(layout, shape, grid, split)
    except (TypeError, ValueError) as e:
        error = e
    C.raise_if_any(grid.comm, error)
    return layout


def _check_layout(layout: object, shape: Sequence[int], grid: ProcessGrid, split: tuple[int | None, ...]) -> None:
    """Local. Raise unless ``layout`` is the layout of this rank's block of ``shape``, split as ``split``."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a hpctp.layout.Layout, got {type(layout).__name__}")
    head = f"layout {layout} does not describe this block"
    if layout.grid_dims != grid.dims:
        raise ValueError(f"{head}: it is for grid dims {layout.grid_dims}, the grid has dims {grid.dims}")
    if layout.split != split:
        raise ValueError(f"{head}: its split is not the layer's {split}")
    want = layout.local_shape(grid.coords)
    if tuple(shape) != want:
        raise ValueError(f"{head}: rank {grid.rank}: block has shape {tuple(shape)}, the layout's there is {want}")


def field_input(
    x: Any,
    grid: ProcessGrid,
    split: object,
    nd: int | None,
    layout: Layout | None = None,
    *,
    check: Callable[[torch.Tensor], None] | None = None,
    collective: bool = True,
) -> FieldInput:
    """Collective over grid for a plain block when ``collective``, else local. The layer's input.

    The local checks come first: the input's kind and grid, ``check`` (a layer's own checks of
    the block: dims, channels), the number of dims, the split, and the layout's agreement
    with the block. A DistTensor's layout is global, so a failed check raises on every rank
    without communication. For a plain block one small collective raises a failed check on every
    rank, or else infers the layout (``layout`` None) or agrees that it describes every block.

    Parameters
    ----------
    x : torch.Tensor or DistTensor
        This rank's block ``[N, C, *spatial]``, or a DistTensor with a torch block.
    grid : ProcessGrid
        The layer's grid.
    split : split specification
        See :func:`full_split` (already an int-free sequence or None).
    nd : int or None
        Number of spatial dims; None: the block's dims less two.
    layout : Layout, optional
        A plain block's global layout (ignored for a DistTensor, which has its own).
    check : callable, optional
        The layer's checks of the block, raising ValueError or TypeError.
    collective : bool
        False for layers that exchange nothing on this call (a norm in eval mode, nearest
        upsampling): a failed check raises on this rank only, and a plain block's layout
        stays as given (None when omitted).

    Returns
    -------
    FieldInput

    Raises
    ------
    TypeError
        If ``x`` is not a torch block or a DistTensor with one.
    ValueError
        On another grid, dims, split, or a layout that does not describe the blocks.
    """
    home = x.grid if isinstance(x, DistTensor) else None
    lay = x.layout if isinstance(x, DistTensor) else layout
    block: torch.Tensor | None = None
    full: tuple[int | None, ...] = ()
    error: Exception | None = None
    try:
        block = _torch_block(x, grid)
        if check is not None:
            check(block)
        n = block.ndim - 2 if nd is None else nd
        if block.ndim != n + 2 or n < 1:
            raise ValueError(f"expected a batched {max(n, 1) + 2}-D block (N, C, *spatial), got {block.ndim} dims")
        full = full_split(split, n, grid.ndim)
        if home is not None and lay is not None and lay.split != full:
            raise InputSplitError(
                f"input split {lay.split} differs from the layer's split {full}; call x.redistribute({full}) first",
                tuple(lay.split), full,
            )  # fmt: skip
        if home is None and lay is not None and not collective:
            _check_layout(lay, block.shape, grid, full)
    except (TypeError, ValueError) as e:
        error = e
    if home is None and collective:
        shape = tuple(block.shape) if block is not None and error is None else ()
        lay = resolve_layout(shape, grid, full, lay, error)
    elif error is not None:
        raise error
    return FieldInput(cast(torch.Tensor, block), lay, grid, full, home)  # (error is None: block was set)


def _torch_block(x: Any, grid: ProcessGrid) -> torch.Tensor:
    """Local. The torch block of a plain block or of a DistTensor on a grid of the layer's dims."""
    if isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DistTensor):
        raise TypeError(f"input must be a torch.Tensor block or a DistTensor, got {type(x).__name__}")
    if not isinstance(x.local, torch.Tensor):
        raise TypeError("DistTensor inputs of nn layers need a torch local block (use .to('torch'))")
    if x.grid.dims != grid.dims:
        raise InputGridError(
            f"input lives on grid dims {x.grid.dims}, the layer on {grid.dims}; build the layer on the input's grid "
            "(with a ParallelPlan: both on plan.model_grid), or move the input there (x.redistribute(split, grid=...))",
            tuple(x.grid.dims),
            tuple(grid.dims),
        )
    return x.local
