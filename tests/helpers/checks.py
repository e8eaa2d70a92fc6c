"""Many comparisons, one collective verdict: ``Checks`` records each rank's failed comparisons locally and
asserts once, collectively (``hpctp.testing.assert_all``), when its ``with`` block ends.

A test that loops over hundreds of cases (splits x dtypes x axes x functions) pays one all-reduce per
``assert_allclose``; with 4 or 6 ranks on 2 cores each one costs a scheduling round of every rank, which
made such tests most of their leg's time. The comparisons are the same (``numpy.testing``); only the
all-reduce moves to the end, where the first failures of the lowest failing rank are reported."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import numpy as np

from hpctp.testing import as_numpy, assert_all


class Checks:
    """Local comparisons of one rank; ``with Checks(grid) as check:`` asserts them collectively at its end."""

    def __init__(self, comm: Any, shown: int = 3) -> None:
        self.comm = comm
        self.shown = shown
        self.count = 0
        self.wrong: list[str] = []

    def true(self, ok: bool, message: str = "") -> None:
        """This rank's verdict ``ok`` (as ``assert_all``)."""
        self.count += 1
        if not ok:
            self.wrong.append(message)

    def allclose(self, actual: Any, desired: Any, rtol: float = 1e-12, atol: float = 0.0, what: str = "") -> None:
        """``numpy.testing.assert_allclose`` on this rank (as ``hpctp.testing.assert_allclose``)."""
        self.count += 1
        try:
            np.testing.assert_allclose(as_numpy(actual), as_numpy(desired), rtol=rtol, atol=atol)
        except AssertionError as e:
            self.wrong.append(f"{what}\n{e}")

    def equal(self, actual: Any, desired: Any, what: str = "") -> None:
        """Exact equality of shapes and values on this rank (as ``hpctp.testing.assert_equal``)."""
        self.count += 1
        try:
            np.testing.assert_array_equal(as_numpy(actual), as_numpy(desired), strict=True)
        except AssertionError as e:
            self.wrong.append(f"{what}\n{e}")

    def verdict(self) -> None:
        """Collective. Raise on every rank if any comparison failed on any rank."""
        shown = "\n".join(self.wrong[: self.shown])
        assert_all(
            self.comm, not self.wrong, f"{len(self.wrong)} of {self.count} comparisons failed; the first:\n{shown}"
        )
        self.wrong.clear()

    def __enter__(self) -> Checks:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.verdict()
