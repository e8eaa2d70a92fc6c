"""The comm layer: buffer-based collectives on numpy and torch blocks, counters, agreement on errors."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpctp.comm as C
from hpctp.comm.env import cuda_aware_setting, device_setting, environment_error
from hpctp.testing import assert_all, assert_equal


@pytest.mark.mpi
def test_allreduce_bcast_torch_and_numpy(world: MPI.Intracomm) -> None:
    size, rank = world.Get_size(), world.Get_rank()
    for make in (
        lambda shape, v: np.full(shape, float(v)),
        lambda shape, v: torch.full(shape, float(v), dtype=torch.float64),
    ):
        x = make((3, 2), rank + 1)
        C.allreduce(world, x, "sum")
        assert_equal(world, np.asarray(x), np.full((3, 2), size * (size + 1) / 2))
        y = make((4,), rank)
        C.allreduce(world, y, "max")
        assert_equal(world, np.asarray(y), np.full(4, size - 1.0))
        z = make((5,), 7 if rank == size - 1 else -1)
        C.bcast(world, z, root=size - 1)
        assert_equal(world, np.asarray(z), np.full(5, 7.0))
    with pytest.raises(ValueError, match="op must be"):
        C.allreduce(world, np.zeros(1), "avg")


def test_host_buffer_fast_path() -> None:
    """Blocks MPI can reduce in place come back as numpy views of the same memory; the others (bfloat16,
    conjugate views, non-contiguous) as None, for the staging and converting path."""
    a = np.arange(6.0)
    assert C.buffers.host_buffer(a) is a and C.buffers.host_buffer(a[::2]) is None
    t = torch.arange(6.0)
    view = C.buffers.host_buffer(t)
    assert view is not None and np.shares_memory(view, t.numpy())
    z = torch.ones(3, dtype=torch.complex128)
    assert C.buffers.host_buffer(z) is not None and C.buffers.host_buffer(z.conj()) is None
    assert C.buffers.host_buffer(t.to(torch.bfloat16)) is None and C.buffers.host_buffer(t[::2]) is None


@pytest.mark.mpi
def test_allreduce_complex_and_views(world: MPI.Intracomm) -> None:
    """The fast path sums complex blocks and contiguous views of a larger tensor in place."""
    r = world.Get_rank()
    z = torch.full((3,), complex(r, 1), dtype=torch.complex128)
    C.allreduce(world, z)
    n = world.Get_size()
    want = torch.full((3,), complex(n * (n - 1) / 2, n), dtype=torch.complex128)
    base = torch.zeros(4, 3)
    base[1] = r + 1.0
    C.allreduce(world, base[1])  # a contiguous row of a larger tensor
    ok = torch.equal(z, want) and torch.equal(base[1], torch.full((3,), n * (n + 1) / 2)) and not base[2].any()
    assert_all(world, bool(ok), f"rank {r}: {z}, {base}")


@pytest.mark.mpi
def test_slowest_seconds(world: MPI.Intracomm) -> None:
    """The slowest rank's time of one call, the same on every rank."""
    r = world.Get_rank()
    sec = C.slowest_seconds(world, lambda: time.sleep(0.01 * (r + 1)))
    every = np.empty(world.Get_size())
    world.Allgather(np.array([sec]), every)
    ok = bool((every == sec).all()) and 0.01 * world.Get_size() <= sec < 0.01 * world.Get_size() + 1.0
    assert_all(world, ok, f"rank {r}: {every}")


@pytest.mark.mpi
def test_ibcast_and_point_to_point(world: MPI.Intracomm) -> None:
    size, rank = world.Get_size(), world.Get_rank()
    buf = torch.arange(6, dtype=torch.float32) if rank == 0 else torch.zeros(6, dtype=torch.float32)
    pending = C.ibcast(world, buf, root=0)
    pending.wait()
    assert_equal(world, buf.numpy(), np.arange(6, dtype=np.float32))
    right, left = (rank + 1) % size, (rank - 1) % size
    send = np.full(3, rank, dtype=np.int64)
    recv = np.empty(3, dtype=np.int64)
    reqs = [C.irecv(world, recv, left, tag=5), C.isend(world, send, right, tag=5)]
    C.waitall(reqs)
    assert_equal(world, recv, np.full(3, left))


@pytest.mark.mpi
def test_counter_accounting(world: MPI.Intracomm) -> None:
    size, rank = world.Get_size(), world.Get_rank()
    world.Set_name("test.world")
    with C.CommCounter() as c:
        C.allreduce(world, np.zeros(10), "sum")
        C.bcast(world, np.zeros(4, dtype=np.float32), root=0)
    if size == 1:
        assert_equal(world, (c.bytes_sent, c.bytes_recv, c.calls), (0, 0, {}))
        return
    bcast_sent = 16 * (size - 1) if rank == 0 else 0
    bcast_recv = 0 if rank == 0 else 16
    assert_equal(world, (c.bytes_sent, c.bytes_recv), (80 + bcast_sent, 80 + bcast_recv))
    assert_equal(world, c.calls, {"Allreduce": 1, "Bcast": 1})
    assert_equal(world, c.per_comm["test.world"].bytes_sent, c.bytes_sent)


@pytest.mark.mpi
def test_alltoallv_bytes(world: MPI.Intracomm) -> None:
    size, rank = world.Get_size(), world.Get_rank()
    # rank r sends r+1 bytes of value r to every rank
    send = np.full((rank + 1) * size, rank, dtype=np.uint8)
    recvcounts = [r + 1 for r in range(size)]
    recv = np.empty(sum(recvcounts), dtype=np.uint8)
    with C.CommCounter() as c:
        C.alltoallv(world, send, [rank + 1] * size, recv, recvcounts)
    assert_equal(world, recv, np.repeat(np.arange(size, dtype=np.uint8), recvcounts))
    assert_equal(world, c.bytes_sent, (rank + 1) * (size - 1))
    assert_equal(world, c.bytes_recv, sum(recvcounts) - (rank + 1))


@pytest.mark.mpi(min_size=2)
def test_raise_if_any_agrees(world: MPI.Intracomm) -> None:
    rank = world.Get_rank()
    C.raise_if_any(world, None)  # nobody failed: no exception anywhere
    err = ValueError(f"bad block on rank {rank}") if rank >= 1 else None
    with pytest.raises(ValueError, match="bad block on rank 1"):
        C.raise_if_any(world, err)
    with pytest.raises(TypeError):
        C.raise_if_any(world, TypeError("x") if rank == world.Get_size() - 1 else None)
    assert_all(world, C.all_true(world, True) and not C.all_true(world, rank != 0), "all_true")


@pytest.mark.mpi
def test_bfloat16_reductions_add_values_not_bit_patterns(world: MPI.Intracomm) -> None:
    size = world.Get_size()
    x = torch.full((3,), 1.5, dtype=torch.bfloat16)
    C.allreduce(world, x, "sum")
    assert_equal(world, x.float().numpy(), np.full(3, 1.5 * size, dtype=np.float32), "allreduce")
    y = torch.full((2,), -0.25, dtype=torch.bfloat16)
    C.reduce(world, y, root=0)
    assert_equal(world, y.float().numpy(), np.full(2, -0.25 * (size if world.rank == 0 else 1), dtype=np.float32))
    z = torch.full((2,), 2.0, dtype=torch.bfloat16)
    C.ireduce(world, z, root=size - 1, op="max").wait()
    assert_equal(world, z.float().numpy(), np.full(2, 2.0, dtype=np.float32), "ireduce max")


def test_cuda_aware_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCTP_CUDA_AWARE", "1")
    assert C.cuda_aware() and C.cuda_aware_reason()[1] == "HPCTP_CUDA_AWARE=1"
    monkeypatch.setenv("HPCTP_CUDA_AWARE", "0")
    assert not C.cuda_aware()
    monkeypatch.delenv("HPCTP_CUDA_AWARE")
    assert isinstance(C.cuda_aware(), bool)
    monkeypatch.setenv("HPCTP_CUDA_AWARE", "1")
    assert C.cuda_aware_reason(override=False)[1] != "HPCTP_CUDA_AWARE=1"  # the library's own answer


@pytest.mark.parametrize("value", ["2", "maybe", "1.0", "-1"])
def test_bad_cuda_aware_setting_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """A typo used to fall through to detection silently."""
    monkeypatch.setenv("HPCTP_CUDA_AWARE", value)
    with pytest.raises(ValueError, match=rf"HPCTP_CUDA_AWARE='{value}' is not a boolean; set it to 1"):
        C.cuda_aware()
    assert "HPCTP_CUDA_AWARE" in str(environment_error())
    for ok, want in (("On", True), (" off ", False), ("YES", True), ("", None)):
        monkeypatch.setenv("HPCTP_CUDA_AWARE", ok)
        assert cuda_aware_setting() is want and environment_error() is None


def test_device_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPCTP_DEVICE", raising=False)
    assert device_setting() is None
    monkeypatch.setenv("HPCTP_DEVICE", " 3 ")
    assert device_setting() == 3
    for bad in ("gpu1", "-1", "1.5", "0x1"):
        monkeypatch.setenv("HPCTP_DEVICE", bad)
        with pytest.raises(ValueError, match=rf"HPCTP_DEVICE='{bad}' is not a device index"):
            device_setting()
        assert environment_error() is not None


@pytest.mark.mpi
@pytest.mark.parametrize("var, value", [("HPCTP_CUDA_AWARE", "2"), ("HPCTP_DEVICE", "first")])
def test_bad_setting_on_one_rank_raises_on_every_rank(
    world: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    """Set on the last rank only: building a grid and ``hpctp info`` raise everywhere, none hangs."""
    from hpctp.cli.info import runtime_info
    from hpctp.comm import ProcessGrid

    if world.Get_rank() == world.Get_size() - 1:
        monkeypatch.setenv(var, value)
    else:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=rf"{var}='{value}' is not"):
        ProcessGrid([world.Get_size()], world)
    with pytest.raises(ValueError, match=rf"{var}='{value}' is not"):
        runtime_info(world)


def test_mpich_answers_the_cuda_query() -> None:
    """MPICH exports MPIX_Query_cuda_support: detection must reach it although Python loads
    the library with RTLD_LOCAL (the global-namespace lookup alone never finds it)."""
    from hpctp.comm.cuda import _query_library

    if not MPI.Get_library_version().startswith("MPICH"):
        pytest.skip("the query is checked against MPICH, the library the suite installs")
    found, why = _query_library()
    assert found is not None, why
    assert "Query_cuda_support" in why, why


def test_noncontiguous_buffer_is_rejected() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        with C.mpi_buffer(np.zeros((4, 4))[:, 1]):
            pass
    with pytest.raises(ValueError, match="contiguous"):
        with C.mpi_buffer(torch.zeros(4, 4).t()):
            pass


@pytest.mark.mpi
def test_node_local_rank_and_device_selection(world: MPI.Intracomm) -> None:
    lrank, lsize = C.local_rank(world)
    # all ranks of the test job share this one machine
    assert_equal(world, (lrank, lsize), (world.Get_rank(), world.Get_size()))
    dev = C.select_device(world)
    expect = None if C.gpu_count() == 0 else lrank % C.gpu_count()
    assert_equal(world, -1 if dev is None else dev, -1 if expect is None else expect)
