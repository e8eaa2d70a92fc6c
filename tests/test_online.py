"""Online training (``python -m apps.simulate --train-online``): the same loss curve on any number of
trainer ranks and either placement, no snapshot file, a checkpoint of what an early-stopped simulation
produced, and a failing trainer that ends the job with its error and leaves the last checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import hpctp
from apps.common.config import load_config
from apps.simulate.__main__ import main as simulate_main
from apps.simulate.online import run_online
from apps.surrogate.online import online_settings, step_budget, stream_config
from apps.surrogate.train import make_optimizer
from hpctp.comm.io_calls import bcast_bytes
from hpctp.io import TrainingSchedule
from hpctp.testing import assert_all, assert_allclose

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "apps" / "configs" / "tiny.toml"
WORLD = MPI.COMM_WORLD


@pytest.fixture
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One empty directory, created by rank 0 and used by every rank."""
    mine = str(tmp_path_factory.mktemp("online")).encode() if WORLD.rank == 0 else None
    return Path(bcast_bytes(WORLD, mine).decode())


def _cfg(out: Path, *extra: str) -> dict:
    return load_config(TINY, [f'train.out="{out}"', f'simulation.out="{out}/sim.h5"', "online.steps=6", *extra])


def test_settings_are_checked() -> None:
    cfg = load_config(TINY)
    assert step_budget(cfg) == 2 * 2  # 2 epochs x 2 batches of the 4 training pairs of 7 snapshots
    assert [TrainingSchedule(6, 7, 3, 2.0).need(s) for s in range(6)] == [3, 5, 5, 6, 7, 7]
    scfg = stream_config(cfg)
    assert (scfg.horizon, scfg.holdout_every, scfg.batch_size, scfg.eviction) == (1, 3, 2, "reservoir")
    for key, value, match in [
        ("placement", "elsewhere", "placement"), ("depth", 1, "depth"), ("stop_after", -1, "stop_after"),
        ("buffer_mib", 0, "buffer_mib"), ("ramp", 0.5, "ramp"), ("tail", 1.0, "tail"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            online_settings({**cfg, "online": {**cfg["online"], key: value}})
    with pytest.raises(ValueError, match="unknown keys"):
        online_settings({**cfg, "online": {"bogus": 1}})


@pytest.mark.mpi(min_size=2)
def test_same_loss_curve_on_any_trainer_ranks_and_placement(shared_dir: Path) -> None:
    """float64: co-located on every rank, separate groups (half the ranks train: 2 of 4), and co-located
    with two data-parallel copies of the trainer draw the same pairs and give the same losses."""
    size = WORLD.Get_size()
    runs = {"colocated": run_online(_cfg(shared_dir / "a", "online.max_wait=inf"), WORLD)}
    runs["separate"] = run_online(_cfg(shared_dir / "b", "online.placement=separate", "online.max_wait=inf"), WORLD)
    if size % 2 == 0:
        runs["data2"] = run_online(_cfg(shared_dir / "c", "online.max_wait=inf", "train.data=2"), WORLD)
    ref = runs["colocated"]
    ok, why = len(ref["losses"]) == 6 and ref["stats"].dropped == 0, f"reference {ref.get('losses')}"
    for name, r in runs.items():
        if "losses" not in r:  # a simulation rank of the separate groups
            continue
        same = np.allclose(r["losses"], ref["losses"], rtol=1e-10, atol=0) and len(r["losses"]) == 6
        same &= abs(r["surrogate"] - ref["surrogate"]) <= 1e-10 * ref["surrogate"] and r["held_out"] == 2
        ok &= same
        why += f"; {name}: {r['losses']} {r['surrogate']}" if not same else ""
    assert_all(WORLD, ok, why)
    sep = runs["separate"]
    if sep["role"] == "trainer":
        s = sep["stats"]
        ok = (s.produced, s.received, s.dropped, s.pairs, s.held_out) == (7, 7, 0, 4, 2) and s.draws == 12
    else:
        ok = sep["role"] == "simulation" and sep["simulated"] == 7
    assert_all(WORLD, ok, f"separate: {sep}")


@pytest.mark.mpi
def test_train_online_command_writes_no_snapshots(shared_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The simulation stops after 5 of its 7 snapshots: the trainer runs the steps those allow (3 of 6:
    steps 0, 1, 2 need 3, 5, 5 snapshots with ramp 2), writes their checkpoint, and prints the held-out
    error; no snapshot file appears."""
    out = shared_dir / "cli"
    code = simulate_main(
        ["--config", str(TINY), "--train-online", "--set", f'train.out="{out}"', "--set", f'simulation.out="{out}/sim.h5"',
         "--set", "online.steps=6", "--set", "online.stop_after=5"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert_all(WORLD, code == 0 and not (out / "sim.h5").exists() and (out / "checkpoint.h5").exists(), "files")
    if WORLD.rank == 0:
        assert "held-out relative L2 error" in printed and "3 steps" in printed, printed
    # the checkpoint holds step 3, on any grid
    from apps.surrogate.evaluate import load_model

    grid = hpctp.ProcessGrid([0, 0], comm=WORLD)
    model = load_model(load_config(TINY), str(out / "checkpoint.h5"), 2, grid)
    step = hpctp.io.load_checkpoint(out / "checkpoint.h5", model, make_optimizer(model, load_config(TINY)), grid)
    assert_allclose(grid, step, 3)
    grid.free()


def test_failing_trainer_ends_the_job_and_leaves_its_last_checkpoint(tmp_path: Path) -> None:
    """Separate groups on 4 ranks; trainer rank 3 raises in its 4th step (checkpoints every 2): the job
    ends with that error (MPI_Abort, no hang), and the checkpoint of step 2 is there, intact."""
    script = f"""
import sys
import apps.surrogate.online as online
from mpi4py import MPI
real = online.train_step
def failing(*args, **kwargs):
    failing.calls += 1
    if MPI.COMM_WORLD.rank == 3 and failing.calls == 4:
        raise RuntimeError("injected trainer failure")
    return real(*args, **kwargs)
failing.calls = 0
online.train_step = failing
from apps.simulate.__main__ import main
from hpctp.cli.runner import run_main
sys.argv = ["x", "--config", {str(TINY)!r}, "--train-online", "--set", 'train.out="{tmp_path}/run"',
            "--set", "online.placement=separate", "--set", "online.steps=6", "--set", "online.checkpoint_every=2"]
run_main(lambda: main(sys.argv[1:]))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "PYTHONPATH": str(ROOT)}
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    proc = subprocess.run(
        [mpiexec, "-n", "4", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode != 0
    assert "[rank 3/4] error" in proc.stderr and "injected trainer failure" in proc.stderr, proc.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoint.h5"
    from apps.surrogate.evaluate import load_model

    grid = hpctp.ProcessGrid([1, 1], comm=MPI.COMM_SELF)
    cfg = load_config(TINY)
    model = load_model(cfg, str(ckpt), 2, grid)
    assert hpctp.io.load_checkpoint(ckpt, model, make_optimizer(model, cfg), grid) == 2
    grid.free()
