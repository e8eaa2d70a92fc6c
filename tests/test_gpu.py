"""CUDA blocks through the core ops (skipped without a GPU; run by benchmarks/gpu_check.sh).

Every op must keep its results on the device and equal numpy on the gathered tensor, with
device buffers handed to MPI directly (CUDA-aware) or staged through pinned host memory.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hpctp
from hpctp.halo import HaloExchange
from hpctp.testing import assert_all, assert_allclose

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _device(grid2d: hpctp.ProcessGrid) -> None:
    hpctp.comm.select_device(grid2d)


@pytest.mark.mpi
@pytest.mark.parametrize("aware", ["0", "1"])
def test_cuda_core_ops(grid2d: hpctp.ProcessGrid, aware: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCTP_CUDA_AWARE", aware)
    if aware == "1" and not hpctp.comm.cuda_aware_reason()[0]:
        pytest.skip("forced CUDA-aware path")  # forced: valid only when the MPI supports it
    a = np.arange(63, dtype=np.float64).reshape(9, 7) ** 1.5
    x = hpctp.distribute(torch.from_numpy(a).cuda() if grid2d.rank == 0 else None, grid2d, (0, 1))
    assert_all(grid2d, x.local.is_cuda, "blocks on the device")
    for split in [(1, 0), (None, 0), (None, None)]:
        y = x.redistribute(split)
        assert_all(grid2d, y.local.is_cuda, "redistribute stays on the device")
        assert_allclose(grid2d, y.gather(None), a)
    assert_allclose(grid2d, float(x.sum()), a.sum())
    assert_allclose(grid2d, x.max(0).gather(None), a.max(0))
    b = hpctp.distribute(torch.from_numpy(a.T.copy()).cuda() if grid2d.rank == 0 else None, grid2d, (0, 1))
    c = x @ b
    assert_all(grid2d, c.local.is_cuda, "matmul on the device")
    assert_allclose(grid2d, c.gather(None), a @ a.T, rtol=1e-12)
    h = HaloExchange(x, 1, boundary="periodic")
    padded = h.exchange(x.local)
    assert_all(grid2d, padded.is_cuda, "halo on the device")
    ref = np.pad(a, 1, mode="wrap")
    r0, c0 = x.local_offsets
    want = ref[r0 : r0 + padded.shape[0], c0 : c0 + padded.shape[1]]
    assert_allclose(grid2d, padded, want)
