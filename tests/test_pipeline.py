"""End to end, as a user runs it: the mpirun job script (simulate -> train -> evaluate) on the
tiny config, then a resume on another rank count, prediction and in-situ inference."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
TINY = "apps/configs/tiny.toml"


def _run(cmd: list[str], env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_pipeline_job_resume_predict_insitu(tmp_path: Path) -> None:
    data, run = tmp_path / "sim.h5", tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NP": "2", "CONFIG": TINY, "DATA": str(data), "RUNDIR": str(run),
           "STAGE_TIMEOUT": "300", "PYTHON": sys.executable, "MPIEXEC": MPIEXEC}  # fmt: skip
    proc = _run(["bash", "jobs/mpirun_pipeline.sh"], env, timeout=900)
    out = proc.stdout + proc.stderr
    m = re.search(r"relative L2 error: ([0-9.]+) \(persistence baseline ([0-9.]+)\)", out)
    assert m, out
    assert 0 < float(m.group(1)) < 1
    with h5py.File(data) as f:
        fields = f["fields"][...]
    assert fields.shape == (7, 2, 16, 12) and np.isfinite(fields).all()
    assert (run / "eval.png").stat().st_size > 1000
    history = [float(r[0]) for r in csv.reader(open(run / "history.csv"))]
    assert len(history) == 2 * 2  # 4 training pairs, batch 2, 2 epochs

    # resume on 1 rank from the 2-rank checkpoint: one more epoch continues the step count
    py = [sys.executable, "-m"]
    _run([MPIEXEC, "-n", "1", *py, "apps.surrogate", "train", "--config", TINY, "--data", str(data), "--out", str(run),
          "--resume", "--set", "train.epochs=3"], env)  # fmt: skip
    history = [float(r[0]) for r in csv.reader(open(run / "history.csv"))]
    assert len(history) == 6 and all(np.isfinite(history))

    ckpt = str(run / "checkpoint.h5")
    _run([MPIEXEC, "-n", "3", *py, "apps.surrogate", "predict", "--config", TINY, "--data", str(data),
          "--checkpoint", ckpt, "--start", "2", "--steps", "3", "--out", str(tmp_path / "pred.h5")], env)  # fmt: skip
    with h5py.File(tmp_path / "pred.h5") as f:
        pred = f["predictions"][...]
    assert pred.shape == (3, 2, 16, 12)
    rel = np.linalg.norm(pred[0] - fields[3]) / np.linalg.norm(fields[3])
    assert rel < 0.2, rel  # one step ahead of snapshot 2 is close to snapshot 3

    proc = _run([MPIEXEC, "-n", "2", *py, "apps.simulate", "--config", TINY, "--insitu", "--checkpoint", ckpt], env)
    m = re.search(r"in-situ: (\d+) predictions from live blocks, relative L2 error mean ([0-9.]+)", proc.stderr)
    assert m and int(m.group(1)) == 6 and float(m.group(2)) < 0.2, proc.stderr
