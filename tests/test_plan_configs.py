"""``hpctp plan`` on every config of apps/configs, priced on every published machine and on a calibrated CPU machine
file: a ranked plan whose table names a grid of the ranks asked, or exit status 2 with one line that names the fix
(never a traceback).

One process, the CLI called in-process. Each config is traced once per device (``meta`` for the published GPU
machines, ``cpu`` for the calibrated one) and the trace shared by the CLI calls that need it: the calls differ in
the machine, ranks and memory, which the planner applies after tracing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mpi4py import MPI

import hpctp
from hpctp._util.toml_config import read_toml
from hpctp.cli.command import main as cli_main
from hpctp.nn.spectral import spectral_conv, spectral_conv_fft
from hpctp.nn.spectral.fourier import split_path_on_whole_fields
from hpctp.perf import ComputeRates, Link, Workload, load_machine, planner, published_machines

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "apps" / "configs").glob("*.toml"))
MACHINES = (*published_machines(), "calibrated")
RANKS = 2
MEMORY = "16GiB"
FLOAT32 = ("--set", "surrogate.dtype=float32")
TRACE = planner.trace
CHOSEN = re.compile(r"^chosen: (.+) \(grid ((?:\d+x)+\d+) as pipeline x data x spatial x tensor\), bounded by \w+$")

# a CPU node's figures, as `mpiexec -n 2 hpctp perf calibrate` writes them (rounded from a 2-core x86-64 machine)
CPU_FLOAT32 = ComputeRates(gemm=8e10, gemm_half=40.0, conv=2e10, fft=5e9, attention=6e10, bandwidth=3e10,
                           kernel=5.5e-6, softmax=4e8)  # fmt: skip
CPU_FLOAT64 = dataclasses.replace(CPU_FLOAT32, gemm=4e10, conv=1e10, fft=2.5e9, attention=3e10, softmax=2e8)
CPU_LINKS = {"allreduce": Link(3.7e-5, 3.7e-9), "allgather": Link(4.7e-4, 5.6e-10), "p2p": Link(2.6e-4, 2.4e-9),
             "reduce_scatter": Link(5.6e-4, 8.1e-10), "alltoall": Link(5.3e-4, 5.9e-10)}  # fmt: skip


@pytest.fixture(scope="module")
def machine_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The ``--machine`` argument of each machine: a published profile's name, or the calibrated file's path (a
    published profile made a calibrated CPU node of 2 ranks: float32 and float64 rates, no figures between nodes)."""
    cpu = dataclasses.replace(
        load_machine(published_machines()[0]), name="2 ranks of a CPU node (calibrated)", source="calibrated",
        ranks_per_node=2, cores_per_node=2, memory_bytes=16 << 30, asynchronous=False, overlap=0.0,
        compute={"float32": CPU_FLOAT32, "float64": CPU_FLOAT64}, network={"intra": CPU_LINKS},
        calibration={"axis0": CPU_LINKS}, reference="", note="hpctp.perf.calibrate on a 2x1 grid",
    )  # fmt: skip
    path = cpu.save(tmp_path_factory.mktemp("machine") / "machine.toml")
    assert load_machine(path) == cpu
    return {**{m: m for m in published_machines()}, "calibrated": str(path)}


@pytest.fixture(scope="module")
def traces() -> Iterator[dict[tuple[Any, ...], Workload]]:
    """Traced workloads by (config, overrides, device), shared by the module's CLI calls."""
    out: dict[tuple[Any, ...], Workload] = {}
    yield out
    out.clear()


Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def hpctp_plan(traces: dict[tuple[Any, ...], Workload], machine_files: dict[str, str], monkeypatch: pytest.MonkeyPatch,
               capsys: pytest.CaptureFixture[str]) -> Run:  # fmt: skip
    """``run(config, machine, ranks, memory, *args)``: ``hpctp plan`` in this process; its exit status, stdout and
    stderr. Each (config, args, device) is traced once; ``trace=False`` fails the call if it traces at all."""

    def run(
        config: Path, machine: str, ranks: int, memory: str, *args: str, trace: bool = True
    ) -> tuple[int, str, str]:
        def shared(model: Any, sample: Any, **kw: Any) -> Workload:
            assert trace, f"hpctp plan {config.name} traced the model before it could tell what is wrong"
            key = (config, args, kw["device"])
            if key not in traces:
                traces[key] = TRACE(model, sample, **kw)
            return traces[key]

        monkeypatch.setattr(planner, "trace", shared)
        capsys.readouterr()
        argv = ["plan", str(config), "--ranks", str(ranks), "--memory", memory, "--machine", machine_files[machine]]
        code = cli_main([*argv, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def assert_one_line_error(code: int, out: str, err: str, *words: str) -> None:
    """Exit status 2, nothing on stdout, one line on stderr (no traceback) holding each of ``words``."""
    assert code == 2, f"exit status {code}, stderr {err!r}"
    assert out == "", f"an error printed a table too: {out!r}"
    assert err.startswith("hpctp plan: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"


def assert_plan(code: int, out: str, err: str, ranks: int, machine: str) -> None:
    """Exit status 0, no warning, a table of plans for ``ranks`` ranks on ``machine`` whose first row and chosen line
    name the same grid of ``ranks`` ranks."""
    assert code == 0, f"exit status {code}, stderr {err!r}"
    assert err == "", err
    lines = out.splitlines()
    head = f"{ranks} ranks, 16.00 GiB per rank, machine: {load_machine(machine).name} "
    assert lines[0].startswith(head), lines[0]
    assert re.search(r"; [1-9]\d* plans fit, \d+ do not", lines[1]), lines[1]
    chosen = CHOSEN.match(lines[-1])
    assert chosen, lines[-1]
    label, grid = chosen.groups()
    assert math.prod(int(d) for d in grid.split("x")) == ranks, grid
    first = next(line for line in lines if line.startswith("  1 | "))
    assert [c.strip() for c in first.split("|")[1:3]] == [label, grid], first


def dtype_of(config: Path) -> str:
    return str(read_toml(config)["surrogate"]["dtype"])


@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_config_plans_on_every_machine(config: Path, machine: str, hpctp_plan: Run,
                                             machine_files: dict[str, str]) -> None:  # fmt: skip
    """A real plan of 2 ranks within 16 GiB; where the machine has no rates of the config's element type (the
    published GPU profiles have no float64), one line naming the rates and the calibration that gives them, and a
    real plan of the config in float32."""
    path = machine_files[machine]
    args: tuple[str, ...] = ()
    if dtype_of(config) not in load_machine(path).compute:
        code, out, err = hpctp_plan(config, machine, RANKS, MEMORY, trace=False)
        assert_one_line_error(
            code, out, err, f"no compute rates for {dtype_of(config)}", "hpctp perf calibrate --dtype"
        )
        args = FLOAT32
    assert_plan(*hpctp_plan(config, machine, RANKS, MEMORY, *args), RANKS, path)


@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_a_budget_that_fits_nothing_names_the_smallest_peak(config: Path, machine: str, hpctp_plan: Run,
                                                             machine_files: dict[str, str]) -> None:  # fmt: skip
    args = () if dtype_of(config) in load_machine(machine_files[machine]).compute else FLOAT32
    code, out, err = hpctp_plan(config, machine, RANKS, "1KiB", *args)
    assert_one_line_error(code, out, err, f"no plan of {RANKS} ranks fits in 1.0 KiB per rank", "the smallest peak is",
                          "Give more memory per rank (at least ")  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_more_ranks_than_a_node_plan_on_published_machines_only(config: Path, hpctp_plan: Run,
                                                                machine_files: dict[str, str]) -> None:  # fmt: skip
    """8 ranks: one node of the published machines; the calibrated file measured 2 ranks as one node and prices no
    message between nodes, which the planner says before tracing."""
    args = () if dtype_of(config) == "float32" else FLOAT32
    for machine in published_machines():
        assert_plan(*hpctp_plan(config, machine, 8, MEMORY, *args), 8, machine_files[machine])
    code, out, err = hpctp_plan(config, "calibrated", 8, MEMORY, trace=False)
    assert_one_line_error(code, out, err, "within a node of 2 ranks only", "plan at most 2 ranks",
                          "mpiexec -n 8 hpctp perf calibrate")  # fmt: skip


@pytest.mark.parametrize(
    "sets, words",
    [
        (("simulation.pde=heat",), ("simulation.pde must be one of ('grayscott', 'navier_stokes'), got 'heat'",)),
        (("surrogate.model=resnet",), ("surrogate.model must be one of", "'resnet'")),
        (("train.nokey=3",), ("unknown key 'nokey'",)),
    ],
)
def test_a_bad_config_key_is_one_line_before_tracing(sets: tuple[str, ...], words: tuple[str, ...],
                                                     hpctp_plan: Run) -> None:  # fmt: skip
    code, out, err = hpctp_plan(CONFIGS[0], "calibrated", RANKS, MEMORY, *(a for s in sets for a in ("--set", s)),
                                trace=False)  # fmt: skip
    assert_one_line_error(code, out, err, *words)


@pytest.mark.parametrize("text, words", [
    ('[surrogate]\nmodel = "fno"\n', ("the config has no [simulation] section",)),
    ('[surrogate]\nmodel = "fno"\ndtype = "float32"\nseed = 0\nwidth = 4\n[simulation]\nsize = [16, 16]\n'
     '[train]\nbatch_size = 2\n', ("the config has no surrogate.depth", "'fno' model needs it")),
])  # fmt: skip
def test_a_surrogate_config_missing_a_key_names_it(text: str, words: tuple[str, ...], tmp_path: Path,
                                                   hpctp_plan: Run) -> None:  # fmt: skip
    config = tmp_path / "mine.toml"
    config.write_text(text)
    assert_one_line_error(*hpctp_plan(config, "calibrated", RANKS, MEMORY, trace=False), *words)


@pytest.mark.parametrize("whole", [True, False], ids=["ffts", "dft-matrices"])
def test_spectral_weight_at_an_odd_offset(whole: bool) -> None:
    """A spectral weight packed at an odd element of a flat buffer (ShardedDataParallel at ZeRO 1-2 packs the
    parameters end to end: ns.toml's FNO put each at an odd offset) gives the aligned weight's output and gradient."""
    torch.manual_seed(0)
    f64 = torch.float64
    weight = torch.randn(3, 2, 4, 2, 2, dtype=f64)  # modes (2, 2) of a 2-D field
    flat = torch.zeros(1 + weight.numel(), dtype=f64)
    odd = flat[1:].view(weight.shape).copy_(weight).detach().requires_grad_()
    assert odd.storage_offset() % 2 == 1
    aligned = weight.clone().requires_grad_()
    x = torch.randn(2, 3, 8, 6, dtype=f64)
    grid = hpctp.ProcessGrid((1, 1), comm=MPI.COMM_SELF)
    try:
        with contextlib.nullcontext() if whole else split_path_on_whole_fields():
            got = [spectral_conv(x, w, grid=grid) for w in (odd, aligned)]
        got += [spectral_conv_fft(x, w) for w in (odd, aligned)]
    finally:
        grid.free()
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)
    torch.testing.assert_close(got[2], got[3], rtol=0, atol=0)
    torch.testing.assert_close(got[0], got[2])
    (got[0] ** 2).sum().backward()
    (got[1] ** 2).sum().backward()
    assert odd.grad is not None and aligned.grad is not None and aligned.grad.abs().sum() > 0
    torch.testing.assert_close(odd.grad, aligned.grad, rtol=0, atol=0)
