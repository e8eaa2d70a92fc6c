#!/usr/bin/env bash
# Plain mpiexec/mpirun, one rank per GPU, on this node or on the nodes of a host file:
# evaluate the trained surrogate (python -m apps.surrogate evaluate).
#   NP=8 PPN=4 HOSTFILE=hosts.txt jobs/mpirun_evaluate.sh
#   NP=4 jobs/mpirun_evaluate.sh                  (one node)
# Parameters: see jobs/mpirun_stage.sh.
exec "$(dirname "${BASH_SOURCE[0]}")/mpirun_stage.sh" evaluate "$@"
