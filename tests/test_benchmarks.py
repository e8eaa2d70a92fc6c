"""The benchmark scripts, run small on the CPU so they cannot rot: the one-shot GPU check (dry run)
and the CPU benchmarks on 2 ranks, each printing its ratio against the reference of the same run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(420)
def test_gpu_check_dry_run_runs_every_step() -> None:
    env = {
        **os.environ,
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_BUDGET": "400",
        # (two of the step's tests: the main suite runs both files on the CPU at every rank count)
        "GPU_CHECK_TESTS": "tests/test_device_blocks.py::test_staging_keeps_every_dtype tests/test_comm.py::test_node_local_rank_and_device_selection",
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
    assert (
        "SUMMA fp32 n=256" in out
        and "halo conv fwd+bwd 1x16x64x64" in out
        and "FNO 2 x SpectralConv2d" in out
        and "ratio" in out
    ), out[-3000:]


MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
SMALL = {
    "matmul.py": (["--sizes", "96", "--reps", "1", "--no-heat"], ["results match numpy", "| 96 | hpctp SUMMA"]),
    "conv.py": (
        ["--size", "32", "--channels", "2", "--layers", "1", "--reps", "1"],
        ["time ratio hpctp/torch", "loss check"],
    ),
    "fno.py": (
        ["--size", "64", "--channels", "2", "--modes", "4", "--layers", "2", "--reps", "1"],
        ["time ratio hpctp/torch", "bytes sent per rank", "loss check"],
    ),
    "fft.py": (["--size", "24", "--reps", "1"], ["time ratio hpctp/numpy", "bytes sent per rank"]),
    "stencil.py": (
        ["--size", "48", "--steps", "2", "--reps", "1"],
        ["time ratio hpctp/numpy", "bytes sent per rank and step", "result check"],
    ),
    "io_read.py": (["--gib", "0.002", "--repeat", "1"], ["speed-up  :", "2 ranks   :"]),
    "moves.py": (
        ["--rows", "64", "--cols", "48", "--fft", "12", "--halo", "40", "--rounds", "1", "--no-heat"],
        ["| redistribute |", "| rfftn |", "| halo |", "equals numpy-block redistribute: True"],
    ),
    "trace_overhead.py": (
        "--blocks 64x16 --rounds 1 --calls 1 --entries 100".split(),
        ["| 64 | 16 | 4 |", "recorder cost per call, measured alone"],
    ),
    "attention.py": (
        "--blocks 32x16 --head-dim 8 --patches 8 --ring-heads 2 --ring-head-dim 8 --rounds 1 --trace 100".split(),
        [
            "| 32 | 16 | 4 |",
            "| traced / untraced |",
            "| forward+backward |",
            "| one process, SDPA",
            "per rank / one process (math)",
            "all-reduces as no-ops (Python only)",
            "forward's floor (the flash kernel",
        ],  # fmt: skip
    ),
}


#: the scripts that also write their figures as a results file of the docs' benchmark pages (``--json PATH``)
JSON = {"conv.py", "fno.py", "fft.py", "stencil.py", "matmul.py"}


def _plots() -> ModuleType:
    return load_script("benchmarks/plots.py", "bench_plots_of_test_benchmarks")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("script", sorted(SMALL))
def test_cpu_benchmark_runs_small(script: str, tmp_path: Path) -> None:
    args, expect = SMALL[script]
    if script == "io_read.py":
        args = [*args, "--dir", str(tmp_path)]
    results = tmp_path / "results" / script.replace(".py", ".json")
    if script in JSON:
        args = [*args, "--json", str(results)]
    proc = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for line in expect:
        assert line in out, out[-3000:]
    if script in ("conv.py", "fno.py"):  # the same loss on 2 ranks and in the single-process reference
        diff = float(out.split("rel diff")[1].split()[0])
        assert diff < 1e-5, out[-2000:]
    if script == "fft.py":  # the gathered distributed FFT equals numpy's
        assert float(out.split("max |numpy| =")[1].split()[0]) < 1e-12, out[-2000:]
    if script == "stencil.py":  # np.roll on DistTensors and the halo version equal numpy's np.roll
        checks = out.split("max |numpy| =")[1].split("\n")[0].replace(",", " ").split()
        assert float(checks[0]) < 1e-12 and float(checks[2]) < 1e-12, out[-2000:]
    if script == "moves.py":  # the pool serves every buffer of the second call, numpy and torch blocks alike
        for move in ("redistribute", "rfftn", "halo"):
            row = next(line for line in out.splitlines() if line.startswith(f"| {move} |"))
            assert row.endswith("numpy 0, torch 0 |"), row
    if script == "attention.py":  # the block (hpctp and DTensor) equals torch's layer, the ring equals SDPA
        block = out.split("max rel diff vs torch:")[1].split("\n")[0].replace(";", " ").split()
        ring = out.split("max rel diff vs SDPA (max over ranks):")[1].split("\n")[0].replace(",", " ").split()
        for diffs in (block, ring):
            values = [float(v) for v in diffs if v[0].isdigit()]
            assert len(values) == 4 and max(values) < 1e-5, out[-2000:]
    if script == "fno.py":  # only the truncated spectrum travels in forward, not the field
        ratio = float(out.split("forward / field =")[1].split()[0])
        assert ratio < 0.1, out[-2000:]
    if script in JSON:  # the run's figures as a valid results file, its command without --json, its plots drawn
        plots = _plots()
        figures = plots.load(results)
        assert figures["command"] == f"mpiexec -n 2 python benchmarks/{script} {' '.join(SMALL[script][0])}"
        assert figures["tables"][0]["rows"] and figures["plots"], figures
        drawn = plots.draw(figures, tmp_path / "png")
        assert [p.name for p in drawn] == [spec["file"] for spec in figures["plots"]]
        assert all(p.is_file() for p in drawn)


@pytest.mark.timeout(200)
def test_error_on_one_rank_aborts_the_benchmark(tmp_path: Path) -> None:
    """Rank 0 fails before the first collective (no such directory): the job ends, none waits."""
    proc = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, str(ROOT / "benchmarks" / "io_read.py"), "--dir", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    # MPI_Abort may cut the launcher's forwarding of the traceback: the exit status is the contract
    assert proc.returncode != 0 and "speed-up" not in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.timeout(200)
def test_memory_benchmark_runs_small(tmp_path: Path) -> None:
    """benchmarks/memory.py launches each configuration in its own job on 2 ranks; stage 3 keeps about half the state
    of one process, and every table row has the measured columns."""
    args = ["--ranks", "2", "--width", "64", "--layers", "4", "--batch", "8", "--steps", "1", "--allocators", "glibc"]
    args += ["--configs", "stage 0", "stage 3"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "memory.py"), *args],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "2 rank(s), data parallel" in out, out[-3000:]
    row = next(line for line in out.splitlines() if line.startswith("| stage 3 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert len(cells) == 8, row  # name, kept, resident and its ratio, live tensors, step and its two ratios
    assert 0.4 < float(cells[1]) < 0.6, row  # state kept / one process
