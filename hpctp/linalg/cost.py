"""Alpha-beta-gamma cost model of SUMMA and of attention: bytes, flops and time; grid, panel and schedule advice.

Pure functions (no MPI). A message of ``b`` bytes costs ``alpha + beta * b`` seconds, a
flop ``gamma`` seconds; a local GEMM whose panel width is ``w`` runs at the fraction
``w / (w + gemm_half)`` of the peak rate (small panels are inefficient).

Byte counts follow :class:`hpctp.CommCounter` exactly (they are computed from the same
:mod:`hpctp.linalg.plan` the implementation runs): a broadcast of ``b`` bytes over ``q``
ranks adds ``b`` to each receiver and ``b * (q - 1)`` to the root; a reduction the
reverse. For ``A @ B`` with both split ``(0, 1)`` (stationary C) a rank at grid coords
``(i, j)`` receives ``m_i * (k - kA_j)`` words of A and ``(k - kB_i) * n_j`` words of B,
where ``kA_j`` / ``kB_i`` are its own k extents in A and B (:func:`stationary_c_words`).

Time of the pipelined algorithm (per panel ``p``: communication ``c_p``, GEMM ``g_p``,
reduction ``r_p``) on the busiest rank::

    T = c_0 + sum_p max(g_p, c_{p+1} + r_{p-1}) + r_last (+ redistribution, if any)

2.5D (:func:`hpctp.linalg.matmul_25d`, ``grid_dims = (pr, pc, layers)``): each layer
walks every ``layers``-th panel on its own ``pr x pc`` grid, then C is all-reduced over
the layers (counted as ``m_i n_j`` words sent and received by every rank). Grid advice
(:func:`recommend_grid`) covers 2-D grids.

Broadcast over ``q`` ranks: ``min(tree, scatter + allgather)`` with
``tree = ceil(log2 q) (alpha + beta b)`` and
``long = (ceil(log2 q) + q - 1) alpha + 2 (q - 1) / q * beta b``; reductions add
``gamma`` per element combined.

Attention (:func:`predict_attention`, :func:`choose_schedule`): the two schedules of
:func:`hpctp.nn.functional.attention` priced on the same machine model, from the layouts
alone, so every rank picks the same schedule for ``schedule="auto"``.

:class:`Machine` is :mod:`hpctp.machine`'s (re-exported here). The runtime's automatic choices
(``schedule="auto"``, ``hpctp.matmul(..., panel="auto")``: :func:`recommend_panel_for`) price on
:func:`hpctp.machine.runtime_cost_machine`, the machine the planner prices on (:func:`hpctp.machine.default_machine`).

Cost model of the two attention schedules (ring, all-to-all): bytes, flops and time; the choice.

Pure functions of the layouts (no MPI), so every rank predicts the same and picks the same
schedule. The model is the alpha-beta-gamma one of :class:`hpctp.linalg.cost.Machine`: a
message of ``b`` bytes costs ``alpha + beta * b`` seconds, a flop ``gamma``. Figures are those of
the busiest rank, forward plus (with ``backward``) backward.

* **ring** (:func:`hpctp.nn.transformer.context_parallel.attention`, ``schedule="ring"``): over a token
  sub-grid of ``P`` ranks holding ``n_m`` keys each (``T = sum n_m``), a rank sends every block
  but its successor's in the forward pass, ``(T - n_succ) * bh * (D + Dv) * itemsize`` bytes in
  ``P - 1`` messages (``bh``: its batch x heads), and in the backward pass the blocks again plus
  every block's ``dK/dV`` once (``P`` more messages). The transfers overlap the block
  attention, so the time is ``max(comm, compute)``. With contiguous blocks the last rank of a
  causal ring sees every key, so causality saves the busiest rank nothing.
* **all-to-all** (``schedule="all_to_all"``, Ulysses): q, k, v move from token-split to
  batch/heads-split (:func:`hpctp.layout.ring.all_to_all_split`), each rank attends over whole
  token sets, the output moves back (and the gradients, in backward); a move over ``P`` ranks
  sends about ``(P - 1) / P`` of a block in ``P - 1`` messages. No overlap: the time is
  ``comm + compute``; causality halves the compute; fewer heads than ranks leave ranks idle.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from .._util.ints import is_int
from ..layout import Layout, block_cuts, grid_coords, redistribution_plan
from ..layout.ring import all_to_all_split, token_dims
from ..machine.model import Machine
from .plan import MatmulPlan, default_panel, logical_axes, plan_25d, plan_matmul, required_layouts

__all__ = [
    "SCHEDULES",
    "AttentionCost",
    "choose_schedule",
    "predict_attention",
    "Machine",
    "MatmulCost",
    "bcast_time",
    "reduce_time",
    "stationary_c_words",
    "matmul_traffic",
    "matmul_flops",
    "predict_matmul",
    "recommend_panel",
    "recommend_panel_for",
    "recommend_grid",
]


@dataclass(frozen=True)
class MatmulCost:
    """Local. Predicted cost of one distributed matmul.

    Attributes
    ----------
    variant : str
        SUMMA variant (see :mod:`hpctp.linalg.plan`).
    grid_dims : tuple of int
    panel, n_panels : int
        Panel width and number of panels.
    bytes_sent, bytes_recv : tuple of int
        Per grid rank (row-major), what :class:`hpctp.CommCounter` reports, including an
        input redistribution if one is needed.
    flops : tuple of int
        Per grid rank, GEMM flops (``2 m k n`` in total).
    redistribute_time, comm_time, compute_time : float
        Seconds of the busiest rank, not overlapped.
    time : float
        Predicted wall time with the pipeline overlapping communication and GEMMs.
    """

    variant: str
    grid_dims: tuple[int, ...]
    panel: int
    n_panels: int
    bytes_sent: tuple[int, ...]
    bytes_recv: tuple[int, ...]
    flops: tuple[int, ...]
    redistribute_time: float
    comm_time: float
    compute_time: float
    time: float

    @property
    def gflops(self) -> float:
        """Predicted aggregate rate in GFLOP/s."""
        return sum(self.flops) / self.time / 1e9 if self.time > 0 else math.inf


def bcast_time(nbytes: float, q: int, machine: Machine) -> float:
    """Local. Seconds to broadcast ``nbytes`` over ``q`` ranks (0 for ``q == 1`` or no data)."""
    if q <= 1 or nbytes <= 0:
        return 0.0
    steps = math.ceil(math.log2(q))
    tree = steps * (machine.alpha + machine.beta * nbytes)
    long = (steps + q - 1) * machine.alpha + 2.0 * (q - 1) / q * machine.beta * nbytes
    return min(tree, long)


def reduce_time(nbytes: float, q: int, machine: Machine, itemsize: int = 8) -> float:
    """Local. Seconds to sum-reduce ``nbytes`` over ``q`` ranks onto one (broadcast cost plus additions)."""
    if q <= 1 or nbytes <= 0:
        return 0.0
    adds = math.ceil(math.log2(q)) * nbytes / itemsize
    return bcast_time(nbytes, q, machine) + machine.gamma * adds


def _check_sizes(m: int, k: int, n: int, grid_dims: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    for name, v in (("m", m), ("k", k), ("n", n)):
        if not is_int(v) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    bad = isinstance(grid_dims, (str, bytes))
    try:
        dims = tuple(grid_dims) if not bad else ()
    except TypeError:
        bad = True
    if bad or len(dims) not in (2, 3) or not all(is_int(d) and d >= 1 for d in dims):
        raise ValueError(f"grid_dims must be 2 (or 3, for 2.5D) positive ints, got {grid_dims!r}")
    dims = tuple(int(d) for d in dims)
    if not is_int(itemsize) or itemsize < 1:
        raise ValueError(f"itemsize must be a positive int, got {itemsize!r}")
    return dims


def stationary_c_words(m: int, k: int, n: int, grid_dims: tuple[int, int], coords: tuple[int, int]) -> tuple[int, int]:
    """Local. Closed form: words ``(sent, received)`` by the rank at ``coords`` for ``A @ B``, all split ``(0, 1)``.

    A panels go along grid rows, B panels along grid columns, each broadcast once:
    received ``m_i (k - kA_j) + (k - kB_i) n_j``, sent ``m_i kA_j (pc - 1) + kB_i n_j (pr - 1)``.

    Returns
    -------
    tuple of int
        Words (multiply by the item size for bytes).
    """
    dims = _check_sizes(m, k, n, grid_dims, 1)
    if len(dims) != 2:
        raise ValueError(f"stationary_c_words is for 2-D grids, got {grid_dims!r}")
    pr, pc = dims
    if len(coords) != 2 or not all(is_int(c) and 0 <= c < p for c, p in zip(coords, dims)):
        raise ValueError(f"coords={coords!r} must be 2 ints in the grid {dims}")
    i, j = (int(c) for c in coords)
    mi = _extent(block_cuts(m, pr), i)
    nj = _extent(block_cuts(n, pc), j)
    ka = _extent(block_cuts(k, pc), j)
    kb = _extent(block_cuts(k, pr), i)
    recv = (mi * (k - ka) if pc > 1 else 0) + ((k - kb) * nj if pr > 1 else 0)
    sent = mi * ka * (pc - 1) + kb * nj * (pr - 1)
    return sent, recv


def _extent(cuts: tuple[int, ...], i: int) -> int:
    return cuts[i + 1] - cuts[i]


@dataclass(frozen=True)
class _Sizes:
    """Local extents at one coordinate: C rows (= op(A) rows), the aligned k, C columns."""

    m_loc: int
    k_loc: int
    n_loc: int


@dataclass(frozen=True)
class _Setup:
    """What the implementation would do: the plan of one layer's grid, and the input moves."""

    plan: MatmulPlan
    la: Layout  # inputs as planned, on the 2-D grid of one layer
    lb: Layout
    ta: bool
    tb: bool
    dims: tuple[int, ...]  # the whole grid (pr, pc) or (pr, pc, layers)
    itemsize: int
    move_sent: tuple[int, ...]  # bytes of the input redistribution per rank
    move_recv: tuple[int, ...]

    @property
    def layers(self) -> int:
        return self.dims[2] if len(self.dims) == 3 else 1

    def pieces(self, layer: int) -> tuple[tuple[int, int, int, int], ...]:
        return self.plan.pieces[layer :: self.layers]

    def sizes(self, coords: tuple[int, ...]) -> _Sizes:
        plan = self.plan
        c = plan.c_layout.local_shape(coords[:2])
        if plan.variant == "stationary_c":
            return _Sizes(c[0], 0, c[1])
        _, (ka, kcuts) = logical_axes(self.la, self.ta)  # k of op(A), aligned with op(B)'s
        return _Sizes(c[0], _extent(kcuts, coords[ka]), c[1])


def _redistribution(src: Layout, dst: Layout, itemsize: int) -> tuple[list[int], list[int]]:
    size = src.nranks
    sent, recv = [0] * size, [0] * size
    if src != dst:
        for r in range(size):
            p = redistribution_plan(src, dst, r)
            sent[r] = sum(x.size for x in p.sends) * itemsize
            recv[r] = sum(x.size for x in p.recvs) * itemsize
    return sent, recv


def _flat(layout: Layout) -> Layout:
    return Layout(layout.global_shape, layout.grid_dims[:2], layout.split, layout.cuts)


def _setup(
    m: int, k: int, n: int, grid_dims: tuple[int, ...], itemsize: int, ta: bool, tb: bool, panel: int | None
) -> _Setup:
    dims = _check_sizes(m, k, n, grid_dims, itemsize)
    la0 = Layout((k, m) if ta else (m, k), dims, (0, 1))
    lb0 = Layout((n, k) if tb else (k, n), dims, (0, 1))
    if len(dims) == 2:
        la, lb = required_layouts(la0, lb0, ta, tb)
        plan = plan_matmul(la, lb, ta, tb, panel)
    else:  # 2.5D: op(x) split (0, 1) on every layer, stationary C
        la = la0.with_split((1, 0)) if ta else la0
        lb = lb0.with_split((1, 0)) if tb else lb0
        plan = plan_25d(la, lb, ta, tb, panel)
    sa, ra = _redistribution(la0, la, itemsize)
    sb, rb = _redistribution(lb0, lb, itemsize)
    return _Setup(
        plan, _flat(la), _flat(lb), ta, tb, dims, itemsize,
        tuple(x + y for x, y in zip(sa, sb, strict=True)), tuple(x + y for x, y in zip(ra, rb, strict=True)),
    )  # fmt: skip


def _piece_bytes(plan: MatmulPlan, s: _Sizes, w: int, itemsize: int) -> tuple[int, int]:
    """Bytes of the two per-panel messages: (along axis_x, along axis_y)."""
    if plan.variant == "stationary_c":
        return s.m_loc * w * itemsize, w * s.n_loc * itemsize
    if plan.variant == "stationary_b":
        return w * s.k_loc * itemsize, w * s.n_loc * itemsize
    return w * s.k_loc * itemsize, s.m_loc * w * itemsize  # stationary_a: C.T rows = C columns


def _traffic(st: _Setup) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Bytes sent and received per rank, input moves included (what CommCounter reports)."""
    plan = st.plan
    size = math.prod(st.dims)
    sent, recv = list(st.move_sent), list(st.move_recv)
    qx, qy = st.dims[plan.axis_x], st.dims[plan.axis_y]
    for r in range(size):
        co = grid_coords(r, st.dims)
        s = st.sizes(co)
        for lo, hi, rx, ry in st.pieces(co[2] if st.layers > 1 else 0):
            bx, by = _piece_bytes(plan, s, hi - lo, st.itemsize)
            if qx > 1:  # broadcast along axis_x from rx
                mine = co[plan.axis_x] == rx
                sent[r] += bx * (qx - 1) if mine else 0
                recv[r] += 0 if mine else bx
            if qy > 1:
                mine = co[plan.axis_y] == ry
                if plan.variant == "stationary_c":  # broadcast from ry
                    sent[r] += by * (qy - 1) if mine else 0
                    recv[r] += 0 if mine else by
                else:  # reduction onto ry
                    recv[r] += by * (qy - 1) if mine else 0
                    sent[r] += 0 if mine else by
        if st.layers > 1:  # all-reduce of the partial C blocks over the layers
            c = s.m_loc * s.n_loc * st.itemsize
            sent[r] += c
            recv[r] += c
    return tuple(sent), tuple(recv)


def matmul_traffic(
    m: int, k: int, n: int, grid_dims: tuple[int, ...], *, itemsize: int = 8,
    transpose_a: bool = False, transpose_b: bool = False, panel: int | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:  # fmt: skip
    """Local. Bytes ``(sent, received)`` per grid rank of ``hpctp.matmul`` on balanced ``(0, 1)`` inputs.

    Parameters
    ----------
    m, k, n : int
        ``op(A)`` is ``m x k``, ``op(B)`` is ``k x n``.
    grid_dims : tuple of int
        ``(pr, pc)``, or ``(pr, pc, layers)`` for :func:`hpctp.linalg.matmul_25d` (inputs
        replicated over the layers).
    itemsize : int
        Bytes per element (8 for float64).
    transpose_a, transpose_b : bool
    panel : int, optional
        Does not change the bytes, only the number of messages (except for 2.5D, where it
        decides which layer walks which panel).

    Returns
    -------
    tuple
        Two tuples indexed by grid rank, equal to :class:`hpctp.CommCounter`'s
        ``bytes_sent`` / ``bytes_recv`` around the call (input redistribution included).

    Raises
    ------
    ValueError
        On negative sizes or a bad grid.
    """
    return _traffic(_setup(m, k, n, grid_dims, itemsize, transpose_a, transpose_b, panel))


def matmul_flops(m: int, k: int, n: int, grid_dims: tuple[int, int]) -> tuple[int, ...]:
    """Local. GEMM flops per grid rank (balanced ``(0, 1)`` inputs, no transposes): ``2 m_i k n_j``.

    Raises
    ------
    ValueError
        On negative sizes or a bad grid.
    """
    dims = _check_sizes(m, k, n, grid_dims, 1)
    if len(dims) != 2:
        raise ValueError(f"matmul_flops is for 2-D grids (see predict_matmul for 2.5D), got {grid_dims!r}")
    pr, pc = dims
    mc, nc = block_cuts(m, pr), block_cuts(n, pc)
    return tuple(2 * _extent(mc, i) * k * _extent(nc, j) for i in range(pr) for j in range(pc))


def _flops(st: _Setup, coords: tuple[int, ...]) -> int:
    plan, s = st.plan, st.sizes(coords)
    if plan.variant == "stationary_c":
        k = sum(hi - lo for lo, hi, _, _ in st.pieces(coords[2] if st.layers > 1 else 0))
        return 2 * s.m_loc * k * s.n_loc
    if plan.variant == "stationary_b":
        return 2 * plan.m * s.k_loc * s.n_loc
    return 2 * s.m_loc * s.k_loc * plan.n


def predict_matmul(
    m: int, k: int, n: int, grid_dims: tuple[int, ...], machine: Machine | None = None, *,
    itemsize: int = 8, transpose_a: bool = False, transpose_b: bool = False, panel: int | None = None,
) -> MatmulCost:  # fmt: skip
    """Local. Predicted bytes, flops and time of ``hpctp.matmul`` on balanced ``(0, 1)`` inputs.

    Parameters
    ----------
    m, k, n : int
        ``op(A)`` is ``m x k``, ``op(B)`` is ``k x n``.
    grid_dims : tuple of int
        ``(pr, pc)``, or ``(pr, pc, layers)`` for :func:`hpctp.linalg.matmul_25d`.
    machine : Machine, optional
        Default :class:`Machine()`.
    itemsize : int
        Bytes per element.
    transpose_a, transpose_b : bool
    panel : int, optional
        Panel width (default as the implementation chooses).

    Returns
    -------
    MatmulCost

    Raises
    ------
    ValueError
        On negative sizes, a bad grid or panel.
    """
    machine = machine or Machine()
    st = _setup(m, k, n, grid_dims, itemsize, transpose_a, transpose_b, panel)
    sent, recv = _traffic(st)
    redist, comm, comp, t = _timing(st, machine)
    flops = tuple(_flops(st, grid_coords(r, st.dims)) for r in range(math.prod(st.dims)))
    return MatmulCost(
        st.plan.variant, st.dims, st.plan.panel, len(st.plan.pieces), sent, recv, flops, redist, comm, comp, t
    )


def _timing(st: _Setup, machine: Machine) -> tuple[float, float, float, float]:
    """(redistribution, communication, compute, pipelined total) seconds of the busiest rank."""
    plan, dims = st.plan, st.dims
    nproc = math.prod(dims)
    sizes = [st.sizes(grid_coords(r, dims)) for r in range(nproc)]
    big = _Sizes(max(s.m_loc for s in sizes), max(s.k_loc for s in sizes), max(s.n_loc for s in sizes))
    qx, qy = dims[plan.axis_x], dims[plan.axis_y]
    redist = max(x + y for x, y in zip(st.move_sent, st.move_recv, strict=True)) * machine.beta
    redist += machine.alpha * (nproc - 1) if any(st.move_sent) else 0.0
    comm, red, comp = [], [], []
    for lo, hi, _, _ in st.pieces(0):  # layer 0 walks the most panels
        w = hi - lo
        bx, by = _piece_bytes(plan, big, w, st.itemsize)
        if plan.variant == "stationary_c":
            comm.append(bcast_time(bx, qx, machine) + bcast_time(by, qy, machine))
            red.append(0.0)
            f = 2 * big.m_loc * big.n_loc * w
        else:
            comm.append(bcast_time(bx, qx, machine))
            red.append(reduce_time(by, qy, machine, st.itemsize))
            f = 2 * w * big.k_loc * (big.n_loc if plan.variant == "stationary_b" else big.m_loc)
        comp.append(f * machine.gamma * (1.0 + machine.gemm_half / w))
    t = redist + (comm[0] if comm else 0.0)
    for p in range(len(comp)):
        nxt = comm[p + 1] if p + 1 < len(comm) else 0.0
        prev = red[p - 1] if p > 0 else 0.0
        t += max(comp[p], nxt + prev)
    t += red[-1] if red else 0.0
    layers = 0.0
    if st.layers > 1:  # all-reduce of C over the layers: reduce + broadcast
        cbytes = big.m_loc * big.n_loc * st.itemsize
        layers = reduce_time(cbytes, st.layers, machine, st.itemsize) + bcast_time(cbytes, st.layers, machine)
    return redist, sum(comm) + sum(red) + layers, sum(comp), t + layers


def _predicted_time(
    m: int, k: int, n: int, grid_dims: tuple[int, ...], machine: Machine, itemsize: int, ta: bool, tb: bool,
    panel: int | None,
) -> float:  # fmt: skip
    return _timing(_setup(m, k, n, grid_dims, itemsize, ta, tb, panel), machine)[3]


def recommend_panel(
    m: int, k: int, n: int, grid_dims: tuple[int, int], machine: Machine | None = None, *,
    itemsize: int = 8, transpose_a: bool = False, transpose_b: bool = False,
) -> int:  # fmt: skip
    """Local. The panel width with the lowest predicted time (powers of two and the default).

    Returns
    -------
    int
        A width between 1 and the widest block of the walked index; ties go to the wider.

    Raises
    ------
    ValueError
        On negative sizes or a bad grid.
    """
    plan = _setup(m, k, n, grid_dims, itemsize, transpose_a, transpose_b, None).plan
    mach = machine or Machine()
    return _best_panel(plan, lambda w: _predicted_time(m, k, n, grid_dims, mach, itemsize, transpose_a, transpose_b, w))


def _best_panel(plan: MatmulPlan, time_of: Callable[[int], float]) -> int:
    """The candidate width of least ``time_of(width)`` (powers of two, the default, the widest; ties: the wider)."""
    bounds = sorted(set(plan.cuts_x) | set(plan.cuts_y))
    widest = max([b - a for a, b in itertools.pairwise(bounds)] + [1])
    cands = {default_panel(plan.cuts_x, plan.cuts_y), widest} | {2**i for i in range(3, 30) if 2**i < widest}
    return -min((time_of(w), -w) for w in cands)[1]


def recommend_panel_for(
    a: Layout, b: Layout, machine: Machine, *, itemsize: int, transpose_a: bool = False, transpose_b: bool = False
) -> int:
    """Local. :func:`recommend_panel` for inputs in these layouts: the panel width of ``panel="auto"``.

    What ``hpctp.matmul(a, b, panel="auto")`` runs with (after moving its inputs to
    :func:`~hpctp.linalg.plan.required_layouts`): the candidate width (powers of two, the default, the widest block)
    whose pipelined SUMMA on these layouts has the lowest predicted time on ``machine``; equal to
    :func:`recommend_panel` for balanced ``(0, 1)`` inputs. Remembered per arguments.

    Parameters
    ----------
    a, b : Layout
        Layouts of the stored A and B that :func:`~hpctp.linalg.plan.plan_matmul` accepts (a 2-D grid).
    machine : Machine
    itemsize : int
        Bytes per element.
    transpose_a, transpose_b : bool

    Returns
    -------
    int

    Raises
    ------
    ValueError
        If no SUMMA variant fits the layouts (as :func:`~hpctp.linalg.plan.plan_matmul`).
    """
    return _panel_for(a, b, machine, int(itemsize), bool(transpose_a), bool(transpose_b))


@functools.lru_cache(maxsize=256)
def _panel_for(a: Layout, b: Layout, machine: Machine, itemsize: int, ta: bool, tb: bool) -> int:
    none = (0,) * math.prod(a.grid_dims)

    def setup(panel: int | None) -> _Setup:
        return _Setup(plan_matmul(a, b, ta, tb, panel), a, b, ta, tb, tuple(a.grid_dims), itemsize, none, none)

    return _best_panel(setup(None).plan, lambda w: _timing(setup(w), machine)[3])


def recommend_grid(
    m: int, k: int, n: int, nranks: int, machine: Machine | None = None, *,
    itemsize: int = 8, transpose_a: bool = False, transpose_b: bool = False,
) -> tuple[int, int]:  # fmt: skip
    """Local. The grid ``(pr, pc)`` with ``pr * pc == nranks`` and the lowest predicted time.

    Each candidate grid is timed with its recommended panel width; ties go to the most
    square grid.

    Returns
    -------
    tuple of int

    Raises
    ------
    ValueError
        If ``nranks < 1`` or sizes are negative.
    """
    if not is_int(nranks) or nranks < 1:  # numpy ints accepted
        raise ValueError(f"nranks must be a positive int, got {nranks!r}")
    nranks = int(nranks)
    best: tuple[float, int, tuple[int, int]] | None = None
    for pr in range(1, nranks + 1):
        if nranks % pr:
            continue
        dims = (pr, nranks // pr)
        w = recommend_panel(m, k, n, dims, machine, itemsize=itemsize, transpose_a=transpose_a, transpose_b=transpose_b)
        t = _predicted_time(m, k, n, dims, machine or Machine(), itemsize, transpose_a, transpose_b, w)
        key = (t, abs(dims[0] - dims[1]), dims)
        if best is None or key < best:
            best = key
    return best[2]  # type: ignore[index]  # nranks >= 1: pr = 1 always qualifies


# ---------------------------------------------------------------- attention schedules
SCHEDULES = ("ring", "all_to_all")
"""The attention schedules that :func:`predict_attention` prices."""


@dataclass(frozen=True)
class AttentionCost:
    """Local. Predicted cost of one attention call on its busiest rank.

    Attributes
    ----------
    schedule : {"ring", "all_to_all"}
    supported : bool
        False where the schedule cannot run these layouts (``reason`` says why).
    reason : str
    bytes_sent : int
        Bytes the busiest rank sends (what :class:`hpctp.CommCounter` reports for the ring).
    messages : int
        Messages the busiest rank sends; for the ring, blocks (each travels in up to
        ``hpctp.nn.transformer.context_parallel.RING_PIECES`` pieces forward and ``RING_PIECES_BACKWARD``
        backward, so the latency term undercounts large blocks by that factor: it is small beside
        the bytes').
    flops : float
        Flops of the busiest rank.
    comm_time, compute_time, time : float
        Seconds: communication, computation, and the predicted wall time.
    """

    schedule: str
    supported: bool
    reason: str
    bytes_sent: int
    messages: int
    flops: float
    comm_time: float
    compute_time: float
    time: float


def _max_extent(layout: Layout, d: int) -> int:
    return max(layout.block_sizes(d))


def _flops_per_pair(d: int, dv: int, backward: bool) -> int:
    """Flops per (query, key) pair: QK^T and PV forward; backward adds QK^T again, dV, dP, dQ and dK."""
    forward = 2 * (d + dv)
    return forward + (2 * (3 * d + 2 * dv) if backward else 0)


def _ring_cost(
    q: Layout, k: Layout, v: Layout, itemsize: int, acc_itemsize: int, backward: bool, m: Machine
) -> AttentionCost:
    # blocks are products of per-dim blocks: the largest/smallest block is the product of the extremes
    dims = token_dims(q.ndim)
    p = math.prod(k.parts(t) for t in dims)
    total = math.prod(k.global_shape[t] for t in dims)
    smallest = math.prod(min(k.block_sizes(t)) for t in dims)
    nonempty = math.prod(sum(1 for n in k.block_sizes(t) if n) for t in dims)
    q_tokens = math.prod(_max_extent(q, t) for t in dims)
    bh = _max_extent(q, 0) * _max_extent(q, 1)
    d, dv = q.global_shape[-1], v.global_shape[-1]
    per_token = bh * (d + dv)
    sent, messages = 0, 0
    if p > 1:
        sent = (total - smallest) * per_token * itemsize
        messages = nonempty - (1 if smallest else 0)
        if backward:  # the blocks again, then every block's dK/dV once
            sent += (total - smallest) * per_token * itemsize + total * per_token * acc_itemsize
            messages += messages + nonempty
    flops = float(bh * q_tokens * total * _flops_per_pair(d, dv, backward))
    comm = m.alpha * messages + m.beta * sent
    compute = m.gamma * flops
    return AttentionCost("ring", True, "", int(sent), messages, flops, comm, compute, max(comm, compute))


def _all_to_all_cost(
    q: Layout, k: Layout, v: Layout, itemsize: int, causal: bool, backward: bool, m: Machine
) -> AttentionCost:
    split, reason = all_to_all_split(q)
    if split is None:
        return AttentionCost("all_to_all", False, reason, 0, 0, 0.0, 0.0, 0.0, math.inf)
    dims = token_dims(q.ndim)
    grid = q.grid_dims
    moved = [g for g in set(split[:2]) - set(q.split[:2]) if g is not None]
    p = math.prod(grid[g] for g in moved)
    d, dv = q.global_shape[-1], v.global_shape[-1]

    def block(layout: Layout) -> int:
        return math.prod(_max_extent(layout, t) for t in range(layout.ndim))

    out_elems = block(q) // d * dv if d else 0
    elems = block(q) + block(k) + block(v) + out_elems
    sent = 0
    messages = 0
    if p > 1:
        sent = int(elems * itemsize * (p - 1) / p)
        messages = 4 * (p - 1)
        if backward:
            sent *= 2
            messages *= 2
    target = Layout(q.global_shape, grid, split)
    bh = _max_extent(target, 0) * _max_extent(target, 1)
    lq = math.prod(q.global_shape[t] for t in dims)
    lk = math.prod(k.global_shape[t] for t in dims)
    flops = float(bh * lq * lk * _flops_per_pair(d, dv, backward)) * (0.5 if causal else 1.0)
    comm = m.alpha * messages + m.beta * sent
    compute = m.gamma * flops
    return AttentionCost("all_to_all", True, "", sent, messages, flops, comm, compute, comm + compute)


def predict_attention(
    q: Layout,
    k: Layout,
    v: Layout,
    itemsize: int,
    *,
    causal: bool = False,
    backward: bool = True,
    acc_itemsize: int | None = None,
    machine: Machine | None = None,
) -> dict[str, AttentionCost]:
    """Local. Predicted cost of both attention schedules for these layouts.

    Parameters
    ----------
    q, k, v : Layout
        Layouts of the queries, keys and values ``[batch, heads, *tokens, head_dim]``.
    itemsize : int
        Bytes per element of q/k/v.
    causal : bool, optional
    backward : bool, optional
        Include the backward pass (default True).
    acc_itemsize : int, optional
        Bytes per element of the ring's travelling ``dK/dV`` (float32 for half inputs;
        default ``itemsize``).
    machine : Machine, optional
        Machine parameters (default :class:`hpctp.linalg.cost.Machine()`).

    Returns
    -------
    dict
        ``{"ring": AttentionCost, "all_to_all": AttentionCost}``.
    """
    m = Machine() if machine is None else machine
    acc = itemsize if acc_itemsize is None else acc_itemsize
    return {
        "ring": _ring_cost(q, k, v, itemsize, acc, backward, m),
        "all_to_all": _all_to_all_cost(q, k, v, itemsize, causal, backward, m),
    }


def choose_schedule(costs: dict[str, AttentionCost]) -> str:
    """Local. The supported schedule of least predicted time (``"all_to_all"`` on a tie: torch's own kernel).

    Parameters
    ----------
    costs : dict
        From :func:`predict_attention`.

    Returns
    -------
    str
    """
    ring, a2a = costs["ring"], costs["all_to_all"]
    if a2a.supported and a2a.time <= ring.time:
        return "all_to_all"
    return "ring"
