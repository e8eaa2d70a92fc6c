"""``histogram`` of a DistTensor's values (numpy semantics): one all-reduce of the counts.

Every rank bins its own block with ``numpy.histogram`` over the same edges: the global range
(``min``/``max``, numpy's rules for empty and constant data) when none is given. numpy decides
each element's bin on its own, so the summed counts equal numpy's on the gathered tensor
exactly; ``density`` is then computed from the global counts, as numpy computes it. Ranks that
hold replicas (grid axes that divide no dim) count their block once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import comm as C
from ..._util.backend import to_numpy
from ..._util.ints import is_int
from ...ops.reduce import allreduce_over_axes
from ..core import DistTensor, operand_block

__all__ = ["histogram"]


def _check(x: DistTensor, bins: object, range: object, weights: object) -> None:  # noqa: A002
    if isinstance(bins, str):
        raise ValueError(
            f"histogram(bins={bins!r}): numpy's bin estimators need the whole data; give a number of bins or the edges"
        )
    if isinstance(bins, DistTensor):
        raise TypeError("histogram: bins must be an int or a 1-D array of edges (the same on every rank)")
    probe = (0.0, 1.0) if range is None else range
    np.histogram_bin_edges(np.empty(0), bins, probe)  # type: ignore[arg-type]  # (numpy's own checks)
    if weights is not None:
        if not isinstance(weights, DistTensor):
            raise TypeError(
                f"histogram: weights must be a DistTensor of the data's shape, got {type(weights).__name__}"
            )
        if weights.global_shape != x.global_shape:
            raise ValueError(f"weights should have the same shape as a: {weights.global_shape} vs {x.global_shape}")


def histogram(
    x: DistTensor,
    bins: int | Any = 10,
    range: tuple[float, float] | None = None,  # noqa: A002 - numpy's name
    density: bool | None = None,
    weights: DistTensor | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Collective over grid. The histogram of all values of ``x``, as ``numpy.histogram`` (also
    ``np.histogram(x, ...)``), on every rank.

    Parameters
    ----------
    x : DistTensor
        Real. Device blocks are copied to the host to be binned.
    bins : int or 1-D array
        The number of equal bins, or the edges (the same on every rank). numpy's bin
        estimators (``"auto"``, ...) are refused: they need the whole data.
    range : (float, float), optional
        The outer edges; default the global minimum and maximum (one all-reduce each).
    density : bool, optional
        As numpy: the counts divided by their total and the bin widths.
    weights : DistTensor, optional
        Of ``x``'s shape (cut like it or not); the sums of the weights replace the counts.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        The counts (or weight sums, or densities) and the bin edges, equal on every rank.

    Raises
    ------
    TypeError, ValueError
        As numpy for bad ``bins``/``range``/``weights`` (on every rank), and for bin estimators;
        ValueError when ranks pass different arguments or the data's range is not finite.
    """
    if not isinstance(x, DistTensor):
        raise TypeError(f"hpctp.histogram needs a DistTensor, got {type(x).__name__}")
    error: Exception | None = None
    try:
        _check(x, bins, range, weights)
    except (TypeError, ValueError) as e:
        error = e
    C.agree_arguments(
        x.grid.comm, "histogram", error, bins=bins, range=range, density=density, weights=weights is not None
    )
    values = to_numpy(x.local)
    outer: Any = range
    if range is None and is_int(bins):  # (edges given: numpy takes their ends)
        if x.size == 0:
            outer = (0, 1)
        else:  # (numpy scalars of the data's dtype, as numpy's own min/max: the same edges)
            lo, hi = (np.asarray(to_numpy(v.local), dtype=values.dtype)[()] for v in (x.min(), x.max()))
            if not (np.isfinite(lo) and np.isfinite(hi)):
                raise ValueError(f"autodetected range of [{lo}, {hi}] is not finite")
            outer = (lo, hi)
    w = None if weights is None else to_numpy(operand_block(x, weights, "histogram"))
    counts, edges = np.histogram(values, bins, range=outer, weights=w)
    counts = np.ascontiguousarray(counts)
    axes = sorted({g for g in x.split if g is not None and x.grid.dims[g] > 1})
    allreduce_over_axes(x.grid, counts, "sum", axes)
    if density:
        return counts / np.diff(edges) / counts.sum(), edges
    return counts, edges
