"""Checkpoint restart job for tests/test_checkpoint.py (run under mpiexec).

    mpiexec -n 4 python tests/scripts/ckpt_job.py save DIR 2x2   # train 3 steps, save, train 2 more
    mpiexec -n k python tests/scripts/ckpt_job.py load DIR AxB   # restore on an AxB grid, train 2 steps

Rank 0 writes DIR/<mode>_<A>x<B>.npz (no pickle): the parameters right after the
checkpoint (gathered to global arrays), the step, and the losses of the next two steps.

The model has replicated parameters (a Linear layer), a replicated buffer, a weight
matrix sharded over both grid axes and a vector sharded over grid axis 1 (replicated
along axis 0, so only primary replicas write it). Its loss is a sum of local
contributions all-reduced in an autograd Function; float64 and Adam.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

import hpctp
import hpctp.io
from hpctp.layout import Layout

SAVE_STEPS, NEXT_STEPS = 3, 2


class AllreduceSum(torch.autograd.Function):
    """Sum of a scalar over all ranks; the gradient of each rank's term is the incoming one."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: object) -> torch.Tensor:  # type: ignore[override]
        out = t.detach().clone().reshape(1)
        hpctp.comm.allreduce(comm, out)
        return out.reshape(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def sharded(global_value: np.ndarray, grid: hpctp.ProcessGrid, split: tuple) -> torch.nn.Parameter:
    layout = Layout(global_value.shape, grid.dims, split)
    p = torch.nn.Parameter(torch.from_numpy(global_value[layout.local_slices(grid.coords)].copy()))
    p.hpctp_layout = layout  # type: ignore[attr-defined]
    return p


class Net(torch.nn.Module):
    def __init__(self, grid: hpctp.ProcessGrid, seed: int) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.grid = grid
        self.lin = torch.nn.Linear(8, 6, dtype=torch.float64)
        with torch.no_grad():
            self.lin.weight.copy_(torch.from_numpy(rng.standard_normal((6, 8)) * 0.3))
            self.lin.bias.copy_(torch.from_numpy(rng.standard_normal(6) * 0.1))
        self.w = sharded(rng.standard_normal((6, 10)), grid, (0, 1))
        self.b = sharded(rng.standard_normal(10), grid, (1,))
        self.register_buffer("scale", torch.tensor([1.5], dtype=torch.float64))
        data = np.random.default_rng(1234)  # same data and targets for every run
        self.x = torch.from_numpy(data.standard_normal((5, 8)))
        self.tw = torch.from_numpy(data.standard_normal((6, 10)))
        self.tb = torch.from_numpy(data.standard_normal(10))

    def loss(self) -> torch.Tensor:
        g = self.grid
        y = torch.tanh(self.lin(self.x)) * self.scale
        m = y.mean(0)
        lw, lb = self.w.hpctp_layout, self.b.hpctp_layout  # type: ignore[attr-defined]
        rows, cols = lw.local_slices(g.coords)
        local = ((m[rows, None] * self.w - self.tw[rows, cols]) ** 2).sum()
        if lb.is_primary(g.coords):
            (bcols,) = lb.local_slices(g.coords)
            local = local + ((self.b * m.sum() - self.tb[bcols]) ** 2).sum()
        local = local + (y**2).mean() / g.size  # replicated term, counted once overall
        return AllreduceSum.apply(local, g.comm)

    def sync_grads(self) -> None:
        """Sum gradients of replicated parameters (over the grid) and of replicas (over replicated axes)."""
        for p in self.parameters():
            if p.grad is None:  # e.g. a replica that did not use its block
                p.grad = torch.zeros_like(p)
            layout = getattr(p, "hpctp_layout", None)
            if layout is None:
                hpctp.comm.allreduce(self.grid.comm, p.grad)
            else:
                for axis in layout.replicated_axes:
                    hpctp.comm.allreduce(self.grid.sub(axis), p.grad)


def train_step(net: Net, opt: torch.optim.Optimizer) -> float:
    opt.zero_grad()
    loss = net.loss()
    loss.backward()
    net.sync_grads()
    opt.step()
    return float(loss.detach())


def gathered(net: Net) -> dict[str, np.ndarray]:
    out = {}
    for name, p in net.named_parameters():
        layout = getattr(p, "hpctp_layout", None)
        if layout is None:
            out[name] = p.detach().numpy().copy()
        else:
            full = hpctp.DistTensor(p.detach().numpy().copy(), net.grid, layout).gather(root=None)
            out[name] = np.asarray(full)
    return out


def main() -> None:
    mode, folder, dims = sys.argv[1], sys.argv[2], tuple(int(d) for d in sys.argv[3].split("x"))
    grid = hpctp.ProcessGrid(dims)
    path = os.path.join(folder, "ckpt.h5")
    if mode == "save":
        net = Net(grid, seed=0)
        opt = torch.optim.Adam(net.parameters(), lr=0.05)
        for _ in range(SAVE_STEPS):
            train_step(net, opt)
        hpctp.io.save_checkpoint(path, net, opt, SAVE_STEPS, grid)
        step = SAVE_STEPS
    else:
        net = Net(grid, seed=99)  # different values: everything must come from the file
        opt = torch.optim.Adam(net.parameters(), lr=0.5)  # lr too: param_groups are restored
        step = hpctp.io.load_checkpoint(path, net, opt, grid)
    params = gathered(net)
    losses = [train_step(net, opt) for _ in range(NEXT_STEPS)]
    if grid.rank == 0:
        out = os.path.join(folder, f"{mode}_{sys.argv[3]}.npz")
        np.savez(out, step=np.int64(step), losses=np.array(losses), lr=opt.param_groups[0]["lr"], **params)
    grid.free()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        from mpi4py import MPI

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)  # never leave the other ranks waiting
