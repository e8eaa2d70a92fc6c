"""Autograd functions around fetch plans: forward fetches, backward runs the adjoint."""

from __future__ import annotations

from typing import Any

import torch

from ...halo.plan import FetchPlan
from ...halo.run import AdjointHandle, FetchHandle, adjoint_fetch, adjoint_fetch_parts, begin_adjoint, fetch

__all__ = ["Fetch", "FetchStrips", "GradSink", "Slot"]


class Fetch(torch.autograd.Function):
    """Collective over grid. Fetch ``plan.want`` of ``x``; the backward (also collective) is the adjoint."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: FetchPlan, comm: Any, fill: float) -> torch.Tensor:  # type: ignore[override]
        ctx.plan, ctx.comm = plan, comm
        return fetch(plan, comm, x.detach(), None, fill)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return adjoint_fetch(ctx.plan, ctx.comm, grad), None, None, None


class FetchStrips(torch.autograd.Function):
    """Collective over grid. Finish a started fetch and return copies of boxes of the fetched array.

    Outputs are ``x_fetched[box].clone()`` for each box, then one 0-element tensor that
    callers use to keep this node (and therefore the collective adjoint exchange) in the
    graph when no box is needed on this rank. The fetched array itself is not kept.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        handle: FetchHandle,
        comm: Any,
        boxes: list[tuple[slice, ...]],  # type: ignore[override]
        own: tuple[slice, ...] | None = None,
        slot: Slot | None = None,
    ) -> tuple[torch.Tensor, ...]:
        ctx.plan, ctx.comm, ctx.boxes, ctx.own, ctx.slot = handle.plan, comm, boxes, own, slot
        full = handle.wait()
        handle.out = None  # the fetched array is freed once the boxes are copied
        outs = [full[b].clone() for b in boxes]
        if own is not None:  # the own block was not fetched: zero it in the copies
            for b, o in zip(boxes, outs):
                rel = _overlap(b, own)
                if rel is not None:
                    o[rel] = 0
        return (*outs, x.new_empty((0,)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        parts = list(zip(ctx.boxes, grads[:-1]))
        if not parts:  # nothing fetched was used here; still answer the peers' messages
            parts = [((slice(0, 0),), grads[-1])]
        if ctx.slot is not None:  # GradSink adds the contributions into x's gradient buffer
            ctx.slot.handle = begin_adjoint(ctx.plan, ctx.comm, parts, ctx.own)
            return None, None, None, None, None, None
        return adjoint_fetch_parts(ctx.plan, ctx.comm, parts, None, ctx.own), None, None, None, None, None


class Slot:
    """Local. Hands an :class:`AdjointHandle` from FetchStrips' backward to GradSink's backward."""

    def __init__(self) -> None:
        self.handle: AdjointHandle | None = None
        self.used = True  # False when FetchStrips' outputs feed nothing (no halo needed)


class GradSink(torch.autograd.Function):
    """Collective over grid. Identity in forward; the backward adds the pending adjoint halo
    contributions into the gradient arriving for ``x`` (in place), instead of summing a separate
    zero-initialised block."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slot: Slot) -> torch.Tensor:  # type: ignore[override]
        ctx.slot = slot
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        h, ctx.slot.handle = ctx.slot.handle, None
        if h is None:
            if ctx.slot.used:
                raise RuntimeError("halo adjoint missing: FetchStrips' backward did not run before GradSink's")
            return g, None
        if not g.is_contiguous():
            g = g.contiguous()
        return h.finish(g), None


def _overlap(box: tuple[slice, ...], own: tuple[slice, ...]) -> tuple[slice, ...] | None:
    """``own`` intersected with ``box``, relative to ``box`` (slices with explicit bounds in
    ``own``; ``slice(None)`` entries mean whole)."""
    out = []
    for b, o in zip(box, own):
        if b == slice(None) or o == slice(None):
            if b == slice(None):
                out.append(o)
                continue
            out.append(slice(0, b.stop - b.start))
            continue
        lo, hi = max(b.start, o.start), min(b.stop, o.stop)
        if hi <= lo:
            return None
        out.append(slice(lo - b.start, hi - b.start))
    return tuple(out)
