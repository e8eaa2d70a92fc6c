"""PipelineParallel's check that the stages fit together: a stage whose output the next stage cannot take is refused
on every rank before any pipeline message, naming both stages, the layers at the cut, the shape given and the fix;
a layer that only fails on meta tensors is no false alarm; the check runs once per input signature."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mpi4py import MPI

import hpctp
from hpctp.nn import ParallelPlan, PipelineParallel, global_mse_loss
from hpctp.nn.pipeline_parallel import runtime
from hpctp.testing import assert_all, assert_equal

WORLD = MPI.COMM_WORLD
F64 = torch.float64
E, N, M = 4, 7, 3  # features, samples (3, 2, 2 over the micro-batches on one data group), micro-batches


def _plan(grid: hpctp.ProcessGrid) -> ParallelPlan:
    return ParallelPlan(grid, data=(1,) if grid.ndim == 2 else (), pipeline=0)


def _dims() -> tuple[int, ...]:
    """pipeline 2 x data 2 on 4 ranks, else a pipeline of every rank."""
    return (2, 2) if WORLD.size == 4 else (WORLD.size,)


def _cuts(n_stages: int, n_layers: int) -> list[int]:
    """Stage 0 is layer 0, stage 1 starts at layer 1 (the misfit's cut), one layer each, the last stage the rest."""
    return [0, *range(1, n_stages), n_layers]


def _loss(plan: ParallelPlan) -> Any:
    return lambda p, t: global_mse_loss(p, t, plan.grid, plan.loss_axes)


def _share(plan: ParallelPlan, n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(n, E, generator=g, dtype=F64), torch.randn(n, E, generator=g, dtype=F64)
    a, b = plan.sample_range(n)
    return x[a:b], y[a:b]


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("schedule", "zero", "meta"),
    [("1f1b", None, False), ("interleaved", None, True), ("zero_bubble", 2, False), ("gpipe", 1, False)],
)
def test_stages_that_do_not_fit_are_refused_on_every_rank_before_any_message(
    schedule: str, zero: int | None, meta: bool
) -> None:
    """Stage 0 outputs 6 features, stage 1 takes 5: every rank raises one ValueError naming both stages, their
    layers at the cut, the shape and dtype stage 0 produces, the error and the fix, and no rank sends or receives a
    pipeline message (activations and their descriptions are point-to-point; none is posted)."""
    virtual = 2 if schedule == "interleaved" else 1
    with hpctp.ProcessGrid(_dims()) as grid:
        plan = _plan(grid)
        n_stages = plan.pipeline_size * virtual
        torch.manual_seed(0)
        with torch.device("meta") if meta else torch.device("cpu"):
            layers = [torch.nn.Linear(E, 6, dtype=F64), torch.nn.Linear(5, E, dtype=F64), torch.nn.Tanh()]
            layers += [torch.nn.Linear(E, E, dtype=F64) for _ in range(3)]
        cuts = _cuts(n_stages, len(layers))
        model = PipelineParallel(
            layers, plan, schedule=schedule, microbatches=M, virtual=virtual, cuts=cuts, zero=zero, seed=0
        )
        x, y = _share(plan)
        with hpctp.CommCounter() as counter, pytest.raises(ValueError) as err:
            model.step(x, y, _loss(plan))
        text = str(err.value)
        if n_stages > 1:
            wanted = ["stage 0 does not fit stage 1", "stage 0 (layers 0:1) ends with layer '0' (Linear(in_features=4, "
                      "out_features=6", "stage 1 (layers 1:", "starts with layer '1' (Linear(in_features=5,",
                      "a float64 tensor of shape (3, 6)", "mat1 and mat2 shapes cannot be multiplied (3x6 and 5x4)",
                      "move the cut", "out_features"]  # fmt: skip
        else:  # (one stage: the misfit is inside it)
            wanted = ["inside stage 0", "layer '1' (Linear(in_features=5,", "output of layer '0'", "(3, 6)"]
        missing = [w for w in wanted if w not in text]
        assert_all(grid, not missing, f"rank {grid.rank}: {missing} not in the error: {text}")
        point_to_point = {k: v for k, v in counter.calls.items() if k in ("Isend", "Irecv", "Send", "Recv")}
        assert_equal(grid, point_to_point, {}, f"rank {grid.rank}: pipeline messages before the error")
        plan.free()


class _Gate(torch.nn.Module):
    """x -> linear(x) if any x is nonzero: reads a value, which a meta tensor does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(E, E, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) if bool(x.abs().sum() >= 0) else x


@pytest.mark.mpi
def test_a_layer_that_only_fails_on_meta_trains_and_the_check_runs_once_per_signature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stage starting with a layer that reads a value (fails on meta, runs on zeros) is not refused: the pipeline
    trains. The check runs on the first step of each input signature only: again for a batch of another size, not
    for one of a size already seen."""
    calls: list[int] = []
    check = runtime.check_fit

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        check(*args, **kwargs)

    monkeypatch.setattr(runtime, "check_fit", counted)
    with hpctp.ProcessGrid(_dims()) as grid:
        plan = _plan(grid)
        n_stages = plan.pipeline_size
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = [torch.nn.Linear(E, E, dtype=F64), _Gate(), torch.nn.Tanh()]
        layers += [torch.nn.Linear(E, E, dtype=F64) for _ in range(2)]
        model = PipelineParallel(layers, plan, microbatches=M, cuts=_cuts(n_stages, len(layers)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for n in (N, N, N + 2, N):
            x, y = _share(plan, n)
            losses.append(model.step(x, y, _loss(plan), optimizer=opt))
            model.zero_grad()
        assert_all(grid, all(v == v for v in losses), f"finite losses {losses}")
        assert_equal(grid, len(calls), 2, "checks: once per input signature (two batch sizes)")
        plan.free()
