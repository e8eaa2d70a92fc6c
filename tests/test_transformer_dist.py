"""TransformerBlock and MultiheadAttention on DistTensor inputs against torch in one process (float64, 1e-10).

Heads split over one grid axis; the tokens whole along it, split over it (sequence parallelism, cuts
from the layout), or split over the other axes (``attention="ring"``: exact attention over all the
tokens, 1-D sequences and 2-D token fields); the batch split over the remaining axes.
"""

from __future__ import annotations

import pytest
import torch
from helpers.agreement import count_agreements
from helpers.transformer import F64, global_grads, normal, torch_grads
from mpi4py import MPI

import hpctp
from hpctp import DistTensor, Layout
from hpctp.comm import CommCounter
from hpctp.layout import block_cuts
from hpctp.layout.ring import ring_plan
from hpctp.linalg.cost import predict_attention
from hpctp.nn import sync_gradients
from hpctp.nn.attention import MultiheadAttention
from hpctp.nn.state_dict import global_state_dict
from hpctp.nn.transformer import TransformerBlock
from hpctp.testing import assert_all, assert_allclose, assert_equal

RTOL, ATOL = 1e-10, 1e-12
B, T, E, H, RATIO = 3, 7, 10, 5, 1.5  # 5 heads: uneven on 2, 3, 4 ranks, a rank without one on 6


def _uneven(n: int, parts: int) -> tuple[int, ...]:
    """Cuts of ``n`` items growing quadratically (7 over 6: 0 0 1 2 3 5 7, an empty first block)."""
    return tuple(n * i * i // (parts * parts) for i in range(parts + 1))


def _dist(grid, X, split, uneven=()):  # type: ignore[no-untyped-def]
    """``X``'s block on this rank as a DistTensor that requires grad, and the block's global slices;
    the dims in ``uneven`` cut by :func:`_uneven`."""
    cuts = tuple(
        _uneven(X.shape[d], grid.dims[g]) if d in uneven and (g := split[d]) is not None else None
        for d in range(X.ndim)
    )
    layout = Layout(X.shape, grid.dims, split, cuts)
    sl = layout.local_slices(grid.coords)
    return DistTensor(X[sl].clone().requires_grad_(), grid, layout), sl


def _other(grid, axis):  # type: ignore[no-untyped-def]
    return [a for a in range(grid.ndim) if a != axis]


def _reference_block(block: TransformerBlock) -> torch.nn.TransformerEncoderLayer:
    ref = torch.nn.TransformerEncoderLayer(
        E, H, int(RATIO * E), dropout=0.0, activation="gelu", batch_first=True, norm_first=True, dtype=F64
    )
    ref.load_state_dict(global_state_dict(block))
    return ref


def _compare_block(grid, block, X, split, what, uneven=(), masks=None):  # type: ignore[no-untyped-def]
    """Forward, input and parameter gradients of ``block`` on ``X``'s blocks against torch's encoder layer
    on the gathered tokens (flattened row-major). ``masks``: (attn_mask, key_padding_mask, is_causal)."""
    ref = _reference_block(block)
    G = normal(tuple(X.shape), 2)
    x, sl = _dist(grid, X, split, uneven)
    attn_mask, pad, causal = masks if masks is not None else (None, None, False)
    kw = {"attn_mask": attn_mask, "is_causal": causal}
    if pad is not None:
        kw["key_padding_mask"] = pad[sl[0]]  # this rank's samples, all the keys
    y = block(x, **kw)
    assert_all(grid, isinstance(y, DistTensor) and y.layout == x.layout and y.grid is grid, f"{what} layout")
    (y.local * G[sl]).sum().backward()
    xr = X.clone().requires_grad_()
    n = xr.flatten(1, -2).shape[1]
    ref_mask = torch.ones(n, n, dtype=torch.bool).triu(1) if causal and attn_mask is None else attn_mask
    yr = ref(xr.flatten(1, -2), src_mask=ref_mask, src_key_padding_mask=pad, is_causal=causal).reshape(X.shape)
    (yr * G).sum().backward()
    assert_allclose(grid, y.local.detach(), yr.detach()[sl], rtol=RTOL, atol=ATOL, what=f"{what} forward")
    assert_allclose(grid, x.local.grad, xr.grad[sl], rtol=RTOL, atol=ATOL, what=f"{what} input grad")
    sync_gradients(block, grid)  # partial over the batch and token axes; complete over the heads' axis
    got, want = global_grads(block), torch_grads(ref)
    assert_equal(grid, sorted(got), sorted(want), f"{what} names")
    for name, g in want.items():
        assert_allclose(grid, got[name], g, rtol=RTOL, atol=ATOL, what=f"{what} {name} grad")


# ---------------------------------------------------------------------------------------------- heads
@pytest.mark.mpi
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_block_dist_input_matches_torch(grid2d, sequence_parallel):  # type: ignore[no-untyped-def]
    """Heads over either axis, the batch (3: uneven, some ranks empty) over the other; the tokens whole
    along the heads' axis, or split over it in uneven cuts (sequence parallelism); causal and padding masks."""
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, -2:] = True
    for axis in range(2):
        block = TransformerBlock(E, H, RATIO, grid2d, axis=axis, sequence_parallel=sequence_parallel, seed=5, dtype=F64)
        split = (_other(grid2d, axis)[0], axis if sequence_parallel else None, None)
        what = f"axis={axis} sp={sequence_parallel}"
        _compare_block(grid2d, block, normal((B, T, E), 1), split, what, uneven=(1,), masks=(causal, pad, True))


@pytest.mark.mpi
def test_attention_dist_cross_attention_matches_torch(grid2d):  # type: ignore[no-untyped-def]
    """MultiheadAttention on DistTensor query, key and value (7 queries over 4 keys, both split over the
    heads' axis: sequence parallelism), against torch.nn.MultiheadAttention."""
    axis = grid2d.ndim - 1
    layer = MultiheadAttention(E, H, grid2d, axis=axis, sequence_parallel=True, seed=7, dtype=F64)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=F64)
    ref.load_state_dict(global_state_dict(layer))
    shapes = ((B, T, E), (B, 4, E), (B, 4, E))
    full = [normal(s, i) for i, s in enumerate(shapes)]
    G = normal((B, T, E), 9)
    ins = [_dist(grid2d, X, (None, axis, None), uneven=(1,)) for X in full]
    y, _ = layer(*(x for x, _ in ins))
    (y.local * G[ins[0][1]]).sum().backward()
    rs = [X.clone().requires_grad_() for X in full]
    yr, _ = ref(*rs, need_weights=False)
    (yr * G).sum().backward()
    assert_all(grid2d, isinstance(y, DistTensor) and y.layout == ins[0][0].layout, "output layout")
    assert_allclose(grid2d, y.local.detach(), yr.detach()[ins[0][1]], rtol=RTOL, atol=ATOL, what="forward")
    for (x, sl), r, name in zip(ins, rs, ("query", "key", "value")):
        assert_allclose(grid2d, x.local.grad, r.grad[sl], rtol=RTOL, atol=ATOL, what=f"{name} grad")
    sync_gradients(
        layer, grid2d, axes=(axis,)
    )  # out_proj.bias: partial over the token blocks (the other axis: replicas)
    got, want = global_grads(layer), torch_grads(ref)
    for name in want:
        assert_allclose(grid2d, got[name], want[name], rtol=RTOL, atol=ATOL, what=f"{name} grad")


@pytest.mark.mpi
def test_sequence_parallel_dist_input_agrees_once(grid1d, monkeypatch):  # type: ignore[no-untyped-def]
    """The token cuts come from the layout: after the first call no Allgather (counted or not), and the
    messages are those of the plain sequence-parallel block without its per-call Allgather."""
    calls = count_agreements(monkeypatch)
    p = grid1d.size
    for sp in (True, False):
        calls.clear()
        block = TransformerBlock(E, H, RATIO, grid1d, sequence_parallel=sp, seed=1, dtype=F64)
        x, _ = _dist(grid1d, normal((B, T, E), 1), (None, 0 if sp else None, None), uneven=(1,))
        block(x).local.sum().backward()  # the first call agrees on the layout
        for _ in range(2):
            with CommCounter() as fwd:
                y = block(x)
            with CommCounter() as bwd:
                y.local.sum().backward()
            if p > 1:
                want = {"Allgatherv": 2, "Alltoallv": 2} if sp else {"Allreduce": 2}
                assert_all(grid1d, fwd.calls == want, f"sp={sp} forward calls {fwd.calls}, expected {want}")
                assert_all(grid1d, bwd.calls == want, f"sp={sp} backward calls {bwd.calls}, expected {want}")
            else:
                assert_all(grid1d, fwd.bytes_sent == bwd.bytes_sent == 0, f"one rank: {fwd.calls} {bwd.calls}")
            assert_all(grid1d, "Allgather" not in fwd.calls, f"sp={sp} no Allgather per call: {fwd.calls}")
        want_calls = ["MultiheadAttention"]  # the block's input, once; the MLP runs on the agreed arguments
        assert_all(grid1d, calls == want_calls, f"sp={sp} agreements {calls}, expected {want_calls}")


# ---------------------------------------------------------------------------------------------- ring
@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True])
def test_ring_block_1d_tokens_matches_torch(grid2d, causal):  # type: ignore[no-untyped-def]
    """Heads over one axis, the 7 tokens over the other in uneven cuts (empty blocks on 6 ranks), both ways;
    ``is_causal`` is the ring's ``causal=`` (no mask passed)."""
    for axis in range(2):
        block = TransformerBlock(E, H, RATIO, grid2d, axis=axis, attention="ring", seed=3, dtype=F64)
        split = (None, _other(grid2d, axis)[0], None)
        what = f"axis={axis} causal={causal}"
        _compare_block(grid2d, block, normal((B, T, E), 1), split, what, uneven=(1,), masks=(None, None, causal))


@pytest.mark.mpi
@pytest.mark.parametrize("attention", ["all_to_all", "auto"])
def test_other_schedules_match_torch(grid2d, attention):  # type: ignore[no-untyped-def]
    block = TransformerBlock(E, H, RATIO, grid2d, axis=0, attention=attention, seed=4, dtype=F64)
    _compare_block(grid2d, block, normal((B, T, E), 1), (None, 1, None), attention, uneven=(1,))


@pytest.mark.mpi
def test_ring_block_2d_field_matches_torch(grid3d):  # type: ignore[no-untyped-def]
    """A 4 x 5 patch grid of 2 samples, its rows and columns split over two grid axes, the heads over the third."""
    X = normal((2, 4, 5, E), 6)
    for axis in (0, 2):
        rows, cols = _other(grid3d, axis)
        block = TransformerBlock(E, H, RATIO, grid3d, axis=axis, attention="ring", seed=8, dtype=F64)
        _compare_block(grid3d, block, X, (None, rows, cols, None), f"axis={axis}", uneven=(2,))


@pytest.mark.mpi
def test_ring_block_sequence_parallel_matches_torch(grid2d):  # type: ignore[no-untyped-def]
    """Sequence parallelism with the ring: a 4 x 5 patch field's columns split over the heads' axis (uneven
    cuts: empty blocks on 3-6 ranks of an axis) and its rows over the other axis, both ways round; and a causal
    sequence split over the heads' axis, the batch over the other (its ring over one rank)."""
    X = normal((2, 4, 5, E), 6)
    for axis in range(2):
        block = TransformerBlock(
            E, H, RATIO, grid2d, axis=axis, attention="ring", sequence_parallel=True, seed=8, dtype=F64
        )
        split = (None, _other(grid2d, axis)[0], axis, None)
        _compare_block(grid2d, block, X, split, f"field axis={axis}", uneven=(2,))
        x, _ = _dist(grid2d, X, split, uneven=(2,))
        block(x).local.sum().backward()  # (the layout agreed)
        with CommCounter() as fwd:
            block(x)
        p = grid2d.dims[axis]
        if p > 1:  # each region gathers the tokens over the heads' axis and scatters its output
            calls = {k: fwd.calls.get(k, 0) for k in ("Allgatherv", "Alltoallv", "Allreduce")}
            want = {"Allgatherv": 2, "Alltoallv": 2, "Allreduce": 0}
            assert_all(grid2d, calls == want, f"axis={axis} forward calls {fwd.calls}")
        # bytes, forward and backward, summed over the ranks: the ring's K/V the same as without sequence
        # parallelism (the same tokens after the gather), the heads' axis those of a bandwidth-optimal all-reduce
        sent = {}
        for sp in (False, True):
            layer = TransformerBlock(
                E, H, RATIO, grid2d, axis=axis, attention="ring", sequence_parallel=sp, seed=8, dtype=F64
            )
            xs, _ = _dist(grid2d, X, split if sp else (*split[:2], None, None), uneven=(2,))
            layer(xs).local.sum().backward()
            with CommCounter() as both:
                layer(xs).local.sum().backward()
            per = [both.per_comm[c.Get_name()].bytes_sent for c in (grid2d.comm, grid2d.sub(axis))]
            sent[sp] = [MPI.COMM_WORLD.allreduce(b) for b in per]
        assert_equal(grid2d, sent[True][0], sent[False][0], f"axis={axis} ring bytes with and without sp")
        assert_equal(grid2d, sent[True][1] * p, sent[False][1] * 2 * (p - 1), f"axis={axis} heads' axis bytes")
    block = TransformerBlock(
        E, H, RATIO, grid2d, axis=0, attention="all_to_all", sequence_parallel=True, seed=8, dtype=F64
    )
    _compare_block(grid2d, block, X, (None, 1, 0, None), "field all_to_all", uneven=(2,))
    block = TransformerBlock(E, H, RATIO, grid2d, axis=0, attention="ring", sequence_parallel=True, seed=9, dtype=F64)
    seq = (1 if grid2d.dims[1] > 1 else None, 0, None)
    _compare_block(grid2d, block, normal((B, T, E), 1), seq, "causal sequence", uneven=(1,), masks=(None, None, True))


@pytest.mark.mpi
def test_ring_block_bytes(grid2d):  # type: ignore[no-untyped-def]
    """Each K/V block once per pass around the ring (backward: again, and every block's dK/dV once), plus
    one all-reduce of [batch, tokens, E] over the heads' axis per region and direction; the busiest rank's
    ring bytes are hpctp.perf.predict_attention's."""
    d = E // H
    for axis in range(2):
        tok = _other(grid2d, axis)[0]
        block = TransformerBlock(E, H, RATIO, grid2d, axis=axis, attention="ring", seed=2, dtype=F64)
        x, sl = _dist(grid2d, normal((B, T, E), 1), (None, tok, None), uneven=(1,))
        block(x).local.sum().backward()  # the first call agrees on the layouts
        with CommCounter() as fwd:
            y = block(x)
        with CommCounter() as bwd:
            y.local.sum().backward()
        heads = grid2d.dims[axis] > 1
        q = Layout(
            (B, H, T, d),
            grid2d.dims,
            (None, axis if heads else None, tok, None),
            (None, block_cuts(H, grid2d.dims[axis]) if heads else None, _uneven(T, grid2d.dims[tok]), None),
        )
        plan = ring_plan(q, q, grid2d.rank)
        per_token = B * q.local_shape(grid2d.coords)[1] * 2 * d * 8  # k and v of this rank's heads
        ring_fwd = plan.sent_tokens * per_token if plan.size > 1 else 0
        ring_bwd = ring_fwd + sum(s.tokens for s in plan.steps) * per_token if plan.size > 1 else 0
        reduce = 2 * B * (sl[1].stop - sl[1].start) * E * 8 if heads else 0
        what = f"axis={axis}"
        assert_equal(grid2d, [fwd.bytes_sent, bwd.bytes_sent], [ring_fwd + reduce, ring_bwd + reduce], f"{what} bytes")
        busiest = [MPI.COMM_WORLD.allreduce(v, op=MPI.MAX) for v in (ring_fwd, ring_fwd + ring_bwd)]
        predicted = [predict_attention(q, q, q, 8, backward=b)["ring"].bytes_sent for b in (False, True)]
        assert_equal(grid2d, busiest, predicted, f"{what} busiest rank vs hpctp.perf")
        want = {"Allreduce": 2} if heads else {}
        assert_all(grid2d, {k: v for k, v in fwd.calls.items() if k == "Allreduce"} == want, f"{what} {fwd.calls}")


@pytest.mark.mpi
def test_ring_cross_attention_matches_torch(grid2d):  # type: ignore[no-untyped-def]
    """MultiheadAttention(schedule="ring"): 7 queries over 5 keys, both split over the axis without heads."""
    axis, tok = 0, 1
    layer = MultiheadAttention(E, H, grid2d, axis=axis, schedule="ring", seed=9, dtype=F64)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=F64)
    ref.load_state_dict(global_state_dict(layer))
    full = [normal((B, T, E), 1), normal((B, 5, E), 2), normal((B, 5, E), 3)]
    G = normal((B, T, E), 4)
    ins = [_dist(grid2d, X, (None, tok, None), uneven=(1,)) for X in full]
    y, _ = layer(*(x for x, _ in ins))
    (y.local * G[ins[0][1]]).sum().backward()
    rs = [X.clone().requires_grad_() for X in full]
    yr, _ = ref(*rs, need_weights=False)
    (yr * G).sum().backward()
    assert_allclose(grid2d, y.local.detach(), yr.detach()[ins[0][1]], rtol=RTOL, atol=ATOL, what="forward")
    for (x, sl), r, name in zip(ins, rs, ("query", "key", "value")):
        assert_allclose(grid2d, x.local.grad, r.grad[sl], rtol=RTOL, atol=ATOL, what=f"{name} grad")
    sync_gradients(layer, grid2d)
    got, want = global_grads(layer), torch_grads(ref)
    for name in want:
        assert_allclose(grid2d, got[name], want[name], rtol=RTOL, atol=ATOL, what=f"{name} grad")


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.mpi
def test_dist_errors(grid2d):  # type: ignore[no-untyped-def]
    """Wrong layouts raise a clear error on every rank before any data moves."""
    X = normal((B, T, E), 1)
    heads = TransformerBlock(E, H, RATIO, grid2d, axis=0, dtype=F64)
    ring = TransformerBlock(E, H, RATIO, grid2d, axis=0, attention="ring", dtype=F64)
    with pytest.raises(ValueError, match="schedule"):
        MultiheadAttention(E, H, grid2d, schedule="tree")
    with pytest.raises(TypeError, match="DistTensor"):
        ring(X)
    with pytest.raises(TypeError, match="all hpctp.DistTensor or all torch.Tensor"):
        heads.self_attn(_dist(grid2d, X, (None, None, None))[0], X, X)
    other = hpctp.ProcessGrid(grid2d.dims)
    with pytest.raises(ValueError, match="another ProcessGrid"):
        heads(_dist(other, X, (None, None, None))[0])
    other.free()
    with pytest.raises(ValueError, match=r"\[batch, tokens, 10\]"):
        heads(_dist(grid2d, normal((B, 2, 3, E), 1), (None, None, None, None))[0])
    with pytest.raises(ValueError, match="one token dim"):
        ring(_dist(grid2d, normal((B, 2, 3, E), 1), (None, None, 1, None))[0], is_causal=True)
    with pytest.raises(ValueError, match="attn_mask"):
        ring(_dist(grid2d, X, (None, 1, None))[0], attn_mask=torch.zeros(T, T, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):
        ring(_dist(grid2d, X, (None, 1, None))[0], key_padding_mask=torch.zeros(B, T, dtype=torch.bool))
    if grid2d.dims[0] > 1:  # axis 0 (the heads') divides
        with pytest.raises(ValueError, match="sequence_parallel=False"):
            heads(_dist(grid2d, X, (None, 0, None))[0])
        with pytest.raises(ValueError, match="batch"):
            heads(_dist(grid2d, X, (0, None, None))[0])
        with pytest.raises(ValueError, match="split the tokens over the other grid axes"):
            ring(_dist(grid2d, X, (None, 0, None))[0])
        ring_sp = TransformerBlock(E, H, RATIO, grid2d, axis=0, attention="ring", sequence_parallel=True, dtype=F64)
        with pytest.raises(ValueError, match="one of query's token dims must be split over grid axis 0"):
            ring_sp(_dist(grid2d, X, (None, None, None))[0])
        with pytest.raises(ValueError, match="embedding"):
            heads(_dist(grid2d, X, (None, None, 0))[0])
        sp = TransformerBlock(E, H, RATIO, grid2d, axis=0, sequence_parallel=True, dtype=F64)
        with pytest.raises(ValueError, match="must be split over grid axis 0"):
            sp(_dist(grid2d, X, (None, None, None))[0])
    if grid2d.dims[1] > 1:
        with pytest.raises(ValueError, match="attention='ring'"):
            heads(_dist(grid2d, X, (None, 1, None))[0])
    heads(_dist(grid2d, X, (1, None, None))[0])  # still usable after the errors (nothing left half-agreed)
