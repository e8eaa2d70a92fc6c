"""The one-shot GPU check script, dry-run on the CPU so it cannot rot between GPU loans."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(420)
def test_gpu_check_dry_run_runs_every_step() -> None:
    env = {
        **os.environ,
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_BUDGET": "400",
        "PYTHON": sys.executable,
        "MPIEXEC": str(Path(sys.executable).with_name("mpiexec")),
    }
    env.pop("OUT", None)
    proc = subprocess.run(
        [str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True, timeout=410, env=env, cwd=ROOT
    )
    out = proc.stdout + proc.stderr
    summary = out[out.rfind("=== summary") :]
    assert proc.returncode == 0, out[-4000:]
    assert summary.count("\nok ") == 5 and "FAIL" not in summary and "SKIP" not in summary, summary
    assert "SUMMA fp32 n=256" in out and "halo conv fwd+bwd 1x16x64x64" in out and "ratio" in out, out[-3000:]
