"""Random distributed tensors that do not depend on the grid or the number of ranks.

Every element is a pure function of ``(seed, global flat index)`` (a counter-based
generator built on the SplitMix64 finalizer), so ``normal(shape, grid, split, seed)``
gathers to the same global tensor on 1 rank or 1000, in any layout. Local: no
communication.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._util.backend import astype, from_numpy
from .._util.ints import is_int
from ..comm import ProcessGrid
from ..layout import Layout
from .core import DistTensor

__all__ = ["normal", "uniform", "block_uniform", "block_normal"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _check_seed(seed: object) -> int:
    if not is_int(seed) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    return int(seed)


def _flat_index(global_shape: Sequence[int], ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """Global row-major flat indices of the box ``ranges`` (uint64, box-shaped)."""
    idx = np.zeros((1,) * len(ranges), dtype=np.uint64)
    stride = 1
    for d in reversed(range(len(ranges))):
        lo, hi = ranges[d]
        shape = [1] * len(ranges)
        shape[d] = hi - lo
        idx = idx + (np.arange(lo, hi, dtype=np.uint64) * np.uint64(stride)).reshape(shape)
        stride *= int(global_shape[d])
    return np.broadcast_to(idx, tuple(hi - lo for lo, hi in ranges))


def _uniform01(seed: int, stream: int, flat: np.ndarray) -> np.ndarray:
    key = _mix(np.array([seed], dtype=np.uint64) * _GOLDEN + np.uint64(stream))
    with np.errstate(over="ignore"):
        bits = _mix(key + (flat + np.uint64(1)) * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def block_uniform(
    global_shape: Sequence[int], ranges: Sequence[tuple[int, int]], seed: int, low: float = 0.0, high: float = 1.0
) -> np.ndarray:
    """Local. The box ``ranges`` of the global uniform ``[low, high)`` tensor for ``seed`` (float64)."""
    seed = _check_seed(seed)
    flat = _flat_index(global_shape, ranges)
    u = _uniform01(seed, 0, flat)
    return np.asarray(low + (high - low) * u).reshape(flat.shape)  # 0-d stays 0-d (key has shape (1,))


def block_normal(
    global_shape: Sequence[int], ranges: Sequence[tuple[int, int]], seed: int, mean: float = 0.0, std: float = 1.0
) -> np.ndarray:
    """Local. The box ``ranges`` of the global normal tensor for ``seed`` (float64, Box-Muller)."""
    seed = _check_seed(seed)
    flat = _flat_index(global_shape, ranges)
    u1 = 1.0 - _uniform01(seed, 1, flat)  # (0, 1]
    u2 = _uniform01(seed, 2, flat)
    return np.asarray(mean + std * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)).reshape(flat.shape)


def _make(
    kind: str, shape: Sequence[int], grid: ProcessGrid, split: object, seed: int,
    a: float, b: float, dtype: object, like: object,
) -> DistTensor:  # fmt: skip
    layout = Layout(tuple(shape), grid.dims, split)  # type: ignore[arg-type]
    fn = block_normal if kind == "normal" else block_uniform
    values = fn(layout.global_shape, layout.local_ranges(grid.coords), seed, a, b)
    block = astype(from_numpy(values, like), dtype)
    return DistTensor(block, grid, layout)


def normal(
    shape: Sequence[int],
    grid: ProcessGrid,
    split: object = None,
    seed: int = 0,
    *,
    mean: float = 0.0,
    std: float = 1.0,
    dtype: object = "float64",
    like: object = "numpy",
) -> DistTensor:
    """Local. Normally distributed tensor, identical for a given ``seed`` on any grid.

    Parameters
    ----------
    shape : sequence of int
        Global shape.
    grid : ProcessGrid
    split : split specification
        See :class:`hpctp.layout.Layout`.
    seed : int
        Non-negative seed.
    mean, std : float
    dtype : dtype
        Floating dtype (values are drawn in float64, then cast).
    like : str or array
        Backend of the blocks: ``"numpy"``, ``"torch"``, ``"cuda"``, ``"cupy"`` or an array.

    Returns
    -------
    DistTensor

    Raises
    ------
    ValueError
        On a bad seed, shape or split.
    """
    return _make("normal", shape, grid, split, seed, mean, std, dtype, like)


def uniform(
    shape: Sequence[int],
    grid: ProcessGrid,
    split: object = None,
    seed: int = 0,
    *,
    low: float = 0.0,
    high: float = 1.0,
    dtype: object = "float64",
    like: object = "numpy",
) -> DistTensor:
    """Local. Uniform ``[low, high)`` tensor, identical for a given ``seed`` on any grid.

    Parameters are as for :func:`normal`, with ``low`` and ``high`` instead of ``mean``/``std``.
    """
    return _make("uniform", shape, grid, split, seed, low, high, dtype, like)
