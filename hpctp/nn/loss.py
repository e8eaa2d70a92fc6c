"""Losses and reductions over a whole partitioned field, identical on every rank.

Each takes this rank's blocks, or DistTensors (a layer's output), whose own blocks are then used.

Each function sums local contributions, packs them (with element counts and an error
flag) into one small float64 buffer and all-reduces it once with
:class:`~hpctp.ops.autograd.AllReduceSum` (identity backward). Every rank gets the
same value and, after ``backward()``, the exact gradient of its own block. Bad input on
any rank (e.g. mismatched shapes) raises ``ValueError`` on every rank after that single
all-reduce, so no rank is left waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import comm as C
from .._util.backend import shape_only
from ..comm import ProcessGrid
from ..ops.autograd import AllReduceSum, check_grid, comms_for_axes
from ..tensor.core import DistTensor

__all__ = ["global_sum", "global_mean", "global_mse_loss", "global_l1_loss", "relative_l2_error"]

_REDUCTIONS = ("mean", "sum")


def _type_error(**args: object) -> TypeError | None:
    """A TypeError for the first argument that is not a tensor (flagged in the all-reduce, not raised)."""
    for name, x in args.items():
        if isinstance(x, DistTensor) and not isinstance(x.local, torch.Tensor):
            return TypeError(
                f"{name} must be a torch.Tensor or a DistTensor of torch blocks, got a DistTensor of "
                f"{type(x.local).__name__} blocks (use .to('torch'))"
            )
        if not isinstance(x, (torch.Tensor, DistTensor)):
            return TypeError(f"{name} must be a torch.Tensor or a DistTensor, got {type(x).__name__}")
    return None


def _blocks(
    grid: ProcessGrid, axes: Sequence[int] | None, **args: object
) -> tuple[list[Any], Sequence[int] | None, Exception | None]:
    """The arguments' torch blocks (a DistTensor's own block), the grid axes to sum over, and the first problem
    (flagged in the all-reduce).

    Two DistTensors must have the same layout, so that their blocks hold the same elements. Without ``axes``, a
    DistTensor on ``grid`` itself is summed over the axes that divide it: the ranks along the others hold copies
    of its block, which summing over every axis would count once per copy (a DistTensor replicated on every axis
    is summed on each rank alone: its copies, and so their errors, are the same everywhere)."""
    err: Exception | None = _type_error(**args)
    dist = [(name, x) for name, x in args.items() if isinstance(x, DistTensor)]
    if err is None and len(dist) == 2 and dist[0][1].layout != dist[1][1].layout:
        (a, x), (b, y) = dist
        err = ValueError(
            f"{a} and {b} are DistTensors of different layouts ({x.layout} and {y.layout}); "
            f"call {b}.redistribute({a}.layout) first"
        )
    if axes is None and dist:  # (whatever err is: every rank must take the same communicators)
        x = dist[0][1]
        if x.grid is grid or (x.grid.dims == grid.dims and x.grid.same_ranks(grid)):
            axes = sorted({a for a in x.layout.split if a is not None})
    return [x.local if isinstance(x, DistTensor) else x for x in args.values()], axes, err


def _device(*xs: object) -> torch.device:
    return next((x.device for x in xs if isinstance(x, torch.Tensor)), torch.device("cpu"))


def _reduce(
    terms: Callable[[], list[torch.Tensor]],
    nterms: int,
    local_error: str | Exception | None,
    grid: ProcessGrid,
    axes: Sequence[int] | None,
    device: torch.device,
) -> torch.Tensor:
    """All-reduce ``[*terms(), error_flag]`` in float64; raise everywhere if any rank flagged.

    ``nterms`` must be the same on every rank (it sizes the message)."""
    comms = comms_for_axes(grid, axes)
    if local_error is None:
        vals = [t.reshape(-1).to(torch.float64) for t in terms()]
        flag = torch.zeros(1, dtype=torch.float64, device=device)
    else:
        vals = [torch.zeros(nterms, dtype=torch.float64, device=device)]
        flag = torch.ones(1, dtype=torch.float64, device=device)
    total = AllReduceSum.apply(torch.cat(vals + [flag]), comms)
    if shape_only(total):  # (a virtual grid's dry run: every rank flags as this one does)
        bad = int(local_error is not None)
    else:
        bad = int(total[-1].item())
    if bad:
        if isinstance(local_error, Exception):
            raise local_error
        if local_error is not None:
            raise ValueError(local_error)
        raise ValueError(f"invalid input on {bad} other rank(s) of the grid (see their error)")
    return total[:-1]


def _opmath(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when it is float16/bfloat16 (torch's accumulation type), else ``x``: the
    terms are computed and summed before any rounding to 16 bits (gradients flow back cast)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _pair_error(pred: torch.Tensor, target: torch.Tensor) -> str | None:
    if pred.shape != target.shape:
        return f"pred block has shape {tuple(pred.shape)} but target block has shape {tuple(target.shape)}"
    return None


def _count(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([float(x.numel())], dtype=torch.float64, device=x.device)


def global_sum(
    x_local: torch.Tensor | DistTensor, grid: ProcessGrid, axes: Sequence[int] | None = None
) -> torch.Tensor:
    """Collective over grid. Sum of all elements of the global tensor (0-d, same on every rank).

    Parameters
    ----------
    x_local : torch.Tensor or DistTensor
        This rank's block, or a DistTensor (its block).
    grid : ProcessGrid
    axes : sequence of int, optional
        Grid axes along which the blocks differ (default: all); ranks along other axes
        hold replicas and are counted once.

    Returns
    -------
    torch.Tensor
        0-d tensor of the dtype of ``torch.sum`` (int64 for bool and integer blocks; the
        sum is exact up to 2**53); differentiable (gradient of ones on every block).

    Raises
    ------
    TypeError
        If ``x_local`` is not a tensor on any rank (raised on every rank) or ``grid`` not a
        ProcessGrid.
    """
    check_grid(grid)
    (x,), axes, err = _blocks(grid, axes, x_local=x_local)
    total = _reduce(lambda: [_opmath(x).sum()], 1, err, grid, axes, _device(x))[0]
    return total.to(x.dtype if x.is_floating_point() or x.is_complex() else torch.int64)


def global_mean(
    x_local: torch.Tensor | DistTensor, grid: ProcessGrid, axes: Sequence[int] | None = None
) -> torch.Tensor:
    """Collective over grid. Mean of all elements of the global tensor (0-d, same on every rank).

    Parameters
    ----------
    x_local : torch.Tensor or DistTensor
    grid : ProcessGrid
    axes : sequence of int, optional
        See :func:`global_sum`.

    Returns
    -------
    torch.Tensor
        0-d tensor of ``x_local.dtype``, float64 for bool and integer blocks (torch refuses
        them; this is ``DistTensor.mean``'s rule); NaN for an empty global tensor, as torch.

    Raises
    ------
    TypeError
        If ``x_local`` is not a tensor on any rank (raised on every rank).
    """
    check_grid(grid)
    (x,), axes, err = _blocks(grid, axes, x_local=x_local)
    s, n = _reduce(lambda: [_opmath(x).sum(), _count(x)], 2, err, grid, axes, _device(x))
    return (s / n).to(x.dtype if x.is_floating_point() or x.is_complex() else torch.float64)


def _pointwise_loss(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    pred: torch.Tensor | DistTensor,
    target: torch.Tensor | DistTensor,
    grid: ProcessGrid,
    axes: Sequence[int] | None,
    reduction: str,
) -> torch.Tensor:
    check_grid(grid)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    (p, t), axes, error = _blocks(grid, axes, pred_local=pred, target_local=target)
    err = error or _pair_error(p, t)
    s, n = _reduce(lambda: [fn(_opmath(p), _opmath(t)).sum(), _count(p)], 2, err, grid, axes, _device(p, t))
    out = s / n if reduction == "mean" else s
    return out.to(torch.promote_types(p.dtype, t.dtype))


def global_mse_loss(
    pred_local: torch.Tensor | DistTensor,
    target_local: torch.Tensor | DistTensor,
    grid: ProcessGrid,
    axes: Sequence[int] | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Collective over grid. ``torch.nn.functional.mse_loss`` of the global tensors.

    Parameters
    ----------
    pred_local, target_local : torch.Tensor or DistTensor
        This rank's blocks (same shape), or DistTensors (a layer's output; two of them of the same layout),
        whose blocks are used.
    grid : ProcessGrid
    axes : sequence of int, optional
        Grid axes along which the blocks differ (default: all).
    reduction : {"mean", "sum"}

    Returns
    -------
    torch.Tensor
        0-d loss, the same on every rank; its gradient w.r.t. ``pred_local`` is the
        single-process gradient restricted to this block.

    Raises
    ------
    ValueError
        If the blocks' shapes or two DistTensors' layouts differ on any rank (raised on every rank), or on
        a bad ``reduction``.
    TypeError
        If an input is not a tensor or a DistTensor of torch blocks.
    """
    return _pointwise_loss(lambda p, t: (p - t) ** 2, pred_local, target_local, grid, axes, reduction)


def global_l1_loss(
    pred_local: torch.Tensor | DistTensor,
    target_local: torch.Tensor | DistTensor,
    grid: ProcessGrid,
    axes: Sequence[int] | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Collective over grid. ``torch.nn.functional.l1_loss`` of the global tensors.

    Parameters
    ----------
    pred_local, target_local : torch.Tensor or DistTensor
        This rank's blocks (same shape), or DistTensors (a layer's output; two of them of the same layout),
        whose blocks are used.
    grid : ProcessGrid
    axes : sequence of int, optional
        Grid axes along which the blocks differ (default: all).
    reduction : {"mean", "sum"}

    Returns
    -------
    torch.Tensor
        0-d loss, the same on every rank.

    Raises
    ------
    ValueError
        If the blocks' shapes differ on any rank (raised on every rank).
    """
    return _pointwise_loss(lambda p, t: (p - t).abs(), pred_local, target_local, grid, axes, reduction)


def relative_l2_error(
    pred: torch.Tensor | DistTensor,
    target: torch.Tensor | DistTensor,
    grid: ProcessGrid,
    axes: Sequence[int] | None = None,
    per_sample: bool = False,
) -> torch.Tensor:
    """Collective over grid. Relative L2 error ``||pred - target|| / ||target||`` of the global field.

    Parameters
    ----------
    pred, target : torch.Tensor or DistTensor
        This rank's blocks ``[N, ...]`` (same shape), or DistTensors (two of the same layout), whose blocks are
        used.
    grid : ProcessGrid
    axes : sequence of int, optional
        Grid axes along which the blocks differ (default: all).
    per_sample : bool
        False: one ratio of norms over the whole tensor. True: the ratio per sample
        (dim 0, not split) averaged over the batch (the usual neural-operator metric).

    Returns
    -------
    torch.Tensor
        0-d, the same on every rank; differentiable.

    Raises
    ------
    ValueError
        If the blocks' shapes differ on any rank (raised on every rank).
    """
    check_grid(grid)
    (pb, tb), axes, error = _blocks(grid, axes, pred=pred, target=target)
    err = error or _pair_error(pb, tb)
    dev = _device(pb, tb)
    if per_sample:
        if err is None and pb.dim() == 0:
            err = "per_sample=True needs blocks with a batch dim"
        n = pb.shape[0] if err is None else -1
        sizes = sorted(set(C.allgather_ints(grid.comm, [n])[:, 0].tolist()))  # n sizes the message
        if -1 not in sizes and len(sizes) > 1:
            raise ValueError(f"per_sample=True needs the same batch size on every rank, got {sizes}")
        n = max(sizes[-1], 0)

        def terms() -> list[torch.Tensor]:
            p, t = _opmath(pb), _opmath(tb)
            dims = tuple(range(1, p.dim()))
            d = ((p - t) ** 2).sum(dims) if dims else (p - t) ** 2
            return [d, (t**2).sum(dims) if dims else t**2]

        s = _reduce(terms, 2 * n, err, grid, axes, dev)
        out = (torch.sqrt(s[:n]) / torch.sqrt(s[n:])).mean()
    else:

        def whole() -> list[torch.Tensor]:
            p, t = _opmath(pb), _opmath(tb)
            return [((p - t) ** 2).sum(), (t**2).sum()]

        s = _reduce(whole, 2, err, grid, axes, dev)
        out = torch.sqrt(s[0]) / torch.sqrt(s[1])
    return out.to(torch.promote_types(pb.dtype, tb.dtype))
