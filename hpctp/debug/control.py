"""Turning the flight recorder, the mismatch check and the watchdog on: from the environment or the API.

``HPCTP_TRACE=N``, ``HPCTP_WATCHDOG=seconds`` and ``HPCTP_CHECK=1`` take effect when the first
:class:`~hpctp.ProcessGrid` is built (:func:`hpctp.comm.trace.on_first_grid`), after the ranks
agreed on them: then rank 0 names the job directory (``HPCTP_TRACE_DIR/job-<time>-<pid>``) and
broadcasts it, the ranks' clocks are noted right after a barrier (to align hosts' clocks
offline), the watchdog starts (on more than one rank), and with ``HPCTP_TRACE`` every rank
writes its dump there when it exits, for ``hpctp trace summarize``. The functions below do the
same from a program.
"""

from __future__ import annotations

import atexit
import math
import os
import time
from pathlib import Path

from ..comm import ProcessGrid, agree_arguments, barrier, check_grid, trace_label
from ..comm import trace as T
from ..comm.env import trace_setting
from ..comm.io_calls import bcast_bytes
from . import watcher as W

__all__ = ["check", "dump", "job_directory", "trace", "watchdog"]

_job: Path | None = None
_exit_dump = False


def job_directory() -> Path | None:
    """Local. The job directory of the dumps and reports (None until a grid or :func:`watchdog` set it up)."""
    return _job


def trace(entries: int = T.DEFAULT_ENTRIES) -> None:
    """Local. Record the last ``entries`` MPI calls of hpctp on this rank (0 stops recording).

    Call it on every rank at the same point of the program (before the grid, ideally): the
    sequence numbers then count the same calls everywhere and line the ranks up. Stopping the
    recorder (0) also disarms the mismatch check, which runs inside it.

    Parameters
    ----------
    entries : int
        Size of the ring (``HPCTP_TRACE`` sets it from the environment).

    Raises
    ------
    ValueError
        If ``entries`` is negative.
    TypeError
        If ``entries`` is not an int.
    """
    if isinstance(entries, bool) or not isinstance(entries, int):
        raise TypeError(f"entries must be an int, got {type(entries).__name__}")
    T.start(entries)


def check(grid: ProcessGrid, on: bool = True) -> None:
    """Collective over grid. Compare every collective's operation, size, dtype and root across its ranks first.

    With the check armed, a rank that calls another collective than the others, or the same one
    with another size, dtype or root, makes every rank of that communicator raise
    :class:`hpctp.comm.trace.CollectiveMismatch` (a ValueError) naming each rank's call and call
    site, before any data moves (``HPCTP_CHECK=1`` arms it when the first grid is built). It costs
    one small ``Allgather`` per collective. Arm it on every rank of the job: communicators made
    by other grids of the same processes are checked too.

    Parameters
    ----------
    grid : ProcessGrid
    on : bool
        Arm (True) or disarm (False).

    Raises
    ------
    ValueError
        If the ranks pass different ``on`` (on every rank).
    """
    grid = check_grid(grid)
    agree_arguments(grid.comm, "hpctp.debug.check", None, on=bool(on))
    T.arm_check(bool(on))


def _setup_job(grid: ProcessGrid, directory: str | os.PathLike[str] | None) -> Path:
    """Collective over grid. Rank 0 names the job directory and broadcasts it; clocks are noted after a barrier."""
    global _job
    error: Exception | None = None
    name = b""
    if grid.rank == 0:
        base = Path(directory if directory is not None else "hpctp-trace").resolve()
        path = base / f"job-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            error = OSError(f"cannot create the flight recorder's job directory {path}: {e}; set HPCTP_TRACE_DIR")
        name = str(path).encode()
    with trace_label("flight recorder setup"):
        agree_arguments(grid.comm, "hpctp.debug job directory", error)
        path = Path(bcast_bytes(grid.comm, name if grid.rank == 0 else None).decode())
        path.mkdir(parents=True, exist_ok=True)  # (on a node without rank 0's file system: a local one)
        barrier(grid.comm)
    rec = T.recorder()
    if rec is not None:
        rec.clock_sync = time.time()
    _job = path
    return path


def watchdog(grid: ProcessGrid, seconds: float, directory: str | os.PathLike[str] | None = None) -> W.Watchdog:
    """Collective over grid. Start the hang watchdog: a rank waiting longer than ``seconds`` in one call ends the job
    with a report.

    The report (stderr of the rank that noticed, ``report.txt`` and ``report.json`` in the job
    directory) names the communicator and sequence number where the ranks diverge, the ranks
    missing from it, and where each rank stands (its call and ``file:line``, or "outside hpctp"
    with its Python stack). See :mod:`hpctp.debug.watcher`. Runs the recorder if it is off.

    Parameters
    ----------
    grid : ProcessGrid
        The ranks that watch each other (all ranks of the job, usually).
    seconds : float
        The longest wait in one call (``HPCTP_WATCHDOG``); longer than any legitimate wait
        (a slow rank's compute between two collectives, a checkpoint write).
    directory : str or path, optional
        Where job directories go (default: the job directory already made, else
        ``HPCTP_TRACE_DIR``, else ``./hpctp-trace``), on a file system every rank sees; rank 0's
        path is used, but every rank must pass one or none.

    Returns
    -------
    Watchdog
        Call ``stop()`` to end it.

    Raises
    ------
    ValueError
        If ``seconds`` is not positive and finite, or the ranks pass different arguments (on every rank).
    """
    grid = check_grid(grid)
    error: Exception | None = None
    try:
        value = float(seconds)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"the watchdog needs seconds > 0, got {seconds!r}")
    except (TypeError, ValueError) as e:
        error = ValueError(str(e))
        value = 0.0
    new = _job is None or directory is not None
    agree_arguments(grid.comm, "hpctp.debug.watchdog", error, seconds=value, new_directory=new)
    if not T.on:
        T.start(T.DEFAULT_ENTRIES)
    rec = T.recorder()
    ranks = rec.group(grid.comm).ranks if rec is not None else (grid.rank,)
    path = _setup_job(grid, directory or T.settings().directory) if new or _job is None else _job
    old = W.active()
    if old is not None:
        old.stop()
    return W.Watchdog(value, path, ranks).start()


def dump(directory: str | os.PathLike[str] | None = None) -> Path:
    """Local. Write this rank's dump (recorder entries, groups, state, Python stack) for offline analysis.

    Parameters
    ----------
    directory : str or path, optional
        Default: the job directory (:func:`job_directory`).

    Returns
    -------
    pathlib.Path
        The file written (``rank00003.json``).

    Raises
    ------
    ValueError
        If no directory is given and no job directory was set up.
    """
    target = directory if directory is not None else _job
    if target is None:
        raise ValueError(
            "hpctp.debug.dump: no job directory yet (it is made with the first grid when HPCTP_TRACE is set, or by "
            "hpctp.debug.watchdog); pass a directory"
        )
    return W.write_dump(target, job=Path(target).name)


def _dump_at_exit() -> None:
    if _job is not None and W.active() is None:
        W._state["process"] = "exited" if W._state["process"] == "running" else W._state["process"]
        W.write_dump(_job, job=_job.name)


def _on_first_grid(grid: ProcessGrid) -> None:
    """Collective over grid. What the environment asks for, once the first grid agreed on it."""
    global _exit_dump
    s = T.settings()
    explicit = bool(trace_setting())
    if not (explicit or s.watchdog):
        return
    if s.watchdog and grid.size > 1:
        watchdog(grid, s.watchdog, s.directory)
    else:
        _setup_job(grid, s.directory)
    if explicit and not _exit_dump:
        _exit_dump = True
        atexit.register(_dump_at_exit)


T.on_first_grid(_on_first_grid)
