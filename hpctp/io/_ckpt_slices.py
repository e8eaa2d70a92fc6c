"""Checkpoints of a :class:`hpctp.nn.ShardedDataParallel` (stages 1-3) written and read as its slices.

The file is the plain global one (:mod:`hpctp.io.checkpoint`: every parameter a global dataset,
the optimizer state per parameter), so it restores on any plan, stage or rank count, or into a
plain model. No rank ever holds a whole parameter or its optimizer state: a data rank's slice of a
bucket holds a contiguous range of each parameter's (block's) row-major elements
(:meth:`hpctp.layout.FlatPacking.pieces`), which is a handful of boxes of the dataset
(:func:`hpctp.layout.flat_range_boxes`), shifted by the block's place in the global tensor. Saving
writes those boxes from the slice and from the optimizer's per-slice state; loading reads them
back (bytes read per rank about ``1/data_size`` of the file). Of the ranks holding the same
slice (replicas along the model grid's axes that do not split the parameter) only the primary
one writes. Parameters that are not trainable and buffers are whole on every rank and go as in a
plain checkpoint, written by data group 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import h5py
import numpy as np

from .. import comm as C
from ..comm import ProcessGrid
from ..layout import Layout, flat_range_boxes
from ._ckpt_file import (
    FORMAT,
    VERSION,
    agree_load,
    agree_save,
    as_tensor,
    check_entries,
    check_format,
    check_same_everywhere,
    check_saved_optimizer,
    check_step,
    class_name,
    read_slab,
)
from ._ckpt_state import Entry, file_dtype, groups_from_json, groups_text, storable
from ._files import check_path, native_dtype, resolve_method
from ._writer import atomic_write
from .hdf5 import create_dataset, open_for_read, read_block, write_block

if TYPE_CHECKING:
    import torch

    from ..nn.distributed._bucket import Bucket
    from ..nn.distributed.sharded import ShardedDataParallel

__all__ = ["save_slices", "load_slices", "write_slices", "Plan"]

Box = tuple[slice, ...]


@dataclass(frozen=True)
class _Piece:
    """Local. A run of one parameter's elements in this rank's slice: the dataset boxes it covers."""

    name: str  # the parameter's state_dict name
    layout: Layout | None
    global_shape: tuple[int, ...]
    at: int  # where the run starts in the slice
    boxes: tuple[Box, ...]  # in the global dataset, in flat order
    sizes: tuple[int, ...]
    writes: bool  # this rank is the primary holder of these values


def _pieces(bucket: Bucket, names: dict[int, str], mgrid: ProcessGrid) -> list[_Piece]:
    """Local. This rank's runs of the bucket's parameters, with their global boxes."""
    out = []
    for piece in bucket.pieces:
        p = bucket.params[piece.tensor]
        layout: Layout | None = getattr(p, "hpctp_layout", None)
        shape = bucket.packing.shapes[piece.tensor]
        start = [lo for lo, _ in layout.local_ranges(mgrid.coords)] if layout is not None else [0] * len(shape)
        local = flat_range_boxes(shape, piece.start, piece.stop)
        boxes = tuple(tuple(slice(o + s.start, o + s.stop) for o, s in zip(start, box)) for box in local)
        sizes = tuple(int(np.prod([s.stop - s.start for s in box])) for box in local)
        writes = layout.is_primary(mgrid.coords) if layout is not None else mgrid.rank == 0
        whole = layout.global_shape if layout is not None else shape
        out.append(_Piece(names[id(p)], layout, whole, piece.at, boxes, sizes, writes))
    return out


def _runs(piece: _Piece, flat: torch.Tensor) -> Iterator[tuple[Box, torch.Tensor]]:
    """Local. Each box of ``piece`` with its values: consecutive runs of the slice-shaped ``flat``."""
    at = piece.at
    for box, size in zip(piece.boxes, piece.sizes):
        yield box, flat[at : at + size].reshape(tuple(s.stop - s.start for s in box))
        at += size


class Plan:
    """Local. What a sharded save or load touches: datasets (metadata), this rank's pieces, the state kinds."""

    def __init__(self, sdp: ShardedDataParallel, optimizer: torch.optim.Optimizer | None) -> None:
        import torch

        from ..nn.distributed._optimizer_state import state_kinds

        self.sdp = sdp
        plan = sdp.plan
        self.mgrid = plan.model_grid
        model = sdp.module
        self.names = {id(p): n for n, p in model.named_parameters()}
        slot = {id(p): (b, i) for b in sdp.flat_buckets for i, p in enumerate(b.params)}
        self.pieces = {id(b): _pieces(b, self.names, self.mgrid) for b in sdp.flat_buckets}
        self.entries: list[Entry] = []  # every dataset (metadata); bucket parameters' values come in pieces
        self.whole: list[Entry] = []  # frozen parameters and buffers: whole on every rank
        for name, t in model.state_dict(keep_vars=True).items():
            layout = getattr(t, "hpctp_layout", None)
            if layout is not None:
                layout.check_block(t.shape, self.mgrid.dims, self.mgrid.coords, f"{name} (by its hpctp_layout)")
            entry = Entry(f"model/{name}", t, layout)
            self.entries.append(entry)
            if id(t) not in slot:
                self.whole.append(entry)
        self.kinds: dict[int, list[tuple[str, str]]] = {}
        self.groups = ""
        if optimizer is not None:
            for b in sdp.flat_buckets:
                state = optimizer.state.get(b._shard(), {})
                self.kinds[id(b)] = state_kinds(state, b)
                for p in b.params:
                    base = f"optimizer/state/{self.names[id(p)]}"
                    for key, kind in self.kinds[id(b)]:
                        if kind == "elementwise":
                            like = torch.empty(p.shape, dtype=state[key].dtype, device="meta")
                            self.entries.append(Entry(f"{base}/{key}", like, getattr(p, "hpctp_layout", None)))
                        elif kind == "tensor":
                            self.entries.append(Entry(f"{base}/{key}", state[key], None))
            every = [n for n, _ in model.named_parameters()]
            self.groups = groups_text([optimizer.param_groups[0]], [every])


def save_slices(
    path: str | os.PathLike[str], sdp: ShardedDataParallel, optimizer: torch.optim.Optimizer | None, step: int,
    method: str,
) -> None:  # fmt: skip
    """Collective over ``sdp.plan.grid``. :func:`hpctp.io.save_checkpoint` of a sharded model, by slices."""
    grid = sdp.plan.grid
    error: Exception | None = None
    fname = ""
    resolved = "serial"
    layout: Plan | None = None
    try:
        fname = check_path(path)
        check_step(step)
        resolved = resolve_method(method, grid.size)
        if optimizer is not None:
            sdp._check_optimizer(optimizer)
        _check_finished(sdp)
        layout = Plan(sdp, optimizer)
    except Exception as e:  # noqa: BLE001 - agree on every failure
        error = e
    agree_save(grid, error, fname, step, method, optimizer)
    layout = cast(Plan, layout)  # (agreed: no rank failed)
    check_same_everywhere(grid, layout.entries, layout.groups)
    scalars = _scalars(layout, optimizer) if optimizer is not None else {}
    whole = {id(e) for e in layout.whole}
    data_root = sdp.plan.data_rank == 0

    def prepare(f: h5py.File) -> None:
        f.attrs.update({"format": FORMAT, "version": VERSION, "step": int(step)})
        f.attrs.update({"grid_dims": np.asarray(layout.mgrid.dims, dtype=np.int64), "nranks": layout.mgrid.size})
        for e in layout.entries:
            ds = create_dataset(f, e.key, e.global_shape, file_dtype(e.dtype))
            ds.attrs.update({"torch_dtype": e.dtype, "sharded": e.layout is not None})
            if e.layout is not None:
                ds.attrs["split"] = _split_text(e.layout)
                ds.attrs["grid_dims"] = np.asarray(e.layout.grid_dims, dtype=np.int64)
            elif ds.size and (id(e) in whole or e.tensor.ndim == 0):  # replicated and whole here: rank 0 writes it
                write_block(ds, storable(e.tensor))
        for key, values in scalars.items():
            f.require_group(key).attrs.update(values)
        if optimizer is not None:
            f.require_group("optimizer").attrs.update({"param_groups": layout.groups, "class": class_name(optimizer)})

    def write(f: h5py.File) -> None:
        write_slices(f, layout, optimizer, data_root)

    atomic_write(grid, fname, mode="w", prepare=prepare, write=write, method=resolved)


def write_slices(f: h5py.File, layout: Plan, optimizer: torch.optim.Optimizer | None, data_root: bool) -> None:
    """Local. This rank's hyperslabs of a sharded model: its slices' runs of every parameter and per-element optimizer
    state (where it is the primary holder), and (data group 0) the whole tensors' blocks."""
    for b in layout.sdp.flat_buckets:
        flats = [("model/{}", b._shard())]
        if optimizer is not None:
            state = optimizer.state.get(b._shard(), {})
            flats += [
                (f"optimizer/state/{{}}/{k}", state[k]) for k, kind in layout.kinds[id(b)] if kind == "elementwise"
            ]
        for piece in layout.pieces[id(b)]:
            if piece.writes:
                for key, flat in flats:
                    for box, values in _runs(piece, flat):
                        write_block(f[key.format(piece.name)], storable(values), box)
    if data_root:
        for e in layout.whole:
            if e.writes(layout.mgrid):
                write_block(f[e.key], storable(e.tensor), e.selection(layout.mgrid))


def _split_text(layout: Layout) -> str:
    import json

    return json.dumps(list(layout.split))


def _scalars(layout: Plan, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """Number state as attributes of each parameter's state group (the slice's, for each of its parameters)."""
    out: dict[str, dict[str, Any]] = {}
    for b in layout.sdp.flat_buckets:
        state = optimizer.state.get(b._shard(), {})
        for key, kind in layout.kinds[id(b)]:
            if kind == "number":
                for p in b.params:
                    out.setdefault(f"optimizer/state/{layout.names[id(p)]}", {})[key] = state[key]
    return out


def _check_finished(sdp: ShardedDataParallel) -> None:
    if sdp._active:
        raise RuntimeError("ShardedDataParallel checkpoint: finish the gradients (sdp.step) first")


def load_slices(
    path: str | os.PathLike[str], sdp: ShardedDataParallel, optimizer: torch.optim.Optimizer | None, strict: bool,
    method: str, *, part: bool = False,
) -> int:  # fmt: skip
    """Collective over ``sdp.plan.grid``. :func:`hpctp.io.load_checkpoint` into a sharded model, by slices.

    ``part``: the model is a part of the saved one (a pipeline's stage): the file may hold more, and the optimizer
    (over every stage of this rank) may hold other parameters; its hyperparameters come from the saved group."""
    grid = sdp.plan.grid
    error: Exception | None = None
    fname = ""
    resolved = "serial"
    layout: Plan | None = None
    try:
        fname = check_path(path)
        resolved = resolve_method(method, grid.size)
        if optimizer is not None and not part:
            sdp._check_optimizer(optimizer)
        _check_finished(sdp)
        layout = Plan(sdp, None)
    except Exception as e:  # noqa: BLE001
        error = e
    agree_load(grid, error, fname, method, strict, optimizer)
    layout = cast(Plan, layout)
    f = open_for_read(fname, grid, resolved)
    step = 0
    try:
        try:
            step = check_format(f, fname)
            check_entries(f, fname, layout.entries, "model", strict and not part)
            shards = {id(b): _read_flat(f, "model/{}", b, layout, fname) for b in sdp.flat_buckets}
            wholes = [(e, read_slab(f[e.key], e.selection(layout.mgrid), fname)) for e in layout.whole]
            opt = _read_optimizer(f, fname, layout, optimizer, part) if optimizer is not None else None
        except Exception as e:  # noqa: BLE001
            error = e
        C.raise_if_any(grid.comm, error)
    finally:
        f.close()
    _apply(sdp, layout, optimizer, shards, wholes, opt)
    return step


def _read_flat(f: h5py.File, key: str, bucket: Bucket, layout: Plan, path: str) -> np.ndarray:
    """Local. This rank's slice of one flat tensor (the parameters, or one state key) from the file."""
    first = f[key.format(bucket.names[0])] if bucket.names else None
    dtype = native_dtype(first) if first is not None else np.dtype("float64")
    out = np.empty(bucket.hi - bucket.lo, dtype=dtype)
    for piece in layout.pieces[id(bucket)]:
        ds = f[key.format(piece.name)]
        if tuple(ds.shape) != piece.global_shape:
            raise ValueError(
                f"{path}:{ds.name} has shape {tuple(ds.shape)} but parameter {piece.name!r} has the global shape "
                f"{piece.global_shape}; load a checkpoint of the same model"
            )
        at = piece.at
        for box, size in zip(piece.boxes, piece.sizes):
            read_block(ds, out[at : at + size].reshape(tuple(s.stop - s.start for s in box)), box, path)
            at += size
    return out


def _read_optimizer(
    f: h5py.File, path: str, layout: Plan, optimizer: torch.optim.Optimizer, part: bool = False
) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """Local. The saved hyperparameters and each bucket's slice state, checked against the model."""
    check_saved_optimizer(f, path, optimizer)
    groups = groups_from_json(f["optimizer"].attrs["param_groups"], optimizer)
    every = [n for n, _ in layout.sdp.module.named_parameters()]
    fits = set(every) <= set(groups[0]["params"]) if part and len(groups) == 1 else groups[0]["params"] == every
    if len(groups) != 1 or not fits:
        raise ValueError(
            f"{path}: optimizer param groups differ: saved {[g['params'] for g in groups]}, current [{every}] "
            "(a sharded model's optimizer has one group over all its parameters); build the same model"
        )
    hyper = {k: v for k, v in groups[0].items() if k != "params"}
    states: dict[int, dict[str, Any]] = {}
    for b in layout.sdp.flat_buckets:
        keys = [_state_keys(f, f"optimizer/state/{n}") for n in b.names]
        if any(k != keys[0] for k in keys):
            raise ValueError(
                f"{path}: the parameters {b.names} have different optimizer state keys in the file ({keys}); "
                "they share one flat slice and must be stepped together"
            )
        base = f"optimizer/state/{b.names[0]}"
        if not keys[0]:
            continue
        state: dict[str, Any] = {k: v.item() if isinstance(v, np.generic) else v for k, v in f[base].attrs.items()}
        for key in sorted(k for k in keys[0] if isinstance(f[base].get(k), h5py.Dataset)):
            ds = f[f"{base}/{key}"]
            dtype = str(ds.attrs.get("torch_dtype", ds.dtype.name))
            if bool(ds.attrs.get("sharded", False)) or ds.ndim > 0:
                state[key] = as_tensor(_read_flat(f, f"optimizer/state/{{}}/{key}", b, layout, path), dtype)
            else:
                state[key] = as_tensor(read_slab(ds, (), path), dtype)
        states[id(b)] = state
    return hyper, states


def _state_keys(f: h5py.File, base: str) -> tuple[str, ...]:
    if base not in f:
        return ()
    return tuple(sorted({*f[base].keys(), *f[base].attrs.keys()}))


def _apply(
    sdp: ShardedDataParallel, layout: Plan, optimizer: torch.optim.Optimizer | None, shards: dict[int, np.ndarray],
    wholes: list[tuple[Entry, np.ndarray]], opt: tuple[dict[str, Any], dict[int, dict[str, Any]]] | None,
) -> None:  # fmt: skip
    """Collective over grid (stages 1-2 gather the whole parameters). Everything read, into the model."""
    import torch

    with torch.no_grad():
        for b in sdp.flat_buckets:
            shard = b._shard()
            shard.copy_(as_tensor(shards[id(b)], str(shard.dtype).replace("torch.", "")))
        for e, buf in wholes:
            e.tensor.copy_(as_tensor(buf, e.dtype))
    if optimizer is not None and opt is not None:
        hyper, states = opt
        optimizer.param_groups[0].update(hyper)
        for b in sdp.flat_buckets:
            shard = b._shard()
            optimizer.state.pop(shard, None)
            if id(b) in states:
                optimizer.state[shard] = {
                    k: v.to(shard.device) if isinstance(v, torch.Tensor) and v.ndim > 0 else v
                    for k, v in states[id(b)].items()
                }
    if sdp.stage in (1, 2):
        with torch.no_grad():
            for b in sdp.flat_buckets:
                b.start_gather(refresh=True)
            for b in sdp.flat_buckets:
                b.wait_gather()
