"""Linear layers whose weight gradients wait: the ``W`` pass of a zero-bubble pipeline, without a graph walk.

[Note: deferred weight gradients] A zero-bubble schedule splits a stage's backward into ``B`` (the gradient of
the stage's input, on the critical path to the previous stage) and ``W`` (the weights' gradients, to fill the
bubble). For a linear layer ``y = x W^T + b`` the split is a matter of who computes ``dW = dy^T x``: while a
:class:`DeferredWeightGradients` is active (:meth:`DeferredWeightGradients.recording`), :func:`linear` computes
``y`` with the weight detached, so autograd's backward (``B``) computes ``dx`` (and the bias's gradient) but not
``dW``; a hook on ``y`` keeps ``dy``, and :meth:`DeferredWeightGradients.run` (``W``) computes each ``dW`` from
the kept ``x`` and ``dy`` and hands it to autograd at the weight (one accumulation each, so ``.grad``, its hooks
and ShardedDataParallel's messages behave as in one backward; the other parameters' gradients, a bias's or a
norm's, arrive in ``B``). The generic split of any autograd graph
(:mod:`hpctp.nn.pipeline_parallel._split_backward`), which remains for layers that do not call :func:`linear`,
costs 1.2x. ``dW`` is computed and accumulated one layer at a time: holding them all until one accumulation call
made ``W`` a third slower on the CPU (fresh pages for every gradient).

[Note: weight gradients accumulated in place] Autograd accumulates a weight's gradient in two passes over it: the
product ``dW = dy^T x`` is written to a new tensor, then added into ``.grad`` (read both, write one). Where that is
all it would do, ``W`` adds the product into ``.grad`` in the product itself (``grad.addmm_(dy^T, x)``, one pass; the
first micro-batch's product becomes ``.grad``), and then runs the parameter's post-accumulate hooks as autograd does
(ShardedDataParallel's). "All it would do": the weight is a parameter (a leaf) or a strided view of one that visits
no element twice (a row block of a fused projection, a transpose), of the parameter's dtype; neither has a tensor
hook (``register_hook``, which may change the incoming gradient); ``.grad`` is absent or dense in the parameter's
layout. Anything else goes through autograd. Hooks registered on a parameter's ``AccumulateGrad`` node itself (not a
tensor's hooks; torch's DistributedDataParallel does this) cannot be seen from Python and are not run on this path:
set :data:`IN_PLACE` to False for such a model. Measured on one CPU core (4 transformer blocks, 8 micro-batches of
2 x 64 tokens, embed 256; jemalloc and glibc alike): forward, ``B`` and ``W`` of a micro-batch cost 1.09-1.13 times
its forward and whole backward with the products accumulated by autograd (``W`` right after ``B``, or one
micro-batch later as on ZB-H1's last stage: ``dy`` and ``x`` have left the cache by then), 1.02-1.04 times in place.

Memory is what a whole backward holds: ``x`` (which the weight's gradient needs anyway) from forward until
``W``, and ``dy`` from ``B`` until ``W``; the rest of the graph is freed by ``B``. Only a parameter or a view of
one is deferred: a computed weight (``w * scale``) could have its graph freed by ``B`` when it is used elsewhere
too, so its linear computes ``dW`` in ``B``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import torch

__all__ = ["DeferredWeightGradients", "LinearRecorder", "linear", "recording"]


class LinearRecorder(Protocol):
    """What :func:`linear` hands its deferrable calls to while :func:`recording`: a :class:`DeferredWeightGradients`,
    or an observer (the planner's probe counts the bytes a zero-bubble ``W`` would keep)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Local. ``linear(x, weight, bias)`` of a call whose weight gradient can wait."""
        ...


_ACTIVE: contextvars.ContextVar[LinearRecorder | None] = contextvars.ContextVar(
    "hpctp_deferred_weight_gradients", default=None
)


@contextlib.contextmanager
def recording(recorder: LinearRecorder) -> Iterator[LinearRecorder]:
    """Local. Inside, :func:`linear` hands every call whose weight gradient can wait to ``recorder``."""
    token = _ACTIVE.set(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.reset(token)


class _Pending:
    """One linear call's deferred weight gradient: its input, its weight and (after ``B``) its output's gradient."""

    __slots__ = ("x", "weight", "version", "dy")

    def __init__(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        self.x, self.weight, self.version = x.detach(), weight, x._version
        self.dy: torch.Tensor | None = None  # (set by the hook on the output, in B)

    def keep(self, dy: torch.Tensor) -> None:
        self.dy = dy


class DeferredWeightGradients:
    """Local. The weight gradients of the :func:`linear` calls made while recording, computed when :meth:`run`.

    One object per forward whose backward is split (a pipeline stage's micro-batch); see
    [Note: deferred weight gradients].
    """

    def __init__(self) -> None:
        self._pending: list[_Pending] = []

    def __len__(self) -> int:
        """Local. How many linear calls wait for their weight gradient."""
        return len(self._pending)

    def recording(self) -> contextlib.AbstractContextManager[LinearRecorder]:
        """Local. Inside, :func:`linear` defers its weight gradient to this object."""
        return recording(self)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Local. ``linear(x, weight.detach(), bias)``, remembering that it owes ``weight`` its gradient."""
        y = torch.nn.functional.linear(x, weight.detach(), bias)
        entry = _Pending(x, weight)
        y.register_hook(entry.keep)
        self._pending.append(entry)
        return y

    def run(self) -> None:
        """Local. Compute every recorded weight gradient and accumulate it into its weight (autograd: hooks run).

        Calls whose output got no gradient in the backward (unused outputs) give none. Afterwards nothing is
        recorded.

        Raises
        ------
        RuntimeError
            When a recorded input was modified in place after the forward (autograd's own error for a saved
            tensor), before any gradient is accumulated.
        """
        pending = deque((e.x, e.dy, e.weight) for e in self._pending if e.dy is not None and e.x._version == e.version)
        if len(pending) < sum(e.dy is not None for e in self._pending):
            raise RuntimeError(
                "DeferredWeightGradients: the input of a linear layer was modified in place between its forward and "
                "the weight-gradient pass (W); clone it before modifying it"
            )
        self._pending = []
        while pending:  # (each product freed once accumulated: one layer's dW at a time)
            x, dy, w = pending.popleft()
            with torch.no_grad():
                if x.dtype != dy.dtype:  # (autocast cast x inside the linear: the same cast here)
                    x = x.to(dy.dtype)
                dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
                if _accumulate_in_place(w, dy2, x2):
                    continue
                dw = dy2.mT @ x2
                if dw.dtype != w.dtype:
                    dw = dw.to(w.dtype)
            del x, dy, dy2, x2
            torch.autograd.backward([w], [dw])
            del dw


IN_PLACE = True
"""Whether :meth:`DeferredWeightGradients.run` adds a weight's gradient into its ``.grad`` by one product where it
can ([Note: weight gradients accumulated in place]); False: always through autograd (for comparison)."""

_MISSING = object()


def _accumulate_in_place(w: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> bool:
    """``dy^T x`` added into the gradient of ``w``'s parameter by one product (``addmm_`` into ``.grad``), where that
    is all autograd's accumulation would do; whether it did. See [Note: weight gradients accumulated in place]."""
    leaf = w if w.is_leaf else w._base
    if leaf is None or not leaf.is_leaf or not leaf.requires_grad or not IN_PLACE:
        return False
    post = getattr(leaf, "_post_accumulate_grad_hooks", _MISSING)
    before = [getattr(t, "_backward_hooks", _MISSING) for t in {id(leaf): leaf, id(w): w}.values()]
    if (
        post is _MISSING
        or any(h is _MISSING or h for h in before)  # (a tensor hook may change the incoming gradient: autograd's way)
        or not (w.dtype == leaf.dtype == dy.dtype == x.dtype and w.device == leaf.device == dy.device)
        or leaf.layout != torch.strided
        or not leaf.is_contiguous()
        or not (w.is_contiguous() or w.mT.is_contiguous())  # (a view that overlaps no element twice)
        or w.is_conj()
        or w.is_neg()
    ):
        return False
    grad = leaf.grad
    if grad is not None and (grad.layout != torch.strided or grad.stride() != leaf.stride() or grad.requires_grad):
        return False
    if grad is None and w is leaf:
        leaf.grad = dy.mT @ x
    else:
        if grad is None:
            grad = leaf.grad = torch.zeros_like(leaf)
        region = grad if w is leaf else grad.as_strided(
            w.shape, w.stride(), grad.storage_offset() + w.storage_offset() - leaf.storage_offset()
        )  # fmt: skip
        region.addmm_(dy.mT, x)
    hooks = cast("dict[Any, Callable[[torch.Tensor], None]]", post or {})
    for hook in hooks.values():  # (as autograd runs them after accumulating: ShardedDataParallel's)
        hook(leaf)
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Local. ``torch.nn.functional.linear(x, weight, bias)``; inside a zero-bubble stage its weight gradient waits.

    Outside :func:`recording` (and where the weight needs no gradient, or autograd is
    off) this is torch's linear. Inside, ``weight``'s gradient is computed by the recording object's
    :meth:`~DeferredWeightGradients.run` instead of by backward; the input's and the bias's are computed by
    backward as always. Same values either way (the same product, ``dy^T x``).

    Parameters
    ----------
    x : torch.Tensor
        ``[..., in_features]``.
    weight : torch.Tensor
        ``[out_features, in_features]`` (a parameter, or a view or cast of one).
    bias : torch.Tensor, optional
        ``[out_features]``.

    Returns
    -------
    torch.Tensor
        ``[..., out_features]``.
    """
    recorder = _ACTIVE.get()
    if (
        recorder is None
        or not weight.requires_grad
        or not (weight.is_leaf or weight._is_view())  # (a view's backward keeps no tensor: W can cross it)
        or not torch.is_grad_enabled()
        or not (x.requires_grad or (bias is not None and bias.requires_grad))  # (else no dy: backward computes dW)
    ):
        return torch.nn.functional.linear(x, weight, bias)
    return recorder.linear(x, weight, bias)
