"""The command line: `hpctp info` and the demo job under mpiexec."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_info_reports_runtime() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hpctp", "info"], capture_output=True, text=True, timeout=120, env=ENV, check=True
    ).stdout
    for key in ("mpi_library", "ranks", "cuda_aware_mpi", "torch", "h5py"):
        assert key in out
    assert "ranks              : 1" in out


def test_demo_under_mpiexec() -> None:
    proc = subprocess.run(
        [MPIEXEC, "-n", "3", sys.executable, "-m", "hpctp", "demo", "--shape", "31", "17"],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "demo ok" in proc.stdout
    assert "[rank 0/3]" in proc.stderr and "[rank 1/3]" not in proc.stderr  # rank 0 logs only
