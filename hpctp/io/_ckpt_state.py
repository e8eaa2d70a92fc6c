"""What a checkpoint holds: model tensors and optimizer state as (file key, tensor, layout) entries.

A tensor is *sharded* when it is a block of a larger global tensor: a parameter or buffer
with the attribute ``hpctp_layout``, or an optimizer state tensor shaped like such a
parameter's block (Adam's ``exp_avg`` ...). Sharded entries are stored as one global
dataset; everything else is replicated and written by rank 0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._util.dtypes import dtype_name
from ..comm import ProcessGrid
from ..layout import Layout

if TYPE_CHECKING:  # torch is imported when a checkpoint is made, not with hpctp.io
    import torch

__all__ = [
    "Entry",
    "model_entries",
    "optimizer_entries",
    "param_names",
    "groups_json",
    "groups_text",
    "groups_from_json",
]


@dataclass
class Entry:
    """Local. One tensor of a checkpoint: its key in the file, local data and global layout."""

    key: str
    tensor: torch.Tensor
    layout: Layout | None  # None: replicated

    @property
    def global_shape(self) -> tuple[int, ...]:
        """Local. Shape of the stored (global) dataset."""
        return self.layout.global_shape if self.layout is not None else tuple(self.tensor.shape)

    @property
    def dtype(self) -> str:
        """Local. Canonical dtype name of the tensor (e.g. ``"float64"``)."""
        return dtype_name(self.tensor.dtype)

    def selection(self, grid: ProcessGrid) -> tuple[slice, ...]:
        """Local. Hyperslab of this rank's block in the global dataset (everything if replicated)."""
        if self.layout is None:
            return tuple(slice(0, n) for n in self.tensor.shape)
        return self.layout.local_slices(grid.coords)

    def writes(self, grid: ProcessGrid) -> bool:
        """Local. True when this rank writes the entry's hyperslab in the parallel phase."""
        return (
            self.layout is not None
            and self.layout.is_primary(grid.coords)
            and math.prod(self.layout.local_shape(grid.coords)) > 0
        )


def storable(t: torch.Tensor) -> np.ndarray:
    """Local. A contiguous host array with the tensor's bits (bfloat16 as int16)."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return np.asarray(t.cpu().resolve_conj().numpy(), order="C")  # 0-d stays 0-d


def file_dtype(torch_dtype: str) -> np.dtype:
    """Local. The HDF5 (numpy) dtype used to store a tensor of ``torch_dtype``."""
    return np.dtype("int16") if torch_dtype == "bfloat16" else np.dtype(torch_dtype)


def _layout_of(t: torch.Tensor, name: str, grid: ProcessGrid) -> Layout | None:
    layout = getattr(t, "hpctp_layout", None)
    if layout is None:
        return None
    if not isinstance(layout, Layout):
        raise TypeError(f"{name}.hpctp_layout must be a hpctp.Layout, got {type(layout).__name__}")
    layout.check_block(t.shape, grid.dims, grid.coords, f"{name} (by its hpctp_layout)")
    return layout


def model_entries(model: torch.nn.Module, grid: ProcessGrid) -> list[Entry]:
    """Local. Parameters and persistent buffers of ``model`` (``state_dict`` names, under ``model/``).

    Raises
    ------
    TypeError, ValueError
        If a ``hpctp_layout`` is not a Layout, or does not match the grid or the block's shape.
    """
    import torch

    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"model state {name!r} is a {type(t).__name__}, not a tensor")
        out.append(Entry(f"model/{name}", t, _layout_of(t, name, grid)))
    return out


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """Local. ``id(parameter) -> name`` (the first name of a shared parameter)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def group_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Local. Names of each optimizer group's parameters.

    Raises
    ------
    ValueError
        If the optimizer holds a parameter that is not one of the model's.
    """
    names = param_names(model)
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        row = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"optimizer param_groups[{gi}] holds a parameter that is not in the model")
            row.append(names[id(p)])
        out.append(row)
    return out


def optimizer_entries(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, grid: ProcessGrid
) -> tuple[list[Entry], dict[str, dict[str, Any]]]:
    """Local. Tensor state (as entries under ``optimizer/state/<param>/<key>``) and scalar state.

    Returns
    -------
    entries : list of Entry
    scalars : dict
        ``{group path: {key: number}}`` for non-tensor state values (stored as attributes).

    Raises
    ------
    TypeError
        For state values that are neither tensors nor numbers.
    """
    import torch

    names = param_names(model)
    entries: list[Entry] = []
    scalars: dict[str, dict[str, Any]] = {}
    group_param_names(model, optimizer)  # validates membership
    for group in optimizer.param_groups:
        for p in group["params"]:
            pname = names[id(p)]
            base = f"optimizer/state/{pname}"
            player = _layout_of(p, pname, grid)
            for key, val in optimizer.state.get(p, {}).items():
                if isinstance(val, torch.Tensor):
                    sharded = player is not None and tuple(val.shape) == tuple(p.shape) and val.ndim > 0
                    entries.append(Entry(f"{base}/{key}", val, player if sharded else None))
                elif isinstance(val, (bool, int, float, np.number)):
                    scalars.setdefault(base, {})[key] = val
                else:
                    raise TypeError(
                        f"optimizer state {pname}/{key} is a {type(val).__name__}; only tensors and numbers "
                        f"can be checkpointed"
                    )
    return entries, scalars


def _plain(value: Any, where: str) -> Any:
    import torch

    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"optimizer hyperparameter {where} is a {type(value).__name__}; cannot store it in a checkpoint")


def groups_json(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """Local. The optimizer's param_groups as JSON: hyperparameters plus parameter names."""
    return groups_text(optimizer.param_groups, group_param_names(model, optimizer))


def groups_text(groups: list[dict[str, Any]], names: list[list[str]]) -> str:
    """Local. Param groups as JSON: each group's hyperparameters (``params`` left out) plus ``names``.

    Raises
    ------
    TypeError
        If a hyperparameter cannot be stored (not a number, string, bool, None or list of them).
    """
    out = []
    for gi, (group, group_names) in enumerate(zip(groups, names, strict=True)):
        g = {k: _plain(v, f"{k} of group {gi}") for k, v in group.items() if k != "params"}
        g["params"] = group_names
        out.append(g)
    return json.dumps(out, sort_keys=True)


def groups_from_json(text: str, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Local. Saved param_groups with list values turned back into tuples where the optimizer uses tuples."""
    groups = json.loads(text)
    for saved, current in zip(groups, optimizer.param_groups, strict=False):  # lengths checked by the caller
        for k, v in saved.items():
            if isinstance(v, list) and isinstance(current.get(k), tuple):
                saved[k] = tuple(v)
    return groups
