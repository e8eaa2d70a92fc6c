"""The typed records of the offline analysis: dumps, matched calls, divergences, positions, waits.

Plain immutable data (NamedTuples and enums), read from the JSON dumps by
:func:`hpctp.debug.dumps.parse_dump` and produced by the pure functions of
:mod:`hpctp.debug.hang` and :mod:`hpctp.debug.timeline`; nothing here talks to MPI.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = [
    "Call",
    "Divergence",
    "Frame",
    "GroupInfo",
    "HangReport",
    "LabelStats",
    "MatchState",
    "Position",
    "ProcessState",
    "RankDump",
    "RankTimes",
    "Straggler",
    "Summary",
    "Where",
]


class GroupInfo(NamedTuple):
    """Local. A communicator of the dumps: its key (name and member world ranks), name and members."""

    key: str
    name: str
    ranks: tuple[int, ...]


class Call(NamedTuple):
    """Local. One recorded MPI call of one rank (times in seconds since the epoch; 0.0: not yet).

    ``seq`` numbers the collectives (or, for point-to-point calls, the point-to-point calls) of
    this rank on ``group``; ``pair`` numbers the sends (receives) to (from) ``peer`` with ``tag``,
    so send ``k`` of rank ``a`` to ``b`` matches receive ``k`` of ``b`` from ``a``. ``peer`` and
    ``root`` are world ranks (-1: none).
    """

    rank: int
    id: int
    group: str
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

    @property
    def completed(self) -> bool:
        """Whether the call completed."""
        return self.state == "completed"

    @property
    def name(self) -> str:
        """The operation with its detail: ``Agree(ProcessGrid)``, ``Allreduce``."""
        return f"{self.op}({self.detail})" if self.detail else self.op

    @property
    def is_send(self) -> bool:
        """Whether this point-to-point call sends."""
        return self.op.lower().endswith("send")


class Frame(NamedTuple):
    """Local. One frame of a Python stack."""

    file: str
    line: int
    function: str
    code: str


class ProcessState(enum.Enum):
    """Local. What the process was doing when it wrote its dump."""

    RUNNING = "running"
    EXITED = "exited"
    RAISED = "raised"


class RankDump(NamedTuple):
    """Local. One rank's dump: its entries, groups and where its main thread stood."""

    rank: int
    world_size: int
    host: str
    pid: int
    time: float
    clock_sync: float
    ring: int
    recorded: int
    groups: tuple[GroupInfo, ...]
    calls: tuple[Call, ...]
    blocked: tuple[int, ...]
    blocked_since: float
    last_end: float
    state: ProcessState
    stack: tuple[Frame, ...]
    site: str
    exception: str
    answers: str
    job: str

    def call(self, entry_id: int) -> Call | None:
        """The call with this entry id, if it is still in the ring."""
        for c in self.calls:
            if c.id == entry_id:
                return c
        return None


class MatchState(enum.Enum):
    """Local. How the ranks of a communicator stand at one call."""

    MATCHED = "matched"
    MISSING = "missing ranks"
    OP_MISMATCH = "different operations"
    SIZE_MISMATCH = "different sizes"
    DTYPE_MISMATCH = "different dtypes"
    ROOT_MISMATCH = "different roots"
    INCOMPLETE = "entered by all, not completed"
    UNDECIDED = "undecided"


class Divergence(NamedTuple):
    """Local. The first call of a communicator at which its ranks do not all stand together.

    Attributes
    ----------
    group : GroupInfo
    p2p : bool
        A point-to-point message (``seq`` is then the pair number of ``sender`` to ``receiver``).
    seq : int
        The collective's sequence number on ``group`` (or the message's pair number).
    state : MatchState
    calls : tuple of Call
        The calls of the ranks that reached it.
    missing : tuple of int
        Ranks of ``group`` with a dump but without this call.
    odd : tuple of int
        Ranks whose call differs from the majority's (a mismatch).
    no_dump : tuple of int
        Ranks of ``group`` whose dump is absent.
    sites_differ_at : int
        The first earlier sequence number at which the same operation was called from different
        lines (a hint that a rank skipped or added a call before), -1 if none.
    sites : tuple of Call
        The calls at ``sites_differ_at``.
    """

    group: GroupInfo
    p2p: bool
    seq: int
    state: MatchState
    calls: tuple[Call, ...]
    missing: tuple[int, ...]
    odd: tuple[int, ...]
    no_dump: tuple[int, ...]
    sites_differ_at: int
    sites: tuple[Call, ...]


class Where(enum.Enum):
    """Local. Where a rank's main thread stood."""

    IN_CALL = "in an MPI call of hpctp"
    OUTSIDE = "outside hpctp"
    EXITED = "exited"
    RAISED = "raised an exception"
    NO_DUMP = "no dump"


class Position(NamedTuple):
    """Local. Where one rank stood when the dumps were taken.

    ``seconds`` is how long it had been there (in the call, or outside hpctp since its last
    call ended), measured on that rank; ``last`` is its last recorded call.
    """

    rank: int
    where: Where
    calls: tuple[Call, ...]
    seconds: float
    site: str
    stack: tuple[Frame, ...]
    exception: str
    last: Call | None


class HangReport(NamedTuple):
    """Local. The diagnosis of a hung or failed job (:func:`hpctp.debug.diagnose`)."""

    reason: str
    detector: int
    divergences: tuple[Divergence, ...]
    positions: tuple[Position, ...]
    culprits: tuple[int, ...]
    job: str


class RankTimes(NamedTuple):
    """Local. One rank's time over its recorded span: in hpctp's MPI calls, waiting for others, the rest."""

    rank: int
    span: float
    in_calls: float
    waiting: float
    compute: float
    calls: int


class LabelStats(NamedTuple):
    """Local. One rank's calls of one hpctp operation (label).

    ``late`` counts the matched calls where this rank arrived last (a collective) or posted its
    send after the receiver (a message), ``late_seconds`` sums by how much; ``waiting`` is the
    time this rank spent in these calls waiting for later ranks; ``compute_before`` the mean time
    since its previous call ended; ``block`` the mean block elements (-1: unknown).
    """

    label: str
    rank: int
    calls: int
    matched: int
    in_call: float
    waiting: float
    late: int
    late_seconds: float
    compute_before: float
    block: float


class Straggler(NamedTuple):
    """Local. A rank that keeps the others waiting at one hpctp operation.

    ``mean_late`` is the mean delay of its arrival at the calls where it was late, ``waited``
    the time the others spent waiting for it there; ``compute_ratio`` and ``block_ratio``
    compare its time since its previous call and its block with the median of the other ranks
    (0.0: unknown).
    """

    rank: int
    label: str
    late: int
    matched: int
    mean_late: float
    waited: float
    compute_ratio: float
    block_ratio: float


class Summary(NamedTuple):
    """Local. What :func:`hpctp.debug.summarize` finds: per rank, per operation, and the stragglers."""

    ranks: tuple[RankTimes, ...]
    labels: tuple[LabelStats, ...]
    stragglers: tuple[Straggler, ...]
    matched: int
    unmatched: int
