"""The gradient of a distributed ``max``/``min``: torch's ``amax``/``amin`` rule, across ranks.

The value is reduced without autograd (``hpctp.ops.reduce``). Its gradient flows to every element
that equals it, shared evenly among them, as ``torch.amax`` shares it among ties; the ties are
counted over the whole tensor (one all-reduce of the counts), so an element's share does not
depend on how the tensor is cut. As for :func:`~hpctp.nn.autograd_comm.allreduce_sum`, each rank
receives the gradient of the replicated result (a global loss on which every rank calls
``backward()``) and keeps only its own elements' shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["extreme"]


class _Extreme(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, block: torch.Tensor, value: torch.Tensor, hit: torch.Tensor, count: torch.Tensor) -> Any:
        ctx.save_for_backward(hit, count)
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        hit, count = ctx.saved_tensors
        share = grad / count.clamp(min=1).to(grad.dtype)  # (a reduced extent with no element: no share)
        return hit.to(grad.dtype) * share, None, None, None


def extreme(
    block: torch.Tensor, value: torch.Tensor, axes: tuple[int, ...], sum_over_ranks: Callable[[torch.Tensor], None]
) -> torch.Tensor:
    """Collective where ``sum_over_ranks`` communicates. ``value`` (the reduced max/min of the
    distributed tensor, with kept dims, the same on the ranks that share it) as the differentiable
    result of ``block``: backward gives each element equal to it (NaN counting as equal to a NaN)
    its share of the gradient.

    Parameters
    ----------
    block : torch.Tensor
        This rank's block, which requires grad.
    value : torch.Tensor
        The reduction over ``axes`` with kept dims (broadcasts against ``block``).
    axes : tuple of int
        The reduced dims of the block.
    sum_over_ranks : callable
        Sums an int64 tensor in place over the ranks that hold other parts of the reduced dims.

    Returns
    -------
    torch.Tensor
        ``value``, recorded by autograd.
    """
    x = block.detach()
    hit = (x == value) | (torch.isnan(x) & torch.isnan(value))
    count = hit.to(torch.int64).sum(dim=axes, keepdim=True) if axes else hit.to(torch.int64)
    count = count.contiguous()
    sum_over_ranks(count)
    return _Extreme.apply(block, value, hit, count)  # type: ignore[no-any-return]
