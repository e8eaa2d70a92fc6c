"""The simulation and the surrogate shared by the guide's data, checkpoint and C API pages.

* :func:`simulate`: blobs carried across a periodic square by a uniform wind while they diffuse,
  written with numpy's ``np.roll`` on a DistTensor (each rank steps its block).
* :class:`Surrogate`: a small Fourier neural operator that learns one snapshot from the previous one.
* :func:`factory`: what ``hpctp_load("guide_model:factory", "checkpoint.h5")`` calls from C or Fortran.
"""

from __future__ import annotations

import numpy as np
import torch

import hpctp
import hpctp.nn


def simulate(grid: hpctp.ProcessGrid, snapshots: int, size: int, split: tuple = (0, 1)) -> hpctp.DistTensor:
    """Collective over grid. ``snapshots`` states ``[T, 1, size, size]`` (float32, numpy blocks), 4 steps apart."""

    def blobs(i: np.ndarray, j: np.ndarray) -> np.ndarray:
        f = np.zeros(np.broadcast_shapes(i.shape, j.shape))
        for ci, cj, w, a in ((0.3, 0.3, 0.08, 1.0), (0.7, 0.55, 0.12, -0.8), (0.45, 0.8, 0.05, 0.6)):
            di = (i / size - ci + 0.5) % 1.0 - 0.5  # periodic distance
            dj = (j / size - cj + 0.5) % 1.0 - 0.5
            f = f + a * np.exp(-(di**2 + dj**2) / (2 * w**2))
        return f

    u = hpctp.fromfunction(blobs, (size, size), grid, split)
    states = []
    for _ in range(snapshots):
        states.append(u.astype("float32")[None, None])  # [1, 1, H, W]
        for _ in range(4):  # upwind advection towards +i and +j, explicit diffusion
            du_i, du_j = u - np.roll(u, 1, 0), u - np.roll(u, 1, 1)
            lap = np.roll(u, 1, 0) + np.roll(u, -1, 0) + np.roll(u, 1, 1) + np.roll(u, -1, 1) - 4 * u
            u = u - 0.4 * du_i - 0.2 * du_j + 0.05 * lap
    return hpctp.concatenate(states, axis=0)


class Surrogate(torch.nn.Module):
    """Local. A Fourier neural operator on ``[N, 1, H, W]`` fields split by ``split`` over ``grid``; predicts the
    next snapshot as the current one plus a learned change."""

    def __init__(self, grid: hpctp.ProcessGrid, split: tuple = (0, 1), width: int = 12, modes: int = 8) -> None:
        super().__init__()
        kw = {"grid": grid, "split": split}
        self.lift = hpctp.nn.Conv2d(1, width, 3, padding=1, padding_mode="circular", seed=0, **kw)
        self.spectral = hpctp.nn.SpectralConv2d(width, width, modes, seed=1, **kw)
        self.mix = hpctp.nn.Conv2d(width, width, 1, seed=2, **kw)
        self.head = hpctp.nn.Conv2d(width, 1, 1, seed=3, **kw)

    def forward(self, u: hpctp.DistTensor) -> hpctp.DistTensor:
        h = torch.nn.functional.gelu(self.lift(u))
        h = torch.nn.functional.gelu(self.spectral(h) + self.mix(h))
        return u + self.head(h)


class Inference:
    """Collective over grid. A trained :class:`Surrogate` as the C API wants it: a DistTensor in, a DistTensor of
    the same layout, dtype and backend out (the caller's blocks, any cuts; ``[1, H, W]`` or ``[N, 1, H, W]``)."""

    def __init__(self, grid: hpctp.ProcessGrid, checkpoint: str) -> None:
        self.model = Surrogate(grid).eval()
        hpctp.io.load_checkpoint(checkpoint, self.model, None, grid, strict=False)  # (the optimizer state: left)

    def __call__(self, x: hpctp.DistTensor) -> hpctp.DistTensor:
        batched = x.ndim == 4
        u = x.to("torch").astype("float32")
        with torch.no_grad():
            y = self.model(u if batched else u[None])
        y = y if batched else y[0]
        return y.to("numpy").astype(x.dtype)


def factory(grid: hpctp.ProcessGrid, checkpoint: str | None) -> Inference:
    """Collective over grid. ``hpctp_load("guide_model:factory", CHECKPOINT)``: the surrogate saved in ``checkpoint``.

    Raises
    ------
    ValueError
        Without a checkpoint (on every rank).
    """
    if not checkpoint:
        raise ValueError(
            "guide_model:factory needs a checkpoint (examples/guide/data_save.py or capi_surrogate.py writes one)"
        )
    return Inference(grid, checkpoint)
