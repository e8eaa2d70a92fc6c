# shellcheck shell=bash
# Sourced by every job script in jobs/ after it has found HPCTP_ROOT (the repository root).
# Sets the environment of an hpctp job and defines:
#   hpctp_stage_cmd STAGE          HPCTP_CMD=( python -m apps... ) for simulate | train | evaluate
#   hpctp_online_cmd               HPCTP_CMD=( python -m apps.simulate --train-online ... ) (online training)
#   hpctp_mpiexec_args NP PPN [HOSTFILE]   MPIEXEC_ARGS=( ... ) for Open MPI / MPICH / Cray PALS
#   hpctp_run CMD...               run CMD, or with DRY_RUN=1 print it (one line, shell-quoted)
#   hpctp_submit CMD...            run a job-submission CMD (its stdout: the job id); DRY_RUN=1 prints
#                                  CMD to stderr and answers a fake id
#   hpctp_prepare_dirs             create the directories of DATA and RUNDIR (not in a dry run)
#   hpctp_slurm_launch             LAUNCH=( srun ... ) for a stage inside a Slurm job (see below)
#   hpctp_stage_failed STAGE RC    report that STAGE failed with exit code RC, and exit with it
#   hpctp_slurm_wait NAME:ID...    wait for Slurm jobs to end, report each one's state and exit code
#
# Parameters (environment variables, with defaults):
#   CONFIG=apps/configs/default.toml   DATA=out/data.h5   RUNDIR=out/run
#   RESUME=auto (train: add --resume when RUNDIR/checkpoint.h5 exists; 1: always; 0: never)
#   PYTHON (default: .venv/bin/python in the repository, else python3), HPCTP_VENV (a venv to activate)
#   MPIEXEC (default: .venv/bin/mpiexec when present, else mpiexec), MPI_FLAVOR=openmpi|mpich|pals
#   MPIEXEC_EXTRA (extra launcher flags), DRY_RUN=1 (print the commands instead of running them)
#   STAGE_ARGS (extra arguments of the stage command, split on blanks: STAGE_ARGS="--set train.epochs=3")
#   GPUS_PER_TASK: 0 on nodes without GPUs (jobs/slurm_pipeline.sh then submits with --gpus-per-task=0,
#     which replaces the headers' --gpus-per-task=1; bind_gpu.sh leaves CUDA_VISIBLE_DEVICES alone)
# Slurm only (hpctp_slurm_launch):
#   MPI_LAUNCHER=srun (default) | mpiexec ($MPIEXEC -n NP inside the allocation, for an MPI that
#     cannot use any PMI of this Slurm)
#   SRUN_MPI=auto (default: the site's MpiDefault when it is not `none`, else pmi2 for MPICH-family
#     libraries and pmix for Open MPI when srun lists them) | site (pass no --mpi) | a plugin (pmi2, pmix...)
#   SRUN_CPU_BIND=cores (srun --cpu-bind=...; empty: no flag)

: "${HPCTP_ROOT:?HPCTP_ROOT must be set before sourcing jobs/common.sh}"
cd "$HPCTP_ROOT"
export HPCTP_ROOT

if [ -n "${HPCTP_VENV:-}" ]; then
  # shellcheck disable=SC1091
  . "$HPCTP_VENV/bin/activate"
fi
if [ -z "${PYTHON:-}" ]; then
  if [ -n "${HPCTP_VENV:-}" ]; then PYTHON=$HPCTP_VENV/bin/python
  elif [ -x "$HPCTP_ROOT/.venv/bin/python" ]; then PYTHON=$HPCTP_ROOT/.venv/bin/python
  else PYTHON=python3
  fi
fi
if [ -z "${MPIEXEC:-}" ]; then
  if [ -x "$HPCTP_ROOT/.venv/bin/mpiexec" ]; then MPIEXEC=$HPCTP_ROOT/.venv/bin/mpiexec; else MPIEXEC=mpiexec; fi
fi
CONFIG=${CONFIG:-apps/configs/default.toml}
DATA=${DATA:-out/data.h5}
RUNDIR=${RUNDIR:-out/run}
RESUME=${RESUME:-auto}
DRY_RUN=${DRY_RUN:-0}
HPCTP_JOBS=$HPCTP_ROOT/jobs
BIND_GPU=$HPCTP_JOBS/bind_gpu.sh

# No GPUs asked for (GPUS_PER_TASK=0, or a Slurm job submitted with --gpus-per-task=0): no GPU binding.
GPUS_PER_TASK=${GPUS_PER_TASK:-${SLURM_GPUS_PER_TASK:-}}
if [ "$GPUS_PER_TASK" = 0 ]; then export HPCTP_BIND_GPU=${HPCTP_BIND_GPU:-0}; fi

# One thread pool per rank, sized to the cores the scheduler gave each task.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-${OMP_THREADS_PER_RANK:-1}}}
export PYTHONUNBUFFERED=1

# ------------------------------------------------------------------ CUDA-aware MPI
# hpctp passes GPU buffers straight to MPI when the library is CUDA-aware, and otherwise stages them
# through pinned host memory (always correct). Detection: HPCTP_CUDA_AWARE=0/1 overrides; then the
# library's MPIX_Query_cuda_support; then the variables below. Uncomment what fits your machine:
#
# Cray MPICH (Perlmutter, Polaris, Alps; also needs the craype-accel-* module at build time):
#   export MPICH_GPU_SUPPORT_ENABLED=1
# MPICH built with CUDA (ch4:ofi or ch4:ucx):
#   export MPIR_CVAR_ENABLE_GPU=1
# Open MPI built with CUDA (UCX pml; smcuda for Open MPI < 5):
#   export OMPI_MCA_opal_cuda_support=1
#   export OMPI_MCA_pml=ucx
#   export UCX_TLS=rc,sm,cuda_copy,cuda_ipc,gdr_copy   # GPUDirect RDMA when gdrcopy is installed
#   export UCX_RNDV_THRESH=8192                        # large messages: rendezvous, zero-copy
#   export UCX_MEMTYPE_CACHE=n                         # safer with the CUDA caching allocator of torch
# Force hpctp's choice (1: hand device pointers to MPI; 0: always stage through the host):
#   export HPCTP_CUDA_AWARE=1
if [ -n "${HPCTP_CUDA_AWARE:-}" ]; then export HPCTP_CUDA_AWARE; fi

# ------------------------------------------------------------------ a hang or a slow step (hpctp.debug)
# Set in the submitting shell (or uncomment); every rank gets them (Open MPI: through -x, below).
#   export HPCTP_WATCHDOG=600          # a rank waiting 600 s in one MPI call: every rank dumps, the job ends
#                                      # with a report of where the ranks diverge (HPCTP_TRACE_DIR/job-*/report.txt)
#   export HPCTP_TRACE=2000            # flight recorder: each rank's last 2000 MPI calls, dumped at exit;
#                                      # then `hpctp trace summarize HPCTP_TRACE_DIR` names the stragglers
#   export HPCTP_CHECK=1               # compare every collective's operation, size, dtype and root first (debug runs)
#   export HPCTP_TRACE_DIR=$RUNDIR/trace   # default ./hpctp-trace; on a file system every node sees
HPCTP_DEBUG_VARS=(HPCTP_TRACE HPCTP_WATCHDOG HPCTP_CHECK HPCTP_TRACE_DIR)
for _v in "${HPCTP_DEBUG_VARS[@]}"; do
  if [ -n "${!_v:-}" ]; then export "${_v?}"; fi
done

hpctp_run() {
  if [ "$DRY_RUN" = 1 ]; then
    local out="" a
    for a in "$@"; do out+="$(printf '%q' "$a") "; done
    printf '%s\n' "${out% }"
  else
    "$@"
  fi
}

hpctp_submit() {
  if [ "$DRY_RUN" = 1 ]; then
    hpctp_run "$@" >&2
    echo "DRYRUN-$RANDOM"
  else
    "$@"
  fi
}

hpctp_prepare_dirs() {
  if [ "$DRY_RUN" != 1 ]; then mkdir -p "$(dirname "$DATA")" "$RUNDIR"; fi
}

hpctp_stage_cmd() {
  case "${1:-}" in
    simulate)
      HPCTP_CMD=("$PYTHON" -m apps.simulate --config "$CONFIG" --out "$DATA") ;;
    train)
      HPCTP_CMD=("$PYTHON" -m apps.surrogate train --config "$CONFIG" --data "$DATA" --out "$RUNDIR")
      if [ "$RESUME" = 1 ] || { [ "$RESUME" = auto ] && [ -f "$RUNDIR/checkpoint.h5" ]; }; then
        HPCTP_CMD+=(--resume)
      fi ;;
    evaluate)
      HPCTP_CMD=("$PYTHON" -m apps.surrogate evaluate --config "$CONFIG" --data "$DATA" --checkpoint "$RUNDIR/checkpoint.h5") ;;
    *)
      echo "hpctp_stage_cmd: unknown stage '${1:-}' (simulate, train or evaluate)" >&2
      return 2 ;;
  esac
  if [ -n "${STAGE_ARGS:-}" ]; then
    local extra
    read -r -a extra <<< "$STAGE_ARGS"
    HPCTP_CMD+=("${extra[@]}")
  fi
}

# hpctp_online_cmd: HPCTP_CMD=( python -m apps.simulate --train-online ... ) from PLACEMENT, TRAINERS,
# MAX_WAIT, CONFIG, RUNDIR and STAGE_ARGS (jobs/mpirun_online.sh, jobs/slurm_online.sbatch)
hpctp_online_cmd() {
  HPCTP_CMD=("$PYTHON" -m apps.simulate --config "$CONFIG" --train-online --set "train.out=$RUNDIR"
             --set "online.placement=${PLACEMENT:-separate}")
  if [ "${PLACEMENT:-separate}" = separate ]; then HPCTP_CMD+=(--set "online.trainer_ranks=${TRAINERS:-0}"); fi
  if [ -n "${MAX_WAIT:-}" ]; then HPCTP_CMD+=(--set "online.max_wait=$MAX_WAIT"); fi
  if [ -n "${STAGE_ARGS:-}" ]; then
    local extra
    read -r -a extra <<< "$STAGE_ARGS"
    HPCTP_CMD+=("${extra[@]}")
  fi
}

# hpctp_mpi_flavor: HPCTP_MPI_FLAVOR=openmpi|mpich|pals, from MPI_FLAVOR or `$MPIEXEC --version`
hpctp_mpi_flavor() {
  local version
  HPCTP_MPI_FLAVOR=${MPI_FLAVOR:-}
  if [ -z "$HPCTP_MPI_FLAVOR" ]; then
    version=$("$MPIEXEC" --version 2>&1 | head -n 5 || true)
    case "$version" in
      *"Open MPI"* | *OpenRTE* | *PRRTE* | *prterun*) HPCTP_MPI_FLAVOR=openmpi ;;
      *PALS* | *pals*) HPCTP_MPI_FLAVOR=pals ;;
      *) HPCTP_MPI_FLAVOR=mpich ;;  # MPICH hydra, Intel MPI, MVAPICH
    esac
  fi
}

hpctp_mpiexec_args() {
  local np=$1 ppn=$2 hostfile=${3:-} flavor
  hpctp_mpi_flavor
  flavor=$HPCTP_MPI_FLAVOR
  case "$flavor" in
    openmpi)
      MPIEXEC_ARGS=(-n "$np" --map-by "ppr:$ppn:node" --bind-to core)
      if [ -n "$hostfile" ]; then MPIEXEC_ARGS+=(--hostfile "$hostfile"); fi
      local v  # (Open MPI passes no variable to other nodes unless told; hydra, PALS and srun pass them all)
      for v in "${HPCTP_DEBUG_VARS[@]}"; do
        if [ -n "${!v:-}" ]; then MPIEXEC_ARGS+=(-x "$v"); fi
      done ;;
    pals)  # Cray PALS (PBS on HPE/Cray systems): spread each rank's cores with --depth
      MPIEXEC_ARGS=(-n "$np" --ppn "$ppn" --depth "${OMP_NUM_THREADS:-1}" --cpu-bind depth)
      if [ -n "$hostfile" ]; then MPIEXEC_ARGS+=(--hostfile "$hostfile"); fi ;;
    mpich)
      MPIEXEC_ARGS=(-n "$np" -ppn "$ppn")
      if [ -n "$hostfile" ]; then MPIEXEC_ARGS+=(-f "$hostfile"); fi ;;
    *)
      echo "hpctp_mpiexec_args: unknown MPI_FLAVOR '$flavor' (openmpi, mpich or pals)" >&2
      return 2 ;;
  esac
  if [ -n "${MPIEXEC_EXTRA:-}" ]; then
    local extra
    read -r -a extra <<< "$MPIEXEC_EXTRA"
    MPIEXEC_ARGS+=("${extra[@]}")
  fi
}

hpctp_log() { echo "[hpctp job $(date '+%F %T')] $*" >&2; }

# hpctp_slurm_launch: LAUNCH=( the launcher of a stage inside a Slurm allocation ), by default
#   srun --kill-on-bad-exit=1 [--cpu-bind=cores] [--mpi=PLUGIN] [--ntasks=NP]
# --kill-on-bad-exit=1: a rank that fails ends the whole step at once (the others would wait for it
# in their next collective until the time limit). The PMI plugin: SRUN_MPI above. MPI_LAUNCHER=mpiexec:
# $MPIEXEC -n NP (MPICH's hydra launches through Slurm by itself; it also ends all ranks when one fails).
hpctp_slurm_launch() {
  local mpi=${SRUN_MPI:-auto} site types
  case "${MPI_LAUNCHER:-srun}" in
    srun) ;;
    mpiexec)
      LAUNCH=("$MPIEXEC" -n "${NP:-${SLURM_NTASKS:-1}}")
      if [ -n "${MPIEXEC_EXTRA:-}" ]; then
        local extra
        read -r -a extra <<< "$MPIEXEC_EXTRA"
        LAUNCH+=("${extra[@]}")
      fi
      return 0 ;;
    *)
      echo "hpctp_slurm_launch: unknown MPI_LAUNCHER '$MPI_LAUNCHER' (srun or mpiexec)" >&2
      return 2 ;;
  esac
  if [ "$mpi" = auto ]; then
    mpi=site
    site=$(scontrol show config 2>/dev/null | awk -F'= *' '/^MpiDefault / { print $2 }' || true)
    if [ -z "$site" ] || [ "$site" = none ]; then  # the site sets no PMI: choose one for the library
      types=$(srun --mpi=list 2>&1 || true)
      hpctp_mpi_flavor
      case "$HPCTP_MPI_FLAVOR" in
        mpich) if grep -qw pmi2 <<< "$types"; then mpi=pmi2; fi ;;
        openmpi) if grep -qw pmix <<< "$types"; then mpi=pmix; fi ;;
      esac
    fi
  fi
  LAUNCH=(srun --kill-on-bad-exit=1)
  if [ -n "${SRUN_CPU_BIND-cores}" ]; then LAUNCH+=("--cpu-bind=${SRUN_CPU_BIND-cores}"); fi
  if [ "$mpi" != site ]; then LAUNCH+=("--mpi=$mpi"); fi
  if [ -n "${NP:-}" ]; then LAUNCH+=("--ntasks=$NP"); fi  # default: every task of the allocation
}

hpctp_stage_failed() {
  local why=""
  if [ "$2" -gt 128 ] 2>/dev/null; then  # srun ended the ranks (a rank failed, or the time limit)
    why=" (signal $(($2 - 128)): the ranks were stopped; the launcher's lines above name the rank that failed)"
  fi
  hpctp_log "$1: FAILED with exit code $2$why"
  exit "$2"
}

# _hpctp_job_field ID FIELD: FIELD=value of `scontrol show job ID` (empty once Slurm forgot the job)
_hpctp_job_field() {
  scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n 1
}

# hpctp_slurm_wait NAME:ID ...: wait until every job has ended, then print one line per job:
#   NAME (job ID): COMPLETED | STATE, exit code N[, signal S] | not run or stopped (CANCELLED, REASON)
# Returns 0 when every job COMPLETED, else the exit code of the first failed job (1 when it has none).
# A job whose dependency can never be met (an earlier stage failed) is cancelled, not left pending.
hpctp_slurm_wait() {
  local item id state reason code rc=0 pending
  while :; do
    pending=0
    for item in "$@"; do
      id=${item##*:}
      state=$(_hpctp_job_field "$id" JobState)
      case "$state" in
        PENDING)
          if [ "$(_hpctp_job_field "$id" Reason)" = DependencyNeverSatisfied ]; then
            scancel "$id" 2>/dev/null || true
          fi
          pending=1 ;;
        RUNNING | CONFIGURING | COMPLETING | SUSPENDED | REQUEUED | RESIZING | SIGNALING | STAGE_OUT) pending=1 ;;
      esac
    done
    [ "$pending" = 1 ] || break
    sleep "${HPCTP_WAIT_POLL:-2}"
  done
  for item in "$@"; do
    id=${item##*:}
    state=$(_hpctp_job_field "$id" JobState)
    reason=$(_hpctp_job_field "$id" Reason)
    code=$(_hpctp_job_field "$id" ExitCode)  # exit:signal of the batch script
    case "$state" in
      COMPLETED) echo "${item%:*} (job $id): COMPLETED" ;;
      CANCELLED)
        echo "${item%:*} (job $id): not run or stopped (CANCELLED, $reason)"
        [ "$rc" != 0 ] || rc=1 ;;
      *)
        if [ "${code#*:}" != 0 ] && [ -n "$code" ]; then code="${code%%:*}, signal ${code#*:}"; else code=${code%%:*}; fi
        echo "${item%:*} (job $id): ${state:-UNKNOWN (forgotten by Slurm)}, exit code ${code:-?}" ;;
    esac
    if [ "$state" != COMPLETED ] && [ "$rc" = 0 ]; then
      rc=${code%%,*}
      case "$rc" in '' | 0 | *[!0-9]*) rc=1 ;; esac
    fi
  done
  return "$rc"
}
