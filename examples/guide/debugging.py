"""Why a job hangs or runs slow: three small faulty jobs under mpiexec, and what hpctp's debugging tools say.

    mpiexec -n 1 python examples/guide/debugging.py [OUTDIR]     (figure: OUTDIR/timeline.png)

Rank 0 launches each job of examples/guide/debugging_job.py on 2 ranks (its own mpiexec, from the repository
root) with one HPCTP_* variable set, and prints what the user sees: a rank that skips an all-reduce, reported by
the watchdog (HPCTP_WATCHDOG); ranks that all-reduce different sizes, caught by the check (HPCTP_CHECK); a rank
that keeps the others waiting, read from the flight recorder's dumps (HPCTP_TRACE, then hpctp trace summarize).
"""

import os
import subprocess
import sys
from pathlib import Path

from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[2]
JOB = "examples/guide/debugging_job.py"
out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/guide").resolve()
mpiexec = Path(sys.executable).with_name("mpiexec")
MPIEXEC = str(mpiexec) if mpiexec.exists() else "mpiexec"


def clean(**env: str) -> dict[str, str]:
    """This environment without the variables of the launcher that started this script (PMI_*, HYDRA_*, ...) and
    any HPCTP_*, with ``env`` added: a job (or command) of its own."""
    ours = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_", "HPCTP_")
    return {**{k: v for k, v in os.environ.items() if not k.startswith(ours)}, **env}


def launch(argv: list[str], ranks: int = 2, **env: str) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n ranks python argv`` from the repository root with ``env`` set; its exit status and output."""
    shown = " ".join([*(f"{k}={v}" for k, v in env.items()), "mpiexec", "-n", str(ranks), "python", *argv])
    print(f"$ {shown}".replace(str(ROOT) + os.sep, ""), flush=True)
    return subprocess.run(
        [MPIEXEC, "-n", str(ranks), sys.executable, *argv],
        cwd=ROOT, env=clean(**env), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def show(text: str) -> None:
    """Print a job's output, the paths under the repository relative to it."""
    print(text.strip("\n").replace(str(ROOT) + os.sep, ""), flush=True)


def rel(path: Path) -> str:
    return os.path.relpath(path, ROOT)


def hang() -> None:
    """1. A rank skips an all-reduce: the watchdog reports where the ranks part and ends the job."""
    job = launch([JOB, "skip"], HPCTP_WATCHDOG="3", HPCTP_TRACE_DIR=rel(out / "hang"))
    print(f"exit status {job.returncode}\n--- stdout ---")
    show(job.stdout)
    print("--- stderr ---")
    show(job.stderr)


def mismatch() -> None:
    """2. The ranks all-reduce different sizes: the check raises on every rank before any data moves."""
    job = launch([JOB, "histogram"])  # without the check: what MPI makes of it
    last = [line for line in job.stderr.splitlines() if line.strip()][-1:]
    print(f"exit status {job.returncode}\n--- the last line of stderr ---")
    show("\n".join(last))
    job = launch([JOB, "histogram"], HPCTP_CHECK="1")
    print(f"exit status {job.returncode}\n--- stdout ---")
    show(job.stdout)


def straggler() -> None:
    """3. A rank holds a larger block: the flight recorder's dumps say who waits for whom, and draw it."""
    job = launch([JOB, "uneven"], HPCTP_TRACE="500", HPCTP_TRACE_DIR=rel(out / "slow"))
    print(f"exit status {job.returncode}")
    show(job.stdout)
    print(f"$ hpctp trace summarize {rel(out / 'slow')} --png {rel(out / 'timeline.png')}", flush=True)
    summary = subprocess.run(
        [sys.executable, "-m", "hpctp", "trace", "summarize", rel(out / "slow"), "--png", rel(out / "timeline.png")],
        cwd=ROOT, env=clean(), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    show(summary.stdout)


if MPI.COMM_WORLD.rank == 0:  # (one launcher: the jobs start their own ranks)
    for part in (hang, mismatch, straggler):
        print(f"\n=== {part.__doc__.splitlines()[0]}", flush=True)
        part()
