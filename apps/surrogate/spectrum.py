"""Error by wavenumber band: where in the spectrum a surrogate is wrong (with hpctp.fft).

Surrogates of pattern-forming fields tend to get the large scales right and smear the small
ones; a single relative L2 error hides which. :func:`band_errors` splits the 2-D spectrum of
the error at half the largest wavenumber and reports each band's share of the relative L2
error, computed on the distributed fields (a pencil FFT, nothing gathered).
:func:`high_band_loss` is the high band's share of the mean squared error as a differentiable
training loss term (``train.spectral_weight``), through hpctp.fft's autograd.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import hpctp
from hpctp.fft import hermitian_weights, wavenumbers
from hpctp.nn import allreduce_sum

__all__ = ["band_errors", "high_band_loss", "high_band_mask"]


def high_band_mask(shape: tuple[int, int], rows: slice, cols: slice) -> tuple[np.ndarray, np.ndarray]:
    """Local. For the ``rfft2`` spectrum of an ``H x W`` field, restricted to ``rows x cols``: the
    high-band mask (``|k| > k_max / 2``, ``k_max = min(H, W) / 2``) and the weight of each mode in
    the field's energy (2 for the half-spectrum columns that stand for a conjugate pair, else 1).
    """
    h, w = shape
    ky = wavenumbers(h)[rows].astype(np.float64)
    kx = wavenumbers(w, half=True)[cols].astype(np.float64)
    k = np.sqrt(ky[:, None] ** 2 + kx[None, :] ** 2)
    weight = np.broadcast_to(hermitian_weights(w)[cols][None, :], k.shape)
    return k > min(h, w) / 4, weight


def _band_powers(
    err: torch.Tensor, grid: hpctp.ProcessGrid | None, layout: hpctp.Layout | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective over grid (local with ``grid`` None, on whole fields). This rank's shares of
    ``||P_low err||^2`` and ``||P_high err||^2`` (Parseval, from the ``rfft2`` of ``err``; every
    mode lives on one rank), differentiable through hpctp.fft's autograd or ``torch.fft``."""
    if grid is None or layout is None:
        spec = torch.fft.rfftn(err, dim=(2, 3))
        shape, rows, cols = tuple(err.shape[2:]), slice(None), slice(None)
    else:
        out = hpctp.fft.rfftn(hpctp.DistTensor(err, grid, layout), axes=(2, 3))
        spec, (rows, cols) = out.local, out.layout.local_slices(grid.coords)[2:]
        shape = tuple(layout.global_shape[2:])
    high, weight = high_band_mask(shape, rows, cols)  # type: ignore[arg-type]
    w = torch.as_tensor(weight / (shape[0] * shape[1]), dtype=err.dtype, device=err.device)
    power = spec.abs().square().sum((0, 1)) * w  # Parseval: sum |X_k|^2 = H W sum |x|^2
    mask = torch.as_tensor(high, device=err.device)
    return power[~mask].sum(), power[mask].sum()


def band_errors(pred: hpctp.DistTensor, truth: hpctp.DistTensor) -> tuple[float, float]:
    """Collective over grid. Relative L2 error of ``pred`` in the low and the high wavenumber band.

    Parameters
    ----------
    pred, truth : DistTensor
        ``[N, C, H, W]`` fields of one layout (torch blocks, any device), H and W split over
        the grid's two axes as the apps' are (so every mode lives on exactly one rank).

    Returns
    -------
    (float, float)
        ``||P_b (pred - truth)|| / ||truth||`` for the band ``b`` of ``|k| <= k_max / 2`` and of
        ``|k| > k_max / 2`` (Parseval: the norms of the band-filtered error): the two parts of
        the relative L2 error, whose squares add up to its square. The same on every rank.
    """
    low, high = _band_powers((pred.local - truth.local).double(), pred.grid, pred.layout)
    sums = np.array([float(low), float(high), float(truth.local.double().square().sum())])
    hpctp.comm.allreduce(pred.grid.comm, sums, "sum")  # each mode and cell is on one rank: a plain sum
    e_low, e_high, t = sums
    return float(np.sqrt(e_low / t)), float(np.sqrt(e_high / t))


def high_band_loss(
    pred: torch.Tensor, target: torch.Tensor, grid: hpctp.ProcessGrid | None = None, layout: hpctp.Layout | None = None
) -> torch.Tensor:
    """Collective over grid. ``||P_high (pred - target)||^2 / numel``: the part of the mean squared
    error in the band ``|k| > k_max / 2`` (Parseval), differentiable.

    Parameters
    ----------
    pred, target : torch.Tensor
        This rank's ``[N, C, h, w]`` blocks (``pred`` may require grad); with ``grid`` None, the
        whole fields (one process, ``torch.fft``).
    grid : ProcessGrid, optional
    layout : Layout
        The blocks' layout, H and W split over the grid's two axes (as the apps' fields are).

    Returns
    -------
    torch.Tensor
        0-d, the same on every rank; its gradient flows to ``pred`` through the FFT's moves.
    """
    _, total = _band_powers(pred - target.to(pred.dtype), grid, layout)
    if grid is None or layout is None:
        return total / pred.numel()
    return allreduce_sum(total, grid) / math.prod(layout.global_shape)
