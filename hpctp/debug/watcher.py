"""The hang watchdog: a thread per rank that notices a rank waiting too long and has the job reported.

Threading. The watchdog is a daemon thread that never calls MPI (except ``MPI_Abort`` to end
the job, which MPI allows from any thread under ``MPI_THREAD_MULTIPLE``, the level mpi4py asks
for). It reads the flight recorder's ``blocked`` attribute (one tuple, replaced whole by the
main thread: ``(since, entries)`` while the main thread waits in a call of hpctp.comm) and
writes files. mpi4py releases the GIL in every blocking MPI call (``Request.Wait``,
``Allreduce``...), so the thread runs while the main thread waits inside MPI; it also runs while
the main thread sleeps, and gets the GIL every switch interval (5 ms) from a pure-Python loop.
Only native code that holds the GIL for long stops it: that rank's dump is then late or absent,
and the report says so.

Side channel: files in a job directory (``HPCTP_TRACE_DIR``, default ``./hpctp-trace``, one
``job-<time>-<pid>`` directory per job, its name broadcast by rank 0 when the first grid is
built). Chosen over a duplicated communicator driven by the watchdog threads because it needs
no MPI progress from a process whose main thread may be stuck in MPI or gone, keeps working when
a rank has exited or raised, and leaves the dumps and the report on disk for the user. Each
rank's thread looks at its main thread every :data:`POLL_SECONDS` and for a request every
:data:`REQUEST_POLL_SECONDS`:

1. a rank waiting in one call longer than the watchdog's seconds writes its dump
   (``rank00003.json``) and tries to create ``request.json`` (atomically, so one rank wins);
2. the winner (the *detector*) waits up to :data:`ANSWER_SECONDS` for every rank's answer;
   every rank's thread that sees the request writes its dump with its main thread's Python stack
   (a rank stuck in ``time.sleep`` or a Python loop answers too); ranks that exited or raised
   left a final dump at exit;
3. the detector diagnoses the dumps (:func:`hpctp.debug.diagnose`), prints the report on its
   stderr, writes ``report.txt`` and ``report.json``, and ends the job with exit status
   :data:`EXIT_CODE` (through :func:`hpctp.cli.run_main`'s abort when it runs the program, else
   ``MPI_Abort``).

An uncaught exception on a rank does the same at once (``sys.excepthook``; ``run_main`` calls
:func:`report_failure`): the job ends with a report of where every other rank stands instead of
hanging in the next collective.

Without a shared file system (node-local ``/tmp`` as the directory, or none mounted on every
node), each node's watchdog sees only its own node's dumps: the detector then reports the ranks
of other nodes as having no dump, names the call its node waits in, and still ends the job.
Point ``HPCTP_TRACE_DIR`` at a shared directory (the job's working directory usually is).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from ..comm import callsite
from ..comm import trace as T
from .dumps import dump_path, read_dump, write_json
from .hang import diagnose, format_report, report_json
from .types import RankDump

__all__ = [
    "ANSWER_SECONDS",
    "EXIT_CODE",
    "OUTPUT_GRACE_SECONDS",
    "POLL_SECONDS",
    "REQUEST_POLL_SECONDS",
    "Watchdog",
    "active",
    "report_failure",
    "write_dump",
]

POLL_SECONDS = 0.25
"""How often each rank's thread looks at its main thread and at the request file (or a tenth of
the watchdog's seconds when that is shorter): the delay before a report starts and before a rank
answers, against a little CPU per poll (a file lookup)."""

OUTPUT_GRACE_SECONDS = 0.5
"""How long the detector waits between printing its report and ending the job: the launcher forwards a rank's
output asynchronously, and ``MPI_Abort`` can end that forwarding before the report passed (seen on a loaded node:
the report missing from the job's standard error, though in report.txt)."""

REQUEST_POLL_SECONDS = 1.0
"""How often each rank looks for a request (one file lookup on the shared file system per rank and
period: at 10 000 ranks, 10 000 lookups a second on its metadata server at 1 s), against how soon
the ranks answer a report."""

ANSWER_SECONDS = 5.0
"""How long the detector waits for the other ranks' dumps (or the watchdog's seconds when shorter,
but at least two request periods): a rank that has not answered by then (gone, native code holding
the GIL, another file system) is reported without a dump, so the report is never held up by one rank."""

EXIT_CODE = 3
"""The job's exit status when the watchdog ended it."""

_state: dict[str, Any] = {"process": "running", "exception": "", "site": "", "stack": None}
_active: Watchdog | None = None
_main_ident = threading.main_thread().ident
_lock = threading.Lock()


def active() -> Watchdog | None:
    """Local. The running watchdog of this process, if any."""
    return _active


def _frames(frame: FrameType | None) -> tuple[list[dict[str, Any]], str]:
    """The stack of ``frame`` (outermost first) as dump frames, and its innermost user ``file:line in fn``."""
    if frame is None:
        return [], ""
    summary = traceback.extract_stack(frame)[-40:]
    frames = [
        {T.Keys.FILE: f.filename, T.Keys.LINE: f.lineno or 0, T.Keys.FUNCTION: f.name, T.Keys.CODE: f.line or ""}
        for f in summary
    ]
    return frames, callsite.user_site(frame)


def _main_frame() -> FrameType | None:
    """The main thread's innermost frame: where it stands when the watchdog thread asks, the caller of the
    dump when the main thread dumps itself (at exit, on request of the API)."""
    if threading.get_ident() == _main_ident:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith("hpctp.debug"):
            frame = frame.f_back
        return frame
    return sys._current_frames().get(_main_ident or 0)


def write_dump(directory: str | os.PathLike[str], answers: str = "", job: str = "") -> Path:
    """Local. Write this rank's dump (the recorder's entries, its state and main thread's stack) to ``directory``.

    Parameters
    ----------
    directory : str or path
    answers : str
        The id of the request this dump answers ("" for none).
    job : str
        The job's name, for the report.

    Returns
    -------
    pathlib.Path
        The file written.
    """
    snap = T.snapshot()
    if _state["stack"] is not None:  # the stack where the exception was raised
        frames, site = _state["stack"], _state["site"]
    else:
        frames, site = _frames(_main_frame())
    snap[T.Keys.PROCESS] = _state["process"]
    snap[T.Keys.EXCEPTION] = _state["exception"]
    snap[T.Keys.STACK] = frames
    snap[T.Keys.USER_SITE] = site
    snap[T.Keys.ANSWERS] = answers
    snap[T.Keys.JOB] = job
    path = dump_path(directory, int(snap[T.Keys.RANK]))
    Path(directory).mkdir(parents=True, exist_ok=True)
    write_json(path, snap)
    return path


class Watchdog:
    """Local (its thread; :func:`hpctp.debug.watchdog` starts it collectively). The hang watchdog of this rank.

    Parameters
    ----------
    seconds : float
        The longest a rank may wait in one call of hpctp.comm.
    directory : str or path
        The job directory shared by the ranks.
    ranks : sequence of int
        The world ranks whose dumps the report needs.

    Attributes
    ----------
    polls : int
        How many times the thread has looked (it keeps counting while the main thread waits in MPI).
    longest_wait : float
        The longest time it saw the main thread waiting in one call.
    """

    def __init__(self, seconds: float, directory: str | os.PathLike[str], ranks: Sequence[int]) -> None:
        self.seconds = float(seconds)
        self.directory = Path(directory)
        self.ranks = tuple(int(r) for r in ranks)
        self.rank = int(T.snapshot()[T.Keys.RANK])
        self.poll = min(POLL_SECONDS, self.seconds / 10)
        self.answer = max(2 * REQUEST_POLL_SECONDS + 0.5, min(ANSWER_SECONDS, self.seconds))
        self._next_request_poll = 0.0
        self.polls = 0
        self.longest_wait = 0.0
        self._answered = ""
        self._fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpctp-watchdog", daemon=True)

    @property
    def request_path(self) -> Path:
        """The request file: its creator is the detector."""
        return self.directory / "request.json"

    def start(self) -> Watchdog:
        """Local. Start the thread (and hook uncaught exceptions and the exit)."""
        global _active
        _active = self
        _install_hooks()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Local. Stop the thread (the exit and exception hooks stay, inert)."""
        global _active
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5 * self.poll + 1)
        if _active is self:
            _active = None

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            self.polls += 1
            try:
                self._look()
            except Exception as e:  # noqa: BLE001 - the watchdog must not die quietly, nor kill the rank
                sys.stderr.write(f"[rank {self.rank}] hpctp watchdog: {type(e).__name__}: {e}\n")

    def _look(self) -> None:
        self._answer_request()
        rec = T.recorder()
        blocked = None if rec is None else rec.blocked
        if blocked is None:
            return
        waited = time.time() - blocked[0]
        self.longest_wait = max(self.longest_wait, waited)
        if waited > self.seconds and not self._fired:
            e = blocked[1][0]
            what = f"{e.op}({e.detail})" if e.detail else e.op
            if e.p2p:
                peer = e.group.ranks[e.peer] if 0 <= e.peer < len(e.group.ranks) else e.peer
                where = f"message #{e.pair} {'to' if e.op.lower().endswith('send') else 'from'} rank {peer}"
            else:
                where = f"collective #{e.seq}"
            self.detect(f"rank {self.rank} waited {waited:.1f} s in {what} ({where} on {e.group.name})")

    def _answer_request(self, now: bool = False) -> None:
        t = time.time()
        if not now and t < self._next_request_poll:
            return
        self._next_request_poll = t + REQUEST_POLL_SECONDS
        try:
            data = json.loads(self.request_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return
        rid = str(data.get("id", ""))
        if rid and rid != self._answered:
            self._answered = rid
            write_dump(self.directory, answers=rid, job=self.directory.name)

    # ------------------------------------------------------------------ detection
    def detect(self, reason: str) -> None:
        """Local (ends the job when this rank is the detector). Ask every rank for its dump, report, end the job.

        Parameters
        ----------
        reason : str
            The first line of the report.
        """
        with _lock:
            if self._fired:
                return
            self._fired = True
        rid = f"{self.rank}-{time.time():.6f}"
        if not self._claim(rid, reason):  # another rank reports: answer it and wait for the end
            self._answer_request(now=True)
            return
        self._answered = rid
        write_dump(self.directory, answers=rid, job=self.directory.name)
        dumps = self._collect(rid)
        report = diagnose(dumps, self.ranks, reason=reason, detector=self.rank)
        text = format_report(report, str(self.directory))
        write_json(self.directory / "report.json", report_json(report))
        (self.directory / "report.txt").write_text(text + "\n")
        sys.stderr.write(f"\n[rank {self.rank}] {text}\n")
        sys.stderr.flush()
        time.sleep(OUTPUT_GRACE_SECONDS)
        T.abort_job(EXIT_CODE)

    def _claim(self, rid: str, reason: str) -> bool:
        """Create the request file if no rank has: True for the one rank that does."""
        tmp = self.directory / f".request.{self.rank}.tmp"
        tmp.write_text(json.dumps({"id": rid, "by": self.rank, "reason": reason, "time": time.time()}))
        try:
            os.link(tmp, self.request_path)  # atomic: fails if another rank made it first
            return True
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: exclusive creation (readers retry a partial read)
            try:
                with open(self.request_path, "x") as f:
                    f.write(tmp.read_text())
                return True
            except FileExistsError:
                return False
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _collect(self, rid: str) -> dict[int, RankDump]:
        """The ranks' dumps that answer ``rid`` (or were their last: exited, raised), waiting up to the answer time."""
        deadline = time.time() + self.answer
        dumps: dict[int, RankDump] = {}
        while True:
            for r in self.ranks:
                if r in dumps:
                    continue
                try:
                    d = read_dump(dump_path(self.directory, r))
                except (FileNotFoundError, ValueError):
                    continue
                if d.answers == rid or d.state.value != "running":
                    dumps[r] = d
            if len(dumps) == len(self.ranks) or time.time() > deadline:
                return dumps
            time.sleep(min(0.05, self.poll))


# ---------------------------------------------------------------------------------------------- process hooks
_hooks_installed = False
_previous_excepthook = sys.excepthook


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    sys.excepthook = _excepthook
    atexit.register(_at_exit)


def _remember(exc: BaseException, tb: TracebackType | None) -> None:
    frames = []
    site = ""  # the innermost user frame of the traceback: where the user's code raised, or called what raised
    for f, line in traceback.walk_tb(tb):
        code = f.f_code
        frames.append(
            {T.Keys.FILE: code.co_filename, T.Keys.LINE: line, T.Keys.FUNCTION: code.co_name, T.Keys.CODE: ""}
        )
        if callsite.is_user(f):
            site = f"{code.co_filename}:{line}"
    for d, summary in zip(frames, traceback.extract_tb(tb)):
        d[T.Keys.CODE] = summary.line or ""
    _state.update(process="raised", exception=f"{type(exc).__name__}: {str(exc)[:500]}", site=site, stack=frames)


def report_failure(exc: BaseException | None = None) -> None:
    """Local (ends the job). After an uncaught exception on this rank: dump, report where every rank stands, end the job.

    Does nothing when no watchdog runs. :func:`hpctp.cli.run_main` calls it before its own abort.

    Parameters
    ----------
    exc : BaseException, optional
        The exception (default: the one being handled).
    """
    wd = _active
    if wd is None:
        return
    exc = exc if exc is not None else sys.exc_info()[1]
    if exc is None:
        return
    _remember(exc, exc.__traceback__)
    wd.detect(f"rank {wd.rank} raised {_state['exception']} at {_state['site'] or '?'}")


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    _previous_excepthook(kind, exc, tb)
    if _active is not None and not isinstance(exc, KeyboardInterrupt):
        sys.stderr.flush()
        report_failure(exc)


def _at_exit() -> None:
    wd = _active
    if wd is None:
        return
    if _state["process"] == "running":
        _state["process"] = "exited"
    wd._stop.set()
    with contextlib.suppress(OSError):
        write_dump(wd.directory, job=wd.directory.name)
