"""The flight recorder: the last N MPI calls of hpctp on each rank, and the mismatch check.

Every collective and point-to-point call that :mod:`hpctp.comm` makes (blocking and
non-blocking, on every communicator: the grid, its axes, plan sub-communicators, the
agreements of :func:`~hpctp.comm.agree_arguments`, communicator creation) passes through
:func:`begin` before it is handed to MPI and :func:`end` when it completes (a blocking call
returns; a non-blocking one is completed by :meth:`Pending.wait <hpctp.comm.Pending.wait>`,
:meth:`~hpctp.comm.Pending.test` or :func:`~hpctp.comm.waitall`, which first mark it *waiting*
with :func:`waiting`). An entry holds the communicator (a :class:`Group`: its name and member
world ranks), the sequence number of the call on that communicator (one counter for
collectives, one for point-to-point; a third per peer, tag and direction pairs each send with
its receive), the operation, its bytes, dtype, root or peer and tag, the hpctp operation that
issued it and the user's ``file:line`` (:mod:`hpctp.comm.callsite`), and the times it was
posted, waited for and completed. Entries live in a ring of the last N (``HPCTP_TRACE=N``).

Off by default: each call of hpctp.comm then pays one branch on the module flag :data:`on`.
The analysis of the entries (which ranks are missing from which call, late arrivals, a
timeline) is :mod:`hpctp.debug`'s; this module holds no thread and writes no file, and
:mod:`hpctp.comm` never imports :mod:`hpctp.debug`: the watchdog registers itself with
:func:`on_first_grid`, and the dumps are :func:`snapshot` dictionaries under the keys of
:class:`Keys`.

Mismatch check (``HPCTP_CHECK=1``): before each collective, the ranks of the communicator
gather one row of int64 (operation, bytes, dtype, root) in an ``Allgather`` of their own; when
the rows differ every rank raises :class:`CollectiveMismatch` with each rank's values and call
site, before the call moves any data. It is armed when the first grid is built, after the
ranks agreed that all of them check (a check on some ranks only would itself hang).
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import numpy as np
from mpi4py import MPI

from . import callsite
from .env import check_setting, trace_dir_setting, trace_setting, watchdog_setting
from .virtual import VirtualComm

__all__ = [
    "DEFAULT_ENTRIES",
    "FORMAT_VERSION",
    "CollectiveMismatch",
    "Entry",
    "Group",
    "Keys",
    "Recorder",
    "Settings",
    "abort_job",
    "begin",
    "end",
    "entries",
    "label",
    "on_first_grid",
    "recorder",
    "set_abort",
    "settings",
    "snapshot",
    "start",
    "stop",
    "waiting",
]

FORMAT_VERSION = "1.0"
"""Version of :func:`snapshot`'s layout: the minor number grows when a key is added, the major when one changes."""

DEFAULT_ENTRIES = 2000
"""Ring entries when ``HPCTP_WATCHDOG`` or ``HPCTP_CHECK`` is set without ``HPCTP_TRACE``: each entry
costs about 0.5 kB while it lives, and a hang is explained by the last few calls of each
communicator, so 2000 (PyTorch's default too) covers many steps of a large model."""

label = callsite.label

on = False
"""True while the recorder runs: the one branch each call of hpctp.comm pays."""

_check = False
_check_started = False
_rec: Recorder | None = None
_first_grid_done = False
_first_grid_hooks: list[Callable[[Any], None]] = []
_abort: Callable[[int], object] | None = None
_keyval: int | None = None


class Keys:
    """Local. The keys of a dump (:func:`snapshot`) and of its entries, named once for writer and reader."""

    VERSION = "version"
    RANK = "rank"
    WORLD_SIZE = "world_size"
    HOST = "host"
    PID = "pid"
    TIME = "time"
    CLOCK_SYNC = "clock_sync"
    RING = "ring"
    RECORDED = "recorded"
    GROUPS = "groups"
    ENTRIES = "entries"
    BLOCKED = "blocked"
    BLOCKED_SINCE = "blocked_since"
    LAST_END = "last_end"
    SETTINGS = "settings"
    # the process (written by hpctp.debug beside the recorder's part)
    PROCESS = "process"
    STACK = "stack"
    USER_SITE = "user_site"
    EXCEPTION = "exception"
    ANSWERS = "answers"
    JOB = "job"
    # one stack frame
    FILE = "file"
    LINE = "line"
    FUNCTION = "function"
    CODE = "code"
    # one group
    KEY = "key"
    NAME = "name"
    RANKS = "ranks"
    # one entry
    ID = "id"
    GROUP = "group"
    P2P = "p2p"
    OP = "op"
    SEQ = "seq"
    PAIR = "pair"
    BYTES = "bytes"
    DTYPE = "dtype"
    PEER = "peer"
    TAG = "tag"
    ROOT = "root"
    DETAIL = "detail"
    LABEL = "label"
    SITE = "site"
    BLOCK = "block"
    START = "start"
    WAIT = "wait"
    END = "end"
    STATE = "state"


class CollectiveMismatch(ValueError):
    """Local. The ranks of a communicator called different collectives, or the same one with other
    sizes, dtypes or roots (``HPCTP_CHECK=1``); raised on every rank before any data moved."""


@dataclass(frozen=True)
class Settings:
    """Local. The debugging settings of this process (from the environment, or the :mod:`hpctp.debug` API).

    Attributes
    ----------
    entries : int
        Ring entries of the recorder (0: off).
    watchdog : float
        Seconds a rank may wait in one call before the watchdog reports (0: no watchdog).
    check : bool
        Whether collectives compare their fingerprints first.
    directory : str or None
        Where dumps and reports go (``HPCTP_TRACE_DIR``; None: ``./hpctp-trace``).
    """

    entries: int = 0
    watchdog: float = 0.0
    check: bool = False
    directory: str | None = None


class Group:
    """Local. One communicator as the recorder knows it: its name, member world ranks and counters."""

    __slots__ = ("key", "name", "ranks", "coll_seq", "p2p_seq", "pairs")
    key: str
    name: str
    ranks: tuple[int, ...]
    coll_seq: int
    p2p_seq: int
    pairs: dict[tuple[bool, int, int], int]

    def __init__(self, key: str, name: str, ranks: tuple[int, ...]) -> None:
        self.key = key
        self.name = name
        self.ranks = ranks
        self.coll_seq = -1
        self.p2p_seq = -1
        self.pairs: dict[tuple[bool, int, int], int] = {}


class Entry:
    """Local. One recorded MPI call (times from ``time.time()``; ``wait``/``end`` 0.0 until they happen)."""

    __slots__ = (
        "id", "group", "p2p", "op", "seq", "pair", "nbytes", "dtype", "peer", "tag", "root", "detail",
        "label", "site", "block", "start", "wait", "end", "state",
    )  # fmt: skip
    id: int
    group: Group
    p2p: bool
    op: str
    seq: int
    pair: int
    nbytes: int
    dtype: str
    peer: int
    tag: int
    root: int
    detail: str
    label: str
    site: str
    block: int
    start: float
    wait: float
    end: float
    state: str

    def __init__(self) -> None:
        self.wait = 0.0
        self.end = 0.0
        self.state = "started"

    def as_dict(self) -> dict[str, Any]:
        """Local. The entry under the keys of :class:`Keys` (peer and root as world ranks, -1: none)."""
        ranks = self.group.ranks
        return {
            Keys.ID: self.id,
            Keys.GROUP: self.group.key,
            Keys.P2P: self.p2p,
            Keys.OP: self.op,
            Keys.SEQ: self.seq,
            Keys.PAIR: self.pair,
            Keys.BYTES: self.nbytes,
            Keys.DTYPE: self.dtype,
            Keys.PEER: ranks[self.peer] if 0 <= self.peer < len(ranks) else -1,
            Keys.TAG: self.tag,
            Keys.ROOT: ranks[self.root] if 0 <= self.root < len(ranks) else -1,
            Keys.DETAIL: self.detail,
            Keys.LABEL: self.label,
            Keys.SITE: self.site,
            Keys.BLOCK: self.block,
            Keys.START: self.start,
            Keys.WAIT: self.wait,
            Keys.END: self.end,
            Keys.STATE: self.state,
        }


class Recorder:
    """Local. The ring of the last ``size`` entries of this rank, and where the main thread waits now.

    ``blocked`` is ``(since, entries)`` while the main thread waits in MPI for those entries (a
    blocking call, or the wait of non-blocking ones), else None; the watchdog thread reads it
    (one attribute, replaced whole, so it never sees half an update).
    """

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self.ring: list[Entry | None] = [None] * self.size
        self.count = 0
        self.blocked: tuple[float, tuple[Entry, ...]] | None = None
        self.last_end = time.time()
        self.clock_sync = 0.0
        self._same: dict[tuple[str, tuple[int, ...]], int] = {}

    def add(self, e: Entry) -> None:
        """Local. Put ``e`` into the ring (the oldest entry drops out once it is full)."""
        e.id = self.count
        self.ring[self.count % self.size] = e
        self.count += 1

    def entries(self) -> list[Entry]:
        """Local. The entries in the ring, oldest first."""
        n = min(self.count, self.size)
        start = self.count - n
        return [e for e in (self.ring[i % self.size] for i in range(start, self.count)) if e is not None]

    def group(self, comm: MPI.Comm) -> Group:
        """Local. The :class:`Group` of ``comm`` (made on its first recorded call, cached on the communicator)."""
        global _keyval
        if _keyval is None:
            _keyval = MPI.Comm.Create_keyval()
        g = cast("Group | None", comm.Get_attr(_keyval))
        if g is None:
            name = comm.Get_name() or "unnamed"
            world = MPI.COMM_WORLD.Get_group()
            mine = comm.Get_group()
            try:
                ranks = tuple(int(r) for r in MPI.Group.Translate_ranks(mine, list(range(comm.Get_size())), world))
            finally:
                mine.Free()
                world.Free()
            n = self._same.get((name, ranks), 0)  # every member makes them in the same order
            self._same[(name, ranks)] = n + 1
            key = f"{name}[{_ranges(ranks)}]" + (f"#{n}" if n else "")
            g = Group(key, name, ranks)
            comm.Set_attr(_keyval, g)
        return g


def _ranges(ranks: Sequence[int]) -> str:
    """``0-3,6`` for (0, 1, 2, 3, 6)."""
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if j == i else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


_DTYPES: dict[Any, str] = {}


def _dtype_name(x: Any) -> str:
    d = getattr(x, "dtype", None)
    if d is None:
        return ""
    name = _DTYPES.get(d)
    if name is None:
        name = str(d).removeprefix("torch.")
        _DTYPES[d] = name
    return name


def begin(
    comm: MPI.Comm,
    op: str,
    nbytes: int,
    buf: Any = None,
    *,
    root: int = -1,
    peer: int = -1,
    tag: int = -1,
    p2p: bool = False,
    blocking: bool = True,
    compare_size: bool = True,
    detail: str = "",
) -> Entry | None:
    """Local, or Collective over ``comm`` while the mismatch check is armed (a collective's own
    fingerprint exchange). Record one MPI call about to be made; call only while :data:`on`.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
    op : str
        The MPI operation (``"Allreduce"``, ``"Isend"``...).
    nbytes : int
        This rank's payload: the buffer of a reduction or broadcast, the sum of the counts of a
        v-collective, the message of a point-to-point call.
    buf : array, optional
        Its dtype is recorded.
    root : int
        Root (rank in ``comm``) of a rooted collective, else -1.
    peer, tag : int
        Destination or source and tag of a point-to-point call.
    p2p : bool
        Point-to-point (counted on the group's p2p sequence) rather than collective.
    blocking : bool
        The main thread waits in this call until :func:`end`.
    compare_size : bool
        Whether ``nbytes`` must be equal on every rank (the mismatch check): False where each rank
        passes its own share (``Alltoallv``).
    detail : str
        More about the call (the ``what`` of an agreement).

    Returns
    -------
    Entry or None
        None for a call on a virtual communicator (:mod:`hpctp.comm.virtual`: nothing to wait for).

    Raises
    ------
    CollectiveMismatch
        On every rank of ``comm``, when the mismatch check is armed and the ranks' fingerprints differ.
    """
    if isinstance(comm, VirtualComm):
        return None
    rec = cast(Recorder, _rec)  # (callers test `on` first)
    g = rec.group(comm)
    e = Entry()
    e.group = g
    e.p2p = p2p
    e.op = op
    if p2p:
        g.p2p_seq += 1
        e.seq = g.p2p_seq
        key = (op.endswith("send") or op.endswith("Send"), peer, tag)
        e.pair = g.pairs.get(key, -1) + 1
        g.pairs[key] = e.pair
    else:
        g.coll_seq += 1
        e.seq = g.coll_seq
        e.pair = -1
    e.nbytes = int(nbytes)
    e.dtype = _dtype_name(buf)
    e.peer = peer
    e.tag = tag
    e.root = root
    e.detail = detail
    e.label, e.site, e.block = callsite.where(2)
    e.start = time.time()
    rec.add(e)
    if blocking:
        rec.blocked = (e.start, (e,))
    if _check and not p2p:
        _compare(comm, e, compare_size)
    return e


def end(e: Entry) -> None:
    """Local. Mark ``e`` complete (its call returned, or its request completed)."""
    rec = _rec
    t = time.time()
    e.end = t
    e.state = "completed"
    if rec is not None:
        rec.blocked = None
        rec.last_end = t


def waiting(entries: Sequence[Entry]) -> None:
    """Local. The main thread now waits for these non-blocking calls (``Pending.wait``, ``waitall``)."""
    rec = _rec
    t = time.time()
    for e in entries:
        e.wait = t
        e.state = "waiting"
    if rec is not None:
        rec.blocked = (t, tuple(entries))


def _crc(text: str) -> int:
    return zlib.crc32(text.encode()) if text else -1


def _describe(e: Entry, world_root: int) -> str:
    size = f"{e.nbytes} B" if e.nbytes >= 0 else "? B"
    parts = [f"{e.op}{f'({e.detail})' if e.detail else ''} {size}"]
    if e.dtype:
        parts.append(e.dtype)
    if world_root >= 0:
        parts.append(f"root {world_root}")
    text = " ".join(parts) + f" (collective #{e.seq})"
    if e.site:
        text += f" at {e.site}"
    if e.label:
        text += f" [{e.label}]"
    return text


def _compare(comm: MPI.Comm, e: Entry, compare_size: bool) -> None:
    """Collective over ``comm``. Raise :class:`CollectiveMismatch` on every rank when the fingerprints differ."""
    size = comm.Get_size()
    row = np.array(
        [_crc(e.op + e.detail), e.nbytes if compare_size else -2, _crc(e.dtype), e.root, e.seq], dtype=np.int64
    )
    table = np.empty((size, row.size), dtype=np.int64)
    rec = cast(Recorder, _rec)
    blocked = rec.blocked
    rec.blocked = (time.time(), (e,))  # (a non-blocking call waits here too: the watchdog sees it)
    comm.Allgather(row, table)  # (the check's own exchange: not an entry)
    rec.blocked = blocked
    if (table[:, :4] == table[0, :4]).all():
        return
    ranks = e.group.ranks
    mine = _describe(e, ranks[e.root] if 0 <= e.root < len(ranks) else -1).encode()
    lengths = np.empty(size, dtype=np.int64)
    comm.Allgather(np.array([len(mine)], dtype=np.int64), lengths)
    texts = np.empty(int(lengths.sum()), dtype=np.uint8)
    displs = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    comm.Allgatherv(np.frombuffer(mine, dtype=np.uint8), [texts, (lengths.tolist(), displs.tolist())])
    each = [texts[d : d + n].tobytes().decode(errors="replace") for d, n in zip(displs.tolist(), lengths.tolist())]
    kinds: dict[tuple[int, ...], list[int]] = {}
    for r in range(size):
        kinds.setdefault(tuple(int(v) for v in table[r, :4]), []).append(r)
    lines = []
    for members in sorted(kinds.values(), key=lambda m: (len(m), m)):
        who = ", ".join(str(ranks[r]) for r in members)
        lines.append(f"  rank{'s' if len(members) > 1 else ''} {who}: {each[members[0]]}")
    what = [n for i, n in enumerate(("operation", "size", "dtype", "root")) if len({k[i] for k in kinds}) > 1]
    what = what[:1] if what[0] == "operation" else what  # (other operations: their sizes and roots differ anyway)
    e.end = time.time()
    e.state = "mismatch"
    if _rec is not None:
        _rec.blocked = None
    raise CollectiveMismatch(
        f"HPCTP_CHECK: the ranks of {e.group.name} (world ranks {_ranges(ranks)}) called collectives of "
        f"different {', '.join(what)}; nothing was sent:\n" + "\n".join(lines) + "\nEvery rank of a communicator "
        "must make the same collective calls in the same order, with the same sizes, dtypes and roots."
    )


# ---------------------------------------------------------------------------------------------- control
def settings() -> Settings:
    """Local. The settings from the environment (``HPCTP_TRACE``, ``HPCTP_WATCHDOG``, ``HPCTP_CHECK``,
    ``HPCTP_TRACE_DIR``); all off where a value does not parse (:class:`~hpctp.ProcessGrid` raises then).
    """
    try:
        entries = trace_setting()
        watchdog = watchdog_setting() or 0.0
        check = check_setting()
    except ValueError:
        return Settings()
    if entries is None:
        entries = DEFAULT_ENTRIES if (watchdog or check) else 0
    return Settings(int(entries), float(watchdog), bool(check), trace_dir_setting())


def start(entries: int) -> None:
    """Local. Run the recorder with a ring of ``entries`` (a new ring when the size changes; 0 stops it).

    Raises
    ------
    ValueError
        If ``entries`` is negative.
    """
    global _rec, on
    if entries < 0:
        raise ValueError(f"the flight recorder needs entries >= 0, got {entries}")
    if entries == 0:
        stop()
        return
    if _rec is None or _rec.size != entries:
        old = _rec
        _rec = Recorder(entries)
        if old is not None:
            _rec._same = old._same
            _rec.clock_sync = old.clock_sync
            for e in old.entries():
                _rec.add(e)
    on = True
    callsite._enabled = True


def stop() -> None:
    """Local. Stop recording (the entries so far stay readable through :func:`entries` and :func:`snapshot`)."""
    global on, _check
    on = False
    _check = False
    callsite._enabled = False


def recorder() -> Recorder | None:
    """Local. The recorder (None before it first ran)."""
    return _rec


def entries() -> list[Entry]:
    """Local. The entries of the ring, oldest first (empty before the recorder first ran)."""
    return [] if _rec is None else _rec.entries()


def arm_check(flag: bool) -> None:
    """Local. Arm or disarm the mismatch check (every rank of every communicator must do the same;
    :func:`hpctp.debug.check` agrees first). Arming it runs the recorder if it is off; disarming
    stops the recorder again if arming started it."""
    global _check, _check_started
    if flag and not on:
        start(settings().entries or DEFAULT_ENTRIES)
        _check_started = True
    if not flag and _check_started:
        _check_started = False
        stop()
    _check = bool(flag)


def snapshot() -> dict[str, Any]:
    """Local. This rank's dump: the group table, the entries and where the main thread waits now.

    Returns
    -------
    dict
        Under the keys of :class:`Keys` (JSON-ready); :mod:`hpctp.debug` adds the Python stack and
        the state of the process and writes it.
    """
    rec = _rec
    world = MPI.COMM_WORLD
    out: dict[str, Any] = {
        Keys.VERSION: FORMAT_VERSION,
        Keys.RANK: world.Get_rank(),
        Keys.WORLD_SIZE: world.Get_size(),
        Keys.HOST: MPI.Get_processor_name(),
        Keys.PID: os.getpid(),
        Keys.TIME: time.time(),
        Keys.SETTINGS: {"entries": 0 if rec is None else rec.size, "check": _check},
    }
    if rec is None:
        out.update({Keys.CLOCK_SYNC: 0.0, Keys.RING: 0, Keys.RECORDED: 0, Keys.GROUPS: [], Keys.ENTRIES: []})
        out.update({Keys.BLOCKED: [], Keys.BLOCKED_SINCE: 0.0, Keys.LAST_END: 0.0})
        return out
    blocked = rec.blocked
    out[Keys.CLOCK_SYNC] = rec.clock_sync
    out[Keys.RING] = rec.size
    out[Keys.RECORDED] = rec.count
    ring = rec.entries()
    groups = {id(e.group): e.group for e in ring}  # (the communicators of the calls still in the ring)
    out[Keys.GROUPS] = [{Keys.KEY: g.key, Keys.NAME: g.name, Keys.RANKS: list(g.ranks)} for g in groups.values()]
    out[Keys.ENTRIES] = [e.as_dict() for e in ring]
    out[Keys.BLOCKED] = [] if blocked is None else [e.id for e in blocked[1]]
    out[Keys.BLOCKED_SINCE] = 0.0 if blocked is None else blocked[0]
    out[Keys.LAST_END] = rec.last_end
    return out


# ---------------------------------------------------------------------------------------------- the first grid
def on_first_grid(hook: Callable[[Any], None]) -> None:
    """Local. Call ``hook(grid)`` once, when the first :class:`~hpctp.ProcessGrid` of the process is built
    (collectively, on every rank of it): :mod:`hpctp.debug` starts the watchdog there."""
    _first_grid_hooks.append(hook)


def grid_built(grid: Any) -> None:
    """Collective over grid (the first time only). Arm the settings agreed while building ``grid`` and
    run the hooks of :func:`on_first_grid`."""
    global _first_grid_done
    if _first_grid_done or isinstance(grid.comm, VirtualComm):
        return
    _first_grid_done = True
    s = settings()
    if s.entries and not on:
        start(s.entries)
    if s.check:
        arm_check(True)
    for hook in _first_grid_hooks:
        hook(grid)


def set_abort(fn: Callable[[int], object] | None) -> None:
    """Local. Let ``fn(code)`` end the job instead of ``MPI_Abort`` (:func:`hpctp.cli.run_main` does)."""
    global _abort
    _abort = fn


def abort_job(code: int) -> NoReturn:
    """Local (ends every rank). End the whole job with exit status ``code``: the function of
    :func:`set_abort`, else ``MPI_Abort`` on COMM_WORLD (allowed from any thread: mpi4py initialises
    MPI_THREAD_MULTIPLE); ``os._exit`` if neither returns."""
    try:
        if _abort is not None:
            _abort(code)
        MPI.COMM_WORLD.Abort(code)
    finally:
        os._exit(code)


def _start_from_environment() -> None:
    """Local. Run the recorder from the first MPI call when ``HPCTP_TRACE`` (or the watchdog, or the check)
    asks for it; the check is armed only when the first grid agreed on it (:func:`grid_built`)."""
    s = settings()
    if s.entries:
        start(s.entries)


_start_from_environment()
