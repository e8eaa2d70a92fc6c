# shellcheck shell=bash
# Sourced by every job script in jobs/ after it has found HPCTP_ROOT (the repository root).
# Sets the environment of an hpctp job and defines:
#   hpctp_stage_cmd STAGE          HPCTP_CMD=( python -m apps... ) for simulate | train | evaluate
#   hpctp_mpiexec_args NP PPN [HOSTFILE]   MPIEXEC_ARGS=( ... ) for Open MPI / MPICH / Cray PALS
#   hpctp_run CMD...               run CMD, or with DRY_RUN=1 print it (one line, shell-quoted)
#   hpctp_submit CMD...            run a job-submission CMD (its stdout: the job id); DRY_RUN=1 prints
#                                  CMD to stderr and answers a fake id
#   hpctp_prepare_dirs             create the directories of DATA and RUNDIR (not in a dry run)
#
# Parameters (environment variables, with defaults):
#   CONFIG=apps/configs/default.toml   DATA=out/data.h5   RUNDIR=out/run
#   RESUME=auto (train: add --resume when RUNDIR/checkpoint.h5 exists; 1: always; 0: never)
#   PYTHON (default: .venv/bin/python in the repository, else python3), HPCTP_VENV (a venv to activate)
#   MPIEXEC (default: .venv/bin/mpiexec when present, else mpiexec), MPI_FLAVOR=openmpi|mpich|pals
#   MPIEXEC_EXTRA (extra launcher flags), DRY_RUN=1 (print the commands instead of running them)

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
}

hpctp_mpiexec_args() {
  local np=$1 ppn=$2 hostfile=${3:-} flavor=${MPI_FLAVOR:-} version
  if [ -z "$flavor" ]; then
    version=$("$MPIEXEC" --version 2>&1 | head -n 5 || true)
    case "$version" in
      *"Open MPI"* | *OpenRTE* | *PRRTE* | *prterun*) flavor=openmpi ;;
      *PALS* | *pals*) flavor=pals ;;
      *) flavor=mpich ;;  # MPICH hydra, Intel MPI, MVAPICH
    esac
  fi
  case "$flavor" in
    openmpi)
      MPIEXEC_ARGS=(-n "$np" --map-by "ppr:$ppn:node" --bind-to core)
      if [ -n "$hostfile" ]; then MPIEXEC_ARGS+=(--hostfile "$hostfile"); fi ;;
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
