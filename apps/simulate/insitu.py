"""In-situ inference: the running simulation hands its own blocks and communicator to the
surrogate and gets predictions back in its own blocks, without gathering the field."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import hpctp
from hpctp.nn import relative_l2_error

from ..surrogate.inference import Surrogate
from .grayscott import GrayScott, initial_state

__all__ = ["run_insitu"]


def run_insitu(cfg: dict[str, Any], grid: hpctp.ProcessGrid, log: Any, checkpoint: str | None) -> int:
    """Collective over grid. Simulate, and every ``horizon`` snapshots compare the surrogate's
    prediction (made from the simulation's live blocks) with the simulated state.

    Returns
    -------
    int
        0 (errors are logged).
    """
    sim = cfg["simulation"]
    ckpt = checkpoint or f"{cfg['train']['out']}/checkpoint.h5"
    # the "simulation code": its own state, decomposition and communicator
    model = GrayScott.from_config(sim)
    state = initial_state(tuple(sim["size"]), grid, sim["seed"], sim["seeds"])
    sim_comm = grid.comm
    # the surrogate on the simulation's communicator
    sgrid = hpctp.ProcessGrid(grid.dims, comm=sim_comm)
    surrogate = Surrogate(sgrid, ckpt)
    stride = int(sim["snapshot_every"]) * int(cfg["surrogate"]["horizon"])
    model.step(state, int(sim["warmup"]))
    errors = []
    steps = int(sim["warmup"])
    while steps + stride <= int(sim["steps"]):
        block = state.local  # the simulation's own numpy block [2, h, w]
        guess = surrogate(hpctp.from_local(block, sgrid, (None, 0, 1))).local  # same shape, no gather
        model.step(state, stride)
        steps += stride
        errors.append(float(relative_l2_error(torch.as_tensor(guess), torch.as_tensor(state.local), sgrid)))
    log.info(
        "in-situ: %d predictions from live blocks, relative L2 error mean %.4f, max %.4f",
        len(errors), float(np.mean(errors)), float(np.max(errors)),
    )  # fmt: skip
    return 0
