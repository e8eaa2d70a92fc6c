"""The command line: `hpctp info` and the demo job under mpiexec."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_info_reports_runtime() -> None:
    env = {**ENV, "HPCTP_WATCHDOG": "45"}
    out = subprocess.run(
        [sys.executable, "-m", "hpctp", "info"], capture_output=True, text=True, timeout=120, env=env, check=True
    ).stdout
    for key in ("mpi_library", "ranks", "cuda_aware_mpi", "torch", "h5py", "HPCTP_TRACE", "HPCTP_CHECK"):
        assert key in out
    assert "HPCTP_WATCHDOG     : 45\n" in out  # the debugging variables with their values (hpctp.debug)
    assert "ranks              : 1" in out


def test_demo_under_mpiexec() -> None:
    proc = subprocess.run(
        [MPIEXEC, "-n", "3", sys.executable, "-m", "hpctp", "demo", "--shape", "31", "17"],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "demo ok" in proc.stdout
    assert "[rank 0/3]" in proc.stderr and "[rank 1/3]" not in proc.stderr  # rank 0 logs only


def test_run_main_exits_with_the_status_and_reports_the_rank(capsys: pytest.CaptureFixture[str]) -> None:
    from hpctp.cli.runner import run_main

    with pytest.raises(SystemExit) as ok:
        run_main(lambda: 3)
    assert ok.value.code == 3

    def fails() -> int:
        raise KeyError("missing input")

    with pytest.raises(SystemExit) as failed:  # one rank: no MPI_Abort, exit status 1
        run_main(fails)
    assert failed.value.code == 1
    err = capsys.readouterr().err
    assert "[rank 0/1] error:" in err and "KeyError: 'missing input'" in err
