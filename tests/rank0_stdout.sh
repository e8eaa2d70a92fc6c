#!/usr/bin/env bash
# mpiexec -n N tests/rank0_stdout.sh CMD...: run CMD on every rank, keep stdout of rank 0 only
# (stderr of every rank stays visible, so a failing rank's traceback is never lost).
rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${SLURM_PROCID:-0}}}}
if [ "$rank" = 0 ]; then exec "$@"; else exec "$@" >/dev/null; fi
