#!/usr/bin/env bash
# Plain mpiexec/mpirun, one rank per GPU, on this node or on the nodes of a host file: one stage
# (simulate, train or evaluate) of the workflow; jobs/mpirun_<stage>.sh call this.
#   NP=8 PPN=4 HOSTFILE=hosts.txt jobs/mpirun_stage.sh train
#   NP=4 jobs/mpirun_stage.sh simulate          (one node)
# Parameters: NP (default 4), PPN (ranks per node, default min(NP, 4)), HOSTFILE, STAGE_TIMEOUT (s, default none),
# MPIEXEC / MPI_FLAVOR / MPIEXEC_EXTRA and CONFIG / DATA / RUNDIR (see jobs/common.sh). DRY_RUN=1 prints the command.
set -euo pipefail
STAGE=${1:?usage: jobs/mpirun_stage.sh simulate|train|evaluate}
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
hpctp_mpiexec_args "$NP" "$PPN" "${HOSTFILE:-}"
hpctp_stage_cmd "$STAGE"
hpctp_prepare_dirs
launch=("$MPIEXEC" "${MPIEXEC_ARGS[@]}" "$BIND_GPU" "${HPCTP_CMD[@]}")
if [ -n "${STAGE_TIMEOUT:-}" ]; then launch=(timeout "$STAGE_TIMEOUT" "${launch[@]}"); fi
hpctp_log "$STAGE: $NP ranks"
hpctp_run "${launch[@]}"
