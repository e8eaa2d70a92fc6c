"""Gradient synchronisation (and parameter broadcast) for modules on a process grid.

Why gradients need summing: a *replicated* parameter (one without ``hpctp_layout``, e.g.
a convolution kernel or a norm's ``weight``) is applied to every rank's block of a
spatially partitioned field. The global loss is a sum over the whole field, so the true
gradient is the sum over blocks; after ``loss.backward()`` each rank holds only its own
block's *partial* gradient. :func:`sync_gradients` all-reduces (sums) them, after which
every rank holds the single-process gradient and identical optimiser steps keep the
replicas identical. Do not average: with a global loss (e.g.
:func:`hpctp.nn.global_mse_loss`) the sum is exact.

A *sharded* parameter (with ``hpctp_layout``) already holds the full gradient of its
block along the grid axes that shard it; along its replicated axes
(``layout.replicated_axes``) the ranks hold partial gradients, summed over those axes'
sub-communicators.

A parameter whose layer completes its gradient in backward (the tensor-parallel linear
layers) carries ``hpctp_grad_reduced``, the grid axes already summed over; those axes are
skipped, so one ``sync_gradients(model, grid)`` is right for models mixing both kinds.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from mpi4py import MPI

from ... import comm as C
from ..._util.backend import byte_view, shape_only, to_numpy
from ..._util.ints import is_int
from ...comm import ProcessGrid
from ...layout import Layout
from ...ops.autograd import Comms, check_grid, comms_for_axes, normalize_axes

__all__ = ["sync_gradients", "broadcast_parameters", "gradient_buckets", "check_replicas"]

BucketKey = tuple[torch.device, torch.dtype, tuple[int, ...]]


def _replica_axes(t: torch.Tensor, name: str, grid: ProcessGrid) -> tuple[int, ...]:
    """The grid axes along which ``t`` must be identical: all of them unless it is sharded."""
    layout = getattr(t, "hpctp_layout", None)
    if layout is None:
        return tuple(range(grid.ndim))
    if not isinstance(layout, Layout) or layout.grid_dims != grid.dims:
        raise ValueError(
            f"parameter {name!r}: hpctp_layout must be a Layout on a grid of dims {grid.dims}, got {layout}"
        )
    return layout.replicated_axes


def partial_axes(p: torch.nn.Parameter, grid: ProcessGrid, axes: tuple[int, ...], name: str) -> tuple[int, ...]:
    """Local. The grid ``axes`` over which ``p``'s gradient is partial: those it is replicated along,
    less those its layer already summed in backward (``hpctp_grad_reduced``)."""
    done = tuple(getattr(p, "hpctp_grad_reduced", ()))  # completed by the layer's own backward
    replicas = _replica_axes(p, name, grid)
    return tuple(a for a in axes if a not in done and a in replicas)


def gradient_buckets(
    module: torch.nn.Module, grid: ProcessGrid, axes: Sequence[int] | None = None
) -> dict[BucketKey, list[tuple[str, torch.nn.Parameter]]]:
    """Local. How :func:`sync_gradients` groups the trainable parameters.

    Parameters
    ----------
    module : torch.nn.Module
    grid : ProcessGrid
    axes : sequence of int, optional
        Grid axes along which ranks hold different data (default: all).

    Returns
    -------
    dict
        ``(device, dtype, reduction axes) -> [(name, parameter), ...]`` in
        ``named_parameters()`` order, only for non-empty reduction axes.

    Raises
    ------
    ValueError
        If a parameter's ``hpctp_layout`` is not a Layout on ``grid``.
    """
    check_grid(grid)
    ax = normalize_axes(grid, axes)
    buckets: dict[BucketKey, list[tuple[str, torch.nn.Parameter]]] = defaultdict(list)
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        red = partial_axes(p, grid, ax, name)
        if red and any(grid.dims[a] > 1 for a in red):
            buckets[(p.device, p.dtype, red)].append((name, p))
    return dict(buckets)


def sync_gradients(module: torch.nn.Module, grid: ProcessGrid, axes: Sequence[int] | None = None) -> None:
    """Collective over grid. Sum the partial gradients of ``module``'s parameters over the ranks.

    Replicated parameters (no ``hpctp_layout``) are summed over the grid ``axes`` (default:
    the whole grid, one ``Allreduce`` on the grid communicator per bucket); sharded
    parameters over ``layout.replicated_axes`` (intersected with ``axes``), one
    ``Allreduce`` per sub-communicator and bucket. Gradients are packed into one flat
    buffer per (device, dtype, axes) bucket, so a model makes a handful of MPI calls.

    A parameter whose ``.grad`` is None on this rank contributes zeros; its gradient stays
    None only if it is None on every rank (a flag per parameter travels in the buffer).

    Parameters
    ----------
    module : torch.nn.Module
        The same module structure on every rank.
    grid : ProcessGrid
    axes : sequence of int, optional
        Grid axes along which ranks hold *different* parts of the data, i.e. along which
        gradients are partial (default: all). Ranks along other axes compute identical
        replicas and are not summed.

    Returns
    -------
    None
        ``p.grad`` is overwritten with the sum on every rank.

    Raises
    ------
    ValueError
        On invalid ``axes`` or an ``hpctp_layout`` of another grid (same on every rank).
    TypeError
        If ``grid`` is not a ProcessGrid.

    Notes
    -----
    Call it after ``loss.backward()`` and before ``optimizer.step()``, with the loss a
    global one (e.g. :func:`hpctp.nn.global_mse_loss`): then every rank's ``.grad``
    equals the single-process gradient. Sparse gradients are not supported.
    """
    buckets = gradient_buckets(module, grid, axes)
    with torch.no_grad():
        for (device, dtype, red), params in buckets.items():
            reduce_bucket(params, dtype, device, comms_for_axes(grid, red))


def reduce_bucket(
    params: Sequence[tuple[str, torch.nn.Parameter]], dtype: torch.dtype, device: torch.device, comms: Comms
) -> None:
    """Collective over each of ``comms``. Sum the gradients of ``params`` (one dtype and device) in
    one flat buffer, all-reduced over each communicator in turn; a ``None`` gradient counts as
    zeros and stays None only if it is None on every rank (a flag per parameter travels along;
    on ``meta`` tensors, a dry run without values, it stays None as every rank's stands for this one's).

    Raises
    ------
    ValueError
        If a gradient is sparse.
    """
    parts = []
    for name, p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError(f"parameter {name!r} has a sparse gradient; sync_gradients needs dense ones")
        parts.append(p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=device))
    flags = torch.tensor([0.0 if p.grad is None else 1.0 for _, p in params], device=device).to(dtype)
    buf = torch.cat(parts + [flags])
    for c in comms:
        C.allreduce(c, buf, "sum")
    had = buf[buf.numel() - len(params) :]
    offset = 0
    for i, (_, p) in enumerate(params):
        n = p.numel()
        total = buf[offset : offset + n].view_as(p)
        offset += n
        if p.grad is not None:
            p.grad.copy_(total)
        elif not shape_only(buf) and bool(had[i] != 0):  # (meta: every rank has none, as this one)
            p.grad = total.clone()


def bcast_tensors(comm: MPI.Intracomm, tensors: Iterable[torch.Tensor], root: int = 0) -> None:
    """Collective over ``comm``. Copy ``root``'s values of ``tensors`` into every rank's, one ``Bcast``
    per (device, dtype) group of flattened tensors (none on a single rank)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    if comm.Get_size() == 1:
        return
    with torch.no_grad():
        for ts in groups.values():
            buf = torch.cat([t.detach().reshape(-1) for t in ts])
            C.bcast(comm, buf, root)
            offset = 0
            for t in ts:
                t.copy_(buf[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_parameters(module: torch.nn.Module, grid: ProcessGrid, root: int = 0) -> None:
    """Collective over grid. Copy ``root``'s replicated parameters and buffers to every rank.

    Makes replicas identical after a rank-dependent initialisation. Parameters with
    ``hpctp_layout`` (sharded) are left alone; buffers (e.g. running statistics) are
    treated as replicated. One ``Bcast`` per (device, dtype).

    Parameters
    ----------
    module : torch.nn.Module
        The same module structure on every rank.
    grid : ProcessGrid
    root : int
        Grid rank whose values win.

    Raises
    ------
    ValueError
        If ``root`` is not a rank of ``grid``.
    """
    check_grid(grid)
    if not is_int(root) or not 0 <= root < grid.size:
        raise ValueError(f"root={root!r} must be a rank in 0..{grid.size - 1}")
    replicated = [p for p in module.parameters() if getattr(p, "hpctp_layout", None) is None]
    bcast_tensors(grid.comm, [*replicated, *module.buffers()], int(root))


def check_replicas(module: torch.nn.Module, grid: ProcessGrid) -> dict[str, list[int]]:
    """Collective over grid. The parameters and buffers whose copies differ between ranks.

    A replicated parameter or buffer must be bitwise identical on every rank, a sharded one
    (with ``hpctp_layout``) on the ranks along its layout's replicated axes: otherwise the
    ranks compute with different models and the result matches no single-process one. This
    compares a 32-bit digest of every tensor's bytes (one small ``Allgather``; tensors on a
    device are copied to the host for it), e.g. after a rank-dependent initialisation or at
    checkpoints of a long run; :func:`broadcast_parameters` makes replicated copies equal again.

    Parameters
    ----------
    module : torch.nn.Module
        The same structure on every rank.
    grid : ProcessGrid

    Returns
    -------
    dict
        On every rank: name -> ranks whose copy differs from the lowest rank holding the same
        block; empty when every copy agrees.

    Raises
    ------
    ValueError
        On every rank, if the ranks' modules have different parameter and buffer names, or a
        ``hpctp_layout`` is not a Layout of this grid.
    """
    check_grid(grid)
    error: Exception | None = None
    named = list(module.named_parameters()) + list(module.named_buffers())
    axes: list[tuple[int, ...]] = []
    try:
        axes = [_replica_axes(t, name, grid) for name, t in named]
    except ValueError as e:
        error = e
    C.agree_arguments(grid.comm, "check_replicas", error, names=[name for name, _ in named])
    digests = [zlib.crc32(to_numpy(byte_view(t.detach().contiguous())).tobytes()) for _, t in named]
    table = C.allgather_ints(grid.comm, digests)
    coords = np.array([grid.coords_of(r) for r in range(grid.size)], dtype=np.int64).reshape(grid.size, grid.ndim)
    out: dict[str, list[int]] = {}
    for i, ((name, _), same) in enumerate(zip(named, axes)):
        block = coords[:, [a for a in range(grid.ndim) if a not in same]]  # ranks holding one block share these
        first: dict[tuple[int, ...], int] = {}
        differ = []
        for r in range(grid.size):
            key = tuple(block[r].tolist())
            ref = first.setdefault(key, r)
            if table[r, i] != table[ref, i]:
                differ.append(r)
        if differ:
            out[name] = differ
    return out
