"""Run an app's ``main`` so that an exception on any rank ends the whole MPI job (no hang)."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

__all__ = ["run_main"]


def run_main(main: Callable[[], int]) -> None:
    """Collective over COMM_WORLD. Call ``main()`` and exit with its status.

    An exception on one rank prints its traceback with the rank and calls
    ``MPI_Abort`` (when more than one rank runs), so the other ranks never wait
    forever in a collective the failed rank will not reach.
    """
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
            world.Abort(1)
        sys.exit(1)
    sys.exit(code)
