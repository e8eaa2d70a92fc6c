#!/usr/bin/env bash
# The test suite: every test on 1 rank, then the MPI tests (-m mpi) on 2, 3, 4 and 6 ranks
# (oversubscribed). Each run has a hard timeout, so a deadlock fails the run. Prints the wall and
# CPU time of each leg as it ends and a table of them at the end.
#
# Usage: tests/run_all.sh                the suite: every file on 1, 2 and 4 ranks; on 6 ranks the
#                                        files of RANKS6_FILES below, on 3 ranks the others
#        tests/run_all.sh FILE... [ARGS]  those tests (pytest args) on 1 rank and on every count of
#                                        MPI_RANKS, whatever the lists say
# Environment: MPI_RANKS="2 4"   the MPI rank counts (default "2 3 4 6")
#              ALL_FILES=1       every file on every rank count (the full matrix: about 3 more minutes)
#              TEST_TIMES=FILE   also append "name<TAB>wall s<TAB>CPU s" per leg to FILE (tests/make_test.sh)
#              LEG_PREFIX=TEXT   put before each leg's name (tests/run_mpio.sh: "MPI-IO ")
set -euo pipefail
cd "$(dirname "$0")/.."

# What each rank count adds (grids: hpctp.testing.grid_shapes, through the conftest's grid1d,
# grid2d and grid3d fixtures), and so which files run there:
#   2 ranks  1x2, 2x1, 1x1x2 ...; a periodic neighbour that is both left and right.   Every file.
#   4 ranks  2x2 (both axes divided), 1x4, 1x2x2 ...; empty blocks of dims < 4.        Every file.
#   6 ranks  the only grids with two divided axes of different sizes (2x3, 3x2, 1x2x3, 3x1x2 ...),
#            where code that mixes up two axes, their sizes or their sub-communicators goes wrong;
#            and 1x6, 6x1, whose blocks of small dims are empty. The files of RANKS6_FILES, whose
#            code moves blocks along single grid axes or between layouts: redistribution, indexing,
#            joins, pads, rolls; SUMMA and tensor-parallel layers on one axis with tokens or data on
#            the other; FFT pencils; halo exchanges and the layers built on them (conv, pool,
#            upsample, neighbourhood attention); ring attention; gathered and scattered state
#            dicts; hyperslab IO and restarts on other grids.
#   3 ranks  an odd, prime count: 3x1, 1x3, 1x1x3; blocks of unequal sizes (8 over 3: 3, 3, 2).
#            Every file not in RANKS6_FILES (those meet axes of 3 ranks in 2x3, 3x2 ... on 6):
#            reductions and all-reduces over grid axes (statistics, norms, losses, gradient sync,
#            heads split over one axis), elementwise protocols, local layouts, comm, the C API, apps.
# A new file runs on 1, 2, 3 and 4 ranks until it is listed here. The files not listed would add about
# 2.5 minutes on 6 ranks (on 2 cores); ALL_FILES=1 runs every file on every count.
RANKS6_FILES=(
  tests/test_grid.py tests/test_disttensor.py tests/test_indexing.py tests/test_join.py
  tests/test_pad.py tests/test_remap.py tests/test_broadcast.py tests/test_differences.py
  tests/test_matmul.py tests/test_linear.py tests/test_fft.py tests/test_spectral.py tests/test_plan.py
  tests/test_halo.py tests/test_conv.py tests/test_pool.py tests/test_upsample.py
  tests/test_transformer.py tests/test_transformer_dist.py tests/test_context_parallel.py tests/test_state_dict.py
  tests/test_neighborhood_attention.py tests/test_patch.py tests/test_vit_surrogate.py tests/test_buffer_pool.py
  tests/test_io.py tests/test_io_dataset.py tests/test_checkpoint.py tests/test_device_blocks.py
  tests/test_torch_interop.py tests/test_train_parallel.py
  tests/test_sharded.py tests/test_sharded_checkpoint.py tests/test_navier_stokes.py
  tests/test_pipeline_parallel.py tests/test_pipeline_checkpoint.py tests/test_meta_init.py tests/test_sharded_meta.py
)

VENV=${VENV:-.venv}
PY=$VENV/bin/python
MPIEXEC=$VENV/bin/mpiexec
MPI_TIMEOUT=${MPI_TIMEOUT:-900}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
# MPICH: yield the core while polling, so 4 ranks on 2 cores do not spin against each other
export MPIR_CVAR_ENABLE_HEAVY_YIELD=${MPIR_CVAR_ENABLE_HEAVY_YIELD:-1}

source tests/cpu_time.sh  # children_cpu, cpu_now

leg_rows=()
suite_start=$(date +%s)
print_times() {
  local row
  echo "=== ${LEG_PREFIX:-}run_all.sh: seconds per leg ==="
  printf '  %-34s %5s %7s\n' leg wall CPU
  children_cpu
  for row in "${leg_rows[@]}" "total	$(($(date +%s) - suite_start))	$cpu_now"; do
    printf '%s\n' "$row" | awk -F'\t' '{ printf "  %-34s %5d %7d\n", $1, $2, $3 }'
  done
}
[ -n "${TEST_TIMES:-}" ] || trap print_times EXIT  # (with TEST_TIMES, the caller prints the table)

# leg NAME CMD...: run CMD, print and record its wall and CPU time; pytest's 5 (no test selected) is no failure
leg() {
  local name="${LEG_PREFIX:-}$1" start cpu rc=0 secs
  shift
  echo "=== ${name} ==="
  start=$(date +%s)
  children_cpu
  cpu=$cpu_now
  "$@" || rc=$?
  secs=$(($(date +%s) - start))
  children_cpu
  cpu=$((cpu_now - cpu))
  leg_rows+=("$name	$secs	$cpu")
  echo "=== leg ${name}: ${secs} s (CPU ${cpu} s) ==="
  [ -z "${TEST_TIMES:-}" ] || printf '%s\t%s\t%s\n' "$name" "$secs" "$cpu" >> "$TEST_TIMES"
  if [ "$rc" -eq 5 ]; then
    echo "(no tests selected)"
  elif [ "$rc" -ne 0 ]; then
    exit "$rc"
  fi
}

args=("$@")
leg "1 rank" timeout "$MPI_TIMEOUT" "$PY" -m pytest -q --with-mpi "${args[@]:-tests}"
for n in ${MPI_RANKS:-2 3 4 6}; do
  files=("${args[@]}")
  what=
  if [ ${#args[@]} -eq 0 ]; then
    files=(tests)
    if [ -z "${ALL_FILES:-}" ] && [ "$n" = 6 ]; then
      files=()
      for f in "${RANKS6_FILES[@]}"; do
        if [ -e "$f" ]; then files+=("$f"); else echo "run_all.sh: RANKS6_FILES names $f, which is gone" >&2; fi
      done
      what=" (RANKS6_FILES)"
    elif [ -z "${ALL_FILES:-}" ] && [ "$n" = 3 ]; then
      for f in "${RANKS6_FILES[@]}"; do
        files+=("--ignore=$f")
      done
      what=" (files not on 6)"
    fi
  fi
  [ ${#files[@]} -gt 0 ] || continue
  leg "$n ranks$what" timeout "$MPI_TIMEOUT" "$MPIEXEC" -n "$n" tests/rank0_stdout.sh \
    "$PY" -m pytest -q --with-mpi -m mpi "${files[@]}"
done
