"""Models that never exist whole: ShardedDataParallel of a model built on meta (seeded, or loaded from a checkpoint by
slices), gradient accumulation, and stage 3's memory against one process (allocation statistics)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from helpers.sharded import F64, N, first_ranks, global_batch, make_model, ref_step, reference, sdp_step
from mpi4py import MPI

import hpctp
import hpctp.io
from hpctp._util.memory import jemalloc_library
from hpctp.comm.io_calls import bcast_bytes
from hpctp.nn import ParallelPlan, ShardedDataParallel, global_mse_loss, global_state_dict
from hpctp.testing import assert_all, assert_allclose, assert_equal

WORLD = MPI.COMM_WORLD
SEED = {"spatial": 2, "tensor": 6}  # the helper models' one torch.nn.Linear is built right after manual_seed(these)

# (grid dims, data axes, tensor axes, model kind, stages): the plans of this job's rank count
_PLANS = {
    4: [((2, 2), (0,), (), "spatial", (3,)), ((2, 2), (0,), (1,), "tensor", (3,))],
    6: [((3, 2), (0,), (), "spatial", (3,))],
}
CASES = [
    pytest.param(dims, data, tensor, kind, stage, id=f"{'x'.join(map(str, dims))}-{kind}-stage{stage}")
    for dims, data, tensor, kind, stages in [((WORLD.size,), (0,), (), "spatial", (0, 1, 2, 3))]
    + _PLANS.get(WORLD.size, [])
    for stage in stages
]


def _adam(params: object, lr: float = 0.05) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=lr)  # type: ignore[arg-type]


def _meta(plan: ParallelPlan, kind: str) -> torch.nn.Module:
    with torch.device("meta"):
        return make_model(plan, kind)


def _check_params(grid: hpctp.ProcessGrid, sdp: ShardedDataParallel, ref: torch.nn.Module, rtol: float) -> None:
    with sdp.gathered() as (inner, _):
        got = global_state_dict(inner, grid=sdp.plan.model_grid)
    for name, value in ref.state_dict().items():
        assert_allclose(grid, got[name], value, rtol=rtol, atol=1e-12, what=name)


@pytest.mark.mpi
@pytest.mark.parametrize(("dims", "data", "tensor", "kind", "stage"), CASES)
def test_meta_model_trains_as_one_process(dims: tuple[int, ...], data: tuple[int, ...], tensor: tuple[int, ...], kind: str, stage: int) -> None:  # fmt: skip
    """Built on meta and materialized from the seed: no rank ever allocates the whole model, and 5 Adam steps give
    one process's losses and parameters to 1e-10 (its model: the same one built for real, gathered)."""
    with hpctp.ProcessGrid(dims) as grid:
        plan = ParallelPlan(grid, data=data, tensor=tensor)
        model = _meta(plan, kind)
        sdp = ShardedDataParallel(model, plan, stage=stage, seed=SEED[kind], bucket_mib=1e-4)
        torch.manual_seed(SEED[kind])
        ref = reference(make_model(plan, kind), plan, kind)
        opt, ref_opt = _adam(sdp.parameters()), _adam(ref.parameters())
        losses = [sdp_step(sdp, opt, kind, s) for s in range(5)]
        want = [ref_step(ref, ref_opt, kind, s) for s in range(5)]
        assert_allclose(grid, np.array(losses), np.array(want), rtol=1e-10, what="losses")
        _check_params(grid, sdp, ref, 1e-10)
        plan.free()


@pytest.fixture
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One empty directory, created by rank 0 and used by every rank."""
    mine = str(tmp_path_factory.mktemp("meta")).encode() if WORLD.rank == 0 else None
    return Path(bcast_bytes(WORLD, mine).decode())


def _file_bytes(path: Path) -> int:
    """Collective over the world. The bytes of every dataset of a file (rank 0 reads the sizes)."""
    total = np.zeros(1, dtype=np.int64)
    sizes: list[int] = []

    def add(_name: str, obj: object) -> None:  # (visititems stops at a callback's first non-None value)
        if isinstance(obj, h5py.Dataset):
            sizes.append(obj.size * obj.dtype.itemsize)

    if WORLD.rank == 0:
        with h5py.File(path, "r") as f:
            f.visititems(add)
        total[0] = sum(sizes)
    WORLD.Bcast(total, root=0)
    return int(total[0])


@pytest.mark.mpi
def test_meta_model_loads_a_one_process_checkpoint_by_slices(shared_dir: Path) -> None:
    """One process trains and saves; a stage-3 model built on meta loads the file reading only its slices of the
    parameters and of Adam's state (bytes read counted: about 1/data_size of the file per rank) and trains on
    exactly as the process does."""
    path = shared_dir / "one.h5"
    ref = make_model(None, "spatial")
    ref_opt = _adam(ref.parameters())
    for s in range(2):
        ref_step(ref, ref_opt, "spatial", s)
    if WORLD.rank == 0:
        with hpctp.ProcessGrid((1,), comm=MPI.COMM_SELF) as one:
            hpctp.io.save_checkpoint(path, ref, ref_opt, 2, one)
    WORLD.Barrier()
    total = _file_bytes(path)
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))
        sdp = ShardedDataParallel(_meta(plan, "spatial"), plan, stage=3, seed=0)  # the seed's values get replaced
        opt = _adam(sdp.parameters(), lr=1.0)  # the file's lr (0.05) replaces it
        with hpctp.io.IOCounter() as io:
            step = hpctp.io.load_checkpoint(path, sdp, opt, grid)
        assert_equal(grid, step, 2, "step")
        slices = sum((b.hi - b.lo) * b.shard.element_size() * 3 for b in sdp.flat_buckets)  # params, exp_avg(_sq)
        steps = sum(4 * len(b.params) for b in sdp.flat_buckets)  # (a 0-d float32 step per parameter)
        assert_all(grid, slices <= io.bytes_read <= slices + steps, f"read {io.bytes_read} B, slices {slices} B")
        assert_all(grid, io.bytes_read <= total / grid.size + 64 * len(sdp.flat_buckets), f"{io.bytes_read} of {total}")
        losses = [sdp_step(sdp, opt, "spatial", s) for s in range(2, 4)]
        want = [ref_step(ref, ref_opt, "spatial", s) for s in range(2, 4)]
        assert_allclose(grid, np.array(losses), np.array(want), rtol=1e-10, what="losses after loading")
        _check_params(grid, sdp, ref, 1e-10)
        plan.free()


@pytest.mark.mpi
def test_stage3_saves_its_slices_and_restores_on_one_rank_and_on_two(shared_dir: Path) -> None:
    """A meta-built stage-3 model saves by slices (each data rank writes about 1/data_size of the file, the whole
    never gathered); the file restores into a plain model on one rank and into stage 3 on two ranks, and both
    train on as the saving job does."""
    path = shared_dir / "sdp.h5"
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))
        sdp = ShardedDataParallel(_meta(plan, "spatial"), plan, stage=3, seed=SEED["spatial"])
        opt = _adam(sdp.parameters())
        for s in range(2):
            sdp_step(sdp, opt, "spatial", s)
        with hpctp.io.IOCounter() as io:
            hpctp.io.save_checkpoint(path, sdp, opt, 2, grid)
        total = _file_bytes(path)
        assert_all(grid, io.bytes_written <= total / grid.size + 4096, f"wrote {io.bytes_written} of {total} B")
        written = np.array([io.bytes_written], dtype=np.int64)
        WORLD.Allreduce(MPI.IN_PLACE, written)
        assert_equal(grid, int(written[0]), total, "the ranks together write the file once")
        want = [sdp_step(sdp, opt, "spatial", s) for s in range(2, 4)]
        plan.free()
    if WORLD.rank == 0:
        ref = make_model(None, "spatial")
        ref_opt = _adam(ref.parameters(), lr=1.0)
        with hpctp.ProcessGrid((1,), comm=MPI.COMM_SELF) as one:
            hpctp.io.load_checkpoint(path, ref, ref_opt, one)
        plain = [ref_step(ref, ref_opt, "spatial", s) for s in range(2, 4)]
        np.testing.assert_allclose(plain, want, rtol=1e-10)
    comm = first_ranks(min(2, WORLD.size))
    if comm is not None:
        with hpctp.ProcessGrid((comm.size,), comm=comm) as grid:
            plan = ParallelPlan(grid, data=(0,))
            sdp = ShardedDataParallel(_meta(plan, "spatial"), plan, stage=3, seed=0)
            opt = _adam(sdp.parameters(), lr=1.0)
            hpctp.io.load_checkpoint(path, sdp, opt, grid)
            got = [sdp_step(sdp, opt, "spatial", s) for s in range(2, 4)]
            assert_allclose(grid, np.array(got), np.array(want), rtol=1e-10, what="restored on 2 ranks")
            plan.free()
        comm.Free()
    WORLD.Barrier()


class _Scaled(torch.nn.Module):
    """A parameter nothing can initialise on meta (no reset_parameters())."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3, dtype=F64)
        self.scale = torch.nn.Parameter(torch.empty(3, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@pytest.mark.mpi
def test_meta_and_checkpoint_errors_name_the_parameter(shared_dir: Path) -> None:
    """On every rank, before any message: a meta parameter no module can initialise; a checkpoint whose global
    shapes differ from the model's (naming the parameter and both shapes)."""
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))
        with torch.device("meta"):
            bad = _Scaled()
        with pytest.raises(ValueError, match=r"scale \(_Scaled has no reset_parameters\(\)\)"):
            ShardedDataParallel(bad, plan, stage=3, seed=0)
        path = shared_dir / "small.h5"
        if WORLD.rank == 0:
            with hpctp.ProcessGrid((1,), comm=MPI.COMM_SELF) as one:
                hpctp.io.save_checkpoint(path, torch.nn.Sequential(torch.nn.Linear(4, 3)), None, 0, one)
        WORLD.Barrier()
        with torch.device("meta"):
            other = torch.nn.Sequential(torch.nn.Linear(4, 5))
        sdp = ShardedDataParallel(other, plan, stage=3, seed=0)
        with pytest.raises(ValueError, match=r"model/0\.weight: file \(3, 4\) float32, model \(5, 4\) float32"):
            hpctp.io.load_checkpoint(path, sdp, None, grid)
        plan.free()


def _micro_step(sdp: ShardedDataParallel, opt: torch.optim.Optimizer, step: int, no_sync: bool) -> None:
    """Collective over grid. One step on the global batch cut into two uneven micro-batches, each backward
    separately (its loss weighted by its share, so the gradients sum to the whole batch's)."""
    plan = sdp.plan
    x, y = global_batch("spatial", step)
    for i, (a, b) in enumerate(((0, 3), (3, N))):
        lo, hi = plan.sample_range(b - a)
        loss = global_mse_loss(sdp(x[a + lo : a + hi]), y[a + lo : a + hi], plan.grid, plan.loss_axes) * (b - a) / N
        if no_sync and i == 0:
            with sdp.no_sync():
                loss.backward()
        else:
            loss.backward()
    sdp.step(opt)
    sdp.zero_grad()


@pytest.mark.mpi
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("no_sync", [False, True])
def test_gradient_accumulation_sums_micro_batches(stage: int, no_sync: bool) -> None:
    """Two backward passes per step (each sending its messages, or the first inside no_sync) sum their gradients,
    never averaging: 3 Adam steps equal one process on the whole batch to 1e-10."""
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))
        sdp = ShardedDataParallel(make_model(plan, "spatial"), plan, stage=stage, bucket_mib=1e-4)
        ref = make_model(None, "spatial")
        opt, ref_opt = _adam(sdp.parameters()), _adam(ref.parameters())
        for s in range(3):
            _micro_step(sdp, opt, s, no_sync)
            ref_step(ref, ref_opt, "spatial", s)
        _check_params(grid, sdp, ref, 1e-10)
        plan.free()


def _stack(width: int, depth: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])


def _state(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _live_peak(model: torch.nn.Module, step: object, opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    """Local. Live tensor bytes at the peak of one step (after a first step made Adam's state): what is alive on
    entry (parameters or slices, Adam's state) plus the profiler's peak above it."""
    step()  # type: ignore[operator]
    if isinstance(model, ShardedDataParallel):
        model.empty_cache()  # (its kept blocks are allocated again inside the measured step, so they count)
    alive = _state(params + [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.ndim])
    with hpctp.PeakMemory(tensors=True) as m:
        step()  # type: ignore[operator]
    return alive + m.tensors


@pytest.mark.mpi
def test_stage3_live_tensor_peak_against_one_process() -> None:
    """Allocation statistics, not resident memory: stage 3's peak of live tensor bytes on D data ranks is at most
    0.1 + 1.2 / D of one process's for the same model and batch (below 0.40 on 4 ranks; the state is 1/D of
    the process's, plus about two units gathered and one unit's gradient)."""
    width, depth, batch = 256, 8, 16
    torch.manual_seed(0)
    one = _stack(width, depth)
    one_opt = _adam(one.parameters())
    x = torch.randn(batch, width)

    def one_step() -> None:
        one(x).square().sum().backward()
        one_opt.step()
        one_opt.zero_grad()

    reference = _live_peak(one, one_step, one_opt, list(one.parameters()))
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))
        with torch.device("meta"):
            model = _stack(width, depth)
        sdp = ShardedDataParallel(model, plan, stage=3, seed=0)
        opt = _adam(sdp.parameters())
        a, b = plan.sample_range(batch)

        def sdp_one() -> None:
            sdp(x[a:b]).square().sum().backward()
            sdp.step(opt)
            sdp.zero_grad()

        peak = _live_peak(sdp, sdp_one, opt, list(sdp.parameters()))
        ratio = peak / reference
        peaks = hpctp.comm.allgather_ints(grid.comm, [peak])[:, 0]
        bound = 0.1 + 1.2 / plan.data_size
        assert_all(grid, max(peaks) / reference <= bound, f"stage 3 / one process {ratio:.3f} > {bound:.3f}")
        plan.free()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(WORLD.size > 1, reason="launches its own mpiexec job; run from the 1-rank session")
@pytest.mark.parametrize("allocator", ["glibc", "jemalloc"])
def test_model_three_times_the_budget_trains_and_saves_at_4_ranks(tmp_path: Path, allocator: str) -> None:
    """Parameters + gradients + Adam state 3x a per-rank budget: built on meta, 2 Adam steps and a save at stage 3 on
    4 ranks, every rank's resident memory (the kernel's high-water mark of the resident set, the runtime's own
    subtracted) stays under the budget, under the default glibc (the wrapper's reused unit memory, one block of
    gradient slices per step and its fixed mapping threshold) and under jemalloc through LD_PRELOAD."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_CVAR_"))}
    env.update(OMP_NUM_THREADS="1", MPIR_CVAR_ENABLE_HEAVY_YIELD="1", PYTHONUNBUFFERED="1")
    env = {k: v for k, v in env.items() if not k.startswith(("MALLOC_", "LD_PRELOAD"))}
    if allocator == "jemalloc":
        lib = jemalloc_library()
        if lib is None:
            pytest.skip("needs libjemalloc.so.2 (Debian libjemalloc2; tests/system_deps.sh installs it as root)")
        env["LD_PRELOAD"] = lib
    mpiexec = Path(sys.executable).with_name("mpiexec")
    script = Path(__file__).parent / "scripts" / "sharded_budget.py"
    cmd = [str(mpiexec), "-n", "4", sys.executable, str(script), str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    mib = 2**20
    assert result["state"] >= 3 * result["budget"] * 0.999
    over = [f"rank {r}: {p / mib:.1f} MiB" for r, p in enumerate(result["peaks"]) if p > result["budget"]]
    assert not over, (
        f"over the budget of {result['budget'] / mib:.1f} MiB (state {result['state'] / mib:.0f} MiB): {over}"
    )
