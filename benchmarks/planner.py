"""The planner (:func:`hpctp.perf.plan`) against measurement: every plan it calls feasible, run for a few steps.

Usage::

    python benchmarks/planner.py                          # ViT, FNO and a wide FNO on 4 and 6 ranks; the tables
    python benchmarks/planner.py --ranks 4 --models fno   # less
    python benchmarks/planner.py --projection              # only the table of predictions for H100 systems

Per rank count ``n`` the launcher first calibrates this machine on ``n`` ranks (``hpctp perf calibrate``, unless
``--machine`` gives a file), then per model it runs the planner here (one process) and launches one worker job
(``mpiexec -n n``, under jemalloc where installed) that trains each plan of the list for ``--steps`` steps of the
surrogate's training step (:class:`hpctp.nn.ShardedDataParallel`, Adam, the global MSE; the model built on the meta
device and materialized by the wrapper) and measures:

* **step**: the median over the steps (after two warm-up steps) of the slowest rank's time; the best of ``--rounds``
  worker jobs;
* **memory** (the measure the predictions are compared with): the live tensors of one more step, torch.profiler's
  allocation events (:class:`hpctp.PeakMemory` ``tensors=True``: what the allocator was asked for, without what it
  keeps after frees), plus the bytes alive on entry (parameters, slices, optimizer state, the batch), the largest
  over ranks; and **resident**: the growth of the resident set over the plan's construction and steps (jemalloc
  returns freed memory, so it is the plan's own), for reference.

The models are the surrogate configs of ``apps/configs`` (``vit.toml``, ``default.toml``: the FNO) with ``--set``
overrides, and a wide FNO (``--wide-width`` channels) whose state exceeds ``--wide-memory`` on one rank; the planner
gets ``--memory`` per rank for the first two and ``--wide-memory`` for the wide one, and for the wide one the
worker also runs every plan predicted not to fit, to check it indeed exceeds the budget. Pipeline plans run only if
``hpctp.nn.PipelineParallel`` exists (else they are left out of the search, with a note). Printed: one table per
model and rank count (predicted and measured memory and step time per plan), the targets (memory error per plan,
Spearman's rank correlation of the step times, the top pick's gap to the fastest measured plan, the budget check)
and, with ``--projection``, the ViT surrogate at about 1 and 10 billion parameters on 4096 x 4096 fields at 64, 512
and 4096 H100 GPUs (predictions from the published figures of ``hpctp/perf/machines/h100-ndr.toml``).
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
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
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 6])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (every model)")
    p.add_argument("--memory", default="2GiB", help="budget per rank of the ViT and the FNO")
    p.add_argument("--wide-width", type=int, default=96, help="channels of the wide FNO")
    p.add_argument("--wide-memory", default="160MiB", help="budget per rank of the wide FNO (below its 1-rank need)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="worker jobs per model (the best time of each plan)")
    p.add_argument("--machine", default=None, help="machine file (default: calibrate on each rank count)")
    p.add_argument("--out", default=str(ROOT / "build" / "planner"), help="where machine files and results go")
    p.add_argument("--projection", action="store_true", help="only the table of H100 projections")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="fno", help=argparse.SUPPRESS)
    p.add_argument("--plans", default="", help=argparse.SUPPRESS)
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
    """Bytes of the distinct storages behind ``tensors`` (a resized-away storage counts 0)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def _run_plan(cfg: dict[str, Any], cand: Any, steps: int) -> dict[str, Any]:
    """Collective over the world. Train ``cand`` for ``steps`` steps; its times and peaks (rank 0's dict)."""
    import numpy as np
    import torch
    from mpi4py import MPI

    import hpctp
    from apps.surrogate.autoplan import planning_inputs
    from hpctp._util.memory import resident_bytes
    from hpctp.nn import ParallelPlan, ShardedDataParallel, global_mse_loss

    inputs = planning_inputs(cfg)
    smp = inputs["sample"]
    nsp = len(cand.spatial)
    dims = (cand.data, *cand.spatial) + ((cand.tensor,) if cand.tensor > 1 else ())
    before = resident_bytes()
    with hpctp.PeakMemory(baseline=before) as resident:
        grid = hpctp.ProcessGrid(dims, comm=MPI.COMM_WORLD)
        plan = ParallelPlan(grid, data=(0,), spatial=tuple(range(1, 1 + nsp)),
                            tensor=(1 + nsp,) if cand.tensor > 1 else ())  # fmt: skip
        with torch.device("meta"):
            model = inputs["builder"](plan)
        if cand.recompute:
            inputs["recompute"](model)
        sdp = ShardedDataParallel(model, plan, stage=cand.zero, seed=0)
        opt = torch.optim.Adam(sdp.parameters(), lr=1e-4)
        lo, hi = plan.sample_range(smp.batch)
        g = torch.Generator().manual_seed(0)
        whole = torch.randn(smp.shape, generator=g, dtype=smp.torch_dtype)
        lay = hpctp.Layout((hi - lo, *smp.shape[1:]), plan.model_grid.dims, (None, None, *plan.spatial))
        block = whole[lo:hi][lay.local_slices(plan.model_grid.coords)].contiguous()
        del whole
        x = hpctp.DistTensor(block, plan.model_grid, lay)
        y = torch.roll(block, 1, dims=-1).contiguous()

        def step() -> None:
            sdp.zero_grad(set_to_none=True)
            opt.zero_grad(set_to_none=True)
            pred = sdp(x)
            loss = global_mse_loss(pred.local, y, plan.grid, plan.loss_axes)
            loss.backward()
            sdp.step(opt)

        for _ in range(2):
            step()
        times = [hpctp.comm.slowest_seconds(grid.comm, step) for _ in range(steps)]
    sdp.zero_grad(set_to_none=True)  # (as a step starts: the last step's gradients are dropped)
    held = [*model.parameters(), *sdp.parameters(), x.local, y]
    held += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    entry = _state_bytes(held)
    del held
    with hpctp.PeakMemory(tensors=True) as live:
        step()
    if os.environ.get("PLANNER_DEBUG"):
        print("entry", entry, "live", live.tensors, flush=True)
    table = hpctp.comm.allgather_ints(grid.comm, [entry + live.tensors, resident.peak])
    out = {"label": cand.label(), "step": float(np.median(times)), "memory": int(table[:, 0].max()),
           "resident": int(table[:, 1].max())}  # fmt: skip
    plan.free()
    grid.free()
    return out


def worker(args: argparse.Namespace) -> None:
    """Collective over the world. Each plan of ``--plans`` in turn; one JSON line per plan on rank 0."""
    import torch
    from mpi4py import MPI

    from hpctp.perf import Candidate

    torch.set_num_threads(1)
    cfg = _config(args, args.model)
    for spec in json.loads(args.plans):
        cand = Candidate(spec["data"], tuple(spec["spatial"]), spec["tensor"], 1, spec["zero"], spec["recompute"])
        row = _run_plan(cfg, cand, args.steps)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps(row), flush=True)


# ---------------------------------------------------------------------------------------------- launcher
def _jemalloc() -> str | None:
    for candidate in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"):
        if Path(candidate).exists():
            return candidate
    found = ctypes.util.find_library("jemalloc")
    return found if found and Path(found).is_absolute() else None


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _mpiexec(n: int, cmd: list[str], jemalloc: bool = False, timeout: float = 7200) -> str:
    env = _env()
    lib = _jemalloc()
    if jemalloc and lib:
        env["LD_PRELOAD"] = lib
    full = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(n), sys.executable, *cmd]
    proc = subprocess.run(full, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout, check=False)
    if proc.returncode:
        sys.exit(
            f"{' '.join(cmd[:3])} on {n} ranks failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc.stdout


def _machine(args: argparse.Namespace, n: int) -> str:
    if args.machine:
        return str(args.machine)
    out = Path(args.out) / f"machine-{n}.toml"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"calibrating this machine on {n} ranks ...", flush=True)
    _mpiexec(n, ["-m", "hpctp", "perf", "calibrate", "--out", str(out)])
    return str(out)


def _spec(c: Any) -> dict[str, Any]:
    return {"data": c.data, "spatial": list(c.spatial), "tensor": c.tensor, "zero": c.zero, "recompute": c.recompute}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def run_model(args: argparse.Namespace, n: int, model: str, machine: str) -> dict[str, Any]:
    """Plan ``model`` on ``n`` ranks, run its plans, print the table; the targets' figures."""
    import hpctp
    from apps.surrogate.autoplan import planning_inputs

    cfg = _config(args, model)
    inputs = planning_inputs(cfg)
    budget = hpctp.perf.parse_bytes(args.wide_memory if model == "wide-fno" else args.memory)
    has_pipeline = hasattr(hpctp.nn, "PipelineParallel")
    t0 = time.perf_counter()
    report = hpctp.perf.plan(inputs["builder"], inputs["sample"], ranks=n, memory=budget, machine=machine,
                             recompute=inputs["recompute"], pipeline=has_pipeline)  # fmt: skip
    seconds = time.perf_counter() - t0
    runnable = [p for p in report.ranked if p.candidate.pipeline == 1]
    over = [p for p in report.infeasible if p.candidate.pipeline == 1] if model == "wide-fno" else []
    todo = runnable + over
    measured: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):
        out = _mpiexec(n, [str(Path(__file__).resolve()), "--worker", f"--model={model}", f"--steps={args.steps}",
                           f"--plans={json.dumps([_spec(p.candidate) for p in todo])}",
                           *[f"--set={s}" for s in args.set], f"--wide-width={args.wide_width}"], jemalloc=True)  # fmt: skip
        for line in out.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                prev = measured.get(row["label"])
                if prev is None or row["step"] < prev["step"]:
                    measured[row["label"]] = {**row, "memory": max(row["memory"], prev["memory"] if prev else 0)}
    w = report.workload
    print(f"\n### {model} on {n} ranks: {w.param_count / 1e6:.3g} M parameters, sample {w.sample.shape}, budget "
          f"{_mib(budget)} MiB per rank; {len(report.ranked)} plans predicted to fit, {len(report.infeasible)} not "
          f"(planned in {seconds:.1f} s){'' if has_pipeline else '; pipeline plans left out (no hpctp.nn.PipelineParallel yet)'}\n")  # fmt: skip
    print(
        "| plan | predicted memory [MiB] | measured (live tensors) [MiB] | error | resident [MiB] | predicted step [ms] "
        "| measured step [ms] | bottleneck (predicted) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    errors, pred_t, meas_t = [], [], []
    for p in todo:
        m = measured[p.candidate.label()]
        err = p.memory.total / m["memory"] - 1
        errors.append(err)
        fits = p.fits
        if fits:
            pred_t.append(p.time.total)
            meas_t.append(m["step"])
        step = f"{p.time.total * 1e3:.1f}" if fits else "(does not fit)"
        print(f"| {p.candidate.label()} | {_mib(p.memory.total)} | {_mib(m['memory'])} | {err:+.1%} | "
              f"{_mib(m['resident'])} | {step} | {m['step'] * 1e3:.1f} | {p.bottleneck if fits else p.reason} |")  # fmt: skip
    from hpctp.perf.search import spearman

    rho = spearman(pred_t, meas_t)
    fastest = min(meas_t)
    gap = meas_t[0] / fastest - 1
    exceed = [measured[p.candidate.label()]["memory"] > budget for p in over]
    print(f"\nmemory error: largest |error| {max(abs(e) for e in errors):.1%} over {len(errors)} plans (target 15%); "
          f"Spearman of step times {rho:.2f} over {len(pred_t)} plans (target 0.8); top pick {runnable[0].candidate.label()} "
          f"measured {meas_t[0] * 1e3:.1f} ms, {gap:+.1%} from the fastest measured ({fastest * 1e3:.1f} ms; target 10%)"
          + (f"; predicted over budget: {sum(exceed)} of {len(exceed)} measured over it" if over else ""), flush=True)  # fmt: skip
    return {"model": model, "ranks": n, "max_error": max(abs(e) for e in errors), "spearman": rho, "gap": gap,
            "exceed": (sum(exceed), len(exceed)), "plans": len(pred_t)}  # fmt: skip


def projection() -> None:
    """The ViT surrogate at about 1 and 10 billion parameters on 4096 x 4096 fields on H100 systems (predictions)."""
    import hpctp
    from apps.common.config import load_config
    from apps.surrogate.autoplan import planning_inputs

    sizes = {"1B": ["surrogate.embed=2048", "surrogate.depth=20", "surrogate.heads=16"],
             "10B": ["surrogate.embed=5120", "surrogate.depth=32", "surrogate.heads=40"]}  # fmt: skip
    machine = hpctp.perf.load_machine("h100-ndr")
    print(
        "\n### Projection (predictions from published H100 figures, hpctp/perf/machines/h100-ndr.toml; not measured)\n"
    )
    print(
        "| model | GPUs | chosen plan | grid (P,D,S,S,T) | memory per GPU [GiB] | predicted step [s] | "
        "fraction of peak FLOP/s | bound by |"
    )
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | --- |")
    peak = 989e12  # bf16 dense, per GPU (datasheet)
    for name, sets in sizes.items():
        cfg = load_config(str(ROOT / "apps/configs/vit.toml"), [
            "simulation.size=[4096, 4096]", "surrogate.patch=16", "surrogate.mlp_ratio=4.0", "surrogate.dtype='bfloat16'",
            "train.batch_size=256", *sets])  # fmt: skip
        inputs = planning_inputs(cfg)
        work = hpctp.perf.trace(inputs["builder"], inputs["sample"], recompute=inputs["recompute"])
        for gpus in (64, 512, 4096):
            t0 = time.perf_counter()
            try:
                r = hpctp.perf.plan(work, ranks=gpus, memory="80GiB", machine=machine)
            except hpctp.perf.PlanError as e:
                print(f"| ViT {name} ({work.param_count / 1e9:.2f} B) | {gpus} | none fits: {e} | | | | | |")
                continue
            b = r.best
            frac = b.time.flops / b.time.total / peak
            print(f"| ViT {name} ({work.param_count / 1e9:.2f} B) | {gpus} | {b.candidate.label()} | "
                  f"{'x'.join(map(str, b.candidate.dims))} | {b.memory.total / 2**30:.1f} | {b.time.total:.3g} | "
                  f"{frac:.0%} | {b.bottleneck} |  <!-- {len(r.ranked)} plans fit; searched in "
                  f"{time.perf_counter() - t0:.1f} s -->")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    sys.path.insert(0, str(ROOT))
    if args.worker:
        worker(args)
        return
    if args.projection:
        projection()
        return
    results = []
    for n in args.ranks:
        machine = _machine(args, n)
        for model in args.models:
            results.append(run_model(args, n, model, machine))
    print(
        "\n| model | ranks | plans timed | largest memory error | Spearman (step time) | top pick vs fastest | "
        "over-budget plans measured over budget |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        ex = f"{r['exceed'][0]} of {r['exceed'][1]}" if r["exceed"][1] else "-"
        print(
            f"| {r['model']} | {r['ranks']} | {r['plans']} | {r['max_error']:.1%} | {r['spearman']:.2f} | "
            f"{r['gap']:+.1%} | {ex} |"
        )
    ok = all(r["max_error"] <= 0.15 and r["spearman"] >= 0.8 and r["gap"] <= 0.10 for r in results)
    print(f"\ntargets {'met' if ok else 'NOT all met'} (memory within 15%, Spearman >= 0.8, top pick within 10%)")


if __name__ == "__main__":
    main()
