"""Online training data: a running simulation puts its field blocks, a trainer draws training pairs
from a distributed replay buffer in its ranks' memory, and nothing goes through a file.

Placements (one class, chosen by which ranks pass which grid)
    **Co-located**: every rank runs the simulation and the trainer, and the simulation's blocks are
    the trainer's blocks (the same ranks, the same cuts along every dim): :meth:`Stream.put` copies
    the block into the trainer's memory on the same rank, with no message.
    **Separate groups**: the simulation's ranks and the trainer's ranks differ (one job split in two:
    ``mpiexec -n 8 sim : -n 4 train``, or :func:`hpctp.comm.split_comm`). Each snapshot moves from the
    simulation's decomposition to the trainer's layout in one redistribution across the groups
    (:func:`hpctp.layout.group_transfer_plan`: one message per pair of ranks whose blocks meet),
    started with non-blocking sends, so :meth:`Stream.put` returns while the data travels.

Flow control between the groups (separate groups)
    The trainer holds at most ``depth`` snapshots that it has not yet put into its buffer. The
    simulation's first rank keeps the count of snapshots sent and of *credits* (the trainer's first
    rank sends one per snapshot it took in). Snapshots are thinned by pairs: one sent as a pair's
    input reserves room for its target, which then goes without waiting; any other snapshot goes
    only if there is room for a pair, waiting at most ``max_wait`` seconds for credits, else it is
    *thinned*: not sent, counted as dropped (that rank's decision reaches the other simulation ranks
    in the small all-reduce that also agrees on errors, once per snapshot). A slow trainer gets fewer
    pairs, never halves of pairs. A header per snapshot
    (index, produced and dropped counts) goes from the simulation's first rank to the trainer's, which
    announces it to the trainer ranks; they then post the receives. :meth:`Stream.end` sends the end
    header; the trainer answers with the number of credits it sent before reading it, so no message
    is left unreceived. A trainer that is done with its steps keeps taking the snapshots in
    :meth:`Stream.close` until the end, so the simulation is never left waiting.

Determinism
    Snapshots are numbered as the simulation puts them (dropped ones too). The trainer takes them in
    order, forms the pairs ``(x_n, x_{n + horizon})`` (or the ``(x, target)`` pairs given to ``put``
    with ``horizon = 0``), keeps every ``holdout_every``-th pair aside and puts the others into the
    replay buffer with the pure decisions of :class:`hpctp.io.ReplayPlan`. A trainer takes snapshot
    ``n`` into its buffer only when told to (:meth:`Stream.ingest` ``until``), so what a training
    step draws depends on the step and the snapshots counted before it, never on timing or on the
    rank count. Thinning depends on timing; with ``max_wait = inf`` nothing is dropped and the run
    is reproducible.

Memory
    A stored pair holds its input and its target (``2 x`` a snapshot, also for lag pairs, so eviction
    can drop pairs independently); the buffer holds ``buffer_bytes // pair bytes`` pairs of the
    *global* field, so each trainer rank holds its blocks of them (a data-parallel copy of the trainer
    holds its own). The simulation keeps a packed copy of each snapshot in flight (at most ``depth``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import astuple
from typing import Any

import numpy as np

from .. import comm as C
from .._util.backend import to_numpy
from .._util.dtypes import dtype_code, dtype_from_code, dtype_name
from .._util.ints import is_int
from ..comm import ProcessGrid, tags
from ..layout import Layout
from ..layout.groups import GroupPiece, GroupTransferPlan, group_transfer_plan
from ..tensor.core import DistTensor
from ._replay_buffer import ReplayBuffer
from ._stream_config import StreamConfig, StreamStats
from .replay import ReplayPlan

__all__ = ["Stream", "StreamConfig", "StreamStats"]

POLL_SECONDS = 1e-3
"""Sleep between two tests for a credit while the simulation waits: shorter reacts sooner and spins
more (the simulation's core is idle while it waits)."""

_HEADER = 6  # int64: kind, snapshot index, produced, dropped, sent, has a target
_DATA, _END = 0, 1
# point-to-point tags (on the stream's own communicator, a duplicate: no other message can match them)
_TAG_DATA, _TAG_HEADER, _TAG_CREDIT, _TAG_ACK = (
    tags.STREAM_DATA,
    tags.STREAM_HEADER,
    tags.STREAM_CREDIT,
    tags.STREAM_ACK,
)


class _Staged:
    """One announced snapshot on a trainer rank: its header, its receives and their buffers."""

    def __init__(self, header: np.ndarray, pending: list[C.Pending], buffers: list[np.ndarray]) -> None:
        self.header = header
        self.pending = pending
        self.buffers = buffers

    @property
    def index(self) -> int:
        return int(self.header[1])

    @property
    def is_end(self) -> bool:
        return int(self.header[0]) == _END


def _describe(layout: Layout, dtype: str) -> list[int]:
    """A layout and a dtype as ints: ndim, shape, dtype code, grid ndim, dims, split (-1: none), cuts."""
    out = [layout.ndim, *layout.global_shape, dtype_code(dtype), len(layout.grid_dims), *layout.grid_dims]
    out += [-1 if s is None else int(s) for s in layout.split]
    for c in layout.dim_cuts:
        out += list(c)
    return out


def _decode(row: np.ndarray) -> tuple[Layout, str]:
    v = [int(x) for x in row]
    nd = v[0]
    shape = tuple(v[1 : 1 + nd])
    dtype = dtype_name(dtype_from_code(v[1 + nd], "numpy"))
    ng = v[2 + nd]
    dims = tuple(v[3 + nd : 3 + nd + ng])
    split = tuple(None if s < 0 else s for s in v[3 + nd + ng : 3 + 2 * nd + ng])
    pos = 3 + 2 * nd + ng
    cuts = []
    for d in range(nd):
        parts = 1 if split[d] is None else dims[split[d]]  # type: ignore[index]
        cuts.append(tuple(v[pos : pos + parts + 1]))
        pos += parts + 1
    return Layout(shape, dims, split, tuple(cuts)), dtype


class Stream:
    """Collective over ``comm``. A channel from a simulation's field blocks to a trainer's replay buffer.

    Every rank of ``comm`` constructs it; simulation ranks pass ``sim_grid`` and ``sim_layout``, trainer
    ranks ``train_grid`` (and ``train_split``); a rank may pass both (co-located) or neither (it only
    takes part in the set-up and :meth:`close`).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm or ProcessGrid
        The ranks of both groups (e.g. ``MPI.COMM_WORLD``); the stream works on a duplicate.
    shape : sequence of int
        Global shape of one snapshot (e.g. ``[C, H, W]``).
    dtype : dtype
        Dtype of the snapshots (numpy/torch spelling).
    config : StreamConfig, optional
        The same on every rank.
    sim_grid : ProcessGrid, optional
        The simulation's grid (its ranks only).
    sim_layout : Layout, optional
        The simulation's layout of one snapshot on ``sim_grid`` (its own, possibly uneven, cuts).
    train_grid : ProcessGrid, optional
        The trainer's grid (all trainer ranks: with data parallelism, the whole training grid).
    train_split : split specification, optional
        Grid axis of ``train_grid`` per dim of a snapshot (default: dim ``d + 1`` over axis ``d``
        for the last ``train_grid.ndim`` dims, e.g. ``(None, 0, 1)``); axes dividing no dim hold
        copies. Blocks are balanced, except that co-located ranks keep the simulation's cuts.

    Raises
    ------
    ValueError, TypeError
        On every rank of ``comm``, before any snapshot moves: a bad setting, grids that do not fit
        their ranks, or a simulation whose snapshots' shape or dtype is not what the trainer expects.
    """

    def __init__(
        self,
        comm: Any,
        shape: Sequence[int],
        dtype: object,
        config: StreamConfig | None = None,
        *,
        sim_grid: ProcessGrid | None = None,
        sim_layout: Layout | None = None,
        train_grid: ProcessGrid | None = None,
        train_split: object = None,
    ) -> None:
        union = getattr(comm, "comm", comm)
        config = StreamConfig() if config is None else config
        error: Exception | None = None
        self.shape: tuple[int, ...] = ()
        self.dtype = ""
        my_train: Layout | None = None
        try:
            if not isinstance(config, StreamConfig):
                raise TypeError(f"config must be a StreamConfig, got {type(config).__name__}")
            config.check()
            if not all(is_int(s) and int(s) >= 1 for s in shape):
                raise ValueError(f"shape={tuple(shape)!r} must be positive ints (one snapshot's global shape)")
            self.shape = tuple(int(s) for s in shape)
            self.dtype = dtype_name(dtype)
            if (sim_grid is None) != (sim_layout is None):
                raise TypeError("pass sim_grid and sim_layout together (simulation ranks), or neither")
            if sim_grid is not None and sim_layout is not None:
                C.check_grid(sim_grid)
                if not isinstance(sim_layout, Layout):
                    raise TypeError(f"sim_layout must be a hpctp.Layout, got {type(sim_layout).__name__}")
                if sim_layout.grid_dims != sim_grid.dims:
                    raise ValueError(f"sim_layout is on a grid {sim_layout.grid_dims} but sim_grid is {sim_grid.dims}")
            if train_grid is not None:
                C.check_grid(train_grid)
                split = train_split
                if split is None:
                    split = (None,) * (len(self.shape) - train_grid.ndim) + tuple(range(train_grid.ndim))
                my_train = Layout(self.shape, train_grid.dims, split)  # type: ignore[arg-type]
            elif train_split is not None:
                raise TypeError("train_split needs train_grid")
        except (TypeError, ValueError) as e:
            error = e
        C.agree_arguments(union, "Stream", error, config=astuple(config))
        self.config = config
        self._grid = ProcessGrid([union.Get_size()], comm=union)  # the stream's own duplicate
        self.rank = self._grid.rank
        try:
            self._roles(sim_grid, sim_layout, train_grid, my_train)
        except BaseException:  # (raised on every rank: the set-up is collective)
            self._grid.free()
            raise
        self.stats = StreamStats()
        self._ended = False
        self._end_taken = False
        if self.is_simulation:
            self._setup_simulation(sim_grid)  # type: ignore[arg-type]
        if self.is_trainer:
            self._setup_trainer(train_grid)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ set-up (collective)
    def _roles(
        self,
        sim_grid: ProcessGrid | None,
        sim_layout: Layout | None,
        train_grid: ProcessGrid | None,
        my_train: Layout | None,
    ) -> None:
        comm = self._grid.comm
        row = [int(sim_grid is not None), sim_grid.rank if sim_grid else -1]
        row += [int(train_grid is not None), train_grid.rank if train_grid else -1]
        table = C.allgather_ints(comm, row)
        sims = {int(r[1]): u for u, r in enumerate(table) if r[0]}
        trains = {int(r[3]): u for u, r in enumerate(table) if r[2]}
        for name, ranks in (("simulation", sims), ("trainer", trains)):
            if not ranks or sorted(ranks) != list(range(len(ranks))):
                raise ValueError(
                    f"Stream: the {name} grid must be given on its ranks, and only there (found grid ranks "
                    f"{sorted(ranks)} among {comm.Get_size()} ranks); every rank of that grid passes it"
                )
        self.sim_ranks = tuple(sims[g] for g in range(len(sims)))
        self.train_ranks = tuple(trains[g] for g in range(len(trains)))
        # the layouts, as the groups' first ranks describe them
        src = self._bcast_desc(self.sim_ranks[0], sim_layout, self.dtype)
        dst = self._bcast_desc(self.train_ranks[0], my_train, self.dtype)
        error: Exception | None = None
        if sim_layout is not None and (
            sim_layout != src[0] or self.dtype != src[1] or self.shape != src[0].global_shape
        ):
            error = ValueError(
                f"Stream: simulation rank {sim_grid.rank if sim_grid else -1} passed {sim_layout}, {self.dtype}, but "
                f"its first rank passed {src[0]}, {src[1]}; every simulation rank describes the same field"
            )
        if my_train is not None and (my_train != dst[0] or self.dtype != dst[1]):
            error = ValueError(
                f"Stream: trainer rank {train_grid.rank if train_grid else -1} passed {my_train}, {self.dtype}, but "
                f"its first rank passed {dst[0]}, {dst[1]}; every trainer rank passes the same grid, split and dtype"
            )
        C.raise_if_any(comm, error)
        (src_layout, src_dtype), (dst_layout, dst_dtype) = src, dst
        if src_layout.global_shape != dst_layout.global_shape or src_dtype != dst_dtype:
            raise ValueError(  # (every rank sees the same two descriptions: raised on every rank)
                f"Stream: the simulation puts snapshots of shape {src_layout.global_shape} and dtype {src_dtype}, but "
                f"the trainer expects shape {dst_layout.global_shape} and dtype {dst_dtype}; make them agree"
            )
        self.shape, self.dtype = src_layout.global_shape, src_dtype
        self.sim_layout = src_layout
        self.colocated = self.sim_ranks == self.train_ranks and all(
            src_layout.parts(d) == dst_layout.parts(d) for d in range(src_layout.ndim)
        )
        if self.colocated:  # keep the simulation's cuts: with matching coordinates, nothing moves
            dst_layout = Layout(self.shape, dst_layout.grid_dims, dst_layout.split, src_layout.dim_cuts)
        self.layout = dst_layout
        self.plan: GroupTransferPlan = group_transfer_plan(
            src_layout, self.sim_ranks, dst_layout, self.train_ranks, self.rank
        )
        self.colocated = C.all_true(comm, self.colocated and not self.plan.sends and not self.plan.recvs)
        self.is_simulation = sim_grid is not None
        self.is_trainer = train_grid is not None
        self.sim_root = self.sim_ranks[0]
        self.train_root = self.train_ranks[0]

    def _bcast_desc(self, root: int, layout: Layout | None, dtype: str) -> tuple[Layout, str]:
        comm = self._grid.comm
        desc = _describe(layout, dtype) if self.rank == root and layout is not None else None
        n = int(C.bcast_ints(comm, [len(desc)] if desc is not None else None, 1, root=root)[0])
        return _decode(C.bcast_ints(comm, desc, n, root=root))

    def _setup_simulation(self, grid: ProcessGrid) -> None:
        self._sim = ProcessGrid(grid.dims, comm=grid.comm)  # collectives of put (a duplicate)
        self._sim_local_shape = self.sim_layout.local_shape(grid.coords)
        self._outgoing: dict[int, list[GroupPiece]] = {}
        for p in self.plan.sends:
            self._outgoing.setdefault(p.peer, []).append(p)
        self._in_flight: deque[tuple[list[C.Pending], list[np.ndarray]]] = deque()
        self._credits_in = 0  # credit messages received (first rank)
        self._consumed = 0  # snapshots the trainer took in, as the last credit said
        self._credit_buf = np.zeros(1, dtype=np.int64)
        self._reserved: set[int] = set()  # (first rank) snapshots promised as the targets of pairs sent
        self._ack_buf = np.zeros(1, dtype=np.int64)
        self._ack_req: C.Pending | None = None

    def _setup_trainer(self, grid: ProcessGrid) -> None:
        cfg = self.config
        self._train = ProcessGrid(grid.dims, comm=grid.comm)  # announcements (a duplicate)
        self.train_coords = grid.coords
        local = self.layout.local_shape(grid.coords)
        pair_bytes = 2 * math.prod(self.shape) * np.dtype(self.dtype).itemsize
        capacity = int(cfg.buffer_bytes) // pair_bytes
        hold = int(cfg.holdout_bytes) // pair_bytes if cfg.holdout_every else 0
        error: Exception | None = None
        if capacity < 1 or (cfg.holdout_every and hold < 1):
            error = ValueError(
                f"Stream: a pair of {self.shape} {self.dtype} snapshots takes {pair_bytes} bytes; buffer_bytes="
                f"{cfg.buffer_bytes} and holdout_bytes={cfg.holdout_bytes} must hold at least one each"
            )
        C.raise_if_any(self._train.comm, error)
        self.buffer = ReplayBuffer(cfg, capacity, hold, local, self.dtype, self.stats)
        self.replay: ReplayPlan = self.buffer.plan
        self._train_local_shape = local
        self._staged: deque[_Staged] = deque()
        self._taken = 0  # snapshots taken in (data headers processed)
        self._produced_seen = 0
        self._credits_out: list[tuple[C.Pending, np.ndarray]] = []
        self._credits_sent = 0
        self._end_read = False  # (first rank) the end header has arrived: no more credits
        self._header_buf = np.zeros(_HEADER, dtype=np.int64)
        self._header_req: C.Pending | None = None
        self._self_parts: dict[int, list[np.ndarray]] = {}  # co-located or overlapping ranks: kept pieces
        if self.rank == self.train_root and not self.colocated:
            self._header_req = C.irecv(self._grid.comm, self._header_buf, self.sim_root, _TAG_HEADER)

    # ------------------------------------------------------------------ the simulation's side
    def put(self, block: Any, target: Any = None) -> bool:
        """Collective over the simulation's grid. Hand over this rank's block of the next snapshot.

        The block is copied (packed for sending, or into the trainer's memory when co-located); the
        simulation may overwrite it when this returns. Waits at most ``max_wait`` seconds for the
        trainer (separate groups); the snapshot is then thinned (counted in ``stats.dropped``).

        Parameters
        ----------
        block : numpy.ndarray, torch.Tensor, cupy.ndarray or DistTensor
            This rank's block of ``sim_layout`` (a DistTensor: of that layout), of the stream's dtype.
        target : same as ``block``, optional
            With ``horizon = 0``: this rank's block of the pair's target (required then, else refused).

        Returns
        -------
        bool
            True if the snapshot went to the trainer, False if it was thinned (the same on every rank).

        Raises
        ------
        ValueError, TypeError
            On every simulation rank before anything is sent, on a block of the wrong shape, layout or
            dtype, a missing or unexpected target, or a stream that has ended.
        RuntimeError
            On a rank that is not a simulation rank (local).
        """
        if not self.is_simulation:
            raise RuntimeError("Stream.put: this rank passed no sim_grid; only simulation ranks put snapshots")
        error: Exception | None = None
        arrays: list[np.ndarray] = []
        try:
            if self._ended:
                raise ValueError("Stream.put after Stream.end: the stream has ended")
            if self.config.horizon > 0 and target is not None:
                raise ValueError(
                    f"Stream.put: horizon={self.config.horizon} forms the pairs from the snapshots; pass no target"
                )
            if self.config.horizon == 0 and target is None:
                raise ValueError("Stream.put: horizon=0 takes each pair from put(x, target=y); pass the target")
            for what, b in (("block", block), ("target", target)):
                if b is not None:
                    arrays.append(self._check_block(what, b))
        except (TypeError, ValueError) as e:
            error = e
        drop = 0
        if error is None and self.colocated:  # (the same on every rank: the trainer's part is collective)
            drop = int(sum(not s.is_end for s in self._staged) >= self.config.depth)
        elif error is None and self.rank == self.sim_root:
            drop = int(not self._decide(self.stats.produced))
        flags = np.array([int(error is not None), drop], dtype=np.int64)
        agreed = C.iallreduce(self._sim.comm, flags, "max")  # (the others wait here while the first rank
        while not agreed.test():  # waits for credits: sleeping, so a trainer sharing the cores runs)
            time.sleep(POLL_SECONDS)
        if flags[0]:
            C.raise_if_any(self._sim.comm, error)
        index = self.stats.produced
        self.stats.produced += 1
        if flags[1]:
            self.stats.dropped += 1
            return False
        header = np.array([_DATA, index, self.stats.produced, self.stats.dropped, self.stats.sent + 1, len(arrays) - 1])
        self.stats.sent += 1
        if self.colocated:  # the trainer's blocks are these: copy, no message
            parts = [np.array(a, copy=True) for a in arrays]
            self._staged.append(_Staged(header, [], parts))
            return True
        self._send(index, header, arrays)
        return True

    def _check_block(self, what: str, b: Any) -> np.ndarray:
        if isinstance(b, DistTensor):
            if b.layout != self.sim_layout:
                raise ValueError(
                    f"Stream.put: {what} has layout {b.layout}, but the stream was set up with {self.sim_layout}"
                )
            b = b.local
        arr = to_numpy(b)
        if tuple(arr.shape) != self._sim_local_shape:
            raise ValueError(
                f"Stream.put: simulation rank {self._sim.rank} passed a {what} of shape {tuple(arr.shape)}, but its "
                f"block of {self.sim_layout.global_shape} is {self._sim_local_shape}"
            )
        if arr.dtype.name != self.dtype:
            raise TypeError(f"Stream.put: {what} has dtype {arr.dtype.name}, the stream carries {self.dtype}")
        return arr

    def _send(self, index: int, header: np.ndarray, arrays: list[np.ndarray]) -> None:
        comm = self._grid.comm
        pending: list[C.Pending] = []
        buffers: list[np.ndarray] = []
        for peer, pieces in sorted(self._outgoing.items()):
            buf = np.concatenate([np.ascontiguousarray(a[p.slices]).reshape(-1) for a in arrays for p in pieces])
            pending.append(C.isend(comm, buf, peer, _TAG_DATA))
            buffers.append(buf)
            self.stats.bytes_sent += buf.nbytes
        if self.plan.local:  # this rank also trains: keep its own pieces
            self._self_parts[index] = [np.array(a[s], copy=True) for a in arrays for s, _ in self.plan.local]
        if self.rank == self.sim_root:
            hbuf = np.asarray(header, dtype=np.int64)
            pending.append(C.isend(comm, hbuf, self.train_root, _TAG_HEADER))
            buffers.append(hbuf)
        self._in_flight.append((pending, buffers))
        while self._in_flight and all(p.test() for p in self._in_flight[0][0]):
            self._in_flight.popleft()

    def _receive_credit(self) -> None:
        C.irecv(self._grid.comm, self._credit_buf, self.train_root, _TAG_CREDIT).wait()
        self._credits_in += 1
        self._consumed = int(self._credit_buf[0])

    def _poll_credits(self) -> None:
        """(The simulation's first rank.) Take in the credits that arrived (probed first, so no
        receive is left posted)."""
        while C.iprobe(self._grid.comm, self.train_root, _TAG_CREDIT):
            self._receive_credit()

    def _decide(self, index: int) -> bool:
        """(The simulation's first rank.) Send snapshot ``index``, or thin it (False).

        Thinning keeps whole pairs: a snapshot sent as the input of a pair reserves a place for its
        target ``horizon`` snapshots later, which is then sent without waiting; any other snapshot is
        sent only if it can start a pair (room for itself and its target: ``outstanding + reserved
        + 2 <= depth``, 1 with ``horizon = 0``), waiting at most ``max_wait`` seconds for credits. A
        snapshot that could only end in a broken pair is never sent."""
        h, depth = self.config.horizon, self.config.depth
        self._poll_credits()
        if index in self._reserved:  # the target of a pair on its way: room was kept for it
            self._reserved.discard(index)
            if h and (self.stats.sent + 1 - self._consumed) + len(self._reserved) + 1 <= depth:
                self._reserved.add(index + h)  # and the input of the next one
            return True
        need = 2 if h else 1
        room = lambda: (self.stats.sent - self._consumed) + len(self._reserved) + need <= depth  # noqa: E731
        if not room():
            t0 = time.perf_counter()
            deadline = t0 + float(self.config.max_wait)
            while not room() and time.perf_counter() < deadline:
                time.sleep(max(0.0, min(POLL_SECONDS, deadline - time.perf_counter())))
                self._poll_credits()
            self.stats.waited += time.perf_counter() - t0
            if not room():
                return False
        if h:
            self._reserved.add(index + h)
        return True

    def end(self) -> None:
        """Collective over the simulation's grid. No more snapshots: the trainer finishes on what it
        got (idempotent; a no-op on other ranks)."""
        if not self.is_simulation or self._ended:
            return
        self._ended = True
        s = self.stats
        header = np.array([_END, s.produced, s.produced, s.dropped, s.sent, 0], dtype=np.int64)
        if self.colocated:
            self._staged.append(_Staged(header, [], []))
            return
        if self.rank == self.sim_root:
            self._in_flight.append(([C.isend(self._grid.comm, header, self.train_root, _TAG_HEADER)], [header]))
            self._ack_req = C.irecv(self._grid.comm, self._ack_buf, self.train_root, _TAG_ACK)

    def _finish_simulation(self) -> None:
        """(Local, point-to-point.) Wait for the sends, the trainer's answer to the end and its credits."""
        for pending, _ in self._in_flight:
            C.waitall(pending)
        self._in_flight.clear()
        if self._ack_req is not None:
            self._ack_req.wait()
            while self._credits_in < int(self._ack_buf[0]):  # (sent before the answer: they are there)
                self._receive_credit()
            self._ack_req = None

    # ------------------------------------------------------------------ the trainer's side
    @property
    def ended(self) -> bool:
        """Local. The stream has ended: :meth:`end` was called (simulation ranks), the end was taken
        in (trainer ranks)."""
        return self._end_taken if self.is_trainer else self._ended

    @property
    def produced(self) -> int:
        """Local. (Trainer ranks.) Snapshots the simulation is known to have produced (dropped ones
        too): those taken in, and those before the first one announced but not yet taken in."""
        known = self._produced_seen
        if self._staged and not self._staged[0].is_end:
            known = max(known, self._staged[0].index)
        return known

    @property
    def pairs(self) -> int:
        """Local. (Trainer ranks.) Training pairs formed so far (:meth:`draw` needs one)."""
        return self.stats.pairs

    def ingest(self, until: int | None = None, wait: bool = True) -> None:
        """Collective over the trainer's grid. Take in the snapshots numbered below ``until`` (all that
        arrived if None), in order: form their pairs and put them into the buffer or the held-out store.

        Parameters
        ----------
        until : int, optional
            Take in no snapshot numbered ``until`` or later (they stay in flight: the determinism of
            the draws). None: every snapshot that has arrived.
        wait : bool
            Wait until :attr:`produced` reaches ``until`` or the stream ends (``until=None``: the end).
            Co-located ranks never wait: they took in what :meth:`put` gave (they run both sides).

        Raises
        ------
        RuntimeError
            On a rank that is not a trainer rank (local).
        """
        if not self.is_trainer:
            raise RuntimeError("Stream.ingest: this rank passed no train_grid; only trainer ranks take snapshots in")
        limit = math.inf if until is None else int(until)
        self._announce(block=False)
        self._take(limit)
        while wait and not self.colocated and not (self._end_taken or self.produced >= limit):
            self._announce(block=True)  # (the same decision on every trainer rank: the same headers)
            self._take(limit)

    def _take(self, limit: float) -> None:
        """Process the staged snapshots in order while their numbers are below ``limit``."""
        while self._staged and (self._staged[0].is_end or self._staged[0].index < limit):
            s = self._staged.popleft()
            if s.is_end:
                self._end_taken = True
                self._produced_seen = int(s.header[2])
                self.stats.produced, self.stats.dropped, self.stats.sent = (int(v) for v in s.header[2:5])
                return
            C.waitall(s.pending)
            arrays = self._unpack(s)
            self._insert(s.index, arrays[0], arrays[1] if len(arrays) > 1 else None)
            self._produced_seen = int(s.header[2])
            self.stats.produced, self.stats.dropped, self.stats.sent = (int(v) for v in s.header[2:5])
            self.stats.received += 1
            self._taken += 1
            if self.rank == self.train_root and not self.colocated and not self._end_read:
                credit = np.array([self._taken], dtype=np.int64)
                self._credits_out.append((C.isend(self._grid.comm, credit, self.sim_root, _TAG_CREDIT), credit))
                self._credits_sent += 1
            self._credits_out = [(p, b) for p, b in self._credits_out if not p.test()]

    def _unpack(self, s: _Staged) -> list[np.ndarray]:
        if self.colocated:
            return s.buffers
        count = int(s.header[5]) + 1
        out = [np.empty(self._train_local_shape, dtype=self.dtype) for _ in range(count)]
        by_peer: dict[int, list[GroupPiece]] = {}
        for p in self.plan.recvs:
            by_peer.setdefault(p.peer, []).append(p)
        for buf, (_, pieces) in zip(s.buffers, sorted(by_peer.items())):
            pos = 0
            for a in out:
                for p in pieces:
                    a[p.slices] = buf[pos : pos + p.size].reshape(p.shape)
                    pos += p.size
        kept = self._self_parts.pop(s.index, [])
        for i, part in enumerate(kept):
            a = out[i // len(self.plan.local)]
            a[self.plan.local[i % len(self.plan.local)][1]] = part
        return out

    def _announce(self, block: bool) -> bool:
        """Collective over the trainer's grid. The first rank takes the headers that arrived (waiting for
        one with ``block``) and tells the others; every rank posts the receives of the announced
        snapshots. Returns True if anything was announced."""
        if self.colocated:
            return False  # (put staged the snapshots itself)
        cap = self.config.depth + 1
        msg = np.zeros(1 + cap * _HEADER, dtype=np.int64)
        if self.rank == self.train_root:
            got = 0
            while self._header_req is not None and got < cap:
                if not self._header_req.test():
                    if not (block and got == 0):
                        break
                    self._header_req.wait()
                msg[1 + got * _HEADER : 1 + (got + 1) * _HEADER] = self._header_buf
                got += 1
                self._header_req = None
                if int(self._header_buf[0]) == _END:
                    self._end_read = True
                    ack = np.array([self._credits_sent], dtype=np.int64)
                    self._credits_out.append((C.isend(self._grid.comm, ack, self.sim_root, _TAG_ACK), ack))
                else:
                    self._header_req = C.irecv(self._grid.comm, self._header_buf, self.sim_root, _TAG_HEADER)
            msg[0] = got
        C.bcast(self._train.comm, msg, root=0)
        by_peer: dict[int, int] = {}
        for p in self.plan.recvs:
            by_peer[p.peer] = by_peer.get(p.peer, 0) + p.size
        for i in range(int(msg[0])):
            header = msg[1 + i * _HEADER : 1 + (i + 1) * _HEADER].copy()
            pending, buffers = [], []
            if int(header[0]) == _DATA:
                count = int(header[5]) + 1
                for peer, n in sorted(by_peer.items()):
                    buf = np.empty(n * count, dtype=self.dtype)
                    pending.append(C.irecv(self._grid.comm, buf, peer, _TAG_DATA))
                    buffers.append(buf)
            self._staged.append(_Staged(header, pending, buffers))
        return bool(msg[0])

    def _insert(self, index: int, x: np.ndarray, y: np.ndarray | None) -> None:
        self.buffer.insert(index, x, y)

    def draw(self, step: int) -> np.ndarray:
        """Local. (Trainer ranks.) The buffer slots training step ``step`` reads (its global batch, the
        same on every trainer rank; see :meth:`hpctp.io.ReplayPlan.draw`). Counts the draws.

        Raises
        ------
        ValueError
            If no training pair has arrived.
        """
        return self.buffer.draw(step)

    def batch(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Local. (Trainer ranks.) This rank's blocks of the pairs in ``slots``: inputs and targets,
        ``[len(slots), *block]`` each (copies), in :attr:`layout`'s cuts."""
        return self.buffer.batch(slots)

    def contents(self) -> tuple[np.ndarray, np.ndarray]:
        """Local. (Trainer ranks.) Per slot of the buffer: the pair's number (in the order pairs were
        formed) and the snapshot number of its input (-1 for an empty slot)."""
        return self.buffer.contents()

    def held_out_pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Local. (Trainer ranks.) The held-out pairs kept: inputs, targets (this rank's blocks) and the
        snapshot number of each input, in snapshot order."""
        return self.buffer.held_out_pairs()

    def pair_rms(self) -> float:
        """Collective over the trainer's grid. RMS of ``target - input`` over the pairs in the buffer
        (of the global field: one all-reduce over the grid's spatial parts)."""
        sums = np.array(self.buffer.square_sums(), dtype=np.float64)
        # the copies of a replicated (data-parallel) layout would count twice: only the primaries add
        if not self.layout.is_primary(self.train_coords):
            sums[:] = 0.0
        C.allreduce(self._train.comm, sums, "sum")
        return float(np.sqrt(sums[0] / sums[1])) if sums[1] else 0.0

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Collective over ``comm``. End the stream (:meth:`end` on simulation ranks), let trainer ranks
        take in what is still coming until the end (:meth:`ingest`), complete every message, and free
        the stream's communicators. The buffer stays readable on trainer ranks."""
        if self.is_simulation:
            self.end()
        if self.is_trainer and not self._end_taken:
            self.ingest(None, wait=True)
        if self.is_simulation and not self.colocated:
            self._finish_simulation()
        if self.is_trainer:
            C.waitall([p for p, _ in self._credits_out])
            self._credits_out.clear()
            self._train.free()
        if self.is_simulation:
            self._sim.free()
        self._grid.free()
