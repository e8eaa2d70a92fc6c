"""Stage 3's units of :class:`hpctp.nn.ShardedDataParallel`: the sub-modules gathered as one.

A unit all-gathers its buckets just before its forward and frees them after, gathers them again
before its backward and frees them once its gradients are in (see :mod:`hpctp.nn.distributed.sharded`). Each
trainable parameter belongs to the innermost unit holding it; the model itself is the unit of the
parameters in no other.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from ._bucket import Bucket

__all__ = ["Unit", "choose_units", "owner_units"]


class Unit:
    """Local. A sub-module whose buckets stage 3 gathers before its forward and backward."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self.module = module
        self.name = name
        self.buckets: list[Bucket] = []

    def start_gather(self) -> None:
        """Collective over the data axes (non-blocking)."""
        for b in self.buckets:
            b.start_gather()

    def gather(self) -> None:
        """Collective over the data axes. The whole parameters, now."""
        self.start_gather()
        for b in self.buckets:
            b.wait_gather()

    def free(self) -> None:
        """Local."""
        for b in self.buckets:
            b.free()

    def __repr__(self) -> str:
        return f"Unit({self.name or '<model>'}, {len(self.buckets)} buckets)"


def choose_units(model: torch.nn.Module, units: Sequence[torch.nn.Module] | None) -> list[torch.nn.Module]:
    """Local. Stage 3's units: ``model`` itself, then ``units`` (default: the model's children holding trainable parameters).

    Raises
    ------
    ValueError
        If a unit is not a submodule of ``model``, or two units that do not nest share a parameter.
    """
    chosen = _default_units(model) if units is None else list(units)
    inside = {id(m) for m in model.modules()}
    bad = [type(u).__name__ for u in chosen if not isinstance(u, torch.nn.Module) or id(u) not in inside]
    if bad:
        raise ValueError(f"ShardedDataParallel: units {bad} are not submodules of the model; list its own modules")
    if not any(u is model for u in chosen):
        chosen.insert(0, model)  # the parameters in no other unit; it runs first
    _check_nesting(chosen)
    return chosen


def _default_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Local. The model's children that hold trainable parameters (those of a ModuleList or ModuleDict, which
    is never called itself; ParameterLists stay with their parent)."""
    out: list[torch.nn.Module] = []
    for child in model.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            out += _default_units(child)
        elif not isinstance(child, (torch.nn.ParameterList, torch.nn.ParameterDict)):
            if any(p.requires_grad for p in child.parameters()):
                out.append(child)
    return out


def _check_nesting(units: list[torch.nn.Module]) -> None:
    """A parameter held by two units that do not nest (tied weights) would be used while freed."""
    holders: dict[int, list[int]] = defaultdict(list)
    for i, u in enumerate(units):
        for p in u.parameters():
            holders[id(p)].append(i)
    inside = [{id(m) for m in u.modules()} for u in units]
    for held in holders.values():
        for i in held:
            for j in held:
                if i < j and id(units[j]) not in inside[i] and id(units[i]) not in inside[j]:
                    raise ValueError(
                        f"ShardedDataParallel: units {type(units[i]).__name__} and {type(units[j]).__name__} share "
                        "a parameter (tied weights) but do not nest; pass units= with a module holding both"
                    )


def owner_units(model: torch.nn.Module, chosen: list[torch.nn.Module]) -> dict[int, torch.nn.Module]:
    """Local. ``id(module) -> unit module`` for every module of ``model``: the innermost chosen unit holding it."""
    names = {id(m): n for n, m in model.named_modules()}
    owner: dict[int, torch.nn.Module] = {}
    for unit in sorted(chosen, key=lambda m: names[id(m)].count(".") + bool(names[id(m)])):  # outer first
        for m in unit.modules():
            owner[id(m)] = unit
    return owner
