#!/usr/bin/env bash
# Fetch, on a machine with PyPI, the wheels benchmarks/gpu_check.sh installs on a GPU machine
# that has torch but no MPI and no network: MPICH (library + mpiexec), mpi4py and pytest-mpi,
# the versions constraints.txt and the CI environment use. They land in .whl/ (git-ignored),
# about 10 MiB. Usage: benchmarks/gpu_wheels.sh [python version of the GPU machine, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
PY=${PYTHON:-python3}
rm -rf .whl && mkdir -p .whl
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${plat[@]}" -d .whl "mpich==${MPICH_VERSION:-5.0.2}" "mpi4py==${MPI4PY_VERSION:-4.1.2}" "pytest-mpi==0.6"
ls -l .whl
