"""Halo (ghost cell) exchange of block-distributed N-D fields, modelled on PETSc's DMDA."""

from __future__ import annotations

from typing import Any

from .. import comm as C
from .._util.backend import Array, backend_name, is_device
from ..comm import ProcessGrid
from ..layout import Layout
from ..tensor.core import DistTensor
from .plan import FetchPlan, fetch_plan, halo_wants, normalize_boundary, normalize_widths
from .run import FetchHandle, adjoint_fetch, begin_fetch

__all__ = ["HaloExchange"]


class HaloExchange:
    """Local. A planned halo exchange for one layout (construction does no communication).

    Each rank's block is widened by ``width`` ghost cells per side along each dim, filled
    with the neighbours' data (faces, edges and corners for ``stencil="box"``) or with the
    boundary condition outside the global index range. Widths may exceed the neighbours'
    block sizes: the data then comes directly from every rank that owns part of the halo
    (one message per peer), also with uneven and empty blocks. Plans are cached.

    Parameters
    ----------
    layout_or_tensor : Layout or DistTensor
        What is exchanged; a Layout needs ``grid``.
    width : int or sequence
        An int ``w``: ``w`` ghost cells on both sides of every split dim. A sequence: one
        entry per dim, an int or a ``(lo, hi)`` pair (unsplit dims may have halos too; they
        hold the boundary condition).
    boundary : {"zero", "periodic", "reflect", "replicate"} or sequence of them
        Values outside ``[0, n)``: zeros (``fill``), wrap-around, mirror without repeating
        the edge (``numpy.pad(mode="reflect")``) or repeat the edge. Per dim or one for all.
    grid : ProcessGrid, optional
        Required with a Layout; taken from a DistTensor otherwise.
    stencil : {"box", "star"}
        ``"star"`` skips edges and corners (pieces that are halo in two or more dims);
        they are set to ``fill``.
    fill : float
        Value of zero-boundary and skipped cells.

    Attributes
    ----------
    layout, grid, widths, boundary, plan
    padded_shape : tuple of int
        Shape of the exchanged local array.
    interior : tuple of slice
        Where this rank's own block sits inside the padded array.

    Raises
    ------
    ValueError
        On bad widths, boundary or stencil, or a layout on another grid shape.
    TypeError
        On a ``layout_or_tensor`` that is neither a Layout nor a DistTensor.

    Notes
    -----
    Peers are Cartesian neighbours: the ``grid.shift`` ranks for faces, plus diagonal
    (edges, corners) and farther ranks when a width spans several blocks. ``boundary``
    alone decides periodicity (the grid's ``periods`` are not consulted). Each exchange
    sends one message per peer with exactly the ghost cells it needs (counted by
    :class:`hpctp.CommCounter` as ``Isend``/``Irecv``); nothing is gathered.

    Examples
    --------
    >>> import numpy as np, hpctp
    >>> grid = hpctp.ProcessGrid([0])
    >>> t = hpctp.distribute(np.arange(12.0) if grid.rank == 0 else None, grid, (0,))
    >>> h = HaloExchange(t, 1, boundary="periodic")
    >>> req = h.begin(t.local)
    >>> interior = 2 * t.local  # work on this rank's block while the halos travel
    >>> padded = h.end(req)
    >>> padded.shape == (t.local.shape[0] + 2,), bool((padded[h.interior] == t.local).all())
    (True, True)
    >>> grid.free()
    """

    def __init__(
        self,
        layout_or_tensor: Layout | DistTensor,
        width: object,
        boundary: object = "zero",
        *,
        grid: ProcessGrid | None = None,
        stencil: str = "box",
        fill: float = 0.0,
    ) -> None:
        if isinstance(layout_or_tensor, DistTensor):
            layout, grid = layout_or_tensor.layout, layout_or_tensor.grid
        elif isinstance(layout_or_tensor, Layout):
            layout = layout_or_tensor
            if not isinstance(grid, ProcessGrid):
                raise ValueError("HaloExchange(layout, ...) needs grid=ProcessGrid")
        else:
            raise TypeError(f"layout_or_tensor must be a Layout or DistTensor, got {type(layout_or_tensor).__name__}")
        error: Exception | None = None
        try:  # checked once here, collectively: a bad or different argument on one rank raises everywhere
            if layout.grid_dims != grid.dims:
                raise ValueError(f"layout is for grid dims {layout.grid_dims}, the grid has dims {grid.dims}")
            self.widths = normalize_widths(width, layout.split)
            self.boundary = normalize_boundary(boundary, layout.ndim)
            self.fill = float(fill)
            plan = fetch_plan(layout, grid.rank, halo_wants(layout, self.widths), self.boundary, stencil)
        except (TypeError, ValueError) as e:
            error = e
        C.agree_arguments(
            grid.comm, "HaloExchange", error, layout=layout, width=width, boundary=boundary, stencil=stencil, fill=fill
        )
        self.layout: Layout = layout
        self.grid: ProcessGrid = grid
        self.plan: FetchPlan = plan
        self.local_shape: tuple[int, ...] = layout.local_shape(grid.coords)
        self.padded_shape: tuple[int, ...] = self.plan.shape
        self.interior: tuple[slice, ...] = tuple(slice(lo, lo + n) for (lo, _), n in zip(self.widths, self.local_shape))

    def _check(self, block: Array, out: Array | None) -> None:
        backend_name(block)
        if tuple(block.shape) != self.local_shape:
            raise ValueError(
                f"rank {self.grid.rank}: block has shape {tuple(block.shape)}, the layout expects {self.local_shape}"
            )
        if out is not None and tuple(out.shape) != self.padded_shape:
            raise ValueError(f"rank {self.grid.rank}: out has shape {tuple(out.shape)}, expected {self.padded_shape}")
        if out is not None and (backend_name(out), is_device(out)) != (backend_name(block), is_device(block)):
            raise TypeError(
                f"rank {self.grid.rank}: out is a {backend_name(out)} array and block a {backend_name(block)} one "
                f"(or one is on a GPU); pass out on the block's backend and device, or no out"
            )

    def begin(self, block: Array, out: Array | None = None) -> FetchHandle:
        """Collective over grid. Start the exchange (non-blocking sends and receives).

        The own block and the boundary condition are written to ``out`` before returning,
        so work that needs no halo can run before :meth:`end`. The data sent is packed
        before returning, so ``block`` may be modified right away; ``out`` must not be
        read in its ghost cells until :meth:`end`.

        Parameters
        ----------
        block : array
            This rank's block (numpy, torch or cupy; shape checked locally).
        out : array, optional
            Destination of shape :attr:`padded_shape`, same backend (allocated if None).

        Returns
        -------
        FetchHandle
            Pass it to :meth:`end`.
        """
        self._check(block, out)
        return begin_fetch(self.plan, self.grid.comm, block, out, self.fill)

    def end(self, handle: FetchHandle) -> Array:
        """Collective over grid. Finish an exchange; returns the padded array."""
        return handle.wait()

    def exchange(self, block: Array, out: Array | None = None) -> Array:
        """Collective over grid. :meth:`begin` then :meth:`end`.

        Returns
        -------
        array
            The block padded with its halo, shape :attr:`padded_shape`.
        """
        return self.end(self.begin(block, out))

    def adjoint(self, padded: Any, out: Array | None = None) -> Array:
        """Collective over grid. The transpose of :meth:`exchange` (ghost contributions summed).

        Each ghost cell's value is sent back to the block element it was copied from and
        added there (PETSc's local-to-global with ``ADD_VALUES``); zero-boundary cells are
        dropped.

        Parameters
        ----------
        padded : array
            Shape :attr:`padded_shape`.
        out : array, optional
            Block-shaped array to add into (zeros if None).

        Returns
        -------
        array
            Shape of this rank's block.
        """
        if tuple(padded.shape) != self.padded_shape:
            raise ValueError(
                f"rank {self.grid.rank}: padded has shape {tuple(padded.shape)}, expected {self.padded_shape}"
            )
        return adjoint_fetch(self.plan, self.grid.comm, padded, out)

    def __repr__(self) -> str:
        return (
            f"HaloExchange({self.layout}, widths={self.widths}, boundary={self.boundary}, "
            f"sends={self.plan.send_elements}, recvs={self.plan.recv_elements} elements)"
        )
