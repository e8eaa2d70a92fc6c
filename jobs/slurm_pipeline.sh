#!/usr/bin/env bash
# Submit the three stages as dependent Slurm jobs: train starts when simulate succeeded,
# evaluate when train succeeded. Extra arguments go to every sbatch call.
#   jobs/slurm_pipeline.sh                         DRY_RUN=1 jobs/slurm_pipeline.sh (print only)
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

j1=$(hpctp_submit sbatch --parsable "$@" "$HPCTP_JOBS/slurm_simulate.sbatch")
j2=$(hpctp_submit sbatch --parsable --dependency=afterok:"${j1%%;*}" "$@" "$HPCTP_JOBS/slurm_train.sbatch")
j3=$(hpctp_submit sbatch --parsable --dependency=afterok:"${j2%%;*}" "$@" "$HPCTP_JOBS/slurm_evaluate.sbatch")
echo "submitted: simulate ${j1%%;*}, train ${j2%%;*}, evaluate ${j3%%;*}"
