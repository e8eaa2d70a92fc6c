"""Why a job hangs: match every communicator's calls across its ranks and say where they part.

Pure functions of the dumps (no MPI; unit-tested on synthetic dumps). For each communicator
(its key names it and its member world ranks, so the ranks agree on which one it is):

* collectives line up by their sequence number on that communicator. The first number at which
  the members do not all stand together is the divergence: some members never reached it
  (*missing ranks*), or they called different operations, sizes, dtypes or roots (a mismatch:
  the minority is named), or all entered and none completed. Sequence numbers before the
  oldest one every member still holds in its ring are not compared (undecided). As a hint,
  the first earlier number at which the same operation came from different lines is given:
  a rank that skipped a call in a loop lines its next call up with the others' skipped one;
* point-to-point messages line up by (sender, receiver, tag, pair number): an unfinished
  receive whose sender never posted that send names the sender as missing, a send of another
  size is a size mismatch.

Every rank's position comes beside it: the call it waits in (and for how long), or "outside
hpctp" for how long with its Python stack, or the exception it raised, or that it exited; a rank
whose dump is absent is named as such. The culprits are the ranks missing from the divergences,
the odd ones of mismatches and the ranks that raised, so a report never ends without naming a rank.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from .types import (
    Call,
    Divergence,
    GroupInfo,
    HangReport,
    MatchState,
    Position,
    ProcessState,
    RankDump,
    Where,
)

__all__ = ["diagnose", "format_report", "report_json", "short_site"]


def short_site(site: str) -> str:
    """Local. ``site`` relative to the working directory when it lies below it."""
    if not site:
        return "?"
    path, _, line = site.rpartition(":")
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return site
    return f"{rel}:{line}" if not rel.startswith("..") else site


def _groups(dumps: Mapping[int, RankDump]) -> dict[str, GroupInfo]:
    out: dict[str, GroupInfo] = {}
    for d in dumps.values():
        for g in d.groups:
            out.setdefault(g.key, g)
    return out


def _fingerprint(c: Call) -> tuple[str, int, str, int]:
    return (c.name, c.nbytes if c.op != "Alltoallv" else -1, c.dtype, c.root)


def _mismatch(calls: Sequence[Call]) -> tuple[MatchState, tuple[int, ...]]:
    """The kind of mismatch among ``calls`` and the ranks outside the largest agreeing set."""
    for index, state in ((0, MatchState.OP_MISMATCH), (1, MatchState.SIZE_MISMATCH),
                         (2, MatchState.DTYPE_MISMATCH), (3, MatchState.ROOT_MISMATCH)):  # fmt: skip
        values = Counter(_fingerprint(c)[index] for c in calls)
        if len(values) > 1:
            top = values.most_common()
            if len(top) > 1 and top[0][1] == top[1][1]:  # no majority: every rank is odd
                return state, tuple(sorted(c.rank for c in calls))
            major = top[0][0]
            return state, tuple(sorted(c.rank for c in calls if _fingerprint(c)[index] != major))
    return MatchState.MATCHED, ()


def _collective_divergence(group: GroupInfo, dumps: Mapping[int, RankDump]) -> Divergence | None:
    have = [r for r in group.ranks if r in dumps]
    no_dump = tuple(r for r in group.ranks if r not in dumps)
    seqs: dict[int, dict[int, Call]] = {
        r: {c.seq: c for c in dumps[r].calls if c.group == group.key and not c.p2p} for r in have
    }
    known = [s for s in seqs.values() if s]
    if not known:
        return None
    lo = max(min(s) for s in known) if len(known) == len(have) else min(min(s) for s in known)
    hi = max(max(s) for s in known)
    first_sites = -1
    for seq in range(lo, hi + 1):
        present = tuple(seqs[r][seq] for r in have if seq in seqs[r])
        missing = tuple(r for r in have if seq not in seqs[r] and (not seqs[r] or max(seqs[r]) < seq))
        truncated = [r for r in have if seq not in seqs[r] and seqs[r] and min(seqs[r]) > seq]
        state, odd = _mismatch(present)
        if not missing and not truncated and state is MatchState.MATCHED:
            if all(c.completed for c in present) and not no_dump:
                if first_sites < 0 and len({c.site for c in present}) > 1:
                    first_sites = seq
                continue
            if all(c.completed for c in present):  # (ranks without a dump: undecided beyond here)
                continue
            state = MatchState.INCOMPLETE
        elif missing and state is MatchState.MATCHED:
            state = MatchState.MISSING
        elif truncated and not missing and state is MatchState.MATCHED:
            state = MatchState.UNDECIDED
        sites: tuple[Call, ...] = ()
        if first_sites >= 0:
            sites = tuple(seqs[r][first_sites] for r in have if first_sites in seqs[r])
        return Divergence(group, False, seq, state, present, missing, odd, no_dump, first_sites, sites)
    if no_dump and any(not c.completed for s in known for c in s.values()):
        present = tuple(c for r in have for c in seqs[r].values() if not c.completed)
        return Divergence(group, False, present[0].seq, MatchState.UNDECIDED, present, (), (), no_dump, -1, ())
    return None


def _p2p_divergences(group: GroupInfo, dumps: Mapping[int, RankDump]) -> list[Divergence]:
    out: list[Divergence] = []
    seen: set[tuple[int, int, int, int]] = set()
    for r in group.ranks:
        d = dumps.get(r)
        if d is None:
            continue
        for c in d.calls:
            if c.group != group.key or not c.p2p or c.completed:
                continue
            sender, receiver = (r, c.peer) if c.is_send else (c.peer, r)
            key = (sender, receiver, c.tag, c.pair)
            if key in seen:
                continue
            seen.add(key)
            other = dumps.get(c.peer)
            if other is None:
                out.append(Divergence(group, True, c.pair, MatchState.UNDECIDED, (c,), (), (), (c.peer,), -1, ()))
                continue
            mates = [
                m
                for m in other.calls
                if m.group == group.key and m.p2p and m.peer == r and m.tag == c.tag and m.is_send != c.is_send
            ]
            mate = next((m for m in mates if m.pair == c.pair), None)
            if mate is None:
                oldest = min((m.pair for m in mates), default=-1)
                state = MatchState.UNDECIDED if oldest > c.pair else MatchState.MISSING
                missing = (c.peer,) if state is MatchState.MISSING else ()
                out.append(Divergence(group, True, c.pair, state, (c,), missing, (), (), -1, ()))
                continue
            seen.add(key)
            if mate.nbytes != c.nbytes:
                out.append(
                    Divergence(group, True, c.pair, MatchState.SIZE_MISMATCH, (c, mate), (), (sender,), (), -1, ())
                )
            elif not mate.completed:
                out.append(Divergence(group, True, c.pair, MatchState.INCOMPLETE, (c, mate), (), (), (), -1, ()))
    return out


_SEVERITY = {
    MatchState.OP_MISMATCH: 0, MatchState.SIZE_MISMATCH: 0, MatchState.DTYPE_MISMATCH: 0, MatchState.ROOT_MISMATCH: 0,
    MatchState.MISSING: 1, MatchState.INCOMPLETE: 2, MatchState.UNDECIDED: 3, MatchState.MATCHED: 4,
}  # fmt: skip
"""Mismatches first (a cause), then missing ranks (where the others wait), then the rest."""

TEXT_DIVERGENCES = 4
"""Divergences the text report shows (all are in report.json): the first few explain a hang, the rest
are usually its consequences (the other ranks' next calls)."""


def _position(rank: int, d: RankDump | None) -> Position:
    if d is None:
        return Position(rank, Where.NO_DUMP, (), 0.0, "", (), "", None)
    last = max(d.calls, key=lambda c: c.id) if d.calls else None
    if d.state is ProcessState.RAISED:
        return Position(rank, Where.RAISED, (), 0.0, d.site, d.stack, d.exception, last)
    blocked = tuple(c for c in (d.call(i) for i in d.blocked) if c is not None)
    if blocked:
        return Position(rank, Where.IN_CALL, blocked, d.time - d.blocked_since, d.site, d.stack, "", last)
    if d.state is ProcessState.EXITED:
        return Position(rank, Where.EXITED, (), 0.0, d.site, d.stack, "", last)
    return Position(rank, Where.OUTSIDE, (), d.time - d.last_end if d.last_end else 0.0, d.site, d.stack, "", last)


def diagnose(
    dumps: Mapping[int, RankDump], ranks: Sequence[int] | None = None, *, reason: str = "", detector: int = -1
) -> HangReport:
    """Local. Where the ranks of a job part: the divergences of every communicator and each rank's position.

    Parameters
    ----------
    dumps : mapping of int to RankDump
        The dumps by world rank (:func:`hpctp.debug.load`); absent ranks are reported as such.
    ranks : sequence of int, optional
        The ranks of the job (default: every rank of the world size in the dumps).
    reason : str
        Why the report was made (the watchdog's trigger), for its first line.
    detector : int
        The rank that made the report (-1: offline).

    Returns
    -------
    HangReport
    """
    if ranks is None:
        size = max((d.world_size for d in dumps.values()), default=0)
        ranks = range(size)
    groups = _groups(dumps)
    divergences: list[Divergence] = []
    for key in sorted(groups, key=lambda k: (len(groups[k].ranks), k)):
        g = groups[key]
        if len(g.ranks) < 2:
            continue
        d = _collective_divergence(g, dumps)
        if d is not None:
            divergences.append(d)
        divergences.extend(_p2p_divergences(g, dumps))
    positions = tuple(_position(r, dumps.get(r)) for r in ranks)
    blocked = {(c.rank, c.id) for p in positions for c in p.calls}
    divergences.sort(key=lambda d: (_SEVERITY[d.state], not any((c.rank, c.id) in blocked for c in d.calls)))
    culprits: set[int] = set()
    for d in divergences:
        culprits.update(d.missing, d.odd, d.no_dump)
    culprits.update(p.rank for p in positions if p.where in (Where.RAISED, Where.NO_DUMP))
    if not culprits:  # everyone inside, nothing missing: name the last to arrive where they wait
        waiting = [c for p in positions for c in p.calls]
        if waiting:
            culprits.add(max(waiting, key=lambda c: c.start).rank)
    job = next((d.job for d in dumps.values() if d.job), "")
    return HangReport(reason, detector, tuple(divergences), positions, tuple(sorted(culprits)), job)


# ---------------------------------------------------------------------------------------------- text
def _ranks(ranks: Sequence[int]) -> str:
    return "{" + ", ".join(str(r) for r in ranks) + "}"


def _call_text(c: Call, with_rank: bool = False) -> str:
    kind = "message" if c.p2p else "collective"
    where = f"{c.name} ({kind} #{c.seq if not c.p2p else c.pair} on {c.group}"
    if c.p2p:
        where += f", {'to' if c.is_send else 'from'} rank {c.peer}, tag {c.tag}"
    where += ")"
    size = f"{c.nbytes} B" + (f" {c.dtype}" if c.dtype else "") + (f" root {c.root}" if c.root >= 0 else "")
    text = f"{where} {size}, called at {short_site(c.site)}"
    if c.label:
        text += f" [{c.label}]"
    return (f"rank {c.rank}: " if with_rank else "") + text


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s >= 0.1 else f"{s * 1e3:.0f} ms"


def _position_lines(p: Position, with_stack: bool) -> list[str]:
    head = f"  rank {p.rank}: "
    last = f" (its last call: {_call_text(p.last)})" if p.last is not None else " (no call recorded)"
    if p.where is Where.IN_CALL:
        c = p.calls[0]
        more = f" and {len(p.calls) - 1} more" if len(p.calls) > 1 else ""
        lines = [head + f"in {_call_text(c)}{more}, waiting for {_seconds(p.seconds)}"]
    elif p.where is Where.OUTSIDE:
        lines = [head + f"outside hpctp since {_seconds(p.seconds)}, at {short_site(p.site)}{last}"]
    elif p.where is Where.RAISED:
        lines = [head + f"raised {p.exception} at {short_site(p.site)}{last}"]
    elif p.where is Where.EXITED:
        lines = [head + f"exited its program{last}"]
    else:
        lines = [head + "no dump: gone, stuck in native code that holds the GIL, or no shared file system"]
    if with_stack and p.stack:
        lines.append("      Python stack (innermost last):")
        for f in p.stack[-8:]:
            code = f": {f.code}" if f.code else ""
            lines.append(f"        {short_site(f'{f.file}:{f.line}')} in {f.function}{code}")
    return lines


def _divergence_lines(d: Divergence) -> list[str]:
    members = ", ".join(str(r) for r in d.group.ranks)
    if d.p2p:
        c = d.calls[0]
        head = f"{d.group.name} (world ranks {members}), message #{d.seq} of rank "
        sender, receiver = (c.rank, c.peer) if c.is_send else (c.peer, c.rank)
        head += f"{sender} to rank {receiver}, tag {c.tag}: {d.state.value}"
    else:
        first = d.calls[0] if d.calls else None
        what = f": {first.name}" if first is not None and d.state is MatchState.MISSING else ""
        head = f"{d.group.name} (world ranks {members}), collective #{d.seq}{what}: {d.state.value}"
    lines = [f"ranks diverge at {head}"]
    if d.missing:
        lines.append(f"  missing ranks: {_ranks(d.missing)}")
    if d.odd:
        lines.append(f"  odd ranks: {_ranks(d.odd)}")
    if d.no_dump:
        lines.append(f"  ranks without a dump: {_ranks(d.no_dump)}")
    for c in d.calls:
        lines.append(f"  {_call_text(c, with_rank=True)}" + ("" if c.completed else f" ({c.state})"))
    if d.sites_differ_at >= 0:
        sites = ", ".join(f"rank {c.rank} at {short_site(c.site)}" for c in d.sites)
        lines.append(
            f"  hint: collective #{d.sites_differ_at} on {d.group.name} came from different lines ({sites}): "
            f"a rank may have skipped or added a call before it"
        )
    return lines


def format_report(report: HangReport, directory: str = "") -> str:
    """Local. The report as text: the verdict, the divergences, then where each rank stands.

    Parameters
    ----------
    report : HangReport
    directory : str
        Where the report's files are (named on the last line).

    Returns
    -------
    str
    """
    culprits = ", ".join(str(r) for r in report.culprits) or "none found"
    lines = [f"hpctp watchdog: {report.reason}" if report.reason else "hpctp flight recorder: job report"]
    lines.append(f"ranks to look at: {culprits}")
    for d in report.divergences[:TEXT_DIVERGENCES]:
        lines.extend(_divergence_lines(d))
    if len(report.divergences) > TEXT_DIVERGENCES:
        lines.append(f"({len(report.divergences) - TEXT_DIVERGENCES} more divergences in report.json)")
    if not report.divergences:
        lines.append("no communicator diverges: every recorded call was matched on all its ranks")
    lines.append("where each rank stands:")
    for p in report.positions:
        lines.extend(_position_lines(p, with_stack=p.where in (Where.OUTSIDE, Where.RAISED)))
    if directory:
        lines.append(f"report: {directory}/report.txt and report.json; dumps: {directory}/rank*.json")
    return "\n".join(lines)


def _call_json(c: Call) -> dict[str, Any]:
    return {k: v for k, v in c._asdict().items()}


def report_json(report: HangReport) -> dict[str, Any]:
    """Local. The report as JSON-ready data (enums by value, calls and positions as objects)."""
    return {
        "reason": report.reason,
        "detector": report.detector,
        "job": report.job,
        "culprits": list(report.culprits),
        "divergences": [
            {
                "group": d.group.key,
                "name": d.group.name,
                "ranks": list(d.group.ranks),
                "p2p": d.p2p,
                "seq": d.seq,
                "state": d.state.name,
                "missing": list(d.missing),
                "odd": list(d.odd),
                "no_dump": list(d.no_dump),
                "calls": [_call_json(c) for c in d.calls],
                "sites_differ_at": d.sites_differ_at,
                "sites": [_call_json(c) for c in d.sites],
            }
            for d in report.divergences
        ],
        "positions": [
            {
                "rank": p.rank,
                "where": p.where.name,
                "seconds": p.seconds,
                "site": p.site,
                "exception": p.exception,
                "calls": [_call_json(c) for c in p.calls],
                "last": None if p.last is None else _call_json(p.last),
                "stack": [f._asdict() for f in p.stack],
            }
            for p in report.positions
        ],
    }
