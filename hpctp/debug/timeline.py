"""Who waits for whom: late arrivals, waiting time and stragglers from the recorder's entries.

Pure functions of the dumps (no MPI; unit-tested on synthetic dumps), after Scalasca's
wait-state analysis:

* a **collective** matched on all its ranks (same communicator and sequence number, all
  completed) cannot finish before its last rank arrives. A rank that blocked in it before then
  *waited* ``min(end, last arrival) - blocked from`` (from its call for a blocking collective,
  from its ``wait`` for a non-blocking one); the last rank *arrived late* by its arrival minus the
  second-to-last arrival (what it alone cost the others);
* a **message** (a send matched with its receive by sender, receiver, tag and pair number): the
  sender is late by its send's posting time minus the receive's (a Late Sender); the receiver
  *waited* while blocked before the send was posted. Both sides of a halo exchange post at once,
  so a rank that computes longer before a layer's halo posts its sends late to every neighbour.

Per rank: its recorded span, the time its main thread spent in hpctp's MPI calls, the part of it
spent waiting, the rest (compute). Per rank and hpctp operation (the entries' labels): calls,
waiting, late arrivals and by how much, the mean time since the previous call (the compute that
precedes it), the block size when the operation gave one. A **straggler** is a rank late at more
than half of an operation's matched calls, by more than :data:`STRAGGLER_SECONDS` on average;
its compute and block are compared with the other ranks' median (why it is late).

Times come from each rank's ``time.time()``; ranks on other hosts than rank 0's are shifted by
their host's offset measured when the first grid was built (:func:`clock_offsets`).
"""

from __future__ import annotations

import heapq
import statistics
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import NamedTuple

from .types import Call, LabelStats, RankDump, RankTimes, Straggler, Summary

__all__ = [
    "STRAGGLER_CALLS",
    "STRAGGLER_SECONDS",
    "STRAGGLER_SHARE",
    "Match",
    "call_label",
    "clock_offsets",
    "format_summary",
    "matches",
    "summarize",
]

STRAGGLER_SECONDS = 1e-3
"""A rank counts as a straggler at an operation only when it is late by more than this on average:
below a millisecond the ranks' clocks and Python's own jitter decide who comes last, not the work."""

STRAGGLER_CALLS = 3
"""... and only when it is late at this many calls at least: a pattern, not the start-up skew a job's
first collective absorbs."""

STRAGGLER_SHARE = 0.05
"""... and only when the others' waiting for it there is at least this share of all the waiting in the
run: the operations that cost the run time, not every late arrival at a cheap agreement."""


class Match(NamedTuple):
    """Local. Calls of several ranks that MPI paired: a collective's members, or a send and its receive."""

    p2p: bool
    group: str
    calls: tuple[Call, ...]


def clock_offsets(dumps: Mapping[int, RankDump]) -> dict[int, float]:
    """Local. Seconds to subtract from each rank's times to put them on rank 0's host clock.

    Ranks of one host share its clock (offset 0 on rank 0's host). A rank on another host is
    shifted by the median, over its host's ranks, of its clock when the first grid was built
    (right after a barrier) minus rank 0's; 0 when that was not recorded.
    """
    ref = dumps.get(min(dumps)) if dumps else None
    out = {r: 0.0 for r in dumps}
    if ref is None or not ref.clock_sync:
        return out
    by_host: dict[str, list[float]] = defaultdict(list)
    for d in dumps.values():
        if d.host != ref.host and d.clock_sync:
            by_host[d.host].append(d.clock_sync - ref.clock_sync)
    shift = {h: statistics.median(v) for h, v in by_host.items()}
    for r, d in dumps.items():
        out[r] = shift.get(d.host, 0.0)
    return out


def _shifted(c: Call, dt: float) -> Call:
    if not dt:
        return c
    return c._replace(start=c.start - dt, wait=c.wait - dt if c.wait else 0.0, end=c.end - dt if c.end else 0.0)


def _aligned(dumps: Mapping[int, RankDump]) -> dict[int, list[Call]]:
    off = clock_offsets(dumps)
    return {r: [_shifted(c, off[r]) for c in d.calls] for r, d in dumps.items()}


def matches(dumps: Mapping[int, RankDump]) -> Iterator[Match]:
    """Local. Every call matched across ranks in the dumps (all members present and completed).

    Yields
    ------
    Match
        Collectives by (communicator, sequence number), messages by (communicator, sender,
        receiver, tag, pair number); times aligned by :func:`clock_offsets`.
    """
    calls = _aligned(dumps)
    members: dict[str, tuple[int, ...]] = {}
    for d in dumps.values():
        for g in d.groups:
            members.setdefault(g.key, g.ranks)
    coll: dict[tuple[str, int], list[Call]] = defaultdict(list)
    sends: dict[tuple[str, int, int, int, int], Call] = {}
    recvs: dict[tuple[str, int, int, int, int], Call] = {}
    for cs in calls.values():
        for c in cs:
            if not c.completed:
                continue
            if not c.p2p:
                coll[(c.group, c.seq)].append(c)
            elif c.is_send:
                sends[(c.group, c.rank, c.peer, c.tag, c.pair)] = c
            else:
                recvs[(c.group, c.peer, c.rank, c.tag, c.pair)] = c
    for (group, _), cs in sorted(coll.items(), key=lambda kv: min(c.start for c in kv[1])):
        if len(cs) == len(members.get(group, ())) and len(cs) > 1:
            yield Match(False, group, tuple(sorted(cs, key=lambda c: c.rank)))
    for key, s in sends.items():
        r = recvs.get(key)
        if r is not None:
            yield Match(True, key[0], (s, r))


def call_label(c: Call) -> str:
    """Local. The hpctp operation of ``c`` (its label, else its MPI operation: ``Agree(ProcessGrid)``)."""
    return c.label or c.name


def _blocked_from(c: Call) -> float:
    return c.wait if c.wait else c.start


class _Acc:
    __slots__ = ("calls", "matched", "in_call", "waiting", "late", "late_s", "before", "blocks")

    def __init__(self) -> None:
        self.calls = self.matched = self.late = 0
        self.in_call = self.waiting = self.late_s = 0.0
        self.before: list[float] = []
        self.blocks: list[int] = []


def summarize(dumps: Mapping[int, RankDump]) -> Summary:
    """Local. Late arrivals, waiting and compute time per rank and per hpctp operation, and the stragglers.

    Parameters
    ----------
    dumps : mapping of int to RankDump
        Every rank's dump of one run (:func:`hpctp.debug.load`).

    Returns
    -------
    Summary
    """
    calls = _aligned(dumps)
    acc: dict[tuple[str, int], _Acc] = defaultdict(_Acc)
    waited_for: dict[tuple[str, int], float] = defaultdict(float)
    rank_wait: dict[int, float] = defaultdict(float)
    for r, cs in calls.items():
        # compute before a call: from the last completion to the call, when nothing was posted in between
        # (the isend right after a halo's irecv follows a post, not a completion: no compute before it)
        last_start = last_end = 0.0
        ends: list[float] = []
        for c in sorted(cs, key=lambda c: c.start):
            a = acc[(call_label(c), r)]
            a.calls += 1
            while ends and ends[0] <= c.start:
                last_end = max(last_end, heapq.heappop(ends))
            if last_end and last_end >= last_start:
                a.before.append(c.start - last_end)
            last_start = c.start
            if c.completed:
                a.in_call += max(0.0, c.end - _blocked_from(c))
                heapq.heappush(ends, c.end)
            if c.block >= 0:
                a.blocks.append(c.block)
    matched = 0
    paired: set[tuple[int, int]] = set()
    for m in matches(dumps):
        matched += 1
        for c in m.calls:
            paired.add((c.rank, c.id))
        if m.p2p:
            send, recv = m.calls
            late = send.start - recv.start
            wait = max(0.0, min(recv.end, send.start) - _blocked_from(recv))
            for c in m.calls:
                acc[(call_label(c), c.rank)].matched += 1
            acc[(call_label(recv), recv.rank)].waiting += wait
            rank_wait[recv.rank] += wait
            if late > 0:
                a = acc[(call_label(send), send.rank)]
                a.late += 1
                a.late_s += late
                waited_for[(call_label(send), send.rank)] += wait
            continue
        arrivals = sorted(m.calls, key=lambda c: c.start)
        last = arrivals[-1]
        for c in m.calls:
            a = acc[(call_label(c), c.rank)]
            a.matched += 1
            wait = max(0.0, min(c.end, last.start) - _blocked_from(c)) if c is not last else 0.0
            a.waiting += wait
            rank_wait[c.rank] += wait
            waited_for[(call_label(last), last.rank)] += wait
        late = last.start - arrivals[-2].start
        if late > 0:
            a = acc[(call_label(last), last.rank)]
            a.late += 1
            a.late_s += late
    unmatched = sum(1 for r, cs in calls.items() for c in cs if (r, c.id) not in paired)
    ranks = []
    for r, cs in sorted(calls.items()):
        if not cs:
            ranks.append(RankTimes(r, 0.0, 0.0, 0.0, 0.0, 0))
            continue
        span = max(c.end or c.start for c in cs) - min(c.start for c in cs)
        in_calls = sum(max(0.0, c.end - _blocked_from(c)) for c in cs if c.completed)
        ranks.append(RankTimes(r, span, in_calls, rank_wait[r], max(0.0, span - in_calls), len(cs)))
    labels = tuple(
        LabelStats(
            label=lab,
            rank=r,
            calls=a.calls,
            matched=a.matched,
            in_call=a.in_call,
            waiting=a.waiting,
            late=a.late,
            late_seconds=a.late_s,
            compute_before=statistics.fmean(a.before) if a.before else 0.0,
            block=statistics.fmean(a.blocks) if a.blocks else -1.0,
        )
        for (lab, r), a in sorted(acc.items())
    )
    total_wait = sum(rank_wait.values())
    return Summary(tuple(ranks), labels, _stragglers(labels, waited_for, total_wait), matched, unmatched)


def _ratio(mine: float, others: list[float]) -> float:
    if not others or mine < 0:
        return 0.0
    mid = statistics.median(others)
    return mine / mid if mid > 0 else 0.0


def _stragglers(
    labels: tuple[LabelStats, ...], waited_for: Mapping[tuple[str, int], float], total_wait: float
) -> tuple[Straggler, ...]:
    by_label: dict[str, list[LabelStats]] = defaultdict(list)
    for s in labels:
        by_label[s.label].append(s)
    out = []
    for lab, stats in by_label.items():
        for s in stats:
            if s.late < STRAGGLER_CALLS or s.late * 2 <= s.matched or s.late_seconds / s.late <= STRAGGLER_SECONDS:
                continue
            if waited_for.get((lab, s.rank), 0.0) < STRAGGLER_SHARE * total_wait:
                continue
            others = [o for o in stats if o.rank != s.rank]
            blocks = [o.block for o in others if o.block >= 0]
            out.append(
                Straggler(
                    rank=s.rank,
                    label=lab,
                    late=s.late,
                    matched=s.matched,
                    mean_late=s.late_seconds / s.late,
                    waited=waited_for.get((lab, s.rank), 0.0),
                    compute_ratio=_ratio(s.compute_before, [o.compute_before for o in others]),
                    block_ratio=_ratio(s.block, blocks) if s.block >= 0 else 0.0,
                )
            )
    return tuple(sorted(out, key=lambda s: -s.waited - s.mean_late * s.late))


# ---------------------------------------------------------------------------------------------- text
def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def format_summary(summary: Summary, top: int = 12) -> str:
    """Local. The summary as text: the stragglers, then per rank, then the operations where ranks wait most.

    Parameters
    ----------
    summary : Summary
    top : int
        Rows of the per-operation table.

    Returns
    -------
    str
    """
    lines = []
    if summary.stragglers:
        lines.append("stragglers (who keeps the others waiting, and where):")
        for s in summary.stragglers:
            every = "every" if s.late == s.matched else f"{s.late} of {s.matched}"
            why = []
            if s.block_ratio:
                why.append(f"its block is {s.block_ratio:.2f}x the others' median")
            if s.compute_ratio:
                why.append(f"it computes {s.compute_ratio:.2f}x the others' median before it")
            lines.append(
                f"  rank {s.rank} arrives {_ms(s.mean_late)} late at {every} {s.label}"
                f" (the others wait {_ms(s.waited)} for it in total)" + (f": {'; '.join(why)}" if why else "")
            )
    else:
        lines.append(
            f"no straggler: no rank is late at more than half of an operation's calls by over {_ms(STRAGGLER_SECONDS)}, "
            f"keeping the others waiting for {STRAGGLER_SHARE:.0%} of all their waiting"
        )
    lines.append(f"matched calls: {summary.matched}; unmatched entries: {summary.unmatched}")
    lines.append("")
    lines.append("| rank | span | in hpctp MPI calls | waiting for others | compute (rest) | calls |")
    lines.append("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for t in summary.ranks:
        lines.append(
            f"| {t.rank} | {_ms(t.span)} | {_ms(t.in_calls)} | {_ms(t.waiting)} | {_ms(t.compute)} | {t.calls} |"
        )
    lines.append("")
    lines.append("| operation | rank | calls | in call | waiting | late (times, total) | compute before | block |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = sorted(summary.labels, key=lambda s: -(s.waiting + s.late_seconds))[:top]
    for row in rows:
        block = f"{row.block:.0f}" if row.block >= 0 else ""
        lines.append(
            f"| {row.label} | {row.rank} | {row.calls} | {_ms(row.in_call)} | {_ms(row.waiting)} | "
            f"{row.late}, {_ms(row.late_seconds)} | {_ms(row.compute_before)} | {block} |"
        )
    return "\n".join(lines)
