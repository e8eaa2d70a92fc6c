"""Activation checkpointing through layers that communicate: :func:`checkpoint` and :class:`Checkpointed`.

A checkpointed region keeps only its inputs in the forward pass and runs again in the
backward pass to rebuild the activations its gradients need (torch's non-reentrant
:func:`torch.utils.checkpoint.checkpoint`). hpctp's layers communicate in forward (halos,
spectrum sums, token gathers, norm statistics, argument agreement), so the recompute issues
collectives too, during the backward pass, interleaved with the other layers' backward
collectives. That is safe when every rank recomputes the same region at the same point of its
backward pass and the recompute issues the messages the first pass issued:

* the whole region is recomputed at once (torch's early stop is switched off: it would end the
  recompute after the last saved tensor, a point that differs between ranks whose blocks save
  different tensors, e.g. an empty block);
* the recompute starts when the gradient reaches the region's outputs (a pre-hook on their
  autograd nodes), a point of the backward graph every rank reaches in the same order, not at
  the first node that needs a saved tensor (torch's rule): that node differs between ranks. A
  rank whose conv output block is empty saves nothing there, so its first saved tensor comes
  after the halo's adjoint exchange, which a neighbour already blocked in its recompute's halo
  exchange never answers;
* random state is replayed: torch's global generators (``preserve_rng_state``) and the private
  ``torch.Generator`` of the modules behind ``function`` (attributes holding one, and those named
  in a module's ``hpctp_generators``, such as :class:`~hpctp.nn.TransformerBlock`'s dropout
  generator), which are put back afterwards so later steps draw as without checkpointing;
* per-call argument agreements cached after their first call
  (:class:`~hpctp.nn.transformer.sequence_parallel.ArgumentAgreement`) hit their cache in the recompute on
  every rank alike, and the uncached ones (layout inference of plain blocks, token cuts) run again
  on every rank alike.

The gradients are bitwise those without checkpointing. Buffers updated in forward are updated
again by the recompute, as torch's own layers under :func:`torch.utils.checkpoint.checkpoint`:
a checkpointed :class:`~hpctp.nn.BatchNorm2d` counts two batches per step in
``num_batches_tracked`` and moves its running statistics twice (the batch statistics, and so
the gradients, are unaffected).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from ...tensor.core import DistTensor

__all__ = ["Checkpointed", "checkpoint", "checkpoint_forward"]


class _Replay:
    """The private generators of the modules behind a checkpointed function: their state before the
    first pass, set again for the recompute (on copies) and put back afterwards."""

    def __init__(self, function: Callable[..., Any]) -> None:
        owner = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
        modules = list(owner.modules()) if isinstance(owner, torch.nn.Module) else []
        self.slots: list[tuple[torch.nn.Module, str, tuple[torch.Tensor, torch.device] | None]] = []
        for m in modules:
            names = set(getattr(m, "hpctp_generators", ())) | {
                k for k, v in vars(m).items() if isinstance(v, torch.Generator)
            }
            for name in sorted(names):
                g = getattr(m, name, None)
                state = (g.get_state(), g.device) if isinstance(g, torch.Generator) else None
                self.slots.append((m, name, state))
        self.recomputing = False

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        """The generators as they were before the first pass (None where none existed yet)."""
        now = [getattr(m, name, None) for m, name, _ in self.slots]
        for m, name, state in self.slots:
            g = None
            if state is not None:
                g = torch.Generator(device=state[1])
                g.set_state(state[0])
            setattr(m, name, g)
        self.recomputing = True
        try:
            yield
        finally:
            self.recomputing = False
            for (m, name, _), g in zip(self.slots, now):
                setattr(m, name, g)


class _Anchor(torch.autograd.Function):
    """Saves one empty tensor inside the region: unpacking it from the outputs' pre-hooks recomputes the region."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x.new_empty((0,))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> None:  # type: ignore[override]
        return None


def _output_nodes(out: Any) -> list[Any]:
    """The autograd nodes of the tensors (and DistTensor blocks) in ``out``, nested in tuples, lists and dicts."""
    if isinstance(out, DistTensor):
        out = out.local
    if isinstance(out, torch.Tensor):
        return [out.grad_fn] if out.grad_fn is not None else []
    if isinstance(out, (tuple, list)):
        return [n for o in out for n in _output_nodes(o)]
    if isinstance(out, dict):
        return [n for o in out.values() for n in _output_nodes(o)]
    return []


def _recompute_at_outputs(out: Any, anchor: torch.Tensor) -> None:
    """Pre-hooks on the outputs' nodes that recompute the region (once per backward) when the gradient arrives."""
    node: Any = anchor.grad_fn  # (the anchor's ctx: its saved_tensors unpack)
    if node is None:  # (grad mode off)
        return
    done: set[int] = set()

    def hook(grad_outputs: Any) -> None:
        task = torch._C._current_graph_task_id()
        if task not in done:
            done.add(task)
            node.saved_tensors  # noqa: B018 (the first unpack in a backward pass recomputes the region)

    for n in _output_nodes(out):
        n.register_prehook(hook)


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Collective over grid (as ``function``). ``function(*args, **kwargs)``, its activations recomputed in backward.

    Built on ``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``
    with the rules of the module docstring, so ``function`` may communicate: the recompute runs
    the same collectives in the same order on every rank, at the point of the backward pass where
    the gradient reaches the outputs, with the same random numbers (torch's generators, and the
    private generators of ``function``'s modules). Call it on every rank alike, as ``function``.
    Without grad mode it is a plain call.

    Parameters
    ----------
    function : callable
        A module, a module's bound method or any function of tensors; its arguments and results
        may be DistTensors (their torch blocks are what torch's checkpoint saves and what the
        gradients reach), also nested in tuples, lists or dicts (results).
    *args, **kwargs
        Its arguments. The same tensor passed twice stays one object in the recompute.

    Returns
    -------
    Any
        ``function``'s result.

    Raises
    ------
    TypeError
        If ``function`` is not callable.
    torch.utils.checkpoint.CheckpointError
        If the recompute saved other tensors than the first pass (a function whose work depends
        on state it changes), on the ranks where it happened.
    """
    if not callable(function):
        raise TypeError(
            f"checkpoint: function must be callable (a module or a function), got {type(function).__name__}"
        )
    replay = _Replay(function)
    flat: list[Any] = []
    grids: dict[int, tuple[Any, Any]] = {}
    index: dict[int, int] = {}

    def take(v: Any) -> int:
        if isinstance(v, (torch.Tensor, DistTensor)) and id(v) in index:
            return index[id(v)]
        i = index[id(v)] = len(flat)
        if isinstance(v, DistTensor) and isinstance(v.local, torch.Tensor):  # torch saves (and replays) the block
            grids[i] = (v.grid, v.layout)
            v = v.local
        flat.append(v)
        return i

    where = [take(a) for a in args]
    named = {k: take(v) for k, v in kwargs.items()}

    def run(*values: Any) -> Any:
        vals = [DistTensor(v, *grids[i]) if i in grids else v for i, v in enumerate(values)]
        out = function(*(vals[i] for i in where), **{k: vals[i] for k, i in named.items()})
        anchor = _Anchor.apply(torch.zeros(0, requires_grad=True))  # (also in the recompute: the same saves)
        if not replay.recomputing:
            _recompute_at_outputs(out, anchor)
        return out

    with torch_checkpoint.set_checkpoint_early_stop(False):
        return torch_checkpoint.checkpoint(
            run, *flat, use_reentrant=False, preserve_rng_state=True,
            context_fn=lambda: (contextlib.nullcontext(), replay.recompute()), determinism_check="default",
        )  # fmt: skip


class Checkpointed(torch.nn.Module):
    """Local. ``module`` run under :func:`checkpoint` in training, plainly in eval mode or without grad.

    Wrap the submodules whose activations should not be kept: ``model.block = Checkpointed(model.block)``.
    The wrapped module is the child ``module`` (its parameters' and state dict's names gain the
    prefix ``module.``). Forward is collective as ``module``'s.

    Parameters
    ----------
    module : torch.nn.Module

    Raises
    ------
    TypeError
        If ``module`` is not a torch.nn.Module.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Checkpointed wraps a torch.nn.Module, got {type(module).__name__}")
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Collective as ``module``. ``module(*args, **kwargs)``, checkpointed when training with grad enabled.

        Parameters
        ----------
        *args, **kwargs
            ``module``'s arguments.

        Returns
        -------
        Any
            ``module``'s result.
        """
        if self.training and torch.is_grad_enabled():
            return checkpoint(self.module, *args, **kwargs)
        return self.module(*args, **kwargs)


def checkpoint_forward(module: torch.nn.Module) -> torch.nn.Module:
    """Local. Run ``module``'s forward under :func:`checkpoint` when training with grad enabled, in place.

    Unlike :class:`Checkpointed`, the module tree and its state dict's names stay as they are (the
    instance's ``forward`` is replaced), so checkpoints load with or without it. Forward is
    collective as ``module``'s.

    Parameters
    ----------
    module : torch.nn.Module

    Returns
    -------
    torch.nn.Module
        ``module`` itself.

    Raises
    ------
    TypeError
        If ``module`` is not a torch.nn.Module.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"checkpoint_forward takes a torch.nn.Module, got {type(module).__name__}")
    forward = module.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        if module.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, **kwargs)
        return forward(*args, **kwargs)

    module.forward = run  # type: ignore[method-assign]
    setattr(module, "hpctp_recomputed", True)  # noqa: B010 (a pipeline's zero-bubble split leaves such a stage whole)
    return module
