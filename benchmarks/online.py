"""Online training (no snapshot file) against offline training (simulate, write HDF5, train on the file),
and what streaming between groups of ranks costs the simulation.

    mpiexec -n 6 python benchmarks/online.py            # the README's tables (Gray-Scott and Navier-Stokes)
    mpiexec -n 6 python benchmarks/online.py --quick    # tiny configs: seconds (tests/test_benchmarks.py)

Needs 6 ranks: the 4-rank runs use ranks 0-3 (ranks 4-5 sleep meanwhile), "4 + 2" all six.

* **Error** (4 ranks, each PDE: ``apps/configs/default.toml`` Gray-Scott, ``apps/configs/ns.toml``
  Navier-Stokes): offline = ``simulate`` + ``save_snapshots`` (HDF5) + ``train`` (the file, ``train.epochs``
  epochs) + ``evaluate`` on the held-out pairs; online = ``python -m apps.simulate --train-online``'s
  :func:`apps.simulate.online.run_online`, co-located, with the same model, seed and budget of optimizer
  steps on the same snapshots, evaluated on the same held-out pairs (kept aside in memory). The
  ratio online / offline is the reference measured in the same run. Bytes: the snapshot file written,
  and what training read of it (:class:`hpctp.io.IOCounter`, summed over ranks).
* **Time**: the simulation alone (its loop, no file) on the same ranks is the reference of each row.
  Co-located: simulation + training steps in one loop vs simulation alone + writing + offline training.
  Separate groups (``online.placement = "separate"``; 2 simulation + 2 trainer ranks, 4 + 2): the
  simulation's loop time with the stream vs alone on as many ranks, the trainer's utilization (time
  in training steps / its wall time up to the last step), the snapshots thinned; once with
  ``max_wait = 0`` (the simulation never waits: the trainer takes what it can) and once with the
  config's 1 s.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

import hpctp
from apps.common.config import load_config
from apps.simulate.online import run_online, snapshots
from apps.simulate.run import save_snapshots, simulate
from apps.surrogate.evaluate import evaluate
from apps.surrogate.train import train
from hpctp.cli.log import get_logger
from hpctp.comm.io_calls import bcast_bytes

ROOT = Path(__file__).resolve().parents[1]
QUICK = {  # tiny runs for the tests: the same code paths
    "grayscott": ["simulation.size=[16, 16]", "simulation.steps=400", "simulation.warmup=100", "simulation.snapshot_every=20",
                  "surrogate.width=4", "surrogate.modes=4", "surrogate.depth=1", "train.epochs=2"],
    "navier_stokes": ["simulation.size=[16, 16]", "simulation.snapshots=12", "simulation.warmup=2.0", "surrogate.width=4",
                      "surrogate.modes=4", "surrogate.depth=1", "train.epochs=2"],
}  # fmt: skip
CONFIGS = {"grayscott": "default.toml", "navier_stokes": "ns.toml"}


def on_ranks(world: MPI.Intracomm, n: int, fn: Callable[[MPI.Intracomm], Any]) -> Any:
    """Collective over world. ``fn`` on a communicator of ranks ``0..n-1``; the others sleep (not spin)
    until it is done. Returns ``fn``'s result there, None elsewhere."""
    active = world.Get_rank() < n
    sub = hpctp.comm.split_comm(world, 0 if active else 1)
    out = fn(sub) if active else None
    hpctp.comm.free_comm(sub)
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.02)
    return out


def reduce(world: MPI.Intracomm, values: dict[str, float], op: str = "max") -> dict[str, float]:
    """Collective over world. Each value reduced over the ranks (missing: -inf for max, 0 for sum)."""
    keys = sorted(values)
    buf = np.array([values[k] for k in keys], dtype=np.float64)
    hpctp.comm.allreduce(world, buf, op)
    return dict(zip(keys, buf.tolist()))


def offline(cfg: dict[str, Any], work: Path, comm: MPI.Intracomm) -> dict[str, float]:
    """Collective over comm. Simulate, write the file, train on it, evaluate: times, bytes, errors."""
    sim = cfg["simulation"]
    grid = hpctp.ProcessGrid(sim["grid"], comm=comm)
    log = get_logger("bench.offline", grid)
    data, run = str(work / "sim.h5"), str(work / "offline")
    grid.comm.Barrier()
    t0 = time.perf_counter()
    snaps = simulate(sim, grid, log, progress=False)
    t1 = time.perf_counter()
    with hpctp.io.IOCounter() as written:
        save_snapshots(snaps, data, sim)
    grid.comm.Barrier()
    t2 = time.perf_counter()
    with hpctp.io.IOCounter() as read:
        train(cfg, data, run, grid, log)
    grid.comm.Barrier()
    t3 = time.perf_counter()
    res = evaluate(cfg, data, f"{run}/checkpoint.h5", grid, log, plot=None)
    sums = np.array([written.bytes_written, read.bytes_read], dtype=np.float64)
    hpctp.comm.allreduce(grid.comm, sums, "sum")
    grid.free()
    return {
        "sim": t1 - t0, "write": t2 - t1, "train": t3 - t2, "error": res["surrogate"],
        "persistence": res["persistence"], "held_out": res["pairs"], "written": sums[0], "read": sums[1],
    }  # fmt: skip


def alone(cfg: dict[str, Any], comm: MPI.Intracomm) -> dict[str, float]:
    """Collective over comm. The simulation's loop alone (its snapshots made, nothing else): wall
    seconds and CPU seconds (the most of any rank)."""
    sim = cfg["simulation"]
    grid = hpctp.ProcessGrid(sim["grid"], comm=comm)
    grid.comm.Barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    count = sum(1 for _ in snapshots(sim, grid))
    out = reduce(comm, {"sim": time.perf_counter() - t0, "cpu": time.process_time() - c0})
    grid.free()
    return out if count else {"sim": math.nan, "cpu": math.nan}


def online(cfg: dict[str, Any], comm: MPI.Intracomm) -> dict[str, float]:
    """Collective over comm. :func:`run_online`; the results of its simulation and trainer ranks."""
    r = run_online(cfg, comm)
    s = r.get("stats")
    mine = {
        "sim": r.get("sim_seconds", -1.0), "cpu": r.get("sim_cpu", -1.0), "waited": r.get("waited", -1.0), "error": r.get("surrogate", -1.0),
        "persistence": r.get("persistence", -1.0), "utilization": r.get("utilization", -1.0),
        "seconds": r.get("seconds", -1.0), "steps": r.get("steps", -1), "held_out": r.get("held_out", -1),
        "dropped": s.dropped if s else r.get("dropped", -1), "produced": s.produced if s else -1, "pairs": s.pairs if s else -1,
        "used": s.used if s else -1, "reuse": s.reuse if s else -1.0,
    }  # fmt: skip
    out = reduce(comm, mine)
    out["bytes"] = reduce(comm, {"b": float(r.get("bytes_sent", 0))}, "sum")["b"]
    return out


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny configs (seconds): the tests' run")
    p.add_argument("--pde", choices=["grayscott", "navier_stokes", "both"], default="both")
    p.add_argument("--no-separate", action="store_true", help="skip the separate-groups timings")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    if world.Get_size() < 6:
        raise SystemExit("run on 6 ranks: mpiexec -n 6 python benchmarks/online.py (4-rank runs, and 4 + 2)")
    logging.disable(logging.INFO)  # the apps' progress lines; this script prints its own
    mine = tempfile.mkdtemp(prefix="hpctp-online-").encode() if world.rank == 0 else None
    work = Path(bcast_bytes(world, mine).decode())
    say = print if world.rank == 0 else (lambda *a, **k: None)
    pdes = ["grayscott", "navier_stokes"] if args.pde == "both" else [args.pde]
    if not args.quick:  # warm-up, not reported: the first training in a process pays imports (Adam loads dynamo)
        tiny = load_config(
            ROOT / "apps" / "configs" / "default.toml", [f'train.out="{work}/warm"', *QUICK["grayscott"]]
        )
        on_ranks(world, 4, partial(offline, tiny, work / "warm"))
    rows_err, rows_time = [], []
    for pde in pdes:
        sets = [f'train.out="{work}/{pde}/online"', "online.max_wait=inf", *(QUICK[pde] if args.quick else [])]
        cfg = load_config(ROOT / "apps" / "configs" / CONFIGS[pde], sets)
        off = on_ranks(world, 4, partial(offline, cfg, work / pde))
        on = on_ranks(world, 4, partial(online, cfg))
        ref4 = on_ranks(world, 4, partial(alone, cfg))
        t_alone = ref4["sim"] if ref4 else 0.0
        if world.rank == 0:
            ratio = on["error"] / off["error"]
            rows_err.append(
                f"| {pde} | offline | {off['error']:.4f} | {off['persistence']:.4f} | | "
                f"{off['sim'] + off['write'] + off['train']:.1f} s | {_mib(off['written'])} written, {_mib(off['read'])} read |"
            )
            rows_err.append(
                f"| {pde} | online, co-located | {on['error']:.4f} | {on['persistence']:.4f} | {ratio:.2f} | "
                f"{on['sim']:.1f} s | none (replay buffer: {int(on['pairs'])} pairs, {int(on['used'])} used, reuse "
                f"{on['reuse']:.1f}) |"
            )
            base = t_alone + off["write"] + off["train"]
            rows_time.append(
                f"| {pde} | co-located, 4 ranks | {on['sim']:.1f} s (simulation + training) | {t_alone:.1f} s alone + "
                f"{off['write']:.1f} s write + {off['train']:.1f} s training = {base:.1f} s: {on['sim'] / base:.2f}x | "
                f"{100 * on['utilization']:.0f}% | 0 of {int(on['produced'])} | {on['error']:.4f} |"
            )
            say(f"{pde}: online/offline held-out error ratio {ratio:.3f} ({on['error']:.4f} / {off['error']:.4f}, "
                f"persistence {off['persistence']:.4f}, {int(off['held_out'])} held-out pairs)", flush=True)  # fmt: skip
        if args.no_separate or pde != "grayscott":
            continue
        ref2 = on_ranks(world, 2, partial(alone, cfg))
        for sims, total in ((2, 4), (4, 6)):
            ref = ref2 if sims == 2 else ref4
            for wait in ("0", "1.0"):
                c2 = load_config(ROOT / "apps" / "configs" / CONFIGS[pde], [*sets, "online.placement=separate",
                                 f"online.trainer_ranks={total - sims}", f"online.max_wait={wait}"])  # fmt: skip
                r = on_ranks(world, total, partial(online, c2))
                if world.rank == 0:
                    rows_time.append(
                        f"| {pde} | separate, {sims} + {total - sims}, max_wait {wait} s | {r['sim']:.1f} s | "
                        f"{ref['sim']:.1f} s alone: {r['sim'] / ref['sim']:.2f}x (waited {r['waited']:.1f} s; CPU time "
                        f"{r['cpu'] / ref['cpu']:.2f}x) | {100 * r['utilization']:.0f}% | {int(r['dropped'])} of "
                        f"{int(r['produced'])} | {r['error']:.4f} |"
                    )
                    say(f"separate {sims}+{total - sims} max_wait {wait}: sim {r['sim']:.1f} s (alone {ref['sim']:.1f} s), "
                        f"utilization {100 * r['utilization']:.0f}%, dropped {int(r['dropped'])}/{int(r['produced'])}, "
                        f"moved {_mib(r['bytes'])}", flush=True)  # fmt: skip
    say("\n| PDE | training | held-out error | persistence | online / offline | time | snapshot bytes |")
    say("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for row in rows_err:
        say(row)
    say(
        "\n| PDE | placement | simulation time | vs reference | trainer utilization | snapshots dropped | held-out error |"
    )
    say("| --- | --- | ---: | --- | ---: | ---: | ---: |")
    for row in rows_time:
        say(row)
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    from hpctp.cli.runner import run_main

    run_main(main)
