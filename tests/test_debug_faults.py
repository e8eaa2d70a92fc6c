"""Jobs that fail on purpose (tests/scripts/hang_job.py): the watchdog reports and ends each, naming the ranks.

Each test launches its own ``mpiexec -n 2..4`` with ``HPCTP_WATCHDOG`` (or ``HPCTP_CHECK``) set and a
hard timeout of the watchdog + 10 s, and asserts on the report's JSON and text: the communicator and
sequence number, the ranks that are missing or odd, and each rank's call site (the marked lines of
the script). Then the uneven conv stack (tests/scripts/imbalance_job.py) and ``hpctp trace
summarize``. They run from the 1-rank session only (they start their own jobs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mpi4py import MPI

import hpctp.debug as D

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "hang_job.py"
IMBALANCE = ROOT / "tests" / "scripts" / "imbalance_job.py"
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
WATCHDOG = 2.0
EXIT_CODE = 3  # hpctp.debug.watcher.EXIT_CODE

pytestmark = pytest.mark.skipif(
    MPI.COMM_WORLD.size > 1, reason="launches its own mpiexec jobs; run from the 1-rank session"
)


def _line(mark: str) -> str:
    """``hang_job.py:N`` of the line marked ``# <- mark``."""
    for n, text in enumerate(SCRIPT.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# <- {mark}"):
            return f"{SCRIPT}:{n}"
    raise AssertionError(f"no line marked {mark!r} in {SCRIPT}")


def _job(n: int, args: list[str], tmp: Path, script: Path = SCRIPT, timeout: float = WATCHDOG + 10, **env: str):
    """Run ``script`` on ``n`` ranks; return the completed process and its wall seconds."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "HPCTP_"))}
    clean.update(OMP_NUM_THREADS="1", MPIR_CVAR_ENABLE_HEAVY_YIELD="1", PYTHONUNBUFFERED="1", HPCTP_TRACE_DIR=str(tmp))
    clean["PYTHONPATH"] = os.pathsep.join([str(ROOT), clean.get("PYTHONPATH", "")])
    clean.update(env)
    start = time.perf_counter()
    proc = subprocess.run(
        [MPIEXEC, "-n", str(n), sys.executable, str(script), *args],
        capture_output=True, text=True, timeout=timeout, env=clean, cwd=tmp,
    )  # fmt: skip
    return proc, time.perf_counter() - start


def _hang(n: int, mode: str, tmp: Path, odd: int | None = None) -> tuple[dict[str, Any], str, str]:
    """Run a failing job under the watchdog; return report.json, report.txt and the job's stderr."""
    proc, wall = _job(n, [mode] + ([] if odd is None else [str(odd)]), tmp, HPCTP_WATCHDOG=str(WATCHDOG))
    assert proc.returncode == EXIT_CODE, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    (job,) = tmp.glob("job-*")
    report = json.loads((job / "report.json").read_text())
    text = (job / "report.txt").read_text()
    assert text.splitlines()[0] in proc.stderr  # the detecting rank printed it
    print(f"{mode} on {n} ranks: {wall:.1f} s")
    return report, text, proc.stderr


def _positions(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {p["rank"]: p for p in report["positions"]}


def test_rank_skips_an_allreduce(tmp_path: Path) -> None:
    report, text, _ = _hang(2, "skip", tmp_path)
    d = report["divergences"][0]
    assert (d["name"], d["state"], d["missing"], d["ranks"]) == ("hpctp.grid", "MISSING", [1], [0, 1])
    (call,) = d["calls"]
    assert call["rank"] == 0 and call["seq"] == d["seq"] and call["site"] == _line("final")
    assert d["sites_differ_at"] == d["seq"] - 1  # rank 1's final all-reduce met rank 0's last loop one
    assert {c["rank"]: c["site"] for c in d["sites"]} == {0: _line("allreduce"), 1: _line("final")}
    pos = _positions(report)
    assert pos[0]["where"] == "IN_CALL" and pos[0]["calls"][0]["site"] == _line("final")
    assert pos[1]["where"] == "EXITED" and pos[1]["last"]["site"] == _line("final")
    assert report["culprits"] == [1]
    assert f"collective #{d['seq']}: Allreduce: missing ranks" in text and "missing ranks: {1}" in text


def test_rank_calls_bcast_where_the_others_allreduce(tmp_path: Path) -> None:
    report, text, _ = _hang(3, "bcast", tmp_path, odd=2)
    d = report["divergences"][0]
    assert (d["name"], d["state"], d["odd"], d["missing"]) == ("hpctp.grid", "OP_MISMATCH", [2], [])
    sites = {c["rank"]: (c["op"], c["site"], c["seq"]) for c in d["calls"]}
    seq = d["seq"]
    assert sites == {0: ("Allreduce", _line("allreduce"), seq), 1: ("Allreduce", _line("allreduce"), seq),
                     2: ("Bcast", _line("bcast"), seq)}  # fmt: skip
    assert all(p["where"] == "IN_CALL" for p in report["positions"])
    assert report["culprits"] == [2] and "different operations" in text


def test_rank_sends_a_different_size(tmp_path: Path) -> None:
    """Rank 1 sends 64 B where rank 0 receives 32 B: MPI fails rank 0's receive, which reports at once."""
    report, text, _ = _hang(2, "send", tmp_path, odd=1)
    size = [d for d in report["divergences"] if d["state"] == "SIZE_MISMATCH"]
    (d,) = size
    assert d["p2p"] and d["odd"] == [1] and d["name"] == "hpctp.grid"
    calls = {c["rank"]: c for c in d["calls"]}
    assert (calls[1]["op"], calls[1]["nbytes"], calls[1]["site"]) == ("Isend", 64, _line("send"))
    assert (calls[0]["op"], calls[0]["nbytes"], calls[0]["peer"]) == ("Irecv", 32, 1)
    pos = _positions(report)
    assert pos[0]["where"] == "RAISED" and pos[0]["site"] == _line("wait")
    assert pos[1]["where"] == "IN_CALL"
    assert 1 in report["culprits"] and "different sizes" in text


def test_rank_stuck_in_sleep(tmp_path: Path) -> None:
    report, text, _ = _hang(3, "sleep", tmp_path, odd=1)
    d = report["divergences"][0]
    assert (d["state"], d["missing"]) == ("MISSING", [1])
    assert {c["rank"] for c in d["calls"]} == {0, 2} and {c["site"] for c in d["calls"]} == {_line("allreduce")}
    pos = _positions(report)
    assert pos[1]["where"] == "OUTSIDE" and pos[1]["site"] == _line("sleep") and pos[1]["seconds"] >= WATCHDOG - 0.2
    assert pos[1]["stack"][-1]["code"].startswith("time.sleep(120)")
    assert report["culprits"] == [1]
    assert f"rank 1: outside hpctp since {pos[1]['seconds']:.1f} s" in text and "time.sleep(120)" in text


def test_rank_stuck_in_a_python_loop(tmp_path: Path) -> None:
    report, text, _ = _hang(2, "loop", tmp_path)
    d = report["divergences"][0]
    assert (d["state"], d["missing"], d["calls"][0]["site"]) == ("MISSING", [1], _line("allreduce"))
    pos = _positions(report)
    loop = int(_line("loop").rsplit(":", 1)[1])  # (the loop's test or its body)
    assert pos[1]["where"] == "OUTSIDE" and pos[1]["site"] in (f"{SCRIPT}:{loop}", f"{SCRIPT}:{loop + 1}")
    assert report["culprits"] == [1]


def test_rank_raises_without_run_main(tmp_path: Path) -> None:
    report, text, stderr = _hang(4, "raise", tmp_path, odd=2)
    d = report["divergences"][0]
    assert (d["state"], d["missing"]) == ("MISSING", [2])
    assert {c["rank"] for c in d["calls"]} <= {0, 1, 3}
    pos = _positions(report)
    assert pos[2]["where"] == "RAISED" and pos[2]["site"] == _line("raise")
    assert pos[2]["exception"] == "ValueError: rank went its own way"
    assert report["culprits"] == [2] and report["detector"] == 2
    assert "Traceback" in stderr and "rank 2 raised ValueError: rank went its own way" in text


@pytest.mark.parametrize("mode, what", [("bcast", "operation"), ("size", "size")])
def test_check_catches_the_mismatch_on_every_rank_before_data_moves(tmp_path: Path, mode: str, what: str) -> None:
    proc, wall = _job(3, [mode, "2"], tmp_path, HPCTP_CHECK="1")
    assert proc.returncode == 0, proc.stderr
    print(f"check {mode} on 3 ranks: {wall:.1f} s")
    for r in range(3):
        assert f"caught on rank {r}: HPCTP_CHECK: the ranks of hpctp.grid (world ranks 0-2) called collectives of " \
               f"different {what}; nothing was sent" in proc.stdout  # fmt: skip
    assert proc.stdout.count("data untouched: True") == 3
    odd = _line(mode).rsplit(":", 1)[1]
    assert f"rank 2: {'Bcast' if mode == 'bcast' else 'Allreduce'} " in proc.stdout
    assert f"hang_job.py:{odd}" in proc.stdout and f"hang_job.py:{_line('allreduce').rsplit(':', 1)[1]}" in proc.stdout


def test_summarize_names_the_uneven_rank_and_the_conv_halo(tmp_path: Path) -> None:
    """Rank 1's block is 1.5x the others'; before each conv every rank sleeps 60 ms x its block / the smallest,
    so rank 1 posts every halo 30 ms late: the summary names it, the halo, and the delay within 20%."""
    base_ms = 60.0
    proc, wall = _job(3, [str(base_ms)], tmp_path, script=IMBALANCE, timeout=120, HPCTP_TRACE="500")
    assert proc.returncode == 0, proc.stderr
    print(f"imbalance on 3 ranks: {wall:.1f} s")
    summary = D.summarize(D.load(tmp_path))
    top = summary.stragglers[0]
    assert (top.rank, top.label, top.late, top.matched) == (1, "Conv2d.forward halo", 12, 12)
    assert top.mean_late == pytest.approx(base_ms / 2e3, rel=0.2)
    assert top.block_ratio == pytest.approx(1.5)
    out = subprocess.run(
        [sys.executable, "-m", "hpctp", "trace", "summarize", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"rank 1 arrives {top.mean_late * 1e3:.1f} ms late at every Conv2d.forward halo" in out.stdout
    assert "its block is 1.50x the others' median" in out.stdout
    (job,) = tmp_path.glob("job-*")
    trace = json.loads((job / "perfetto.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1, 2}
