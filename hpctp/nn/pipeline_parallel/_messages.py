"""What crosses a stage boundary: activations forward, their gradients back, and their shapes once.

A boundary joins stage ``s`` (on pipeline rank ``s % p``) and stage ``s + 1``; every rank of a model grid
talks to the rank of the same model-grid coordinates on the neighbouring stage, over the plan's pipeline
communicator, so a DistTensor activation (a field split over the spatial axes, tokens over the tensor
axis) moves block by block, in its layout. The first time a boundary carries a micro-batch of a size, the
sender describes the activation (local shape, dtype, the DistTensor's global layout) in one small message
(:data:`hpctp.comm.tags.PIPELINE_META`); both sides remember it, so later steps send only the data, one
message per micro-batch each way (:data:`~hpctp.comm.tags.PIPELINE_ACTIVATION`,
:data:`~hpctp.comm.tags.PIPELINE_GRADIENT`). Messages of one kind between two ranks match in the order
they were sent (the schedule's lowering writes them so), so a tag per kind is all the matching needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ... import comm as C
from ..._util.dtypes import dtype_code, dtype_from_code
from ...comm import Pending, tags
from ...layout import Layout
from ...tensor.core import DistTensor

__all__ = ["Described", "describe", "receive_description", "META_INTS"]

META_INTS = 512
"""Length of a description message (int64): local shape, dtype, and a DistTensor's global shape, split and cuts."""


@dataclass(frozen=True)
class Described:
    """Local. An activation as the receiver rebuilds it: its block's shape and dtype, and its layout if a DistTensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Layout | None

    def empty(self, device: Any) -> torch.Tensor:
        """Local. A buffer to receive the block into."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def wrap(self, block: torch.Tensor, grid: Any) -> Any:
        """Local. The received block as the stage's input (a DistTensor when the sender's was)."""
        return block if self.layout is None else DistTensor(block, grid, self.layout)


def describe(value: Any) -> tuple[torch.Tensor, Described]:
    """Local. The block to send and its description.

    Raises
    ------
    TypeError
        If ``value`` is not a tensor or a DistTensor of a torch block.
    """
    if isinstance(value, DistTensor):
        block, layout = value.local, value.layout
    else:
        block, layout = value, None
    if not isinstance(block, torch.Tensor):
        raise TypeError(
            f"a pipeline stage must return a torch.Tensor or a DistTensor of one (the next stage's input), "
            f"got {type(value).__name__}"
        )
    return block, Described(tuple(block.shape), block.dtype, layout)


def _encode(d: Described) -> np.ndarray:
    out = [len(d.shape), *d.shape, dtype_code(d.dtype)]
    if d.layout is None:
        out.append(0)
    else:
        lay = d.layout
        out += [1, len(lay.global_shape), *lay.global_shape, *[-1 if a is None else a for a in lay.split]]
        for a, cuts in zip(lay.split, lay.dim_cuts):
            if a is not None:
                out += list(cuts)
    if len(out) > META_INTS:
        raise ValueError(f"an activation's description needs {len(out)} ints, more than {META_INTS}")
    msg = np.zeros(META_INTS, dtype=np.int64)
    msg[: len(out)] = out
    return msg


def _decode(msg: np.ndarray, grid_dims: tuple[int, ...]) -> Described:
    v = [int(x) for x in msg]
    n = v[0]
    shape = tuple(v[1 : 1 + n])
    dtype = dtype_from_code(v[1 + n], "torch")
    i = 2 + n
    if not v[i]:
        return Described(shape, dtype, None)
    g = v[i + 1]
    gshape = tuple(v[i + 2 : i + 2 + g])
    split = tuple(None if a < 0 else a for a in v[i + 2 + g : i + 2 + 2 * g])
    j = i + 2 + 2 * g
    cuts: list[tuple[int, ...] | None] = []
    for a in split:
        if a is None:
            cuts.append(None)
        else:
            cuts.append(tuple(v[j : j + grid_dims[a] + 1]))
            j += grid_dims[a] + 1
    return Described(shape, dtype, Layout(gshape, grid_dims, split, tuple(cuts)))


def send_description(comm: Any, d: Described, dest: int) -> Pending:
    """Local (point-to-point). Start sending an activation's description to the next stage's rank."""
    return C.isend(comm, _encode(d), dest, tags.PIPELINE_META)


def receive_description(comm: Any, source: int, grid_dims: tuple[int, ...]) -> Described:
    """Local (point-to-point). Receive the description the previous stage's rank sends first."""
    msg = np.zeros(META_INTS, dtype=np.int64)
    C.irecv(comm, msg, source, tags.PIPELINE_META).wait()
    return _decode(msg, grid_dims)
