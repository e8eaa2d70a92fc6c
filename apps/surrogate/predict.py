"""Roll the surrogate forward from a stored snapshot and write the predicted states."""

from __future__ import annotations

from typing import Any

import torch

import hpctp
from hpctp.io import load_hdf5, save_hdf5

from .data import FIELDS, SPLIT
from .evaluate import load_model

__all__ = ["predict"]


def predict(
    cfg: dict[str, Any], data: str, checkpoint: str, start: int, steps: int, out: str, grid: hpctp.ProcessGrid, log: Any
) -> hpctp.DistTensor:
    """Collective over grid. Predict ``steps`` states (each ``horizon`` snapshots apart) from snapshot ``start``.

    Returns
    -------
    DistTensor
        ``[steps, C, H, W]`` split ``(None, None, 0, 1)``, also written to ``out`` (dataset ``predictions``).
    """
    x0 = load_hdf5(data, FIELDS, grid, SPLIT, index=start)  # [C, H, W], this rank's hyperslab only
    model = load_model(cfg, checkpoint, x0.global_shape[0], grid)
    dtype = next(model.parameters()).dtype
    state = hpctp.DistTensor(
        torch.as_tensor(x0.local).to(dtype)[None], grid, hpctp.Layout((1, *x0.global_shape), grid.dims, (None, *SPLIT))
    )
    frames = []
    with torch.no_grad():
        for _ in range(steps):
            state = model(state)
            frames.append(state.local[0])
    layout = hpctp.Layout((steps, *x0.global_shape), grid.dims, (None, *SPLIT))
    result = hpctp.DistTensor(torch.stack(frames), grid, layout)
    save_hdf5(result, out, "predictions", mode="w", attrs={"start": start, "horizon": int(cfg["surrogate"]["horizon"])})
    log.info("wrote %d predicted states from snapshot %d to %s", steps, start, out)
    return result
