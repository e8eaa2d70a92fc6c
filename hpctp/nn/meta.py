"""Materializing a model built on the ``meta`` device: storage, then the values of construction.

See [Note: deferred initialisation] in :mod:`hpctp.nn.init`. A module's *own* tensors are its
direct parameters and buffers (``recurse=False``). Materializing a group of modules gives each
module's own meta tensors storage, then calls the ``reset_parameters()`` of every
module that had some, children before parents (post-order: the order construction runs, where a
parent builds its children and may then adjust them). A module whose class sets
``hpctp_resets_children = True`` re-initialises its sub-modules itself (in construction's order,
under its own seed), so they are not reset on their own. The parameter objects stay the same
(their ``hpctp_layout`` and hooks too); only their data changes.

:class:`hpctp.nn.ShardedDataParallel` materializes one sharding unit at a time and keeps only its
slices; :func:`materialize` does a whole model (each rank its own blocks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .init import seeded

__all__ = ["materialize", "meta_problems", "has_meta", "reset_order", "dematerialize"]


def _own_tensors(m: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, p in m.named_parameters(recurse=False):
        yield name, p
    for name, b in m.named_buffers(recurse=False):
        yield name, b


def _has_own_meta(m: torch.nn.Module) -> bool:
    return any(t.is_meta for _, t in _own_tensors(m))


def has_meta(module: torch.nn.Module) -> bool:
    """Local. Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def reset_order(module: torch.nn.Module, prefix: str = "") -> list[tuple[str, torch.nn.Module, bool]]:
    """Local. ``(name, module, reset_here)`` for ``module`` and its sub-modules in post-order.

    ``reset_here`` is False for the sub-modules of a module with ``hpctp_resets_children``: their
    parent's ``reset_parameters()`` sets their values.
    """
    out: list[tuple[str, torch.nn.Module, bool]] = []

    def walk(m: torch.nn.Module, name: str, covered: bool) -> None:
        inner = covered or bool(getattr(m, "hpctp_resets_children", False))
        for child_name, child in m.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, inner)
        out.append((name, m, not covered))

    walk(module, prefix, False)
    return out


def meta_problems(order: Sequence[tuple[str, torch.nn.Module, bool]]) -> list[str]:
    """Local. The meta tensors of ``order`` (:func:`reset_order`) that nothing would initialise:
    their module has no ``reset_parameters()`` and no ancestor resets it; one line each."""
    problems = []
    for name, m, reset_here in order:
        if reset_here and _has_own_meta(m) and not callable(getattr(m, "reset_parameters", None)):
            for t_name, t in _own_tensors(m):
                if t.is_meta:
                    full = f"{name}.{t_name}" if name else t_name
                    problems.append(f"{full} ({type(m).__name__} has no reset_parameters())")
    return problems


def materialize_modules(order: Sequence[tuple[str, torch.nn.Module, bool]], device: Any) -> None:
    """Local. Storage on ``device`` for the own meta tensors of ``order``'s modules, then the
    resets (in ``order``; on the caller's generator, see :func:`hpctp.nn.init.seeded`).

    Raises
    ------
    ValueError
        If a meta tensor has no way to be initialised (:func:`meta_problems`); nothing is changed.
    """
    problems = meta_problems(order)
    if problems:
        raise ValueError(_problem_text(problems))
    covered_meta: dict[int, bool] = {}
    for _, m, _ in order:
        if _has_own_meta(m):
            covered_meta[id(m)] = True
            _allocate_own(m, device)
    with torch.no_grad():
        for _, m, reset_here in order:
            if reset_here and (covered_meta.get(id(m)) or _covers_meta_child(m, covered_meta)):
                m.reset_parameters()  # type: ignore[operator]


def _allocate_own(m: torch.nn.Module, device: Any) -> None:
    """Uninitialised storage on ``device`` for ``m``'s own meta tensors. A parameter keeps its Python
    object (its ``hpctp_layout``, attributes and anyone's references to it): torch's ``to_empty``
    would make a new one, since a meta tensor's data cannot be swapped by ``.data =``."""
    for p in list(m._parameters.values()):
        if p is not None and p.is_meta:
            attrs = dict(p.__dict__)
            fresh = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, fresh)
            p.__dict__.update(attrs)
    for name, b in list(m._buffers.items()):
        if b is not None and b.is_meta:
            m._buffers[name] = torch.empty_like(b, device=device)


def dematerialize(module: torch.nn.Module) -> None:
    """Local. Move every parameter and buffer of ``module`` back to the meta device (releasing its storage), keeping
    the parameter objects: for layers materialized only to draw the random numbers construction draws."""
    for m in module.modules():
        for p in list(m._parameters.values()):
            if p is not None and not p.is_meta:
                attrs = dict(p.__dict__)
                torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad))
                p.__dict__.update(attrs)
        for name, b in list(m._buffers.items()):
            if b is not None and not b.is_meta:
                m._buffers[name] = torch.empty_like(b, device="meta")


def _covers_meta_child(m: torch.nn.Module, materialized: dict[int, bool]) -> bool:
    if not getattr(m, "hpctp_resets_children", False):
        return False
    return any(materialized.get(id(c)) for c in m.modules() if c is not m)


def _problem_text(problems: list[str]) -> str:
    shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    return (
        f"the model is on the meta device and these tensors have no way to be initialised: {shown}. "
        "Give their module a reset_parameters() that sets them (as torch's layers have), or build that "
        "module on a real device"
    )


def materialize(module: torch.nn.Module, *, seed: int | None = None, device: Any = "cpu") -> torch.nn.Module:
    """Local. Give every meta parameter and buffer of ``module`` storage and its value of construction.

    Each rank materializes its own blocks (no communication): a sharded parameter gets this rank's
    block of the grid-independent global tensor, a replicated one the same values on every rank.
    See :mod:`hpctp.nn.meta` for the order of the resets.

    Parameters
    ----------
    module : torch.nn.Module
        Built on ``meta`` (``with torch.device("meta"): ...``); tensors already on a device are left
        as they are.
    seed : int, optional
        Run the resets on torch's generator seeded with this (in a fork): the values one process
        gets from ``torch.manual_seed(seed)`` and then building the model for real (layers with
        their own ``seed=`` draw from it either way). None: the caller's generator as it is (then
        every rank must hold the same generator state, as for torch's own layers).
    device : torch.device or str
        Where the tensors are allocated.

    Returns
    -------
    torch.nn.Module
        ``module`` (the same parameter objects, now with data).

    Raises
    ------
    ValueError
        If a meta tensor belongs to a module without ``reset_parameters()`` (naming it); nothing
        is changed then.
    """
    order = reset_order(module)
    with seeded(seed):
        materialize_modules(order, device)
    return module
