#!/usr/bin/env bash
# Plain mpiexec/mpirun, one rank per GPU, on this node or on the nodes of a host file:
# train the surrogate (python -m apps.surrogate train); resumes from RUNDIR/checkpoint.h5 when it exists (RESUME=auto).
#   NP=8 PPN=4 HOSTFILE=hosts.txt jobs/mpirun_train.sh
#   NP=4 jobs/mpirun_train.sh                  (one node)
# Parameters: see jobs/mpirun_stage.sh.
exec "$(dirname "${BASH_SOURCE[0]}")/mpirun_stage.sh" train "$@"
