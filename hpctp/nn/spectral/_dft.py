"""Truncated DFT matrices for the spectral layers: local math on index ranges, no MPI.

A Fourier layer keeps only the lowest modes of each spatial axis. Along a *full* axis of
length ``n`` it keeps ``m`` non-negative and ``m`` negative frequencies (``k = 0..m-1`` and
``k = n-m..n-1``, the layout of ``torch.fft.fft``); along the *half* (last) axis of a real
field, ``k = 0..m-1`` of ``torch.fft.rfft``. Restricted to one block's index range
``[start, stop)`` the transform is a small dense matrix, so a rank computes its block's
share of the spectrum with one matmul per axis and the shares add up over the grid.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

__all__ = ["kept_modes", "forward_matrix", "inverse_matrix", "check_modes"]


def kept_modes(n: int, m: int, half: bool) -> np.ndarray:
    """Local. Frequency indices kept along an axis of length ``n`` (``2m`` of them, ``m`` if ``half``)."""
    if half:
        return np.arange(m, dtype=np.int64)
    return np.concatenate([np.arange(m, dtype=np.int64), np.arange(n - m, n, dtype=np.int64)])


def check_modes(n: int, m: int, half: bool, what: str) -> None:
    """Local. Raise ValueError when ``m`` modes do not fit an axis of length ``n``.

    A full axis holds ``2m <= n`` distinct frequencies; the half axis ``m <= n // 2 + 1``.
    """
    limit = n // 2 + 1 if half else n // 2
    if m > limit:
        need = f"m <= n // 2 + 1 = {limit}" if half else f"2m <= n, i.e. m <= {limit}"
        raise ValueError(f"{what}: {m} modes do not fit a dim of size {n} ({need}); use fewer modes")


def _phase(n: int, start: int, stop: int, k: np.ndarray) -> np.ndarray:
    """``2 pi (k j mod n) / n`` for ``j`` in ``[start, stop)``: exact integer reduction first."""
    j = np.arange(start, stop, dtype=np.int64)
    return (2.0 * np.pi / n) * np.mod(np.multiply.outer(j, k), n).astype(np.float64)


def _complex(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype == torch.float64 else torch.complex64


@functools.lru_cache(maxsize=128)
def forward_matrix(
    n: int, start: int, stop: int, m: int, half: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Local. ``F[j - start, i] = exp(-2 pi i k_i j / n)``: block rows of the truncated DFT.

    ``x_block @ F`` along the axis is this block's share of the kept spectrum.

    Parameters
    ----------
    n : int
        Global length of the axis.
    start, stop : int
        This block's index range along it.
    m : int
        Modes kept (see :func:`kept_modes`).
    half : bool
        The rfft (last) axis.
    dtype : torch.dtype
        Real dtype of the field; the matrix is its complex counterpart.
    device : torch.device

    Returns
    -------
    torch.Tensor
        ``[stop - start, len(kept_modes)]``, complex. Cached: do not modify.
    """
    ph = _phase(n, start, stop, kept_modes(n, m, half))
    f = torch.from_numpy(np.cos(ph) - 1j * np.sin(ph))
    return f.to(device=device, dtype=_complex(dtype))


@functools.lru_cache(maxsize=128)
def inverse_matrix(
    n: int, start: int, stop: int, m: int, half: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Local. Columns ``[start, stop)`` of the inverse of the truncated DFT (zero-padded modes).

    Full axis: ``G[i, j - start] = exp(2 pi i k_i j / n) / n`` (``torch.fft.ifft``). Half axis:
    the same times ``c_k`` (2, or 1 for ``k = 0`` and the Nyquist mode ``2k = n``); the real
    part of ``spectrum @ G`` is then ``torch.fft.irfft`` (which ignores the imaginary parts of
    those two modes, as the real part does).

    Returns
    -------
    torch.Tensor
        ``[len(kept_modes), stop - start]``, complex. Cached: do not modify.
    """
    k = kept_modes(n, m, half)
    ph = _phase(n, start, stop, k).T
    g = (np.cos(ph) + 1j * np.sin(ph)) / n
    if half:
        c = np.where((k == 0) | (2 * k == n), 1.0, 2.0)
        g = g * c[:, None]
    return torch.from_numpy(g).to(device=device, dtype=_complex(dtype))
