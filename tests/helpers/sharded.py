"""Small models on a ParallelPlan's model grid and their one-process torch twins, a training step of each,
for the ShardedDataParallel tests (float64)."""

from __future__ import annotations

import torch
from mpi4py import MPI

import hpctp
from hpctp.layout import block_range
from hpctp.nn import ParallelPlan, ShardedDataParallel, global_mse_loss, global_state_dict

F64 = torch.float64
N = 5  # global batch: uneven over 2, 3 and 4 data groups
CIN, H, W = 2, 7, 5  # field [N, CIN, H, W]; H is split over the spatial axis (7 over 3: 3, 2, 2)
T, E, HIDDEN = 3, 4, 5  # tokens [N, T, E]; HIDDEN split over the tensor axis (5 over 2: 3, 2)


def _seeded(seed: int, make: type[torch.nn.Module], *args: object) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make(*args, dtype=F64)


class SpatialNet(torch.nn.Module):
    """Conv (halo) -> replicated Linear over W -> tanh -> replicated LayerNorm -> conv; plain torch without a grid."""

    def __init__(self, grid: hpctp.ProcessGrid | None = None, split: tuple[int | None, ...] = (None, None)) -> None:
        super().__init__()

        def conv(cin: int, cout: int, seed: int) -> torch.nn.Module:
            if grid is None:
                return _seeded(seed, torch.nn.Conv2d, cin, cout, 3, 1, 1)
            return hpctp.nn.Conv2d(cin, cout, 3, padding=1, dtype=F64, grid=grid, split=split, seed=seed)

        self.c1 = conv(CIN, 3, 1)
        self.lin = _seeded(2, torch.nn.Linear, W, W)
        self.norm = torch.nn.LayerNorm(W, dtype=F64)
        self.c2 = conv(3, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.norm(torch.tanh(self.lin(self.c1(x)))))


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = _seeded(4, torch.nn.Linear, E, HIDDEN)
        self.linear2 = _seeded(5, torch.nn.Linear, HIDDEN, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(torch.nn.functional.gelu(self.linear1(x)))


class TensorNet(torch.nn.Module):
    """Replicated Linear -> ParallelMLP (hidden split over ``axis``) -> replicated LayerNorm; plain torch without a grid."""

    def __init__(self, grid: hpctp.ProcessGrid | None = None, axis: int = 0) -> None:
        super().__init__()
        self.lin = _seeded(6, torch.nn.Linear, E, E)
        self.mlp = _MLP() if grid is None else hpctp.nn.ParallelMLP(E, HIDDEN, grid, axis=axis, seed=7, dtype=F64)
        self.norm = torch.nn.LayerNorm(E, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.mlp(torch.tanh(self.lin(x))))


def make_model(plan: ParallelPlan | None, kind: str) -> torch.nn.Module:
    """Collective over the model grid. ``kind`` ("spatial" or "tensor") on ``plan.model_grid``, or plain torch."""
    if kind == "tensor":
        return TensorNet() if plan is None else TensorNet(plan.model_grid, plan.tensor[0])
    if plan is None:
        return SpatialNet()
    split = (plan.spatial[0], None) if plan.spatial else (None, None)
    return SpatialNet(plan.model_grid, split)


def reference(model: torch.nn.Module, plan: ParallelPlan, kind: str) -> torch.nn.Module:
    """Collective over the model grid. The plain torch twin holding ``model``'s gathered parameters."""
    ref = make_model(None, kind)
    ref.load_state_dict(global_state_dict(model, grid=plan.model_grid))
    return ref


def global_batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local. The whole batch (inputs, targets) of a step."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "tensor":
        return torch.randn(N, T, E, generator=g, dtype=F64), torch.randn(N, T, E, generator=g, dtype=F64)
    return torch.randn(N, CIN, H, W, generator=g, dtype=F64), torch.randn(N, 1, H, W, generator=g, dtype=F64)


def local_batch(plan: ParallelPlan, kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local. This rank's share: its data group's samples, its spatial block of H."""
    x, y = global_batch(kind, step)
    a, b = plan.sample_range(N)
    x, y = x[a:b], y[a:b]
    if kind == "spatial" and plan.spatial:
        axis = plan.spatial[0]
        r0, r1 = block_range(H, plan.model_grid.dims[axis], plan.model_grid.coords[axis])
        x, y = x[:, :, r0:r1], y[:, :, r0:r1]
    return x.contiguous(), y.contiguous()


def sdp_step(sdp: ShardedDataParallel, opt: torch.optim.Optimizer, kind: str, step: int) -> float:
    """Collective over grid. One training step of the wrapped model; the global batch's loss."""
    plan = sdp.plan
    x, y = local_batch(plan, kind, step)
    loss = global_mse_loss(sdp(x), y, plan.grid, plan.loss_axes)
    loss.backward()
    sdp.step(opt)
    sdp.zero_grad()
    return float(loss.detach())


def torch_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """Local. One optimizer step of plain torch on the MSE of ``model(x)`` (a DistTensor's block) against ``y``."""
    pred = model(x)
    loss = torch.nn.functional.mse_loss(getattr(pred, "local", pred), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def ref_step(ref: torch.nn.Module, opt: torch.optim.Optimizer, kind: str, step: int) -> float:
    """Local. The same step of one process on the whole batch."""
    return torch_step(ref, opt, *global_batch(kind, step))


def first_ranks(n: int) -> MPI.Intracomm | None:
    """Collective over COMM_WORLD. A communicator of world ranks ``0..n-1`` there, None elsewhere."""
    world = MPI.COMM_WORLD
    sub = world.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
    return None if sub == MPI.COMM_NULL else sub
