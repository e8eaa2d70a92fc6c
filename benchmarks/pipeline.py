"""Pipeline parallelism (hpctp.nn.PipelineParallel): measured bubble against the schedules' formulas, activation
memory per stage, and step time against data parallelism of the same model on the same ranks.

Usage::

    python benchmarks/pipeline.py                          # mpiexec -n 2 and -n 4 of itself; the tables
    python benchmarks/pipeline.py --ranks 2 --m 4 8        # fewer runs
    python benchmarks/pipeline.py --schedules 1f1b zero_bubble
    mpiexec -n 2 python benchmarks/pipeline.py --worker    # one rank count (what the launcher runs)

The model is ``--blocks`` :class:`hpctp.nn.TransformerBlock` (embed ``--embed``, ``--heads`` heads, MLP ratio 4) on
token sequences ``[batch, --tokens, embed]``, float32, one micro-batch ``--micro`` sequences; the global batch is
``m`` micro-batches. On ``p`` ranks (one pipeline axis; ``ParallelPlan(grid, pipeline=0)``) every schedule runs
``--steps`` steps (the first left out) for each ``m``:

* **bubble**: from each rank's timeline of the step (``PipelineParallel.timeline``: the compute actions' spans), one
  minus the time it computed over the step (the slowest rank's, ``PipelineParallel.step_seconds``: a rank done early
  idles until the step ends), averaged over the ranks (``PipelineParallel.idle_fraction``); beside it the schedule's closed form (unit
  ``F`` and ``B``; zero-bubble ``F = B = W``) and the simulator's predictions
  (:meth:`hpctp.nn.pipeline_parallel.Schedule.simulate`) with the measured ``F``, ``B`` and ``W`` times: their means
  over all stages (the schedule's own bubble), and each stage's own (what stages of unequal cost add: the last stage
  computes the loss; under zero-bubble the first stage's ``B`` is empty and its ``W`` the whole backward);
* **compute per micro-batch**: each rank's mean ``F + B + W`` time per micro-batch over its stages (the timeline's
  spans); the slowest rank bounds the step (``m`` times it, plus the pipeline's fill), and every other rank idles the
  difference, whatever the schedule;
* **activations**: the peak of live tensor bytes in a step above what is alive before it (parameters, their
  gradients kept allocated, Adam's state), from torch.profiler's memory events (:class:`hpctp.PeakMemory`), the
  largest over the ranks (stages);
* **step**: the median of the slowest rank's step, against data parallelism of the whole model over the same ranks
  (each rank the model and ``1/p`` of the batch, gradients all-reduced) in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)]


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="rank counts (launcher)")
    p.add_argument("--m", type=int, nargs="+", default=[4, 8, 16], help="micro-batch counts")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--embed", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--schedules", nargs="+", default=[s for s, _ in SCHEDULES], choices=[s for s, _ in SCHEDULES])
    p.add_argument("--worker", action="store_true", help="run one rank count under mpiexec")
    return p.parse_args(argv)


def _blocks(args: argparse.Namespace, grid: Any) -> list[torch.nn.Module]:
    from hpctp.nn import TransformerBlock

    return [TransformerBlock(args.embed, args.heads, 4.0, grid, seed=10 + k) for k in range(args.blocks)]


def _batch(args: argparse.Namespace, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, args.tokens, args.embed, generator=g)
    return x, torch.tanh(x)


def _pipeline(args: argparse.Namespace, plan: Any, schedule: str, virtual: int, m: int) -> dict[str, Any]:
    """Collective over the plan's grid. One schedule and micro-batch count: bubble, activations, step."""
    import hpctp
    from hpctp.nn import PipelineParallel, global_mse_loss

    model = PipelineParallel(_blocks(args, plan.model_grid), plan, schedule=schedule, microbatches=m, virtual=virtual)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    x, y = _batch(args, m * args.micro)

    def loss_fn(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return global_mse_loss(p, t, plan.grid, plan.loss_axes)

    steps: list[float] = []
    bubbles: list[float] = []
    costs: dict[str, list[float]] = {"F": [], "B": [], "W": []}
    n_stages = model.schedule.n_stages
    per_stage = np.zeros((2, 3, n_stages))  # (sum, count) x (F, B, W) x stage: this rank's stages
    for i in range(args.steps + 1):
        plan.grid.comm.Barrier()
        t0 = time.perf_counter()
        model.step(x, y, loss_fn, optimizer=opt)
        slowest = np.array([time.perf_counter() - t0])
        hpctp.comm.allreduce(plan.grid.comm, slowest, "max")
        model.zero_grad(set_to_none=False)  # (the gradients stay allocated: the next step's peak is activations)
        if i:
            bubbles.append(model.idle_fraction())
            steps.append(float(slowest[0]))
            for name, s, e in model.timeline[1:]:
                kind = "W" if "W" in name else "B" if "B" in name else "F"
                costs[kind].append(e - s)
                k, stage = "FBW".index(kind), int(name[: name.index(kind)])  # (names such as "1B3": stage 1, B, 3)
                per_stage[:, k, stage] += (e - s, 1)
    with hpctp.PeakMemory(tensors=True) as mem:
        model.step(x, y, loss_fn)
    mean = {k: statistics.fmean(v) if v else 0.0 for k, v in costs.items()}
    table = np.array([statistics.fmean(bubbles), mean["F"], mean["B"], mean["W"], float(mem.tensors)])
    every = hpctp.comm.allgather_ints(plan.grid.comm, [int(mem.tensors)])[:, 0]
    hpctp.comm.allreduce(plan.grid.comm, table, "sum")
    table /= plan.grid.size
    sched = model.schedule
    f, b_, w = table[1], table[2], table[3]
    sim = sched.simulate({"F": f, "B": b_, "W": w} if sched.split_backward else {"F": f, "B": b_}).bubble_fraction
    hpctp.comm.allreduce(plan.grid.comm, per_stage, "sum")  # (each stage's actions run on its pipeline rank only)
    stage_means = per_stage[0] / np.maximum(per_stage[1], 1)
    kinds = "FBW" if sched.split_backward else "FB"
    staged = sched.simulate({k: [float(v) for v in stage_means["FBW".index(k)]] for k in kinds}).bubble_fraction
    p = sched.p
    closed = (p - 1) / (3 * m + p - 1) if sched.split_backward else (p - 1) / (virtual * m + p - 1)
    return {"schedule": schedule, "m": m, "bubble": float(table[0]), "closed": closed, "simulated": float(sim),
            "staged": float(staged), "stage_ms": np.round(stage_means * 1e3, 2).tolist(),
            "activations": int(every.max()), "step": float(statistics.median(steps))}  # fmt: skip


def _data_parallel(args: argparse.Namespace, plan_dp: Any, m: int) -> float:
    """Collective over the grid. The whole model on every rank, the batch split, gradients all-reduced; the step."""
    import hpctp
    from hpctp.nn import global_mse_loss

    model = torch.nn.Sequential(*_blocks(args, plan_dp.model_grid))
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    x, y = _batch(args, m * args.micro)
    a, b = plan_dp.sample_range(len(x))
    steps = []
    for i in range(args.steps + 1):
        plan_dp.grid.comm.Barrier()
        t0 = time.perf_counter()
        loss = global_mse_loss(model(x[a:b]), y[a:b], plan_dp.grid, plan_dp.loss_axes)
        loss.backward()
        plan_dp.sync_gradients(model)
        opt.step()
        opt.zero_grad()
        slowest = np.array([time.perf_counter() - t0])
        hpctp.comm.allreduce(plan_dp.grid.comm, slowest, "max")
        if i:
            steps.append(float(slowest[0]))
    return float(statistics.median(steps))


def worker(args: argparse.Namespace) -> None:
    """Collective over the world. Every schedule and micro-batch count; JSON lines on rank 0's stdout."""
    from mpi4py import MPI

    import hpctp
    from hpctp.nn import ParallelPlan

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    grid = hpctp.ProcessGrid((world.Get_size(), 1))
    plan = ParallelPlan(grid, pipeline=0)  # axis 1 (size 1): the blocks' model grid
    plan_dp = ParallelPlan(grid, data=(0,))
    for m in args.m:
        dp = _data_parallel(args, plan_dp, m)
        for schedule, virtual in SCHEDULES:
            if args.blocks < world.Get_size() * virtual or schedule not in args.schedules:
                continue
            row = _pipeline(args, plan, schedule, virtual, m)
            row["data_parallel"] = dp
            if world.Get_rank() == 0:
                print(json.dumps({"ranks": world.Get_size(), **row}), flush=True)
    plan.free()
    plan_dp.free()
    grid.free()


def _report(rows: list[dict[str, Any]]) -> None:
    p = rows[0]["ranks"]
    print(f"\n{p} ranks (pipeline {p}); activations: live tensor peak above a step's start, the largest stage")
    print("| schedule | m | bubble measured | closed form | simulated (mean F, B, W) | simulated (each stage's F, B, W) "
          "| compute per micro-batch, rank 0 / 1 / ... [ms] | activations [MiB] | / GPipe's | step [s] "
          "| / data parallel |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    gpipe = {r["m"]: r["activations"] for r in rows if r["schedule"] == "gpipe"}
    for r in rows:
        act = r["activations"] / 2**20
        ratio = r["activations"] / gpipe[r["m"]] if r["m"] in gpipe else float("nan")
        busy = " / ".join(f"{t:.1f}" for t in _per_rank(r["stage_ms"], p))
        print(f"| {r['schedule']} | {r['m']} | {r['bubble']:.3f} | {r['closed']:.3f} | {r['simulated']:.3f} | "
              f"{r['staged']:.3f} | {busy} | {act:.1f} | {ratio:.2f} | {r['step']:.3f} | "
              f"{r['step'] / r['data_parallel']:.2f} |")  # fmt: skip


def _per_rank(stage_ms: list[list[float]], p: int) -> list[float]:
    """Each rank's computation per micro-batch: its stages' mean ``F + B + W`` (stage ``s`` on rank ``s % p``); the
    largest bounds the step at ``m`` times it plus the pipeline's fill."""
    per_stage = [sum(kind[s] for kind in stage_ms) for s in range(len(stage_ms[0]))]
    return [sum(per_stage[s] for s in range(r, len(per_stage), p)) for r in range(p)]


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.worker:
        worker(args)
        return
    mpiexec = Path(sys.executable).parent / "mpiexec"
    rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
    for n in args.ranks:
        cmd = [str(mpiexec), "-n", str(n), sys.executable, str(Path(__file__).resolve()), "--worker", *rest]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE.parent, check=False)
        lines = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode or not lines:
            sys.exit(f"{n} ranks failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        _report(lines)


if __name__ == "__main__":
    main()
