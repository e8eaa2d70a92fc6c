"""Loading a plain model's checkpoint: each rank reads the hyperslabs of its blocks (see :mod:`hpctp.io.checkpoint`).

Shared by :func:`hpctp.io.load_checkpoint` and the stages of a pipeline (``part``: a model that is part of the saved one).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from .. import comm as C
from ..comm import ProcessGrid
from ._ckpt_file import agree_load, as_tensor, check_entries, check_format, check_saved_optimizer, read_slab
from ._ckpt_state import Entry, group_param_names, groups_from_json, model_entries, param_names
from ._files import IOKeyError, check_path, resolve_method
from .hdf5 import open_for_read

if TYPE_CHECKING:
    import torch

__all__ = ["load_plain", "check_modules"]


def load_plain(
    path: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, grid: ProcessGrid,
    strict: bool, method: str, *, part: bool = False,
) -> int:  # fmt: skip
    """Collective over grid. :func:`load_checkpoint` of a plain model; ``part``: the model is a part of the saved one
    (a pipeline's stages on this rank): the file may hold more, and the optimizer's groups lie inside saved ones."""
    error: Exception | None = None
    fname = ""
    try:
        fname = check_path(path)
        check_modules(model, optimizer)
        resolved = resolve_method(method, grid.size)
    except (TypeError, ValueError) as e:
        error = e
    agree_load(grid, error, fname, method, strict, optimizer)
    f = open_for_read(fname, grid, resolved)
    try:
        step = 0
        values: list[tuple[Entry, np.ndarray]] = []
        opt_state: dict[str, Any] | None = None
        try:
            step = check_format(f, fname)
            entries = model_entries(model, grid)
            check_entries(f, fname, entries, "model", strict and not part)
            values = [(e, _read(f, e, grid, fname)) for e in entries]
            if optimizer is not None:
                opt_state = _read_optimizer(f, fname, model, optimizer, grid, part)
        except Exception as e:  # noqa: BLE001
            error = e
        C.raise_if_any(grid.comm, error)
    finally:
        f.close()
    import torch

    try:
        with torch.no_grad():
            for entry, buf in values:
                entry.tensor.copy_(as_tensor(buf, entry.dtype))
        if optimizer is not None and opt_state is not None:
            optimizer.load_state_dict(opt_state)
    except Exception as e:  # noqa: BLE001 - validated above, so not expected; still agree
        error = e
    C.raise_if_any(grid.comm, error)
    return step


def check_modules(model: object, optimizer: object) -> None:
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")


def _read(f: h5py.File, e: Entry, grid: ProcessGrid, path: str) -> np.ndarray:
    return read_slab(f[e.key], e.selection(grid), path)


def _read_optimizer(
    f: h5py.File,
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    grid: ProcessGrid,
    part: bool = False,
) -> dict[str, Any]:
    check_saved_optimizer(f, path, optimizer)
    saved_groups = groups_from_json(f["optimizer"].attrs["param_groups"], optimizer)
    current = group_param_names(model, optimizer)
    saved_names = [g["params"] for g in saved_groups]
    if part:  # each current group's parameters inside one saved group: its hyperparameters
        homes = [next((g for g in saved_groups if set(names) <= set(g["params"])), None) for names in current]
        if any(h is None for h in homes):
            raise ValueError(
                f"{path}: optimizer param groups differ: the groups {current} are not parts of the saved {saved_names}; "
                "build the optimizer with parameter groups that are parts of those when saving"
            )
        saved_groups = [{**h, "params": names} for h, names in zip(homes, current)]  # type: ignore[dict-item]
    elif saved_names != current:
        raise ValueError(
            f"{path}: optimizer param groups differ: saved {saved_names}, current {current}; "
            f"build the optimizer with the same parameter groups as when saving"
        )
    names = param_names(model)
    state: dict[int, dict[str, Any]] = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            base = f"optimizer/state/{names[id(p)]}"
            if base in f:
                state[index] = _read_param_state(f, base, p, grid, path)
            index += 1
    groups = []
    start = 0
    for g in saved_groups:
        n = len(g["params"])
        groups.append({**g, "params": list(range(start, start + n))})
        start += n
    return {"state": state, "param_groups": groups}


def _read_param_state(f: h5py.File, base: str, p: torch.Tensor, grid: ProcessGrid, path: str) -> dict[str, Any]:
    """Number state from attributes; tensors shaped like ``p`` follow its layout, others are read whole."""
    out: dict[str, Any] = {k: v.item() if isinstance(v, np.generic) else v for k, v in f[base].attrs.items()}
    layout = getattr(p, "hpctp_layout", None)
    for key, ds in f[base].items():
        if not isinstance(ds, h5py.Dataset):
            raise IOKeyError(f"{path}:{base}/{key} is a group, expected optimizer state tensors")
        gshape = layout.global_shape if layout is not None else tuple(p.shape)
        if bool(ds.attrs.get("sharded", False)) and tuple(ds.shape) != gshape:
            raise ValueError(
                f"{path}:{base}/{key} has shape {tuple(ds.shape)} but the parameter's global shape is {gshape}"
            )
        sharded = bool(ds.attrs.get("sharded", tuple(ds.shape) == gshape))  # saved flag; older files: by shape
        if layout is not None and ds.ndim > 0 and sharded:
            sel = layout.local_slices(grid.coords)  # sharded like the parameter: follow its layout
        else:
            sel = tuple(slice(0, n) for n in ds.shape)
        dtype = str(ds.attrs.get("torch_dtype", ds.dtype.name))
        out[key] = as_tensor(read_slab(ds, sel, path), dtype)
    return out
