"""The alpha-beta-gamma cost model of SUMMA (pure functions; the per-rank byte counts are
checked against CommCounter in tests/test_matmul.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctp import perf
from hpctp.testing import grid_shapes

GRIDS = [d for p in range(1, 7) for d in grid_shapes(p, 2)]


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(0, 12), k=st.integers(0, 12), n=st.integers(0, 12),
    grid=st.sampled_from(GRIDS), ta=st.booleans(), tb=st.booleans(), panel=st.sampled_from([None, 1, 3]),
)  # fmt: skip
def test_traffic_is_conserved_and_flops_sum(m, k, n, grid, ta, tb, panel):  # type: ignore[no-untyped-def]
    """Every byte sent is received once; the ranks together do exactly 2 m k n flops."""
    sent, recv = perf.matmul_traffic(m, k, n, grid, transpose_a=ta, transpose_b=tb, panel=panel)
    assert len(sent) == len(recv) == math.prod(grid)
    assert sum(sent) == sum(recv)
    cost = perf.predict_matmul(m, k, n, grid, transpose_a=ta, transpose_b=tb, panel=panel)
    assert cost.bytes_sent == sent and cost.bytes_recv == recv
    assert sum(cost.flops) == 2 * m * k * n
    assert cost.time >= max(cost.compute_time, cost.redistribute_time) >= 0


@pytest.mark.parametrize("grid", GRIDS, ids=["x".join(map(str, g)) for g in GRIDS])
def test_stationary_c_closed_form(grid: tuple[int, int]) -> None:
    for m, k, n in [(7, 5, 9), (3, 2, 5), (1, 6, 4), (10, 13, 6)]:
        sent, recv = perf.matmul_traffic(m, k, n, grid, itemsize=4)
        for r, coords in enumerate(itertools.product(range(grid[0]), range(grid[1]))):
            ws, wr = perf.stationary_c_words(m, k, n, grid, coords)
            assert (sent[r], recv[r]) == (4 * ws, 4 * wr), (m, k, n, coords)


def test_known_numbers() -> None:
    # 2 x 2 grid, 4 x 4 x 4: each rank receives a 2 x 2 block of A and one of B (8 words)
    sent, recv = perf.matmul_traffic(4, 4, 4, (2, 2))
    assert recv == (64,) * 4 and sent == (64,) * 4
    # 1 x 2 grid: only A moves (along the grid row); B's k is not cut
    assert perf.stationary_c_words(4, 6, 2, (1, 2), (0, 1)) == (12, 12)
    assert perf.matmul_flops(4, 3, 5, (2, 2)) == (2 * 2 * 3 * 3, 2 * 2 * 3 * 2, 2 * 2 * 3 * 3, 2 * 2 * 3 * 2)
    # a single rank never communicates and only computes
    c = perf.predict_matmul(64, 64, 64, (1, 1), perf.Machine(gemm_half=0.0), panel=64)
    assert c.bytes_sent == (0,) and c.comm_time == 0.0
    assert c.time == pytest.approx(2 * 64**3 * perf.Machine().gamma)
    assert c.gflops == pytest.approx(1 / perf.Machine().gamma / 1e9)


def test_collective_times() -> None:
    mach = perf.Machine(alpha=1e-6, beta=1e-9, gamma=1e-9)
    assert perf.bcast_time(100, 1, mach) == 0.0
    assert perf.bcast_time(0, 8, mach) == 0.0
    assert perf.bcast_time(1000, 2, mach) == pytest.approx(1e-6 + 1e-6)
    assert perf.bcast_time(1e9, 16, mach) < 4 * (1e-6 + 1.0)  # long messages: scatter + allgather, not a tree
    assert perf.reduce_time(800, 2, mach) == pytest.approx(1e-6 + 800 * 1e-9 + 100 * 1e-9)  # send + add


def test_25d_moves_less_than_2d() -> None:
    """2.5D on (2, 2, 2): the panels move within a layer, half each, plus one all-reduce of C."""
    m = k = n = 64
    s2, r2 = perf.matmul_traffic(m, k, n, (2, 2))
    s3, r3 = perf.matmul_traffic(m, k, n, (2, 2, 2))
    assert sum(s3) == sum(r3)
    c_block = 32 * 32 * 8
    assert r3[0] == r2[0] // 2 + c_block  # layer 0, rank (0, 0, 0)
    assert sum(perf.predict_matmul(m, k, n, (2, 2, 2)).flops) == 2 * m * k * n
    assert perf.predict_matmul(m, k, n, (1, 1, 1)).bytes_sent == (0,)
    slow = perf.Machine(alpha=1e-6, beta=1e-8)
    assert (
        perf.predict_matmul(512, 4096, 512, (2, 2, 2), slow).time
        < perf.predict_matmul(512, 4096, 512, (2, 4), slow).time
    )


def test_recommend_grid() -> None:
    fast = perf.Machine()
    slow = perf.Machine(alpha=1e-4, beta=1e-8)  # communication dominates
    assert perf.recommend_grid(2048, 2048, 2048, 4, fast) == (2, 2)
    assert perf.recommend_grid(2048, 2048, 2048, 16, slow) == (4, 4)
    assert perf.recommend_grid(100_000, 64, 64, 4, slow) == (4, 1)  # tall A: never move it
    assert perf.recommend_grid(64, 64, 100_000, 4, slow) == (1, 4)  # wide B
    assert perf.recommend_grid(5, 5, 5, 1) == (1, 1)
    with pytest.raises(ValueError, match="nranks"):
        perf.recommend_grid(5, 5, 5, 0)


def test_recommend_panel_tradeoffs() -> None:
    size = (1024, 1024, 1024)
    latency_bound = perf.Machine(alpha=1e-2)
    no_overheads = perf.Machine(alpha=0.0, gemm_half=0.0)
    assert perf.recommend_panel(*size, (2, 2), latency_bound) == 512  # one panel per block
    assert perf.recommend_panel(*size, (2, 2), no_overheads) == 8  # smallest prologue
    w = perf.recommend_panel(*size, (2, 2))
    assert 8 <= w <= 512
    assert perf.predict_matmul(*size, (2, 2), panel=w).time <= perf.predict_matmul(*size, (2, 2), panel=64).time


def test_model_validation() -> None:
    with pytest.raises(ValueError, match="machine"):
        perf.Machine(gamma=0.0)
    for bad in ({"alpha": float("nan")}, {"beta": float("inf")}, {"gemm_half": float("nan")}):
        with pytest.raises(ValueError, match="must be finite"):  # NaN slipped through the >= 0 test
            perf.Machine(**bad)
    for bad in ({"alpha": "1e-6"}, {"gamma": True}, {"beta": None}):
        with pytest.raises(TypeError, match=r"Machine\.(alpha|gamma|beta) must be a real number"):
            perf.Machine(**bad)  # type: ignore[arg-type]
    assert perf.Machine(alpha=np.float32(1e-6), gemm_half=np.int64(8)).gemm_half == 8
    with pytest.raises(ValueError, match="m must"):
        perf.matmul_traffic(-1, 2, 2, (1, 1))
    with pytest.raises(ValueError, match="grid_dims"):
        perf.predict_matmul(2, 2, 2, (2, 2, 1, 1))
    with pytest.raises(ValueError, match="panel"):
        perf.predict_matmul(2, 2, 2, (1, 1), panel=0)
    for dims in [(2.7, 1), "22", (True, 2), (2, 0), 4]:  # refused, not truncated or split into characters
        with pytest.raises(ValueError, match="grid_dims"):
            perf.matmul_traffic(4, 4, 4, dims)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"coords=\(2, 0\) must be 2 ints in the grid \(2, 2\)"):
        perf.stationary_c_words(4, 4, 4, (2, 2), (2, 0))
    with pytest.raises(ValueError, match="coords"):
        perf.stationary_c_words(4, 4, 4, (2, 2), (-1, -1))
    # numpy ints are ints
    assert perf.stationary_c_words(np.int64(4), 4, 4, (np.int64(2), 2), (np.int64(1), 0)) == perf.stationary_c_words(
        4, 4, 4, (2, 2), (1, 0)
    )
    assert perf.recommend_grid(4, 4, 4, np.int64(4)) == perf.recommend_grid(4, 4, 4, 4)
