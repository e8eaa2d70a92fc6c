"""Rollouts and the speed-up measurement of the surrogate against single-process references: the
rollout errors of a distributed model equal plain torch's on the gathered snapshots on every grid,
persistence's equal numpy's, the CSV and plot are written; the speed-up script runs end to end."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

import hpctp
from apps.common.config import load_config
from apps.simulate.run import save_snapshots, simulate
from apps.surrogate.__main__ import main as surrogate_main
from apps.surrogate.models import build_model
from apps.surrogate.rollout import max_rollout_steps, rollout, rollout_starts, run_rollout
from apps.surrogate.speedup import format_report, measure, resize_field
from apps.surrogate.speedup import main as speedup_main
from hpctp.cli.log import get_logger
from hpctp.io import save_checkpoint
from hpctp.testing import assert_all, assert_allclose

CONFIGS = Path(__file__).resolve().parent.parent / "apps" / "configs"
TINY = CONFIGS / "tiny.toml"
# 13 snapshots of a 12 x 10 field; every 3rd pair held out: initial states 2, 5, 8, 11
TINY_SET = ["simulation.size=[12, 10]", "simulation.steps=280", "surrogate.model=fno", "surrogate.modes=3"]


def _shared_dir(grid: hpctp.ProcessGrid, factory: pytest.TempPathFactory, name: str) -> Path:
    """One directory for all ranks, chosen by rank 0."""
    buf = np.zeros(256, dtype=np.uint8)
    if grid.rank == 0:
        raw = str(factory.mktemp(name)).encode()
        buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    grid.comm.Bcast(buf, root=0)
    return Path(buf.tobytes().rstrip(b"\0").decode())


def _tiny_data(grid: hpctp.ProcessGrid, factory: pytest.TempPathFactory, extra: Sequence[str] = ()) -> tuple[dict, str]:
    cfg = load_config(TINY, [*TINY_SET, *extra])
    cfg["simulation"]["grid"] = list(grid.dims)
    run = _shared_dir(grid, factory, "rollout")
    cfg["train"]["out"] = str(run / "run")
    if grid.rank == 0:
        (run / "run").mkdir()
    path = str(run / "sim.h5")
    save_snapshots(simulate(cfg["simulation"], grid, get_logger("test", grid), progress=False), path, cfg["simulation"])
    return cfg, path


def _models(cfg: dict, grid: hpctp.ProcessGrid, channels: int = 2) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The distributed FNO and its plain-torch twin, with the same (non-zero) head so that it is not persistence."""
    model = build_model(cfg["surrogate"], channels, grid)
    ref = build_model(cfg["surrogate"], channels, None)
    gen = torch.Generator().manual_seed(11)
    head = 0.3 * torch.randn(ref.head.weight.shape, dtype=torch.float64, generator=gen)
    bias = 0.1 * torch.randn(ref.head.bias.shape, dtype=torch.float64, generator=gen)
    with torch.no_grad():
        for m in (model, ref):
            m.head.weight.copy_(head.reshape(m.head.weight.shape))
            m.head.bias.copy_(bias)
            m.delta_scale.fill_(0.02)
    return model.eval(), ref.eval()


def _reference_rollout(ref: torch.nn.Module, path: str, cfg: dict, steps: int) -> tuple[np.ndarray, np.ndarray]:
    with h5py.File(path, "r") as f:
        snaps = np.asarray(f["fields"])
    horizon = int(cfg["surrogate"]["horizon"])
    starts = rollout_starts(snaps.shape[0], horizon, float(cfg["train"]["holdout"]), steps)
    err, base = np.zeros(steps), np.zeros(steps)
    for s in starts:
        state = torch.from_numpy(snaps[s][None])
        for k in range(1, steps + 1):
            with torch.no_grad():
                state = ref(state)
            truth = snaps[s + k * horizon]
            err[k - 1] += np.linalg.norm(state[0].numpy() - truth) / np.linalg.norm(truth)
            base[k - 1] += np.linalg.norm(snaps[s] - truth) / np.linalg.norm(truth)
    return err / len(starts), base / len(starts)


def test_rollout_starts_and_its_errors() -> None:
    # 13 snapshots, horizon 1, every 3rd pair held out: 2, 5, 8, 11
    assert rollout_starts(13, 1, 0.34, 1) == [2, 5, 8, 11]
    assert rollout_starts(13, 1, 0.34, 3) == [2, 5, 8]
    assert rollout_starts(13, 2, 0.34, 5) == [2]  # 2 + 5 * 2 = 12, the last snapshot
    assert max_rollout_steps(13, 1, 0.34) == 10 and max_rollout_steps(13, 2, 0.34) == 5
    with pytest.raises(ValueError, match="longest rollout this data allows is 10"):
        rollout_starts(13, 1, 0.34, 11)
    with pytest.raises(ValueError, match="steps >= 1"):
        rollout_starts(13, 1, 0.34, 0)


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_rollout_matches_single_process_torch(
    grid2d: hpctp.ProcessGrid, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The model fed its own outputs on the distributed field (in batches of 2 initial states: 2 + 1) gives
    plain torch's errors on the gathered snapshots at every lead; persistence gives numpy's."""
    cfg, path = _tiny_data(grid2d, tmp_path_factory)
    model, ref = _models(cfg, grid2d)
    result = rollout(model, path, cfg, grid2d, 3, batch=2)
    want, want_base = _reference_rollout(ref, path, cfg, 3)
    assert_all(grid2d, result.starts == [2, 5, 8], f"initial states {result.starts}")
    assert_allclose(grid2d, result.surrogate, want, rtol=1e-10, what="surrogate error per lead")
    assert_allclose(grid2d, result.persistence, want_base, rtol=1e-12, what="persistence error per lead")
    assert_all(
        grid2d, bool(np.all(np.abs(result.surrogate - result.persistence) > 1e-6)), "the model is not persistence"
    )
    assert_all(grid2d, [k for k, _, _ in result.frames] == [1, 2, 3], "frames kept at leads 1, 2, 3")
    truth = result.frames[-1][1].gather(None)
    with h5py.File(path, "r") as f:
        stored = np.asarray(f["fields"][2 + 3])
    assert_allclose(grid2d, truth[0].numpy(), stored, rtol=0, what="the kept truth is snapshot 2 + 3")


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_run_rollout_writes_csv_and_plot(grid2d: hpctp.ProcessGrid, tmp_path_factory: pytest.TempPathFactory) -> None:
    cfg, path = _tiny_data(grid2d, tmp_path_factory)
    model, ref = _models(cfg, grid2d)
    run = Path(cfg["train"]["out"])
    save_checkpoint(run / "checkpoint.h5", model, None, 0, grid2d)
    result = run_rollout(cfg, path, str(run / "checkpoint.h5"), grid2d, get_logger("test", grid2d), 4)
    want, want_base = _reference_rollout(ref, path, cfg, 4)
    assert_allclose(grid2d, result.surrogate, want, rtol=1e-10, what="errors after a checkpoint round trip")
    rows = np.loadtxt(run / "rollout.csv", delimiter=",", skiprows=1, ndmin=2)
    header = (run / "rollout.csv").read_text().splitlines()[0]
    assert_all(grid2d, header == "lead,surrogate,persistence", f"CSV header {header!r}")
    assert_allclose(grid2d, rows, np.column_stack([np.arange(1, 5), want, want_base]), rtol=1e-12, what="CSV rows")
    assert_all(grid2d, (run / "rollout.png").stat().st_size > 1000, "rollout.png written")


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_speedup_measures_gray_scott(grid2d: hpctp.ProcessGrid, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Positive times and ratios, finite errors; at the data's size the solver's step from the held-out snapshot
    is the stored next snapshot (Gray-Scott is bitwise reproducible), so the one-step error is plain torch's."""
    cfg, path = _tiny_data(grid2d, tmp_path_factory, ["simulation.size=[12, 12]"])
    model, ref = _models(cfg, grid2d)
    ckpt = Path(cfg["train"]["out"]) / "checkpoint.h5"
    save_checkpoint(ckpt, model, None, 0, grid2d)
    result = measure(cfg, path, str(ckpt), grid2d, get_logger("test", grid2d), sizes=[24], reps=2, leads=[1, 2, 20])
    rows = result["rows"]
    assert_all(grid2d, [r["size"] for r in rows] == [(12, 12), (24, 24)], f"sizes {[r['size'] for r in rows]}")
    ok = all(r["speedup"] > 0 and r["solver_s"] > 0 and r["surrogate_s"] > 0 for r in rows)
    ok = ok and all(r["chain_speedup"] == r["chain_solver_s"] / r["chain_surrogate_s"] > 0 for r in rows)
    assert_all(grid2d, ok and all(math.isfinite(r["one_step_error"]) for r in rows), f"rows {rows}")
    assert_all(grid2d, all(r["solver_steps"] == 20 for r in rows), "one surrogate step = horizon x snapshot_every")
    assert_all(grid2d, result["chain"] == 5, f"chain {result['chain']}")
    with h5py.File(path, "r") as f:
        x, y = np.asarray(f["fields"][2]), np.asarray(f["fields"][3])
    with torch.no_grad():
        p = ref(torch.from_numpy(x[None]))[0].numpy()
    want = np.linalg.norm(p - y) / np.linalg.norm(y)
    assert_allclose(grid2d, rows[0]["one_step_error"], want, rtol=1e-10, what="one-step error vs the solver")
    roll = result["rollout"]
    longest = max_rollout_steps(13, 1, 0.34)
    assert_all(grid2d, roll is not None and roll.surrogate.size == longest and result["leads"] == [1, 2], "leads")
    assert_all(grid2d, bool(np.all(np.isfinite(roll.surrogate))), "finite rollout errors")
    report = format_report(result, cfg, grid2d, True)
    assert_all(grid2d, "| 24x24 |" in report and "speed-up" in report and "lead" in report, report)


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_speedup_measures_navier_stokes(grid2d: hpctp.ProcessGrid, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The CFL-adaptive Navier-Stokes solver from a snapshot, at its size and interpolated spectrally to 32x32."""
    cfg = load_config(
        CONFIGS / "ns.toml",
        ["simulation.size=[16, 16]", "simulation.warmup=0.5", "simulation.snapshots=8", "simulation.snapshot_every=0.25",
         "surrogate.modes=3", "surrogate.width=4", "surrogate.depth=2", "train.holdout=0.34"],
    )  # fmt: skip
    cfg["simulation"]["grid"] = list(grid2d.dims)
    run = _shared_dir(grid2d, tmp_path_factory, "ns")
    path = str(run / "sim.h5")
    save_snapshots(simulate(cfg["simulation"], grid2d, get_logger("test", grid2d), False), path, cfg["simulation"])
    result = measure(cfg, path, None, grid2d, get_logger("test", grid2d), sizes=[32], reps=1, leads=[1, 2])
    rows = result["rows"]
    ok = all(r["speedup"] > 0 and r["solver_steps"] >= 1 and math.isfinite(r["one_step_error"]) for r in rows)
    assert_all(grid2d, ok and [r["size"] for r in rows] == [(16, 16), (32, 32)], f"rows {rows}")
    assert_all(grid2d, "CFL-adaptive" in result["what"], result["what"])
    roll = result["rollout"]  # untrained: the zeroed head predicts no change, so it is persistence
    assert_allclose(grid2d, roll.surrogate, roll.persistence, rtol=1e-5, what="untrained model = persistence")


def test_resize_field() -> None:
    gen = np.random.default_rng(3)
    gs = gen.standard_normal((2, 4, 6))
    assert np.array_equal(resize_field(gs, (8, 12), "grayscott")[:, 4:, 6:], gs)
    with pytest.raises(ValueError, match="multiples"):
        resize_field(gs, (8, 8), "grayscott")
    # a band-limited field is reproduced exactly on the finer grid
    x = np.arange(16) / 16
    f = np.sin(2 * np.pi * (x[:, None] + 2 * x[None, :]))[None] + 0.5 * np.cos(2 * np.pi * 3 * x)[None, :, None]
    xf = np.arange(64) / 64
    want = np.sin(2 * np.pi * (xf[:, None] + 2 * xf[None, :]))[None] + 0.5 * np.cos(2 * np.pi * 3 * xf)[None, :, None]
    np.testing.assert_allclose(resize_field(f, (64, 64), "navier_stokes"), want, atol=1e-12)


@pytest.mark.timeout(180)
def test_command_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``evaluate --rollout N`` and ``python -m apps.surrogate.speedup`` on one rank, after a short training."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sets: list[Any] = []
    for item in [*TINY_SET, f"simulation.out={tmp_path / 'sim.h5'}", f"train.out={tmp_path / 'run'}", "train.epochs=1"]:
        sets += ["--set", item]
    with hpctp.ProcessGrid([1, 1]) as grid:
        cfg = load_config(TINY, TINY_SET + [f"simulation.out={tmp_path / 'sim.h5'}"])
        save_snapshots(
            simulate(cfg["simulation"], grid, get_logger("t", grid), False), cfg["simulation"]["out"], cfg["simulation"]
        )
    assert surrogate_main(["train", "--config", str(TINY), *sets]) == 0
    assert surrogate_main(["evaluate", "--config", str(TINY), *sets, "--rollout", "3"]) == 0
    out = capsys.readouterr().out
    assert "rollout from 3 held-out initial states" in out and "persistence" in out, out
    rows = np.loadtxt(tmp_path / "run" / "rollout.csv", delimiter=",", skiprows=1, ndmin=2)
    assert rows.shape == (3, 3) and np.all(np.isfinite(rows)) and (tmp_path / "run" / "rollout.png").is_file()
    assert speedup_main(["--config", str(TINY), *sets, "--reps", "1", "--leads", "1,3"]) == 0
    out = capsys.readouterr().out
    assert "| 12x10 |" in out and "trained weights" in out and "speed-up" in out, out


@pytest.mark.timeout(240)
def test_neuraloperator_comparison_runs_small(tmp_path: Path) -> None:
    """benchmarks/fno_vs_neuraloperator.py on 2 ranks, one epoch of a 16x16 Navier-Stokes flow: hpctp's row
    (and neuraloperator's, where it imports; otherwise the reason)."""
    sets = ["simulation.size=[16, 16]", "simulation.warmup=0.5", "simulation.snapshots=12",
            "simulation.snapshot_every=0.25", "surrogate.modes=3", "surrogate.width=4", "surrogate.depth=2",
            "train.epochs=1", "train.holdout=0.34"]  # fmt: skip
    cfg = load_config(CONFIGS / "ns.toml", sets)
    with hpctp.ProcessGrid([1, 1]) as grid:
        data = tmp_path / "sim.h5"
        save_snapshots(simulate(cfg["simulation"], grid, get_logger("t", grid), False), data, cfg["simulation"])
    root = Path(__file__).resolve().parents[1]
    args = [str(root / "benchmarks" / "fno_vs_neuraloperator.py"), "--config", str(CONFIGS / "ns.toml")]
    for item in sets:
        args += ["--set", item]
    args += ["--data", str(data), "--out", str(tmp_path / "hpctp"), "--lead", "2"]
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("mpiexec")), "-n", "2", sys.executable, *args],
        capture_output=True, text=True, timeout=220, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "| hpctp | 2 x 1 |" in out and "| persistence |" in out, out[-3000:]
    assert "ratio hpctp / neuraloperator" in out or "no comparison: neuraloperator does not import" in out, out[-3000:]
