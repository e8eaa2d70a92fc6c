"""Collective assertions for multi-rank tests: every rank reaches the same verdict.

A plain ``assert`` failing on one rank leaves the others waiting in the next collective.
These helpers first agree on pass/fail over the communicator, then raise
:class:`CollectiveAssertionError` on every rank (with the first failing rank's message),
so a test fails cleanly everywhere. Any other exception escaping a multi-rank test
should abort the job (see ``tests/conftest.py``).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from ._util.backend import backend_name, to_numpy
from .comm import raise_if_any

__all__ = ["CollectiveAssertionError", "assert_all", "assert_allclose", "assert_equal", "grid_shapes", "as_numpy"]


class CollectiveAssertionError(AssertionError):
    """Raised on every rank when a collective assertion failed on at least one rank."""


def assert_all(comm: Any, ok: bool, message: str = "") -> None:
    """Collective over ``comm``. Raise on every rank unless ``ok`` holds on every rank.

    Parameters
    ----------
    comm : mpi4py communicator or ProcessGrid
    ok : bool
        This rank's verdict.
    message : str
        Explanation used when this rank failed.

    Raises
    ------
    CollectiveAssertionError
        On every rank, naming the lowest failing rank and its message.
    """
    comm = getattr(comm, "comm", comm)
    try:
        raise_if_any(comm, None if ok else AssertionError(f"rank {comm.Get_rank()}: {message}"[:2000]))
    except AssertionError as e:
        raise CollectiveAssertionError(str(e)) from None


def as_numpy(x: Any) -> np.ndarray:
    """Local. A numpy copy/view of an array of any backend, or of a scalar."""
    try:
        backend_name(x)
    except TypeError:
        return np.asarray(x)
    return np.asarray(to_numpy(x))


def assert_allclose(
    comm: Any, actual: Any, desired: Any, rtol: float = 1e-12, atol: float = 0.0, what: str = ""
) -> None:
    """Collective over ``comm``. ``numpy.testing.assert_allclose`` agreed on by every rank.

    ``actual``/``desired`` may be numpy, torch or cupy arrays or scalars (compared on the host).
    """
    ok, msg = True, ""
    try:
        np.testing.assert_allclose(as_numpy(actual), as_numpy(desired), rtol=rtol, atol=atol)
    except AssertionError as e:
        ok, msg = False, f"{what}\n{e}"
    assert_all(comm, ok, msg)


def assert_equal(comm: Any, actual: Any, desired: Any, what: str = "") -> None:
    """Collective over ``comm``. Exact equality (shapes and values), agreed on by every rank."""
    ok, msg = True, ""
    try:
        np.testing.assert_array_equal(as_numpy(actual), as_numpy(desired), strict=True)
    except AssertionError as e:
        ok, msg = False, f"{what}\n{e}"
    assert_all(comm, ok, msg)


def grid_shapes(size: int, ndim: int) -> list[tuple[int, ...]]:
    """Local. Every grid shape with ``ndim`` axes and ``size`` ranks (e.g. 4, 2 -> 1x4, 2x2, 4x1)."""
    out = []
    for dims in itertools.product(range(1, size + 1), repeat=ndim):
        if math.prod(dims) == size:
            out.append(dims)
    return out
