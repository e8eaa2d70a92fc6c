"""PyTorch's DTensor and DistTensor, one as the other without copying the blocks.

Grid axis ``i`` is mesh dim ``i`` (:func:`hpctp.comm.torch_dist.device_mesh` builds the grid's
mesh): a tensor dim divided over grid axis ``i`` is ``Shard(d)`` on mesh dim ``i``, and a grid axis
that divides no dim is ``Replicate()``. DTensor's shards follow ``torch.chunk`` (``ceil(n / P)``
per rank, the last ranks smaller or empty), so a DistTensor whose cuts differ (hpctp's balanced
cuts of an uneven size) must move into ``torch.chunk``'s cuts first; the error says how.
``Partial`` placements and several mesh dims sharding one tensor dim have no DistTensor layout.

This module imports torch; :mod:`hpctp.tensor` registers it lazily (``x.to_dtensor(mesh)`` and
:func:`hpctp.from_dtensor` load it), so ``import hpctp`` does not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import comm as C
from .._util.backend import backend_name
from ..comm import ProcessGrid, check_grid
from ..comm.torch_dist import torch_ranks
from ..layout import Layout
from .core import DistTensor
from .registry import register

__all__ = ["to_dtensor", "from_dtensor", "chunk_cuts"]

_MESH_FIX = "build the grid's mesh with hpctp.comm.torch_dist.device_mesh(grid)"


def chunk_cuts(n: int, parts: int) -> tuple[int, ...]:
    """Local. The ``parts + 1`` block boundaries of ``torch.chunk`` (DTensor's ``Shard``) of ``n``
    items: ``ceil(n / parts)`` per block, the last blocks smaller or empty.

    ``Layout(shape, grid.dims, split, cuts=...)`` with these cuts along the divided dims is the
    layout :func:`to_dtensor` accepts (hpctp's balanced cuts put the remainder on the first
    blocks instead: 3, 2, 2 where ``torch.chunk`` makes 3, 3, 1).

    Parameters
    ----------
    n : int
        Number of items.
    parts : int
        Number of blocks (>= 1).

    Returns
    -------
    tuple of int
        ``cuts[0] == 0``, ``cuts[-1] == n``; block ``i`` is ``[cuts[i], cuts[i + 1])``.
    """
    step = -(-n // parts)
    return tuple(min(i * step, n) for i in range(parts + 1))


def _check_mesh(mesh: object, grid: ProcessGrid, ranks: Sequence[int]) -> DeviceMesh:
    """Local. ``mesh`` if it is ``grid``'s (its shape ``grid.dims``, its ranks in row-major order
    the grid's default-group ranks), else TypeError/ValueError naming both."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}; {_MESH_FIX}")
    if tuple(mesh.shape) != grid.dims:
        raise ValueError(f"the mesh has shape {tuple(mesh.shape)} but the grid has dims {grid.dims}; {_MESH_FIX}")
    have = [int(r) for r in mesh.mesh.flatten().tolist()]
    if have != list(ranks):
        raise ValueError(
            f"the mesh's ranks in row-major order are {have} but the grid's, in grid-rank order, are {list(ranks)} "
            f"(torch.distributed default-group ranks): mesh coordinates must be grid coordinates; {_MESH_FIX}"
        )
    return mesh


def _fix_cuts(x: DistTensor, cuts: list[tuple[int, ...] | None]) -> str:
    lay = x.layout
    return (
        f"move it into torch.chunk's cuts first: x.redistribute(hpctp.Layout({lay.global_shape}, {lay.grid_dims}, "
        f"{lay.split}, cuts={tuple(cuts)}))"
    )


def _placements(x: DistTensor) -> tuple[Any, ...]:
    """Local. DTensor's placements of ``x``'s layout, one per grid axis; ValueError where a
    divided dim's cuts are not ``torch.chunk``'s."""
    lay = x.layout
    wrong = []
    want: list[tuple[int, ...] | None] = [None] * lay.ndim
    for d, g in enumerate(lay.split):
        if g is not None:
            want[d] = chunk_cuts(lay.global_shape[d], lay.grid_dims[g])
            if lay.dim_cuts[d] != want[d]:
                wrong.append(
                    f"dim {d} (size {lay.global_shape[d]}): hpctp's cuts {lay.dim_cuts[d]}, DTensor's {want[d]}"
                )
    if wrong:
        raise ValueError(
            f"to_dtensor: DTensor shards follow torch.chunk, and this tensor's blocks do not: {'; '.join(wrong)}; "
            + _fix_cuts(x, want)
        )
    return tuple(Shard(lay.split.index(i)) if i in lay.split else Replicate() for i in range(len(lay.grid_dims)))


@register("to_dtensor")
def to_dtensor(x: DistTensor, mesh: DeviceMesh) -> DTensor:
    """Collective over grid. ``x`` as a DTensor on ``mesh``, sharing this rank's block.

    Tensor dim ``d`` divided over grid axis ``i`` becomes ``Shard(d)`` on mesh dim ``i``; a grid
    axis dividing no dim becomes ``Replicate()``. ``DTensor.from_local`` with the global shape
    and contiguous strides, no check and no copy: ``to_local()`` of the result is a view of
    ``x.local``. Autograd records it where ``x.local`` requires grad. Called as
    ``x.to_dtensor(mesh)``.

    Parameters
    ----------
    x : DistTensor
        With torch blocks on ``mesh``'s device type.
    mesh : torch.distributed.device_mesh.DeviceMesh
        The grid's mesh (:func:`hpctp.comm.torch_dist.device_mesh`): shape ``x.grid.dims``,
        the process at mesh coordinates ``c`` grid rank ``x.grid.rank_of(c)``.

    Returns
    -------
    torch.distributed.tensor.DTensor

    Raises
    ------
    TypeError
        On every rank, if the blocks are not torch tensors (``x.to("torch")``) or ``mesh`` is
        not a DeviceMesh.
    ValueError
        On every rank, if ``mesh`` is not the grid's, its device type is not the blocks', a
        divided dim's cuts are not ``torch.chunk``'s (the message gives the ``redistribute``
        that fixes it), or ``torch.distributed`` is not initialised.
    """
    ranks = torch_ranks(x.grid)
    error: Exception | None = None
    placements: tuple[Any, ...] = ()
    try:
        if backend_name(x.local) != "torch":
            raise TypeError(f"to_dtensor needs torch blocks, got {x.backend}: convert them first, x.to('torch')")
        _check_mesh(mesh, x.grid, ranks)
        if x.local.device.type != mesh.device_type:
            raise ValueError(
                f"the blocks are on {x.local.device.type} but the mesh is a {mesh.device_type!r} mesh; "
                f"use hpctp.comm.torch_dist.device_mesh(grid, {x.local.device.type!r}) or move the blocks"
            )
        placements = _placements(x)
    except (TypeError, ValueError) as e:
        error = e
    C.raise_if_any(x.grid.comm, error)
    shape = torch.Size(x.global_shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(x.local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _layout(t: DTensor, grid: ProcessGrid) -> Layout:
    """Local. The DistTensor layout of ``t``'s placements on ``grid``; ValueError for placements
    that have none."""
    split: list[int | None] = [None] * t.ndim
    for i, p in enumerate(t.placements):
        if isinstance(p, Replicate):
            continue
        if type(p) is Shard:  # not _StridedShard, which is no Shard subclass in newer torch, or was one
            d = p.dim % t.ndim
            if split[d] is not None:
                raise ValueError(
                    f"from_dtensor: mesh dims {split[d]} and {i} both shard tensor dim {d} (placements "
                    f"{tuple(t.placements)}); hpctp divides a dim over one grid axis: t.redistribute(t.device_mesh, "
                    f"placements) with at most one Shard({d}) first"
                )
            split[d] = i
            continue
        what = "holds partial values (a pending reduction)" if p.is_partial() else "has no DistTensor layout"
        raise ValueError(
            f"from_dtensor: placement {p!r} on mesh dim {i} {what}; move it to Shard/Replicate placements first: "
            f"t.redistribute(t.device_mesh, [Shard(d) or Replicate() per mesh dim])"
        )
    cuts = tuple(None if g is None else chunk_cuts(n, grid.dims[g]) for n, g in zip(t.shape, split))
    return Layout(tuple(t.shape), grid.dims, tuple(split), cuts=cuts)


@register("from_dtensor")
def from_dtensor(t: DTensor, grid: ProcessGrid) -> DistTensor:
    """Collective over grid. The DistTensor of DTensor ``t`` on ``grid``, holding ``t.to_local()``
    as its block (no copy); :func:`hpctp.from_dtensor` calls it.

    ``Shard(d)`` on mesh dim ``i`` divides tensor dim ``d`` over grid axis ``i`` with
    :func:`chunk_cuts`; ``Replicate()`` leaves grid axis ``i`` replicated.

    Parameters
    ----------
    t : torch.distributed.tensor.DTensor
        On the grid's mesh (:func:`hpctp.comm.torch_dist.device_mesh`).
    grid : ProcessGrid

    Returns
    -------
    DistTensor

    Raises
    ------
    TypeError
        If ``t`` is not a DTensor or ``grid`` not a ProcessGrid.
    ValueError
        On every rank: if the mesh is not the grid's, a placement is ``Partial`` or a strided
        shard, two mesh dims shard one tensor dim (the message gives the ``t.redistribute``
        that fixes it), a local tensor's shape is not its ``torch.chunk`` block's, or
        ``torch.distributed`` is not initialised.
    """
    grid = check_grid(grid)
    ranks = torch_ranks(grid)
    error: Exception | None = None
    try:
        if not isinstance(t, DTensor):
            raise TypeError(f"from_dtensor needs a torch DTensor, got {type(t).__name__}")
        _check_mesh(t.device_mesh, grid, ranks)
        layout = _layout(t, grid)
        local = t.to_local()
        layout.check_block(local.shape, grid.dims, grid.coords, f"rank {grid.rank}: the DTensor's local tensor")
    except (TypeError, ValueError) as e:
        error = e
    C.raise_if_any(grid.comm, error)
    return DistTensor(local, grid, layout)
