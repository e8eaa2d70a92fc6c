"""Entering and leaving a tensor-parallel region, with or without sequence parallelism.

A tensor-parallel region (Megatron's column-parallel then row-parallel pair, or attention
split over heads) runs on activations that every rank of one grid axis holds whole, and
ends with partial sums that the axis must add up. How the activations outside the region
are held decides the pair of autograd collectives at its borders:

==================  ===============================  ===================================
outside the region  entering (forward / backward)     leaving (forward / backward)
==================  ===============================  ===================================
replicated          identity / all-reduce             all-reduce / identity
tokens split        all-gather / reduce-scatter       reduce-scatter / all-gather
==================  ===============================  ===================================

With the tokens split over the axis (sequence parallelism), the norms, dropout and
residual additions outside the region hold ``1/P`` of the activations; the all-gather
and the reduce-scatter together move the bytes of one bandwidth-optimal all-reduce
(``2 (P - 1) / P`` of the tensor per rank). Token counts may be uneven (any cuts, some
ranks may hold none); :func:`token_cuts` agrees on them, and on the call's other
arguments, in one small ``Allgather`` per call.

The layers agree on their arguments once per input signature
(:class:`hpctp.nn.transformer.agreement.ArgumentAgreement`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from ... import comm as C
from ...comm.agree import digest
from .agreement import ArgumentAgreement  # noqa: F401  (its home before agreement.py: still importable here)

__all__ = [
    "CopyToAxis",
    "SumOverAxis",
    "GatherTokens",
    "ScatterTokens",
    "enter_parallel_region",
    "leave_parallel_region",
    "token_cuts",
]

Cuts = tuple[int, ...]
Comm = Any  # an mpi4py communicator (hpctp.comm is the only module that imports MPI)


def token_cuts(
    comm: Comm, counts: Sequence[int], what: str, signature: Hashable, error: Exception | None
) -> list[Cuts]:
    """Collective over ``comm``. The cuts of tokens split over the ranks, and agreement on the rest.

    One ``Allgather`` of ``2 + len(counts)`` int64 per rank: this rank's error flag, its
    token counts (one per split tensor, e.g. query and key), and a digest of ``signature``
    (what must be equal on every rank: batch, features, dtypes, mask shapes).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The ranks along the axis that splits the tokens.
    counts : sequence of int
        This rank's number of tokens of each split tensor (0 when ``error`` is set).
    what : str
        The layer, for messages.
    signature : hashable
    error : Exception or None
        This rank's local validation result.

    Returns
    -------
    list of tuple of int
        Per tensor, the cuts ``(0, n_0, n_0 + n_1, ..., total)`` in rank order.

    Raises
    ------
    Exception
        The lowest failing rank's error, on every rank.
    ValueError
        If the signatures differ between ranks (on every rank).
    """
    row = [0 if error is None else 1] + [int(n) for n in counts] + [digest(signature)]
    table = C.allgather_ints(comm, row)
    if table[:, 0].any():
        C.raise_if_any(comm, error)
    if (table[:, -1] != table[0, -1]).any():
        ranks = [r for r in range(table.shape[0]) if table[r, -1] != table[0, -1]]
        raise ValueError(
            f"{what}: ranks {ranks} passed inputs whose batch, features, dtype or masks differ from rank 0's "
            f"(this rank: {signature!r}); the ranks of a sequence-parallel axis split only the tokens"
        )
    return [tuple(int(v) for v in np.concatenate([[0], np.cumsum(table[:, 1 + i])])) for i in range(len(counts))]


# ---------------------------------------------------------------------------- replicated borders
class CopyToAxis(torch.autograd.Function):
    """Collective over the axis (backward). Forward identity, backward sum over the axis.

    The input is used by every rank of the axis, so its gradient is the sum of theirs.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:  # type: ignore[override]
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return C.allreduce(ctx.comm, dy.contiguous().clone()), None


class SumOverAxis(torch.autograd.Function):
    """Collective over the axis. Forward sum over the axis (partial products), backward identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:  # type: ignore[override]
        return C.allreduce(comm, x.contiguous().clone())

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return dy, None


# ---------------------------------------------------------------------------- token-split borders
def _tokens_first(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.detach().movedim(dim, 0).contiguous()


def _all_gather(x: torch.Tensor, comm: Comm, cuts: Cuts, dim: int) -> torch.Tensor:
    """The whole tensor from every rank's token block along ``dim`` (cuts in rank order)."""
    xt = _tokens_first(x, dim)
    row = int(np.prod(xt.shape[1:]))
    counts = [(cuts[r + 1] - cuts[r]) * row for r in range(len(cuts) - 1)]
    out = torch.empty((cuts[-1],) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    C.allgatherv(comm, xt.reshape(-1), out.reshape(-1), counts)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, comm: Comm, cuts: Cuts, dim: int) -> torch.Tensor:
    """This rank's token block of the sum over the ranks of ``x`` (whole along ``dim`` on every rank).

    One ``Alltoallv``: block ``r`` of every rank goes to rank ``r``, which adds them up.
    """
    xt = _tokens_first(x, dim)
    row = int(np.prod(xt.shape[1:]))
    rank, size = comm.Get_rank(), comm.Get_size()
    own = cuts[rank + 1] - cuts[rank]
    send = [(cuts[r + 1] - cuts[r]) * row for r in range(size)]
    recv = torch.empty((size, own) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    C.alltoallv(comm, xt.reshape(-1), send, recv.reshape(-1), [own * row] * size)
    return recv.sum(0).movedim(0, dim)


class GatherTokens(torch.autograd.Function):
    """Collective over the axis. Forward all-gather of the token blocks, backward reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, cuts: Cuts, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.meta = (comm, cuts, dim)
        return _all_gather(x, comm, cuts, dim)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        comm, cuts, dim = ctx.meta
        return _reduce_scatter(dy, comm, cuts, dim), None, None, None


class ScatterTokens(torch.autograd.Function):
    """Collective over the axis. Forward reduce-scatter of partial sums into token blocks, backward all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, cuts: Cuts, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.meta = (comm, cuts, dim)
        return _reduce_scatter(x, comm, cuts, dim)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        comm, cuts, dim = ctx.meta
        return _all_gather(dy, comm, cuts, dim), None, None, None


def enter_parallel_region(x: torch.Tensor, comm: Comm, cuts: Cuts | None = None, dim: int = 1) -> torch.Tensor:
    """Collective over ``comm``. The whole activations every rank of the axis computes the region from.

    Parameters
    ----------
    x : torch.Tensor
        Replicated along the axis (``cuts`` None), or this rank's block of the tokens along ``dim``.
    comm : mpi4py.MPI.Intracomm
        The ranks of the tensor-parallel axis.
    cuts : tuple of int, optional
        Token cuts over the ranks (sequence parallelism), see :func:`token_cuts`.
    dim : int
        The token dim.

    Returns
    -------
    torch.Tensor
        ``x`` itself (its gradient summed over the axis in backward) or the all-gathered
        tokens (backward: reduce-scatter).
    """
    if cuts is None:
        return CopyToAxis.apply(x, comm)
    return GatherTokens.apply(x, comm, tuple(cuts), dim % x.ndim)


def leave_parallel_region(x: torch.Tensor, comm: Comm, cuts: Cuts | None = None, dim: int = 1) -> torch.Tensor:
    """Collective over ``comm``. The sum over the axis of the region's partial results.

    Parameters
    ----------
    x : torch.Tensor
        This rank's partial result, whole along ``dim``.
    comm : mpi4py.MPI.Intracomm
    cuts : tuple of int, optional
        Token cuts (sequence parallelism): each rank keeps its block of the sum.
    dim : int
        The token dim.

    Returns
    -------
    torch.Tensor
        The all-reduced sum (backward: identity), or this rank's token block of it
        (reduce-scatter; backward: all-gather).
    """
    if cuts is None:
        return SumOverAxis.apply(x, comm)
    return ScatterTokens.apply(x, comm, tuple(cuts), dim % x.ndim)
