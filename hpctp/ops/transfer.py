"""Moving blocks between layouts and ranks: redistribute, gather, scatter."""

from __future__ import annotations

import numpy as np

from .. import comm as C
from .._util.backend import Array, copy_into, empty_like_backend, flip, from_bytes, is_torch
from ..comm import ProcessGrid
from ..comm import pool as P
from ..layout import Layout, Remap, grid_coords, moves_data, redistribution_plan

__all__ = ["redistribute_block", "needs_grad", "gather_block", "scatter_block", "itemsize", "pack_into"]


def itemsize(x: Array) -> int:
    """Local. Bytes per element of a block."""
    return int(x.element_size()) if hasattr(x, "element_size") else int(x.itemsize)


def pack_into(buf: Array, pieces: list[Array], like: Array) -> Array:
    """Local. Copy the elements of ``pieces`` (blocks of ``like``'s dtype) one after the other into
    the flat byte buffer ``buf``; return the filled bytes ``buf[:total]``.

    Unlike concatenating, this writes into memory the caller keeps (a pooled buffer, see
    :mod:`hpctp.comm.pool`) and records nothing for autograd.
    """
    item = itemsize(like)
    offset = 0
    for piece in pieces:
        n = int(np.prod(piece.shape)) * item
        if n:
            src = piece.detach() if is_torch(piece) else piece
            copy_into(from_bytes(buf[offset : offset + n], like.dtype, tuple(piece.shape)), src)
        offset += n
    return buf[:offset]


def redistribute_block(local: Array, grid: ProcessGrid, src: Layout, dst: Layout, remap: Remap = ()) -> Array:
    """Collective over grid when data moves between ranks (see :func:`hpctp.layout.moves_data`),
    else Local. Move a tensor from layout ``src`` to ``dst`` in one ``Alltoallv``.

    Each rank sends only the boxes the receivers do not already hold (see
    :func:`hpctp.layout.redistribution_plan`); local overlap is copied without MPI.
    ``dst`` may be on another grid shape of ``grid``'s ranks (row-major rank order).
    ``remap`` also flips or rolls dims on the way (``numpy.flip``/``numpy.roll`` of the
    global tensor).

    Returns
    -------
    array
        The new local block, same backend, device and dtype as ``local``.
    """
    plan = redistribution_plan(src, dst, grid.rank, remap)
    rev = plan.reversed_dims
    out = empty_like_backend(dst.local_shape(grid_coords(grid.rank, dst.grid_dims)), local.dtype, local)
    if moves_data(src, dst, plan.remap):
        item = itemsize(local)
        sendcounts = [0] * grid.size
        for p in plan.sends:
            sendcounts[p.peer] += p.size * item
        recvcounts = [0] * grid.size
        for p in plan.recvs:
            recvcounts[p.peer] += p.size * item
        send_pool = P.acquire(sum(sendcounts), local)  # (reused across calls: no allocation once warm)
        recv_pool = P.acquire(sum(recvcounts), local)
        try:
            sendbuf = pack_into(send_pool, [flip(local[p.slices], rev) for p in plan.sends], local)
            recvbuf = recv_pool[: sum(recvcounts)]
            with C.trace_label("redistribute {}->{}", src.split, dst.split):  # (formatted only while tracing)
                C.alltoallv(grid.comm, sendbuf, sendcounts, recvbuf, recvcounts)
            offset = 0
            for p in plan.recvs:  # (in the senders' packing order)
                n = p.size * item
                shape = tuple(hi - lo for lo, hi in p.box)
                copy_into(out[(*p.slices, ...)], from_bytes(recvbuf[offset : offset + n], local.dtype, shape))
                offset += n
        finally:
            P.release(send_pool)
            P.release(recv_pool)
    for src_sl, dst_sl in plan.local:
        copy_into(out[(*dst_sl, ...)], flip(local[src_sl], rev))
    return out


def needs_grad(block: Array) -> bool:
    """Local. True for a torch block that autograd records operations on."""
    if not is_torch(block):
        return False
    import torch  # (loaded: the block is a torch tensor)

    return bool(block.requires_grad and torch.is_grad_enabled())


def gather_block(local: Array, grid: ProcessGrid, layout: Layout, root: int | None = 0) -> Array | None:
    """Collective over grid. Assemble the global tensor on ``root`` (every rank if None).

    Only one replica of each block is sent.

    Returns
    -------
    array or None
        The global tensor (same backend as ``local``) on ``root``; None elsewhere.
    """
    item = itemsize(local)
    counts = []
    for r in range(grid.size):
        coords = grid_coords(r, layout.grid_dims)
        counts.append(int(np.prod(layout.local_shape(coords))) * item if layout.is_primary(coords) else 0)
    everyone = root is None
    receives = everyone or grid.rank == root
    send_pool = P.acquire(counts[grid.rank], local)
    recv_pool = P.acquire(sum(counts), local) if receives else None
    try:
        sendbuf = pack_into(send_pool, [local] if counts[grid.rank] else [], local)
        recvbuf = recv_pool[: sum(counts)] if recv_pool is not None else None
        if everyone:
            C.allgatherv(grid.comm, sendbuf, recvbuf, counts)
        else:
            C.gatherv(grid.comm, sendbuf, recvbuf, counts, root=root)  # type: ignore[arg-type]
        if recvbuf is None:
            return None
        out = empty_like_backend(layout.global_shape, local.dtype, local)
        offset = 0
        for r, n in enumerate(counts):
            if n:
                coords = grid_coords(r, layout.grid_dims)
                block = from_bytes(recvbuf[offset : offset + n], local.dtype, layout.local_shape(coords))
                copy_into(out[(*layout.local_slices(coords), ...)], block)
            offset += n
        return out
    finally:
        P.release(send_pool)
        if recv_pool is not None:
            P.release(recv_pool)


def scatter_block(
    array: Array | None, grid: ProcessGrid, layout: Layout, dtype: object, like: object, root: int = 0
) -> Array:
    """Collective over grid. Send every rank its block of ``array`` (given on ``root`` only).

    Returns
    -------
    array
        This rank's block, on the backend of ``like`` with ``dtype``.
    """
    out = empty_like_backend(layout.local_shape(grid.coords), dtype, like)
    item = itemsize(out)
    counts = [int(np.prod(layout.local_shape(grid_coords(r, layout.grid_dims)))) * item for r in range(grid.size)]
    send_pool = P.acquire(sum(counts), array) if grid.rank == root else None
    recv_pool = P.acquire(counts[grid.rank], out)
    try:
        sendbuf = None
        if send_pool is not None:
            blocks = [array[(*layout.local_slices(grid_coords(r, layout.grid_dims)), ...)] for r in range(grid.size)]  # type: ignore[index]
            sendbuf = pack_into(send_pool, blocks, array)
        recv = recv_pool[: counts[grid.rank]]
        C.scatterv(grid.comm, sendbuf, counts, recv, root=root)
        copy_into(out, from_bytes(recv, out.dtype, tuple(out.shape)))
        return out
    finally:
        if send_pool is not None:
            P.release(send_pool)
        P.release(recv_pool)
