"""Moving a tensor from one group of ranks to another: the pieces each rank sends and receives when
the source layout lives on one process grid and the destination layout on another (disjoint or
overlapping) grid, both numbered inside a common communicator. Pure math, cached, no MPI.

This is :func:`hpctp.layout.redistribution_plan` for two grids that are not the same ranks (a
simulation's grid and a trainer's grid inside one MPI job). A destination block is cut into the
boxes where it meets the source blocks; each box travels from the source rank that holds it to the
destination rank that wants it, as one message per ``(sender, receiver)`` pair. A source replicated
over some grid axes is sent by its replica at coordinate 0 on those axes; a destination replicated
over some axes (data-parallel copies) is received by every replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from .layout import Layout, grid_coords
from .plan import intersect

__all__ = ["GroupPiece", "GroupTransferPlan", "group_transfer_plan"]

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class GroupPiece:
    """Local. One box moving between two ranks of the common communicator.

    ``peer`` is the other rank (in the common communicator), ``box`` the global ``(start, stop)``
    ranges, ``slices`` where the box sits in this rank's own block (its source block for a send,
    its destination block for a receive).
    """

    peer: int
    box: Ranges
    slices: tuple[slice, ...]

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(hi - lo for lo, hi in self.box)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the box."""
        return tuple(hi - lo for lo, hi in self.box)


@dataclass(frozen=True)
class GroupTransferPlan:
    """Local. What one rank sends (as a source-grid member), receives (as a destination-grid member)
    and copies to itself (a rank in both grids) to move a tensor from ``src`` to ``dst``.

    ``sends`` and ``recvs`` are in ``(peer, box)`` order, so the pieces between two ranks pack and
    unpack alike; ``local`` pairs slices of this rank's source block with slices of its destination
    block.
    """

    src: Layout
    dst: Layout
    rank: int
    sends: tuple[GroupPiece, ...]
    recvs: tuple[GroupPiece, ...]
    local: tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]

    @property
    def send_elements(self) -> int:
        """Elements this rank sends to other ranks."""
        return sum(p.size for p in self.sends)

    @property
    def recv_elements(self) -> int:
        """Elements this rank receives from other ranks."""
        return sum(p.size for p in self.recvs)

    @property
    def peers_sent(self) -> tuple[int, ...]:
        """The ranks this rank sends to, each once, ascending."""
        return tuple(sorted({p.peer for p in self.sends}))

    @property
    def peers_received(self) -> tuple[int, ...]:
        """The ranks this rank receives from, each once, ascending."""
        return tuple(sorted({p.peer for p in self.recvs}))


def _relative(box: Ranges, origin: Ranges) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def _check(src: Layout, src_ranks: tuple[int, ...], dst: Layout, dst_ranks: tuple[int, ...]) -> None:
    if src.global_shape != dst.global_shape:
        raise ValueError(
            f"group transfer: the source holds a tensor of shape {src.global_shape} but the destination "
            f"expects {dst.global_shape}; both sides must describe the same tensor"
        )
    for name, layout, ranks in (("src", src, src_ranks), ("dst", dst, dst_ranks)):
        if len(ranks) != layout.nranks:
            raise ValueError(
                f"group transfer: {name}_ranks names {len(ranks)} ranks but the {name} layout's grid "
                f"{layout.grid_dims} has {layout.nranks}; give the common rank of every grid rank"
            )
        if len(set(ranks)) != len(ranks) or any(r < 0 for r in ranks):
            raise ValueError(f"group transfer: {name}_ranks={ranks} must be distinct ranks >= 0")


@lru_cache(maxsize=64)
def _cached(
    src: Layout, src_ranks: tuple[int, ...], dst: Layout, dst_ranks: tuple[int, ...], rank: int
) -> GroupTransferPlan:
    _check(src, src_ranks, dst, dst_ranks)
    rep = set(src.replicated_axes)
    # the source blocks that send: one replica (coordinate 0 on the replicated axes) per block
    senders = []
    for g in range(src.nranks):
        c = grid_coords(g, src.grid_dims)
        if all(c[a] == 0 for a in rep):
            senders.append((src_ranks[g], src.local_ranges(c)))
    receivers = [(dst_ranks[g], dst.local_ranges(grid_coords(g, dst.grid_dims))) for g in range(dst.nranks)]
    my_src = next((box for r, box in senders if r == rank), None)
    my_dst = next((box for r, box in receivers if r == rank), None)
    sends: list[GroupPiece] = []
    recvs: list[GroupPiece] = []
    local = []
    if my_src is not None:
        for peer, theirs in receivers:
            box = intersect(my_src, theirs)
            if box is None:
                continue
            if peer == rank:
                local.append((_relative(box, my_src), _relative(box, theirs)))
            else:
                sends.append(GroupPiece(peer, box, _relative(box, my_src)))
    if my_dst is not None:
        for peer, theirs in senders:
            box = intersect(theirs, my_dst)
            if box is not None and peer != rank:
                recvs.append(GroupPiece(peer, box, _relative(box, my_dst)))
    order = lambda p: (p.peer, p.box)  # noqa: E731
    return GroupTransferPlan(
        src, dst, rank, tuple(sorted(sends, key=order)), tuple(sorted(recvs, key=order)), tuple(local)
    )


def group_transfer_plan(
    src: Layout, src_ranks: Sequence[int], dst: Layout, dst_ranks: Sequence[int], rank: int
) -> GroupTransferPlan:
    """Local. Build (and cache) the plan for ``rank`` to move a tensor from the ``src`` layout on
    one grid to the ``dst`` layout on another, both inside one communicator.

    Parameters
    ----------
    src, dst : Layout
        Layouts of the same global shape; their grids may differ in shape and size.
    src_ranks, dst_ranks : sequence of int
        The rank in the common communicator of each grid rank (row-major) of ``src``'s and
        ``dst``'s grid. A rank may be in both (it then copies what it keeps).
    rank : int
        The calling rank, in the common communicator (it may be in neither grid: an empty plan).

    Returns
    -------
    GroupTransferPlan

    Raises
    ------
    ValueError
        If the layouts describe different tensors, or a rank list does not fit its grid.
    """
    return _cached(src, tuple(int(r) for r in src_ranks), dst, tuple(int(r) for r in dst_ranks), int(rank))
