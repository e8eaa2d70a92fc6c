"""Sharded data parallelism (ZeRO/FSDP stages of hpctp.nn.ShardedDataParallel): memory per rank, as accounted and
as measured, and step time, on 1, 2 and 4 ranks, against one process.

Usage::

    python benchmarks/memory.py                                 # every configuration on 2 and 4 ranks; the tables
    python benchmarks/memory.py --ranks 2 --width 256 --steps 2 # smaller
    mpiexec -n 4 python benchmarks/memory.py --worker --config "stage 3"   # one configuration (the launcher's job)

The model (``--model mlp``, the default) is ``--layers`` ``torch.nn.Linear(width, width)`` with a tanh between, float32,
on a global batch of ``--batch`` rows split over the data ranks (``ParallelPlan(grid, data=(0,))``); ``--model fno``
is a wide FNO (``--width`` channels, ``--layers`` Fourier layers of ``--modes`` modes with their 1x1 convolutions, on
``--size``-square 2-channel fields). It is built on the ``meta`` device and materialized by the wrapper (one process:
:func:`hpctp.nn.materialize`), then trained with Adam. Every configuration runs in a process of its own (the C
allocator's state carries over from one run to the next), launched once per allocator (``--allocators``: the
default glibc, and jemalloc through ``LD_PRELOAD`` where ``libjemalloc.so.2`` is found). Per configuration:

* **state** (accounting): the bytes of parameters, gradients and Adam state a rank holds between steps (*kept*);
* **resident** (measured, as a user sees it): the peak of the resident set over construction and ``--steps`` steps,
  sampled from a thread at >= 1 kHz together with the kernel's high-water mark (:class:`hpctp.PeakMemory`), minus
  the runtime's own (the same measurement after a warm-up run of a 2-layer model of the same width); the largest
  over ranks. On a GPU (``--device cuda``): ``torch.cuda.max_memory_allocated``;
* **tensors** (allocation statistics): the peak of live CPU tensor bytes in one more step (torch.profiler's memory
  events: what the allocator was asked for, free of its retention), plus what was alive on entry;
* **step**: the median over ``--steps`` steps (the first left out) of the slowest rank's time, against stage 0 of the
  same run and against one process running the global batch with as many threads as there are ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpctp._util.memory import jemalloc_library

HERE = Path(__file__).resolve().parent
CONFIGS = {  # name: (stage, overlap, prefetch, checkpointing, malloc_threshold)
    "stage 0": (0, True, True, False, "auto"),
    "stage 0, messages after backward (no overlap)": (0, False, True, False, "auto"),
    "stage 1": (1, True, True, False, "auto"),
    "stage 2": (2, True, True, False, "auto"),
    "stage 3": (3, True, True, False, "auto"),
    "stage 3, malloc left alone": (3, True, True, False, None),
    "stage 3, no prefetch": (3, True, False, False, "auto"),
    "stage 3, checkpointing": (3, True, True, True, "auto"),
}
ONE = "one process"


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="rank counts (launcher)")
    p.add_argument("--model", choices=["mlp", "fno"], default="mlp")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--modes", type=int, default=12, help="fno: Fourier modes")
    p.add_argument("--size", type=int, default=32, help="fno: field size")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), metavar="NAME", help="configurations (launcher)")
    p.add_argument("--allocators", nargs="+", default=["glibc", "jemalloc"], help="glibc, jemalloc (launcher)")
    p.add_argument("--worker", action="store_true", help="run one configuration under mpiexec")
    p.add_argument("--config", default="stage 3", help="the worker's configuration, or 'one process'")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- model
def _model(args: argparse.Namespace, grid: Any, layers: int) -> torch.nn.Module:
    """The benchmark's model on ``grid`` (plain torch layers for the MLP: replicated, sharded by the wrapper)."""
    w = args.width
    if args.model == "mlp":
        return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(w, w), torch.nn.Tanh())])
    from hpctp.nn import Conv2d, SpectralConv2d

    class WideFNO(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lift = Conv2d(2, w, 1, grid=grid, seed=0)
            self.spectral = torch.nn.ModuleList(
                SpectralConv2d(w, w, args.modes, grid=grid, seed=1 + i) for i in range(layers)
            )
            self.pointwise = torch.nn.ModuleList(Conv2d(w, w, 1, grid=grid, seed=100 + i) for i in range(layers))
            self.head = Conv2d(w, 2, 1, grid=grid, seed=200)

        def forward(self, x: Any) -> Any:
            h = self.lift(x)
            for k, c in zip(self.spectral, self.pointwise):
                a, b = k(h), c(h)
                h = a.with_local(torch.nn.functional.gelu(a.local + b.local))
            return self.head(h)

    return WideFNO()


def _batch(args: argparse.Namespace, start: int, stop: int, grid: Any) -> tuple[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    if args.model == "mlp":
        x = torch.randn(args.batch, args.width, generator=g)
        return x[start:stop].to(args.device), torch.tanh(x[start:stop]).to(args.device)
    import hpctp

    x = torch.randn(args.batch, 2, args.size, args.size, generator=g)
    xs = x[start:stop].contiguous()
    lay = hpctp.Layout(tuple(xs.shape), grid.dims, (None, None, 0, 1))
    return hpctp.DistTensor(xs, grid, lay), torch.roll(x, 1, dims=-1)[start:stop].contiguous()


def _prediction(out: Any) -> torch.Tensor:
    return out.local if hasattr(out, "local") else out


def _state_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a resized-away storage counts 0)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def _held(model: torch.nn.Module, owner: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for p in [*model.parameters(), *owner.parameters()]:
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
    for state in opt.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


# ---------------------------------------------------------------------------------------------- worker
def _run(args: argparse.Namespace, plan: Any, config: str, layers: int, steps: int) -> dict[str, Any]:
    """Collective over the plan's grid. Build, wrap and train ``steps`` steps; times and what is kept."""
    import hpctp
    from hpctp.nn import ShardedDataParallel, checkpoint_forward, global_mse_loss, materialize

    grid = plan.model_grid
    with torch.device("meta"):
        model = _model(args, grid, layers)
    if config == ONE:
        materialize(model, seed=0, device=args.device)
        owner: torch.nn.Module = model
        step_fn: Callable[[torch.optim.Optimizer], None] = lambda opt: opt.step()  # noqa: E731
        loss_axes: tuple[int, ...] = ()
    else:
        stage, overlap, prefetch, ckpt, threshold = CONFIGS[config]
        owner = ShardedDataParallel(
            model, plan, stage=stage, overlap=overlap, prefetch=prefetch, seed=0, device=args.device,
            malloc_threshold=threshold,
        )  # fmt: skip
        if ckpt:
            for m in model.modules():
                if isinstance(m, torch.nn.Linear) or m.__class__.__name__.startswith("Spectral"):
                    checkpoint_forward(m)
        step_fn = owner.step  # type: ignore[assignment]
        loss_axes = plan.loss_axes
    opt = torch.optim.Adam(owner.parameters(), lr=1e-5)
    start, stop = plan.sample_range(args.batch) if config != ONE else (0, args.batch)
    x, y = _batch(args, start, stop, grid)

    def step() -> None:
        loss = global_mse_loss(_prediction(owner(x)), y, plan.grid, loss_axes)
        loss.backward()
        step_fn(opt)
        owner.zero_grad()

    times = []
    for i in range(steps):
        plan.grid.comm.Barrier()
        t0 = time.perf_counter()
        step()
        slowest = np.array([time.perf_counter() - t0])
        hpctp.comm.allreduce(plan.grid.comm, slowest, "max")
        if i or steps == 1:  # the first step builds plans and allocates the optimizer state
            times.append(float(slowest[0]))
    kept = _state_bytes(_held(model, owner, opt))
    return {
        "step": float(np.median(times)), "kept": kept, "run": step, "held": lambda: _held(model, owner, opt),
        "owner": owner,
    }  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """Collective over the world. One configuration; a JSON line on rank 0's stdout."""
    from mpi4py import MPI

    import hpctp
    from hpctp._util.memory import resident_bytes, trim_heap
    from hpctp.nn import ParallelPlan, ShardedDataParallel

    world = MPI.COMM_WORLD
    if args.config == ONE:
        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
        world = MPI.COMM_SELF
    else:
        torch.set_num_threads(1)
    grid = hpctp.ProcessGrid((world.Get_size(), 1, 1) if args.model == "fno" else (world.Get_size(),), comm=world)
    plan = ParallelPlan(grid, data=(0,))
    _run(args, plan, args.config, 2, 2)  # warm-up: the runtime's own memory, with the same kinds of buffers
    trim_heap()  # (glibc: what the warm-up freed is not reused unseen below the baseline)
    base = resident_bytes()
    with hpctp.PeakMemory(baseline=base) as measured:
        result = _run(args, plan, args.config, args.layers, args.steps + 1)
    if isinstance(result["owner"], ShardedDataParallel):
        result["owner"].empty_cache()  # (stage 3's kept blocks are allocated again in the measured step: they count)
    entry = _state_bytes(result["held"]())
    with hpctp.PeakMemory(tensors=True) as live:
        result["run"]()
    table = hpctp.comm.allgather_ints(
        grid.comm, [measured.peak, measured.cuda, entry + live.tensors, result["kept"], measured.samples]
    )
    if world.Get_rank() == 0:
        row = {
            "config": args.config, "ranks": grid.size, "step": result["step"], "resident": int(table[:, 0].max()),
            "cuda": int(table[:, 1].max()), "tensors": int(table[:, 2].max()), "kept": int(table[:, 3].max()),
            "rate": float(measured.samples / max(measured.seconds, 1e-9)),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
    plan.free()
    grid.free()


# ---------------------------------------------------------------------------------------------- launcher


def _launch(n: int, config: str, allocator: str, rest: list[str]) -> dict[str, Any]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
    if allocator == "jemalloc":
        env["LD_PRELOAD"] = jemalloc_library() or ""
    if config == ONE:
        env["BENCH_THREADS"] = str(n)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--config", ONE, *rest]
    else:
        cmd = [
            str(mpiexec),
            "-n",
            str(n),
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--config",
            config,
            *rest,
        ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE.parent, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        sys.exit(
            f"{config} on {n} ranks ({allocator}) failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
        )
    return dict(json.loads(lines[-1]))


def _report(n: int, rows: dict[str, dict[str, dict[str, Any]]], allocators: list[str]) -> None:
    mib = 2.0**20
    one = rows[ONE]
    base = rows.get("stage 0", rows[next(iter(rows))])[allocators[0]]
    ref = one[allocators[0]]
    print(f"\n{n} rank(s), data parallel; one process: state kept {ref['kept'] / mib:.1f} MiB, "
          + ", ".join(f"resident peak {one[a]['resident'] / mib:.0f} MiB ({a})" for a in allocators)
          + f", live tensors peak {ref['tensors'] / mib:.0f} MiB, step {ref['step'] * 1e3:.1f} ms ({n} threads)")  # fmt: skip
    heads = [f"resident peak [MiB] ({a}) | / one process" for a in allocators]
    print("| configuration | state kept / one process | " + " | ".join(heads)
          + " | live tensors peak / one process | step [ms] | / stage 0 | / one process |")  # fmt: skip
    print("| --- | ---: | " + " | ".join("---: | ---:" for _ in allocators) + " | ---: | ---: | ---: | ---: |")
    for name, by in rows.items():
        r = by[allocators[0]]
        cells = [f"{by[a]['resident'] / mib:.0f} | {by[a]['resident'] / one[a]['resident']:.2f}" for a in allocators]
        print(f"| {name} | {r['kept'] / ref['kept']:.2f} | " + " | ".join(cells)
              + f" | {r['tensors'] / ref['tensors']:.2f} | {r['step'] * 1e3:.1f} | {r['step'] / base['step']:.2f} | "
              f"{r['step'] / ref['step']:.2f} |")  # fmt: skip
    rates = [by[a]["rate"] for by in rows.values() for a in allocators]
    print(f"(resident memory sampled at {min(rates):.0f}-{max(rates):.0f} Hz, with the kernel's high-water mark)")


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.worker:
        worker(args)
        return
    allocators = [a for a in args.allocators if a != "jemalloc" or jemalloc_library()]
    rest = [f"--model={args.model}", f"--width={args.width}", f"--layers={args.layers}", f"--modes={args.modes}",
            f"--size={args.size}", f"--batch={args.batch}", f"--steps={args.steps}", f"--device={args.device}"]  # fmt: skip
    for n in args.ranks:
        rows: dict[str, dict[str, dict[str, Any]]] = {}
        for config in [ONE, *args.configs]:
            rows[config] = {a: _launch(n, config, a, rest) for a in allocators}
        _report(n, rows, allocators)


if __name__ == "__main__":
    main()
