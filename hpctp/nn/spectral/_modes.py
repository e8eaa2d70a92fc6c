"""The kept spectrum split by modes over the ranks that split the field: each rank mixes only its own modes.

After the forward DFTs every rank holds its block's share of the whole kept spectrum ``[N, C_in, M]``
(``M`` kept modes, flattened row-major). Summing the shares with an all-reduce and mixing every mode on every
rank repeats the mix ``q`` times over the ``q`` ranks; instead a reduce-scatter gives each rank the sums of its
own contiguous run of modes (:func:`mode_cuts`), the rank mixes those with its slice of the weight, and an
all-gather gives every rank the whole output spectrum for its inverse DFTs. The two messages move what one
all-reduce moves; the mix (``N C_in C_out M`` complex products) is divided by ``q``. Backward is the adjoint:
the all-gather's gradient is reduce-scattered, the reduce-scatter's all-gathered, and the weight slice's
gradient all-gathered, so the weight's gradient is whole on every rank.

Complex values travel as pairs of reals (:func:`torch.view_as_real`), modes first so that each rank's run is
contiguous.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from mpi4py import MPI

from ... import comm as C
from ...layout import block_cuts

__all__ = ["mode_cuts", "scatter_modes", "gather_modes", "weight_modes"]

Cuts = tuple[int, ...]


def mode_cuts(modes: int, ranks: int) -> Cuts:
    """Local. Where the run of each of ``ranks`` ranks starts and the last ends, over ``modes`` kept modes
    (:func:`hpctp.layout.block_cuts`: runs differ by at most one mode; ranks past ``modes`` hold none)."""
    return block_cuts(modes, ranks)


def _modes_first(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` (complex, or real with a trailing pair) with ``dim`` moved first, contiguous, as reals."""
    r = torch.view_as_real(x) if x.is_complex() else x
    return r.detach().movedim(dim, 0).contiguous()


def _modes_back(r: torch.Tensor, dim: int, complex_: bool) -> torch.Tensor:
    out = r.movedim(0, dim).contiguous()
    return torch.view_as_complex(out) if complex_ else out


def _counts(x: torch.Tensor, dim: int, cuts: Cuts) -> list[int]:
    """Real elements of each rank's run of ``x``'s modes along ``dim`` (complex values count two)."""
    row = math.prod(n for d, n in enumerate(x.shape) if d != dim) * (2 if x.is_complex() else 1)
    return [(hi - lo) * row for lo, hi in zip(cuts[:-1], cuts[1:])]


def _gather(x: torch.Tensor, comm: MPI.Intracomm, cuts: Cuts, dim: int) -> torch.Tensor:
    """Every rank's run of modes along ``dim``, joined in rank order."""
    r, counts = _modes_first(x, dim), _counts(x, dim, cuts)
    out = torch.empty((cuts[-1], *r.shape[1:]), dtype=r.dtype, device=r.device)
    C.iallgatherv(comm, r.reshape(-1), out.reshape(-1), counts).wait()
    return _modes_back(out, dim, x.is_complex())


def _scatter(x: torch.Tensor, comm: MPI.Intracomm, cuts: Cuts, dim: int) -> torch.Tensor:
    """This rank's run of modes along ``dim`` of the sum over the ranks of ``x`` (whole along ``dim``)."""
    r, counts = _modes_first(x, dim), _counts(x, dim, cuts)
    k = comm.Get_rank()
    out = torch.empty((cuts[k + 1] - cuts[k], *r.shape[1:]), dtype=r.dtype, device=r.device)
    C.ireduce_scatter(comm, r.reshape(-1), out.reshape(-1), counts).wait()
    return _modes_back(out, dim, x.is_complex())


def _own_run(w: torch.Tensor, comm: MPI.Intracomm, cuts: Cuts, dim: int) -> torch.Tensor:
    """This rank's run of modes along ``dim`` of a replicated ``w`` (a view)."""
    k = comm.Get_rank()
    return w.narrow(dim, cuts[k], cuts[k + 1] - cuts[k])


Move = Callable[[torch.Tensor, MPI.Intracomm, Cuts, int], torch.Tensor]


class _Adjoint(torch.autograd.Function):
    """Forward ``move``, backward its adjoint ``back`` (the three moves of this module: reduce-scatter and
    all-gather are each other's adjoint, and the all-gather is a rank's run's)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, comm: MPI.Intracomm, cuts: Cuts, dim: int, move: Move, back: Move
    ) -> torch.Tensor:
        ctx.meta = (comm, cuts, dim, back)
        return move(x, comm, cuts, dim)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        comm, cuts, dim, back = ctx.meta
        return back(dy, comm, cuts, dim), None, None, None, None, None


def scatter_modes(x: torch.Tensor, comm: MPI.Intracomm, cuts: Cuts, dim: int) -> torch.Tensor:
    """Collective over ``comm``. This rank's run ``cuts[k]:cuts[k+1]`` along ``dim`` of the sum of every rank's
    ``x`` (complex, whole along ``dim``); backward: the all-gather of the runs' gradients."""
    return _Adjoint.apply(x, comm, cuts, dim, _scatter, _gather)


def gather_modes(x: torch.Tensor, comm: MPI.Intracomm, cuts: Cuts, dim: int) -> torch.Tensor:
    """Collective over ``comm``. Every rank's run of modes along ``dim`` joined in rank order (complex);
    backward: the reduce-scatter of the whole gradient into each rank's run."""
    return _Adjoint.apply(x, comm, cuts, dim, _gather, _scatter)


def weight_modes(w: torch.Tensor, comm: MPI.Intracomm, cuts: Cuts, dim: int) -> torch.Tensor:
    """Collective over ``comm`` in backward. This rank's run of modes along ``dim`` of the replicated ``w`` (real
    pairs last); backward: the all-gather of the runs' gradients (the whole gradient on every rank)."""
    return _Adjoint.apply(w, comm, cuts, dim, _own_run, _gather)
