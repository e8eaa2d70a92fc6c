"""Reused communication buffers (hpctp.comm.pool): planned moves allocate nothing on their second call.

Each move (redistribute, the FFT's transposes, a halo exchange and its adjoint, gather, scatter)
runs once to warm the pool, then again under a CommCounter: no buffer may be allocated, the
result must equal the first call's, and results are never pooled memory (they do not change
when the move runs again).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hpctp
import hpctp.fft
from hpctp._util.backend import empty_host_torch
from hpctp.comm import pool as P
from hpctp.testing import assert_all, assert_equal

BACKENDS = ["numpy", "torch"]


def _numpy(a: object) -> np.ndarray:
    return a.detach().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def _second_call(fn, grid: hpctp.ProcessGrid):  # type: ignore[no-untyped-def]
    """Collective over grid. Run ``fn`` twice; the second time under a CommCounter. Returns both results
    and the number of buffers the second call allocated, the largest over the ranks."""
    first = fn()
    with hpctp.CommCounter() as c:
        second = fn()
    worst = np.array([c.allocations], dtype=np.int64)
    hpctp.comm.allreduce(grid.comm, worst, "max")
    return first, second, int(worst[0])


# ----------------------------------------------------------------------------- the pool itself (local)
def test_pool_reuses_and_keeps_buffers_apart() -> None:
    P.clear()
    like = np.zeros(1)
    with hpctp.CommCounter() as c:
        a = P.acquire(10_000, like)
        b = P.acquire(10_000, like)  # (a is in use: b is other memory)
        assert a.shape[0] >= 10_000 and b.shape[0] >= 10_000
        assert not np.shares_memory(a, b)
        P.release(a)
        P.release(b)
        again = P.acquire(9_000, like)  # (a free buffer of enough capacity serves a smaller request)
        assert any(again is buf for buf in (a, b))
        P.release(again)
    assert c.allocations == 2 and c.allocated_bytes == 2 * a.shape[0]
    assert P.buffers() == (2, 2 * a.shape[0])
    with hpctp.CommCounter() as c:
        big = P.acquire(100_000, like)  # (no free buffer of that size: a new one)
        P.release(big)
        t = P.acquire(10_000, torch.zeros(1))  # (buffers are kept per backend)
        assert isinstance(t, torch.Tensor) and t.dtype == torch.uint8
        P.release(t)
    assert c.allocations == 2
    P.clear()
    assert P.buffers() == (0, 0)


def test_pool_drops_the_least_recently_used_beyond_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    P.clear()
    monkeypatch.setattr(P, "MAX_POOLED_BYTES", 3 * 4096)
    like = np.zeros(1)
    bufs = [P.acquire(4096 * (k + 1), like) for k in range(3)]  # 4, 8 and 12 KiB
    for b in bufs:
        P.release(b)
    count, held = P.buffers()
    assert held <= 3 * 4096 and count == 1 and P.acquire(12 * 1024, like) is bufs[2]
    P.clear()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.complex64, torch.bool])
def test_empty_host_torch_is_an_ordinary_tensor(dtype: torch.dtype) -> None:
    big = empty_host_torch((512, 1024), dtype)  # (1 MiB or more: numpy memory)
    small = empty_host_torch((3, 4), dtype)
    for t in (big, small):
        assert t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    big.zero_()
    big[1, 2] = 1
    assert int((big != 0).sum()) == 1


def test_empty_host_torch_under_fake_tensors() -> None:
    """The planner traces a step under FakeTensorMode, where a large buffer is a fake tensor of its shape (numpy
    memory cannot be wrapped: '.numpy() is not supported for tensor subclasses')."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        big = empty_host_torch((512, 1024), torch.float32)
    assert isinstance(big, FakeTensor) and big.shape == (512, 1024) and big.dtype == torch.float32


# ----------------------------------------------------------------------------- planned moves, second call
@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_redistribute_second_call_allocates_no_buffer(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    x = hpctp.random.normal((37, 23), grid2d, (0, 1), seed=4).to(backend)
    first, second, allocated = _second_call(lambda: x.redistribute((1, None)), grid2d)
    assert_equal(grid2d, allocated, 0, "buffers allocated by the second redistribute")
    assert_all(grid2d, np.array_equal(_numpy(first.local), _numpy(second.local)), "redistribute differs")
    assert_all(grid2d, first.local is not second.local, "results share memory")
    x.redistribute((None, 0))  # (another move of the same pool: the first result must not change)
    assert_all(grid2d, np.array_equal(_numpy(first.local), _numpy(second.local)), "a result changed later")
    assert_equal(grid2d, second.gather(root=None), x.gather(root=None), "redistribute values")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_rfftn_second_call_allocates_no_buffer(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    x = hpctp.random.normal((9, 8, 6), grid2d, (0, 1, None), seed=5).to(backend)
    first, second, allocated = _second_call(lambda: hpctp.fft.rfftn(x), grid2d)
    assert_equal(grid2d, allocated, 0, "buffers allocated by the second rfftn")
    got = second.gather(root=None)
    want = np.fft.rfftn(_numpy(x.gather(root=None)))
    assert_all(grid2d, bool(np.allclose(_numpy(got), want, rtol=1e-12, atol=1e-12)), "rfftn values")
    assert_all(grid2d, np.array_equal(_numpy(first.local), _numpy(second.local)), "rfftn differs")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_halo_exchange_and_adjoint_second_call_allocate_no_buffer(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    x = hpctp.random.normal((11, 10), grid2d, (0, 1), seed=6).to(backend)
    halo = hpctp.HaloExchange(x, 1, boundary="periodic")
    first, second, allocated = _second_call(lambda: halo.exchange(x.local), grid2d)
    assert_equal(grid2d, allocated, 0, "buffers allocated by the second halo exchange")
    assert_all(grid2d, np.array_equal(_numpy(first), _numpy(second)), "halo exchange differs")
    a1, a2, allocated = _second_call(lambda: halo.adjoint(second), grid2d)
    assert_equal(grid2d, allocated, 0, "buffers allocated by the second adjoint")
    assert_all(grid2d, np.array_equal(_numpy(a1), _numpy(a2)), "adjoint differs")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_and_scatter_second_call_allocate_no_buffer(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    whole = np.arange(7 * 5, dtype=np.float64).reshape(7, 5)
    x = hpctp.distribute(whole, grid2d, (1, 0)).to(backend)
    first, second, allocated = _second_call(lambda: x.gather(root=None), grid2d)
    assert_equal(grid2d, allocated, 0, "buffers allocated by the second gather")
    assert_all(grid2d, np.array_equal(_numpy(second), whole), "gather values")
    source = whole if backend == "numpy" else torch.from_numpy(whole)
    d1, d2, allocated = _second_call(lambda: hpctp.distribute(source, grid2d, (0, 1)), grid2d)
    assert_equal(grid2d, allocated, 0, "buffers allocated by the second scatter")
    assert_all(grid2d, np.array_equal(_numpy(d1.local), _numpy(d2.local)), "scatter differs")
