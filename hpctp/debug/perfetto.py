"""The recorded calls as a Chrome / Perfetto trace (JSON trace-event format), and a PNG of it.

One process per rank ("rank 3 (host)"), three tracks: the calls the main thread waits in
(blocking calls, and the waits of non-blocking ones), the non-blocking calls from their posting
to their completion, and the computed waiting for others (:mod:`hpctp.debug.timeline`); flow
arrows join the calls MPI matched: a send to its receive, and a collective's last arrival to
the ranks it released. Open the file in https://ui.perfetto.dev or ``chrome://tracing``.
Slices are named by the hpctp operation and the MPI call (``Conv2d.forward halo: Irecv``) and
carry the communicator, sequence number, bytes, dtype, peer and call site as arguments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .timeline import _aligned, _blocked_from, call_label, matches
from .types import Call, RankDump

__all__ = ["TRACK_CALLS", "TRACK_POSTED", "TRACK_WAITING", "perfetto_trace", "plot_timeline"]

TRACK_CALLS = 0
"""Track (thread id) of the calls the main thread blocks in."""
TRACK_POSTED = 1
"""Track of non-blocking calls, from posting to completion."""
TRACK_WAITING = 2
"""Track of the computed waiting for later ranks."""

_TRACKS = {TRACK_CALLS: "in MPI (blocked)", TRACK_POSTED: "non-blocking (posted)", TRACK_WAITING: "waiting for others"}


def _name(c: Call) -> str:
    return f"{c.label}: {c.name}" if c.label else call_label(c)


def _args(c: Call) -> dict[str, Any]:
    args: dict[str, Any] = {"group": c.group, "seq" if not c.p2p else "pair": c.seq if not c.p2p else c.pair}
    args.update({"bytes": c.nbytes, "dtype": c.dtype, "site": c.site, "state": c.state})
    if c.p2p:
        args.update({"peer": c.peer, "tag": c.tag})
    if c.root >= 0:
        args["root"] = c.root
    return args


def perfetto_trace(dumps: Mapping[int, RankDump]) -> dict[str, Any]:
    """Local. The dumps of one run as a Chrome / Perfetto trace.

    Parameters
    ----------
    dumps : mapping of int to RankDump

    Returns
    -------
    dict
        ``{"traceEvents": [...], "displayTimeUnit": "ms"}``; times in microseconds from the first call.
    """
    calls = _aligned(dumps)
    starts = [c.start for cs in calls.values() for c in cs]
    t0 = min(starts) if starts else 0.0

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    events: list[dict[str, Any]] = []
    for r, d in sorted(dumps.items()):
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r} ({d.host})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
        for tid, text in _TRACKS.items():
            events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": text}})
        for c in calls[r]:
            end = c.end if c.end else d.time
            blocking = not c.wait and c.op[:1] != "I"
            if not blocking:
                events.append({"ph": "X", "pid": r, "tid": TRACK_POSTED, "name": _name(c), "cat": "mpi",
                               "ts": us(c.start), "dur": us(end) - us(c.start), "args": _args(c)})  # fmt: skip
            if blocking or c.wait:
                begin = c.start if blocking else c.wait
                events.append({"ph": "X", "pid": r, "tid": TRACK_CALLS, "name": _name(c), "cat": "mpi",
                               "ts": us(begin), "dur": us(end) - us(begin), "args": _args(c)})  # fmt: skip
    flow = 0
    for m in matches(dumps):
        if m.p2p:
            send, recv = m.calls
            links = [(send, recv)]
            wait = max(0.0, min(recv.end, send.start) - _blocked_from(recv))
            if wait > 0:
                events.append(_wait(recv, _blocked_from(recv), wait, send.rank, us))
        else:
            last = max(m.calls, key=lambda c: c.start)
            links = [(last, c) for c in m.calls if c is not last]
            for c in m.calls:
                wait = max(0.0, min(c.end, last.start) - _blocked_from(c)) if c is not last else 0.0
                if wait > 0:
                    events.append(_wait(c, _blocked_from(c), wait, last.rank, us))
        for src, dst in links:
            flow += 1
            src_tid = TRACK_CALLS if (not src.wait and src.op[:1] != "I") else TRACK_POSTED
            dst_tid = TRACK_CALLS if (not dst.wait and dst.op[:1] != "I") else TRACK_POSTED
            events.append({"ph": "s", "id": flow, "pid": src.rank, "tid": src_tid, "ts": us(src.start),
                           "name": "matched", "cat": "match"})  # fmt: skip
            events.append({"ph": "f", "bp": "e", "id": flow, "pid": dst.rank, "tid": dst_tid,
                           "ts": max(us(dst.start), us(dst.end) - 0.001), "name": "matched", "cat": "match"})  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _wait(c: Call, since: float, seconds: float, late: int, us: Any) -> dict[str, Any]:
    return {"ph": "X", "pid": c.rank, "tid": TRACK_WAITING, "name": f"waiting for rank {late}", "cat": "wait",
            "ts": us(since), "dur": round(seconds * 1e6, 3), "args": {"label": c.label, "call": c.name}}  # fmt: skip


def plot_timeline(
    trace: Mapping[str, Any], path: str | os.PathLike[str], *, start_ms: float = 0.0, end_ms: float | None = None
) -> None:
    """Local. Draw a :func:`perfetto_trace` as a PNG: one row per rank, calls, waits and matches.

    Needs matplotlib (the ``apps`` extra). Blue: blocked in an MPI call; light blue: a
    non-blocking call in flight; red: waiting for a later rank (labelled with it); grey arrows:
    matched calls (a send to its receive; a collective's last arrival to the others).

    Parameters
    ----------
    trace : mapping
        The output of :func:`perfetto_trace`.
    path : str or path
        The PNG to write.
    start_ms, end_ms : float
        The window to draw, in milliseconds from the first call (default: all).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = list(trace["traceEvents"])
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    pids = sorted(names)
    row = {pid: i for i, pid in enumerate(pids)}
    slices = [e for e in events if e["ph"] == "X"]
    stop = end_ms if end_ms is not None else max((e["ts"] + e["dur"]) / 1e3 for e in slices) if slices else 1.0
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.75 * len(pids)))
    style = {
        TRACK_CALLS: ("#1f77b4", 0.0, 0.26),
        TRACK_POSTED: ("#aec7e8", 0.27, 0.16),
        TRACK_WAITING: ("#d62728", -0.27, 0.16),
    }
    for e in slices:
        a, b = e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3
        if b < start_ms or a > stop:
            continue
        color, dy, h = style[e["tid"]]
        y = row[e["pid"]] + dy
        ax.broken_barh([(a, max(b - a, (stop - start_ms) / 2000))], (y - h / 2, h), facecolors=color)
        if e["tid"] == TRACK_WAITING and (b - a) > (stop - start_ms) / 12:
            ax.text((a + b) / 2, y, e["name"], ha="center", va="center", fontsize=6, color="white", clip_on=True)
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    for e in events:
        if e["ph"] != "f" or e["id"] not in starts:
            continue
        s = starts[e["id"]]
        x0, x1 = s["ts"] / 1e3, e["ts"] / 1e3
        if start_ms <= x0 <= stop and start_ms <= x1 <= stop:
            ax.annotate("", xy=(x1, row[e["pid"]]), xytext=(x0, row[s["pid"]]),
                        arrowprops={"arrowstyle": "->", "color": "0.45", "lw": 0.7})  # fmt: skip
    ax.set_yticks(range(len(pids)), [names[p] for p in pids])
    ax.set_ylim(len(pids) - 0.4, -0.6)
    ax.set_xlim(start_ms, stop)
    ax.set_xlabel("ms since the first recorded call")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=style[TRACK_CALLS][0]),
        plt.Rectangle((0, 0), 1, 1, color=style[TRACK_POSTED][0]),
        plt.Rectangle((0, 0), 1, 1, color=style[TRACK_WAITING][0]),
    ]
    ax.legend(handles, ["blocked in MPI", "non-blocking in flight", "waiting for a later rank"],
              loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8, frameon=False)  # fmt: skip
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110, bbox_inches="tight")  # (the legend below the axes included)
    plt.close(fig)
