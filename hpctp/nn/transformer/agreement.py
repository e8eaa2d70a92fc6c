"""Agreeing on a layer's arguments once per input signature, not on every call.

:class:`ArgumentAgreement` caches the ranks' agreement on a layer's arguments per input
signature, so a layer called again with inputs of a shape it has seen sends nothing
before its data.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from ... import comm as C

__all__ = ["ArgumentAgreement"]

Comm = Any  # an mpi4py communicator (hpctp.comm is the only module that imports MPI)


class ArgumentAgreement:
    """Local. Remembers the input signatures the ranks of a communicator agreed on.

    :meth:`check` agrees (one small uncounted ``Allgather``, :func:`hpctp.comm.agree_arguments`)
    the first time a signature is seen, and not again: the ranks of a tensor-parallel axis
    pass inputs of the same signature in the same order, so they hold the same cache and
    all skip, or all enter, the agreement. A signature whose local validation failed is
    never remembered. At most ``limit`` signatures are kept (all forgotten together, on
    every rank alike, when it is reached).
    """

    def __init__(self, limit: int = 64) -> None:
        self._seen: set[Hashable] = set()
        self._limit = int(limit)

    def check(self, comm: Comm, what: str, signature: Hashable, error: Exception | None) -> None:
        """Collective over ``comm`` (the first time ``signature`` is seen). Raise ``error`` of any rank.

        Parameters
        ----------
        comm : mpi4py.MPI.Intracomm
        what : str
            The layer, for messages.
        signature : hashable
            What must be the same on every rank of ``comm`` (shapes, dtypes, flags).
        error : Exception or None
            This rank's local validation result.

        Raises
        ------
        Exception
            The lowest failing rank's error, on every rank.
        ValueError
            If the ranks' signatures differ (on every rank).
        """
        if error is None and signature in self._seen:
            return
        C.agree_arguments(comm, what, error, signature=signature)
        if len(self._seen) >= self._limit:
            self._seen.clear()
        self._seen.add(signature)
