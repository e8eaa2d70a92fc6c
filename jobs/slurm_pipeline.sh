#!/usr/bin/env bash
# Submit the three stages as dependent Slurm jobs: train starts when simulate succeeded,
# evaluate when train succeeded. Extra arguments go to every sbatch call.
#   jobs/slurm_pipeline.sh                         DRY_RUN=1 jobs/slurm_pipeline.sh (print only)
#   GPUS_PER_TASK=0 WAIT=1 CONFIG=apps/configs/tiny.toml jobs/slurm_pipeline.sh --nodes=1 --ntasks-per-node=2
# Parameters (besides those of jobs/common.sh, which the jobs inherit):
#   GPUS_PER_TASK  unset: the headers' --gpus-per-task=1; N: every sbatch gets --gpus-per-task=N
#                  (0 on nodes without GPUs: the jobs ask for no GPU)
#   STAGES         the stages to submit, in order (default "simulate train evaluate"; e.g. "train evaluate"
#                  to train again on existing data, RESUME=1 to continue a run)
#   AFTER          a job id the first stage waits for (afterok), e.g. the evaluation of an earlier run
#   WAIT=1         wait for the jobs to end and print each one's state and exit code; exits non-zero
#                  (the failed stage's exit code) unless all COMPLETED; a stage after a failed one is
#                  cancelled instead of pending forever
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

read -r -a stages <<< "${STAGES:-simulate train evaluate}"
gpus=()
if [ -n "${GPUS_PER_TASK:-}" ]; then gpus=("--gpus-per-task=$GPUS_PER_TASK"); fi
prev=${AFTER:-}
jobs=()
summary=""
for stage in "${stages[@]}"; do
  case "$stage" in
    simulate | train | evaluate) ;;
    *) echo "slurm_pipeline.sh: unknown stage '$stage' in STAGES (simulate, train, evaluate)" >&2; exit 2 ;;
  esac
  dep=()
  if [ -n "$prev" ]; then dep=("--dependency=afterok:$prev"); fi
  id=$(hpctp_submit sbatch --parsable "${dep[@]}" "${gpus[@]}" "$@" "$HPCTP_JOBS/slurm_$stage.sbatch")
  prev=${id%%;*}  # --parsable: "id" or "id;cluster"
  jobs+=("$stage:$prev")
  summary+="${summary:+, }$stage $prev"
done
echo "submitted: $summary"
if [ "${WAIT:-0}" = 1 ] && [ "$DRY_RUN" != 1 ]; then
  hpctp_slurm_wait "${jobs[@]}"
fi
