"""Run a program's ``main`` so that an exception on any rank ends the whole MPI job (no hang).

The apps, the benchmarks and ``python -m hpctp`` start through :func:`run_main`; a script
of a simulation code driving hpctp can do the same.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

__all__ = ["run_main"]


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """Collective over COMM_WORLD. Call ``main()`` and exit with its status.

    An exception on one rank prints its traceback with the rank and calls
    ``MPI_Abort`` (when more than one rank runs), so the other ranks never wait
    forever in a collective the failed rank will not reach. With the hang watchdog
    (``HPCTP_WATCHDOG``, :mod:`hpctp.debug`) the failing rank first reports where every
    rank stands; the watchdog's own reports end the job through the same abort.

    Parameters
    ----------
    main : callable
        Takes no argument; returns the exit status (None counts as 0).

    Raises
    ------
    SystemExit
        Always: with ``main``'s status, or 1 after an exception on a single rank.
    """
    from ..comm import trace
    from ..debug import watcher

    trace.set_abort(_abort)  # the hang watchdog (hpctp.debug) ends the job through here too
    try:
        code = main()
    except SystemExit:
        raise
    except BaseException:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        sys.stderr.write(f"[rank {world.Get_rank()}/{world.Get_size()}] error:\n{traceback.format_exc()}")
        sys.stderr.flush()
        if world.Get_size() > 1:
            watcher.report_failure()  # with HPCTP_WATCHDOG: where every other rank stands, then the abort below
            _abort(1)
        sys.exit(1)
    finally:
        trace.set_abort(None)
    sys.exit(code)


def _abort(code: int) -> None:
    """Local (ends every rank). ``MPI_Abort`` with ``code``, after the launcher had a moment to forward the output."""
    from mpi4py import MPI

    sys.stderr.flush()
    time.sleep(0.5)  # let the launcher forward the traceback before the job is torn down
    MPI.COMM_WORLD.Abort(code)
