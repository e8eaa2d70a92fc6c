"""Stage 3's reused unit memory (hpctp.nn.distributed._unit_memory) and glibc's fixed mapping threshold: blocks are
reused, what autograd saved of a parameter stays valid when its unit's memory moves, bad thresholds are refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from mpi4py import MPI

import hpctp
from hpctp._util.memory import map_large_blocks
from hpctp.nn import ParallelPlan, ShardedDataParallel
from hpctp.nn.distributed._unit_memory import GradientSlices, UnitMemory
from hpctp.testing import assert_all, assert_allclose, assert_equal

WORLD = MPI.COMM_WORLD
F64 = torch.float64


def test_a_freed_block_is_taken_by_the_next_storage_of_its_size() -> None:
    memory = UnitMemory()
    a = torch.empty(0, dtype=torch.uint8).untyped_storage()
    b = torch.empty(0, dtype=torch.uint8).untyped_storage()
    memory.attach(a, 4096)
    assert a.nbytes() == 4096 and memory.allocations == 1
    where = a.data_ptr()
    memory.detach(a)
    assert a.nbytes() == 0 and memory.kept_bytes == 4096
    memory.attach(b, 4096)  # the block a gave back
    assert b.nbytes() == 4096 and b.data_ptr() == where and memory.allocations == 1 and memory.kept_bytes == 0
    memory.attach(a, 4096)  # none kept: a new one
    assert memory.allocations == 2 and a.data_ptr() != where
    memory.detach(a)
    memory.detach(b)  # one block kept per size: the second is freed
    assert memory.kept_bytes == 4096
    memory.attach(a, 1024)  # another size: its own block
    assert memory.allocations == 3 and a.nbytes() == 1024
    memory.clear()
    assert memory.kept_bytes == 0


def test_a_view_taken_before_the_memory_moves_reads_the_new_memory() -> None:
    """What autograd saves of a parameter (the parameter, or a view of it) shares its storage object, so after the
    unit's memory is given back and another block attached and refilled, the view reads the refilled values."""
    memory = UnitMemory()
    flat = torch.zeros(6, dtype=F64)
    view = flat[2:5].view(3, 1).t()
    memory.detach(flat.untyped_storage())
    other = torch.zeros(0, dtype=F64)
    memory.attach(other.untyped_storage(), 48)  # another unit takes the block meanwhile
    memory.attach(flat.untyped_storage(), 48)  # and the first unit gets a new one
    flat.copy_(torch.arange(6, dtype=F64))
    assert torch.equal(view, torch.tensor([[2.0, 3.0, 4.0]], dtype=F64))


class _Bucket:
    def __init__(self, stage: int, size: int, dtype: torch.dtype = F64) -> None:
        self.stage, self.lo, self.hi, self.device, self.dtype = stage, 10, 10 + size, torch.device("cpu"), dtype


def test_a_steps_gradient_slices_are_views_of_one_block_per_dtype() -> None:
    a, b, c, d = _Bucket(3, 4), _Bucket(3, 0), _Bucket(3, 2, torch.float32), _Bucket(1, 5)
    slices = GradientSlices([a, b, c, d])
    sa, sb, sc = slices.slice_of(a), slices.slice_of(b), slices.slice_of(c)
    assert (sa.numel(), sb.numel(), sc.numel()) == (4, 0, 2) and sc.dtype == torch.float32
    assert sa.untyped_storage().data_ptr() == sb.untyped_storage().data_ptr()
    assert sa.untyped_storage().nbytes() == 4 * 8 and sc.untyped_storage().nbytes() == 2 * 4
    with pytest.raises(KeyError):
        slices.slice_of(d)  # stage 1 sums whole gradients: no slice here
    assert slices.slice_of(a).data_ptr() == sa.data_ptr()  # the same step: the same block
    slices.next_step()
    assert slices.slice_of(a).untyped_storage().data_ptr() != sa.untyped_storage().data_ptr()


class _Transposed(torch.nn.Module):
    """``x @ w.T`` through an explicit transpose: autograd saves a view of the weight, not the weight."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(n, n, generator=g, dtype=F64) / n**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.mm(x, self.weight.t()))


def _chain() -> torch.nn.Sequential:
    return torch.nn.Sequential(*[_Transposed(6, seed) for seed in range(4)])


@pytest.mark.mpi
def test_stage3_with_reused_unit_memory_trains_as_one_process() -> None:
    """Four units of one size share two blocks (a unit and its prefetched neighbour): 4 Adam steps equal one process's
    parameters (float64), of a step's 8 gathers at most one allocates (the neighbour prefetched at the start of
    forward: one block is kept between steps), and the gradient slices handed to the optimizer are views of one
    block."""
    x = torch.randn(7, 6, generator=torch.Generator().manual_seed(9), dtype=F64)
    ref = _chain()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))
        sdp = ShardedDataParallel(_chain(), plan, stage=3)
        opt = torch.optim.Adam(sdp.parameters(), lr=0.05)
        a, b = plan.sample_range(len(x))
        counts = []
        for _ in range(4):
            ref_opt.zero_grad()
            ref(x).square().sum().backward()
            ref_opt.step()
            sdp(x[a:b]).square().sum().backward()
            sdp.finish_gradients()
            blocks = {p.grad.untyped_storage().data_ptr() for p in sdp.parameters()}
            sdp.step(opt)
            sdp.zero_grad()
            counts.append(sdp._unit_memory.allocations)
        assert_equal(grid, len(blocks), 1, what="blocks holding the gradient slices handed to the optimizer")
        per_step = [b - a for a, b in zip(counts, counts[1:])]  # of 8 gathers a step (4 units, forward and backward)
        assert_equal(grid, per_step, [min(per_step[0], 1)] * 3, what="unit blocks allocated per step after the first")
        with sdp.gathered() as (model, _):
            for (name, got), want in zip(model.named_parameters(), ref.parameters()):
                assert_allclose(grid, got.detach(), want.detach(), rtol=1e-12, atol=1e-14, what=name)
        plan.free()


@pytest.mark.mpi
@pytest.mark.parametrize("bad", [0, -4, 1.5, True, "big"])
def test_a_bad_malloc_threshold_is_refused_on_every_rank(bad: object) -> None:
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))
        with pytest.raises(ValueError, match=r"malloc_threshold must be a positive number of bytes.*got") as e:
            ShardedDataParallel(_chain(), plan, stage=3, malloc_threshold=bad)  # type: ignore[arg-type]
        assert_all(grid, repr(bad) in str(e.value), str(e.value))
        plan.free()


_CHILD = """
import torch, hpctp
from hpctp.nn import ParallelPlan, ShardedDataParallel
with hpctp.ProcessGrid((1,)) as grid:
    plan = ParallelPlan(grid, data=(0,))
    def model():
        return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))
    def auto(rows):  # "auto" after a forward of `rows` samples (activations of rows x 1024 float32 are saved)
        sdp = ShardedDataParallel(model(), plan, stage=3)
        before = sdp.malloc_threshold
        with torch.no_grad():
            sdp(torch.ones(rows, 1024))
        during = sdp.malloc_threshold
        sdp(torch.ones(rows, 1024)).sum().backward()
        return before, during, sdp.malloc_threshold
    print(*auto(4), *auto(3 * 1024)[2:],
          ShardedDataParallel(model(), plan, stage=3, malloc_threshold=3 << 20).malloc_threshold,
          ShardedDataParallel(model(), plan, stage=2).malloc_threshold,
          ShardedDataParallel(model(), plan, stage=3, malloc_threshold=None).malloc_threshold)
    plan.free()
"""


@pytest.mark.skipif(WORLD.size > 1, reason="starts its own processes")
@pytest.mark.parametrize(
    ("env", "printed"),
    [({}, "None None 4194304 None 3145728 None None"),
     ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "None None None None None None None")],
    ids=["glibc", "set-in-the-environment"],
)  # fmt: skip
def test_stage3_fixes_glibc_mapping_threshold_unless_the_user_did(env: dict[str, str], printed: str) -> None:
    """With "auto", at the first forward with gradients (not before, not under no_grad): the largest parameter's
    bytes (a float32 weight of 1024 x 1024: 4 MiB), unless a tensor saved for backward is larger (3072 x 1024 float32
    inputs: 12 MiB), then nothing; an int at once; stages 0-2 and None leave malloc alone, as does a threshold the
    environment already set."""
    skip = ("PMI_", "PMIX_", "HYDRA_", "MALLOC_", "LD_PRELOAD")
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(skip)}
    child_env.update(env, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=child_env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == printed


def test_map_large_blocks_leaves_a_threshold_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert map_large_blocks(1 << 20) is False
