"""Error in the field's gradient: how sharply a surrogate reproduces fronts (spot and stripe edges).

A surrogate can have a small L2 error and still blur the edges of Gray-Scott patterns, where
the field changes fastest. :func:`gradient_error` compares the gradients of prediction and
truth, as periodic central differences written with ``np.roll`` on the distributed fields
(each roll moves one row or column between neighbouring blocks; nothing is gathered).
"""

from __future__ import annotations

import math

import numpy as np

import hpctp

__all__ = ["gradient_error"]


def _central(f: hpctp.DistTensor, axis: int) -> hpctp.DistTensor:
    """Periodic central difference of ``f`` along ``axis`` (unit spacing)."""
    return (np.roll(f, -1, axis) - np.roll(f, 1, axis)) / 2.0


def gradient_error(pred: hpctp.DistTensor, truth: hpctp.DistTensor) -> float:
    """Collective over grid. ``||grad(pred - truth)|| / ||grad truth||`` over the spatial dims.

    Parameters
    ----------
    pred, truth : DistTensor
        ``[N, C, H, W]`` periodic fields of one layout (any backend; H and W may be divided).

    Returns
    -------
    float
        The relative L2 error of the gradient (both components, every sample and channel);
        the same on every rank.
    """
    err = (pred - truth).astype("float64")
    ref = truth.astype("float64")
    num = sum(float((g * g).sum()) for g in (_central(err, 2), _central(err, 3)))
    den = sum(float((g * g).sum()) for g in (_central(ref, 2), _central(ref, 3)))
    return math.sqrt(num / den)
