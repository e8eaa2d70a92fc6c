"""Grid-independent checkpoints: global (unsharded) HDF5 datasets plus layout metadata.

File layout (no pickle anywhere; hyperparameters are JSON text)::

    /                      attrs: format, version, step, grid_dims, nranks
    /model/<name>          every parameter and persistent buffer (state_dict names), global shape
    /optimizer             attrs: param_groups (JSON: hyperparameters and parameter names),
                           class (the optimizer's type, checked on load)
    /optimizer/state/<param>/<key>   tensor state (global shape); number state as attributes

Every tensor dataset has attributes ``torch_dtype``, ``sharded`` and, when sharded, the
``split``/``grid_dims`` it was saved with (informational: loading reads whatever hyperslab
the new layout needs). A run saved on 4 ranks as 2x2 thus restarts on any grid.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from .. import comm as C
from .._util.ints import is_int
from ..comm import ProcessGrid, check_grid
from ._ckpt_file import (
    FORMAT,
    VERSION,
    as_tensor,
    check_entries,
    check_format,
    check_same_everywhere,
    class_name,
    read_slab,
)
from ._ckpt_slices import load_slices, save_slices
from ._ckpt_state import (
    Entry,
    file_dtype,
    group_param_names,
    groups_from_json,
    groups_json,
    model_entries,
    optimizer_entries,
    param_names,
    storable,
)
from ._files import IOKeyError, check_path, resolve_method
from ._writer import atomic_write
from .hdf5 import create_dataset, open_for_read, write_block

if TYPE_CHECKING:  # torch is imported when a checkpoint is made, not with hpctp.io
    import torch

    from ..nn.distributed.sharded import ShardedDataParallel

__all__ = ["save_checkpoint", "load_checkpoint", "FORMAT", "VERSION"]


def save_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    grid: ProcessGrid,
    *,
    method: str = "auto",
) -> None:
    """Collective over grid. Save model (and optimizer) state as global datasets, atomically.

    Sharded tensors (``hpctp_layout`` parameters, and optimizer state shaped like them)
    are written as one global dataset by their primary owners; replicated ones by rank 0.

    Parameters
    ----------
    path : str or os.PathLike
        Checkpoint file; replaced atomically (a failed save leaves the old one).
    model : torch.nn.Module
        Or a :class:`hpctp.nn.ShardedDataParallel` (any stage): the file is then that of its
        inner model and the optimizer state cut per parameter (the same file as for the model
        unwrapped). Stages 1-3 write each rank's slices as hyperslabs of those datasets
        (:mod:`hpctp.io._ckpt_slices`), so no rank holds a whole parameter; stage 0's data
        group 0 writes its blocks.
    optimizer : torch.optim.Optimizer or None
    step : int
        Training step to resume from; returned by :func:`load_checkpoint`.
    grid : ProcessGrid
        The grid the sharded parameters' layouts refer to (a ShardedDataParallel's ``plan.grid``).
    method : {"auto", "mpio", "serial"}
        As for :func:`hpctp.io.save_hdf5`.

    Raises
    ------
    TypeError
        If state holds something other than tensors and numbers, or a bad ``hpctp_layout``.
    ValueError
        On a negative step, layouts that do not match the grid or blocks, or models that
        differ between ranks.
    FileNotFoundError, OSError
        If the directory is missing or writing fails.
    All raised on every rank.
    """
    grid = check_grid(grid)
    sharded = _sharded(model, grid)
    if sharded is not None:
        _save_sharded(path, sharded, optimizer, step, method)
        return
    error: Exception | None = None
    entries: list[Entry] = []
    scalars: dict[str, dict[str, Any]] = {}
    groups = ""
    fname = ""
    try:
        fname = check_path(path)
        _check_modules(model, optimizer)
        if not is_int(step) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        resolved = resolve_method(method, grid.size)
        entries = model_entries(model, grid)
        if optimizer is not None:
            opt_entries, scalars = optimizer_entries(model, optimizer, grid)
            entries += opt_entries
            groups = groups_json(model, optimizer)
    except Exception as e:  # noqa: BLE001 - agree on every failure
        error = e
    C.agree_arguments(
        grid.comm,
        "save_checkpoint",
        error,
        path=os.path.abspath(fname),
        step=step,
        method=method,
        optimizer=optimizer is not None,
    )
    check_same_everywhere(grid, entries, groups)

    def prepare(f: h5py.File) -> None:
        f.attrs.update({"format": FORMAT, "version": VERSION, "step": int(step)})
        f.attrs.update({"grid_dims": np.asarray(grid.dims, dtype=np.int64), "nranks": grid.size})
        for e in entries:
            ds = create_dataset(f, e.key, e.global_shape, file_dtype(e.dtype))
            ds.attrs.update({"torch_dtype": e.dtype, "sharded": e.layout is not None})
            if e.layout is not None:
                ds.attrs["split"] = json.dumps(list(e.layout.split))
                ds.attrs["grid_dims"] = np.asarray(e.layout.grid_dims, dtype=np.int64)
            elif ds.size:
                write_block(ds, storable(e.tensor))
        for key, values in scalars.items():
            f.require_group(key).attrs.update(values)
        if optimizer is not None:
            f.require_group("optimizer").attrs.update({"param_groups": groups, "class": class_name(optimizer)})

    mine = [e for e in entries if e.writes(grid)]

    def write(f: h5py.File) -> None:
        for e in mine:
            write_block(f[e.key], storable(e.tensor), e.selection(grid))

    atomic_write(grid, fname, mode="w", prepare=prepare, write=write if mine else None, method=resolved)


def _sharded(model: object, grid: ProcessGrid) -> ShardedDataParallel | None:
    """Collective over grid. ``model`` if it is a ShardedDataParallel of ``grid`` (checked on every rank), else None."""
    from ..nn.distributed.sharded import (
        ShardedDataParallel,  # here: hpctp.nn loads torch, which importing hpctp.io does not
    )

    if not isinstance(model, ShardedDataParallel):
        return None
    error = None
    if model.plan.grid is not grid:
        error = ValueError(
            f"a ShardedDataParallel's checkpoint needs its plan's grid (dims {model.plan.grid.dims}) as grid, "
            f"got another grid of dims {grid.dims}; pass sdp.plan.grid"
        )
    C.raise_if_any(grid.comm, error)
    return model


def _save_sharded(
    path: str | os.PathLike[str],
    sdp: ShardedDataParallel,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    method: str,
) -> None:
    """Collective over grid. Stages 1-3: every rank writes its slices (:mod:`hpctp.io._ckpt_slices`); stage 0
    (whole model on every rank): data group 0 saves the inner model."""
    if sdp.stage >= 1:
        save_slices(path, sdp, optimizer, step, method)
        return
    plan = sdp.plan
    error: Exception | None = None
    if plan.data_rank == 0:
        try:
            save_checkpoint(path, sdp.module, optimizer, step, plan.model_grid, method=method)
        except Exception as e:  # noqa: BLE001 - the other data groups raise it too
            error = e
    C.raise_if_any(plan.grid.comm, error)


def _load_sharded(
    path: str | os.PathLike[str],
    sdp: ShardedDataParallel,
    optimizer: torch.optim.Optimizer | None,
    strict: bool,
    method: str,
) -> int:
    """Collective over grid. Stages 1-3: every rank reads its slices; stage 0: every data group reads its blocks."""
    if sdp.stage >= 1:
        return load_slices(path, sdp, optimizer, strict, method)
    plan = sdp.plan
    step = 0
    error: Exception | None = None
    try:
        step = load_checkpoint(path, sdp.module, optimizer, plan.model_grid, strict=strict, method=method)
    except Exception as e:  # noqa: BLE001 - agreed over the whole grid
        error = e
    C.raise_if_any(plan.grid.comm, error)
    return step


def _check_modules(model: object, optimizer: object) -> None:
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")


def load_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    grid: ProcessGrid,
    *,
    strict: bool = True,
    method: str = "auto",
) -> int:
    """Collective over grid. Restore a checkpoint into ``model``'s (and ``optimizer``'s) current layouts.

    Each rank reads only the hyperslabs its tensors hold, so a checkpoint saved on any
    grid loads on any other. The model is changed only after everything was read and
    validated on every rank.

    Parameters
    ----------
    path : str or os.PathLike
    model : torch.nn.Module
        Sharded parameters carry ``hpctp_layout`` for this grid. Or a
        :class:`hpctp.nn.ShardedDataParallel` (any stage, any plan; ``grid`` its ``plan.grid``):
        stages 1-3 read only each rank's slices of the parameters and of the optimizer state
        (about ``1/data_size`` of the file per rank); stage 0's data groups read their blocks.
    optimizer : torch.optim.Optimizer or None
        Built over the model's parameters with the same param groups as when saved
        (for a ShardedDataParallel: over ``sdp.parameters()``).
    grid : ProcessGrid
    strict : bool
        Also fail on tensors in the file that the model does not have.
    method : {"auto", "mpio", "serial"}
        As for :func:`hpctp.io.load_hdf5`.

    Returns
    -------
    int
        The saved training step.

    Raises
    ------
    FileNotFoundError
        If the file does not exist.
    KeyError
        On missing (or, if ``strict``, unexpected) tensors, or missing optimizer state.
    ValueError
        On a file that is not a checkpoint, global shape or dtype mismatches, or
        optimizer param groups that differ from the saved ones.
    OSError
        If the file is corrupt.
    All raised on every rank; nothing is modified then.
    """
    grid = check_grid(grid)
    sharded = _sharded(model, grid)
    if sharded is not None:
        return _load_sharded(path, sharded, optimizer, strict, method)
    error: Exception | None = None
    fname = ""
    try:
        fname = check_path(path)
        _check_modules(model, optimizer)
        resolved = resolve_method(method, grid.size)
    except (TypeError, ValueError) as e:
        error = e
    C.agree_arguments(
        grid.comm,
        "load_checkpoint",
        error,
        path=os.path.abspath(fname),
        method=method,
        strict=strict,
        optimizer=optimizer is not None,
    )
    f = open_for_read(fname, grid, resolved)
    try:
        step = 0
        values: list[tuple[Entry, np.ndarray]] = []
        opt_state: dict[str, Any] | None = None
        try:
            step = check_format(f, fname)
            entries = model_entries(model, grid)
            check_entries(f, fname, entries, "model", strict)
            values = [(e, _read(f, e, grid, fname)) for e in entries]
            if optimizer is not None:
                opt_state = _read_optimizer(f, fname, model, optimizer, grid)
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


def _read(f: h5py.File, e: Entry, grid: ProcessGrid, path: str) -> np.ndarray:
    return read_slab(f[e.key], e.selection(grid), path)


def _read_optimizer(
    f: h5py.File, path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grid: ProcessGrid
) -> dict[str, Any]:
    if "optimizer" not in f:
        raise IOKeyError(f"{path} holds no optimizer state; pass optimizer=None to load the model only")
    saved_class = f["optimizer"].attrs.get("class", None)
    if saved_class is not None and str(saved_class) != class_name(optimizer):
        raise ValueError(
            f"{path}: optimizer state was saved from {saved_class}, but the optimizer is {class_name(optimizer)}; "
            f"build the same optimizer type, or pass optimizer=None to load the model only"
        )
    saved_groups = groups_from_json(f["optimizer"].attrs["param_groups"], optimizer)
    current = group_param_names(model, optimizer)
    saved_names = [g["params"] for g in saved_groups]
    if saved_names != current:
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
