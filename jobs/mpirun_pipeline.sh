#!/usr/bin/env bash
# The whole workflow on one machine with plain mpiexec: simulate -> train -> evaluate, each stage on
# NP ranks (default 4) and killed after STAGE_TIMEOUT seconds (default 3600), so a hang fails fast.
#   jobs/mpirun_pipeline.sh                          (uses .venv/bin/mpiexec when present)
#   NP=2 CONFIG=apps/configs/tiny.toml DATA=out/tiny.h5 RUNDIR=out/tiny jobs/mpirun_pipeline.sh
#   DRY_RUN=1 jobs/mpirun_pipeline.sh                (print the three commands, run nothing)
# Parameters: see jobs/common.sh.
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
STAGE_TIMEOUT=${STAGE_TIMEOUT:-3600}
hpctp_prepare_dirs
for stage in simulate train evaluate; do
  hpctp_stage_cmd "$stage"
  hpctp_log "$stage: $NP ranks, timeout ${STAGE_TIMEOUT}s"
  start=$SECONDS
  hpctp_run timeout "$STAGE_TIMEOUT" "$MPIEXEC" -n "$NP" "$BIND_GPU" "${HPCTP_CMD[@]}"
  hpctp_log "$stage: done in $((SECONDS - start)) s"
done
