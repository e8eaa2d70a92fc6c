"""MultiheadAttention split over heads against torch.nn.MultiheadAttention in one process (float64, 1e-10)."""

from __future__ import annotations

import pytest
import torch
from helpers.transformer import F64, global_grads, normal, token_rows, torch_grads
from mpi4py import MPI

import hpctp
from hpctp.comm import CommCounter
from hpctp.nn.attention import MultiheadAttention
from hpctp.nn.state_dict import global_state_dict
from hpctp.testing import assert_all, assert_allclose, assert_equal

RTOL, ATOL = 1e-10, 1e-12
B, T, E, H = 2, 7, 10, 5  # 5 heads: uneven on 2, 3, 4 ranks; a rank without a head on 6


def _masks(kind: str) -> dict[str, object]:
    """Keyword arguments for both layers (torch needs the causal mask spelled out with is_causal)."""
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, -2:] = True  # the first sample's last two keys are padding
    if kind == "none":
        return {}
    if kind == "bool2d":
        return {"attn_mask": normal((T, T), 9) > 0.8}
    if kind == "float3d":
        return {"attn_mask": normal((B * H, T, T), 10)}
    if kind == "padding":
        return {"key_padding_mask": pad}
    if kind == "causal":
        return {"attn_mask": causal, "is_causal": True}
    if kind == "causal+padding":
        return {"attn_mask": causal, "is_causal": True, "key_padding_mask": pad}
    raise ValueError(kind)


def _reference(layer: MultiheadAttention) -> torch.nn.MultiheadAttention:
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=F64)
    ref.load_state_dict(global_state_dict(layer))
    return ref


def _check(grid, layer, ref, y, x, xr, yr, what):  # type: ignore[no-untyped-def]
    rows = token_rows(grid, layer.axis, T) if layer.sequence_parallel else slice(None)
    assert_allclose(grid, y.detach(), yr.detach()[:, rows], rtol=RTOL, atol=ATOL, what=f"{what} forward")
    assert_allclose(grid, x.grad, xr.grad[:, rows], rtol=RTOL, atol=ATOL, what=f"{what} input grad")
    if layer.sequence_parallel:  # out_proj.bias saw only this rank's tokens
        hpctp.nn.sync_gradients(layer, grid, axes=(layer.axis,))
    got, want = global_grads(layer), torch_grads(ref)
    assert_equal(grid, sorted(got), sorted(want), f"{what} parameter names")
    for name in want:
        assert_allclose(grid, got[name], want[name], rtol=RTOL, atol=ATOL, what=f"{what} {name} grad")


@pytest.mark.mpi
@pytest.mark.parametrize("masks", ["none", "bool2d", "float3d", "padding", "causal", "causal+padding"])
def test_self_attention_matches_torch(grid1d, masks):  # type: ignore[no-untyped-def]
    layer = MultiheadAttention(E, H, grid1d, axis=0, seed=4, dtype=F64)
    ref = _reference(layer)
    X, G = normal((B, T, E), 1), normal((B, T, E), 2)
    kw = _masks(masks)
    x, xr = X.clone().requires_grad_(), X.clone().requires_grad_()
    y, weights = layer(x, x, x, need_weights=False, **kw)
    yr, _ = ref(xr, xr, xr, need_weights=False, **kw)
    (y * G).sum().backward()
    (yr * G).sum().backward()
    assert_all(grid1d, weights is None, "no attention weights")
    _check(grid1d, layer, ref, y, x, xr, yr, masks)


@pytest.mark.mpi
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_each_axis_of_2d_grids(grid2d, sequence_parallel):  # type: ignore[no-untyped-def]
    """Heads over either axis; the other axis holds replicas. With sequence parallelism the tokens
    (7: uneven) are split over the same axis."""
    for axis in range(2):
        layer = MultiheadAttention(E, H, grid2d, axis=axis, sequence_parallel=sequence_parallel, seed=2, dtype=F64)
        ref = _reference(layer)
        X, G = normal((B, T, E), 3), normal((B, T, E), 4)
        rows = token_rows(grid2d, axis, T) if sequence_parallel else slice(None)
        kw = _masks("causal+padding")
        x, xr = X[:, rows].clone().requires_grad_(), X.clone().requires_grad_()
        y, _ = layer(x, **kw)
        yr, _ = ref(xr, xr, xr, need_weights=False, **kw)
        (y * G[:, rows]).sum().backward()
        (yr * G).sum().backward()
        _check(grid2d, layer, ref, y, x, xr, yr, f"axis={axis} sp={sequence_parallel}")


@pytest.mark.mpi
def test_cross_attention_matches_torch(grid1d):  # type: ignore[no-untyped-def]
    """Query of 7 tokens over 4 keys; key and value distinct tensors."""
    layer = MultiheadAttention(E, H, grid1d, bias=False, seed=7, dtype=F64)
    ref = torch.nn.MultiheadAttention(E, H, bias=False, batch_first=True, dtype=F64)
    ref.load_state_dict(global_state_dict(layer))
    Q, K, V, G = normal((B, T, E), 1), normal((B, 4, E), 2), normal((B, 4, E), 3), normal((B, T, E), 4)
    ts = [t.clone().requires_grad_() for t in (Q, K, V)]
    rs = [t.clone().requires_grad_() for t in (Q, K, V)]
    pad = torch.tensor([[False, False, True, False], [False, False, False, False]])
    y, _ = layer(*ts, key_padding_mask=pad)
    yr, _ = ref(*rs, key_padding_mask=pad, need_weights=False)
    (y * G).sum().backward()
    (yr * G).sum().backward()
    assert_allclose(grid1d, y.detach(), yr.detach(), rtol=RTOL, atol=ATOL, what="forward")
    for t, r, name in zip(ts, rs, ("query", "key", "value")):
        assert_allclose(grid1d, t.grad, r.grad, rtol=RTOL, atol=ATOL, what=f"{name} grad")
    got, want = global_grads(layer), torch_grads(ref)
    for name in want:
        assert_allclose(grid1d, got[name], want[name], rtol=RTOL, atol=ATOL, what=f"{name} grad")


@pytest.mark.mpi
def test_heads_split_and_grid_independent_init(grid1d):  # type: ignore[no-untyped-def]
    """Whole heads per rank (balanced: 5 on 2 ranks is 3 + 2), and the gathered parameters of a seed
    are the same on any number of ranks (here: vs the layer on a 1-rank grid)."""
    layer = MultiheadAttention(E, H, grid1d, seed=11, dtype=F64)
    counts = MPI.COMM_WORLD.allgather(layer.heads[1] - layer.heads[0])
    want = [H // grid1d.size + (1 if r < H % grid1d.size else 0) for r in range(grid1d.size)]
    assert_all(grid1d, counts == want, f"heads per rank {counts}, expected {want}")
    assert_all(grid1d, layer.in_proj_weight.shape == (3, 2 * want[grid1d.rank], E), str(layer.in_proj_weight.shape))
    solo_grid = hpctp.ProcessGrid((1,), comm=MPI.COMM_SELF)
    solo = global_state_dict(MultiheadAttention(E, H, solo_grid, seed=11, dtype=F64))
    full = global_state_dict(layer)
    for name, t in solo.items():
        assert_allclose(grid1d, full[name], t, rtol=0, atol=0, what=name)
    bound = (6.0 / (4 * E)) ** 0.5  # torch's xavier_uniform_ of [3E, E]
    w = full["in_proj_weight"]
    assert_all(grid1d, w.shape == (3 * E, E) and float(w.abs().max()) <= bound, "in_proj_weight's range")
    assert_all(grid1d, not full["in_proj_bias"].any() and not full["out_proj.bias"].any(), "zero biases as torch")
    solo_grid.free()


@pytest.mark.mpi
def test_one_allreduce_forward_and_backward(grid1d):  # type: ignore[no-untyped-def]
    layer = MultiheadAttention(E, H, grid1d, seed=1, dtype=F64)
    x = normal((B, T, E), 1).requires_grad_()
    layer(x)  # the first call agrees on the arguments (uncounted control message)
    expected = {"Allreduce": 1} if grid1d.size > 1 else {}
    nbytes = B * T * E * 8 if grid1d.size > 1 else 0
    with CommCounter() as fwd:
        y, _ = layer(x, x, x)
    with CommCounter() as bwd:
        y.sum().backward()
    for what, c in (("forward", fwd), ("backward", bwd)):
        assert_all(grid1d, c.calls == expected, f"{what}: {c.calls}, expected {expected}")
        assert_all(grid1d, c.bytes_sent == nbytes, f"{what}: {c.bytes_sent} bytes, expected [B, T, E] = {nbytes}")


@pytest.mark.mpi
def test_errors(grid1d):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="divisible"):
        MultiheadAttention(10, 3, grid1d)
    with pytest.raises(ValueError, match="axis"):
        MultiheadAttention(10, 5, grid1d, axis=1)
    layer = MultiheadAttention(E, H, grid1d, dtype=F64)
    x = normal((B, T, E), 1)
    with pytest.raises(ValueError, match="need_weights"):
        layer(x, need_weights=True)
    with pytest.raises(ValueError, match="attn_mask"):
        layer(x, attn_mask=torch.zeros(T, T + 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="dtype|float"):
        layer(x.float())
    bad = normal((B, T, E + (1 if grid1d.rank == grid1d.size - 1 else 0)), 1)
    with pytest.raises(ValueError, match="embed|10"):  # one rank wrong: every rank raises, none waits
        layer(bad)
    if grid1d.size > 1:
        with pytest.raises(ValueError, match="differ"):  # token counts differ along the axis
            layer(normal((B, T + grid1d.rank, E), 1))
