"""The Cartesian process grid that every distributed tensor lives on."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
from mpi4py import MPI

from .._util.ints import is_int
from ..layout import grid_coords
from . import trace as T
from .agree import agree_arguments
from .env import environment_error
from .virtual import VirtualComm, is_virtual, virtual_world

_C = TypeVar("_C")


def _created(parent: MPI.Comm, op: str, make: Callable[[], _C]) -> _C:
    """Collective over ``parent``. ``make()``, a communicator creation, entered in the flight recorder."""
    e = T.begin(parent, op, 0) if T.on and parent.Get_size() > 1 else None
    made = make()
    if e is not None:
        T.end(e)
    return made


__all__ = ["ProcessGrid", "check_grid"]


def _agreed_shape(
    comm: MPI.Intracomm, dims: int | Sequence[int], periods: Sequence[bool] | None
) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Collective over ``comm``. Validated dims and periods, the same on every rank: a rank
    whose arguments are invalid, or differ from the others', makes every rank raise."""
    error: Exception | None = None
    shape: tuple[int, ...] = ()
    per: tuple[bool, ...] = ()
    try:
        shape = _normalize_dims(dims, comm.Get_size())
        per = tuple(bool(p) for p in ([False] * len(shape) if periods is None else periods))
        if len(per) != len(shape):
            raise ValueError(f"periods has {len(per)} entries but the grid has {len(shape)} axes")
        error = environment_error()  # a bad HPCTP_* setting surfaces here, on every rank
    except (TypeError, ValueError) as e:
        error = e
    s = T.settings()  # a watchdog or a mismatch check on some ranks only would itself hang: agree on them
    debug = {"HPCTP_WATCHDOG": s.watchdog, "HPCTP_CHECK": s.check, "HPCTP_TRACE_DIR": s.directory}
    agree_arguments(comm, "ProcessGrid", error, dims=shape, periods=per, environment=debug)
    return shape, per


def _normalize_dims(dims: int | Sequence[int], size: int) -> tuple[int, ...]:
    if isinstance(dims, (bool, np.bool_)):
        raise TypeError(f"dims must be an int or a sequence of ints, got {dims!r}")
    if is_int(dims):
        if dims < 1:
            raise ValueError(f"dims={dims}: a grid needs at least one axis")
        dims = [0] * int(dims)
    try:
        raw = list(dims)
    except TypeError:
        raise TypeError(f"dims must be an int or a sequence of ints, got {type(dims).__name__}") from None
    if not raw:
        raise ValueError("dims must not be empty")
    for i, d in enumerate(raw):
        if not is_int(d) or d < 0:
            raise ValueError(f"dims[{i}]={d!r} must be a non-negative int (0 = let MPI choose)")
        raw[i] = int(d)
    fixed = math.prod(d for d in raw if d > 0)
    if 0 not in raw:
        if fixed != size:
            raise ValueError(
                f"grid dims {tuple(raw)} hold {fixed} ranks but the communicator has {size}; "
                f"use dims whose product is {size}, or put 0 where MPI may choose"
            )
        return tuple(raw)
    if size % fixed:
        raise ValueError(
            f"grid dims {tuple(raw)}: the fixed sizes (product {fixed}) do not divide the communicator size {size}"
        )
    return tuple(MPI.Compute_dims(size, raw))


class ProcessGrid:
    """Collective over ``comm``. A Cartesian grid of MPI processes.

    The grid works on its own duplicate of ``comm`` (``comm.Dup()`` then ``Create_cart``
    without reordering), so hpctp's messages never mix with the caller's. Ranks are laid
    out row-major: the grid rank equals the rank in ``comm``.

    Parameters
    ----------
    dims : int or sequence of int
        Grid shape. Entries of 0 are filled in by ``MPI.Compute_dims``; a plain int ``n``
        asks for an ``n``-dimensional grid chosen entirely by MPI.
    comm : mpi4py.MPI.Intracomm, optional
        The communicator to build the grid on (default ``MPI.COMM_WORLD``).
    periods : sequence of bool, optional
        Periodicity per grid axis (affects :meth:`shift`); default non-periodic.

    Attributes
    ----------
    dims, ndim, rank, size, coords, comm

    Raises
    ------
    ValueError
        If the product of ``dims`` does not match the communicator size, or ``periods``
        has the wrong length. Raised on every rank before any communication.
    TypeError
        If ``dims`` or ``comm`` has the wrong type.
    """

    def __init__(
        self,
        dims: int | Sequence[int],
        comm: MPI.Intracomm | None = None,
        periods: Sequence[bool] | None = None,
    ) -> None:
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py Intracomm, got {type(comm).__name__}")
        dup = _created(comm, "Comm_dup", comm.Dup)
        dup.Set_name("hpctp.grid.setup")
        try:
            self.dims, self.periods = _agreed_shape(dup, dims, periods)
            self.comm: MPI.Cartcomm = _created(
                dup, "Cart_create", lambda: dup.Create_cart(list(self.dims), periods=list(self.periods), reorder=False)
            )
        finally:
            dup.Free()
        self.ndim: int = len(self.dims)
        self.comm.Set_name("hpctp.grid")
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self.coords: tuple[int, ...] = tuple(self.comm.Get_coords(self.rank))
        if self.coords != grid_coords(self.rank, self.dims):  # MPI guarantees row-major order
            raise RuntimeError("MPI Cartesian ranks are not row-major; hpctp cannot use this MPI")
        self._subs: dict[int, MPI.Cartcomm] = {}
        self._axes_comms: dict[tuple[int, ...], MPI.Intracomm] = {}
        for axis in range(self.ndim):
            remain = [a == axis for a in range(self.ndim)]
            sub = _created(self.comm, "Cart_sub", lambda: self.comm.Sub(remain))  # noqa: B023 - called at once
            sub.Set_name(f"hpctp.grid.axis{axis}")
            self._subs[axis] = sub
        T.grid_built(self)  # the first grid arms HPCTP_CHECK and starts the watchdog (hpctp.debug)

    @classmethod
    def virtual(cls, dims: Sequence[int], rank: int = 0, periods: Sequence[bool] | None = None) -> ProcessGrid:
        """Local. A grid of ``prod(dims)`` virtual ranks, of which this process plays ``rank``.

        Nothing runs on the other ranks: the grid's communicators are :class:`~hpctp.comm.virtual.VirtualComm`
        objects, on which every call of :mod:`hpctp.comm` returns at once without moving data and is
        counted as on MPI (:class:`~hpctp.comm.CommCounter`, :class:`~hpctp.comm.CallLog`). Run a layer or
        a training step on it, on ``meta`` tensors, to see what rank ``rank`` of that grid sends and holds,
        for any number of ranks (:mod:`hpctp.comm.virtual`).

        Parameters
        ----------
        dims : sequence of int
            Grid shape, every entry ``>= 1``.
        rank : int
            The rank this process plays (row-major over ``dims``).
        periods : sequence of bool, optional
            Periodicity per axis.

        Returns
        -------
        ProcessGrid

        Raises
        ------
        ValueError
            If a dim is not a positive int or ``rank`` is not a rank of the grid.
        """
        try:
            shape = [int(d) for d in dims]
        except (TypeError, ValueError):
            raise ValueError(f"dims={dims!r}: a virtual grid needs a sequence of positive ints") from None
        if not shape or any(d < 1 for d in shape):
            raise ValueError(f"dims={tuple(shape)}: a virtual grid needs every dim >= 1 (nothing for MPI to choose)")
        return cls(shape, comm=virtual_world(math.prod(shape), rank), periods=periods)

    @property
    def is_virtual(self) -> bool:
        """Local. True for a grid of :meth:`virtual` ranks."""
        return is_virtual(self.comm)

    # ------------------------------------------------------------------ local queries
    def sub(self, axis: int) -> MPI.Cartcomm:
        """Local. The communicator of the ranks that differ from this one only along ``axis``.

        Its rank equals this process's coordinate along ``axis``.

        Raises
        ------
        ValueError
            If ``axis`` is not a grid axis.
        """
        self._check_axis(axis)
        return self._subs[axis]

    def axes_comm(self, axes: Sequence[int]) -> MPI.Intracomm:
        """Collective over grid on the first call for a set of axes, local after (cached).

        The communicator of the ranks that differ from this one only along ``axes``; its
        ranks are row-major over those axes' coordinates. Every rank must make the first
        call for the same ``axes`` in the same order.

        Parameters
        ----------
        axes : sequence of int
            Distinct grid axes, in any order (the communicator's order is the grid's).

        Returns
        -------
        mpi4py.MPI.Intracomm
            A Cartesian communicator; a single-rank one (not Cartesian) for ``axes == ()``.

        Raises
        ------
        ValueError
            If an axis is not a grid axis or repeats.
        """
        key = self._axes_key(axes)
        if len(key) == self.ndim:
            return self.comm
        if len(key) == 1:
            return self._subs[key[0]]
        cached = self._axes_comms.get(key)
        if cached is not None:
            return cached
        made: MPI.Intracomm
        if key or is_virtual(self.comm):
            made = _created(self.comm, "Cart_sub", lambda: self.comm.Sub([a in key for a in range(self.ndim)]))
        else:  # (some MPICH versions give COMM_NULL for a Cart_sub that keeps no dims)
            made = _created(self.comm, "Comm_split", lambda: self.comm.Split(self.rank, 0))  # type: ignore[assignment]
        made.Set_name(f"hpctp.grid.axes{''.join(map(str, key))}")
        self._axes_comms[key] = made
        return made

    def subgrid(self, axes: Sequence[int]) -> ProcessGrid:
        """Collective over grid. The grid of the ranks that differ from this one only along ``axes``.

        Its dims are ``[dims[a] for a in sorted(axes)]`` (``(1,)`` for no axes) and its
        ranks are row-major over those coordinates; it works on its own duplicate, as every
        ProcessGrid, so free it with :meth:`free`.

        Parameters
        ----------
        axes : sequence of int
            Distinct grid axes.

        Returns
        -------
        ProcessGrid

        Raises
        ------
        ValueError
            If an axis is not a grid axis or repeats.
        """
        key = self._axes_key(axes)
        dims = [self.dims[a] for a in key] or [1]
        return ProcessGrid(dims, comm=self.axes_comm(key))

    def _axes_key(self, axes: Sequence[int]) -> tuple[int, ...]:
        for a in axes:
            self._check_axis(a)
        key = tuple(sorted(int(a) for a in axes))
        if len(set(key)) != len(key):
            raise ValueError(f"axes {tuple(axes)} repeat an axis; name each grid axis once")
        return key

    def shift(self, axis: int, disp: int = 1) -> tuple[int, int]:
        """Local. ``(source, dest)`` ranks for a shift by ``disp`` along ``axis``.

        ``MPI.PROC_NULL`` marks a missing neighbour on a non-periodic axis.
        """
        self._check_axis(axis)
        src, dst = self.comm.Shift(axis, int(disp))
        return int(src), int(dst)

    def coords_of(self, rank: int) -> tuple[int, ...]:
        """Local. Grid coordinates of ``rank``."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a grid of {self.size} ranks")
        return grid_coords(rank, self.dims)

    def rank_of(self, coords: Sequence[int]) -> int:
        """Local. Rank at grid ``coords``."""
        if len(coords) != self.ndim or any(not 0 <= c < d for c, d in zip(coords, self.dims)):
            raise ValueError(f"coords {tuple(coords)} are not on a grid of dims {self.dims}")
        return int(self.comm.Get_cart_rank(list(coords)))

    def same_ranks(self, other: ProcessGrid) -> bool:
        """Local. True if ``other`` holds the same processes with the same ranks as this grid
        (``MPI.Comm.Compare`` is identical or congruent), whatever the two grids' shapes: a
        tensor can then move from one to the other (:meth:`hpctp.DistTensor.redistribute`)."""
        if is_virtual(self.comm) or is_virtual(other.comm):
            a, b = self.comm, other.comm
            return isinstance(a, VirtualComm) and isinstance(b, VirtualComm) and a.members == b.members
        if self.comm == MPI.COMM_NULL or other.comm == MPI.COMM_NULL:
            return False
        return MPI.Comm.Compare(self.comm, other.comm) in (MPI.IDENT, MPI.CONGRUENT)

    def _check_axis(self, axis: int) -> None:
        if not is_int(axis) or not 0 <= axis < self.ndim:
            raise ValueError(f"axis={axis!r} is not an axis of a {self.ndim}-D grid (0..{self.ndim - 1})")

    # ------------------------------------------------------------------ lifetime
    def free(self) -> None:
        """Collective over grid. Release the grid's communicators."""
        for sub in [*self._subs.values(), *self._axes_comms.values()]:
            if sub != MPI.COMM_NULL:
                sub.Free()
        self._subs.clear()
        self._axes_comms.clear()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def __enter__(self) -> ProcessGrid:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        return f"ProcessGrid(dims={self.dims}, rank={self.rank}, coords={self.coords})"


def check_grid(grid: object) -> ProcessGrid:
    """Local. Return ``grid`` if it is a :class:`ProcessGrid`, else raise TypeError.

    Raises
    ------
    TypeError
        Naming the type that was passed instead.
    """
    if not isinstance(grid, ProcessGrid):
        raise TypeError(f"grid must be a hpctp.ProcessGrid, got {type(grid).__name__}")
    return grid
