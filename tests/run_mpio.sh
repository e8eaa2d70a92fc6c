#!/usr/bin/env bash
# The parallel-HDF5 leg of the test suite: the IO tests again, in a second environment whose h5py
# is built against parallel HDF5, so the MPI-IO paths (driver="mpio"; method="mpio", and "auto" on
# more than one rank) run on 1, 2, 3 and 4 ranks. The main .venv has PyPI's h5py, which has no MPI.
#
# Parallel HDF5 comes from the system, as on a cluster (`module load hdf5/parallel`):
#   Debian/Ubuntu: libhdf5-mpich-dev (installed by tests/system_deps.sh when run as root), or set
#   HDF5_PKGCONFIG_NAME (pkg-config name) or HDF5_DIR, plus MPICC and MPIEXEC of the same MPI.
# mpi4py and h5py are compiled against that MPI and HDF5 (about 5 minutes on 2 cores) into
# .venv-mpio, once; later runs reuse it. mpi4py is built at -O1: its one large C file needs a few
# minutes and under 1 GB of memory that way (at -O3, many GB).
# Usage: tests/run_mpio.sh [pytest args]    (default: the IO test files)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${MPIO_VENV:-.venv-mpio}
HDF5_PKGCONFIG_NAME=${HDF5_PKGCONFIG_NAME:-hdf5-mpich}
MPICC=${MPICC:-mpicc.mpich}
MPIEXEC=${MPIEXEC:-mpiexec.mpich}
H5PY_VERSION=${H5PY_VERSION:-3.16.*}
MPI4PY_VERSION=${MPI4PY_VERSION:-4.1.*}
export HDF5_PKGCONFIG_NAME

have_parallel_hdf5() {
  if [ -n "${HDF5_DIR:-}" ]; then
    [ -f "$HDF5_DIR/include/H5FDmpio.h" ]
  else
    pkg-config --exists "$HDF5_PKGCONFIG_NAME" 2>/dev/null && command -v "$MPICC" >/dev/null
  fi
}

if ! have_parallel_hdf5; then
  bash tests/system_deps.sh libhdf5-mpich-dev pkg-config
  if ! have_parallel_hdf5; then
    echo "run_mpio.sh: no parallel HDF5 found (pkg-config $HDF5_PKGCONFIG_NAME, MPICC=$MPICC)." >&2
    echo "  Install libhdf5-mpich-dev (Debian/Ubuntu), or set HDF5_DIR or HDF5_PKGCONFIG_NAME," >&2
    echo "  MPICC and MPIEXEC for your site's parallel HDF5 and MPI." >&2
    exit 1
  fi
fi

case "$VENV" in ""|/|.|..) echo "run_mpio.sh: refusing MPIO_VENV=$VENV" >&2; exit 1 ;; esac
stamp=$VENV/.installed-mpio
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
  echo "=== building $VENV: mpi4py + h5py against $MPICC and parallel HDF5 ==="
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install -q -c constraints.txt)
  "${pip[@]}" --upgrade pip
  MPICC=$MPICC CFLAGS="-O1" "${pip[@]}" --no-binary mpi4py --no-cache-dir "mpi4py==$MPI4PY_VERSION"
  "${pip[@]}" numpy "Cython>=3" pkgconfig "setuptools>=77" wheel
  # no build isolation: h5py's isolated build would compile another (old) mpi4py
  CC=$MPICC HDF5_MPI=ON "${pip[@]}" --no-build-isolation --no-binary h5py --no-cache-dir "h5py==$H5PY_VERSION"
  "${pip[@]}" -e ".[test]"   # no [mpich] extra: the system MPI, not the mpich wheel
  touch "$stamp"
fi
# tests and tools find mpiexec next to the interpreter, as in .venv (a wrapper: hydra looks for
# its proxy next to the mpiexec it was started as)
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v "$MPIEXEC")" > "$VENV/bin/mpiexec"
chmod +x "$VENV/bin/mpiexec"

"$VENV/bin/python" - <<'EOF'
import h5py
from mpi4py import MPI
lib = MPI.Get_library_version().splitlines()[0]
if not h5py.get_config().mpi:
    raise SystemExit(f"h5py {h5py.__version__} in this environment has no MPI; delete it and rerun")
print(f"h5py {h5py.__version__} (HDF5 {h5py.version.hdf5_version}, parallel) with {lib.strip()}")
EOF

args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests/test_io.py tests/test_io_dataset.py tests/test_checkpoint.py tests/test_device_blocks.py)
VENV=$VENV MPI_RANKS=${MPI_RANKS:-2 3 4} bash tests/run_all.sh "${args[@]}"  # (6 ranks of MPI-IO: 4 more minutes)
