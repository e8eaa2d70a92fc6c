"""The demo workflow at its smallest: simulate -> train -> evaluate -> roll out, the `make demo` job on a tiny config.

    mpiexec -n 2 python examples/guide/workflow.py [OUTDIR]     (writes OUTDIR/sim.h5 and OUTDIR/run/: eval.png, ...)

The same as ``mpiexec -n 2 python -m apps.pipeline --config apps/configs/tiny.toml`` with the outputs
in OUTDIR; its log (rank 0, on stderr) is shown on stdout here.
"""

import os
import sys
from pathlib import Path

from mpi4py import MPI

from apps.pipeline import main

out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/guide")
if MPI.COMM_WORLD.Get_rank() == 0:
    os.dup2(sys.stdout.fileno(), sys.stderr.fileno())  # the log on stdout
config = ["--config", "apps/configs/tiny.toml"]
config += ["--set", f"simulation.out={out}/sim.h5", "--set", f"train.out={out}/run"]  # outputs in OUTDIR
sys.exit(main(config))
