"""hpctp.nn.ShardedDataParallel: stages 0-3 against one process, overlap of gradient messages, stage 3's memory."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from helpers.sharded import global_batch, make_model, ref_step, reference, sdp_step
from mpi4py import MPI

import hpctp
from hpctp.nn import ParallelPlan, ShardedDataParallel, global_mse_loss, global_state_dict
from hpctp.testing import assert_all, assert_allclose, assert_equal

WORLD = MPI.COMM_WORLD
STEPS = 5

# (grid dims, data axes, tensor axes, model kind): the plans of this job's rank count
_PLANS = {
    1: [((1,), (0,), (), "spatial")],
    2: [((2,), (0,), (), "spatial"), ((1, 2), (0,), (), "spatial")],
    3: [((3,), (0,), (), "spatial")],
    4: [((2, 2), (0,), (), "spatial"), ((2, 2), (0,), (1,), "tensor"), ((4,), (0,), (), "spatial")],
    6: [((2, 3), (0,), (), "spatial"), ((3, 2), (1,), (), "spatial")],
}
CASES = [
    pytest.param(dims, data, tensor, kind, stage, id=f"{'x'.join(map(str, dims))}-d{data}-{kind}-stage{stage}")
    for dims, data, tensor, kind in _PLANS.get(WORLD.size, [((WORLD.size,), (0,), (), "spatial")])
    for stage in (0, 1, 2, 3)
    if not (dims == (4,) and stage != 3)  # data 4 runs stage 3 only
]


def _adam(params: object) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=0.05)  # type: ignore[arg-type]


@pytest.mark.mpi
@pytest.mark.parametrize(("dims", "data", "tensor", "kind", "stage"), CASES)
def test_training_equals_one_process(dims: tuple[int, ...], data: tuple[int, ...], tensor: tuple[int, ...], kind: str, stage: int) -> None:  # fmt: skip
    """5 Adam steps on a global batch of 5 samples shared by the data groups: every loss, and the parameters after, equal
    one process's to 1e-10."""
    with hpctp.ProcessGrid(dims) as grid:
        plan = ParallelPlan(grid, data=data, tensor=tensor)
        model = make_model(plan, kind)
        ref = reference(model, plan, kind)
        sdp = ShardedDataParallel(model, plan, stage=stage, bucket_mib=1e-4)  # several buckets
        opt, ref_opt = _adam(sdp.parameters()), _adam(ref.parameters())
        losses = [sdp_step(sdp, opt, kind, s) for s in range(STEPS)]
        want = [ref_step(ref, ref_opt, kind, s) for s in range(STEPS)]
        assert_allclose(grid, np.array(losses), np.array(want), rtol=1e-10, what="losses")
        with sdp.gathered() as (inner, _):
            got = global_state_dict(inner, grid=plan.model_grid)
        for name, value in ref.state_dict().items():
            assert_allclose(grid, got[name], value, rtol=1e-10, atol=1e-12, what=name)
        plan.free()


@pytest.mark.mpi
@pytest.mark.parametrize("stage", [1, 3])
def test_optimizer_state_only_for_the_slices(stage: int) -> None:
    """Stages 1-3 give the optimizer this data rank's flat slices; gathered() cuts their Adam state back per
    parameter, equal to one process's."""
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))
        model = make_model(plan, "spatial")
        ref = reference(model, plan, "spatial")
        sdp = ShardedDataParallel(model, plan, stage=stage)
        total = sum(p.numel() for p in model.parameters())
        mine = sum(p.numel() for p in sdp.parameters())
        sizes = hpctp.comm.allgather_ints(grid.comm, [mine])[:, 0].tolist()
        assert_equal(grid, sum(sizes), total, "the slices cover every parameter once")
        assert_all(grid, max(sizes) - min(sizes) <= len(list(sdp.parameters())), f"balanced slices {sizes}")
        opt, ref_opt = _adam(sdp.parameters()), _adam(ref.parameters())
        for s in range(2):
            sdp_step(sdp, opt, "spatial", s)
            ref_step(ref, ref_opt, "spatial", s)
        held = sum(t.numel() for st in opt.state.values() for t in st.values() if t.ndim > 0)
        assert_equal(grid, held, 2 * mine, "Adam's moments exist for the slices only")
        with sdp.gathered(opt) as (inner, view):
            names = dict(inner.named_parameters())
            for name, p in names.items():
                st, ref_st = view.state[p], ref_opt.state[dict(ref.named_parameters())[name]]
                for key in ("exp_avg", "exp_avg_sq"):
                    assert_allclose(grid, st[key], ref_st[key], rtol=1e-10, atol=1e-14, what=f"{name}.{key}")
                assert_equal(grid, float(st["step"]), float(ref_st["step"]), f"{name}.step")
        plan.free()


class _Log:
    """Counts gradient messages started, read from a CommCounter, at each gradient hook of the test."""

    def __init__(self, counter: hpctp.CommCounter) -> None:
        self.counter = counter
        self.at_gradient: list[int] = []

    def started(self) -> int:
        calls = self.counter.calls
        return calls.get("Iallreduce", 0) + calls.get("Ireduce_scatter", 0)

    def hook(self, _p: torch.Tensor) -> None:
        self.at_gradient.append(self.started())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("overlap", [True, False])
def test_gradient_messages_start_during_backward(stage: int, overlap: bool) -> None:
    """The order of events: with overlap a bucket's message starts before the last gradient of backward
    arrives; without, all start in finish_gradients."""
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))
        model = make_model(plan, "spatial")
        with hpctp.CommCounter() as counter:
            log = _Log(counter)
            for p in model.parameters():  # before the wrapper's hooks: each runs first on its parameter
                p.register_post_accumulate_grad_hook(log.hook)
            sdp = ShardedDataParallel(model, plan, stage=stage, bucket_mib=1e-4, overlap=overlap)
            x, y = global_batch("spatial", 0)
            a, b = plan.sample_range(len(x))
            loss = global_mse_loss(sdp(x[a:b]), y[a:b], plan.grid, plan.loss_axes)
            before = log.started()
            loss.backward()
            sdp.finish_gradients()
            after = log.started()
        n_params = len(list(model.parameters()))
        assert_equal(grid, len(log.at_gradient), n_params, "one gradient hook per parameter")
        at_end = log.at_gradient[-1] - before  # started before the last gradient arrived
        buckets = len(sdp._buckets)
        assert_all(grid, buckets >= 3, f"several buckets expected, got {buckets}")
        if overlap:
            assert_all(grid, at_end >= 1, f"no gradient message started before backward ended ({log.at_gradient})")
        else:
            assert_equal(grid, at_end, 0, "messages before finish_gradients without overlap")
        assert_equal(grid, after - before, buckets, "one message per bucket, whatever its number of parameters")
        plan.free()


@pytest.mark.mpi
def test_stage3_keeps_only_slices_between_steps() -> None:
    """Outside forward and backward, a rank holds its slices (about 1/data_size of the model) and the
    parameters' storage is empty; inside a unit's forward its parameters are whole."""
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))
        model = make_model(plan, "spatial")
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        sdp = ShardedDataParallel(model, plan, stage=3)
        seen: list[bool] = []
        model.c1.register_forward_pre_hook(lambda m, i: seen.append(m.weight.untyped_storage().nbytes() > 0))
        opt = _adam(sdp.parameters())
        for s in range(2):
            sdp_step(sdp, opt, "spatial", s)
            stored = sum(p.untyped_storage().nbytes() for p in model.parameters())
            slices = sum(p.numel() * p.element_size() for p in sdp.parameters())
            bound = total / plan.data_size + 8 * len(sdp._buckets)  # block_range rounds each bucket up
            assert_equal(grid, stored, 0, "parameter storage between steps")
            assert_all(grid, slices <= bound, f"slices hold {slices} bytes, bound {bound} (model {total})")
        assert_all(grid, seen == [True, True], f"c1's weight whole inside its forward: {seen}")
        plan.free()


@pytest.mark.mpi
def test_misuse_raises_on_every_rank() -> None:
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))
        model = make_model(plan, "spatial")
        with pytest.raises(ValueError, match="stage must be"):
            ShardedDataParallel(model, plan, stage=4)
        with pytest.raises(ValueError, match="bucket_mib"):
            ShardedDataParallel(model, plan, bucket_mib=0)
        with pytest.raises(ValueError, match="units= applies to stage 3"):
            ShardedDataParallel(model, plan, stage=1, units=[model.c1])
        with pytest.raises(ValueError, match="not submodules"):
            ShardedDataParallel(model, plan, stage=3, units=[torch.nn.Linear(2, 2)])
        tied = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        tied[1].weight = tied[0].weight
        with pytest.raises(ValueError, match="share a parameter"):
            ShardedDataParallel(tied, plan, stage=3)
        with pytest.raises(TypeError, match="ParallelPlan"):
            ShardedDataParallel(model, grid)  # type: ignore[arg-type]
        sdp = ShardedDataParallel(model, plan, stage=2)
        with pytest.raises(ValueError, match="exactly sdp.parameters"):
            sdp.step(_adam(model.parameters()))
        opt = _adam(sdp.parameters())
        x, y = global_batch("spatial", 0)
        a, b = plan.sample_range(len(x))
        loss = global_mse_loss(sdp(x[a:b]), y[a:b], plan.grid, plan.loss_axes)
        loss.backward()
        with pytest.raises(RuntimeError, match="finish the gradients"):
            with sdp.gathered():
                pass
        sdp.step(opt)
        plan.free()


@pytest.mark.mpi
def test_units_argument_matches_default() -> None:
    """Stage 3 with coarser units (the whole model as one) steps like the default units."""
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))
        results = []
        for units in (None, []):
            model = make_model(plan, "spatial")
            sdp = ShardedDataParallel(model, plan, stage=3, units=units)
            opt = _adam(sdp.parameters())
            results.append([sdp_step(sdp, opt, "spatial", s) for s in range(2)])
            assert_equal(grid, len(sdp._units), 4 if units is None else 1, "units")
        assert_allclose(grid, np.array(results[0]), np.array(results[1]), rtol=1e-12, what="losses")
        plan.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("stage", [0, 3])
def test_wrapper_and_model_are_freed(stage: int) -> None:
    """After a step, dropping the wrapper, the model and the optimizer frees them and every parameter: the hooks
    autograd keeps in C++ (each parameter's post-accumulate hook, the units' output hooks) hold the wrapper weakly,
    and nothing that holds the parameter."""
    import gc
    import weakref

    def run() -> tuple[weakref.ref[Any], ...]:
        grid = hpctp.ProcessGrid((WORLD.size,))
        plan = ParallelPlan(grid, data=(0,))
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
        sdp = ShardedDataParallel(model, plan, stage=stage, seed=0)
        opt = _adam(sdp.parameters())
        sdp(torch.randn(3, 4)).square().mean().backward()
        sdp.step(opt)
        plan.free()
        grid.free()
        return weakref.ref(sdp), weakref.ref(model), *(weakref.ref(p) for p in sdp.parameters())

    refs = run()
    gc.collect()
    assert_all(WORLD, all(r() is None for r in refs), f"still alive: {[r() is not None for r in refs]}")
