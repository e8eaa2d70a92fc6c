"""The trained surrogate as a callable on DistTensors: for in-situ use and the C API.

``hpctp_load("apps.surrogate.inference:factory", "out/run/checkpoint.h5")`` from C, or
``Surrogate(grid, checkpoint)(hpctp.from_local(block, grid, (None, 0, 1)))`` from Python:
the caller's blocks go in, the prediction comes back in blocks of the same layout, and
nothing is gathered.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import hpctp
from hpctp._util.backend import astype, convert

from .evaluate import load_model

__all__ = ["Surrogate", "factory"]


class Surrogate:
    """Collective over grid. A trained surrogate loaded from ``checkpoint`` (any saving grid).

    The architecture comes from ``config.json`` beside the checkpoint (written by ``train``).

    Parameters
    ----------
    grid : ProcessGrid
        Grid of the caller's blocks (2-D: H over axis 0, W over axis 1).
    checkpoint : str
        Path of ``checkpoint.h5``.

    Raises
    ------
    FileNotFoundError
        If the checkpoint or its ``config.json`` is missing.
    """

    def __init__(self, grid: hpctp.ProcessGrid, checkpoint: str) -> None:
        cfg_path = Path(checkpoint).parent / "config.json"
        error = (
            None if cfg_path.is_file() else FileNotFoundError(f"{cfg_path} not found (written by apps.surrogate train)")
        )
        hpctp.comm.raise_if_any(grid.comm, error)
        self.cfg: dict[str, Any] = json.loads(cfg_path.read_text())
        self.grid = grid
        self.channels = 2
        self.model = load_model(self.cfg, checkpoint, self.channels, grid)
        self.dtype = next(self.model.parameters()).dtype

    def __call__(self, x: hpctp.DistTensor) -> hpctp.DistTensor:
        """Collective over grid. The state ``horizon`` snapshots after ``x`` (``[C, H, W]`` or
        ``[B, C, H, W]``), as blocks of ``x``'s layout, backend and dtype."""
        batched = x.ndim == 4
        block = torch.as_tensor(convert(x.local, "torch")).to(self.dtype)
        if not batched:
            block = block[None]
        shape = x.global_shape if batched else (1, *x.global_shape)
        split = x.split if batched else (None, *x.split)
        cuts = x.layout.cuts if batched else (None, *x.layout.cuts)
        xin = hpctp.DistTensor(block, self.grid, hpctp.Layout(shape, self.grid.dims, split, cuts))
        # the layers work on balanced blocks (the U-Net's upsampled path is balanced, and its
        # residual x + f(x) needs both in one layout): uneven caller blocks go in balanced
        balanced = hpctp.Layout(shape, self.grid.dims, split)
        with torch.no_grad():
            y = self.model(xin if xin.layout == balanced else xin.redistribute(balanced))
        if y.layout != xin.layout:  # back to the caller's blocks
            y = y.redistribute(xin.layout)
        out = y.local if batched else y.local[0]
        out = convert(out, x.backend)
        return hpctp.DistTensor(astype(out, x.dtype), x.grid, x.layout)


def factory(grid: hpctp.ProcessGrid, checkpoint: str | None) -> Surrogate:
    """Collective over grid. Entry point for ``hpctp_load`` (the C API)."""
    if not checkpoint:
        raise ValueError("the surrogate needs a checkpoint path (out/run/checkpoint.h5)")
    return Surrogate(grid, checkpoint)
