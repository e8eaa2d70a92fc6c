"""Frequencies of a distributed spectrum's blocks: spectral derivatives, filters and solvers.

:func:`frequencies` gives each rank the sample frequencies (``numpy.fft.fftfreq`` /
``rfftfreq``) of its own block of a transformed tensor, shaped to broadcast against it on
its backend, so that ``ik``-multiplications, Poisson solves and filters run on the
distributed spectrum without a message. :func:`wavenumbers` and :func:`hermitian_weights`
are the integer per-axis parts that :func:`hpctp.fft.radial_spectrum` bins with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._util.backend import from_numpy
from .._util.ints import is_int
from ..tensor.core import DistTensor
from .plan import normalize_fft_axes

__all__ = ["frequencies", "hermitian_weights", "wavenumbers"]


def wavenumbers(n: int, half: bool = False) -> np.ndarray:
    """Local. ``|k|`` of each index of a length-``n`` FFT axis (``n // 2 + 1`` of them if ``half``,
    the axis an ``rfft`` shortens): ``0, 1, ..., n // 2, ..., 1``."""
    i = np.arange(n // 2 + 1 if half else n)
    return np.minimum(i, n - i) if not half else i


def hermitian_weights(n: int) -> np.ndarray:
    """Local. How many modes of the full spectrum each of the ``n // 2 + 1`` modes of an ``rfft``
    axis stands for: 1 for ``k = 0`` and (``n`` even) the Nyquist mode, 2 for the others (the
    mode and its conjugate)."""
    i = np.arange(n // 2 + 1)
    return np.where((i == 0) | (2 * i == n), 1.0, 2.0)


def frequencies(
    y: DistTensor, axes: object = None, d: float | Sequence[float] = 1.0, n: int | None = None
) -> tuple[Any, ...]:
    """Local. Sample frequencies of this rank's block of the spectrum ``y``, one array per axis.

    Parameters
    ----------
    y : DistTensor
        The output of :func:`hpctp.fft.fftn` (or :func:`~hpctp.fft.rfftn`), any layout.
    axes : int or sequence of int, optional
        Its transformed dims (default: all), as passed to the transform.
    d : float or sequence of float
        Sample spacing (``numpy.fft.fftfreq``'s ``d``), or one per axis (a box of unequal
        sides); multiply the result by ``2 pi`` for angular wavenumbers.
    n : int, optional
        For an ``rfftn`` output: the real-space length of the last of ``axes`` (its
        frequencies are then ``numpy.fft.rfftfreq(n, d)``); None for a full spectrum.

    Returns
    -------
    tuple of arrays
        ``f[i]`` holds ``fftfreq(N, d)`` of axis ``axes[i]`` over this block's index range,
        float64 of ``y``'s backend and device, shaped ``[1, ..., len, ..., 1]`` to broadcast
        against ``y.local``.

    Raises
    ------
    ValueError
        If ``n`` does not fit the last axis (``n // 2 + 1`` must be its length), ``d`` has not
        one spacing per axis, or an axis is out of range.
    TypeError
        If ``y`` is not a DistTensor or ``n`` not an int.
    """
    if not isinstance(y, DistTensor):
        raise TypeError(f"frequencies needs a hpctp.DistTensor spectrum, got {type(y).__name__}")
    ax = normalize_fft_axes(axes, y.ndim)
    if n is not None:
        if not is_int(n):
            raise TypeError(f"n must be an int (the real-space length of axis {ax[-1]}), got {n!r}")
        if int(n) // 2 + 1 != y.global_shape[ax[-1]]:
            raise ValueError(
                f"n={n} does not fit axis {ax[-1]} of length {y.global_shape[ax[-1]]}: an rfft of n points has "
                f"n // 2 + 1 modes (n = {2 * y.global_shape[ax[-1]] - 2} or {2 * y.global_shape[ax[-1]] - 1})"
            )
    spacing = [float(v) for v in d] if isinstance(d, Sequence) else [float(d)] * len(ax)
    if len(spacing) != len(ax):
        raise ValueError(f"d={tuple(spacing)} must be one spacing, or one spacing per axis of {ax}")
    slices = y.layout.local_slices(y.grid.coords)
    out = []
    for a, step in zip(ax, spacing):
        if n is not None and a == ax[-1]:
            f = np.fft.rfftfreq(int(n), step)
        else:
            f = np.fft.fftfreq(y.global_shape[a], step)
        view = [1] * y.ndim
        view[a] = -1
        out.append(from_numpy(np.ascontiguousarray(f[slices[a]].reshape(view)), y.local))
    return tuple(out)
