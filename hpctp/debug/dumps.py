"""Dump files: one JSON file per rank (``rank00003.json``) in a job directory, read into typed records.

A dump is :func:`hpctp.comm.trace.snapshot` (the recorder's entries, group table and the call
the main thread waits in) plus the process part that :mod:`hpctp.debug.watcher` adds (its
state, the main thread's Python stack, an exception, the request it answers), under the keys of
:class:`hpctp.comm.trace.Keys`. Files are written whole and renamed into place, so a reader never
sees half of one. JSON, not pickle: a dump is data, readable by any tool.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..comm.trace import FORMAT_VERSION, Keys
from .types import Call, Frame, GroupInfo, ProcessState, RankDump

__all__ = ["dump_path", "load", "job_directory_of", "parse_dump", "read_dump", "write_json"]

_MAJOR = FORMAT_VERSION.split(".")[0]


def dump_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """Local. The file of ``rank``'s dump in ``directory``."""
    return Path(directory) / f"rank{rank:05d}.json"


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Local. Write ``data`` as JSON to ``path`` whole (a temporary file renamed into place)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, p)


def _frame(d: Mapping[str, Any]) -> Frame:
    return Frame(str(d[Keys.FILE]), int(d[Keys.LINE]), str(d[Keys.FUNCTION]), str(d.get(Keys.CODE, "")))


def _call(rank: int, d: Mapping[str, Any]) -> Call:
    return Call(
        rank=rank,
        id=int(d[Keys.ID]),
        group=str(d[Keys.GROUP]),
        p2p=bool(d[Keys.P2P]),
        op=str(d[Keys.OP]),
        seq=int(d[Keys.SEQ]),
        pair=int(d[Keys.PAIR]),
        nbytes=int(d[Keys.BYTES]),
        dtype=str(d[Keys.DTYPE]),
        peer=int(d[Keys.PEER]),
        tag=int(d[Keys.TAG]),
        root=int(d[Keys.ROOT]),
        detail=str(d.get(Keys.DETAIL, "")),
        label=str(d[Keys.LABEL]),
        site=str(d[Keys.SITE]),
        block=int(d.get(Keys.BLOCK, -1)),
        start=float(d[Keys.START]),
        wait=float(d[Keys.WAIT]),
        end=float(d[Keys.END]),
        state=str(d[Keys.STATE]),
    )


def parse_dump(d: Mapping[str, Any]) -> RankDump:
    """Local. A dump's JSON object as a :class:`~hpctp.debug.types.RankDump`.

    Raises
    ------
    ValueError
        If the dump's format version has another major number than this hpctp's, or a key is missing.
    """
    version = str(d.get(Keys.VERSION, "?"))
    if version.split(".")[0] != _MAJOR:
        raise ValueError(f"dump format {version} is not readable by this hpctp (format {FORMAT_VERSION})")
    try:
        rank = int(d[Keys.RANK])
        return RankDump(
            rank=rank,
            world_size=int(d[Keys.WORLD_SIZE]),
            host=str(d.get(Keys.HOST, "")),
            pid=int(d.get(Keys.PID, 0)),
            time=float(d[Keys.TIME]),
            clock_sync=float(d.get(Keys.CLOCK_SYNC, 0.0)),
            ring=int(d.get(Keys.RING, 0)),
            recorded=int(d.get(Keys.RECORDED, 0)),
            groups=tuple(
                GroupInfo(str(g[Keys.KEY]), str(g[Keys.NAME]), tuple(int(r) for r in g[Keys.RANKS]))
                for g in d[Keys.GROUPS]
            ),
            calls=tuple(_call(rank, e) for e in d[Keys.ENTRIES]),
            blocked=tuple(int(i) for i in d.get(Keys.BLOCKED, ())),
            blocked_since=float(d.get(Keys.BLOCKED_SINCE, 0.0)),
            last_end=float(d.get(Keys.LAST_END, 0.0)),
            state=ProcessState(d.get(Keys.PROCESS, ProcessState.RUNNING.value)),
            stack=tuple(_frame(f) for f in d.get(Keys.STACK, ())),
            site=str(d.get(Keys.USER_SITE, "")),
            exception=str(d.get(Keys.EXCEPTION, "")),
            answers=str(d.get(Keys.ANSWERS, "")),
            job=str(d.get(Keys.JOB, "")),
        )
    except KeyError as e:
        raise ValueError(f"a dump lacks the key {e.args[0]!r}; is it a hpctp flight-recorder dump?") from None


def read_dump(path: str | os.PathLike[str]) -> RankDump:
    """Local. Read one dump file.

    Raises
    ------
    ValueError
        If the file is not a dump of a readable format.
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e}); a dump being written? read it again") from None
    return parse_dump(data)


def job_directory_of(directory: str | os.PathLike[str]) -> Path:
    """Local. ``directory`` if it holds dumps, else its newest ``job-*`` subdirectory that does.

    Raises
    ------
    FileNotFoundError
        If neither holds a dump.
    """
    d = Path(directory)
    if any(d.glob("rank*.json")):
        return d
    jobs = sorted((p for p in d.glob("job-*") if any(p.glob("rank*.json"))), key=lambda p: p.stat().st_mtime)
    if not jobs:
        raise FileNotFoundError(
            f"no flight-recorder dumps (rank*.json) in {d} or its job-* directories; run with HPCTP_TRACE=N "
            f"(dumps at exit), or call hpctp.debug.dump() on every rank"
        )
    return jobs[-1]


def load(directory: str | os.PathLike[str]) -> dict[int, RankDump]:
    """Local. Every rank's dump in ``directory`` (or in its newest ``job-*`` directory), by world rank.

    Raises
    ------
    FileNotFoundError
        If there is no dump.
    ValueError
        If a file is not a readable dump.
    """
    d = job_directory_of(directory)
    out: dict[int, RankDump] = {}
    for p in sorted(d.glob("rank*.json")):
        dump = read_dump(p)
        out[dump.rank] = dump
    return out
