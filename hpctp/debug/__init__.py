"""Why a distributed run hangs or runs slow: the flight recorder, the hang watchdog, the mismatch check.

Three environment variables (checked when the first grid is built; a bad value raises on every
rank), or the functions below:

* ``HPCTP_TRACE=N`` (:func:`trace`): every MPI call of hpctp (collectives and point-to-point,
  blocking or not, on every communicator) goes into a per-rank ring of the last ``N`` entries:
  the communicator and the call's sequence number on it, the operation, bytes, dtype, peer or
  root, the hpctp operation that made it (``Conv2d.forward halo``, ``redistribute (0, None)->(None,
  0)``) and the user's ``file:line``, and when it was posted, waited for and completed. Every rank
  writes its dump at exit into ``HPCTP_TRACE_DIR`` (default ``./hpctp-trace``), one ``job-*``
  directory per job: ``hpctp trace summarize DIR`` then prints who waits for whom
  (:func:`summarize`) and writes a Perfetto trace (:func:`perfetto_trace`).
* ``HPCTP_WATCHDOG=seconds`` (:func:`watchdog`): a rank waiting longer than that in one call has
  every rank dump, then reports which communicator and sequence number the ranks diverge at,
  which ranks are missing and where each stands (its call, or its Python stack outside hpctp),
  and ends the job (exit status 3). An uncaught exception on a rank does the same at once.
* ``HPCTP_CHECK=1`` (:func:`check`): each collective first compares its operation, size, dtype
  and root across the ranks; a difference raises on every rank before any data moves.

Off by default; the recorder's cost when off is one branch per MPI call of hpctp. The analysis
(:func:`diagnose`, :func:`summarize`, :func:`perfetto_trace`) is pure and runs offline on
:func:`load`'s dumps.
"""

from __future__ import annotations

from ..comm.trace import CollectiveMismatch, label
from .control import check, dump, job_directory, trace, watchdog
from .dumps import load
from .hang import diagnose, format_report, report_json
from .perfetto import perfetto_trace, plot_timeline
from .timeline import format_summary, summarize
from .watcher import Watchdog

__all__ = [
    "CollectiveMismatch",
    "Watchdog",
    "check",
    "diagnose",
    "dump",
    "format_report",
    "format_summary",
    "job_directory",
    "label",
    "load",
    "perfetto_trace",
    "plot_timeline",
    "report_json",
    "summarize",
    "trace",
    "watchdog",
]
