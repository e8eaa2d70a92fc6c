#!/usr/bin/env bash
# Online training with plain mpiexec: one job whose ranks split into simulation ranks and trainer ranks
# (online.placement = "separate"): the simulation streams its snapshots to the trainer's replay buffer,
# no snapshot file is written, the checkpoint goes to RUNDIR (python -m apps.simulate --train-online).
#   NP=6 TRAINERS=2 jobs/mpirun_online.sh                       (4 simulation + 2 trainer ranks)
#   NP=4 CONFIG=apps/configs/ns.toml RUNDIR=out/ns/online jobs/mpirun_online.sh
#   PLACEMENT=colocated NP=4 jobs/mpirun_online.sh              (every rank simulates and trains)
#   DRY_RUN=1 jobs/mpirun_online.sh                             (print the command, run nothing)
# Parameters: NP (default 4), TRAINERS (trainer ranks, the last ones; default NP / 2), PLACEMENT (separate),
# MAX_WAIT (seconds the simulation may wait for the trainer before thinning a snapshot; default: the config's),
# PPN (ranks per node, default min(NP, 4)), HOSTFILE, STAGE_TIMEOUT (s), STAGE_ARGS and those of jobs/common.sh.
set -euo pipefail
# The repository root: $HPCTP_ROOT, else the parent of this script's directory, else the directory
# the job was submitted from or its parent (Slurm and PBS run a copy of the script elsewhere).
if [ -z "${HPCTP_ROOT:-}" ]; then
  for d in "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/.." "${SLURM_SUBMIT_DIR:-}" "${SLURM_SUBMIT_DIR:-}/.." \
           "${PBS_O_WORKDIR:-}" "${PBS_O_WORKDIR:-}/.."; do
    if [ -f "$d/jobs/common.sh" ]; then HPCTP_ROOT=$(cd "$d" && pwd); break; fi
  done
fi
: "${HPCTP_ROOT:?cannot find the hpctp repository: set HPCTP_ROOT}"
# shellcheck source=jobs/common.sh
. "$HPCTP_ROOT/jobs/common.sh"

NP=${NP:-4}
PPN=${PPN:-$((NP < 4 ? NP : 4))}
PLACEMENT=${PLACEMENT:-separate}
TRAINERS=${TRAINERS:-$((NP / 2))}
hpctp_mpiexec_args "$NP" "$PPN" "${HOSTFILE:-}"
hpctp_online_cmd
hpctp_prepare_dirs
launch=("$MPIEXEC" "${MPIEXEC_ARGS[@]}" "$BIND_GPU" "${HPCTP_CMD[@]}")
if [ -n "${STAGE_TIMEOUT:-}" ]; then launch=(timeout "$STAGE_TIMEOUT" "${launch[@]}"); fi
hpctp_log "online: $NP ranks, $PLACEMENT$([ "$PLACEMENT" = separate ] && echo " ($((NP - TRAINERS)) simulate, $TRAINERS train)")"
hpctp_run "${launch[@]}"
