"""Shell-binned power spectra of distributed fields: the energy spectrum E(k) of a simulation.

:func:`radial_spectrum` transforms the field with :func:`hpctp.fft.rfftn` (left in the
transposed layout the plan ends in), bins each rank's modes by the length of their integer
wavevector with the blocks' own ``bincount``, and sums the bins over the grid: the spectrum
(a few hundred numbers per field) is all that travels besides the FFT's own moves.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import comm as C
from .._util.backend import array_module, backend_name, dtype_kind, from_numpy, to_numpy
from .._util.dtypes import dtype_name
from ..tensor.core import DistTensor
from .freqs import hermitian_weights, wavenumbers
from .plan import normalize_fft_axes
from .transform import fftn, rfftn

__all__ = ["radial_spectrum"]


def _bincount(idx: Any, weights: Any, length: int) -> np.ndarray:
    """Sum of ``weights`` per index (the block's backend), as a float64 numpy array."""
    if backend_name(weights) == "torch":
        import torch

        return torch.bincount(idx, weights=weights, minlength=length).cpu().numpy()
    return to_numpy(array_module(weights).bincount(idx, weights=weights, minlength=length))


def _power(block: Any) -> Any:
    """``|block|^2`` in float64 (the block's backend)."""
    if backend_name(block) == "torch":
        import torch

        return block.detach().abs().to(torch.float64).square()
    xp = array_module(block)
    return xp.square(xp.abs(block).astype(xp.float64))


def radial_spectrum(x: DistTensor, axes: object = None) -> np.ndarray:
    """Collective over grid. Power spectrum of ``x`` over ``axes``, summed over shells of ``|k|``.

    Shell ``s`` holds the modes whose integer wavevector has ``round(|k|) == s``;
    ``E[..., s] = sum |X_k|^2 / N^2`` over them (``X`` the unnormalised FFT, ``N`` the number
    of points transformed), so ``E.sum(-1)`` is the mean of ``|x|^2`` over ``axes`` (Parseval).
    The other dims (batch, channels) are kept: one spectrum each. Real fields are transformed
    with ``rfftn`` (the half spectrum counts each conjugate pair twice), complex ones with
    ``fftn``; 16-bit floats in float32, integers in float64. The field may have any layout (see :func:`fftn`).

    Parameters
    ----------
    x : DistTensor
        Real or complex field (numpy, torch or cupy blocks).
    axes : int or sequence of int, optional
        The spatial dims (default: all).

    Returns
    -------
    numpy.ndarray
        float64, shape ``(*other_dims, S)`` with ``S = round(sqrt(sum (n_a // 2)^2)) + 1``
        for the transformed lengths ``n_a``; the same on every rank.

    Raises
    ------
    ValueError, TypeError
        As :func:`fftn`, on every rank.
    """
    kind = dtype_kind(x.local) if isinstance(x, DistTensor) else "?"  # (rfftn raises on a non-DistTensor)
    if kind in "biu":
        x = x.astype("float64")
    elif kind == "f" and dtype_name(x.local.dtype) in ("float16", "bfloat16"):
        x = x.astype("float32")  # no FFT library takes every 16-bit length
    real = kind != "c"
    y = (rfftn if real else fftn)(x, axes, out_split="any")  # validates and agrees on every rank
    ax = normalize_fft_axes(axes, x.ndim)
    shape = x.global_shape
    other = [d for d in range(x.ndim) if d not in ax]
    shells = int(round(math.sqrt(sum((shape[a] // 2) ** 2 for a in ax)))) + 1
    slices = y.layout.local_slices(y.grid.coords)
    # per-dim factors shaped to broadcast against the block; full-sized only in ``idx``
    k2: Any = 0.0
    weight: Any = 1.0 / float(math.prod(shape[a] for a in ax)) ** 2  # Parseval: |X|^2 / N^2
    row: Any = 0
    stride = 1
    for d in reversed(range(x.ndim)):
        view = [1] * x.ndim
        view[d] = -1
        if d in ax:
            half = real and d == ax[-1]
            k2 = k2 + (wavenumbers(shape[d], half)[slices[d]].astype(np.float64) ** 2).reshape(view)
            if half:
                weight = weight * hermitian_weights(shape[d])[slices[d]].reshape(view)
        else:  # the row of the output this index belongs to (global, row-major over the other dims)
            row = row + (np.arange(shape[d])[slices[d]] * stride).reshape(view)
            stride *= shape[d]
    local = tuple(int(s) for s in y.local.shape)
    idx = np.broadcast_to(row * shells + np.rint(np.sqrt(k2)).astype(np.int64), local).flatten()  # (a writable copy)
    power = (_power(y.local) * from_numpy(np.asarray(weight, dtype=np.float64), y.local)).reshape(-1)
    out = np.zeros(stride * shells)
    meta = getattr(y.local, "is_meta", False)  # (meta blocks, a virtual grid's dry run: no values to bin)
    if y.layout.is_primary(y.grid.coords) and idx.size and not meta:  # (each mode counted once: no replica adds)
        out += _bincount(from_numpy(idx, y.local), power, stride * shells)
    C.allreduce(x.grid.comm, out, "sum")
    return out.reshape(tuple(shape[d] for d in other) + (shells,))
