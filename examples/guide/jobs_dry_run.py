"""The launch lines of the jobs/ scripts, printed by their dry runs (DRY_RUN=1: nothing is submitted or run).

python examples/guide/jobs_dry_run.py      (from anywhere; the paths are shown relative to the repository)
"""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = [
    ("mpirun, 2 nodes x 4 ranks: train (MPI_FLAVOR=mpich)", "jobs/mpirun_train.sh",
     {"NP": "8", "PPN": "4", "MPI_FLAVOR": "mpich"}),
    ("the same with Open MPI (MPI_FLAVOR=openmpi)", "jobs/mpirun_train.sh", {"NP": "8", "PPN": "4", "MPI_FLAVOR": "openmpi"}),
    ("Slurm, inside `sbatch jobs/slurm_train.sbatch` (2 nodes x 4 tasks)", "jobs/slurm_train.sbatch",
     {"SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2"}),
    ("PBS, inside `qsub -V jobs/pbs_train.pbs`", "jobs/pbs_train.pbs", {"MPI_FLAVOR": "mpich"}),
    ("Slurm, the whole workflow: jobs/slurm_pipeline.sh (afterok chain)", "jobs/slurm_pipeline.sh", {}),
]  # fmt: skip

for title, script, extra in RUNS:
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": "python", "MPIEXEC": "mpiexec", **extra}
    for name in ("SLURM_NTASKS", "SLURM_JOB_NUM_NODES", "PBS_NODEFILE", "HPCTP_VENV"):
        if name not in extra:
            env.pop(name, None)
    proc = subprocess.run(
        ["bash", script], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60
    )
    if proc.returncode != 0:
        raise SystemExit(f"{script} failed ({proc.returncode}):\n{proc.stdout}")
    lines = proc.stdout.replace(str(ROOT) + "/", "").splitlines()
    print(f"# {title}")
    print("\n".join(line for line in lines if not line.startswith("[hpctp job")), end="\n\n")
