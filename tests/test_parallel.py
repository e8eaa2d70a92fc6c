"""sync_gradients / broadcast_parameters and an end-to-end training step."""

from __future__ import annotations

import pytest
import torch

import hpctp
from hpctp.layout import Layout
from hpctp.nn.loss import global_mse_loss
from hpctp.nn.norm import BatchNorm2d
from hpctp.nn.parallel import broadcast_parameters, check_replicas, gradient_buckets, sync_gradients
from hpctp.ops.autograd import allreduce_sum, redistribute, sum_gradients
from hpctp.testing import assert_all, assert_allclose, assert_equal

F64 = torch.float64


def field(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


class Mixed(torch.nn.Module):
    """Replicated params of two dtypes, a frozen one, and a sharded one."""

    def __init__(self, grid: hpctp.ProcessGrid) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(3, dtype=F64))
        self.b = torch.nn.Parameter(torch.zeros(2, 2, dtype=F64))
        self.c = torch.nn.Parameter(torch.zeros(4, dtype=torch.float32))
        self.frozen = torch.nn.Parameter(torch.zeros(2, dtype=F64), requires_grad=False)
        layout = Layout((2 * grid.dims[0],), grid.dims, (0,))  # sharded over axis 0, replicated on the rest
        self.s = torch.nn.Parameter(torch.zeros(2, dtype=F64))
        self.s.hpctp_layout = layout  # type: ignore[attr-defined]


@pytest.mark.mpi
def test_sync_gradients_values_and_call_count(grid2d) -> None:  # type: ignore[no-untyped-def]
    m = Mixed(grid2d)
    r = grid2d.rank + 1.0
    m.a.grad = torch.full((3,), r, dtype=F64)
    m.b.grad = None  # unused on every rank: stays None
    m.c.grad = torch.arange(4, dtype=torch.float32) * r
    m.s.grad = torch.full((2,), r, dtype=F64)
    total = sum(range(1, grid2d.size + 1))
    # sum of (rank + 1) over the ranks that share this rank's axis-0 coordinate
    row = [grid2d.rank_of((grid2d.coords[0], j)) + 1.0 for j in range(grid2d.dims[1])]
    with hpctp.CommCounter() as cc:
        sync_gradients(m, grid2d)
    assert_allclose(grid2d, m.a.grad, torch.full((3,), float(total), dtype=F64))
    assert_allclose(grid2d, m.c.grad, torch.arange(4, dtype=torch.float32) * total)
    assert_allclose(grid2d, m.s.grad, torch.full((2,), sum(row), dtype=F64))
    assert_all(grid2d, m.b.grad is None and m.frozen.grad is None, "unused/frozen grads must stay None")
    # one Allreduce per dtype bucket on the grid; one per bucket on the axis-1 sub-communicator
    grid_calls = cc.per_comm["hpctp.grid"].calls.get("Allreduce", 0)
    sub_calls = cc.per_comm["hpctp.grid.axis1"].calls.get("Allreduce", 0)
    want_grid = 2 if grid2d.size > 1 else 0
    want_sub = 1 if grid2d.dims[1] > 1 else 0
    assert_equal(
        grid2d, (grid_calls, sub_calls, cc.calls.get("Allreduce", 0)), (want_grid, want_sub, want_grid + want_sub)
    )


@pytest.mark.mpi
def test_sync_gradients_partial_none_and_axes(grid2d) -> None:  # type: ignore[no-untyped-def]
    """A grad present on rank 0 only is summed (zeros elsewhere); axes=(0,) sums along axis 0 only."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=F64))
    m = torch.nn.Module()
    m.p = p
    p.grad = torch.ones(2, dtype=F64) if grid2d.rank == 0 else None
    sync_gradients(m, grid2d)
    assert_allclose(grid2d, p.grad, torch.ones(2, dtype=F64))
    p.grad = torch.full((2,), grid2d.rank + 1.0, dtype=F64)
    sync_gradients(m, grid2d, axes=(0,))
    col = sum(grid2d.rank_of((i, grid2d.coords[1])) + 1.0 for i in range(grid2d.dims[0]))
    assert_allclose(grid2d, p.grad, torch.full((2,), col, dtype=F64))
    with pytest.raises(ValueError, match="not an axis"):
        sync_gradients(m, grid2d, axes=(2,))
    bad = torch.nn.Parameter(torch.zeros(1))
    bad.hpctp_layout = Layout((1,), (grid2d.size, 7), (0,))  # type: ignore[attr-defined]
    m.bad = bad
    with pytest.raises(ValueError, match="hpctp_layout"):
        sync_gradients(m, grid2d)
    assert_all(grid2d, len(gradient_buckets(torch.nn.Linear(2, 2), grid2d)) == (1 if grid2d.size > 1 else 0))


@pytest.mark.mpi
def test_broadcast_parameters(grid2d) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(grid2d.rank)  # rank-dependent initialisation
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    m[1].running_mean.fill_(grid2d.rank)
    torch.manual_seed(0)
    want = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    want[1].running_mean.fill_(0)
    broadcast_parameters(m, grid2d, root=0)
    for (n, a), (_, b) in zip(m.state_dict().items(), want.state_dict().items(), strict=True):
        assert_equal(grid2d, a, b, what=n)
    with pytest.raises(ValueError, match="root"):
        broadcast_parameters(m, grid2d, root=grid2d.size)


@pytest.mark.mpi
def test_check_replicas_finds_the_ranks_that_drifted(grid2d) -> None:  # type: ignore[no-untyped-def]
    m = Mixed(grid2d)
    m.register_buffer("stat", torch.arange(3, dtype=torch.bfloat16))
    with torch.no_grad():
        m.s.fill_(float(grid2d.coords[0]))  # a different block per coordinate of axis 0: not a drift
    assert_all(grid2d, check_replicas(m, grid2d) == {}, "identical replicas")
    last = grid2d.size - 1
    with torch.no_grad():
        if grid2d.rank == last:
            m.b[1, 0] += 1e-12  # one bit is enough
            m.stat[2] = -1
            m.s[0] += 1
    got = check_replicas(m, grid2d)
    axis0 = [r for r in range(grid2d.size) if grid2d.coords_of(r)[0] == grid2d.coords_of(last)[0]]
    want = {"b": [last], "stat": [last]} if grid2d.size > 1 else {}
    if len(axis0) > 1:  # the sharded block is replicated along axis 1: its other copies are there
        want["s"] = [last]
    assert_all(grid2d, got == want, f"{got} != {want}")
    broadcast_parameters(m, grid2d, root=0)  # replicated copies equal again; the sharded one is left alone
    assert_all(grid2d, check_replicas(m, grid2d) == ({"s": [last]} if "s" in want else {}), "after broadcast")
    if grid2d.size > 1:
        extra = torch.nn.Linear(1, 1) if grid2d.rank == 0 else torch.nn.Linear(1, 1, bias=False)
        with pytest.raises(ValueError, match="check_replicas: ranks passed different names"):
            check_replicas(extra, grid2d)
    m.s.hpctp_layout = Layout((2,), (grid2d.size,), (0,))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="parameter 's': hpctp_layout must be a Layout on a grid of dims"):
        check_replicas(m, grid2d)


@pytest.mark.mpi
def test_autograd_collectives(grid2d) -> None:  # type: ignore[no-untyped-def]
    """allreduce_sum: identity backward; sum_gradients: sum backward; redistribute: inverse backward."""
    x = torch.full((2,), grid2d.rank + 1.0, dtype=F64, requires_grad=True)
    y = allreduce_sum(x, grid2d)
    n = grid2d.size
    assert_allclose(grid2d, y.detach(), torch.full((2,), n * (n + 1) / 2, dtype=F64))
    (y * 3).sum().backward()
    assert_allclose(grid2d, x.grad, torch.full((2,), 3.0, dtype=F64))
    z = torch.ones(2, dtype=F64, requires_grad=True)
    (sum_gradients(z, grid2d) * (grid2d.rank + 1.0)).sum().backward()
    assert_allclose(grid2d, z.grad, torch.full((2,), n * (n + 1) / 2, dtype=F64))
    shape = (5, 7)
    src = Layout(shape, grid2d.dims, (0, 1))
    dst = Layout(shape, grid2d.dims, (1, None))
    g = field(shape, 1)
    xl = g[src.local_slices(grid2d.coords)].clone().requires_grad_(True)
    yl = redistribute(xl, grid2d, src, dst)
    assert_equal(grid2d, yl.detach(), g[dst.local_slices(grid2d.coords)])
    w = field(shape, 2)
    # dst is replicated along grid axis 0; every replica computes the same (full) gradient
    (yl * w[dst.local_slices(grid2d.coords)]).sum().backward()
    assert_allclose(grid2d, xl.grad, w[src.local_slices(grid2d.coords)], rtol=1e-14)
    wrong = torch.zeros(1, 1, dtype=F64) if grid2d.rank == 0 else g[src.local_slices(grid2d.coords)].clone()
    with pytest.raises(ValueError, match="expects"):
        redistribute(wrong, grid2d, src, dst)  # bad block on rank 0 only: raised everywhere


class Net(torch.nn.Module):
    """Pointwise conv (replicated weight, no halo) + distributed BatchNorm."""

    def __init__(self, grid: hpctp.ProcessGrid | None) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, kernel_size=1, dtype=F64)
        self.norm = (
            BatchNorm2d(4, grid=grid, split=(0, 1), dtype=F64)
            if grid is not None
            else torch.nn.BatchNorm2d(4, dtype=F64)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.conv(x)))


@pytest.mark.mpi
def test_training_step_matches_single_process(grid2d) -> None:  # type: ignore[no-untyped-def]
    shape = (2, 3, 7, 9)
    layout = Layout(shape, grid2d.dims, (None, None, 0, 1))
    sl = layout.local_slices(grid2d.coords)
    torch.manual_seed(grid2d.rank + 10)
    net = Net(grid2d)
    broadcast_parameters(net, grid2d)  # replicas start identical
    ref = Net(None)
    ref.load_state_dict(net.state_dict())
    bufs: dict[int, torch.Tensor] = {}

    def sgd(model: torch.nn.Module, lr: float = 0.1, mu: float = 0.9) -> None:
        """torch.optim.SGD(momentum=mu) by hand (torch.optim's first use imports dynamo: seconds)."""
        with torch.no_grad():
            for p in model.parameters():
                b = bufs.get(id(p))
                b = p.grad.clone() if b is None else b.mul_(mu).add_(p.grad)
                bufs[id(p)] = b
                p.sub_(lr * b)
                p.grad = None

    for step in range(3):
        x, t = field(shape, 100 + step), field((2, 4, 7, 9), 200 + step)
        loss = global_mse_loss(net(x[sl]), t[(*sl[:1], slice(None), *sl[2:])], grid2d)
        loss.backward()
        sync_gradients(net, grid2d)
        sgd(net)
        loss_ref = torch.nn.functional.mse_loss(ref(x), t)
        loss_ref.backward()
        sgd(ref)
        assert_allclose(grid2d, loss.detach(), loss_ref.detach(), rtol=1e-12, what=f"loss {step}")
    for (n, a), (_, b) in zip(net.state_dict().items(), ref.state_dict().items(), strict=True):
        assert_allclose(grid2d, a, b, rtol=1e-10, atol=1e-13, what=n)
