#!/usr/bin/env bash
# System packages the test suite uses besides the venv, installed with apt-get when missing and run
# as root on Debian/Ubuntu (elsewhere install them yourself; the tests that need them say so):
#   gfortran                       the Fortran module of libhpctp_c (tests/test_capi.py)
#   libhdf5-mpich-dev, pkg-config  parallel HDF5 (and MPICH) for the MPI-IO leg (tests/run_mpio.sh)
#   patchelf                       points mpi4py's binary wheel at Debian's MPICH (tests/run_mpio.sh)
#   libjemalloc2                   the memory-budget test of stage-3 sharding (tests/test_sharded_meta.py)
# Usage: tests/system_deps.sh [package ...]    (default: all of the above)
set -euo pipefail
pkgs=("$@")
[ ${#pkgs[@]} -gt 0 ] || pkgs=(gfortran libhdf5-mpich-dev pkg-config patchelf libjemalloc2)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -gt 0 ] || exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "system_deps.sh: not installing ${missing[*]} (needs root and apt-get); the tests that need them will say so" >&2
  exit 0
fi
echo "=== installing ${missing[*]} (Debian packages) ==="
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q "${missing[@]}" >/dev/null \
  || { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; }
