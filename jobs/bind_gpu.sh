#!/usr/bin/env bash
# One GPU per MPI rank:  <launcher> jobs/bind_gpu.sh COMMAND [ARGS...]
#
# Sets CUDA_VISIBLE_DEVICES from the rank's node-local index, read from (first found)
#   SLURM_LOCALID (srun), OMPI_COMM_WORLD_LOCAL_RANK (Open MPI), MPI_LOCALRANKID (MPICH hydra,
#   Intel MPI), PALS_LOCAL_RANKID (Cray PALS), MV2_COMM_WORLD_LOCAL_RANK (MVAPICH), PMI_LOCAL_RANK,
# then runs COMMAND. If the launcher already gave the rank a list of GPUs, the rank takes entry
# (local rank mod length); a single GPU already bound (e.g. srun --gpus-per-task=1) is kept.
# Without a list, GPU = local rank (mod HPCTP_GPUS_PER_NODE when set). Also exports
# HPCTP_LOCAL_RANK. HPCTP_BIND_GPU=0 disables the binding; HPCTP_BIND_VERBOSE=1 reports it on stderr.
set -euo pipefail
if [ $# -eq 0 ]; then
  echo "usage: $0 COMMAND [ARGS...]" >&2
  exit 2
fi
local_rank="" source_var=""
for v in SLURM_LOCALID OMPI_COMM_WORLD_LOCAL_RANK MPI_LOCALRANKID PALS_LOCAL_RANKID MV2_COMM_WORLD_LOCAL_RANK PMI_LOCAL_RANK; do
  if [ -n "${!v:-}" ]; then
    local_rank=${!v}
    source_var=$v
    break
  fi
done
if [ -n "$local_rank" ] && [ "${HPCTP_BIND_GPU:-1}" != 0 ]; then
  case "$local_rank" in
    *[!0-9]*)
      echo "bind_gpu.sh: $source_var='$local_rank' is not a rank number" >&2
      exit 2 ;;
  esac
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -r -a devices <<< "$CUDA_VISIBLE_DEVICES"
    gpu=${devices[$((local_rank % ${#devices[@]}))]}
  elif [ -n "${HPCTP_GPUS_PER_NODE:-}" ] && [ "${HPCTP_GPUS_PER_NODE}" -gt 0 ]; then
    gpu=$((local_rank % HPCTP_GPUS_PER_NODE))
  else
    gpu=$local_rank
  fi
  export CUDA_VISIBLE_DEVICES=$gpu
  export HPCTP_LOCAL_RANK=$local_rank
  if [ "${HPCTP_BIND_VERBOSE:-0}" = 1 ]; then
    echo "bind_gpu.sh: $(hostname) $source_var=$local_rank -> CUDA_VISIBLE_DEVICES=$gpu" >&2
  fi
fi
exec "$@"
