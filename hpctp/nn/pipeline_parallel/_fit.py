"""Whether the stages fit together: each layer's output against the next layer's input, checked before a step's
first activation message.

Construction keeps a *shadow* of every layer of the chain on every rank (:func:`shadows`): a copy whose parameters
and buffers are on the ``meta`` device (no memory, no values), without forward hooks or a replaced ``forward`` (the
recompute of :func:`hpctp.nn.checkpoint_forward` changes no shape). The first step of each input signature runs
the shadows in the chain's order on meta tensors, a micro-batch of each distinct size, each layer on the previous
layer's output (:func:`check_fit`): no values and no messages, so every rank walks every stage. Where a layer fails
on meta, the ranks holding its stage run a copy of that one layer with real (zero) parameters on zeros of the same
shape, so that an operation without a meta kernel, or one that reads values, raises no false alarm; if it fails
there too, every rank raises a ValueError after one agreement over the grid (:func:`hpctp.comm.agree_arguments`),
before any activation or gradient message: the two stages (the layers' names at the cut), what the earlier one
produces, what the later one failed with, and the fix.

Checked: plain tensors (and tuples of them) through torch layers and the user's own. Not checked (the walk stops
there and the rest of the chain is left to the step, where a misfit fails the step as before): a layer holding an
hpctp layer other than :class:`~hpctp.nn.Checkpointed` (they communicate in forward: ParallelMLP, a Conv2d's
halos, Redistribute), a DistTensor activation, a layer that cannot be copied, and a layer that fails on meta but
runs on zeros. Nor are the last stage's output against the targets (the loss), or failures that depend on the
values (those still fail the step on their rank, and :func:`hpctp.cli.run_main` ends the job).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ... import comm as C
from ...tensor.core import DistTensor
from ..distributed.recompute import Checkpointed

__all__ = ["check_fit", "shadows", "signature", "walk_shapes"]

_META = torch.device("meta")


def _communicates(module: torch.nn.Module) -> bool:
    """An hpctp layer (or a subclass of one): its forward may talk to other ranks. Checkpointed only wraps."""
    if isinstance(module, Checkpointed):
        return False
    return any(c.__module__.split(".")[0] == "hpctp" for c in type(module).__mro__)


def _shadow(layer: torch.nn.Module) -> torch.nn.Module | None:
    """A meta copy of ``layer``, or None where the walk cannot run it."""
    if any(_communicates(m) for m in layer.modules()):
        return None
    try:
        memo: dict[int, Any] = {
            id(p): torch.nn.Parameter(torch.empty_like(p, device=_META), requires_grad=p.requires_grad)
            for p in layer.parameters()
        }
        memo.update({id(b): torch.empty_like(b, device=_META) for b in layer.buffers()})
        out = copy.deepcopy(layer, memo)
    except Exception:  # noqa: BLE001 - a layer that cannot be copied is left unchecked
        return None
    for m in out.modules():
        m.__dict__.pop("forward", None)  # (checkpoint_forward's wrapper calls the original layer)
        for hooks in (m._forward_hooks, m._forward_pre_hooks):
            hooks.clear()
    return out


def shadows(chain: Sequence[torch.nn.Module]) -> list[torch.nn.Module | None]:
    """Local. Each layer's copy on the ``meta`` device, or None where the check cannot run it (module docstring).

    Parameters
    ----------
    chain : sequence of torch.nn.Module
        The model's layers, real or on ``meta``, before anything wraps them.

    Returns
    -------
    list of torch.nn.Module or None
    """
    return [_shadow(layer) for layer in chain]


def signature(x: Any) -> tuple[Any, ...]:
    """Local. What the check depends on in a batch's inputs besides its length: type, shape past dim 0, dtype."""
    if isinstance(x, DistTensor):
        return ("DistTensor", tuple(x.global_shape[1:]), x.local.dtype, x.layout.split)
    if isinstance(x, torch.Tensor):
        return ("Tensor", tuple(x.shape[1:]), x.dtype)
    return (type(x).__qualname__,)


def _meta_input(x: Any, n: int) -> Any:
    """A meta micro-batch of ``n`` samples shaped like ``x``, or None (a DistTensor, anything else: unchecked)."""
    if isinstance(x, torch.Tensor):
        return torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=_META)
    return None


def _parts(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def _plain_meta(x: Any) -> bool:
    """A meta tensor or a non-empty tuple of them (what the walk can hand on)."""
    parts = _parts(x)
    return bool(parts) and all(isinstance(t, torch.Tensor) and t.device == _META for t in parts)


@dataclass(frozen=True)
class _Misfit:
    layer: int  # the chain index of the layer that failed
    given: Any  # its input (meta tensors)


def _walk(chain: Sequence[torch.nn.Module | None], x: Any) -> _Misfit | None:
    """The first layer that fails on meta, or None (every layer ran, or the walk stopped at an unchecked one)."""
    with torch.no_grad():
        for i, layer in enumerate(chain):
            if layer is None or not _plain_meta(x):
                return None
            try:
                x = layer(x)
            except Exception:  # noqa: BLE001 - confirmed or dismissed by a real run (_confirm)
                return _Misfit(i, x)
    return None


def walk_shapes(chain: Sequence[torch.nn.Module | None], inputs: Any, n: int, end: int) -> Any:
    """Local. What layers ``0:end`` of the chain give for a micro-batch of ``n`` samples shaped like ``inputs``: meta
    tensors (or a tuple of them) from the :func:`shadows`, no values and no messages; None where the walk cannot run
    them (a layer without a shadow, a DistTensor, a layer that fails on meta).

    Parameters
    ----------
    chain : sequence of torch.nn.Module or None
        :func:`shadows` of the model's layers.
    inputs : tensor or DistTensor
        This data group's share of the batch.
    n : int
        The micro-batch's samples.
    end : int
        The layers walked: ``chain[:end]``.

    Returns
    -------
    tensor, tuple of tensors or None
    """
    x = _meta_input(inputs, n)
    with torch.no_grad():
        for layer in chain[:end]:
            if layer is None or not _plain_meta(x):
                return None
            try:
                x = layer(x)
            except Exception:  # noqa: BLE001 - a layer without a meta kernel: not walked
                return None
    return x if _plain_meta(x) else None


def _confirm(shadow: torch.nn.Module, given: Any, device: torch.device) -> Exception | None:
    """Local. The error of a copy of the layer with zero parameters on zeros shaped like ``given`` (on ``device``),
    or None: it runs (a meta-only failure), or it cannot be built (unchecked)."""
    try:
        real = copy.deepcopy(shadow).to_empty(device=device)
        with torch.no_grad():
            for t in itertools.chain(real.parameters(), real.buffers()):
                t.zero_()
        x = tuple(torch.zeros(t.shape, dtype=t.dtype, device=device) for t in _parts(given))
    except Exception:  # noqa: BLE001
        return None
    try:
        with torch.no_grad():
            real(x if isinstance(given, tuple) else x[0])
    except Exception as e:  # noqa: BLE001 - the misfit itself
        return e
    return None


def _stage_of(layer: int, cuts: Sequence[int]) -> int:
    return next(s for s in range(len(cuts) - 1) if cuts[s] <= layer < cuts[s + 1])


def _describe(x: Any) -> str:
    one = [f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)}" for t in _parts(x)]
    what = one[0] if not isinstance(x, tuple) else f"a tuple of {len(one)}: " + ", ".join(one)
    return what + " (plain torch tensors, no DistTensor layout)"


def _short(name: str, layer: torch.nn.Module) -> str:
    text = f"{type(layer).__name__}({layer.extra_repr()})"
    return f"'{name}' ({text if len(text) <= 120 else text[:117] + '...'})"


def _message(
    misfit: _Misfit, error: Exception, n: int, chain: Sequence[torch.nn.Module | None], cuts: Sequence[int],
    names: Sequence[str],
) -> str:  # fmt: skip
    i = misfit.layer
    s = _stage_of(i, cuts)
    failed = f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"
    layer = _short(names[i], chain[i])  # type: ignore[arg-type]
    given = _describe(misfit.given)
    if i == 0:
        return (
            f"PipelineParallel: the inputs do not fit stage 0 (layers {cuts[0]}:{cuts[1]}): a micro-batch of {n} "
            f"samples is {given}, and its first layer {layer} fails on it with {failed}. Pass inputs of the shape "
            "that layer takes, or fix its input features"
        )
    before = _short(names[i - 1], chain[i - 1])  # type: ignore[arg-type]
    fix = (
        f"make the output of layer {before} and the input of layer {layer} agree (e.g. a Linear's out_features and "
        "the next Linear's in_features)"
    )
    if i != cuts[s]:
        return (
            f"PipelineParallel: inside stage {s} (layers {cuts[s]}:{cuts[s + 1]}), layer {layer} does not fit the "
            f"output of layer {before}: for a micro-batch of {n} samples that is {given}, and it fails with "
            f"{failed}. Fix the layers: {fix}"
        )
    return (
        f"PipelineParallel: stage {s - 1} does not fit stage {s}: stage {s - 1} (layers {cuts[s - 1]}:{cuts[s]}) ends "
        f"with layer {before}, whose output for a micro-batch of {n} samples is {given}; stage {s} (layers "
        f"{cuts[s]}:{cuts[s + 1]}) starts with layer {layer}, which fails on it with {failed}. Fix the model: "
        f"{fix}, or move the cut (cuts={tuple(cuts)}) to where the two sides agree"
    )


def check_fit(
    comm: Any, chain: Sequence[torch.nn.Module | None], cuts: Sequence[int], names: Sequence[str], inputs: Any,
    sizes: Sequence[int], held: Sequence[int], device: torch.device,
) -> None:  # fmt: skip
    """Collective over ``comm`` (the grid: one agreement). Walk the chain's shadows on meta micro-batches shaped like
    ``inputs``, one of each distinct size in ``sizes``; raise where a layer does not fit its input.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        Every rank of the pipeline (the plan's grid).
    chain : sequence of torch.nn.Module or None
        :func:`shadows` of the model's layers.
    cuts : sequence of int
        Stage ``s`` runs layers ``cuts[s]:cuts[s + 1]``.
    names : sequence of str
        The layers' names.
    inputs : tensor or DistTensor
        This data group's share of the batch (a DistTensor is not checked).
    sizes : sequence of int
        This group's micro-batch sizes.
    held : sequence of int
        The stages this rank holds: it confirms a misfit in their layers by a real run.
    device : torch.device
        Where this rank's stages compute (the confirming run's).

    Raises
    ------
    ValueError
        On every rank, before any activation message, if a layer fails on its input both on meta and in a real run
        (the misfit's stages and layers, the input's shape and dtype, the error and the fix).
    """
    error: Exception | None = None
    for n in dict.fromkeys(sizes):
        x = _meta_input(inputs, n)
        misfit = _walk(chain, x) if x is not None else None
        if misfit is None:
            continue
        if _stage_of(misfit.layer, cuts) in held:
            failed = _confirm(chain[misfit.layer], misfit.given, device)  # type: ignore[arg-type]
            if failed is not None:
                error = ValueError(_message(misfit, failed, n, chain, cuts, names))
        break  # (another size fails alike)
    C.agree_arguments(comm, "PipelineParallel.step", error)
