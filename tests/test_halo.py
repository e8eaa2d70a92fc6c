"""Halo exchange: plans (pure math), HaloExchange on numpy/torch blocks, halo_pad autograd, byte counts."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from helpers.layers import global_field
from helpers.layouts import make_layout, skewed_cuts

import hpctp
from hpctp.comm import CommCounter
from hpctp.halo import HaloExchange, dim_segments, fetch_plan, halo_wants, source_index
from hpctp.layout import Layout, grid_coords
from hpctp.nn.functional import halo_pad
from hpctp.tensor.infer import infer_layout
from hpctp.testing import assert_all, assert_allclose, assert_equal

NP_MODE = {"zero": "constant", "periodic": "wrap", "reflect": "reflect", "replicate": "edge"}
TORCH_MODE = {"zero": "constant", "periodic": "circular", "reflect": "reflect", "replicate": "replicate"}


# ----------------------------------------------------------------------------- pure plan math
@pytest.mark.parametrize("boundary", list(NP_MODE))
@pytest.mark.parametrize("n", [2, 3, 7])
def test_source_index_matches_numpy_pad(boundary: str, n: int) -> None:
    for w in (1, 3, 10):
        kw = {"constant_values": -1} if boundary == "zero" else {}
        expect = np.pad(np.arange(n), w, mode=NP_MODE[boundary], **kw)
        np.testing.assert_array_equal(source_index(np.arange(-w, n + w), n, boundary), expect)


def test_dim_segments_runs() -> None:
    cuts = (0, 3, 5, 9)
    segs = dim_segments(cuts, 1, 1, 8, "zero")  # block 1 = [3, 5) wants [1, 8)
    assert [(s.dst, s.owner, s.src, s.halo) for s in segs] == [
        ((0, 2), 0, (1, 3), True),
        ((2, 4), 1, (0, 2), False),
        ((4, 7), 2, (0, 3), True),
    ]
    refl = dim_segments((0, 4), 0, -2, 4, "reflect")  # [2, 1 | 0, 1, 2, 3]
    assert [(s.dst, s.src, s.flip) for s in refl] == [((0, 2), (1, 3), True), ((2, 6), (0, 4), False)]


def _simulate(layout: Layout, wants: tuple, boundary: tuple, stencil: str = "box") -> None:
    """Every rank's sends match its peers' receives piece by piece, and each cell is filled once."""
    plans = [fetch_plan(layout, r, wants, boundary, stencil) for r in range(layout.nranks)]
    for r, p in enumerate(plans):
        cover = np.zeros(p.shape, dtype=int)
        for sl in p.fills:
            cover[sl] += 1
        for piece in p.local + tuple(q for m in p.recvs for q in m.pieces):
            cover[piece.dst] += 1
        assert (cover == 1).all(), f"rank {r}: cells covered {np.unique(cover)} times"
        for m in p.sends:
            back = {x.peer: x for x in plans[m.peer].recvs}[r]
            assert [q.shape for q in back.pieces] == [q.shape for q in m.pieces]
        assert sum(len(m.pieces) for m in p.recvs) == sum(len(m.pieces) for q in plans for m in q.sends if m.peer == r)


@pytest.mark.parametrize("boundary", list(NP_MODE))
@pytest.mark.parametrize("stencil", ["box", "star"])
def test_plans_are_consistent(boundary: str, stencil: str) -> None:
    for dims, shape, width in [((3,), (7,), 4), ((2, 3), (5, 8), 2), ((2, 2, 1), (3, 6, 4), 1), ((4,), (3,), 2)]:
        split = tuple(range(len(dims)))
        cuts = tuple(skewed_cuts(n, d) for n, d in zip(shape, dims))
        lay = Layout(shape, dims, split, cuts)
        b = "zero" if (boundary == "reflect" and min(shape) < 2) else boundary
        _simulate(lay, halo_wants(lay, [(width, width + 1)] * len(dims)), (b,) * len(dims), stencil)


def test_star_stencil_sends_no_corners() -> None:
    lay = Layout((6, 6), (2, 2), (0, 1))
    box = fetch_plan(lay, 0, halo_wants(lay, [(1, 1)] * 2), ("zero", "zero"))
    star = fetch_plan(lay, 0, halo_wants(lay, [(1, 1)] * 2), ("zero", "zero"), "star")
    assert [m.peer for m in box.recvs] == [1, 2, 3] and box.recv_elements == 3 + 3 + 1
    assert [m.peer for m in star.recvs] == [1, 2] and star.recv_elements == 6


# ----------------------------------------------------------------------------- multi-rank
def _expected_padded(X: np.ndarray, lay: Layout, coords: tuple, widths: list, boundary: str) -> np.ndarray:
    full = np.pad(X, widths, mode=NP_MODE[boundary])
    return full[tuple(slice(a, b + lo + hi) for (a, b), (lo, hi) in zip(lay.local_ranges(coords), widths))]


@pytest.mark.mpi
@pytest.mark.parametrize("boundary", list(NP_MODE))
def test_exchange_numpy_2d_uneven_multihop(grid2d: hpctp.ProcessGrid, boundary: str) -> None:
    """(N, C, H, W) numpy blocks, a 1-cell block and widths wider than it: equals numpy.pad."""
    lay = make_layout(grid2d, (1, 2, 7, 6), (None, None, 0, 1), skew=True)
    X = global_field(lay.global_shape, 0).numpy()
    widths = [(0, 0), (0, 0), (2, 3), (1, 2)]
    h = HaloExchange(lay, widths, boundary, grid=grid2d)
    out = h.exchange(np.ascontiguousarray(X[lay.local_slices(grid2d.coords)]))
    assert_equal(grid2d, out, _expected_padded(X, lay, grid2d.coords, widths, boundary), f"{boundary} halo")


@pytest.mark.mpi
def test_exchange_torch_3d_box_and_star(grid3d: hpctp.ProcessGrid) -> None:
    t = hpctp.random.normal((2, 5, 4, 6), grid3d, (None, 0, 1, 2), seed=3, like="torch")
    X = t.gather(root=None).numpy()
    widths = [(0, 0), (1, 1), (1, 1), (2, 1)]
    box = HaloExchange(t, [0, 1, 1, (2, 1)], "periodic").exchange(t.local)
    expect = _expected_padded(X, t.layout, grid3d.coords, widths, "periodic")
    assert_equal(grid3d, box.numpy(), expect, "periodic box halo")
    star = HaloExchange(t, [0, 1, 1, (2, 1)], "periodic", stencil="star").exchange(t.local)
    halo_dims = np.zeros(star.shape[1:], dtype=int)  # in how many dims each cell is a ghost
    for d, (lo, _) in enumerate(widths[1:]):
        idx = np.arange(star.shape[d + 1])
        ghost = (idx < lo) | (idx >= lo + t.local.shape[d + 1])
        halo_dims += ghost.reshape([-1 if i == d else 1 for i in range(3)])
    face = np.broadcast_to(halo_dims <= 1, star.shape)
    ok = np.array_equal(star.numpy()[face], expect[face]) and not star.numpy()[~face].any()
    assert_all(grid3d, ok, "star stencil: faces exchanged, edges/corners zero")


@pytest.mark.mpi
@pytest.mark.parametrize("boundary", list(NP_MODE))
def test_exchange_1d_wider_than_neighbours(grid1d: hpctp.ProcessGrid, boundary: str) -> None:
    lay = make_layout(grid1d, (7,), (0,), skew=True)
    X = np.arange(7, dtype=np.float32) + 1
    h = HaloExchange(lay, 5, boundary, grid=grid1d)
    out = h.exchange(X[lay.local_slices(grid1d.coords)].copy())
    assert_equal(grid1d, out, _expected_padded(X, lay, grid1d.coords, [(5, 5)], boundary))


@pytest.mark.mpi
def test_face_peers_are_grid_shift_neighbours(grid3d: hpctp.ProcessGrid) -> None:
    """Star stencil, width 1: the peers are exactly the ``grid.shift`` neighbours (every block
    non-empty: an empty block's halo comes from the nearest non-empty one, past the neighbour)."""
    lay = Layout(tuple(max(n, g) for n, g in zip((4, 5, 6), grid3d.dims)), grid3d.dims, (0, 1, 2))
    h = HaloExchange(lay, 1, grid=grid3d, stencil="star")
    shift = {r for a in range(3) for r in grid3d.shift(a, 1) if r >= 0}
    peers = {m.peer for m in h.plan.recvs} | {m.peer for m in h.plan.sends}
    assert_all(grid3d, peers == shift, f"peers {sorted(peers)} != shift neighbours {sorted(shift)}")


@pytest.mark.mpi
def test_begin_end_overlap(grid2d: hpctp.ProcessGrid) -> None:
    t = hpctp.random.uniform((9, 8), grid2d, (0, 1), seed=1)
    h = HaloExchange(t, 1, "reflect")
    req = h.begin(t.local)
    early = req.out[h.interior].copy()  # the own block is in place before end()
    interior_sum = t.local.sum()  # "interior work" while the halo is in flight
    out = h.end(req)
    assert_equal(grid2d, early, t.local, "own block copied at begin()")
    assert_equal(grid2d, out, h.exchange(t.local), "begin/end == exchange")
    assert_allclose(grid2d, interior_sum, out[h.interior].sum(), rtol=1e-12)


@pytest.mark.mpi
@pytest.mark.parametrize("boundary", list(NP_MODE))
def test_adjoint_dot_product(grid2d: hpctp.ProcessGrid, boundary: str) -> None:
    """<H x, y> == <x, H^T y> summed over ranks, for HaloExchange.adjoint and halo_pad's backward."""
    lay = make_layout(grid2d, (2, 7, 5), (None, 0, 1), skew=True)
    widths = [(0, 0), (3, 1), (2, 2)]
    h = HaloExchange(lay, widths, boundary, grid=grid2d)
    rng = np.random.default_rng(grid2d.rank)
    x = rng.standard_normal(h.local_shape)
    y = rng.standard_normal(h.padded_shape)
    dots = np.array([np.vdot(h.exchange(x), y), np.vdot(x, h.adjoint(y))])
    hpctp.comm.allreduce(grid2d.comm, dots, "sum")
    assert_allclose(grid2d, dots[0], dots[1], rtol=1e-12, what="numpy adjoint")
    xt = torch.from_numpy(x).requires_grad_()
    yt = torch.from_numpy(y)
    padded = halo_pad(xt, grid2d, (None, 0, 1), widths, boundary)
    (padded * yt).sum().backward()
    dots = np.array([float((padded.detach() * yt).sum()), float((xt.detach() * xt.grad).sum())])
    hpctp.comm.allreduce(grid2d.comm, dots, "sum")
    assert_allclose(grid2d, dots[0], dots[1], rtol=1e-12, what="halo_pad backward")
    assert_allclose(grid2d, xt.grad.numpy(), h.adjoint(y), rtol=1e-13, what="backward == adjoint")


@pytest.mark.mpi
@pytest.mark.parametrize("boundary", ["zero", "periodic", "reflect", "replicate"])
def test_halo_pad_matches_torch_pad(grid2d: hpctp.ProcessGrid, boundary: str) -> None:
    lay = make_layout(grid2d, (1, 2, 6, 9), (None, None, 0, 1), skew=False)
    X = global_field(lay.global_shape, 5)
    x = X[lay.local_slices(grid2d.coords)].clone().requires_grad_()
    y = halo_pad(x, grid2d, (None, None, 0, 1), [0, 0, 2, (1, 3)], boundary)
    R = torch.nn.functional.pad(X, (1, 3, 2, 2), mode=TORCH_MODE[boundary])
    (a, b), (c, d) = lay.local_ranges(grid2d.coords)[2:]
    assert_equal(grid2d, y.detach(), R.detach()[:, :, a : b + 4, c : d + 4], "halo_pad forward")
    GY = global_field(R.shape, 6)
    (y * GY[:, :, a : b + 4, c : d + 4]).sum().backward()  # each rank's padded block is its own output
    # reference: the loss sums every rank's padded window, so overlaps count once per window
    G = torch.zeros_like(X)
    for r in range(grid2d.size):
        (a2, b2), (c2, d2) = lay.local_ranges(grid_coords(r, grid2d.dims))[2:]
        gy = GY[:, :, a2 : b2 + 4, c2 : d2 + 4]
        Xs = X.clone().requires_grad_()
        Rs = torch.nn.functional.pad(Xs, (1, 3, 2, 2), mode=TORCH_MODE[boundary])[:, :, a2 : b2 + 4, c2 : d2 + 4]
        (Rs * gy).sum().backward()
        G += Xs.grad
    assert_allclose(grid2d, x.grad, G[lay.local_slices(grid2d.coords)], rtol=1e-12, what="halo_pad backward")


def _expected_bytes(lay: Layout, grid: hpctp.ProcessGrid, w: int, boundary: str, item: int) -> tuple[int, int, int]:
    """Independent count: cells of each rank's padded box owned by another rank."""

    def owners(coords: tuple) -> list[np.ndarray]:
        out = []
        for d, (a, b) in enumerate(lay.local_ranges(coords)):
            g = np.arange(a - w, b + w)
            n = lay.global_shape[d]
            src = np.mod(g, n) if boundary == "periodic" else np.where((g >= 0) & (g < n), g, -1)
            out.append(np.where(src >= 0, np.searchsorted(lay.dim_cuts[d], src, side="right") - 1, -1))
        return out

    sent = recv = 0
    peers = set()
    for r in range(grid.size):
        c = grid_coords(r, grid.dims)
        for combo in itertools.product(*owners(c)):
            if min(combo) < 0:
                continue
            src_rank = hpctp.layout.grid_rank(combo, grid.dims)
            if src_rank == r:
                continue
            if r == grid.rank:
                recv += item
                peers.add(src_rank)
            if src_rank == grid.rank:
                sent += item
    return sent, recv, len(peers)


@pytest.mark.mpi
@pytest.mark.parametrize("boundary", ["zero", "periodic"])
def test_exchange_sends_exactly_halo_bytes(grid2d: hpctp.ProcessGrid, boundary: str) -> None:
    lay = make_layout(grid2d, (7, 6), (0, 1), skew=True)
    h = HaloExchange(lay, 2, boundary, grid=grid2d)
    block = np.ones(h.local_shape)
    h.exchange(block)  # plan and buffers warm
    with hpctp.CommCounter() as cnt:
        h.exchange(block)
    sent, recv, peers = _expected_bytes(lay, grid2d, 2, boundary, 8)
    ok = (cnt.bytes_sent, cnt.bytes_recv, cnt.messages) == (sent, recv, peers) and set(cnt.calls) <= {"Isend", "Irecv"}
    assert_all(grid2d, ok, f"counted {cnt}, expected sent={sent} recv={recv} messages={peers}")


@pytest.mark.mpi
def test_bad_arguments_raise_everywhere(grid2d: hpctp.ProcessGrid) -> None:
    lay = Layout((4, 4), grid2d.dims, (0, 1))
    with pytest.raises(ValueError, match="one per dim"):
        HaloExchange(lay, [1, 1, 1], grid=grid2d)
    with pytest.raises(ValueError, match=">= 0"):
        HaloExchange(lay, -1, grid=grid2d)
    with pytest.raises(ValueError, match="boundary must be one of"):
        HaloExchange(lay, 1, "mirror", grid=grid2d)
    with pytest.raises(ValueError, match="needs grid"):
        HaloExchange(lay, 1)
    with pytest.raises(ValueError, match="empty"):
        HaloExchange(Layout((0, 4), grid2d.dims, (0, 1)), 1, "periodic", grid=grid2d)
    x = torch.zeros(2, 3)
    if grid2d.dims[1] > 1:
        with pytest.raises(ValueError, match="do not tile"):  # ranks of one grid row disagree on W
            halo_pad(torch.zeros(2 + grid2d.rank, 3), grid2d, (0, 1), 1)
    with pytest.raises(ValueError, match="entries"):
        halo_pad(x, grid2d, (0,), 1)
    # a caller's failed local check travels in the inference's one message: raised on every rank
    last = grid2d.rank == grid2d.size - 1
    with pytest.raises(ValueError, match=rf"rank {grid2d.size - 1}: bad block"):
        infer_layout((2, 3), grid2d, (0, 1), ValueError(f"rank {grid2d.rank}: bad block") if last else None)
    with CommCounter() as c:
        lay = infer_layout((2, 3), grid2d, (0, 1), None)
    assert_all(grid2d, lay.global_shape == (2 * grid2d.dims[0], 3 * grid2d.dims[1]), f"inferred {lay}")
    assert_all(grid2d, c.calls.get("Allgather", 0) == (grid2d.size > 1) and len(c.calls) <= 1, f"{c.calls}")
    assert_equal(grid2d, math.prod(halo_pad(torch.zeros(2, 3), grid2d, (0, 1), 1).shape), 4 * 5)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "case", ["width", "bad_width", "boundary", "stencil", "pad_width", "pad_boundary", "pad_dtype"]
)
def test_halo_argument_differing_on_one_rank_raises_everywhere(grid2d: hpctp.ProcessGrid, case: str) -> None:
    """Checked where the plan is made, collectively: a bad or different width, boundary, stencil or
    dtype on one rank hung the others or returned uninitialised ghost cells."""
    g = grid2d
    odd = g.size > 1 and g.rank == g.size - 1
    lay = Layout((6, 5), g.dims, (0, 1))
    block = torch.ones(lay.local_shape(g.coords), dtype=torch.float64)
    calls = {
        "width": lambda: HaloExchange(lay, 2 if odd else 1, grid=g),
        "bad_width": lambda: HaloExchange(lay, -1 if odd else 1, grid=g),
        "boundary": lambda: HaloExchange(lay, 1, "periodic" if odd else "zero", grid=g),
        "stencil": lambda: HaloExchange(lay, 1, grid=g, stencil="star" if odd else "box"),
        "pad_width": lambda: halo_pad(block, g, (0, 1), 2 if odd else 1),
        "pad_boundary": lambda: halo_pad(block, g, (0, 1), 1, "sideways" if odd else "zero"),
        "pad_dtype": lambda: halo_pad(block.float() if odd else block, g, (0, 1), 1),
    }
    if g.size == 1:
        if case not in ("bad_width", "pad_boundary"):
            calls[case]()
        return
    with pytest.raises(ValueError, match=r"ranks passed different|must be >= 0|boundary"):
        calls[case]()


@pytest.mark.mpi
def test_out_on_another_backend_is_a_clear_error(grid2d: hpctp.ProcessGrid) -> None:
    lay = Layout((6, 5), grid2d.dims, (0, 1))
    ex = HaloExchange(lay, 1, grid=grid2d)
    block = np.ones(lay.local_shape(grid2d.coords))
    with pytest.raises(TypeError, match="out is a torch array and block a numpy one"):
        ex.begin(block, out=torch.zeros(ex.padded_shape, dtype=torch.float64))
    out = np.zeros(ex.padded_shape)  # refused before any message: the same exchange then works
    got = ex.end(ex.begin(block, out=out))
    assert_all(grid2d, got is out and bool((out[ex.interior] == 1).all()), "exchange into a numpy out")
