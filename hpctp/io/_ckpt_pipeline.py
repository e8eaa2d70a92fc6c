"""Checkpoints of a :class:`hpctp.nn.PipelineParallel`: the plain global file of the whole model, from its stages.

Each rank holds its stages' layers, whose state-dict names are the whole model's (the layers keep their indices),
so the file is the one a single process saves (:mod:`hpctp.io.checkpoint`) and restores on another pipeline
size, plan or stage, or into a plain model. Saving: the ranks of a pipeline describe their datasets to each
other (one exchange of names, shapes, dtypes, layouts and 0-d values over the pipeline axis), rank 0 lays out
every dataset, and each rank writes its stages' hyperslabs (plain stages: the blocks of data group 0's primary
holders; ZeRO stages: every rank its slices, :mod:`hpctp.io._ckpt_slices`). Loading: every rank reads its own
stages' entries (the plain or the sliced way) and its optimizer's state; an optimizer over a rank's stages
takes its hyperparameters from the saved group. ``strict`` compares the file with the union of the stages.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from .. import comm as C
from ._ckpt_file import FORMAT, VERSION, agree_save, check_step, class_name
from ._ckpt_plain import load_plain
from ._ckpt_slices import Plan, load_slices, write_slices
from ._ckpt_state import Entry, file_dtype, model_entries, optimizer_entries, storable
from ._files import IOKeyError, check_path, resolve_method
from ._writer import atomic_write
from .hdf5 import create_dataset, open_for_read, write_block

if TYPE_CHECKING:
    import torch

    from ..nn.pipeline_parallel.runtime import PipelineParallel

__all__ = ["save_pipeline", "load_pipeline"]


def _layers(pipe: PipelineParallel) -> Any:
    """Local. This rank's plain stages' layers in one module, under the whole model's names."""
    import torch

    holder = torch.nn.Module()
    for s in pipe.stages:
        for name, layer in pipe.modules_of[s].named_children():
            holder.add_module(name, layer)
    return holder


def _describe(e: Entry) -> dict[str, Any]:
    out: dict[str, Any] = {"key": e.key, "shape": list(e.global_shape), "dtype": e.dtype}
    if e.layout is not None:
        out["split"] = json.dumps(list(e.layout.split))
        out["grid_dims"] = list(e.layout.grid_dims)
    elif e.tensor.ndim == 0:
        out["value"] = storable(e.tensor).tolist()
    return out


def _own(pipe: PipelineParallel, optimizer: torch.optim.Optimizer | None) -> tuple[list[Entry], dict[str, Any], list[Callable[[h5py.File], None]]]:  # fmt: skip
    """Local. This rank's datasets, number state (attributes) and hyperslab writes."""
    plan = pipe.plan
    mgrid = plan.model_grid
    data_root = plan.data_rank == 0
    writes: list[Callable[[h5py.File], None]] = []
    scalars: dict[str, dict[str, Any]] = {}
    if pipe.zero is None:
        holder = _layers(pipe)
        entries = model_entries(holder, mgrid)
        if optimizer is not None:
            opt_entries, scalars = optimizer_entries(holder, optimizer, mgrid)
            entries += opt_entries
        for e in entries:
            if e.layout is not None:
                mine = data_root and e.writes(mgrid)
            else:
                mine = data_root and mgrid.rank == 0 and e.tensor.ndim > 0
            if mine:
                writes.append(partial(_write_entry, e=e, selection=e.selection(mgrid)))
        return entries, scalars, writes
    entries = []
    for s in pipe.stages:
        sdp: Any = pipe.modules_of[s]
        layout = Plan(sdp, optimizer)
        entries += layout.entries
        writes.append(partial(write_slices, layout=layout, optimizer=optimizer, data_root=data_root))
        if optimizer is not None:
            for b in sdp.flat_buckets:
                state = optimizer.state.get(b._shard(), {})
                for key, kind in layout.kinds[id(b)]:
                    if kind == "number":
                        for n in b.names:
                            scalars.setdefault(f"optimizer/state/{n}", {})[key] = state[key]
        for e in layout.whole:  # frozen parameters and buffers: whole, replicated ones written in the parallel phase
            if e.layout is None and e.tensor.ndim > 0 and data_root and mgrid.rank == 0:
                writes.append(partial(_write_entry, e=e, selection=None))
    return entries, scalars, writes


def _write_entry(f: h5py.File, e: Entry, selection: Any) -> None:
    """Local. One tensor's block (``selection``) or the whole tensor (None) into its dataset."""
    if selection is None:
        write_block(f[e.key], storable(e.tensor))
    else:
        write_block(f[e.key], storable(e.tensor), selection)


def _exchange(pipe: PipelineParallel, text: str) -> list[dict[str, Any]]:
    """Collective over the pipeline axis. Every stage's description (JSON text; no pickle)."""
    comm = pipe.plan.pipeline_comm
    raw = np.frombuffer(text.encode(), dtype=np.uint8)
    counts = [int(c) for c in C.allgather_ints(comm, [raw.size])[:, 0]]
    whole = np.empty(sum(counts), dtype=np.uint8)
    C.allgatherv(comm, raw, whole, counts)
    out, at = [], 0
    for n in counts:
        out.append(json.loads(whole[at : at + n].tobytes().decode()))
        at += n
    return out


def save_pipeline(
    path: str | os.PathLike[str], pipe: PipelineParallel, optimizer: torch.optim.Optimizer | None, step: int,
    method: str,
) -> None:  # fmt: skip
    """Collective over ``pipe.plan.grid``. :func:`hpctp.io.save_checkpoint` of a pipeline (see the module docstring)."""
    plan = pipe.plan
    grid = plan.grid
    error: Exception | None = None
    fname, resolved, text = "", "serial", "{}"
    writes: list[Callable[[h5py.File], None]] = []
    try:
        fname = check_path(path)
        check_step(step)
        resolved = resolve_method(method, grid.size)
        entries, scalars, writes = _own(pipe, optimizer)
        names = [n for n, _ in _layers(pipe).named_parameters()] if pipe.zero is None else [
            n for s in pipe.stages for n, _ in pipe.modules_of[s].module.named_parameters()  # type: ignore[union-attr]
        ]  # fmt: skip
        hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"} if optimizer is not None else {}
        if optimizer is not None and len(optimizer.param_groups) != 1:
            raise ValueError("save_checkpoint of a PipelineParallel: the optimizer must have one param group")
        text = json.dumps({"entries": [_describe(e) for e in entries], "scalars": scalars, "names": names,
                           "hyper": {k: (v.item() if hasattr(v, "item") else v) for k, v in hyper.items()}},
                          default=lambda v: v.item() if hasattr(v, "item") else str(v))  # fmt: skip
    except Exception as e:  # noqa: BLE001 - agree on every failure
        error = e
    agree_save(grid, error, fname, step, method, optimizer)
    stages = _exchange(pipe, text)
    error = None
    if len({json.dumps(d["hyper"], sort_keys=True) for d in stages}) > 1:
        error = ValueError(
            "save_checkpoint of a PipelineParallel: the stages' optimizers have different hyperparameters"
        )
    C.raise_if_any(grid.comm, error)
    datasets: dict[str, dict[str, Any]] = {}
    for d in stages:
        for item in d["entries"]:
            datasets.setdefault(item["key"], item)
    layer = {name: i for i, name in enumerate(pipe.layer_names)}  # (the whole model's parameter order)
    order = {n: i for d in stages for i, n in enumerate(d["names"])}
    every = sorted(order, key=lambda n: (layer[n.split(".", 1)[0]], order[n]))
    groups = json.dumps([{**stages[0]["hyper"], "params": every}], sort_keys=True)

    def prepare(f: h5py.File) -> None:
        f.attrs.update({"format": FORMAT, "version": VERSION, "step": int(step)})
        f.attrs.update({"grid_dims": np.asarray(plan.model_grid.dims, dtype=np.int64), "nranks": grid.size})
        for key, item in datasets.items():
            ds = create_dataset(f, key, tuple(item["shape"]), file_dtype(item["dtype"]))
            ds.attrs.update({"torch_dtype": item["dtype"], "sharded": "split" in item})
            if "split" in item:
                ds.attrs["split"] = item["split"]
                ds.attrs["grid_dims"] = np.asarray(item["grid_dims"], dtype=np.int64)
            elif "value" in item:  # (0-d: rank 0 writes it while laying out the file)
                write_block(ds, np.asarray(item["value"], dtype=file_dtype(item["dtype"])))
        for d in stages:
            for key, values in d["scalars"].items():
                f.require_group(key).attrs.update(values)
        if optimizer is not None:
            f.require_group("optimizer").attrs.update({"param_groups": groups, "class": class_name(optimizer)})

    def write(f: h5py.File) -> None:
        for w in writes:
            w(f)

    atomic_write(grid, fname, mode="w", prepare=prepare, write=write, method=resolved)


def load_pipeline(
    path: str | os.PathLike[str], pipe: PipelineParallel, optimizer: torch.optim.Optimizer | None, strict: bool,
    method: str,
) -> int:  # fmt: skip
    """Collective over ``pipe.plan.grid``. :func:`hpctp.io.load_checkpoint` into a pipeline (see the module docstring).

    Raises
    ------
    KeyError
        With ``strict``, if the file holds model tensors no stage has (on every rank).
    """
    plan = pipe.plan
    if strict:
        _check_union(path, pipe)
    if pipe.zero is None:
        step = load_plain(path, _layers(pipe), optimizer, plan.model_grid, False, method, part=True)
        C.raise_if_any(plan.grid.comm, None)  # (every stage restored before any rank goes on)
        return step
    step = 0
    for s in pipe.stages:
        step = load_slices(path, pipe.modules_of[s], optimizer, False, method, part=True)  # type: ignore[arg-type]
    return step


def _check_union(path: str | os.PathLike[str], pipe: PipelineParallel) -> None:
    """Collective over grid. The file's model tensors are exactly those of the stages together."""
    grid = pipe.plan.grid
    mine = [k for s in pipe.stages for k in (_inner(pipe.modules_of[s]).state_dict())]
    every = {k for d in _exchange(pipe, json.dumps({"keys": mine})) for k in d["keys"]}
    error: Exception | None = None
    fname = ""
    try:
        fname = check_path(path)
    except Exception as e:  # noqa: BLE001
        error = e
    C.raise_if_any(grid.comm, error)
    f = open_for_read(fname, grid, resolve_method("serial", grid.size))
    try:
        present: set[str] = set()
        if "model" in f:
            f["model"].visititems(lambda n, o: present.add(n) if isinstance(o, h5py.Dataset) else None)
        extra = sorted(present - every)
        if extra:
            error = IOKeyError(
                f"{fname} holds model tensors no stage of the pipeline has: {extra[:8]}; build the same model, or pass "
                "strict=False"
            )
    finally:
        f.close()
    C.raise_if_any(grid.comm, error)


def _inner(module: Any) -> Any:
    return getattr(module, "module", module)
