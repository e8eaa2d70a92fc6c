"""``hpctp plan CONFIG`` and ``hpctp perf calibrate``: the planner and the machine measurement from the command line.

``hpctp plan`` runs in one process (no ``mpiexec``). CONFIG is a TOML file; what the planner needs of it (the
model builder, the global batch of a step, how layers are checkpointed) comes from a function named by its
``[plan] inputs = "module:function"`` key, or for an ``apps`` surrogate config (one with a ``[surrogate]``
section) from :data:`SURROGATE_INPUTS`. The function takes the parsed config and returns a dict with
``builder`` and ``sample`` (and optionally ``recompute``, ``units``); its module is imported from the
current directory or the repository holding CONFIG.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._util.toml_config import apply_overrides, read_toml

__all__ = ["SURROGATE_INPUTS", "planning_inputs", "plan_command", "calibrate_command"]

SURROGATE_INPUTS = "apps.surrogate.autoplan:planning_inputs"
"""The inputs function of configs with a ``[surrogate]`` section (the apps of this repository)."""


def _import(spec: str, near: Path) -> Callable[..., Any]:
    if ":" not in spec:
        raise ValueError(f"[plan] inputs = {spec!r} must name a function as 'module:function'")
    module, name = spec.split(":", 1)
    top = module.split(".")[0]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != top and not (e.name or "").startswith(top + "."):
            raise
        for folder in [Path.cwd(), *near.resolve().parents]:  # the repository holding the config
            if (folder / top).is_dir() or (folder / f"{top}.py").is_file():
                sys.path.insert(0, str(folder))
                break
        else:
            raise ValueError(
                f"cannot import {module!r} for [plan] inputs: run from the directory that holds it"
            ) from None
        mod = importlib.import_module(module)
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"[plan] inputs = {spec!r}: {module} has no function {name!r}")
    return fn  # type: ignore[no-any-return]


def planning_inputs(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Local. The planner's inputs of the config at ``path`` (``section.key=value`` overrides applied).

    Raises
    ------
    FileNotFoundError
        If the file does not exist.
    ValueError
        On invalid TOML, an override of an unknown key, or a config that names no inputs function.
    """
    p = Path(path)
    cfg = apply_overrides(read_toml(p), overrides)
    spec = cfg.get("plan", {}).get("inputs") if isinstance(cfg.get("plan"), dict) else None
    if spec is None:
        if "surrogate" not in cfg:
            raise ValueError(
                f"config {p} names no model: add [plan] inputs = 'module:function' (a function of the config returning "
                "{'builder': ..., 'sample': ...}), or use an apps surrogate config"
            )
        spec = SURROGATE_INPUTS
    out = _import(str(spec), p)(cfg)
    if not isinstance(out, dict) or "builder" not in out or "sample" not in out:
        raise ValueError(f"{spec} must return a dict with 'builder' and 'sample', got {type(out).__name__}")
    return out


def plan_command(config: str, ranks: int, memory: str, machine: str | None, top: int, overrides: Sequence[str],
                 pipeline: bool) -> int:  # fmt: skip
    """Local. ``hpctp plan``: print the ranked plans; a clear message and exit status 2 when none fits."""
    from ..perf import PlanError, plan
    from ..perf.planner import DEFAULT_MACHINE

    if machine is None:
        print(_default_machine_warning(DEFAULT_MACHINE), file=sys.stderr, flush=True)
    try:
        inputs = planning_inputs(config, overrides)
        report = plan(inputs["builder"], inputs["sample"], ranks=ranks, memory=memory, machine=machine,
                      recompute=inputs.get("recompute", True), units=inputs.get("units"), pipeline=pipeline)  # fmt: skip
    except (PlanError, ValueError, FileNotFoundError) as e:
        print(f"hpctp plan: {e}", file=sys.stderr, flush=True)
        return 2
    print(report.table(top=top), flush=True)
    best = report.best
    print(f"\nchosen: {best.candidate.label()} (grid {'x'.join(map(str, best.candidate.dims))} as pipeline x data x "
          f"spatial x tensor), bounded by {best.bottleneck}", flush=True)  # fmt: skip
    return 0


def _default_machine_warning(name: str) -> str:
    """Local. What ``hpctp plan`` says on stderr when no ``--machine`` is given: whose figures price the plans."""
    from ..perf.machine import load_machine, published_machines

    return (
        f"hpctp plan: warning: no --machine given, so the plans are priced on the published profile {name!r} "
        f"({load_machine(name).name}), not on this machine. Measure this machine with "
        "'mpiexec -n 2 hpctp perf calibrate --out machine.toml' and pass --machine machine.toml, or name the "
        f"machine you will run on with --machine (published: {', '.join(published_machines())})."
    )


def calibrate_command(out: str, dtype: str, repeats: int) -> int:
    """Collective over COMM_WORLD. ``hpctp perf calibrate``: measure and write the machine file (rank 0)."""
    from mpi4py import MPI

    from ..comm import ProcessGrid
    from ..perf import calibrate

    grid = ProcessGrid([0] * (2 if MPI.COMM_WORLD.Get_size() > 1 else 1), comm=MPI.COMM_WORLD)
    profile = calibrate(grid, dtype=dtype, repeats=repeats)
    if grid.rank == 0:
        profile.save(out)
        rates = profile.rates(dtype)
        print(f"{profile.name}: GEMM {rates.gemm / 1e9:.3g} GFLOP/s, conv {rates.conv / 1e9:.3g}, FFT {rates.fft / 1e9:.3g}, "
              f"attention {rates.attention / 1e9:.3g} (softmax {rates.softmax / 1e9:.3g} G scores/s), "
              f"memory {rates.bandwidth / 1e9:.3g} GB/s, "
              f"{rates.kernel * 1e6:.3g} us per kernel per rank", flush=True)  # fmt: skip
        for kind, link in profile.network["intra"].items():
            print(
                f"  {kind:15s} alpha {link.alpha * 1e6:8.2f} us   beta {1 / max(link.beta, 1e-30) / 1e9:8.3g} GB/s",
                flush=True,
            )
        print(f"written to {out}", flush=True)
    grid.free()
    return 0
