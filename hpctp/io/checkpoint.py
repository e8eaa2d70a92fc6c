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
from typing import TYPE_CHECKING, Any, TypeVar

import h5py
import numpy as np

from .. import comm as C
from ..comm import ProcessGrid, check_grid
from ._ckpt_file import (
    FORMAT,
    VERSION,
    agree_save,
    check_same_everywhere,
    check_step,
    class_name,
)
from ._ckpt_pipeline import load_pipeline, save_pipeline
from ._ckpt_plain import check_modules, load_plain
from ._ckpt_slices import load_slices, save_slices
from ._ckpt_state import (
    Entry,
    file_dtype,
    groups_json,
    model_entries,
    optimizer_entries,
    storable,
)
from ._files import check_path, resolve_method
from ._writer import atomic_write
from .hdf5 import create_dataset, write_block

if TYPE_CHECKING:  # torch is imported when a checkpoint is made, not with hpctp.io
    import torch

    from ..nn.distributed.sharded import ShardedDataParallel
    from ..nn.pipeline_parallel.runtime import PipelineParallel

__all__ = ["save_checkpoint", "load_checkpoint", "FORMAT", "VERSION"]

W = TypeVar("W")


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
    pipe = _pipeline(model, grid)
    if pipe is not None:
        save_pipeline(path, pipe, optimizer, step, method)
        return
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
        check_modules(model, optimizer)
        check_step(step)
        resolved = resolve_method(method, grid.size)
        entries = model_entries(model, grid)
        if optimizer is not None:
            opt_entries, scalars = optimizer_entries(model, optimizer, grid)
            entries += opt_entries
            groups = groups_json(model, optimizer)
    except Exception as e:  # noqa: BLE001 - agree on every failure
        error = e
    agree_save(grid, error, fname, step, method, optimizer)
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
    from ..nn.distributed.sharded import ShardedDataParallel  # here: hpctp.nn loads torch, importing hpctp.io does not

    return _wrapper(model, grid, ShardedDataParallel, "sdp")


def _pipeline(model: object, grid: ProcessGrid) -> PipelineParallel | None:
    """Collective over grid. ``model`` if it is a PipelineParallel of ``grid`` (checked on every rank), else None."""
    from ..nn.pipeline_parallel.runtime import PipelineParallel  # here: hpctp.nn loads torch

    return _wrapper(model, grid, PipelineParallel, "pipe")


def _wrapper(model: object, grid: ProcessGrid, cls: type[W], name: str) -> W | None:
    """Collective over grid. ``model`` if it is a ``cls`` (a wrapper with a ``plan``) on ``grid``, else None.

    Raises
    ------
    ValueError
        On every rank, if the wrapper's plan is on another grid.
    """
    if not isinstance(model, cls):
        return None
    error = None
    mine = model.plan.grid  # type: ignore[attr-defined]
    if mine is not grid:
        error = ValueError(
            f"a {cls.__name__}'s checkpoint needs its plan's grid (dims {mine.dims}) as grid, got another grid of "
            f"dims {grid.dims}; pass {name}.plan.grid"
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
    pipe = _pipeline(model, grid)
    if pipe is not None:
        return load_pipeline(path, pipe, optimizer, strict, method)
    sharded = _sharded(model, grid)
    if sharded is not None:
        return _load_sharded(path, sharded, optimizer, strict, method)
    return load_plain(path, model, optimizer, grid, strict, method)
