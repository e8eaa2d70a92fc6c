"""Exact attention over tokens split on 1-, 2- and 3-D grids (hpctp.nn.context_parallel) against torch's
scaled_dot_product_attention of the flattened tokens on one process: forward and q/k/v gradients in float64,
causal and not, uneven and empty blocks, both schedules; the ring's per-block paths (torch's CPU flash kernels
in pieces, key tiles) in float32; the ring's bytes (CommCounter) and its memory."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import hpctp
from hpctp import CommCounter, Layout
from hpctp.layout.ring import all_to_all_split
from hpctp.linalg.cost import choose_schedule, predict_attention
from hpctp.nn import context_parallel as cp
from hpctp.testing import assert_all, assert_allclose, assert_equal

F64 = torch.float64
B, H, D = 2, 3, 4


def _globals(shape, seeds, dtype=F64, dv=None):
    """Global q, k, v and an upstream gradient, the same on every rank."""
    gen = torch.Generator().manual_seed(seeds)
    out_shape = shape[:-1] + ((dv or shape[-1]),)
    q = torch.randn(shape, dtype=F64, generator=gen)
    k = torch.randn(shape, dtype=F64, generator=gen)
    v = torch.randn(out_shape, dtype=F64, generator=gen)
    g = torch.randn(out_shape, dtype=F64, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), g.to(dtype)


def _dist(x, grid, layout, grad=True):
    block = x[layout.local_slices(grid.coords)].clone()
    return hpctp.DistTensor(block.requires_grad_(grad), grid, layout)


def _reference(q, k, v, g, causal, scale=None):
    """SDPA of the flattened tokens on one process; the output and q/k/v gradients in the global shapes."""
    ins = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    flat = [x.flatten(2, -2) for x in ins]
    y = F.scaled_dot_product_attention(*flat, is_causal=causal, scale=scale)
    y = y.reshape(q.shape[:-1] + (v.shape[-1],))
    y.backward(g)
    return y.detach(), [x.grad for x in ins]


def _check(grid, q, k, v, g, layouts, causal, schedule, rtol=1e-10, atol=1e-12, scale=None):
    lq, lk, lv = layouts
    dq, dk, dv = _dist(q, grid, lq), _dist(k, grid, lk), _dist(v, grid, lv)
    y = cp.attention(dq, dk, dv, causal=causal, schedule=schedule, scale=scale)
    want, grads = _reference(q, k, v, g, causal, scale)
    out = Layout(want.shape, grid.dims, lq.split, lq.cuts[:-1] + (None,) if lq.cuts else ())
    assert_equal(grid, np.array(y.layout == out), np.array(True), what="output layout")
    mine = out.local_slices(grid.coords)
    y.local.backward(g[mine])
    tag = f"{schedule} causal={causal}"
    assert_allclose(grid, y.local.detach(), want[mine], rtol=rtol, atol=atol, what=f"{tag}: output")
    for name, x, lay, ref in zip("qkv", (dq, dk, dv), layouts, grads):
        assert_allclose(
            grid, x.local.grad, ref[lay.local_slices(grid.coords)], rtol=rtol, atol=atol, what=f"{tag}: d{name}"
        )


def _layout(shape, grid, token_split, cuts=(), batch=None, heads=None):
    return Layout(shape, grid.dims, (batch, heads, *token_split, None), cuts)


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", ["ring", "all_to_all"])
def test_sequence_split_over_one_axis(grid1d, causal, schedule):
    shape = (B, H, 11, D)
    q, k, v, g = _globals(shape, 1)
    lay = _layout(shape, grid1d, (0,))
    _check(grid1d, q, k, v, g, (lay, lay, lay), causal, schedule)


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", ["ring", "all_to_all"])
def test_patch_grid_split_over_two_axes(grid2d, causal, schedule):
    shape = (B, H, 5, 7, D)  # uneven over 2x2, 3x1, 2x3...
    q, k, v, g = _globals(shape, 2)
    lay = _layout(shape, grid2d, (0, 1))
    _check(grid2d, q, k, v, g, (lay, lay, lay), causal, schedule)


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True])
def test_volume_split_over_three_axes(grid3d, causal):
    shape = (B, H, 3, 4, 5, D)
    q, k, v, g = _globals(shape, 3)
    lay = _layout(shape, grid3d, (0, 1, 2))
    _check(grid3d, q, k, v, g, (lay, lay, lay), causal, "ring")
    if all_to_all_split(lay)[0] is not None:  # at most two axes of more than one rank
        _check(grid3d, q, k, v, g, (lay, lay, lay), causal, "all_to_all")


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True])
def test_uneven_cuts_with_empty_blocks(grid1d, causal):
    n = grid1d.dims[0]
    seq = 7
    shape = (B, H, seq, D)
    q, k, v, g = _globals(shape, 4)
    # the first block empty, the rest as uneven as the sizes allow; keys cut differently from queries
    qcuts = (0, 0) + tuple(min(seq, 1 + 2 * i) for i in range(1, n - 1)) + (seq,) if n > 1 else None
    kcuts = (0,) + tuple(min(seq, 3 * i) for i in range(1, n)) + (seq,) if n > 1 else None
    lq = _layout(shape, grid1d, (0,), cuts=(None, None, qcuts, None))
    lk = _layout(shape, grid1d, (0,), cuts=(None, None, kcuts, None))
    for schedule in ("ring", "all_to_all"):
        _check(grid1d, q, k, v, g, (lq, lk, lk), causal, schedule)


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True])
def test_batch_on_one_axis_tokens_on_the_other(grid2d, causal):
    shape = (1, H, 11, D)
    q, k, v, g = _globals(shape, 5)
    lay = _layout(shape, grid2d, (1,), batch=0)  # a ring per grid row; rows past the first hold no batch
    # (their empty messages are skipped on both sides: none is left to match a later call's receive)
    _check(grid2d, q, k, v, g, (lay, lay, lay), causal, "ring")
    rep = _layout(shape, grid2d, (1,))  # grid axis 0 holds replicas: one ring per replica
    _check(grid2d, q, k, v, g, (rep, rep, rep), causal, "ring")
    _check(grid2d, q, k, v, g, (rep, rep, rep), causal, "all_to_all")


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention_other_key_grid_and_value_width(grid2d, causal):
    qshape, kshape = (B, H, 5, 7, D), (B, H, 4, 6, D)
    q, _, _, g = _globals(qshape, 6, dv=6)
    _, k, v, _ = _globals(kshape, 7, dv=6)
    lq = _layout(qshape, grid2d, (0, 1))
    lk = _layout(kshape, grid2d, (0, 1))
    lv = _layout(kshape[:-1] + (6,), grid2d, (0, 1))
    for schedule in ("ring", "all_to_all"):
        _check(grid2d, q, k, v, g, (lq, lk, lv), causal, schedule, scale=0.3)


@pytest.mark.mpi
def test_float32_and_bfloat16_against_float64(grid1d):
    shape = (B, H, 11, D)
    q, k, v, g = _globals(shape, 8)
    lay = _layout(shape, grid1d, (0,))
    want, _ = _reference(q, k, v, g, True)
    mine = lay.local_slices(grid1d.coords)
    for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        ins = [_dist(x.to(dtype), grid1d, lay) for x in (q, k, v)]
        y = cp.attention(*ins, causal=True, schedule="ring")
        y.local.backward(g[mine].to(dtype))
        assert_equal(grid1d, str(y.local.dtype), str(dtype))
        assert_allclose(grid1d, y.local.detach().double(), want[mine], rtol=rtol, atol=rtol, what=str(dtype))
        assert_all(grid1d, all(x.local.grad.dtype == dtype for x in ins), "gradient dtype")


@pytest.mark.mpi
def test_gradient_of_q_only(grid1d):
    shape = (B, H, 11, D)
    q, k, v, g = _globals(shape, 9)
    lay = _layout(shape, grid1d, (0,))
    dq = _dist(q, grid1d, lay)
    dk, dv = _dist(k, grid1d, lay, grad=False), _dist(v, grid1d, lay, grad=False)
    y = cp.attention(dq, dk, dv, causal=True, schedule="ring")
    mine = lay.local_slices(grid1d.coords)
    with CommCounter() as c:
        y.local.backward(g[mine])
    _, grads = _reference(q, k, v, g, True)
    assert_allclose(grid1d, dq.local.grad, grads[0][mine], rtol=1e-10, atol=1e-12)
    assert_equal(grid1d, c.calls.get("Isend", 0) <= grid1d.size - 1, True, what="no dK/dV ring")


def _tokens(layout, coords):
    return math.prod(hi - lo for lo, hi in layout.local_ranges(coords)[2:-1])


@pytest.mark.mpi
def test_ring_sends_each_block_once_per_pass(grid2d):
    shape = (B, H, 5, 7, D)
    q, k, v, g = _globals(shape, 10)
    lay = _layout(shape, grid2d, (0, 1))
    ins = [_dist(x, grid2d, lay) for x in (q, k, v)]
    cp.attention(*ins, schedule="ring")  # (first call: the arguments are agreed)
    size, rank = grid2d.size, grid2d.rank
    total = 5 * 7
    per_token = B * H * (D + D) * 8  # K and V of one token, float64
    own = _tokens(lay, grid2d.coords)
    succ = _tokens(lay, grid2d.coords_of((rank + 1) % size))  # all axes split tokens: the ring is 0..size-1
    nonempty = sum(1 for r in range(size) if _tokens(lay, grid2d.coords_of(r)))
    with CommCounter() as fwd:
        y = cp.attention(*ins, schedule="ring")
    with CommCounter() as bwd:
        y.local.backward(g[lay.local_slices(grid2d.coords)])
    ring = size > 1
    assert_equal(grid2d, fwd.bytes_sent, (total - succ) * per_token if ring else 0, what="forward bytes sent")
    assert_equal(grid2d, fwd.bytes_recv, (total - own) * per_token if ring else 0, what="forward bytes received")
    assert_equal(grid2d, fwd.messages, (nonempty - (1 if succ else 0)) if ring else 0, what="forward messages")
    assert_equal(grid2d, set(fwd.calls), {"Isend", "Irecv"} if ring else set(), what="only the ring's messages")
    # backward: the blocks once more, and every block's dK/dV once, back to its owner
    assert_equal(grid2d, bwd.bytes_sent, (2 * total - succ) * per_token if ring else 0, what="backward bytes sent")
    assert_equal(grid2d, bwd.bytes_recv, (2 * total - own) * per_token if ring else 0, what="backward bytes received")
    everyone = hpctp.comm.allgather_ints(grid2d.comm, [fwd.bytes_sent])
    assert_equal(
        grid2d, int(everyone.sum()), (size - 1) * total * per_token if ring else 0, what="each block P-1 times"
    )
    cost = predict_attention(lay, lay, lay, 8)["ring"]
    assert_equal(
        grid2d, cost.bytes_sent, int(hpctp.comm.allgather_ints(grid2d.comm, [fwd.bytes_sent + bwd.bytes_sent]).max())
    )


def _pieces(tokens):
    return len(cp._piece_bounds(tokens, cp.RING_PIECES))  # (forward)


@pytest.mark.mpi
@pytest.mark.parametrize("path", ["flash", "tiles"])
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_travel_in_pieces(grid2d, monkeypatch, path, causal):
    monkeypatch.setattr(cp, "FLASH_BLOCKS", path == "flash")
    monkeypatch.setattr(cp, "KEY_TILE_MIN", 2)  # pieces of at least 2 keys, at most 3 per block: uneven pieces
    monkeypatch.setattr(cp, "RING_PIECES", 3)
    qshape, kshape = (B, H, 5, 7, D), (B, H, 4, 6, D)
    q, k0, v0, g = _globals(qshape, 17)
    _, k, v, _ = _globals(kshape, 18)
    lq, lk = _layout(qshape, grid2d, (0, 1)), _layout(kshape, grid2d, (0, 1))
    _check(grid2d, q, k0, v0, g, (lq, lq, lq), causal, "ring")  # self-attention
    _check(grid2d, q, k, v, g, (lq, lk, lk), causal, "ring", scale=0.3)  # cross-attention
    # bytes as with whole blocks; one message per piece
    ins = [_dist(x, grid2d, lay) for x, lay in ((q, lq), (k, lk), (v, lk))]
    size, rank = grid2d.size, grid2d.rank
    per_token = B * H * (D + D) * 8
    own, succ = _tokens(lk, grid2d.coords), _tokens(lk, grid2d.coords_of((rank + 1) % size))
    pieces = sum(_pieces(_tokens(lk, grid2d.coords_of(r))) for r in range(size))
    with CommCounter() as fwd:
        cp.attention(*ins, causal=causal, schedule="ring")
    ring = size > 1
    total = 4 * 6
    assert_equal(grid2d, fwd.bytes_sent, (total - succ) * per_token if ring else 0, what="forward bytes sent")
    assert_equal(grid2d, fwd.bytes_recv, (total - own) * per_token if ring else 0, what="forward bytes received")
    assert_equal(grid2d, fwd.messages, pieces - _pieces(succ) if ring else 0, what="forward messages")


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True])
def test_uneven_and_empty_blocks_in_pieces(grid1d, monkeypatch, causal):
    monkeypatch.setattr(cp, "KEY_TILE_MIN", 1)
    n, seq = grid1d.dims[0], 13
    shape = (B, H, seq, D)
    q, k, v, g = _globals(shape, 19)
    qcuts = (0, 0) + tuple(min(seq, 1 + 3 * i) for i in range(1, n - 1)) + (seq,) if n > 1 else None
    kcuts = (0,) + tuple(min(seq, 5 * i) for i in range(1, n)) + (seq,) if n > 1 else None
    lq = _layout(shape, grid1d, (0,), cuts=(None, None, qcuts, None))
    lk = _layout(shape, grid1d, (0,), cuts=(None, None, kcuts, None))
    _check(grid1d, q, k, v, g, (lq, lk, lk), causal, "ring")
    # q's gradient only: no dK/dV travels
    dq = _dist(q, grid1d, lq)
    dk, dv = _dist(k, grid1d, lk, grad=False), _dist(v, grid1d, lk, grad=False)
    y = cp.attention(dq, dk, dv, causal=causal, schedule="ring")
    y.local.backward(g[lq.local_slices(grid1d.coords)])
    _, grads = _reference(q, k, v, g, causal)
    assert_allclose(grid1d, dq.local.grad, grads[0][lq.local_slices(grid1d.coords)], rtol=1e-10, atol=1e-12)


class _LargestTensor(TorchFunctionMode):
    """Records the bytes of the largest tensor any torch function returns, and the names of the functions."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.shape: tuple[int, ...] = ()
        self.called: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.called.add(getattr(func, "__name__", str(func)))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.largest:
                self.largest = t.numel() * t.element_size()
                self.shape = tuple(t.shape)
        return out


_FLASH = "_scaled_dot_product_flash_attention_for_cpu"


@pytest.mark.mpi
@pytest.mark.parametrize("path", ["flash", "tiles"])
def test_ring_memory_per_rank_is_one_block(grid1d, monkeypatch, path):
    monkeypatch.setattr(cp, "FLASH_BLOCKS", path == "flash")
    monkeypatch.setattr(cp, "SCORE_TILE_ELEMENTS", 0)
    monkeypatch.setattr(cp, "KEY_TILE_MIN", 4)  # score tiles of 4 keys
    monkeypatch.setattr(cp, "MASK_ELEMENTS", 64)  # float masks of 64 (query, key) pairs
    seq, d = 64, 8
    shape = (B, 2, seq, d)
    q, k, v, g = _globals(shape, 11)
    lay = _layout(shape, grid1d, (0,))
    ins = [_dist(x, grid1d, lay) for x in (q, k, v)]
    mine = lay.local_slices(grid1d.coords)
    upstream = g[mine].clone()
    held = {"now": 0, "most": 0}  # bytes of the ring's pooled message buffers (K/V pieces) held at once
    sizes: dict[int, int] = {}
    acquire, release = cp.P.acquire, cp.P.release

    def counted_acquire(n, like):
        buf = acquire(n, like)
        sizes[id(buf)] = n
        held["now"] += n
        held["most"] = max(held["most"], held["now"])
        return buf

    def counted_release(buf):
        held["now"] -= sizes.pop(id(buf), 0)
        release(buf)

    monkeypatch.setattr(cp.P, "acquire", counted_acquire)
    monkeypatch.setattr(cp.P, "release", counted_release)
    with _LargestTensor() as probe:
        y = cp.attention(*ins, causal=True, schedule="ring")
        y.local.backward(upstream)
    most = max(lay.block_sizes(2))
    block = most * B * 2 * (d + d) * 8  # one rank's K and V, float64
    bounds = cp._piece_bounds(most, cp.RING_PIECES)  # the forward's pieces (backward: smaller ones)
    piece = max(b - a for a, b in bounds) * B * 2 * (d + d) * 8  # K and V of one piece
    full_kv = seq * B * 2 * (d + d) * 8
    full_scores = seq * seq * B * 2 * 8
    assert_all(  # the largest: one rank's queries, K or V (dq, dK, the output) or a K/V piece, not its K and V
        grid1d,
        probe.largest <= max(block // 2, piece),
        f"largest tensor {probe.shape} ({probe.largest} B) > one K block ({block // 2} B) and one piece ({piece} B)",
    )
    assert_all(  # K/V in flight: a few pieces (less than one block once a block travels in pieces)
        grid1d,
        held["most"] <= cp._KV_SLOTS * piece and (len(bounds) <= cp._KV_SLOTS or held["most"] < block),
        f"pooled K/V buffers of {held['most']} B > {cp._KV_SLOTS} pieces of {piece} B",
    )
    if grid1d.size > 1:  # no rank holds all K/V, nor a P-th of the attention matrix
        assert_all(grid1d, probe.largest < full_kv and probe.largest < full_scores // grid1d.size, "O(tokens/P)")
    assert_all(grid1d, (_FLASH in probe.called) == (path == "flash"), f"{path}: flash kernel called")
    want, _ = _reference(q, k, v, g, True)
    assert_allclose(grid1d, y.local.detach(), want[mine], rtol=1e-10, atol=1e-12, what=f"{path}: output")


def _covered(pieces, seen, n):
    """How often each (query, key) pair of a block is attended by its pieces."""
    count = np.zeros((len(seen), n), dtype=np.int64)
    for p in pieces:
        keys = np.arange(p.k0, p.k1)
        if p.causal:
            visible = keys[None, :] - p.k0 <= np.arange(p.r1 - p.r0)[:, None]
        elif p.limit is not None:
            visible = keys[None, :] - p.k0 < p.limit[:, None]
        else:
            visible = np.ones((p.r1 - p.r0, p.k1 - p.k0), dtype=bool)
        count[p.r0 : p.r1, p.k0 : p.k1] += visible
    return count


@pytest.mark.parametrize("mask_elements", [1, 64, 1 << 16])
def test_flash_pieces_cover_each_visible_pair_once(monkeypatch, mask_elements):
    monkeypatch.setattr(cp, "MASK_ELEMENTS", mask_elements)
    rng = np.random.default_rng(0)
    n = 40
    cases = [
        np.arange(1, 41),  # a diagonal block: one causal square
        np.arange(0, 60) // 2,  # two queries per key: masks
        np.concatenate([np.zeros(5, int), np.arange(3, 23), np.full(30, 22), np.arange(22, 41), np.full(6, n)]),
        np.repeat(np.arange(0, 41, 8), 7),  # a staircase (keys split over another grid axis)
    ]
    cases += [np.sort(rng.integers(0, n + 1, size=m)) for m in (1, 17, 50, 90)]
    for seen in cases:
        pieces = cp._staircase(seen, n)
        want = np.arange(n)[None, :] < seen[:, None]
        assert (_covered(pieces, seen, n) == want).all(), seen
        for p in pieces:  # no piece is empty, nor holds a query that sees none of its keys
            assert p.r1 > p.r0 and p.k1 > p.k0
            if p.limit is not None:  # masks of at most MASK_ELEMENTS pairs (one query's keys when more)
                assert p.limit.min() >= 1
                assert (p.r1 - p.r0) * (p.k1 - p.k0) <= max(mask_elements, p.k1 - p.k0)
        if len(seen) >= cp.CAUSAL_RUN_MIN and (np.diff(seen) == 1).all() and seen[0] >= 1 and seen[-1] < n:
            assert any(p.causal for p in pieces) and not any(p.limit is not None for p in pieces)


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_elements", [64, 1 << 16])
def test_flash_blocks_float32_against_sdpa(grid2d, monkeypatch, causal, mask_elements):
    monkeypatch.setattr(cp, "MASK_ELEMENTS", mask_elements)
    qshape, kshape = (1, 2, 16, 12, 8), (1, 2, 10, 14, 8)
    f32 = torch.float32
    for shapes, seed in (((qshape, qshape), 15), ((qshape, kshape), 16)):  # self- and cross-attention
        q, _, _, g = _globals(shapes[0], seed, f32)
        _, k, v, _ = _globals(shapes[1], seed + 10, f32)
        lq, lk = _layout(shapes[0], grid2d, (0, 1)), _layout(shapes[1], grid2d, (0, 1))
        with _LargestTensor() as probe:
            _check(grid2d, q, k, v, g, (lq, lk, lk), causal, "ring", rtol=1e-5, atol=1e-6)
        assert_all(grid2d, _FLASH in probe.called, "the flash kernels attend the blocks")


@pytest.mark.mpi
def test_auto_schedule_is_the_cost_models_choice(grid2d, caplog):
    shape = (B, H, 5, 7, D)
    q, k, v, g = _globals(shape, 12)
    lay = _layout(shape, grid2d, (0, 1))
    ins = [_dist(x, grid2d, lay) for x in (q, k, v)]
    with caplog.at_level("INFO", logger="hpctp.nn.attention"):
        chosen = cp.attention_schedule(*ins, causal=True)
    assert_equal(grid2d, chosen, choose_schedule(predict_attention(lay, lay, lay, 8, causal=True)))
    if grid2d.rank == 0:
        assert any("schedule" in r.getMessage() for r in caplog.records)
    everyone = hpctp.comm.allgather_ints(grid2d.comm, [("ring", "all_to_all").index(chosen)])
    assert_all(grid2d, bool((everyone == everyone[0]).all()), "one choice on every rank")
    _check(grid2d, q, k, v, g, (lay, lay, lay), True, "auto")


@pytest.mark.mpi
def test_arguments_are_agreed_once(grid1d, monkeypatch):
    shape = (B, H, 13, D)
    q, k, v, _ = _globals(shape, 13)
    lay = _layout(shape, grid1d, (0,))
    ins = [_dist(x, grid1d, lay, grad=False) for x in (q, k, v)]
    calls = []
    agree = hpctp.comm.agree_arguments
    monkeypatch.setattr(cp.C, "agree_arguments", lambda *a, **kw: (calls.append(a[1]), agree(*a, **kw))[1])
    for _ in range(3):
        cp.attention(*ins, causal=True, scale=0.25, schedule="ring")
    assert_equal(grid1d, calls, ["attention"])


@pytest.mark.mpi
def test_bad_arguments_raise_on_every_rank(grid1d):
    shape = (B, H, 7, D)
    q, k, v, _ = _globals(shape, 14)
    lay = _layout(shape, grid1d, (0,))
    ins = [_dist(x, grid1d, lay, grad=False) for x in (q, k, v)]
    with pytest.raises(TypeError, match="DistTensor"):
        cp.attention(q, k, v)
    with pytest.raises(ValueError, match="schedule must be one of"):
        cp.attention(*ins, schedule="fast")
    with pytest.raises(TypeError, match="causal must be a bool"):
        cp.attention(*ins, causal=1)
    with pytest.raises(ValueError, match="scale"):
        cp.attention(*ins, scale=float("nan"))
    as_numpy = hpctp.DistTensor(ins[1].local.numpy(), grid1d, lay)
    with pytest.raises(TypeError, match="to\\('torch'\\)"):
        cp.attention(ins[0], as_numpy, ins[2])
    with pytest.raises(TypeError, match="dtypes"):
        cp.attention(ins[0], hpctp.DistTensor(ins[1].local.float(), grid1d, lay), ins[2])
    other = _layout(shape, grid1d, (None,), batch=0)
    with pytest.raises(ValueError, match="split alike"):
        cp.attention(ins[0], _dist(k, grid1d, other, False), _dist(v, grid1d, other, False))
    heads = Layout(shape, grid1d.dims, (None, None, None, 0))
    with pytest.raises(ValueError, match="head dim"):
        cp.attention(*[_dist(x, grid1d, heads, False) for x in (q, k, v)])
    with pytest.raises(ValueError, match="head dim 4 differs"):
        cp.attention(ins[0], _dist(k[..., :3], grid1d, _layout((B, H, 7, 3), grid1d, (0,)), False), ins[2])
