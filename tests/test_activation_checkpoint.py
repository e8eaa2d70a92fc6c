"""Activation checkpointing through layers that communicate: gradients bitwise those without it, fewer saved bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hpctp
from hpctp.nn import (
    BatchNorm2d,
    Checkpointed,
    Conv2d,
    GroupNorm,
    MultiheadAttention,
    SpectralConv2d,
    TransformerBlock,
    checkpoint,
    global_mse_loss,
    sync_gradients,
)
from hpctp.testing import assert_all, assert_allclose, assert_equal

F64 = torch.float64
N, CIN, C, H, W = 2, 2, 8, 8, 4  # the field [N, C, H, W]: H split over the ranks, W whole
SPLIT = (0, None)
P_DROP = 0.2


def _field(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _dist(grid: hpctp.ProcessGrid, X: torch.Tensor) -> hpctp.DistTensor:
    layout = hpctp.Layout(tuple(X.shape), grid.dims, (None, None, *SPLIT))
    return hpctp.DistTensor(X[layout.local_slices(grid.coords)].clone(), grid, layout)


class _Chain(torch.nn.Module):
    """conv (halo) -> dropout (torch's generator) -> spectral conv (+ residual) -> group norm -> a sequence-parallel
    transformer block with dropout (its own generator) over the pixels as tokens -> batch norm -> dropout -> conv.

    With ``ckpt``, only some layers are checkpointed: ``conv1`` and ``block`` (:class:`Checkpointed`) and the
    tail (:func:`checkpoint` of a bound method, DistTensor in and out, torch's dropout inside); the spectral
    conv, the group norm and the first dropout run plainly between them."""

    def __init__(self, grid: hpctp.ProcessGrid, ckpt: bool) -> None:
        super().__init__()
        kw: dict[str, Any] = {"grid": grid, "split": SPLIT, "dtype": F64}
        self.ckpt = ckpt
        self.conv1: torch.nn.Module = Conv2d(CIN, C, 3, padding=1, seed=1, **kw)
        self.spectral = SpectralConv2d(C, C, (2, 2), seed=2, **kw)
        self.norm = GroupNorm(2, C, **kw)
        self.block: torch.nn.Module = TransformerBlock(
            C, 2, 2.0, grid, axis=0, sequence_parallel=True, dropout=P_DROP, seed=3, dtype=F64
        )
        self.bn = BatchNorm2d(C, **kw)
        self.conv2 = Conv2d(C, 1, 3, padding=1, seed=4, **kw)
        if ckpt:
            self.conv1, self.block = Checkpointed(self.conv1), Checkpointed(self.block)

    def tail(self, h: hpctp.DistTensor) -> hpctp.DistTensor:
        h = self.bn(h)
        return self.conv2(h.with_local(torch.nn.functional.dropout(h.local, P_DROP)))

    def forward(self, x: hpctp.DistTensor) -> hpctp.DistTensor:
        h = self.conv1(x)
        h = h.with_local(torch.nn.functional.dropout(h.local, P_DROP))
        h = self.norm(h.with_local(h.local + self.spectral(h).local))
        n, c, rows, w = h.local.shape
        t = self.block(h.local.permute(0, 2, 3, 1).reshape(n, rows * w, c))
        h = h.with_local(t.reshape(n, rows, w, c).permute(0, 3, 1, 2))
        return checkpoint(self.tail, h) if self.ckpt else self.tail(h)


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of the distinct storages autograd keeps for backward (parameters excluded)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.storages: dict[int, int] = {}
        skip = {p.untyped_storage().data_ptr() for p in params}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() not in skip:
                self.storages[s.data_ptr()] = s.nbytes()
            return t

        super().__init__(pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _steps(grid: hpctp.ProcessGrid, ckpt: bool, steps: int = 2) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Collective over grid. ``steps`` forward/backward/SGD steps: the gradients (input's and parameters', synced)
    of each step and the activation bytes kept for each backward."""
    torch.manual_seed(7 + grid.rank)  # the plain dropout's masks: the same sequence in both runs
    model = _Chain(grid, ckpt)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    target = _dist(grid, _field((N, 1, H, W), 2)).local
    grads, kept = [], []
    for step in range(steps):
        x = _dist(grid, _field((N, CIN, H, W), 1 + 10 * step))
        x.local.requires_grad_()
        opt.zero_grad()
        saved = _SavedBytes(params)
        with saved:
            loss = global_mse_loss(model(x).local, target, grid)
        kept.append(saved.total)
        loss.backward()
        sync_gradients(model, grid)
        grads.append([x.local.grad] + [p.grad for p in params])
        opt.step()
    return grads, kept


@pytest.mark.mpi
def test_checkpointed_chain_gradients_bitwise_equal(grid1d):  # type: ignore[no-untyped-def]
    """Only some layers checkpointed, in a chain whose recomputes exchange halos, gather and scatter tokens,
    sum norm statistics and draw dropout masks from torch's and from the block's generator, during backward,
    between the other layers' backward messages: no deadlock, every gradient bitwise the plain run's over two
    steps (the second step's masks come from generators the first recompute put back), fewer bytes kept."""
    plain, kept_plain = _steps(grid1d, ckpt=False)
    ckpt, kept_ckpt = _steps(grid1d, ckpt=True)
    for step, (a, b) in enumerate(zip(plain, ckpt)):
        assert_equal(grid1d, len(b), len(a), "gradient count")
        same = [ga is not None and gb is not None and torch.equal(ga, gb) for ga, gb in zip(a, b)]
        assert_all(
            grid1d,
            all(same),
            f"step {step}: gradients differ (tensor index {same.index(False) if False in same else -1})",
        )
    assert_all(grid1d, all(k < p for k, p in zip(kept_ckpt, kept_plain)), f"kept bytes {kept_ckpt} vs {kept_plain}")
    if grid1d.rank == 0:
        print(f"activation bytes kept for backward: plain {kept_plain[0]}, checkpointed {kept_ckpt[0]}")


@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_checkpointed_region_with_empty_output_blocks(grid1d):  # type: ignore[no-untyped-def]
    """GroupNorm then a stride-2 conv of 4 rows: on 4 ranks two have no output row but send their input row
    to a neighbour's halo. Their conv saves nothing, so their first saved tensor in backward comes after the
    halo's adjoint exchange, while the neighbour's comes before it: recomputing at the first unpack (torch's
    rule) deadlocks there; recomputing where the gradient reaches the region's output does not."""
    X = _field((1, 2, 4, 3), 9)
    grads = []
    for ckpt in (False, True):
        layers = torch.nn.Sequential(
            GroupNorm(1, 2, grid=grid1d, split=SPLIT, dtype=F64),
            Conv2d(2, 2, 3, stride=2, padding=1, grid=grid1d, split=SPLIT, seed=1, dtype=F64),
        )
        model = Checkpointed(layers) if ckpt else layers
        x = _dist(grid1d, X)
        x.local.requires_grad_()
        y = model(x)
        global_mse_loss(y.local, torch.ones_like(y.local), grid1d).backward()
        grads.append([x.local.grad] + [p.grad for p in layers.parameters()])
    assert_all(grid1d, all(torch.equal(a, b) for a, b in zip(*grads)), "gradients differ")


@pytest.mark.mpi
def test_checkpointed_attention_keeps_self_attention_path(grid1d):  # type: ignore[no-untyped-def]
    """``checkpoint(mha, t, t, t)``: one tensor passed three times stays one object in the recompute (the
    layer's ``key is query`` path, one all-reduce backward), so the gradients are the plain call's bitwise."""
    mha = MultiheadAttention(C, 2, grid1d, seed=5, dtype=F64)
    grads = []
    for ckpt in (False, True):
        t = _field((N, 5, C), 6).requires_grad_()
        mha.zero_grad()
        y, _ = checkpoint(mha, t, t, t, need_weights=False) if ckpt else mha(t, t, t, need_weights=False)
        (y * _field(tuple(y.shape), 7)).sum().backward()
        grads.append([t.grad] + [p.grad for p in mha.parameters()])
    assert_all(grid1d, all(torch.equal(a, b) for a, b in zip(*grads)), "gradients differ")


@pytest.mark.mpi
def test_checkpointed_batch_norm_updates_running_stats_as_torch(grid1d):  # type: ignore[no-untyped-def]
    """The recompute updates the running statistics again, as torch's BatchNorm2d under torch's checkpoint:
    two batches counted per step, the global field's statistics applied twice."""
    bn = Checkpointed(BatchNorm2d(C, grid=grid1d, split=SPLIT, dtype=F64))
    ref = torch.nn.BatchNorm2d(C, dtype=F64)
    X = _field((N, C, H, W), 8)
    x = _dist(grid1d, X)
    x.local.requires_grad_()
    bn(x).local.sum().backward()
    Xr = X.clone().requires_grad_()
    torch.utils.checkpoint.checkpoint(ref, Xr, use_reentrant=False).sum().backward()
    inner: Any = bn.module
    assert_equal(grid1d, int(inner.num_batches_tracked), int(ref.num_batches_tracked), "batches counted")
    assert_equal(grid1d, int(ref.num_batches_tracked), 2, "torch counts the recompute")
    assert_allclose(grid1d, inner.running_mean, ref.running_mean, rtol=1e-12, what="running mean")
    assert_allclose(grid1d, inner.running_var, ref.running_var, rtol=1e-12, what="running var")
    assert_allclose(grid1d, x.with_local(x.local.grad).gather(None), Xr.grad, rtol=1e-10, atol=1e-12, what="input grad")


@pytest.mark.mpi
def test_checkpointed_is_plain_in_eval_and_without_grad(grid1d):  # type: ignore[no-untyped-def]
    conv = Conv2d(CIN, C, 3, padding=1, seed=1, grid=grid1d, split=SPLIT, dtype=F64)
    wrapped = Checkpointed(conv)
    x = _dist(grid1d, _field((N, CIN, H, W), 1))
    want = conv(x).local
    with torch.no_grad():
        got = wrapped(x).local
    wrapped.eval()
    got_eval = wrapped(x).local
    assert_all(grid1d, torch.equal(got, want) and torch.equal(got_eval.detach(), want.detach()), "outputs differ")
    assert_equal(grid1d, sorted(n for n, _ in wrapped.named_parameters()), ["module.bias", "module.weight"], "names")


def test_checkpoint_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="function must be callable"):
        checkpoint(3, torch.zeros(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Checkpointed wraps a torch.nn.Module, got function"):
        Checkpointed(lambda x: x)  # type: ignore[arg-type]


def test_checkpoint_forward_keeps_names_and_gradients() -> None:
    """In place: the state dict's names stay, gradients are bitwise those without it, fewer bytes are saved."""

    def make() -> torch.nn.Sequential:
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.GELU(), torch.nn.Linear(32, 6)).double()

    plain, ckpt = make(), make()
    names = list(ckpt.state_dict())
    assert hpctp.nn.checkpoint_forward(ckpt) is ckpt
    assert list(ckpt.state_dict()) == names
    x = torch.randn(5, 6, dtype=torch.float64)
    saved = []
    for model in (plain, ckpt):
        count = [0]

        def pack(t: torch.Tensor, count: list[int] = count) -> torch.Tensor:
            count[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = model(x)
        (y * y).sum().backward()
        saved.append(count[0])
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert saved[1] < saved[0], saved
    ckpt.eval()
    with torch.no_grad():
        assert torch.equal(ckpt(x), plain(x))
    with pytest.raises(TypeError, match="Module"):
        hpctp.nn.checkpoint_forward(lambda t: t)  # type: ignore[arg-type]
