#!/usr/bin/env bash
# The parallel-HDF5 leg of the test suite: the IO tests again, in a second environment whose h5py
# is built against parallel HDF5, so the MPI-IO paths (driver="mpio"; method="mpio", and "auto" on
# more than one rank) run on 1, 2 and 4 ranks (MPI_RANKS="2 3 4" adds 3). The main .venv has PyPI's h5py,
# which has no MPI. 3 ranks' odd grids and unequal blocks meet the IO code in the main legs (per-rank POSIX
# reads, token-passing writes); here 4 ranks (2x2 grids, uneven blocks of the tests' odd sizes) cover the
# MPI-IO driver's hyperslabs, and Debian's MPICH 4.0.2 spins where ranks outnumber the cores (no heavy yield:
# a 3-rank leg costs about a minute).
#
# Parallel HDF5 comes from the system, as on a cluster (`module load hdf5/parallel`):
#   Debian/Ubuntu: libhdf5-mpich-dev (installed by tests/system_deps.sh when run as root), or set
#   HDF5_PKGCONFIG_NAME (pkg-config name) or HDF5_DIR, plus MPICC and MPIEXEC of the same MPI.
# .venv-mpio is built once; later runs reuse it (rebuilt when setup.cfg, constraints.txt or this
# script change):
#   mpi4py  PyPI's binary wheel, which loads the MPI library it finds at run time (MPICH's or Open
#           MPI's ABI). It is pointed at the library $MPICC links: lib/libmpi.so in the venv (the
#           first place mpi4py looks), and, where that library's name differs from the ABI's
#           (Debian's MPICH is libmpich.so.12, the wheel asks for libmpi.so.12), the wheel's
#           extension is relinked to it with patchelf. Without patchelf (or MPI4PY_FROM_SOURCE=1)
#           mpi4py is compiled instead (about 1.5 minutes of one core at -O1; its one large C
#           file needs many GB of memory at -O3).
#   h5py    compiled against that MPI and HDF5 (about 2.5 minutes of one core); the wheel is kept
#           outside the checkout, as pip keeps the wheels it builds ($MPIO_WHEELS, default
#           ~/.cache/hpctp/mpio-wheels/), keyed by the versions it was built against, so a rebuilt
#           .venv-mpio or a fresh clone on the same machine does not compile it again.
# Usage: tests/run_mpio.sh [pytest args]    (default: the IO test files)
#        tests/run_mpio.sh --build-only     build .venv-mpio and stop (tests/make_test.sh runs this
#                                           in the background while the main suite runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${MPIO_VENV:-.venv-mpio}
HDF5_PKGCONFIG_NAME=${HDF5_PKGCONFIG_NAME:-hdf5-mpich}
MPICC=${MPICC:-mpicc.mpich}
MPIEXEC=${MPIEXEC:-mpiexec.mpich}
H5PY_VERSION=${H5PY_VERSION:-3.16.*}
MPI4PY_VERSION=${MPI4PY_VERSION:-4.1.*}
MPI4PY_FROM_SOURCE=${MPI4PY_FROM_SOURCE:-}
export HDF5_PKGCONFIG_NAME

build_only=
if [ "${1:-}" = --build-only ]; then
  build_only=1
  shift
fi

have_parallel_hdf5() {
  if [ -n "${HDF5_DIR:-}" ]; then
    [ -f "$HDF5_DIR/include/H5FDmpio.h" ]
  else
    pkg-config --exists "$HDF5_PKGCONFIG_NAME" 2>/dev/null && command -v "$MPICC" >/dev/null
  fi
}

if ! have_parallel_hdf5; then
  bash tests/system_deps.sh libhdf5-mpich-dev pkg-config patchelf
  if ! have_parallel_hdf5; then
    echo "run_mpio.sh: no parallel HDF5 found (pkg-config $HDF5_PKGCONFIG_NAME, MPICC=$MPICC)." >&2
    echo "  Install libhdf5-mpich-dev (Debian/Ubuntu), or set HDF5_DIR or HDF5_PKGCONFIG_NAME," >&2
    echo "  MPICC and MPIEXEC for your site's parallel HDF5 and MPI." >&2
    exit 1
  fi
fi

# mpi_library: "SONAME PATH" of the MPI library that $MPICC links (Debian's MPICH: libmpich.so.12)
mpi_library() {
  local dir rc=0
  dir=$(mktemp -d)
  printf '#include <mpi.h>\nint main(int c, char **v) { MPI_Init(&c, &v); return MPI_Finalize(); }\n' > "$dir/t.c"
  "$MPICC" "$dir/t.c" -o "$dir/t" && LC_ALL=C ldd "$dir/t" | awk '$1 ~ /^libmpi/ && $3 ~ /^\// {print $1, $3; exit}' || rc=$?
  rm -rf "$dir"
  return "$rc"
}

# install_mpi4py_wheel PIP...: PyPI's mpi4py wheel, on the MPI library of $MPICC; false if it cannot be
# (no patchelf where the extension needs relinking), so that the caller compiles mpi4py instead
install_mpi4py_wheel() {
  local soname path abi ext needed
  read -r soname path < <(mpi_library) || return 1
  case "$soname" in
    libmpi.so.40*) abi=openmpi ;;
    *) abi=mpich ;;  # MPICH's ABI: MPICH, Intel MPI, MVAPICH, Cray MPICH (libmpi.so.12, libmpich.so.12)
  esac
  "$@" --only-binary mpi4py "mpi4py==$MPI4PY_VERSION" || return 1
  ext=$(ls "$VENV"/lib/python3*/site-packages/mpi4py/MPI."$abi".*.so) || return 1
  needed=$(LC_ALL=C readelf -d "$ext" | sed -n 's/.*(NEEDED).*\[\(libmpi\.so[^]]*\)\].*/\1/p')
  if [ -n "$needed" ] && [ "$needed" != "$soname" ]; then
    command -v patchelf >/dev/null || return 1
    patchelf --replace-needed "$needed" "$soname" "$ext" || return 1
  fi
  ln -sf "$path" "$VENV/lib/libmpi.so" || return 1  # mpi4py's first guess: it reads the ABI off this library
  echo "mpi4py wheel on $path ($abi ABI)"
}

source tests/cpu_time.sh  # children_cpu, cpu_now

case "$VENV" in ""|/|.|..) echo "run_mpio.sh: refusing MPIO_VENV=$VENV" >&2; exit 1 ;; esac
stamp=$VENV/.installed-mpio
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
  echo "=== building $VENV: mpi4py + h5py against $MPICC and parallel HDF5 ==="
  build_start=$(date +%s)
  children_cpu
  build_cpu=$cpu_now
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install -q -c constraints.txt)
  "${pip[@]}" --upgrade pip
  if [ -n "$MPI4PY_FROM_SOURCE" ] || ! install_mpi4py_wheel "${pip[@]}"; then
    echo "compiling mpi4py (MPI4PY_FROM_SOURCE=$MPI4PY_FROM_SOURCE; patchelf: $(command -v patchelf || echo none))"
    MPICC=$MPICC CFLAGS="-O1" "${pip[@]}" --force-reinstall --no-binary mpi4py --no-cache-dir "mpi4py==$MPI4PY_VERSION"
    rm -f "$VENV/lib/libmpi.so"
  fi
  "${pip[@]}" numpy "Cython>=3" pkgconfig "setuptools>=77" wheel
  # the h5py wheel, compiled once per set of versions it depends on
  key=$("$VENV/bin/python" -c 'import sys, mpi4py; print(f"py{sys.version_info[0]}{sys.version_info[1]}-mpi4py{mpi4py.__version__}")')
  if [ -n "${HDF5_DIR:-}" ]; then hdf5=${HDF5_DIR//\//_}; else hdf5=$(pkg-config --modversion "$HDF5_PKGCONFIG_NAME"); fi
  key="h5py${H5PY_VERSION//\*/x}-$key-hdf5-$hdf5-$(basename "$MPICC")"
  wheels=${MPIO_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/hpctp/mpio-wheels}/$key
  if ! ls "$wheels"/h5py-*.whl >/dev/null 2>&1; then
    echo "compiling h5py into $wheels"
    rm -rf "$wheels.tmp"
    # no build isolation: h5py's isolated build would compile another (old) mpi4py
    CC=$MPICC HDF5_MPI=ON "$VENV/bin/python" -m pip wheel -q -c constraints.txt --no-deps --no-build-isolation \
      --no-binary h5py --no-cache-dir -w "$wheels.tmp" "h5py==$H5PY_VERSION"
    mkdir -p "$(dirname "$wheels")"
    mv "$wheels.tmp" "$wheels"
  fi
  "${pip[@]}" --no-deps "$wheels"/h5py-*.whl
  "${pip[@]}" -e ".[test]"   # no [mpich] extra: the system MPI, not the mpich wheel
  touch "$stamp"
  children_cpu
  echo "=== built $VENV in $(($(date +%s) - build_start)) s (CPU $((cpu_now - build_cpu)) s) ==="
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
maps = {line.split()[-1] for line in open("/proc/self/maps") if "libmpi" in line}
if len(maps) > 1:
    raise SystemExit(f"two MPI libraries in one process: {sorted(maps)}; delete {__import__('sys').prefix} and rerun")
print(f"h5py {h5py.__version__} (HDF5 {h5py.version.hdf5_version}, parallel) with {lib.strip()}")
EOF
[ -z "$build_only" ] || exit 0

args=("$@")
# the IO files, and the device-block tests that write and read HDF5 (the others run no IO)
[ ${#args[@]} -gt 0 ] || args=(tests/test_io.py tests/test_io_dataset.py tests/test_checkpoint.py tests/test_sharded_checkpoint.py
  tests/test_device_blocks.py::test_hdf5_keeps_device_blocks tests/test_device_blocks.py::test_checkpoint_of_a_model_on_the_device)
VENV=$VENV MPI_RANKS=${MPI_RANKS:-2 4} LEG_PREFIX="MPI-IO " bash tests/run_all.sh "${args[@]}"  # (6 ranks of MPI-IO: 4 more minutes)
