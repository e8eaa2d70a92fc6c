"""``hpctp trace summarize DIR`` and ``hpctp trace report DIR``: the flight recorder's dumps, read offline.

``summarize`` prints who waits for whom (:func:`hpctp.debug.summarize`: the stragglers, each
rank's time in MPI calls, waiting and computing, and the operations where the ranks wait) and
writes the Chrome / Perfetto trace (``DIR/perfetto.json``, or ``--perfetto FILE``), and with
``--png FILE`` a picture of it. ``report`` diagnoses the dumps as the watchdog does (which
communicator and sequence number the ranks diverge at, where each rank stands), e.g. after a job
was killed by the scheduler with dumps from ``hpctp.debug.dump``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..debug import diagnose, format_report, format_summary, load, perfetto_trace, plot_timeline, summarize
from ..debug.dumps import job_directory_of

__all__ = ["report_command", "summarize_command"]


def summarize_command(
    directory: str, perfetto: str | None = None, png: str | None = None, window: Sequence[float] | None = None
) -> int:
    """Local. Print the wait-state summary of the dumps in ``directory`` and write the Perfetto trace.

    Parameters
    ----------
    directory : str
        A job directory with ``rank*.json`` dumps, or a directory of ``job-*`` directories (the newest).
    perfetto : str, optional
        Where to write the trace (default: ``perfetto.json`` in the job directory).
    png : str, optional
        Also draw the trace as a PNG (needs matplotlib).
    window : pair of float, optional
        The PNG's time window, in ms from the first recorded call.

    Returns
    -------
    int
        0.

    Raises
    ------
    FileNotFoundError
        If there are no dumps.
    """
    job = job_directory_of(directory)
    dumps = load(job)
    print(f"flight recorder: {len(dumps)} rank dumps in {job}", flush=True)
    print(format_summary(summarize(dumps)), flush=True)
    trace = perfetto_trace(dumps)
    out = Path(perfetto) if perfetto else job / "perfetto.json"
    out.write_text(json.dumps(trace))
    print(f"Perfetto trace: {out} (open it in https://ui.perfetto.dev)", flush=True)
    if png:
        start, end = window if window is not None else (0.0, None)
        plot_timeline(trace, png, start_ms=start, end_ms=end)
        print(f"timeline picture: {png}", flush=True)
    return 0


def report_command(directory: str) -> int:
    """Local. Print the hang diagnosis of the dumps in ``directory`` (as the watchdog's report).

    Parameters
    ----------
    directory : str
        A job directory, or a directory of ``job-*`` directories (the newest).

    Returns
    -------
    int
        0 when no communicator diverges, else 1.
    """
    job = job_directory_of(directory)
    report = diagnose(load(job))
    print(format_report(report), flush=True)
    return 1 if report.divergences else 0
