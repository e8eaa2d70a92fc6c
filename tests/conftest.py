"""Multi-rank pytest harness.

* One test command runs the suite on 1 rank and (``-m mpi``) on 2, 3, 4 and 6 ranks.
* Fixtures ``grid1d``/``grid2d``/``grid3d`` are parametrised with every grid shape of the
  current communicator size, so each run covers all its grids without skips.
* Collective assertions (``hpctp.testing``) fail on all ranks together. Any other
  exception escaping a test on a multi-rank run aborts the whole job (no hang).
* Only rank 0's stdout is shown (tests/rank0_stdout.sh); every rank's stderr is.
* pytest-timeout dumps stacks and exits a rank stuck past the timeout; mpiexec then ends the rest.
* The 1-rank leg runs on two pytest-xdist workers, whole files each (``-n 2 --dist loadfile``,
  tests/run_all.sh), each worker an MPI singleton; a module-scoped fixture (a CMake build, a traced
  workload) is made once.
"""

from __future__ import annotations

import os
import sys
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpctp.testing import CollectiveAssertionError, grid_shapes  # noqa: E402

WORLD = MPI.COMM_WORLD


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    size = WORLD.Get_size()
    for name, ndim in (("grid1d", 1), ("grid2d", 2), ("grid3d", 3)):
        if name in metafunc.fixturenames:
            dims = grid_shapes(size, ndim)
            metafunc.parametrize(name, dims, ids=["x".join(map(str, d)) for d in dims], indirect=True)


def _grid(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    import hpctp

    g = hpctp.ProcessGrid(request.param)
    yield g
    g.free()


grid1d = pytest.fixture(_grid, name="grid1d")
grid2d = pytest.fixture(_grid, name="grid2d")
grid3d = pytest.fixture(_grid, name="grid3d")


@pytest.fixture
def world() -> MPI.Intracomm:
    return WORLD


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):  # type: ignore[no-untyped-def]
    try:
        return (yield)
    except CollectiveAssertionError:
        raise
    except BaseException as e:
        if WORLD.Get_size() > 1 and not isinstance(e, (pytest.skip.Exception, KeyboardInterrupt)):
            sys.stderr.write(
                f"\n[rank {WORLD.Get_rank()}] {item.nodeid} raised on this rank only; aborting all ranks\n"
            )
            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
            WORLD.Abort(1)
        raise
