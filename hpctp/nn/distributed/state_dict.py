"""Whole (gathered) state dicts of partitioned modules, in torch's convention, and loading them back.

:func:`global_state_dict` assembles every sharded tensor (a parameter or buffer carrying
``hpctp_layout``, the :class:`~hpctp.Layout` of the global tensor on its module's grid)
and keeps replicated ones as they are, so a model partitioned over any grid yields the
state dict of the single-process torch model: save it with ``torch.save`` and load it
into ``torch.nn`` modules, or load a pretrained torch state into the partitioned model
with :func:`load_global_state_dict` (each rank keeps its block).

Modules whose torch counterpart packs or names parameters differently provide two hooks,
called with the module's own entries (keys relative to the module):

* ``hpctp_export_state(state) -> state``: gathered tensors to torch's convention (e.g.
  :class:`~hpctp.nn.MultiheadAttention` reshapes ``in_proj_weight`` ``[3, E, E] -> [3E, E]``);
  applied to the deepest modules first;
* ``hpctp_import_state(state) -> state``: the reverse, applied to the outermost modules first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ... import comm as C
from ..._util.ints import is_int
from ...comm import ProcessGrid
from ...layout import Layout
from ...ops.transfer import gather_block, scatter_block

__all__ = ["global_state_dict", "load_global_state_dict"]


def _module_grids(module: torch.nn.Module, grid: ProcessGrid | None) -> dict[str, ProcessGrid | None]:
    """Each submodule's prefix -> the grid its tensors live on (its own ``grid``, else its parent's)."""
    out: dict[str, ProcessGrid | None] = {}
    for name, m in module.named_modules():
        parent = out.get(name.rpartition(".")[0]) if name else None
        own = getattr(m, "grid", None)
        out[name] = grid if grid is not None else own if isinstance(own, ProcessGrid) else parent
    return out


def _owner(key: str) -> str:
    return key.rpartition(".")[0]


def _layout(t: Any) -> Layout | None:
    layout = getattr(t, "hpctp_layout", None)
    return layout if isinstance(layout, Layout) else None


def _tensors(module: torch.nn.Module, grid: ProcessGrid | None) -> tuple[dict[str, Any], dict[str, ProcessGrid | None], ProcessGrid | None]:  # fmt: skip
    """The module's state entries (parameters as objects, so their ``hpctp_layout`` shows), each
    entry's grid, and the grid to agree on (the first found)."""
    state = module.state_dict(keep_vars=True)
    grids = _module_grids(module, grid)
    where = {k: grids.get(_owner(k)) for k in state}
    first = grid if grid is not None else next((g for g in grids.values() if g is not None), None)
    return dict(state), where, first


def _layout_error(key: str, t: Any, g: ProcessGrid | None) -> Exception | None:
    layout = _layout(t)
    if getattr(t, "hpctp_layout", None) is not None and layout is None:
        return TypeError(f"{key}: hpctp_layout must be a hpctp.Layout, got {type(t.hpctp_layout).__name__}")
    if layout is None:
        return None
    if g is None:
        return ValueError(f"{key} is sharded but neither its module nor a parent has a ProcessGrid `grid`; pass grid=")
    if layout.grid_dims != g.dims:
        return ValueError(f"{key}: hpctp_layout is on a grid of dims {layout.grid_dims}, its module's grid is {g.dims}")
    if tuple(t.shape) != layout.local_shape(g.coords):
        return ValueError(
            f"{key}: the block's shape {tuple(t.shape)} is not its layout's {layout.local_shape(g.coords)} "
            f"at grid coordinates {g.coords}"
        )
    return None


def _check_root(root: object, g: ProcessGrid | None) -> Exception | None:
    if root is None:
        return None
    size = 1 if g is None else g.size
    if not is_int(root) or not 0 <= root < size:
        return ValueError(f"root={root!r} must be None (every rank) or a rank in 0..{size - 1}")
    return None


def _hooked(module: torch.nn.Module, name: str) -> list[tuple[str, Any]]:
    """``(prefix, hook)`` of the submodules defining ``name``, outermost first."""
    found = [(p, getattr(m, name)) for p, m in module.named_modules() if callable(getattr(m, name, None))]
    return sorted(found, key=lambda item: 0 if not item[0] else item[0].count(".") + 1)


def _apply_hook(state: dict[str, Any], prefix: str, hook: Any) -> dict[str, Any]:
    lead = prefix + "." if prefix else ""
    mine = {k[len(lead) :]: v for k, v in state.items() if k.startswith(lead)}
    rest = {k: v for k, v in state.items() if not k.startswith(lead)}
    rest.update({lead + k: v for k, v in hook(mine).items()})
    return rest


def global_state_dict(
    module: torch.nn.Module, *, root: int | None = None, grid: ProcessGrid | None = None
) -> dict[str, Any]:
    """Collective over the module's grid. The gathered state dict, in torch's convention.

    Sharded tensors (``hpctp_layout``) are assembled from their blocks (one ``Allgatherv``,
    or ``Gatherv`` with ``root``, per tensor); replicated ones are copied. Modules with an
    ``hpctp_export_state`` hook then convert their entries (see the module docstring).

    Parameters
    ----------
    module : torch.nn.Module
        The same structure on every rank.
    root : int, optional
        The rank that receives the state (None: every rank).
    grid : ProcessGrid, optional
        The grid of every sharded tensor (default: the ``grid`` attribute of the tensor's
        module or of its nearest parent having one).

    Returns
    -------
    dict
        Detached tensors (on the parameters' devices) under the keys of ``module.state_dict()``
        as torch names them; an empty dict on ranks other than ``root``.

    Raises
    ------
    ValueError, TypeError
        On a bad ``root``, a ``hpctp_layout`` that does not fit its module's grid or its
        block, or ranks whose modules differ (on every rank).
    """
    state, where, g = _tensors(module, grid)
    error = _check_root(root, g)
    for k, t in state.items():
        error = error or _layout_error(k, t, where[k])
    if g is None:  # nothing partitioned and no grid: this process holds the whole model
        if error is not None:
            raise error
        return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    C.agree_arguments(g.comm, "global_state_dict", error, keys=list(state), root=root)
    receives = root is None or g.rank == root
    out: dict[str, Any] = {}
    for k, t in state.items():
        layout = _layout(t)
        if layout is not None:
            kg = where[k]
            full = gather_block(t.detach().contiguous(), kg, layout, root)  # type: ignore[arg-type]
            if receives:
                out[k] = full
        elif receives:
            out[k] = t.detach().clone() if isinstance(t, torch.Tensor) else t
    if not receives:
        return {}
    for prefix, hook in reversed(_hooked(module, "hpctp_export_state")):
        out = _apply_hook(out, prefix, hook)
    return out


def _import(module: torch.nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(state)
    for prefix, hook in _hooked(module, "hpctp_import_state"):
        out = _apply_hook(out, prefix, hook)
    return out


def _load_errors(state: Mapping[str, Any], mine: dict[str, Any], strict: bool) -> Exception | None:
    """Local. Missing or unexpected keys (strict) and global shapes that do not fit."""
    missing = [k for k in mine if k not in state]
    unexpected = [k for k in state if k not in mine]
    if strict and (missing or unexpected):
        return KeyError(
            f"load_global_state_dict: missing keys {missing}, unexpected keys {unexpected} "
            f"(pass strict=False to load the others)"
        )
    for k, t in mine.items():
        if k not in state or not isinstance(t, torch.Tensor):
            continue
        v = state[k]
        layout = _layout(t)
        want = layout.global_shape if layout is not None else tuple(t.shape)
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(want):
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            return ValueError(f"load_global_state_dict: {k} must be a tensor of the global shape {want}, got {got}")
    return None


def load_global_state_dict(
    module: torch.nn.Module, state: Mapping[str, Any] | None, *, root: int | None = None, strict: bool = True,
    grid: ProcessGrid | None = None,
) -> None:  # fmt: skip
    """Collective over the module's grid. Load a whole (torch-convention) state dict; each rank keeps its block.

    Modules with an ``hpctp_import_state`` hook first convert torch's entries (see the module
    docstring); then every sharded tensor takes its block (``hpctp_layout``) and every
    replicated one the whole value, through ``module.load_state_dict``.

    Parameters
    ----------
    module : torch.nn.Module
    state : mapping or None
        The global state (e.g. a single-process model's ``state_dict()``), on every rank, or
        only on ``root`` (others pass None).
    root : int, optional
        The rank holding ``state``: its blocks are scattered (one ``Scatterv`` per sharded
        tensor, one ``Bcast`` per replicated one). None: every rank holds it (no data moves).
    strict : bool
        Missing and unexpected keys are an error (as ``torch.nn.Module.load_state_dict``).
    grid : ProcessGrid, optional
        As for :func:`global_state_dict`.

    Raises
    ------
    KeyError
        With ``strict``, on missing or unexpected keys (on every rank).
    ValueError, TypeError
        On a tensor whose shape is not the global shape, a bad ``root`` or layout.
    """
    mine, where, g = _tensors(module, grid)
    error = _check_root(root, g)
    for k, t in mine.items():
        error = error or _layout_error(k, t, where[k])
        if error is None and root is not None and not isinstance(t, torch.Tensor):
            error = TypeError(f"load_global_state_dict: {k} is not a tensor; with root= only tensors travel")
    holds = root is None or (g is not None and g.rank == root) or g is None
    if holds and error is None:
        if not isinstance(state, Mapping):
            error = TypeError(f"load_global_state_dict: state must be a mapping, got {type(state).__name__}")
        else:
            state = _import(module, state)
            error = _load_errors(state, mine, strict)
    if g is None:
        if error is not None:
            raise error
    else:
        C.agree_arguments(g.comm, "load_global_state_dict", error, keys=list(mine), root=root, strict=strict)
    present = _present(g, root, state, mine)
    local: dict[str, Any] = {}
    for k, t in mine.items():
        if not present.get(k, False):
            continue
        v = state[k] if holds else None  # type: ignore[index]
        layout = _layout(t)
        if layout is not None:
            kg = where[k]
            if root is None:
                local[k] = v[layout.local_slices(kg.coords)]  # type: ignore[index, union-attr]
            else:
                src = v.detach().to(dtype=t.dtype, device=t.device).contiguous() if holds else None  # type: ignore[union-attr]
                local[k] = scatter_block(src, kg, layout, t.dtype, t, root=root)  # type: ignore[arg-type]
        elif root is None or g is None or not isinstance(t, torch.Tensor):
            local[k] = v
        else:
            buf = v.detach().to(dtype=t.dtype, device=t.device).clone().contiguous() if holds else torch.empty_like(t)  # type: ignore[union-attr]
            local[k] = C.bcast(g.comm, buf, root)
    module.load_state_dict(local, strict=strict)


def _present(g: ProcessGrid | None, root: int | None, state: Any, mine: dict[str, Any]) -> dict[str, bool]:
    """Which of the module's keys the state holds (known on every rank: sent from ``root``)."""
    if root is None or g is None:
        return {k: k in state for k in mine}
    flags = [int(k in state) for k in mine] if g.rank == root else [0] * len(mine)
    got = C.bcast_ints(g.comm, flags if g.rank == root else None, len(mine), root=root)
    return {k: bool(f) for k, f in zip(mine, got)}
