"""Sharded data parallelism (ZeRO/FSDP stages of hpctp.nn.ShardedDataParallel): state memory per rank and
step time, on 1, 2 and 4 ranks, against one process.

Usage::

    python benchmarks/memory.py                            # mpiexec -n 1, 2, 4 of itself; the tables
    python benchmarks/memory.py --ranks 2 --width 32       # smaller, one rank count
    mpiexec -n 4 python benchmarks/memory.py --worker      # one rank count (what the launcher runs)

The model is a wide FNO (``--width`` channels, ``--depth`` Fourier layers of ``--modes`` modes, each
with its 1x1 convolution) on ``--size``-square 2-channel fields, float32, trained with Adam on a
global batch of ``--batch`` samples split over the ranks (data parallelism: ``ParallelPlan(grid,
data=(0,))``; gradient buckets of ``--bucket-mib``, default 4: several per model, so that their messages can
start during backward). For every configuration, in ONE run per rank count:

* **state** per rank: the bytes of parameters, gradients and Adam state held by this rank, as
  *kept* between steps (after the step: what the rank must hold for the model to exist) and at the
  *peak* inside the step (sampled after every module's forward and backward, so the whole
  parameters and gradients that stage 3 gathers for a unit, and the next unit prefetched, count
  while they exist); the maximum over ranks, against one process's (the same model unsharded).
* **step**: the median over ``--steps`` steps of the slowest rank's time; against the unsharded
  data-parallel step (stage 0, overlap on) of the same run, and against one process running the
  global batch with as many threads as there are ranks (rank 0 alone while the others sleep).
* **activations**: bytes that autograd saves in forward (``saved_tensors_hooks``), without and
  with activation checkpointing (``hpctp.nn.checkpoint`` per layer).
* ``--budget-mib``: whether the state fits a per-rank budget (default 64 MiB: one process does not).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="rank counts (launcher)")
    p.add_argument("--width", type=int, default=48)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--modes", type=int, default=12)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budget-mib", type=float, default=64.0)
    p.add_argument("--bucket-mib", type=float, default=4.0, help="gradient bucket size (several buckets: overlap)")
    p.add_argument("--worker", action="store_true", help="run one rank count under mpiexec")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- model
def _model(args: argparse.Namespace, grid: Any) -> torch.nn.Module:
    from hpctp.nn import Conv2d, SpectralConv2d

    w, f32 = args.width, torch.float32

    class WideFNO(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lift = Conv2d(2, w, 1, grid=grid, seed=0, dtype=f32)
            self.spectral = torch.nn.ModuleList(
                SpectralConv2d(w, w, args.modes, grid=grid, seed=1 + i, dtype=f32) for i in range(args.depth)
            )
            self.pointwise = torch.nn.ModuleList(
                Conv2d(w, w, 1, grid=grid, seed=100 + i, dtype=f32) for i in range(args.depth)
            )
            self.head = Conv2d(w, 2, 1, grid=grid, seed=200, dtype=f32)

        def forward(self, x: Any) -> Any:
            h = self.lift(x)
            for k, c in zip(self.spectral, self.pointwise):
                a, b = k(h), c(h)
                h = a.with_local(torch.nn.functional.gelu(a.local + b.local))
            return self.head(h)

    return WideFNO()


def _layers(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList):
            yield from m


def _checkpoint_layers(model: torch.nn.Module) -> None:
    from hpctp.nn import checkpoint_forward

    for layer in _layers(model):
        checkpoint_forward(layer)


# ---------------------------------------------------------------------------------------------- measuring
def _state_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a resized-away storage counts 0)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


class _Probe:
    """Samples the state bytes after every module's forward and backward (and on demand)."""

    def __init__(self, model: torch.nn.Module, owner: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.owner, self.opt, self.peak = model, owner, opt, 0
        self.handles = []
        for m in model.modules():
            self.handles.append(m.register_forward_hook(lambda *_: self.sample(), prepend=True))
            self.handles.append(m.register_full_backward_hook(lambda *_: self.sample(), prepend=True))

    def tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for p in [*self.model.parameters(), *self.owner.parameters()]:
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        for state in self.opt.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return out

    def sample(self) -> None:
        self.peak = max(self.peak, _state_bytes(self.tensors()))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _saved_bytes(run: Callable[[], Any], params: list[torch.Tensor]) -> tuple[Any, int]:
    """``run()`` and the bytes of the tensors autograd saves for backward in it, parameters (state,
    counted apart) left out."""
    total = [0]
    state = {p.untyped_storage().data_ptr() for p in params}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in state:
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, total[0]


# ---------------------------------------------------------------------------------------------- worker
def _data(args: argparse.Namespace, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(args.batch, 2, args.size, args.size, generator=g)
    return x[start:stop].contiguous(), torch.roll(x, 1, dims=-1)[start:stop].contiguous()


def _configuration(
    args: argparse.Namespace, plan: Any, stage: int, overlap: bool, ckpt: bool, prefetch: bool = True
) -> dict[str, Any]:
    import hpctp
    from hpctp.nn import ShardedDataParallel, global_mse_loss

    grid = plan.model_grid
    model = _model(args, grid)
    if ckpt:
        _checkpoint_layers(model)
    sdp = ShardedDataParallel(model, plan, stage=stage, overlap=overlap, prefetch=prefetch, bucket_mib=args.bucket_mib)
    opt = torch.optim.Adam(sdp.parameters(), lr=1e-4)
    start, stop = plan.sample_range(args.batch)
    x, y = _data(args, start, stop)
    lay = hpctp.Layout(tuple(x.shape), grid.dims, (None, None, 0, 1))
    xd = hpctp.DistTensor(x, grid, lay)
    probe = _Probe(model, sdp, opt)
    times, saved, kept = [], 0, 0
    for i in range(args.steps + 1):
        plan.grid.comm.Barrier()
        t0 = time.perf_counter()
        pred, saved = _saved_bytes(lambda: sdp(xd), [*model.parameters(), *sdp.parameters()])
        loss = global_mse_loss(pred.local, y, plan.grid, plan.loss_axes)
        loss.backward()
        sdp.step(opt)
        kept = _state_bytes(probe.tensors())  # (before zero_grad: the gradients a step needs count)
        sdp.zero_grad()
        probe.sample()
        slowest = np.array([time.perf_counter() - t0])
        hpctp.comm.allreduce(plan.grid.comm, slowest, "max")
        if i:  # the first step builds plans and allocates the optimizer state
            times.append(float(slowest[0]))
    probe.remove()
    peak = np.array([float(max(probe.peak, kept)), float(saved), float(kept)])
    hpctp.comm.allreduce(plan.grid.comm, peak, "max")
    return {"stage": stage, "overlap": overlap, "checkpoint": ckpt, "prefetch": prefetch, "state": peak[0],
            "saved": peak[1], "kept": peak[2], "step": float(np.median(times)), "loss": float(loss.detach())}  # fmt: skip


def _one_process(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    """The unsharded model on the whole global batch in this process (a 1x1 grid of COMM_SELF)."""
    from mpi4py import MPI

    import hpctp
    from hpctp.nn import global_mse_loss

    torch.set_num_threads(threads)
    grid = hpctp.ProcessGrid((1, 1), comm=MPI.COMM_SELF)
    model = _model(args, grid)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = _data(args, 0, args.batch)
    xd = hpctp.DistTensor(x, grid, hpctp.Layout(tuple(x.shape), grid.dims, (None, None, 0, 1)))
    probe = _Probe(model, model, opt)
    times = []
    kept = 0
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        pred, saved = _saved_bytes(lambda: model(xd), list(model.parameters()))
        loss = global_mse_loss(pred.local, y, grid)
        loss.backward()
        opt.step()
        kept = _state_bytes(probe.tensors())
        opt.zero_grad(set_to_none=True)
        probe.sample()
        if i:
            times.append(time.perf_counter() - t0)
    torch.set_num_threads(1)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"state": float(max(probe.peak, kept)), "kept": float(kept), "saved": float(saved),
            "step": float(np.median(times)), "params": params}  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """Collective over the world. Every configuration on this rank count; JSON on rank 0's stdout."""
    from mpi4py import MPI

    import hpctp
    from hpctp.nn import ParallelPlan

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    grid = hpctp.ProcessGrid((world.Get_size(), 1, 1), comm=world)
    plan = ParallelPlan(grid, data=(0,))
    rows = [_configuration(args, plan, s, True, False) for s in (0, 1, 2, 3)]
    rows.append(_configuration(args, plan, 0, False, False))
    rows.append(_configuration(args, plan, 3, True, False, prefetch=False))
    rows.append(_configuration(args, plan, 3, True, True))
    ref = None
    if world.Get_rank() == 0:
        ref = _one_process(args, world.Get_size())
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.05)
    if world.Get_rank() == 0:
        print(json.dumps({"ranks": world.Get_size(), "rows": rows, "one_process": ref}), flush=True)
    plan.free()
    grid.free()


# ---------------------------------------------------------------------------------------------- launcher
def _report(result: dict[str, Any], budget: float) -> None:
    ref, rows, p = result["one_process"], result["rows"], result["ranks"]
    base = next(r for r in rows if r["stage"] == 0 and r["overlap"] and not r["checkpoint"])
    mib = 2.0**20
    print(f"\n{p} rank(s), data parallel; one process: parameters {ref['params'] / mib:.1f} MiB, "
          f"state (params + grads + Adam) kept {ref['kept'] / mib:.1f} MiB, peak {ref['state'] / mib:.1f} MiB, "
          f"step {ref['step'] * 1e3:.1f} ms ({p} threads), activations saved {ref['saved'] / mib:.1f} MiB")  # fmt: skip
    print("| configuration | state kept [MiB] | / one process | state peak [MiB] | / one process | peak fits budget | "
          "step [ms] | / stage 0 | / one process | activations saved [MiB] |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | :---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        name = (f"stage {r['stage']}" + ("" if r["overlap"] else ", no overlap")
                + ("" if r["prefetch"] or r["stage"] < 3 else ", no prefetch")
                + (", checkpointing" if r["checkpoint"] else ""))  # fmt: skip
        fits = "yes" if r["state"] <= budget * mib else "no"
        print(f"| {name} | {r['kept'] / mib:.1f} | {r['kept'] / ref['kept']:.2f} | {r['state'] / mib:.1f} | "
              f"{r['state'] / ref['state']:.2f} | {fits} | {r['step'] * 1e3:.1f} | {r['step'] / base['step']:.2f} | "
              f"{r['step'] / ref['step']:.2f} | {r['saved'] / mib:.1f} |")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.worker:
        worker(args)
        return
    mpiexec = Path(sys.executable).parent / "mpiexec"
    rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for n in args.ranks:
        cmd = [str(mpiexec), "-n", str(n), sys.executable, str(Path(__file__).resolve()), "--worker", *rest]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE.parent, check=False)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode or not lines:
            sys.exit(f"{n} ranks failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        _report(json.loads(lines[-1]), args.budget_mib)


if __name__ == "__main__":
    main()
