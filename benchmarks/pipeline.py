"""Pipeline parallelism (hpctp.nn.PipelineParallel): measured bubble against the schedules' formulas, activation
memory per stage, and step time against data parallelism of the same model on the same ranks.

Usage::

    python benchmarks/pipeline.py                          # mpiexec -n 2 and -n 4 of itself; the tables
    python benchmarks/pipeline.py --ranks 2 --m 4 8        # fewer runs
    python benchmarks/pipeline.py --schedules 1f1b zero_bubble
    mpiexec -n 2 python benchmarks/pipeline.py --worker    # one rank count (what the launcher runs)

The model is ``--blocks`` :class:`hpctp.nn.TransformerBlock` (embed ``--embed``, ``--heads`` heads, MLP ratio 4) on
token sequences ``[batch, --tokens, embed]``, float32, one micro-batch ``--micro`` sequences; the global batch is
``m`` micro-batches. On ``p`` ranks (one pipeline axis; ``ParallelPlan(grid, pipeline=0)``), for each ``m``, every
schedule and data parallelism take one step each in turn, ``--steps`` rounds after one left out (a host's cores
do not keep one speed: paired rounds let every schedule see the same machine). The ranks run under jemalloc where it
is installed (``--glibc``: glibc's malloc), as ``benchmarks/planner.py``'s. Per schedule and ``m``:

* **bubble**: from each rank's timeline of the step (``PipelineParallel.timeline``: the compute actions' spans), one
  minus the time it computed over the step (the slowest rank's, ``PipelineParallel.step_seconds``: a rank done early
  idles until the step ends), averaged over the ranks (``PipelineParallel.idle_fraction``), the median over the
  steps; beside it the schedule's closed form (unit ``F`` and ``B``; zero-bubble ``F = B = W``) and the simulator's
  predictions (:meth:`hpctp.nn.pipeline_parallel.Schedule.simulate`) with the measured ``F``, ``B`` and ``W`` times:
  their means over all stages (the schedule's own bubble), and each stage's own (what stages of unequal cost add: the
  last stage computes the loss; under zero-bubble the first stage's ``B`` is empty and its ``W`` the whole backward);
* **replayed**: the simulator's bubble with every action's own measured duration (each step's, the median over the
  steps): the schedule on this machine's pass times, their jitter and the ranks' differences included, with no time
  lost between actions; the measured bubble minus this is the runtime's own (messages, Python);
* **zero-bubble / 1F1B**: the ratio of their bubbles in each round (the same minute of the machine), the median over
  the rounds, and over the rounds whose 1F1B ranks computed within ``EVEN`` of each other;
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
EVEN = 0.05
"""A round's machine counts as even when the ranks' compute in its 1F1B step (the same work on every rank: one
stage each, the last one's loss aside) differs by at most this fraction: a host's cores do not always run at one
speed, and a rank that computes slower makes every other rank idle whatever the schedule."""
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
    p.add_argument("--steps", type=int, default=8, help="measured rounds (one step of each schedule per round)")
    p.add_argument("--schedules", nargs="+", default=[s for s, _ in SCHEDULES], choices=[s for s, _ in SCHEDULES])
    p.add_argument("--glibc", action="store_true", help="glibc's malloc even where jemalloc is installed (launcher)")
    p.add_argument("--worker", action="store_true", help="run one rank count under mpiexec")
    return p.parse_args(argv)


def _blocks(args: argparse.Namespace, grid: Any) -> list[torch.nn.Module]:
    from hpctp.nn import TransformerBlock

    return [TransformerBlock(args.embed, args.heads, 4.0, grid, seed=10 + k) for k in range(args.blocks)]


def _batch(args: argparse.Namespace, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, args.tokens, args.embed, generator=g)
    return x, torch.tanh(x)


def _slowest(comm: Any, step: Any) -> float:
    """Collective over ``comm``. Run ``step()`` after a barrier; the slowest rank's seconds."""
    import hpctp

    comm.Barrier()
    t0 = time.perf_counter()
    step()
    seconds = np.array([time.perf_counter() - t0])
    hpctp.comm.allreduce(comm, seconds, "max")
    return float(seconds[0])


class _Run:
    """Collective over the plan's grid. One schedule at one micro-batch count: its model, optimizer, and what its
    steps measured (bubble, pass times per stage, step)."""

    def __init__(self, args: argparse.Namespace, plan: Any, schedule: str, virtual: int, m: int) -> None:
        from hpctp.nn import PipelineParallel, global_mse_loss

        self.plan, self.schedule, self.virtual, self.m = plan, schedule, virtual, m
        self.model = PipelineParallel(_blocks(args, plan.model_grid), plan, schedule=schedule, microbatches=m,
                                      virtual=virtual)  # fmt: skip
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        self.x, self.y = _batch(args, m * args.micro)
        self.loss_fn = lambda p, t: global_mse_loss(p, t, plan.grid, plan.loss_axes)
        self.steps: list[float] = []
        self.bubbles: list[float] = []
        self.durations: list[list[float]] = []  # (each step's compute actions, in this rank's order)
        self.per_stage = np.zeros((2, 3, self.model.schedule.n_stages))  # (sum, count) x (F, B, W) x stage

    def step(self, record: bool) -> None:
        """Collective over the plan's grid. One training step; its bubble, pass times and step kept if ``record``."""
        seconds = _slowest(
            self.plan.grid.comm, lambda: self.model.step(self.x, self.y, self.loss_fn, optimizer=self.opt)
        )
        self.model.zero_grad(set_to_none=False)  # (the gradients stay allocated: the next peak is activations)
        if not record:
            return
        self.bubbles.append(self.model.idle_fraction())
        self.steps.append(seconds)
        self.durations.append([])
        for name, s, e in self.model.timeline[1:]:
            self.durations[-1].append(e - s)
            kind = "W" if "W" in name else "B" if "B" in name else "F"
            k, stage = "FBW".index(kind), int(name[: name.index(kind)])  # (names such as "1B3": stage 1, B, 3)
            self.per_stage[:, k, stage] += (e - s, 1)

    def row(self) -> dict[str, Any]:
        """Collective over the plan's grid. The table's row: the steps' medians, and one more step's activations."""
        import hpctp

        with hpctp.PeakMemory(tensors=True) as mem:
            self.model.step(self.x, self.y, self.loss_fn)
        comm = self.plan.grid.comm
        table = self.per_stage[0].sum(1) / np.maximum(self.per_stage[1].sum(1), 1)  # (this rank's mean F, B, W)
        bubbles = np.array(self.bubbles)  # (each step's mean over the ranks: the same on every rank after the sum)
        every = hpctp.comm.allgather_ints(comm, [int(mem.tensors)])[:, 0]
        busy = np.empty((comm.Get_size(), len(self.durations)))
        comm.Allgather(np.array(self.durations).sum(1), busy)  # (rank x round: the compute of each step)
        hpctp.comm.allreduce(comm, table, "sum")
        hpctp.comm.allreduce(comm, bubbles, "sum")
        table /= self.plan.grid.size
        bubbles /= self.plan.grid.size
        sched = self.model.schedule
        f, b_, w = table
        sim = sched.simulate({"F": f, "B": b_, "W": w} if sched.split_backward else {"F": f, "B": b_}).bubble_fraction
        hpctp.comm.allreduce(comm, self.per_stage, "sum")  # (each stage's actions run on its pipeline rank only)
        stage_means = self.per_stage[0] / np.maximum(self.per_stage[1], 1)
        kinds = "FBW" if sched.split_backward else "FB"
        replay = self._replay(sched)
        staged = sched.simulate({k: [float(v) for v in stage_means["FBW".index(k)]] for k in kinds}).bubble_fraction
        p, m = sched.p, self.m
        closed = (p - 1) / (3 * m + p - 1) if sched.split_backward else (p - 1) / (self.virtual * m + p - 1)
        spread = (busy.max(0) / busy.min(0)).round(4).tolist()  # (each round: the slowest rank's compute / the fastest)
        return {"schedule": self.schedule, "m": m, "bubble": float(np.median(bubbles)),
                "bubbles": [round(float(b), 4) for b in bubbles], "spread": spread, "closed": closed,
                "simulated": float(sim),
                "staged": float(staged), "replay": replay, "stage_ms": np.round(stage_means * 1e3, 2).tolist(),
                "activations": int(every.max()), "step": float(statistics.median(self.steps))}  # fmt: skip

    def _replay(self, sched: Any) -> float:
        """Collective over the plan's grid. The simulator's bubble with every action's own measured duration, the
        median over the steps: what the schedule gives on this machine's pass times, jitter and imbalance included,
        with no time lost between actions (the measured bubble minus this is the runtime's own)."""
        comm = self.plan.grid.comm
        mine = np.array(self.durations)  # (step x action)
        every = np.empty((comm.Get_size(), *mine.shape))
        comm.Allgather(mine, every)  # (every rank runs as many compute actions: m (v) F, B (and W) per stage)
        names = [[str(a) for a in sched.compute(r)] for r in range(comm.Get_size())]
        fractions = []
        for k in range(mine.shape[0]):
            took = {n: every[r, k, j] for r in range(len(names)) for j, n in enumerate(names[r])}
            fractions.append(sched.simulate(lambda a, took=took: took.get(str(a), 0.0)).bubble_fraction)
        return float(np.median(fractions))


class _DataParallel:
    """Collective over the grid. The whole model on every rank, the batch split, gradients all-reduced."""

    def __init__(self, args: argparse.Namespace, plan_dp: Any, m: int) -> None:
        from hpctp.nn import global_mse_loss

        self.plan = plan_dp
        self.model = torch.nn.Sequential(*_blocks(args, plan_dp.model_grid))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        x, y = _batch(args, m * args.micro)
        a, b = plan_dp.sample_range(len(x))
        self.x, self.y = x[a:b], y[a:b]
        self.loss_fn = global_mse_loss
        self.steps: list[float] = []

    def step(self, record: bool) -> None:
        """Collective over the grid. One step; its time (the slowest rank's) kept if ``record``."""
        seconds = _slowest(self.plan.grid.comm, self._step)
        if record:
            self.steps.append(seconds)

    def _step(self) -> None:
        plan = self.plan
        loss = self.loss_fn(self.model(self.x), self.y, plan.grid, plan.loss_axes)
        loss.backward()
        plan.sync_gradients(self.model)
        self.opt.step()
        self.opt.zero_grad()


def worker(args: argparse.Namespace) -> None:
    """Collective over the world. Every schedule and micro-batch count; JSON lines on rank 0's stdout.

    For each ``m`` the schedules and data parallelism take their steps in turn, round after round (one step each
    per round), so that every one of them sees the same machine: a core of a shared host can run 20-30% slower for
    a minute, and steps measured one schedule after another would compare schedules at different speeds."""
    from mpi4py import MPI

    import hpctp
    from hpctp.nn import ParallelPlan

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    grid = hpctp.ProcessGrid((world.Get_size(), 1))
    plan = ParallelPlan(grid, pipeline=0)  # axis 1 (size 1): the blocks' model grid
    plan_dp = ParallelPlan(grid, data=(0,))
    for m in args.m:
        dp = _DataParallel(args, plan_dp, m)
        runs = [_Run(args, plan, schedule, virtual, m) for schedule, virtual in SCHEDULES
                if args.blocks >= world.Get_size() * virtual and schedule in args.schedules]  # fmt: skip
        for i in range(args.steps + 1):  # (the first round left out: warm-up)
            dp.step(record=i > 0)
            for run in runs:
                run.step(record=i > 0)
        for run in runs:
            row = run.row()
            row["data_parallel"] = float(statistics.median(dp.steps))
            if world.Get_rank() == 0:
                print(json.dumps({"ranks": world.Get_size(), **row}), flush=True)
        del runs, dp
    plan.free()
    plan_dp.free()
    grid.free()


def _report(rows: list[dict[str, Any]]) -> None:
    p = rows[0]["ranks"]
    print(f"\n{p} ranks (pipeline {p}); activations: live tensor peak above a step's start, the largest stage")
    print("| schedule | m | bubble measured | closed form | simulated (mean F, B, W) | simulated (each stage's F, B, W) "
          "| replayed (each action's) | compute per micro-batch, rank 0 / 1 / ... [ms] | activations [MiB] | / GPipe's "
          "| step [s] | / data parallel |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    gpipe = {r["m"]: r["activations"] for r in rows if r["schedule"] == "gpipe"}
    for r in rows:
        act = r["activations"] / 2**20
        ratio = r["activations"] / gpipe[r["m"]] if r["m"] in gpipe else float("nan")
        busy = " / ".join(f"{t:.1f}" for t in _per_rank(r["stage_ms"], p))
        print(f"| {r['schedule']} | {r['m']} | {r['bubble']:.3f} | {r['closed']:.3f} | {r['simulated']:.3f} | "
              f"{r['staged']:.3f} | {r['replay']:.3f} | {busy} | {act:.1f} | {ratio:.2f} | {r['step']:.3f} | "
              f"{r['step'] / r['data_parallel']:.2f} |")  # fmt: skip
    by = {(r["schedule"], r["m"]): r for r in rows}
    for m in sorted({r["m"] for r in rows}):
        if ("zero_bubble", m) in by and ("1f1b", m) in by:
            zb, one = by[("zero_bubble", m)], by[("1f1b", m)]
            pairs = [(z / o, s) for z, o, s in zip(zb["bubbles"], one["bubbles"], one["spread"]) if o > 0]
            q = np.quantile([r for r, _ in pairs], [0.25, 0.5, 0.75])
            even = [r for r, s in pairs if s <= 1 + EVEN]
            print(f"zero-bubble / 1F1B bubble, m = {m}: {q[1]:.2f} (each round's pair; quartiles "
                  f"{q[0]:.2f}-{q[2]:.2f}, {len(pairs)} rounds); in the {len(even)} rounds whose 1F1B ranks computed "
                  f"within {EVEN:.0%} of each other: {np.median(even) if even else float('nan'):.2f}")  # fmt: skip


def _per_rank(stage_ms: list[list[float]], p: int) -> list[float]:
    """Each rank's computation per micro-batch: its stages' mean ``F + B + W`` (stage ``s`` on rank ``s % p``); the
    largest bounds the step at ``m`` times it plus the pipeline's fill."""
    per_stage = [sum(kind[s] for kind in stage_ms) for s in range(len(stage_ms[0]))]
    return [sum(per_stage[s] for s in range(r, len(per_stage), p)) for r in range(p)]


def main(argv: list[str] | None = None) -> None:
    from hpctp._util.memory import jemalloc_library

    args = _args(argv)
    if args.worker:
        worker(args)
        return
    mpiexec = Path(sys.executable).parent / "mpiexec"
    rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
    lib = jemalloc_library()
    allocator = "glibc"
    if lib and not args.glibc:  # (as benchmarks/planner.py: freed blocks reused at once, no fresh pages per step)
        env["LD_PRELOAD"] = lib
        allocator = f"jemalloc ({lib})"
    print(f"allocator: {allocator}")
    for n in args.ranks:
        cmd = [str(mpiexec), "-n", str(n), sys.executable, str(Path(__file__).resolve()), "--worker", *rest]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE.parent, check=False)
        lines = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode or not lines:
            sys.exit(f"{n} ranks failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        _report(lines)


if __name__ == "__main__":
    main()
