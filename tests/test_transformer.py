"""ParallelMLP and the pre-norm TransformerBlock (tensor and sequence parallel) against torch in one process."""

from __future__ import annotations

import pytest
import torch
from helpers.agreement import count_agreements
from helpers.transformer import F64, batch_rows, global_grads, normal, token_rows, torch_grads
from mpi4py import MPI

import hpctp
from hpctp.comm import CommCounter
from hpctp.nn import check_replicas, sync_gradients
from hpctp.nn.mlp import ParallelMLP
from hpctp.nn.state_dict import global_state_dict
from hpctp.nn.transformer import TransformerBlock
from hpctp.testing import assert_all, assert_allclose, assert_equal

RTOL, ATOL = 1e-10, 1e-12
B, T, E, H, RATIO = 3, 7, 10, 5, 1.5  # hidden 15: uneven on 2, 4, 6 ranks


def _reference_block(block: TransformerBlock) -> torch.nn.TransformerEncoderLayer:
    ref = torch.nn.TransformerEncoderLayer(
        E, H, int(RATIO * E), dropout=0.0, activation="gelu", batch_first=True, norm_first=True, dtype=F64
    )
    ref.load_state_dict(global_state_dict(block))  # strict: the gathered state is torch's
    return ref


@pytest.mark.mpi
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_parallel_mlp_matches_torch(grid1d, sequence_parallel):  # type: ignore[no-untyped-def]
    mlp = ParallelMLP(E, 15, grid1d, sequence_parallel=sequence_parallel, seed=3, dtype=F64)
    ref = torch.nn.Sequential(torch.nn.Linear(E, 15, dtype=F64), torch.nn.GELU(), torch.nn.Linear(15, E, dtype=F64))
    full = global_state_dict(mlp)
    ref.load_state_dict({k.replace("linear1", "0").replace("linear2", "2"): v for k, v in full.items()})
    X, G = normal((B, T, E), 1), normal((B, T, E), 2)
    rows = token_rows(grid1d, 0, T) if sequence_parallel else slice(None)
    x, xr = X[:, rows].clone().requires_grad_(), X.clone().requires_grad_()
    (mlp(x) * G[:, rows]).sum().backward()
    yr = ref(xr)
    (yr * G).sum().backward()
    assert_allclose(grid1d, mlp(X[:, rows]).detach(), yr.detach()[:, rows], rtol=RTOL, atol=ATOL, what="forward")
    assert_allclose(grid1d, x.grad, xr.grad[:, rows], rtol=RTOL, atol=ATOL, what="input grad")
    sync_gradients(mlp, grid1d)  # sums linear2.bias over the token blocks with sequence parallelism, else nothing
    got, want = global_grads(mlp), torch_grads(ref)
    for name, g in want.items():
        ours = name.replace("0.", "linear1.").replace("2.", "linear2.")
        assert_allclose(grid1d, got[ours], g, rtol=RTOL, atol=ATOL, what=f"{name} grad")


@pytest.mark.mpi
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_block_matches_torch_encoder_layer(grid2d, sequence_parallel):  # type: ignore[no-untyped-def]
    """Tensor parallel over one axis, data parallel (batch 3 split, some ranks empty) over the other;
    one sync_gradients over the whole grid gives torch's gradients."""
    for axis in range(2):
        block = TransformerBlock(E, H, RATIO, grid2d, axis=axis, sequence_parallel=sequence_parallel, seed=5, dtype=F64)
        ref = _reference_block(block)
        X, G = normal((B, T, E), 1), normal((B, T, E), 2)
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        b = batch_rows(grid2d, axis, B)
        t = token_rows(grid2d, axis, T) if sequence_parallel else slice(None)
        x = X[b, t].clone().requires_grad_()
        y = block(x, attn_mask=causal, is_causal=True)
        (y * G[b, t]).sum().backward()
        xr = X.clone().requires_grad_()
        yr = ref(xr, src_mask=causal, is_causal=True)
        (yr * G).sum().backward()
        what = f"axis={axis} sp={sequence_parallel}"
        assert_allclose(grid2d, y.detach(), yr.detach()[b, t], rtol=RTOL, atol=ATOL, what=f"{what} forward")
        assert_allclose(grid2d, x.grad, xr.grad[b, t], rtol=RTOL, atol=ATOL, what=f"{what} input grad")
        sync_gradients(block, grid2d)
        got, want = global_grads(block), torch_grads(ref)
        assert_equal(grid2d, sorted(got), sorted(want), f"{what} names")
        for name, g in want.items():
            assert_allclose(grid2d, got[name], g, rtol=RTOL, atol=ATOL, what=f"{what} {name} grad")
        assert_equal(grid2d, len(check_replicas(block, grid2d)), 0, "replicas identical")


@pytest.mark.mpi
def test_sequence_parallel_sends_the_bytes_of_the_all_reduce(grid1d):  # type: ignore[no-untyped-def]
    """Forward and backward: two all-reduces of [B, T, E] without sequence parallelism; with it an
    all-gather and a reduce-scatter per region, together the bytes of a bandwidth-optimal all-reduce
    (2 (P - 1) / P of the tensor per rank), summed over the ranks exactly, tokens uneven or not."""
    p, n = grid1d.size, B * T * E * 8
    totals = {}
    for sp in (False, True):
        block = TransformerBlock(E, H, RATIO, grid1d, sequence_parallel=sp, seed=1, dtype=F64)
        x = normal((B, T, E), 1)[:, token_rows(grid1d, 0, T) if sp else slice(None)].requires_grad_()
        block(x)  # the first call agrees on the arguments
        with CommCounter() as control:
            if sp:
                block.self_attn.agree(x, x, x)  # the token counts: one small Allgather per block call
        with CommCounter() as fwd:
            y = block(x)
        with CommCounter() as bwd:
            y.sum().backward()
        sent = [fwd.bytes_sent - control.bytes_sent, bwd.bytes_sent]
        totals[sp] = [MPI.COMM_WORLD.allreduce(s) for s in sent]
        if p > 1:
            want = {"Allgather": 1, "Allgatherv": 2, "Alltoallv": 2} if sp else {"Allreduce": 2}
            assert_all(grid1d, fwd.calls == want, f"sp={sp} forward calls {fwd.calls}")
            want = {"Allgatherv": 2, "Alltoallv": 2} if sp else {"Allreduce": 2}
            assert_all(grid1d, bwd.calls == want, f"sp={sp} backward calls {bwd.calls}")
    assert_equal(grid1d, totals[False], [2 * n * p if p > 1 else 0] * 2, "all-reduce bytes")
    assert_equal(grid1d, [t * p for t in totals[True]], [t * 2 * (p - 1) for t in totals[False]], "sp bytes")


@pytest.mark.mpi
def test_dropout_keeps_replicas_equal(grid1d):  # type: ignore[no-untyped-def]
    block = TransformerBlock(E, H, RATIO, grid1d, dropout=0.5, seed=2, dtype=F64)
    y = block(normal((B, T, E), 1))
    ys = MPI.COMM_WORLD.allgather(y.detach())
    assert_all(grid1d, all(torch.equal(ys[0], o) for o in ys), "the ranks of the axis draw the same masks")
    block.eval()
    block_ref = _reference_block(block)
    assert_allclose(
        grid1d,
        block(normal((B, T, E), 1)).detach(),
        block_ref.eval()(normal((B, T, E), 1)).detach(),
        rtol=RTOL,
        atol=ATOL,
    )


@pytest.mark.mpi
def test_init_independent_of_grid_and_rms_norm(grid1d):  # type: ignore[no-untyped-def]
    solo_grid = hpctp.ProcessGrid((1,), comm=MPI.COMM_SELF)
    for norm in ("layer", "rms"):
        full = global_state_dict(TransformerBlock(E, H, RATIO, grid1d, norm=norm, seed=9, dtype=F64))
        solo = global_state_dict(TransformerBlock(E, H, RATIO, solo_grid, norm=norm, seed=9, dtype=F64))
        assert_equal(grid1d, sorted(full), sorted(solo), "names")
        for name, t in solo.items():
            assert_allclose(grid1d, full[name], t, rtol=0, atol=0, what=f"{norm} {name}")
    solo_grid.free()


@pytest.mark.mpi
def test_errors(grid1d):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="attention"):  # (ring attention's errors: tests/test_transformer_dist.py)
        TransformerBlock(E, H, RATIO, grid1d, attention="sparse")
    with pytest.raises(ValueError, match="mlp_ratio"):
        TransformerBlock(E, H, 0.01, grid1d)
    with pytest.raises(ValueError, match="norm"):
        TransformerBlock(E, H, RATIO, grid1d, norm="batch")
    with pytest.raises(ValueError, match="activation"):
        ParallelMLP(E, 4, grid1d, activation="swish2")
    block = TransformerBlock(E, H, RATIO, grid1d, sequence_parallel=True, dtype=F64)
    x = normal((B + (1 if grid1d.rank == 0 else 0), 2, E), 1)
    if grid1d.size > 1:
        with pytest.raises(ValueError, match="differ"):  # batch differs along a sequence-parallel axis
            block(x)
    block = TransformerBlock(E, H, RATIO, grid1d, dtype=F64)
    with pytest.raises(ValueError, match="10"):  # one rank's embedding wrong: all raise before the norm
        block(normal((B, T, E + (1 if grid1d.rank == grid1d.size - 1 else 0)), 1))


@pytest.mark.mpi
def test_arguments_agreed_once_per_shape(grid1d, monkeypatch):  # type: ignore[no-untyped-def]
    calls = count_agreements(monkeypatch)
    block = TransformerBlock(E, H, RATIO, grid1d, dtype=F64)
    for _ in range(3):
        block(normal((B, T, E), 1)).sum().backward()
    # one agreement for the block's input: its attention and MLP run on the agreed arguments
    assert_all(grid1d, calls == ["MultiheadAttention"], f"agreements {calls}")
