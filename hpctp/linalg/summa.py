"""SUMMA on local blocks: pipelined panel broadcasts (and reductions) with local GEMMs.

Block-level: functions of ``(local blocks, grid, layouts)`` returning a block and its
layout, like :mod:`hpctp.ops`. The variant and panels come from :mod:`hpctp.linalg.plan`.

Pipelining: the broadcasts of panel ``p + 1`` are posted (``hpctp.comm.ibcast``) before
panel ``p`` is waited for and multiplied, into the other of two buffers (double
buffering); in the stationary-A/B variants the reduction of panel ``p`` stays in flight
while panel ``p + 1`` is computed (two reduction buffers). Whether transfers progress
*during* a GEMM depends on the MPI library (MPICH: ``MPIR_CVAR_ASYNC_PROGRESS=1``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import comm as C
from .._util.backend import Array, backend_name, copy_into, is_torch, native_order
from ..comm import Pending, ProcessGrid
from ..comm.summa_calls import ireduce
from ..layout import Layout
from ..machine import runtime_cost_machine
from .cost import recommend_panel_for
from .local import Workspace, gemm, gemm_dtype_error, is_contiguous, zeros_like_backend
from .plan import MatmulPlan, check_panel, plan_matmul

__all__ = ["auto_panel", "summa_block", "run_plan"]


def auto_panel(a: Layout, b: Layout, transpose_a: bool, transpose_b: bool, block: Array) -> int:
    """Local. The panel width of ``panel="auto"`` for blocks like ``block`` in layouts ``a``, ``b`` (layouts
    :func:`~hpctp.linalg.plan.plan_matmul` accepts): :func:`hpctp.linalg.cost.recommend_panel_for` priced on
    :func:`hpctp.machine.runtime_cost_machine` of both grid axes and the blocks' element type, the machine the planner
    prices with. A function of arguments every rank shares, so the same width on every rank."""
    machine = runtime_cost_machine(a.grid_dims, range(len(a.grid_dims)), block.dtype)
    itemsize = int(block.itemsize)
    return recommend_panel_for(a, b, machine, itemsize=itemsize, transpose_a=transpose_a, transpose_b=transpose_b)


class _Op:
    """A stored local block seen as ``op(X)`` (its transpose when ``t``), without copying."""

    def __init__(self, local: Array, t: bool) -> None:
        self.local = local
        self.t = t

    @property
    def shape(self) -> tuple[int, int]:
        r, c = tuple(self.local.shape)
        return (c, r) if self.t else (r, c)

    def logical(self, stored: Array) -> Array:
        return stored.T if self.t else stored

    def stored_rows(self, lo: int, hi: int) -> Array:
        """Stored view of logical rows ``[lo, hi)``."""
        return self.local[:, lo:hi] if self.t else self.local[lo:hi]

    def stored_cols(self, lo: int, hi: int) -> Array:
        """Stored view of logical columns ``[lo, hi)``."""
        return self.local[lo:hi] if self.t else self.local[:, lo:hi]

    def stored_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """Stored shape of a logical ``(rows, cols)`` panel."""
        return (cols, rows) if self.t else (rows, cols)


@dataclass
class _Panel:
    ops: list[Array]
    pending: list[Pending] = field(default_factory=list)


def _bcast_piece(
    comm: Any, op: _Op, ws: Workspace, slot: int, mine: bool, root: int,
    stored_view: Any, shape: tuple[int, int], panel: _Panel,
) -> None:  # fmt: skip
    """Root: send the stored piece (staged if strided); others: receive into the slot."""
    size = shape[0] * shape[1]
    if mine:
        stored = stored_view()
        if comm.Get_size() > 1 and size:
            stored = ws.staged(slot, stored)
            panel.pending.append(C.ibcast(comm, stored, root))
    else:
        stored = ws.view(slot, op.stored_shape(*shape))
        if size:
            panel.pending.append(C.ibcast(comm, stored, root))
    panel.ops.append(op.logical(stored))


def _stationary_c(plan: MatmulPlan, grid: ProcessGrid, a: _Op, b: _Op, c: Array) -> None:
    comm_a, comm_b = grid.sub(plan.axis_x), grid.sub(plan.axis_y)
    my_a, my_b = grid.coords[plan.axis_x], grid.coords[plan.axis_y]
    m_loc, n_loc = tuple(c.shape)
    wmax = max((e - s for s, e, _, _ in plan.pieces), default=1)
    ws_a = Workspace(2, m_loc * wmax, c.dtype, c)
    ws_b = Workspace(2, wmax * n_loc, c.dtype, c)

    def post(p: int) -> _Panel:
        s, e, ra, rb = plan.pieces[p]
        oa, ob = s - plan.cuts_x[ra], s - plan.cuts_y[rb]
        w, slot, panel = e - s, p % 2, _Panel([])
        _bcast_piece(comm_a, a, ws_a, slot, my_a == ra, ra, lambda: a.stored_cols(oa, oa + w), (m_loc, w), panel)
        _bcast_piece(comm_b, b, ws_b, slot, my_b == rb, rb, lambda: b.stored_rows(ob, ob + w), (w, n_loc), panel)
        return panel

    npieces = len(plan.pieces)
    cur = post(0) if npieces else None
    for p in range(npieces):
        nxt = post(p + 1) if p + 1 < npieces else None
        C.waitall(cur.pending)  # type: ignore[union-attr]
        gemm(c, cur.ops[0], cur.ops[1], accumulate=True)  # type: ignore[union-attr]
        cur = nxt


def _walk_rows(plan: MatmulPlan, grid: ProcessGrid, a: _Op, b: _Op, c: Array) -> None:
    """C rows by panels: broadcast op(A)'s row panel along axis_x, reduce partial C rows along axis_y.

    ``c`` is the logical C view (the transpose of the stored block for stationary-A).
    """
    comm_a, comm_c = grid.sub(plan.axis_x), grid.sub(plan.axis_y)
    my_a, my_c = grid.coords[plan.axis_x], grid.coords[plan.axis_y]
    k_loc, n_loc = b.shape
    bl = b.logical(b.local)
    wmax = max((e - s for s, e, _, _ in plan.pieces), default=1)
    ws_a = Workspace(2, wmax * k_loc, c.dtype, c)
    ws_c = Workspace(2, wmax * n_loc, c.dtype, c)
    in_flight: list[tuple[Pending | None, Array, Array | None] | None] = [None, None]

    def post(p: int) -> _Panel:
        s, e, ra, _ = plan.pieces[p]
        oa, w, panel = s - plan.cuts_x[ra], e - s, _Panel([])
        _bcast_piece(comm_a, a, ws_a, p % 2, my_a == ra, ra, lambda: a.stored_rows(oa, oa + w), (w, k_loc), panel)
        return panel

    def finish(slot: int) -> None:
        item = in_flight[slot]
        if item is not None:
            pending, buf, target = item
            if pending is not None:
                pending.wait()
            if target is not None:
                copy_into(target, buf)
            in_flight[slot] = None

    npieces = len(plan.pieces)
    cur = post(0) if npieces else None
    for p in range(npieces):
        nxt = post(p + 1) if p + 1 < npieces else None
        C.waitall(cur.pending)  # type: ignore[union-attr]
        slot = p % 2
        finish(slot)
        s, e, _, rc = plan.pieces[p]
        oc, w = s - plan.cuts_y[rc], e - s
        target = c[oc : oc + w] if my_c == rc else None
        buf = target if target is not None and is_contiguous(target) else ws_c.view(slot, (w, n_loc))
        gemm(buf, cur.ops[0], bl, accumulate=False)  # type: ignore[union-attr]
        pending = ireduce(comm_c, buf, rc) if comm_c.Get_size() > 1 and w * n_loc else None
        in_flight[slot] = (pending, buf, target if buf is not target else None)
        cur = nxt
    finish(0)
    finish(1)


@contextlib.contextmanager
def _no_autograd(x: Array) -> Iterator[None]:
    if is_torch(x):
        import torch

        with torch.no_grad():
            yield
    else:
        yield


def run_plan(plan: MatmulPlan, a: Array, b: Array, grid: ProcessGrid, transpose_a: bool, transpose_b: bool) -> Array:
    """Collective over grid. Execute a :class:`~hpctp.linalg.plan.MatmulPlan` on local blocks.

    Parameters
    ----------
    plan : MatmulPlan
        From :func:`~hpctp.linalg.plan.plan_matmul` for these blocks' layouts.
    a, b : array
        This rank's blocks of the stored A and B (same backend, device and dtype).
    grid : ProcessGrid
    transpose_a, transpose_b : bool
        As given to the plan.

    Returns
    -------
    array
        This rank's block of C in ``plan.c_layout`` (not differentiable: torch blocks are
        computed without autograd).
    """
    shape = plan.c_layout.local_shape(grid.coords)
    out = zeros_like_backend(shape, a.dtype, a)
    with _no_autograd(a):
        opa, opb = _Op(a, transpose_a), _Op(b, transpose_b)
        if plan.variant == "stationary_c":
            _stationary_c(plan, grid, opa, opb, out)
        elif plan.variant == "stationary_b":
            _walk_rows(plan, grid, opa, opb, out)
        else:  # stationary_a: C.T = op(B).T @ op(A).T walks the rows of C.T
            _walk_rows(plan, grid, _Op(b, not transpose_b), _Op(a, not transpose_a), out.T)
    return out


def summa_block(
    a: Array,
    b: Array,
    grid: ProcessGrid,
    a_layout: Layout,
    b_layout: Layout,
    *,
    transpose_a: bool = False,
    transpose_b: bool = False,
    panel: int | str | None = None,
) -> tuple[Array, Layout]:
    """Collective over grid. ``op(A) @ op(B)`` of blocks in layouts some SUMMA variant accepts.

    Parameters
    ----------
    a, b : array
        This rank's blocks (numpy, torch CPU/CUDA or cupy; same backend and dtype).
    grid : ProcessGrid
        A 2-D grid of dims ``a_layout.grid_dims``.
    a_layout, b_layout : Layout
        Layouts of the stored matrices, each split over both grid axes (see
        :func:`hpctp.linalg.plan.required_layouts` for moving other layouts first).
    transpose_a, transpose_b : bool
        Multiply by ``A.T`` / ``B.T`` (the stored blocks are used as transposed views).
    panel : int or "auto", optional
        Panel width (default from the block sizes, :func:`hpctp.linalg.plan.default_panel`; ``"auto"``:
        :func:`auto_panel`, the width of least predicted time on the runtime's machine).

    Returns
    -------
    tuple
        ``(c_local, c_layout)``: this rank's block of C and C's layout (split ``(0, 1)``).

    Raises
    ------
    ValueError
        If no variant fits the layouts, sizes differ, or a block's shape does not match
        its layout on any rank (raised on every rank).
    TypeError
        If the blocks have different backends or dtypes, or a dtype with no product
        (bool; torch uint16/32/64, integers on a GPU), on any rank (raised on every rank).
    """
    error: Exception | None = None
    try:
        if backend_name(a) != backend_name(b) or a.dtype != b.dtype:
            raise TypeError(f"A and B blocks must share backend and dtype, got {backend_name(a)} {a.dtype} and "
                            f"{backend_name(b)} {b.dtype}")  # fmt: skip
        error = gemm_dtype_error(a)
        for name, x, lay in (("A", a, a_layout), ("B", b, b_layout)):
            lay.check_block(x.shape, grid.dims, grid.coords, f"rank {grid.rank}: {name} block")
    except (TypeError, ValueError) as e:
        error = e
    C.raise_if_any(grid.comm, error)  # a bad block on one rank raises on every rank, none waits
    a, b = native_order(a), native_order(b)
    auto = isinstance(panel, str) and panel == "auto"
    width = auto_panel(a_layout, b_layout, transpose_a, transpose_b, a) if auto else check_panel(panel)
    plan = plan_matmul(a_layout, b_layout, transpose_a, transpose_b, width)
    return run_plan(plan, a, b, grid, transpose_a, transpose_b), plan.c_layout
