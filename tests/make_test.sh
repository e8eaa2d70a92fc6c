#!/usr/bin/env bash
# What `make test` runs: the whole test suite, timed leg by leg.
#   1. .venv (make install) and the system packages (tests/system_deps.sh)
#   2. .venv-mpio is built in the background (tests/run_mpio.sh --build-only, at low priority; log in
#      build/test-logs/mpio-build.log) while the main suite runs: compiling h5py is one process, done
#      at nice 10 on the core time the tests leave idle (MPI ranks waiting in collectives)
#   3. the main suite (tests/run_all.sh): 1 rank (two xdist workers), 2, 3, 4 and 6 ranks
#   4. the MPI-IO leg (tests/run_mpio.sh): the IO tests with parallel HDF5, on 1, 2 and 4 ranks
#   5. the Slurm leg (tests/run_slurm.sh): jobs/ under a one-node Slurm started for it (as root; else skipped)
# Prints the wall and CPU time of each leg as it ends, and a table of them with the totals at the end
# (also when a leg fails); the table is also in build/test-times.txt. On a machine that other jobs
# share, CPU time tells what the suite costs: on 2 idle cores the MPI legs take about CPU / 2.
set -euo pipefail
cd "$(dirname "$0")/.."
export TEST_TIMES=build/test-times.txt
mkdir -p build/test-logs
: > "$TEST_TIMES"
start=$(date +%s)
build_pid=

source tests/cpu_time.sh  # children_cpu, cpu_now

summary() {
  local rc=$?
  if [ -n "$build_pid" ] && kill -0 "$build_pid" 2>/dev/null; then
    kill -- -"$build_pid" 2>/dev/null || kill "$build_pid" 2>/dev/null || true
    wait "$build_pid" 2>/dev/null || true
  fi
  children_cpu
  printf 'total\t%s\t%s\n' $(($(date +%s) - start)) "$cpu_now" >> "$TEST_TIMES"
  echo "=== make test: seconds per leg$([ "$rc" -eq 0 ] || echo "; FAILED with exit code $rc") ==="
  awk -F'\t' 'BEGIN { printf "  %-38s %5s %7s\n", "leg", "wall", "CPU" }
              { printf "  %-38s %5s %7s\n", $1, $2, $3 }' "$TEST_TIMES"
  exit "$rc"
}
trap summary EXIT

# timed NAME CMD...: run CMD in the foreground, record its wall and CPU time
timed() {
  local name=$1 t0 cpu rc=0
  shift
  echo "=== $name ==="
  t0=$(date +%s)
  children_cpu
  cpu=$cpu_now
  "$@" || rc=$?
  children_cpu
  printf '%s\t%s\t%s\n' "$name" $(($(date +%s) - t0)) $((cpu_now - cpu)) >> "$TEST_TIMES"
  echo "=== leg $name: $(($(date +%s) - t0)) s (CPU $((cpu_now - cpu)) s) ==="
  return "$rc"
}

timed "install .venv" "${MAKE:-make}" --no-print-directory install
timed "system packages" bash tests/system_deps.sh

build_log=build/test-logs/mpio-build.log
echo "=== building .venv-mpio in the background (log: $build_log) ==="
# in a session of its own (setsid), so that a failing leg can stop the whole build
launch=(nice -n 10)
! command -v setsid >/dev/null || launch=(setsid -w nice -n 10)
"${launch[@]}" bash tests/run_mpio.sh --build-only > "$build_log" 2>&1 &
build_pid=$!

bash tests/run_all.sh

rc=0
t0=$(date +%s)
wait "$build_pid" || rc=$?
build_pid=
# (its CPU time is the build's, in the line below)
printf '%s\t%s\t-\n' "wait for the .venv-mpio build" $(($(date +%s) - t0)) >> "$TEST_TIMES"
# its own line: "=== built .venv-mpio in N s (CPU M s) ===" (none when .venv-mpio was up to date)
sed -n 's/^=== built .* in \([0-9]*\) s (CPU \([0-9]*\) s) ===$/(.venv-mpio build, in the background)\t\1\t\2/p' \
  "$build_log" >> "$TEST_TIMES"
if [ "$rc" -ne 0 ]; then
  echo "make_test.sh: building .venv-mpio failed (exit $rc); the end of $build_log:" >&2
  tail -n 40 "$build_log" >&2
  exit "$rc"
fi
bash tests/run_mpio.sh
bash tests/run_slurm.sh
