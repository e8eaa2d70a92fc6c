#!/usr/bin/env bash
# The Slurm leg of `make test`: the batch scripts of jobs/ under a real, one-node Slurm.
#   1. installs Debian's slurmctld, slurmd, slurm-client and munge when missing (root; tests/system_deps.sh)
#   2. writes a slurm.conf into a temporary directory (SLURM_CONF: a site's /etc/slurm is never read or
#      written), starts munged (as the munge user, with its own key and socket), slurmctld and slurmd
#   3. submits, all at once (the node shares its CPUs between the jobs, OverSubscribe=FORCE):
#      - a stage whose rank 1 dies while rank 0 waits for it: the job must end FAILED within 30 s
#        (srun --kill-on-bad-exit=1; without it rank 0 would wait until the time limit)
#      - jobs/slurm_pipeline.sh (simulate -> train -> evaluate, afterok) with apps/configs/tiny.toml on 2 tasks
#      - the same on 4 tasks, then its training resumed on 2 tasks (one more epoch) and evaluated again
#      - the simulation on 2 tasks launched by MPICH's mpiexec inside the job (MPI_LAUNCHER=mpiexec)
#   4. checks every stage's outputs and MPI size, that each evaluation's relative L2 error is finite and
#      below the persistence baseline, and that the resumed training continued from the saved step
#   5. stops the daemons by their process ids and removes the temporary directory (also on failure)
# Skips (exit 0, saying why) where it cannot run as root or the packages cannot be installed.
# With TEST_TIMES=FILE (tests/make_test.sh) appends "name<TAB>wall s<TAB>CPU s" to FILE; the CPU time
# counts the jobs' ranks too (they run under slurmd, not under this script).
# HPCTP_SLURM_CPUS: the CPUs the node declares (default: the machine's, at least 4, so that 4 tasks fit
# on a 2-core runner; slurmd accepts more than it finds with SlurmdParameters=config_overrides).
# HPCTP_SLURM_KEEP=1 keeps the temporary directory (job outputs, daemon logs) for a look afterwards.
# The same steps by hand, on a laptop or a CI runner: jobs/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
LEG="Slurm: jobs/ under sbatch (run_slurm)"
LEG_LIMIT=${HPCTP_SLURM_TIMEOUT:-240}  # seconds for the whole leg
t_start=$(date +%s)
echo "=== $LEG ==="

say() { echo "[run_slurm $(date +%T)] $*"; }
skip() {
  echo "=== Slurm leg SKIPPED: $* ==="
  [ -z "${TEST_TIMES:-}" ] || printf '%s\t%s\t%s\n' "$LEG (skipped)" $(($(date +%s) - t_start)) 0 >> "$TEST_TIMES"
  exit 0
}
fail() {
  echo "run_slurm.sh: FAILED: $*" >&2
  exit 1
}

[ "$(id -u)" = 0 ] || skip "it starts Slurm's daemons and munged, which needs root (run tests/run_slurm.sh as root)"
[ -x .venv/bin/python ] || fail "no .venv (make install)"
PKGS=(slurmctld slurmd slurm-client munge)
TOOLS=(slurmctld slurmd sbatch srun scontrol squeue scancel sinfo munged munge unmunge runuser)
have_tools() {
  local t
  for t in "${TOOLS[@]}"; do command -v "$t" >/dev/null || return 1; done
}
if ! have_tools; then
  bash tests/system_deps.sh "${PKGS[@]}" || true
  have_tools || skip "Slurm and munge are not installed and could not be (apt-get install ${PKGS[*]})"
fi
id munge >/dev/null 2>&1 || skip "no munge user (the munge package creates it)"

# ------------------------------------------------------------------ state, cleanup
T=$(mktemp -d "${TMPDIR:-/tmp}/hpctp-slurm.XXXXXX")
chmod 755 "$T"  # munged (the munge user) must reach its directory inside
mkdir -p "$T/state" "$T/spool" "$T/log" "$T/out" "$T/work" "$T/munge" "$T/pids"
: > "$T/cpu"
CTLD_PID="" SLURMD_PID="" MUNGED_PID=""
BG_PIDS=()
# MPICH names a node's shared memory /dev/shm/mpich_{shm,vci}_<FNV-1a hash of the PMI kvs name>_<node>,
# and under srun the kvs name is "<job id>.<step id>": a killed job leaves its segments behind, and a
# later job with the same ids attaches to them (MPI_Init fails, or ranks of two jobs mix). Job ids of a
# fresh cluster start at FirstJobId: a random one per run, and this cluster's segments are removed.
FIRST_JOB_ID=$(( (RANDOM << 15 | RANDOM) % 60000000 + 1000 ))

remove_mpich_segments() {
  [ -d /dev/shm ] || return 0
  .venv/bin/python - "$FIRST_JOB_ID" <<'EOF'
import os, sys

def fnv1a(text: str) -> str:
    h = 2166136261
    for b in text.encode():
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return f"{h:x}"

first = int(sys.argv[1])
ours = {fnv1a(f"{job}.{step}") for job in range(first, first + 100) for step in range(4)}
for name in os.listdir("/dev/shm"):
    parts = name.split("_")
    if len(parts) == 4 and parts[0] == "mpich" and parts[2] in ours:
        os.unlink(os.path.join("/dev/shm", name))
EOF
}

stop_pid() {  # stop_pid PID: TERM, then KILL after 10 s
  local pid=$1 _
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.2
  done
  kill -9 "$pid" 2>/dev/null || true
}

# cpu_seconds: this shell's reaped children (`times`) plus the jobs' ranks (from $T/cpu)
cpu_seconds() {
  local f
  f=$(mktemp)
  times > "$f"
  awk 'function s(t) { split(t, a, "m"); sub("s", "", a[2]); return a[1] * 60 + a[2] }
       FNR == NR && FNR == 2 { c += s($1) + s($2) }
       FNR != NR { c += s($1) + s($2) }
       END { printf "%d\n", c }' "$f" "$T/cpu"
  rm -f "$f"
}

cleanup() {
  local rc=$? pid _ secs cpu
  set +e
  trap - EXIT INT TERM
  for pid in "${BG_PIDS[@]}" $(cat "$T"/pids/* 2>/dev/null); do kill "$pid" 2>/dev/null; done
  if [ -n "$CTLD_PID" ] && kill -0 "$CTLD_PID" 2>/dev/null; then
    # shellcheck disable=SC2046
    scancel --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null  # this cluster's jobs only (SLURM_CONF)
    for _ in $(seq 30); do
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  if [ "$rc" != 0 ]; then
    echo "--- run_slurm.sh failed (exit $rc): the job outputs and the daemons' logs ---" >&2
    for f in "$T"/out/*.out "$T"/*.log "$T"/log/*.log "$T"/munge/*.log; do
      [ -f "$f" ] || continue
      echo "----- $f (last 30 lines)" >&2
      tail -n 30 "$f" >&2
    done
  fi
  stop_pid "$SLURMD_PID"
  stop_pid "$CTLD_PID"
  stop_pid "$MUNGED_PID"
  wait 2>/dev/null
  remove_mpich_segments
  secs=$(($(date +%s) - t_start))
  cpu=$(cpu_seconds)
  if [ "${HPCTP_SLURM_KEEP:-0}" = 1 ]; then echo "kept $T" >&2; else rm -rf "$T"; fi
  echo "=== leg $LEG: $secs s (CPU $cpu s)$([ "$rc" = 0 ] || echo "; FAILED") ==="
  [ -z "${TEST_TIMES:-}" ] || printf '%s\t%s\t%s\n' "$LEG" "$secs" "$cpu" >> "$TEST_TIMES"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------ munge: its own key and socket
MUNGE_SOCKET=$T/munge/munge.socket
chown munge: "$T/munge"
chmod 711 "$T/munge"
dd if=/dev/urandom of="$T/munge/munge.key" bs=1024 count=1 status=none
chown munge: "$T/munge/munge.key"
chmod 400 "$T/munge/munge.key"
runuser -u munge -- munged --socket="$MUNGE_SOCKET" --key-file="$T/munge/munge.key" \
  --pid-file="$T/munge/munged.pid" --log-file="$T/munge/munged.log" --seed-file="$T/munge/munged.seed"
for _ in $(seq 50); do
  [ -s "$T/munge/munged.pid" ] && [ -S "$MUNGE_SOCKET" ] && break
  sleep 0.1
done
MUNGED_PID=$(cat "$T/munge/munged.pid" 2>/dev/null || true)
munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET" >/dev/null || fail "munged does not answer on $MUNGE_SOCKET"

# ------------------------------------------------------------------ slurm.conf, the daemons
# nothing of an outer Slurm job or of the caller's job parameters leaks into this cluster's jobs
while read -r v; do unset "$v"; done < <(compgen -e | grep -E '^(SLURM_|SBATCH_|SRUN_|SALLOC_)' || true)
unset NP PPN RESUME STAGES AFTER WAIT STAGE_ARGS MPI_LAUNCHER MPI_FLAVOR MPIEXEC MPIEXEC_EXTRA DRY_RUN \
  HPCTP_ROOT HPCTP_VENV HPCTP_BIND_GPU DATA RUNDIR CONFIG PYTHON

free_port() {
  .venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
NODE=$(hostname -s)
CPUS=${HPCTP_SLURM_CPUS:-$(nproc)}
[ "$CPUS" -ge 4 ] || CPUS=4
export SLURM_CONF=$T/slurm.conf
cat > "$SLURM_CONF" <<EOF
# the one-node test cluster of tests/run_slurm.sh (see jobs/README.md)
ClusterName=hpctp-test
FirstJobId=$FIRST_JOB_ID
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldLogFile=$T/log/slurmctld.log
SlurmdLogFile=$T/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# no PMI by default: the job scripts choose one (srun --mpi=pmi2 for the venv's MPICH)
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
DependencyParameters=kill_invalid_depend
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=test Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
slurmctld -D > "$T/log/slurmctld.stderr.log" 2>&1 &
CTLD_PID=$!
slurmd -D > "$T/log/slurmd.stderr.log" 2>&1 &
SLURMD_PID=$!
for _ in $(seq 100); do
  case "$(sinfo -h -o %T 2>/dev/null)" in idle*) break ;; esac
  kill -0 "$CTLD_PID" 2>/dev/null && kill -0 "$SLURMD_PID" 2>/dev/null || fail "a Slurm daemon ended at start"
  sleep 0.2
done
[[ "$(sinfo -h -o %T 2>/dev/null)" == idle* ]] || fail "the node did not come up: $(sinfo 2>&1)"
say "one-node Slurm up ($NODE, $CPUS CPUs, $(srun --version)) in $(($(date +%s) - t_start)) s; state in $T"

# ------------------------------------------------------------------ the jobs
# What every job inherits (sbatch exports the environment): the tiny configuration, no GPUs; the PMI
# is left to the scripts' detection (MPICH -> srun --mpi=pmi2). PYTHON: the venv's, its CPU time logged.
cat > "$T/python" <<EOF
#!/bin/bash
"$ROOT/.venv/bin/python" "\$@"
rc=\$?
times >> "$T/cpu"
exit "\$rc"
EOF
# a stage made to fail on rank 1: that rank runs the simulation like rank 0 but dies (exit 3, as in a
# crash) where it should write the snapshots, while rank 0 waits for it there
cat > "$T/failing_python" <<EOF
#!/bin/sh
if [ "\${SLURM_PROCID:-0}" = 1 ]; then
  exec "$ROOT/.venv/bin/python" -c '
import os, runpy, sys
import apps.simulate.run
apps.simulate.run.save_snapshots = lambda *args, **kwargs: os._exit(3)
sys.argv = sys.argv[2:]  # -c -m MODULE ARGS...
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
' "\$@"
fi
exec "$T/python" "\$@"
EOF
chmod 755 "$T/python" "$T/failing_python"
export CONFIG=apps/configs/tiny.toml GPUS_PER_TASK=0 OMP_NUM_THREADS=1 PYTHON=$T/python HPCTP_WAIT_POLL=0.5
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1  # waiting MPICH ranks yield their core (more ranks than cores)
SBATCH_ARGS=(--nodes=1 --cpus-per-task=1 --time=10 --output="$T/out/%x-%j.out")

pipeline() {  # pipeline LOG WORK NTASKS [VAR=VALUE...]: jobs/slurm_pipeline.sh with WAIT=1, in the background
  local log=$1 work=$2 n=$3
  shift 3
  # shellcheck disable=SC2163  # (the arguments are VAR=VALUE)
  (export DATA=$T/work/$work/data.h5 RUNDIR=$T/work/$work/run WAIT=1 "$@"
   rc=0
   jobs/slurm_pipeline.sh "${SBATCH_ARGS[@]}" --ntasks-per-node="$n" > "$T/$log.log" 2>&1 &
   echo $! > "$T/pids/$log"
   wait $! || rc=$?
   date +%s > "$T/$log.end"
   echo "$rc" > "$T/$log.rc") &
  BG_PIDS+=($!)
}
t_fail=$(date +%s)
pipeline fail fail 2 STAGES=simulate PYTHON="$T/failing_python"
pipeline n2 n2 2
pipeline n4 n4 4
pipeline hydra hydra 2 STAGES=simulate MPI_LAUNCHER=mpiexec  # the fallback: MPICH's own launcher in the job
# the 4-task run's training resumed on 2 tasks once its evaluation is done, then evaluated again
for _ in $(seq 100); do
  grep -q '^submitted:' "$T/n4.log" 2>/dev/null && break
  sleep 0.1
done
eval4=$(sed -n 's/^submitted: .*evaluate \([0-9]*\).*/\1/p' "$T/n4.log")
[ -n "$eval4" ] || fail "jobs/slurm_pipeline.sh did not submit: $(cat "$T/n4.log")"
pipeline resume n4 2 STAGES="train evaluate" AFTER="$eval4" RESUME=1 STAGE_ARGS="--set train.epochs=3"
say "submitted: a stage with a failing rank, the pipelines on 2 and 4 tasks, the resume of the latter on 2 tasks," \
  "a stage launched by mpiexec"

# ------------------------------------------------------------------ checks
finished() {  # finished LOG: wait for that pipeline's verdict (within the leg's time), print its report
  while [ ! -e "$T/$1.rc" ]; do
    [ $(($(date +%s) - t_start)) -lt "$LEG_LIMIT" ] \
      || fail "out of time (${LEG_LIMIT} s) waiting for the jobs of $1; the queue: $(squeue 2>&1)"
    sleep 0.5
  done
  cat "$T/$1.log"
}

output_of() {  # output_of LOG STAGE: the output file of that stage's job
  local id
  id=$(sed -n "s/^$2 (job \([0-9]*\)).*/\1/p" "$T/$1.log" | tail -n 1)
  [ -n "$id" ] && [ -f "$T/out/hpctp-$2-$id.out" ] || fail "$1: no output of its $2 job"
  echo "$T/out/hpctp-$2-$id.out"
}

check_stage() {  # check_stage LOG STAGE NTASKS [LAUNCHER]: it ran to the end as one MPI job of NTASKS ranks
  local out launcher=${4:-srun .*--mpi=pmi2}
  out=$(output_of "$1" "$2")
  grep -q "$2: .*launcher: $launcher" "$out" || fail "$1: $2 was not launched with '$launcher' ($out)"
  grep -q "\[rank 0/$3\]" "$out" || fail "$1: $2 did not run as one MPI job of $3 ranks ($out)"
  grep -q "$2: done" "$out" || fail "$1: $2 did not finish ($out)"
}

check_eval() {  # check_eval LOG NTASKS: the evaluation's error is finite and below persistence
  local out line err base
  check_stage "$1" evaluate "$2"
  out=$(output_of "$1" evaluate)
  line=$(grep -o 'relative L2 error: .*' "$out" | tail -n 1)
  err=$(sed -n 's/^relative L2 error: \([^ ]*\) (persistence baseline \([^)]*\)).*/\1/p' <<< "$line")
  base=$(sed -n 's/^relative L2 error: \([^ ]*\) (persistence baseline \([^)]*\)).*/\2/p' <<< "$line")
  .venv/bin/python -c 'import math, sys; e, b = map(float, sys.argv[1:]); sys.exit(not (math.isfinite(e) and 0 <= e < b))' \
    "$err" "$base" 2>/dev/null || fail "$1: the surrogate's error '$err' is not finite and below persistence '$base' ($out)"
  say "OK: $1 on $2 tasks: $line"
}

finished fail
fail_s=$(($(cat "$T/fail.end") - t_fail))
fail_id=$(sed -n 's/^simulate (job \([0-9]*\)).*/\1/p' "$T/fail.log")
fail_state=$(scontrol show job -o "$fail_id" | tr ' ' '\n' | sed -n 's/^JobState=//p')
fail_out=$(output_of fail simulate)
[ "$(cat "$T/fail.rc")" != 0 ] || fail "jobs/slurm_pipeline.sh WAIT=1 did not report the failed stage"
[ "$fail_state" = FAILED ] || fail "the job with a failing rank ended ${fail_state:-?}, not FAILED"
[ "$fail_s" -lt 30 ] || fail "the job with a failing rank took $fail_s s to end (limit 30 s)"
grep -q "simulate: FAILED with exit code [1-9]" "$fail_out" || fail "$fail_out does not report the failed stage"
grep -q "task 1: Exited with exit code 3" "$fail_out" || fail "rank 1 did not fail as arranged ($fail_out)"
say "OK: a failing rank ends its job: $fail_state $fail_s s after submission ($(grep -o 'simulate: FAILED.*' "$fail_out"))"

for run in n2:2 n4:4; do
  name=${run%:*} n=${run#*:} dir=$T/work/${run%:*}
  finished "$name"
  [ "$(cat "$T/$name.rc")" = 0 ] || fail "$name: the pipeline on $n tasks failed"
  for f in "$dir/data.h5" "$dir/run/checkpoint.h5" "$dir/run/config.json" "$dir/run/history.csv" "$dir/run/eval.png"; do
    [ -s "$f" ] || fail "$name: $f is missing or empty"
  done
  check_stage "$name" simulate "$n"
  check_stage "$name" train "$n"
  check_eval "$name" "$n"
done

finished resume
[ "$(cat "$T/resume.rc")" = 0 ] || fail "resume: training the 4-task run further on 2 tasks failed"
check_stage resume train 2
resumed=$(grep -o 'resumed from .* at step [0-9]*' "$(output_of resume train)" | sed 's/.* at step //')
steps=$(wc -l < "$T/work/n4/run/history.csv")
# 2 epochs on 4 tasks, then a 3rd on 2 tasks: 3/2 as many steps in the history as in the checkpoint
[ -n "$resumed" ] && [ "$resumed" -gt 0 ] && [ $((2 * steps)) = $((3 * resumed)) ] \
  || fail "resume: did not continue from the 4-task checkpoint (resumed at step '$resumed', $steps steps in history.csv)"
say "OK: the 4-task run's training resumed on 2 tasks at step $resumed and ran to step $steps"
check_eval resume 2
finished hydra
[ "$(cat "$T/hydra.rc")" = 0 ] || fail "hydra: simulate with MPI_LAUNCHER=mpiexec failed"
check_stage hydra simulate 2 "$ROOT/.venv/bin/mpiexec -n 2"
[ -s "$T/work/hydra/data.h5" ] || fail "hydra: no data.h5"
say "OK: MPI_LAUNCHER=mpiexec: simulate ran as one MPI job of 2 ranks under MPICH's mpiexec"
say "Slurm leg passed"
