"""Losses and reductions over a whole partitioned field, identical on every rank.

Each function sums local contributions, packs them (with element counts and an error
flag) into one small float64 buffer and all-reduces it once with
:class:`~hpctp.ops.autograd.AllReduceSum` (identity backward). Every rank gets the
same value and, after ``backward()``, the exact gradient of its own block. Bad input on
any rank (e.g. mismatched shapes) raises ``ValueError`` on every rank after that single
all-reduce, so no rank is left waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import comm as C
from ..comm import ProcessGrid
from ..ops.autograd import AllReduceSum, check_grid, comms_for_axes

__all__ = ["global_sum", "global_mean", "global_mse_loss", "global_l1_loss", "relative_l2_error"]

_REDUCTIONS = ("mean", "sum")


def _type_error(**args: object) -> TypeError | None:
    """A TypeError for the first argument that is not a tensor (flagged in the all-reduce, not raised)."""
    for name, x in args.items():
        if not isinstance(x, torch.Tensor):
            return TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return None


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


def global_sum(x_local: torch.Tensor, grid: ProcessGrid, axes: Sequence[int] | None = None) -> torch.Tensor:
    """Collective over grid. Sum of all elements of the global tensor (0-d, same on every rank).

    Parameters
    ----------
    x_local : torch.Tensor
        This rank's block.
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
    x = x_local
    err = _type_error(x_local=x)
    total = _reduce(lambda: [_opmath(x).sum()], 1, err, grid, axes, _device(x))[0]
    return total.to(x.dtype if x.is_floating_point() or x.is_complex() else torch.int64)


def global_mean(x_local: torch.Tensor, grid: ProcessGrid, axes: Sequence[int] | None = None) -> torch.Tensor:
    """Collective over grid. Mean of all elements of the global tensor (0-d, same on every rank).

    Parameters
    ----------
    x_local : torch.Tensor
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
    x = x_local
    err = _type_error(x_local=x)
    s, n = _reduce(lambda: [_opmath(x).sum(), _count(x)], 2, err, grid, axes, _device(x))
    return (s / n).to(x.dtype if x.is_floating_point() or x.is_complex() else torch.float64)


def _pointwise_loss(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    pred: torch.Tensor,
    target: torch.Tensor,
    grid: ProcessGrid,
    axes: Sequence[int] | None,
    reduction: str,
) -> torch.Tensor:
    check_grid(grid)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    err = _type_error(pred_local=pred, target_local=target) or _pair_error(pred, target)
    s, n = _reduce(
        lambda: [fn(_opmath(pred), _opmath(target)).sum(), _count(pred)], 2, err, grid, axes, _device(pred, target)
    )
    out = s / n if reduction == "mean" else s
    return out.to(torch.promote_types(pred.dtype, target.dtype))


def global_mse_loss(
    pred_local: torch.Tensor,
    target_local: torch.Tensor,
    grid: ProcessGrid,
    axes: Sequence[int] | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Collective over grid. ``torch.nn.functional.mse_loss`` of the global tensors.

    Parameters
    ----------
    pred_local, target_local : torch.Tensor
        This rank's blocks (same shape).
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
        If the blocks' shapes differ on any rank (raised on every rank), or on a bad
        ``reduction``.
    TypeError
        If an input is not a tensor.
    """
    return _pointwise_loss(lambda p, t: (p - t) ** 2, pred_local, target_local, grid, axes, reduction)


def global_l1_loss(
    pred_local: torch.Tensor,
    target_local: torch.Tensor,
    grid: ProcessGrid,
    axes: Sequence[int] | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Collective over grid. ``torch.nn.functional.l1_loss`` of the global tensors.

    Parameters
    ----------
    pred_local, target_local : torch.Tensor
        This rank's blocks (same shape).
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
    pred: torch.Tensor,
    target: torch.Tensor,
    grid: ProcessGrid,
    axes: Sequence[int] | None = None,
    per_sample: bool = False,
) -> torch.Tensor:
    """Collective over grid. Relative L2 error ``||pred - target|| / ||target||`` of the global field.

    Parameters
    ----------
    pred, target : torch.Tensor
        This rank's blocks ``[N, ...]`` (same shape).
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
    err = _type_error(pred=pred, target=target) or _pair_error(pred, target)
    dev = _device(pred, target)
    if per_sample:
        if err is None and pred.dim() == 0:
            err = "per_sample=True needs blocks with a batch dim"
        n = pred.shape[0] if err is None else -1
        sizes = sorted(set(C.allgather_ints(grid.comm, [n])[:, 0].tolist()))  # n sizes the message
        if -1 not in sizes and len(sizes) > 1:
            raise ValueError(f"per_sample=True needs the same batch size on every rank, got {sizes}")
        n = max(sizes[-1], 0)

        def terms() -> list[torch.Tensor]:
            p, t = _opmath(pred), _opmath(target)
            dims = tuple(range(1, p.dim()))
            d = ((p - t) ** 2).sum(dims) if dims else (p - t) ** 2
            return [d, (t**2).sum(dims) if dims else t**2]

        s = _reduce(terms, 2 * n, err, grid, axes, dev)
        out = (torch.sqrt(s[:n]) / torch.sqrt(s[n:])).mean()
    else:

        def whole() -> list[torch.Tensor]:
            p, t = _opmath(pred), _opmath(target)
            return [((p - t) ** 2).sum(), (t**2).sum()]

        s = _reduce(whole, 2, err, grid, axes, dev)
        out = torch.sqrt(s[0]) / torch.sqrt(s[1])
    return out.to(torch.promote_types(pred.dtype, target.dtype))
