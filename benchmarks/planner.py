"""The planner (:func:`hpctp.perf.plan`) against measurement: every plan it calls feasible, run for a few steps.

Usage::

    python benchmarks/planner.py                          # ViT, FNO and a wide FNO on 2, 4 and 6 ranks; the tables
    python benchmarks/planner.py --ranks 4 --models fno   # less
    python benchmarks/planner.py --projection              # only the table of predictions for H100 systems

The launcher runs again under jemalloc where it is installed (``LD_PRELOAD``; ``--glibc``: not), and so does
everything it starts: the planner measures a step's host time in this process, and it should see the allocator the
plans run under. Per rank count ``n`` the launcher first calibrates this machine on ``n`` ranks (``hpctp perf
calibrate``, unless ``--machine`` gives a file), then per model it runs the planner here (one process) and launches
one worker job (``mpiexec -n n``) that trains each plan of the list for ``--steps`` steps of the
surrogate's training step (:class:`hpctp.nn.ShardedDataParallel`, Adam, the global MSE; the model built on the meta
device and materialized by the wrapper) and measures:

* **step** (the measure the predictions are compared with): paired with the top pick's. Each job first builds the
  planner's top pick (the reference) and keeps it; each of a plan's ``--steps`` timed steps (after two warm-up steps;
  the slowest rank's time) is followed by one step of the reference. A plan's measure is its step over the
  reference's, the median over its steps in a pass, then over the ``--cycles`` passes (each pass a job of its own,
  building every plan again, and starting at another plan: a job's first plan runs on a cold process), times the
  reference's median step over the run: the plan's step at the run's median speed. The two steps of a pair run within
  a fraction of a second, so a machine whose speed drifts for seconds at a time slows both alike (this one's: a fixed
  kernel's best time per second moves 1.2-1.5x on an idle machine, ``benchmarks/machine_drift.py``; the reference's
  own step moved 1.4-2.4x over a run). Printed too: each plan's **best step** (the shortest over all its steps, the
  measure of the earlier runs), and the reference's spread;
* **memory** (the measure the predictions are compared with): the live tensors of one more step, torch.profiler's
  allocation events (:class:`hpctp.PeakMemory` ``tensors=True``: what the allocator was asked for, without what it
  keeps after frees), plus the bytes alive on entry (parameters, slices, optimizer state, the batch), the largest
  over ranks; and **resident**: the growth of the resident set over the plan's construction and warm-up steps
  (jemalloc returns freed memory, so it is the plan's own), for reference; its sampling thread is stopped before
  the timed steps.

The models are the surrogate configs of ``apps/configs`` (``vit.toml``, ``default.toml``: the FNO) with ``--set``
overrides, and a wide FNO (``--wide-width`` channels) whose state exceeds ``--wide-memory`` on one rank; the planner
gets ``--memory`` per rank for the first two and ``--wide-memory`` for the wide one, and for the wide one the
worker also runs every plan predicted not to fit, to check it indeed exceeds the budget. Pipeline plans (the ViT is
a chain of layers) run through :class:`hpctp.nn.PipelineParallel`, its stages cut where the planner priced them
(``Prediction.cuts``); ``--no-pipeline`` leaves them out of the search. Printed: one table per
model and rank count (predicted and measured memory and step time per plan), the targets (memory error per plan,
Spearman's rank correlation of the step times, the top pick's gap to the fastest measured plan, the budget check),
the measurement against itself (:func:`repeatability`: how well one pass ranks the plans of the others, the ceiling
of the ranking targets on a shared machine)
and, with ``--projection``, the ViT surrogate at about 1 and 10 billion parameters on 4096 x 4096 fields at 64, 512
and 4096 H100 GPUs (predictions from the published figures of ``hpctp/perf/machines/h100-ndr.toml``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIZE = ["simulation.size=[96, 96]", "train.batch_size=6"]  # (6 samples: 1, 2, 3 and 6 data groups share them evenly)
MODELS = {
    "vit": (
        "apps/configs/vit.toml",
        ["simulation.size=[64, 64]", "train.batch_size=6", "surrogate.embed=48", "surrogate.heads=12"],
    ),
    "fno": ("apps/configs/default.toml", [*SIZE, "surrogate.width=24"]),
    "wide-fno": ("apps/configs/default.toml", SIZE),
}
"""The surrogate configs benchmarked, with the overrides that make their steps long enough to time on a shared CPU
(the wide FNO's width is ``--wide-width``)."""


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 6], help="rank counts (2: a core per rank here)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (every model)")
    p.add_argument("--memory", default="2GiB", help="budget per rank of the ViT and the FNO")
    p.add_argument("--wide-width", type=int, default=96, help="channels of the wide FNO")
    p.add_argument("--wide-memory", default="256MiB", help="budget per rank of the wide FNO (below its 1-rank need)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per plan and cycle")
    p.add_argument("--cycles", type=int, default=3, help="passes over the plans (each plan's best step over all)")
    p.add_argument("--machine", default=None, help="machine file (default: calibrate on each rank count)")
    p.add_argument("--out", default=str(ROOT / "build" / "planner"), help="where machine files and results go")
    p.add_argument("--projection", action="store_true", help="only the table of H100 projections")
    p.add_argument("--glibc", action="store_true", help="glibc's malloc throughout, even where jemalloc is installed")
    p.add_argument("--no-pipeline", dest="pipeline", action="store_false", help="leave pipeline plans out")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-memory", dest="memory", action="store_false", help=argparse.SUPPRESS)
    p.add_argument("--model", default="fno", help=argparse.SUPPRESS)
    p.add_argument("--plans", default="", help=argparse.SUPPRESS)
    p.add_argument("--reference", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _config(args: argparse.Namespace, model: str) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from apps.common.config import load_config

    path, extra = MODELS[model]
    overrides = list(extra) + list(args.set)
    if model == "wide-fno":
        overrides.append(f"surrogate.width={args.wide_width}")
    return load_config(str(ROOT / path), overrides)


# ---------------------------------------------------------------------------------------------- worker
def _state_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a resized-away storage counts 0; a meta tensor, a layer
    of another pipeline stage that this rank never materialized, none: meta storages all sit at address 0)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == "meta":
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


class _Built:
    """Collective over the world. A plan built (the model on the meta device, materialized by its wrapper), with its
    batch, Adam and one training step; :meth:`step` runs it, :meth:`free` lets its communicators go."""

    def __init__(self, cfg: dict[str, Any], cand: Any, cuts: Any = None) -> None:
        import torch
        from mpi4py import MPI

        import hpctp
        from apps.surrogate.autoplan import planning_inputs
        from hpctp.nn import ParallelPlan, PipelineParallel, ShardedDataParallel

        inputs = planning_inputs(cfg)
        smp = inputs["sample"]
        nsp = len(cand.spatial)
        pipe = (cand.pipeline,) if cand.pipeline > 1 else ()
        dims = (cand.data, *pipe, *cand.spatial) + ((cand.tensor,) if cand.tensor > 1 else ())
        first = 1 + len(pipe)
        self.grid = hpctp.ProcessGrid(dims, comm=MPI.COMM_WORLD)
        self.plan = plan = ParallelPlan(self.grid, data=(0,), pipeline=(1,) if pipe else (),
                                        spatial=tuple(range(first, first + nsp)),
                                        tensor=(first + nsp,) if cand.tensor > 1 else ())  # fmt: skip
        with torch.device("meta"):
            self.model = inputs["builder"](plan)
        if cand.recompute:
            inputs["recompute"](self.model)
        self.pipelined = bool(pipe)
        self.wrapped: Any
        if pipe:  # (stages cut where the planner priced them; without cuts, PipelineParallel's default)
            self.wrapped = PipelineParallel(self.model, plan, schedule=cand.schedule, microbatches=cand.microbatches,
                                            virtual=cand.chunks, zero=cand.zero or None, seed=0,
                                            cuts=cuts or None)  # fmt: skip
        else:
            self.wrapped = ShardedDataParallel(self.model, plan, stage=cand.zero, seed=0)
        self.opt = torch.optim.Adam(self.wrapped.parameters(), lr=1e-4)
        lo, hi = plan.sample_range(smp.batch)
        g = torch.Generator().manual_seed(0)
        whole = torch.randn(smp.shape, generator=g, dtype=smp.torch_dtype)
        lay = hpctp.Layout((hi - lo, *smp.shape[1:]), plan.model_grid.dims, (None, None, *plan.spatial))
        # (a copy: a data group's rows are a view of the whole batch, whose storage a rank would never hold)
        block = whole[lo:hi][lay.local_slices(plan.model_grid.coords)].clone()
        del whole
        self.x = hpctp.DistTensor(block, plan.model_grid, lay)
        self.y = torch.roll(block, 1, dims=-1).contiguous()
        self.yd = hpctp.DistTensor(self.y, plan.model_grid, lay)

    def _loss(self, pred: Any, target: Any) -> Any:
        from hpctp.nn import global_mse_loss

        return global_mse_loss(pred.local, target.local, self.plan.grid, self.plan.loss_axes)

    def step(self) -> None:
        """Collective over the world. One training step."""
        self.wrapped.zero_grad(set_to_none=True)
        self.opt.zero_grad(set_to_none=True)
        if self.pipelined:
            self.wrapped.step(self.x, self.yd, self._loss, optimizer=self.opt)
            return
        self._loss(self.wrapped(self.x), self.yd).backward()
        self.wrapped.step(self.opt)

    def timed(self) -> float:
        """Collective over the world. One step's time on the slowest rank [s]."""
        import hpctp

        return hpctp.comm.slowest_seconds(self.grid.comm, self.step)

    def free(self) -> None:
        """Collective over the world."""
        self.plan.free()
        self.grid.free()


def _run_plan(
    cfg: dict[str, Any], cand: Any, steps: int, memory: bool, reference: _Built | None = None, cuts: Any = None
) -> dict[str, Any]:
    """Collective over the world. Train ``cand`` for ``steps`` steps; its best time and (``memory``) its peaks.

    With ``reference``, each timed step is followed by one of the reference plan's: ``ratio`` is the median of the
    plan's step over the reference's that follows it. The two steps run within a fraction of a second of each other,
    so a machine that drifts slower over seconds (``benchmarks/machine_drift.py``) slows both alike."""
    import numpy as np
    import torch

    import hpctp
    from hpctp._util.memory import resident_bytes
    from hpctp.nn import ShardedDataParallel

    before = resident_bytes()
    with hpctp.PeakMemory(baseline=before) as resident:
        built = _Built(cfg, cand, cuts)
        for _ in range(2):
            built.step()
    times, cpus, refs = [], [], []  # (timed without the resident set's sampling thread: it costs every step 10-25%)
    for _ in range(steps):
        c0 = time.process_time()
        times.append(built.timed())
        cpu = np.array([time.process_time() - c0])
        hpctp.comm.allreduce(built.grid.comm, cpu, "max")
        cpus.append(float(cpu[0]))
        if reference is not None:
            refs.append(reference.timed())
    ratio = float(np.median(np.divide(times, refs))) if refs else math.nan
    out = {"label": cand.label(), "step": float(np.min(times)), "cpu": float(np.min(cpus)), "memory": 0,
           "resident": 0, "ratio": ratio, "reference": float(np.median(refs)) if refs else math.nan}  # fmt: skip
    if memory:
        wrapped, opt = built.wrapped, built.opt
        wrapped.zero_grad(set_to_none=True)  # (as a step starts: the last step's gradients are dropped)
        held = [*built.model.parameters(), *wrapped.parameters(), built.x.local, built.y]
        held += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        entry = _state_bytes(held)  # (and stage 3's unit memory kept from the last step, which no tensor holds)
        entry += sum(m.cache_bytes for m in wrapped.modules() if isinstance(m, ShardedDataParallel))
        del held
        with hpctp.PeakMemory(tensors=True) as live:
            built.step()
        table = hpctp.comm.allgather_ints(built.grid.comm, [entry + live.tensors, resident.peak])
        out.update(memory=int(table[:, 0].max()), resident=int(table[:, 1].max()))
    built.free()
    return out


def _candidate(spec: dict[str, Any]) -> Any:
    from hpctp.perf import Candidate

    return Candidate(spec["data"], tuple(spec["spatial"]), spec["tensor"], spec["pipeline"], spec["zero"],
                     spec["recompute"], spec["schedule"], spec["microbatches"], spec["chunks"])  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """Collective over the world. One pass: each plan of ``--plans`` in turn, each timed step followed by one of the
    ``--reference`` plan; one JSON line per plan on rank 0 (the launcher runs ``--cycles`` such jobs and keeps each
    plan's median ratio to the reference, and its best step)."""
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    cfg = _config(args, args.model)
    reference = None
    if args.reference:  # (built first, warmed up, kept throughout)
        ref = json.loads(args.reference)
        reference = _Built(cfg, _candidate(ref), ref.get("cuts"))
        for _ in range(2):
            reference.step()
    for spec in json.loads(args.plans):
        row = _run_plan(cfg, _candidate(spec), args.steps, memory=args.memory, reference=reference,
                        cuts=spec.get("cuts"))  # fmt: skip
        gc.collect()  # (the wrapper's hooks make cycles: free each plan's tensors before the next)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps(row), flush=True)
    if reference is not None:
        reference.free()


# ---------------------------------------------------------------------------------------------- launcher


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _mpiexec(n: int, cmd: list[str], timeout: float = 7200) -> str:
    """``mpiexec -n n python cmd``; its stdout. The allocator is this process's (:func:`_under_jemalloc`)."""
    env = _env()
    full = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(n), sys.executable, *cmd]
    proc = subprocess.run(full, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout, check=False)
    if proc.returncode:
        sys.exit(
            f"{' '.join(cmd[:3])} on {n} ranks failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc.stdout


CALIBRATIONS = 3
"""Calibrations per rank count, a few seconds apart; the machine file takes each figure's median (one calibration's
time per kernel read 6.7 to 11.8 us on 4 ranks within a minute here)."""


def _machine(args: argparse.Namespace, n: int) -> str:
    import hpctp

    if args.machine:
        return str(args.machine)
    out = Path(args.out) / f"machine-{n}.toml"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"calibrating this machine on {n} ranks ({CALIBRATIONS} times, each figure's median) ...", flush=True)
    runs = []
    for k in range(CALIBRATIONS):
        one = out.with_name(f"machine-{n}-{k}.toml")
        _mpiexec(n, ["-m", "hpctp", "perf", "calibrate", "--out", str(one)])
        runs.append(hpctp.perf.load_machine(one))
    _median_profile(runs).save(out)
    return str(out)


def _median_profile(runs: list[Any]) -> Any:
    """Each figure of the machine profiles ``runs`` (same keys) at its median."""
    import dataclasses
    import statistics

    from hpctp.perf import Link

    def links(tables: list[Any]) -> dict[str, dict[str, Any]]:
        return {level: {kind: Link(statistics.median(t[level][kind].alpha for t in tables),
                                   statistics.median(t[level][kind].beta for t in tables)) for kind in tables[0][level]}
                for level in tables[0]}  # fmt: skip

    compute = {dtype: dataclasses.replace(rates, **{f.name: statistics.median(getattr(r.compute[dtype], f.name)
                                                                              for r in runs)
                                                     for f in dataclasses.fields(rates)})
               for dtype, rates in runs[0].compute.items()}  # fmt: skip
    return dataclasses.replace(runs[0], compute=compute, network=links([r.network for r in runs]),
                               calibration=links([r.calibration for r in runs]),
                               overlap=statistics.median(r.overlap for r in runs),
                               note=f"{runs[0].note}; each figure the median of {len(runs)} calibrations")  # fmt: skip


def _spec(p: Any) -> dict[str, Any]:
    """A prediction's plan as the worker takes it, with the pipeline's stage cuts the prediction assumed."""
    c = p.candidate
    return {
        "cuts": list(p.cuts),
        "data": c.data,
        "spatial": list(c.spatial),
        "tensor": c.tensor,
        "zero": c.zero,
        "recompute": c.recompute,
        "pipeline": c.pipeline,
        "schedule": c.schedule,
        "microbatches": c.microbatches,
        "chunks": c.chunks,
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def run_model(args: argparse.Namespace, n: int, model: str, machine: str) -> dict[str, Any] | None:
    """Plan ``model`` on ``n`` ranks, run its plans, print the table; the targets' figures (None: no plan fits)."""
    import hpctp
    from apps.surrogate.autoplan import planning_inputs
    from hpctp.perf.search import spearman

    cfg = _config(args, model)
    inputs = planning_inputs(cfg)
    budget = hpctp.perf.parse_bytes(args.wide_memory if model == "wide-fno" else args.memory)
    t0 = time.perf_counter()
    try:
        report = hpctp.perf.plan(inputs["builder"], inputs["sample"], ranks=n, memory=budget, machine=machine,
                                 recompute=inputs["recompute"], pipeline=args.pipeline)  # fmt: skip
    except hpctp.perf.PlanError as e:
        print(f"\n### {model} on {n} ranks: no plan fits, none run: {e}\n", flush=True)
        return None
    seconds = time.perf_counter() - t0
    runnable = list(report.ranked)
    over = list(report.infeasible) if model == "wide-fno" else []
    todo = runnable + over
    measured: dict[str, dict[str, Any]] = {}
    ratios: dict[str, list[float]] = {}  # (each plan's step against the top pick's, per pass)
    refs: list[float] = []
    for cycle in range(args.cycles):  # (one job per pass: what a pass leaves allocated ends with its processes)
        # each pass starts at another plan: the first plan of a job runs on a cold process (its heap, its caches),
        # and in the ranked order that would be the top pick in every pass
        k = cycle * len(todo) // args.cycles
        order = todo[k:] + todo[:k]
        out = _mpiexec(n, [str(Path(__file__).resolve()), "--worker", f"--model={model}", f"--steps={args.steps}",
                           f"--plans={json.dumps([_spec(p) for p in order])}",
                           f"--reference={json.dumps(_spec(runnable[0]))}",
                           *[f"--set={s}" for s in args.set], f"--wide-width={args.wide_width}",
                           *(["--no-memory"] if cycle else [])])  # fmt: skip
        for line in out.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                ratios.setdefault(row["label"], []).append(row["ratio"])
                refs.append(row["reference"])
                prev = measured.setdefault(row["label"], row)
                prev["step"], prev["cpu"] = min(prev["step"], row["step"]), min(prev["cpu"], row["cpu"])
    speed = statistics.median(refs)  # (the top pick's step at the run's median speed)
    for label, row in measured.items():
        row["paired"] = statistics.median(ratios[label]) * speed
    w = report.workload
    note = "" if args.pipeline else "; pipeline plans left out (--no-pipeline)"
    print(f"\n### {model} on {n} ranks: {w.param_count / 1e6:.3g} M parameters, sample {w.sample.shape}, budget "
          f"{_mib(budget)} MiB per rank; {len(report.ranked)} plans predicted to fit, {len(report.infeasible)} not "
          f"(planned in {seconds:.1f} s){note}\n")  # fmt: skip
    heads = ["plan", "predicted memory [MiB]", "measured (live tensors) [MiB]", "error", "resident [MiB]",
             "predicted step [ms]", "measured step [ms]", "best step [ms]", "measured CPU [ms]",
             "bottleneck (predicted)"]  # fmt: skip
    print("| " + " | ".join(heads) + " |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    errors, pred_t, meas_t, meas_c = [], [], [], []
    for p in todo:
        m = measured[p.candidate.label()]
        err = p.memory.total / m["memory"] - 1
        errors.append(err)
        if p.fits:
            pred_t.append(p.time.total)
            meas_t.append(m["paired"])
            meas_c.append(m["cpu"])
        cells = [p.candidate.label(), _mib(p.memory.total), _mib(m["memory"]), f"{err:+.1%}", _mib(m["resident"]),
                 f"{p.time.total * 1e3:.1f}" if p.fits else "(does not fit)", f"{m['paired'] * 1e3:.1f}",
                 f"{m['step'] * 1e3:.1f}", f"{m['cpu'] * 1e3:.1f}", p.bottleneck if p.fits else p.reason]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    rho, rho_cpu = spearman(pred_t, meas_t), spearman(pred_t, meas_c)
    gap, gap_cpu = meas_t[0] / min(meas_t) - 1, meas_c[0] / min(meas_c) - 1
    exceed = [measured[p.candidate.label()]["memory"] > budget for p in over]
    self_rho, self_gap = repeatability([[ratios[p.candidate.label()][k] for p in runnable] for k in range(args.cycles)])
    worst = max(abs(e) for e in errors)
    print(f"\nmemory error: largest |error| {worst:.1%} over {len(errors)} plans (target 15%); Spearman of the step "
          f"times {rho:.2f} (wall), {rho_cpu:.2f} (CPU) over {len(pred_t)} plans (target 0.8); top pick "
          f"{runnable[0].candidate.label()}: {gap:+.1%} from the fastest measured (CPU: {gap_cpu:+.1%}; target 10%)"
          + (f"; predicted over budget: {sum(exceed)} of {len(exceed)} measured over it" if over else "")
          + f"; the measurement against itself (each pass against the others): Spearman {self_rho:.2f}, its fastest "
          f"plan {self_gap:+.1%}; the top pick's step {speed * 1e3:.1f} ms (median), {min(refs) * 1e3:.1f} to "
          f"{max(refs) * 1e3:.1f} ms over the plans and passes", flush=True)  # fmt: skip
    return {"model": model, "ranks": n, "max_error": worst, "spearman": rho, "gap": gap, "spearman_cpu": rho_cpu,
            "gap_cpu": gap_cpu, "exceed": (sum(exceed), len(exceed)), "plans": len(pred_t), "self_spearman": self_rho,
            "self_gap": self_gap, "drift": max(refs) / min(refs)}  # fmt: skip


def repeatability(passes: list[list[float]]) -> tuple[float, float]:
    """How well this machine's measurement predicts itself: the ceiling of the ranking targets here.

    ``passes[k][i]``: plan ``i``'s step time (or its step over the top pick's) in pass ``k``. Each pass ``k`` is
    compared with the median of every plan over the other passes (the measure the predictions are compared with,
    less one pass): Spearman's rank correlation, and the gap of pass ``k``'s fastest plan to the fastest there (as the
    top pick's gap). Returns the mean of each over ``k`` (NaN with fewer than 2 passes).
    """
    import numpy as np

    from hpctp.perf.search import spearman

    if len(passes) < 2:
        return math.nan, math.nan
    t = np.asarray(passes, dtype=float)
    rhos, gaps = [], []
    for k in range(len(t)):
        rest = np.median(np.delete(t, k, axis=0), axis=0)
        rhos.append(spearman(t[k].tolist(), rest.tolist()))
        gaps.append(rest[int(np.argmin(t[k]))] / rest.min() - 1)
    return float(np.mean(rhos)), float(np.mean(gaps))


PROJECTION = {"1B": (2048, 20, 16), "10B": (5120, 32, 40)}
"""The projected ViTs: embed, depth, heads (MLP ratio 4, patch 16: 256 x 256 tokens of a 4096 x 4096 field)."""


def projection(batch: int = 256) -> None:
    """The ViT surrogate at about 1 and 10 billion parameters on 4096 x 4096 fields on H100 systems: predictions from
    published figures (bfloat16 parameters, activations and Adam state; a global batch of ``batch`` fields)."""
    import torch

    import hpctp
    from apps.surrogate.parallel import checkpoint_layers
    from apps.surrogate.vit import ViT

    machine = hpctp.perf.load_machine("h100-ndr")
    peak = 989e12  # bf16 dense tensor-core peak per GPU (datasheet), the denominator of the fraction of peak
    print(
        "\n### Projection: predictions from published figures (hpctp/perf/machines/h100-ndr.toml), not measurements\n"
    )
    print("| model | GPUs | chosen plan | grid (P,D,S,S,T) | memory per GPU [GiB] | predicted step [s] | fraction of peak "
          "FLOP/s | bound by |")  # fmt: skip
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | --- |")
    for name, (embed, depth, heads) in PROJECTION.items():

        def builder(plan: Any, embed: int = embed, depth: int = depth, heads: int = heads) -> torch.nn.Module:
            return ViT(2, 16, embed, depth, heads, 4.0, "global", 5, "ring", plan.model_grid, 0, torch.bfloat16,
                       tensor_axis=plan.tensor[0] if plan.tensor else None)  # fmt: skip

        sample = hpctp.perf.Sample((batch, 2, 4096, 4096), "bfloat16", spatial_multiple=16, tensor_units=heads)
        t0 = time.perf_counter()
        work = hpctp.perf.trace(builder, sample, recompute=checkpoint_layers, device="meta")
        traced = time.perf_counter() - t0
        for gpus in (64, 512, 4096):
            t0 = time.perf_counter()
            label = f"ViT {name} ({work.param_count / 1e9:.2f} B)"
            try:
                r = hpctp.perf.plan(work, ranks=gpus, memory="80GiB", machine=machine)
            except hpctp.perf.PlanError as e:
                print(f"| {label} | {gpus} | none fits: {e} | | | | | |")
                continue
            b = r.best
            frac = b.time.flops / b.time.total / peak
            print(f"| {label} | {gpus} | {b.candidate.label()} | {'x'.join(map(str, b.candidate.dims))} | "
                  f"{b.memory.total / 2**30:.1f} | {b.time.total:.3g} | {frac:.0%} | {b.bottleneck} |", flush=True)  # fmt: skip
            print(f"<!-- {name} on {gpus}: {len(r.ranked)} plans fit, {len(r.infeasible)} do not; traced in "
                  f"{traced:.0f} s, searched in {time.perf_counter() - t0:.1f} s -->", flush=True)  # fmt: skip


def _under_jemalloc(args: argparse.Namespace, argv: list[str] | None) -> None:
    """This launcher again, with jemalloc preloaded where it is installed (unless ``--glibc``): the planner measures
    a step's host time in this process (:func:`hpctp.perf.trace`), the calibration and the plans run in its children,
    and all of them should see the allocator the plans run under (glibc's fresh pages per step cost the FNO half its
    step time on this machine)."""
    from hpctp._util.memory import jemalloc_library

    lib = jemalloc_library()
    if args.glibc or not lib or lib in os.environ.get("LD_PRELOAD", "").split(":"):
        return
    env = {**os.environ, "LD_PRELOAD": ":".join(x for x in (lib, os.environ.get("LD_PRELOAD", "")) if x)}
    sys.stdout.flush()
    os.execve(
        sys.executable,
        [sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:])],
        env,
    )


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    sys.path.insert(0, str(ROOT))
    if args.worker:
        worker(args)
        return
    if args.projection:
        projection()
        return
    _under_jemalloc(args, argv)
    results = []
    for n in args.ranks:
        machine = _machine(args, n)
        for model in args.models:
            r = run_model(args, n, model, machine)
            if r is not None:
                results.append(r)
    print("\n| model | ranks | plans timed | largest memory error | Spearman, wall (CPU) | top pick vs fastest, wall "
          "(CPU) | measurement against itself: Spearman, fastest vs fastest | the top pick's step, slowest / fastest "
          "| over-budget plans measured over budget |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        ex = f"{r['exceed'][0]} of {r['exceed'][1]}" if r["exceed"][1] else "-"
        print(f"| {r['model']} | {r['ranks']} | {r['plans']} | {r['max_error']:.1%} | {r['spearman']:.2f} "
              f"({r['spearman_cpu']:.2f}) | {r['gap']:+.1%} ({r['gap_cpu']:+.1%}) | {r['self_spearman']:.2f}, "
              f"{r['self_gap']:+.1%} | {r['drift']:.2f} | {ex} |")  # fmt: skip
    ok = all(r["max_error"] <= 0.15 and r["spearman"] >= 0.8 and r["gap"] <= 0.10 for r in results)
    print(f"\ntargets {'met' if ok else 'NOT all met'} (memory within 15%, Spearman >= 0.8, top pick within 10%)")


if __name__ == "__main__":
    main()
