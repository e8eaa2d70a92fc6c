#!/usr/bin/env bash
# The test suite: every test on 1 rank (two pytest-xdist workers, one per core), then the MPI tests
# (-m mpi) on 2, 3, 4 and 6 ranks (4 and 6 oversubscribed). Each run has a hard timeout, so a deadlock
# fails the run. Prints the wall and CPU time of each leg as it ends, the 25 slowest tests of each leg,
# and a table of the legs at the end.
#
# Usage: tests/run_all.sh                the suite: every file on 1 and 2 ranks; on 4 ranks the files of
#                                        RANKS4_FILES, on 6 ranks those of RANKS6_FILES, on 3 ranks the
#                                        files not in RANKS6_FILES (new files included)
#        tests/run_all.sh FILE... [ARGS]  those tests (pytest args) on 1 rank and on every count of
#                                        MPI_RANKS, whatever the lists say
# Environment: MPI_RANKS="2 4"   the MPI rank counts (default "2 3 4 6")
#              ALL_FILES=1       every file on every rank count (the full matrix: about 8 more minutes)
#              XDIST=0           the 1-rank leg in one process (default: 2 xdist workers, -n 2 --dist loadfile)
#              TEST_TIMES=FILE   also append "name<TAB>wall s<TAB>CPU s" per leg to FILE (tests/make_test.sh)
#              LEG_PREFIX=TEXT   put before each leg's name (tests/run_mpio.sh: "MPI-IO ")
set -euo pipefail
cd "$(dirname "$0")/.."

# What each rank count adds (grids: hpctp.testing.grid_shapes, through the conftest's grid1d,
# grid2d and grid3d fixtures), and so which files run there:
#   1 rank   every test, the not-mpi ones included (those that launch their own mpiexec jobs of 2 to 4
#            ranks run here only). Two xdist workers, one per core, whole files each (--dist loadfile:
#            a module-scoped fixture, such as a CMake build or a traced workload, is made once).
#   2 ranks  1x2, 2x1, 1x1x2 ...; a periodic neighbour that is both left and right.   Every file.
#   3 ranks  an odd, prime count: 3x1, 1x3, 1x1x3; blocks of unequal sizes (8 over 3: 3, 3, 2).
#            Every file not in RANKS6_FILES (those meet axes of 3 ranks in 2x3, 3x2 ... on 6):
#            reductions and all-reduces over grid axes (statistics, norms, losses, gradient sync,
#            heads split over one axis), elementwise protocols, local layouts, comm, the C API, apps;
#            a new file runs here (and on 1 and 2 ranks) until it is listed below.
#   6 ranks  the only grids with two divided axes of different sizes (2x3, 3x2, 1x2x3, 3x1x2 ...),
#            where code that mixes up two axes, their sizes or their sub-communicators goes wrong;
#            and 1x6, 6x1, whose blocks of small dims are empty. The files of RANKS6_FILES, whose
#            code moves blocks along single grid axes or between layouts: redistribution, indexing,
#            joins, pads, rolls; SUMMA and tensor-parallel layers on one axis with tokens or data on
#            the other; FFT pencils; halo exchanges and the layers built on them (conv, pool,
#            upsample, neighbourhood attention); ring attention; gathered and scattered state
#            dicts; hyperslab IO and restarts on other grids.
#   4 ranks  2x2 (both axes divided, of equal sizes), 1x4 and 4x1 (empty blocks of dims < 4), 1x2x2.
#            The files (or single tests, FILE::TEST) of RANKS4_FILES: (a) files not on 6 ranks whose code
#            reduces or moves data over two grid axes at once (grid2d/grid3d fixtures): 2x2 is the one
#            grid of their legs with two divided axes (sub-communicators of both, reductions over (0, 1));
#            (b) cases written for 4 ranks: pipeline x data grids of 2x2 (pipeline_parallel,
#            pipeline_checkpoint, pipeline_mismatch, train_parallel), ZeRO on 2x2 (sharded_checkpoint),
#            online training on 2 of 4 ranks,
#            the planner's plans of two divided axes checked against measured steps, FFT pencils that
#            move twice on 2x2; (c) halo exchanges, where on 2x2 every neighbour of a rank, diagonal
#            ones included, is one rank, and SUMMA on the square grids it is mostly run on. The other
#            RANKS6_FILES meet two divided axes on 6 ranks, and empty blocks on 1x6.
# ALL_FILES=1 runs every file on every count.
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
RANKS4_FILES=(
  # (a) not on 6 ranks; reductions and moves over two grid axes
  tests/test_apps.py tests/test_attention_heads.py tests/test_debug.py tests/test_histogram.py tests/test_ints.py
  tests/test_layer_norm.py tests/test_loss.py tests/test_nanfunctions.py tests/test_norm.py tests/test_numpy_api.py
  tests/test_parallel.py tests/test_quantiles.py tests/test_scan.py tests/test_search.py tests/test_statistics.py
  tests/test_torch_api.py tests/test_rollout.py::test_rollout_matches_single_process_torch
  tests/test_capi.py::test_infer_in_place_matches_numpy
  # (b) cases written for 4 ranks
  tests/test_pipeline_parallel.py tests/test_pipeline_checkpoint.py tests/test_pipeline_mismatch.py
  tests/test_train_parallel.py tests/test_sharded_checkpoint.py
  tests/test_online.py::test_same_loss_curve_on_any_trainer_ranks_and_placement
  tests/test_planner.py::test_predicted_messages_equal_commcounter[fno]
  tests/test_planner.py::test_predicted_messages_equal_commcounter[vit]
  tests/test_planner.py::test_predicted_state_equals_sharded_data_parallel
  tests/test_planner.py::test_predicted_peak_memory_is_within_15_percent_of_a_measured_step
  tests/test_fft.py::test_messages_are_one_alltoallv_per_move
  # (c) halos with one neighbour in every direction, SUMMA on a square grid
  tests/test_halo.py tests/test_matmul.py
  # (d) the virtual grid against the real one, on 2 and 4 ranks only (RANKS24_FILES)
  tests/test_virtual_grid.py tests/test_virtual_spatial.py tests/test_virtual_transformer.py tests/test_virtual_parallel.py
)
# Files on 1, 2 and 4 ranks only: each compares every layer's messages on a virtual grid with a real run, whose
# 3-rank grids (3x1, 1x3) add uneven cuts the layers' own files test on 3 and 6 ranks.
RANKS24_FILES=(
  tests/test_virtual_grid.py tests/test_virtual_spatial.py tests/test_virtual_transformer.py tests/test_virtual_parallel.py
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

# present_files NAME FILE[::TEST]...: sets files to those of the list whose file exists (a missing one is reported)
present_files() {
  local list=$1 f
  shift
  files=()
  for f in "$@"; do
    if [ -e "${f%%::*}" ]; then files+=("$f"); else echo "run_all.sh: $list names $f, which is gone" >&2; fi
  done
}

# the 1-rank leg on two xdist workers (whole files each), where pytest-xdist is installed
xdist=()
if [ "${XDIST:-1}" != 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
  xdist=(-n "${XDIST_WORKERS:-2}" --dist loadfile)
fi

args=("$@")
leg "1 rank" timeout "$MPI_TIMEOUT" "$PY" -m pytest -q --durations=25 --with-mpi "${xdist[@]}" "${args[@]:-tests}"
for n in ${MPI_RANKS:-2 3 4 6}; do
  files=("${args[@]}")
  what=
  if [ ${#args[@]} -eq 0 ]; then
    files=(tests)
    if [ -z "${ALL_FILES:-}" ] && [ "$n" = 6 ]; then
      present_files RANKS6_FILES "${RANKS6_FILES[@]}"
      what=" (RANKS6_FILES)"
    elif [ -z "${ALL_FILES:-}" ] && [ "$n" = 4 ]; then
      present_files RANKS4_FILES "${RANKS4_FILES[@]}"
      what=" (RANKS4_FILES)"
    elif [ -z "${ALL_FILES:-}" ] && [ "$n" = 3 ]; then
      for f in "${RANKS6_FILES[@]}" "${RANKS24_FILES[@]}"; do
        files+=("--ignore=$f")
      done
      what=" (files not on 6, nor RANKS24_FILES)"
    fi
  fi
  [ ${#files[@]} -gt 0 ] || continue
  leg "$n ranks$what" timeout "$MPI_TIMEOUT" "$MPIEXEC" -n "$n" tests/rank0_stdout.sh \
    "$PY" -m pytest -q --durations=25 --with-mpi -m mpi "${files[@]}"
done
