"""A short end-to-end run of the core: scatter, redistribute through every 2-D layout,
reduce, and check each result against numpy on the gathered tensor."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..comm import CommCounter, ProcessGrid
from ..tensor import random as hrandom
from ..testing import assert_allclose
from .log import get_logger

__all__ = ["run_demo"]


def run_demo(shape: tuple[int, int] = (1001, 777), seed: int = 0, verbose: bool = False, comm: Any = None) -> float:
    """Collective over ``comm`` (default COMM_WORLD). Run the demo; return the largest relative error."""
    grid = ProcessGrid([0, 0], comm=comm)
    log = get_logger("hpctp.demo", grid, verbose)
    log.info("grid %s on %d ranks, tensor %s float64, seed %d", grid.dims, grid.size, shape, seed)
    x = hrandom.normal(shape, grid, (0, 1), seed)
    ref = x.gather(root=None)
    worst = 0.0
    t0 = time.perf_counter()
    for split in [(0, 1), (1, 0), (0, None), (None, 1), (None, None), (1, None), (0, 1)]:
        with CommCounter() as c:
            x = x.redistribute(split)
        got = x.gather(root=None)
        assert_allclose(grid, got, ref, rtol=0, atol=0, what=f"redistribute to {split}")
        log.info("redistributed to split=%-12s sent %9d bytes from this rank", str(split), c.bytes_sent)
    for name, value, expect in [
        ("sum", x.sum(), ref.sum()),
        ("mean", x.mean(), ref.mean()),
        ("max", x.max(), ref.max()),
        ("norm", x.norm(), np.linalg.norm(ref)),
    ]:
        err = abs(float(value) - expect) / max(abs(expect), 1e-300)
        worst = max(worst, err)
        log.info("%-4s = %+.12e   numpy %+.12e   rel.err %.1e", name, float(value), expect, err)
    col = x.sum(axis=0).gather(root=None)
    err = float(np.max(np.abs(col - ref.sum(axis=0))) / np.max(np.abs(ref.sum(axis=0))))
    worst = max(worst, err)
    log.info("sum(axis=0) matches numpy to %.1e; %.3f s for all steps", err, time.perf_counter() - t0)
    grid.free()
    return worst
