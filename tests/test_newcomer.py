"""What a new user meets: their own data, their own model, a data x spatial grid, then the planner. Each mistake
there gets a message that names the fix."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpctp
import hpctp.io
from hpctp.cli.command import main as cli_main
from hpctp.comm.io_calls import bcast_bytes
from hpctp.nn import Conv2d, ParallelPlan, PipelineParallel, ShardedDataParallel, global_mse_loss, relative_l2_error
from hpctp.perf.planner import PlanReport
from hpctp.testing import assert_allclose

WORLD = MPI.COMM_WORLD


def _conv(grid: hpctp.ProcessGrid, seed: int | None = 0) -> Conv2d:
    return Conv2d(2, 2, 3, padding=1, grid=grid, split=(0, None), seed=seed)


@pytest.mark.mpi(min_size=2)
def test_meta_model_without_seed_says_to_pass_seed() -> None:
    """torch seeds every process differently, so a meta model wrapped without seed= always meets different
    generators: the message says to pass seed= or to seed torch alike, in both wrappers."""
    with hpctp.ProcessGrid((WORLD.size,)) as grid, torch.random.fork_rng(devices=[]):
        plan = ParallelPlan(grid, data=(0,))
        torch.manual_seed(1234 + grid.rank)  # as torch leaves each process
        for wrap in (lambda m: ShardedDataParallel(m, plan), lambda m: PipelineParallel([m], plan, microbatches=1)):
            with torch.device("meta"):
                model = _conv(plan.model_grid, seed=None)
            with pytest.raises(ValueError, match=r"different generator_state.*pass seed=.*torch\.manual_seed"):
                wrap(model)
        plan.free()


@pytest.mark.mpi(min_size=2)
def test_model_on_the_whole_grid_is_refused_when_wrapped() -> None:
    """A model built on plan.grid instead of plan.model_grid is refused by the wrappers, naming plan.model_grid
    (not at its first forward, with the grids' dims)."""
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))  # model grid: one rank per data group
        model = torch.nn.Sequential(_conv(grid))
        wanted = (
            rf"layer '0' \(Conv2d\) is built on a grid of dims \({WORLD.size},\).*build the model on plan.model_grid"
        )
        with pytest.raises(ValueError, match="ShardedDataParallel: " + wanted):
            ShardedDataParallel(model, plan, stage=2)
        with pytest.raises(ValueError, match="PipelineParallel: " + wanted):
            PipelineParallel(model, plan, microbatches=1)
        plan.free()


@pytest.mark.mpi
def test_losses_take_layer_outputs(grid1d: hpctp.ProcessGrid) -> None:
    """A layer's output (a DistTensor) goes into the global losses as it is; two DistTensors cut differently are
    refused, naming the redistribution."""
    x = hpctp.random.normal((3, 2, 8, 6), grid1d, (None, None, 0, None), seed=1, like="torch")
    y = hpctp.random.normal((3, 2, 8, 6), grid1d, (None, None, 0, None), seed=2, like="torch")
    whole = torch.nn.functional.mse_loss(torch.as_tensor(x.gather(None)), torch.as_tensor(y.gather(None)))
    assert_allclose(grid1d, global_mse_loss(x, y, grid1d), whole, rtol=1e-12, what="DistTensors in")
    assert_allclose(grid1d, global_mse_loss(x, y.local, grid1d), whole, rtol=1e-12, what="a DistTensor and a block")
    other = y.redistribute((None, None, None, 0))
    with pytest.raises(ValueError, match=r"different layouts.*call target\.redistribute\(pred\.layout\) first"):
        relative_l2_error(x, other, grid1d)


@pytest.mark.mpi
def test_losses_count_a_replicated_block_once(grid2d: hpctp.ProcessGrid) -> None:
    """A DistTensor cut over grid axis 0 only holds copies of its blocks along axis 1: its global sum and loss
    count each element once, as in one process (summing over both axes would count it dims[1] times)."""
    x = hpctp.random.normal((5, 7), grid2d, (0, None), seed=3, like="torch", dtype="float64")
    y = hpctp.random.normal((5, 7), grid2d, (0, None), seed=4, like="torch", dtype="float64")
    xg, yg = torch.as_tensor(x.gather(None)), torch.as_tensor(y.gather(None))
    assert_allclose(grid2d, hpctp.nn.global_sum(x, grid2d), xg.sum(), rtol=1e-12, what="global_sum")
    assert_allclose(
        grid2d, global_mse_loss(x, y, grid2d, reduction="sum"), ((xg - yg) ** 2).sum(), rtol=1e-12, what="mse sum"
    )
    whole = hpctp.random.normal((5, 7), grid2d, (None, None), seed=5, like="torch", dtype="float64")
    assert_allclose(
        grid2d, hpctp.nn.global_sum(whole, grid2d), torch.as_tensor(whole.gather(None)).sum(), rtol=1e-12,
        what="a DistTensor whole on every rank",
    )  # fmt: skip


@pytest.mark.mpi(min_size=2)
def test_loader_without_plan_on_an_undivided_axis_is_refused(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A dataset on a data x spatial grid whose split uses only the spatial axis, loaded without plan=: every data
    group would read the whole batch, so the loader refuses, naming plan= and plan.model_grid."""
    folder = Path(
        bcast_bytes(WORLD, str(tmp_path_factory.mktemp("newcomer")).encode() if WORLD.rank == 0 else None).decode()
    )
    with hpctp.ProcessGrid((WORLD.size, 1)) as grid:  # axis 0: the data, axis 1: the rows (1 rank)
        u = hpctp.distribute(np.ones((6, 1, 4, 4)) if grid.rank == 0 else None, grid, (None, None, 1, None))
        hpctp.io.save_hdf5(u, folder / "u.h5", "u", mode="w")
        ds = hpctp.io.FieldDataset(folder / "u.h5", "u", grid, (None, 1, None), targets=1)
        with pytest.raises(ValueError, match=r"leaves grid axes \[0\].*same samples.*pass plan=.*plan\.model_grid"):
            hpctp.io.FieldLoader(ds, 4)
        ds.close()


# ------------------------------------------------------------------------------------------------- the planner
def _report(memory: tuple[float, float, float, float, float], label: str = "D2 S2 T1 Z2") -> PlanReport:
    """A report of one plan with these bytes (total, parameters, gradients, optimizer, activations)."""
    total, params, grads, optim, activ = memory
    pred = SimpleNamespace(
        candidate=SimpleNamespace(label=lambda: label, dims=(1, 2, 2, 1)),
        memory=SimpleNamespace(total=total, params=params, grads=grads, optimizer=optim, activations=activ),
        time=SimpleNamespace(total=0.0125, compute=0.01, comm={"data": 0.002}, bubble=0.0, optimizer=0.0005),
        bottleneck="compute", cuts=(),
    )  # fmt: skip
    work = SimpleNamespace(
        param_count=3.6e5, param_bytes=1.4 * 2**20, sample=SimpleNamespace(shape=(4, 1, 32, 32), dtype="float32")
    )
    machine = SimpleNamespace(name="this CPU", source="measured")
    return PlanReport([pred], [], work, machine, 4, 2**30)  # type: ignore[arg-type]


def test_plan_table_puts_units_on_every_column() -> None:
    """Every size carries its unit (a small model's gradients read '720.0 KiB', not '0.00'), and times say ms."""
    text = _report((2.5 * 2**30, 1.4 * 2**20, 720 * 2**10, 2.8 * 2**20, 96.0)).table()
    header, row = text.splitlines()[3:5]
    assert "memory/rank" in header and "step [ms]" in header and "optim [ms]" in header, header
    cells = [c.strip() for c in row.split("|")]
    assert cells[3] == "2.50 GiB", row
    assert cells[4].split() == ["1.4", "MiB", "720.0", "KiB", "2.8", "MiB", "96", "B"], row
    assert " 0.00 " not in row and "12.5" in cells[5], row
    for label in ("D2 S2 T1 Z2", "D1 S2x1 T1 Z0 P2 interleaved m8 v2"):  # (a pipeline's label is wider)
        header, row = (
            _report((2.5 * 2**30, 1.4 * 2**20, 720 * 2**10, 2.8 * 2**20, 96.0), label).table().splitlines()[3:5]
        )
        bars = [[i for i, c in enumerate(line) if c == "|"] for line in (header, row)]
        assert bars[0] == bars[1], f"the columns do not line up:\n{header}\n{row}"


def test_plan_of_ones_own_model_warns_and_names_the_builders_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hpctp plan`` of one's own model (``[plan] inputs``) without --machine says on stderr that it prices on the
    published H100 profile and how to price this machine; a builder that fixes its layers' split gets the fix (split
    on the plan's spatial axes), not 'call x.redistribute(...)'."""
    if WORLD.size > 1:
        pytest.skip("the command runs in one process")
    (tmp_path / "newcomer_cnn.py").write_text(
        "import torch\nimport hpctp.perf\nfrom hpctp.nn import Conv2d\n\n"
        "def inputs(cfg):\n"
        "    def build(plan):  # the rows split over model-grid axis 0, whatever the plan: the mistake\n"
        "        return Conv2d(1, 4, 3, padding=1, grid=plan.model_grid, split=(0, None), seed=0)\n"
        "    return {'builder': build, 'sample': hpctp.perf.Sample((4, 1, 32, 32))}\n"
    )
    config = tmp_path / "cnn.toml"
    config.write_text('[plan]\ninputs = "newcomer_cnn:inputs"\n')
    assert cli_main(["plan", str(config), "--ranks", "4", "--memory", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "warning: no --machine given" in err and "'h100-ndr'" in err and "not on this machine" in err, err
    assert "hpctp perf calibrate" in err and "--machine machine.toml" in err, err
    assert "the builder must split the input on the plan's spatial axes" in err and "split=plan.spatial" in err, err
    assert "(None, None, 0, 1)" in err and "redistribute" not in err, err
    assert cli_main(["plan", str(config), "--ranks", "4", "--memory", "1GiB", "--machine", "a100-hdr"]) == 2
    assert "warning" not in capsys.readouterr().err
