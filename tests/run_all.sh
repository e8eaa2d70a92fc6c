#!/usr/bin/env bash
# The whole test suite: every test on 1 rank, then the MPI tests (-m mpi) on 2, 3, 4 and 6
# ranks (oversubscribed). Each MPI run has a hard timeout, so a deadlock fails the run.
# Usage: tests/run_all.sh [pytest args, e.g. a test file]     (MPI_RANKS="2 4" to choose the rank counts)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$VENV/bin/python
MPIEXEC=$VENV/bin/mpiexec
MPI_TIMEOUT=${MPI_TIMEOUT:-900}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
# MPICH: yield the core while polling, so 4 ranks on 2 cores do not spin against each other
export MPIR_CVAR_ENABLE_HEAVY_YIELD=${MPIR_CVAR_ENABLE_HEAVY_YIELD:-1}
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests)

echo "=== 1 rank ==="
timeout "$MPI_TIMEOUT" "$PY" -m pytest -q --with-mpi "${args[@]}"
# 6: grids 2x3, 3x2, 6x1, 1x2x3 ... and blocks left empty by small dims
for n in ${MPI_RANKS:-2 3 4 6}; do
  echo "=== $n ranks ==="
  rc=0
  timeout "$MPI_TIMEOUT" "$MPIEXEC" -n "$n" tests/rank0_stdout.sh "$PY" -m pytest -q --with-mpi -m mpi "${args[@]}" || rc=$?
  if [ "$rc" -eq 5 ]; then  # pytest: no tests collected (a file without MPI tests)
    echo "(no MPI tests selected)"
  elif [ "$rc" -ne 0 ]; then
    exit "$rc"
  fi
done
