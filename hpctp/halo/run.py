"""Executing fetch plans with non-blocking point-to-point messages (numpy, torch, cupy blocks).

Blocks keep their backend and device: packing, unpacking, flips and accumulation use the
block's own array library, and the buffers go through :mod:`hpctp.comm` (which stages
device memory when MPI is not CUDA-aware).
"""

from __future__ import annotations

from typing import Any

from .. import comm as C
from .._util.backend import Array, copy_into, empty_like_backend, from_bytes, is_torch
from ..comm import pool as P
from ..comm import tags
from ..layout import grid_coords
from ..ops.transfer import itemsize
from .plan import FetchPlan, Piece

__all__ = [
    "ADJOINT_TAG",
    "TAG",
    "AdjointHandle",
    "FetchHandle",
    "adjoint_fetch",
    "adjoint_fetch_parts",
    "begin_adjoint",
    "begin_fetch",
    "end_fetch",
    "fetch",
]

TAG = tags.HALO
ADJOINT_TAG = tags.HALO_ADJOINT


def _flip(a: Array, axes: tuple[int, ...]) -> Array:
    if not axes:
        return a
    if is_torch(a):
        return a.flip(axes)
    return a[tuple(slice(None, None, -1) if d in axes else slice(None) for d in range(a.ndim))]


def _fill(view: Array, value: float) -> None:
    if is_torch(view):
        view.fill_(value)
    else:
        view[...] = value


def _add_into(dst: Array, src: Array) -> None:
    if is_torch(dst):
        dst.add_(src)
    else:
        dst += src


def _zeros(shape: tuple[int, ...], like: Array) -> Array:
    out = empty_like_backend(shape, like.dtype, like)
    _fill(out, 0)
    return out


def _detach(x: Array) -> Array:
    return x.detach() if is_torch(x) else x


def _buffer(count: int, like: Array, held: list[Array]) -> Array:
    """A 1-D message buffer of ``count`` elements of ``like``'s dtype, from :mod:`hpctp.comm.pool`;
    the pooled memory is appended to ``held``, to be released once the message completed."""
    n = count * itemsize(like)
    raw = P.acquire(n, like)
    held.append(raw)
    return from_bytes(raw[:n], like.dtype, (count,))


def _release(held: list[Array]) -> None:
    for raw in held:
        P.release(raw)
    held.clear()


def _pack(block: Array, pieces: tuple[Piece, ...], attr: str, flip: bool, held: list[Array]) -> Array:
    """One contiguous 1-D (pooled) buffer holding ``block[piece.<attr>]`` for every piece, in order."""
    buf = _buffer(sum(p.size for p in pieces), block, held)
    off = 0
    for p in pieces:
        part = block[getattr(p, attr)]
        copy_into(buf[off : off + p.size].reshape(p.shape), _flip(part, p.flip) if flip else part)
        off += p.size
    return buf


Box = tuple[slice, ...]


def _clip(piece: Piece, box: Box) -> tuple[Box, Box, Box] | None:
    """The part of ``piece`` whose destination lies in ``box``.

    Returns ``(src, dst, rel)``: slices in the source block, in the fetched array, and in
    the piece's own (source-oriented) box; None if they do not meet.
    """
    src, dst, rel = [], [], []
    for d, (ps, pd) in enumerate(zip(piece.src, piece.dst)):
        b = box[d] if d < len(box) else slice(None)
        lo = pd.start if b.start is None else max(pd.start, b.start)
        hi = pd.stop if b.stop is None else min(pd.stop, b.stop)
        if hi <= lo:
            return None
        if d in piece.flip:  # dst index i <-> source offset (pd.stop - 1 - i)
            r0, r1 = pd.stop - hi, pd.stop - lo
        else:
            r0, r1 = lo - pd.start, hi - pd.start
        src.append(slice(ps.start + r0, ps.start + r1))
        dst.append(slice(lo, hi))
        rel.append(slice(r0, r1))
    return tuple(src), tuple(dst), tuple(rel)


def _inside(piece: Piece, box: Box | None) -> bool:
    """True when ``piece``'s destination lies inside ``box``."""
    if box is None:
        return False
    for d, pd in enumerate(piece.dst):
        b = box[d] if d < len(box) else slice(None)
        if (b.start is not None and pd.start < b.start) or (b.stop is not None and pd.stop > b.stop):
            return False
    return True


def _relative(dst: Box, box: Box) -> Box:
    """``dst`` (absolute slices) relative to the origin of ``box``."""
    out = []
    for d, sl in enumerate(dst):
        o = box[d].start if d < len(box) and box[d].start is not None else 0
        out.append(slice(sl.start - o, sl.stop - o))
    return tuple(out)


class FetchHandle:
    """Local. Messages of one fetch in flight; :meth:`wait` completes it and returns the array."""

    def __init__(
        self, plan: FetchPlan, out: Array, recvs: list[tuple[Any, Array]], pending: list[Any], held: list[Array]
    ) -> None:
        self.plan = plan
        self.out = out
        self._recvs = recvs
        self._pending = pending
        self._held = held
        self._done = False

    def wait(self) -> Array:
        """Local. Wait for this rank's messages, unpack the halo and return the fetched array."""
        if not self._done:
            C.waitall(self._pending)
            for msg, buf in self._recvs:
                off = 0
                for p in msg.pieces:
                    copy_into(self.out[p.dst], _flip(buf[off : off + p.size].reshape(p.shape), p.flip))
                    off += p.size
            self._recvs = []
            self._pending = []
            _release(self._held)
            self._done = True
        return self.out


def begin_fetch(
    plan: FetchPlan,
    comm: Any,
    block: Array,
    out: Array | None = None,
    fill: float = 0.0,
    need: list[Box] | None = None,
    skip: Box | None = None,
) -> FetchHandle:
    """Local (point-to-point, must be matched on the peers). Start fetching ``plan.want``.

    Posts every receive and send, then fills the boundary and copies the locally owned
    pieces into ``out``, so interior work can start before :meth:`FetchHandle.wait`.

    Parameters
    ----------
    plan : FetchPlan
    comm : mpi4py communicator
        The grid communicator the plan's ranks refer to.
    block : array
        This rank's block (shape ``plan.layout.local_shape(coords)``).
    out : array, optional
        Destination of shape ``plan.shape`` on the block's backend (allocated if None).
    fill : float
        Value of the filled pieces (zero boundary, star corners).
    need : list of tuple of slice, optional
        Only these boxes of ``out`` will be read: locally owned data outside them is not
        copied (received halos are always unpacked).
    skip : tuple of slice, optional
        Local pieces whose destination lies inside this box are not copied at all.

    Returns
    -------
    FetchHandle
    """
    block = _detach(block)
    if out is None:
        out = empty_like_backend(plan.shape, block.dtype, block)
    held: list[Array] = []  # (pooled message buffers, released by wait)
    recvs = [(m, _buffer(m.size, block, held)) for m in plan.recvs]
    with C.trace_label("halo", block=block):  # (the block's size explains a late halo in `hpctp trace summarize`)
        pending = [C.irecv(comm, buf, m.peer, TAG) for m, buf in recvs]
        for m in plan.sends:
            pending.append(C.isend(comm, _pack(block, m.pieces, "src", False, held), m.peer, TAG))
    for sl in plan.fills:
        _fill(out[sl], fill)
    for p in plan.local:
        if _inside(p, skip):
            continue
        if need is None:
            copy_into(out[p.dst], _flip(block[p.src], p.flip))
            continue
        for box in need:
            part = _clip(p, box)
            if part is not None:
                copy_into(out[part[1]], _flip(block[part[0]], p.flip))
    return FetchHandle(plan, out, recvs, pending, held)


def end_fetch(handle: FetchHandle) -> Array:
    """Local. Complete a fetch started by :func:`begin_fetch`; returns the fetched array."""
    return handle.wait()


def fetch(plan: FetchPlan, comm: Any, block: Array, out: Array | None = None, fill: float = 0.0) -> Array:
    """Local (point-to-point, matched on the peers). :func:`begin_fetch` then wait."""
    return begin_fetch(plan, comm, block, out, fill).wait()


def adjoint_fetch(plan: FetchPlan, comm: Any, grad: Array, out: Array | None = None) -> Array:
    """Local (point-to-point, matched on the peers). The transpose of :func:`fetch`.

    Every element of ``grad`` (shape ``plan.shape``) is sent back to the block element it
    was fetched from and summed there; filled positions are dropped.

    Returns
    -------
    array
        Shape ``plan.layout.local_shape(coords)``, same backend as ``grad``. If ``out`` is
        given the contributions are added to it.
    """
    return adjoint_fetch_parts(plan, comm, [((), _detach(grad))], out)


def adjoint_fetch_parts(
    plan: FetchPlan, comm: Any, parts: list[tuple[Box, Array]], out: Array | None = None, skip: Box | None = None
) -> Array:
    """Local (point-to-point, matched on the peers). :func:`adjoint_fetch` of a sparse gradient.

    The gradient of the fetched array is the sum of ``parts``: ``(box, g)`` pairs with
    ``g`` the gradient of ``fetched[box]`` (boxes may overlap; uncovered cells are zero).
    No fetched-size array is formed. Local pieces inside ``skip`` are ignored (the
    transpose of :func:`begin_fetch`'s ``skip``).
    """
    h = begin_adjoint(plan, comm, parts, skip)
    if out is None:
        out = _zeros(plan.layout.local_shape(grid_coords(plan.rank, plan.layout.grid_dims)), parts[0][1])
    return h.finish(out)


class AdjointHandle:
    """Local. An adjoint fetch in flight; :meth:`finish` adds its contributions to a block."""

    def __init__(
        self, recvs: list[tuple[Any, Array]], pending: list[Any], local: list[tuple[Box, Array]], held: list[Array]
    ) -> None:
        self._recvs = recvs
        self._pending = pending
        self._local = local
        self._held = held

    def finish(self, out: Array) -> Array:
        """Local (waits for the peers' messages). Add every contribution into ``out``; returns it."""
        for src, val in self._local:
            _add_into(out[src], val)
        C.waitall(self._pending)
        for m, buf in self._recvs:
            off = 0
            for p in m.pieces:
                _add_into(out[p.src], buf[off : off + p.size].reshape(p.shape))
                off += p.size
        self._recvs, self._pending, self._local = [], [], []
        _release(self._held)
        return out


def begin_adjoint(plan: FetchPlan, comm: Any, parts: list[tuple[Box, Array]], skip: Box | None = None) -> AdjointHandle:
    """Local (point-to-point, matched on the peers). Post the messages of :func:`adjoint_fetch_parts`.

    Ghost gradients are packed and sent, the receives for this rank's own data are posted;
    :meth:`AdjointHandle.finish` later adds everything into a block-shaped array, so the
    caller may supply an existing gradient buffer instead of a new zero block.
    """
    like = parts[0][1]
    held: list[Array] = []  # (pooled message buffers, released by finish)
    recvs = [(m, _buffer(m.size, like, held)) for m in plan.sends]
    pending = [C.irecv(comm, buf, m.peer, ADJOINT_TAG) for m, buf in recvs]
    for m in plan.recvs:
        buf = _buffer(m.size, like, held)
        _fill(buf, 0)
        off = 0
        for p in m.pieces:
            view = buf[off : off + p.size].reshape(p.shape)
            for box, g in parts:
                part = _clip(p, box)
                if part is not None:
                    _add_into(view[part[2]], _flip(_detach(g)[_relative(part[1], box)], p.flip))
            off += p.size
        pending.append(C.isend(comm, buf, m.peer, ADJOINT_TAG))
    local = []
    for p in plan.local:
        if _inside(p, skip):
            continue
        for box, g in parts:
            part = _clip(p, box)
            if part is not None:
                local.append((part[0], _flip(_detach(g)[_relative(part[1], box)], p.flip)))
    return AdjointHandle(recvs, pending, local, held)
