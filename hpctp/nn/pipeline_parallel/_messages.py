"""What crosses a stage boundary: activations forward, their gradients back, and their shapes once.

A boundary joins stage ``s`` (on pipeline rank ``s % p``) and stage ``s + 1``; every rank of a model grid
talks to the rank of the same model-grid coordinates on the neighbouring stage, over the plan's pipeline
communicator, so a DistTensor activation (a field split over the spatial axes, tokens over the tensor
axis) moves block by block, in its layout. The first time a boundary carries a micro-batch of a size, the
sender describes the activation (local shape, dtype, the DistTensor's global layout) in one small message
(:data:`hpctp.comm.tags.PIPELINE_META`); both sides remember it, so later steps send only the data, one
message per micro-batch and tensor each way (an activation may be a tuple of tensors: a U-Net's skip connections,
a model's input carried to its residual output) (:data:`~hpctp.comm.tags.PIPELINE_ACTIVATION`,
:data:`~hpctp.comm.tags.PIPELINE_GRADIENT`). Messages of one kind between two ranks match in the order
they were sent (the schedule's lowering writes them so), so a tag per kind is all the matching needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ... import comm as C
from ..._util.dtypes import dtype_code, dtype_from_code
from ...comm import Pending, tags
from ...layout import Layout, grid_coords
from ...tensor.core import DistTensor

__all__ = ["Part", "Described", "describe", "moved", "blocks_of", "receive_description", "META_INTS"]

META_INTS = 512
"""Length of a description message (int64): for each tensor of the activation its local shape, dtype, and a
DistTensor's global shape, split and cuts."""


@dataclass(frozen=True)
class Part:
    """Local. One tensor of an activation as the receiver rebuilds it: its block's shape and dtype, and its layout if
    a DistTensor; ``source``: the sender's layout when the part changes layout on the way (the next stage starts
    with :class:`hpctp.nn.Redistribute`: the pieces travel straight to their new ranks,
    :func:`hpctp.layout.group_transfer_plan`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Layout | None
    source: Layout | None = None


@dataclass(frozen=True)
class Described:
    """Local. An activation: one tensor or DistTensor, or (``structured``) a tuple of them (e.g. a U-Net's skip
    connections beside its features, or a model's input carried to its residual output), one message each."""

    parts: tuple[Part, ...]
    structured: bool = False

    def empty(self, device: Any) -> list[torch.Tensor]:
        """Local. Buffers to receive the blocks into."""
        return [torch.empty(p.shape, dtype=p.dtype, device=device) for p in self.parts]

    def wrap(self, blocks: list[torch.Tensor], grid: Any, moved_grid: Any = None) -> Any:
        """Local. The received blocks as the stage's input (DistTensors where the sender's were, on ``grid``, or on
        ``moved_grid`` where they changed layout on the way; a tuple where the sender's was)."""
        out = [
            b if p.layout is None else DistTensor(b, moved_grid if p.source is not None and moved_grid else grid, p.layout)
            for p, b in zip(self.parts, blocks)
        ]  # fmt: skip
        return tuple(out) if self.structured else out[0]


def _part(value: Any) -> tuple[torch.Tensor, Part]:
    if isinstance(value, DistTensor):
        block, layout = value.local, value.layout
    else:
        block, layout = value, None
    if not isinstance(block, torch.Tensor):
        raise TypeError(
            f"a pipeline stage must return a torch.Tensor, a DistTensor of one, or a tuple of them (the next stage's "
            f"input), got {type(value).__name__}"
        )
    return block, Part(tuple(block.shape), block.dtype, layout)


def describe(value: Any) -> tuple[list[torch.Tensor], Described]:
    """Local. The blocks to send and their description.

    Raises
    ------
    TypeError
        If ``value`` is not a tensor, a DistTensor of a torch block, or a non-empty tuple of them.
    """
    structured = isinstance(value, tuple)
    if structured and not value:
        raise TypeError("a pipeline stage returned an empty tuple; return the tensors the next stage needs")
    pairs = [_part(v) for v in (value if structured else (value,))]
    return [b for b, _ in pairs], Described(tuple(p for _, p in pairs), structured)


def blocks_of(value: Any) -> list[torch.Tensor]:
    """Local. The torch blocks of an activation (a tensor, a DistTensor or a tuple of them)."""
    parts = value if isinstance(value, tuple) else (value,)
    return [v.local if isinstance(v, DistTensor) else v for v in parts]


def _encode_layout(lay: Layout | None) -> list[int]:
    if lay is None:
        return [0]
    out = [1, len(lay.global_shape), *lay.global_shape, len(lay.grid_dims), *lay.grid_dims]
    out += [-1 if a is None else a for a in lay.split]
    for a, cuts in zip(lay.split, lay.dim_cuts):
        if a is not None:
            out += list(cuts)
    return out


def _decode_layout(v: list[int], i: int) -> tuple[Layout | None, int]:
    if not v[i]:
        return None, i + 1
    g = v[i + 1]
    gshape = tuple(v[i + 2 : i + 2 + g])
    i += 2 + g
    grid_dims = tuple(v[i + 1 : i + 1 + v[i]])
    i += 1 + len(grid_dims)
    split = tuple(None if a < 0 else a for a in v[i : i + g])
    j = i + g
    cuts: list[tuple[int, ...] | None] = []
    for a in split:
        if a is None:
            cuts.append(None)
        else:
            cuts.append(tuple(v[j : j + grid_dims[a] + 1]))
            j += grid_dims[a] + 1
    return Layout(gshape, grid_dims, split, tuple(cuts)), j


def _encode_part(d: Part) -> list[int]:
    return [len(d.shape), *d.shape, dtype_code(d.dtype), *_encode_layout(d.layout), *_encode_layout(d.source)]


def _encode(d: Described) -> np.ndarray:
    out = [int(d.structured), len(d.parts)]
    for part in d.parts:
        out += _encode_part(part)
    if len(out) > META_INTS:
        raise ValueError(
            f"an activation's description needs {len(out)} ints, more than {META_INTS}: send fewer tensors between "
            "stages (cut the model elsewhere)"
        )
    msg = np.zeros(META_INTS, dtype=np.int64)
    msg[: len(out)] = out
    return msg


def _decode_part(v: list[int], i: int) -> tuple[Part, int]:
    n = v[i]
    shape = tuple(v[i + 1 : i + 1 + n])
    dtype = dtype_from_code(v[i + 1 + n], "torch")
    layout, i = _decode_layout(v, i + 2 + n)
    source, i = _decode_layout(v, i)
    return Part(shape, dtype, layout, source), i


def _decode(msg: np.ndarray) -> Described:
    v = [int(x) for x in msg]
    parts, at = [], 2
    for _ in range(v[1]):
        part, at = _decode_part(v, at)
        parts.append(part)
    return Described(tuple(parts), bool(v[0]))


def moved(d: Described, target: Callable[[Layout], Layout], rank: int) -> Described:
    """Local. ``d`` with each DistTensor part moving to ``target(layout)`` on the way (its block shape that of the
    model rank ``rank``, the receiver's as the sender's: the same model coordinates)."""
    parts = []
    for p in d.parts:
        if p.layout is None:
            parts.append(p)
            continue
        dst = target(p.layout)
        parts.append(Part(dst.local_shape(grid_coords(rank, dst.grid_dims)), p.dtype, dst, p.layout))
    return Described(tuple(parts), d.structured)


def send_description(comm: Any, d: Described, dest: int) -> Pending:
    """Local (point-to-point). Start sending an activation's description to the next stage's rank."""
    return C.isend(comm, _encode(d), dest, tags.PIPELINE_META)


def receive_description(comm: Any, source: int) -> Described:
    """Local (point-to-point). Receive the description the previous stage's rank sends first."""
    msg = np.zeros(META_INTS, dtype=np.int64)
    C.irecv(comm, msg, source, tags.PIPELINE_META).wait()
    return _decode(msg)
