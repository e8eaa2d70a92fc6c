"""Batch job scripts in jobs/: they parse, their scheduler headers ask for one rank per GPU,
bind_gpu.sh maps node-local ranks to GPUs, the dry runs print the exact stage commands, and the Slurm
scripts' launcher choices, failure reports and waiting work against stand-ins for srun/sbatch/scontrol.
Under a real one-node Slurm they run in tests/run_slurm.sh (a leg of `make test`)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "jobs"
BASH = shutil.which("bash") or "/bin/bash"
STAGES = ("simulate", "train", "evaluate")
LOCAL_RANK_VARS = (
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "PALS_LOCAL_RANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "PMI_LOCAL_RANK",
)
_SCRUB = re.compile(
    r"^(SLURM_|PBS_|OMPI_|PMI_|PMIX_|MPI_LOCAL|PALS_|MV2_|HYDRA_|CUDA_VISIBLE_DEVICES|HPCTP_|DRY_RUN|CONFIG|DATA|RUNDIR"
    r"|RESUME|NP$|PPN|NODES|HOSTFILE|MPIEXEC|MPI_FLAVOR|PYTHON$|STAGE_TIMEOUT|STAGE_ARGS|STAGES$|AFTER$|WAIT$"
    r"|GPUS_PER_TASK|SRUN_|MPI_LAUNCHER)"
)


def _env(**extra: str) -> dict[str, str]:
    """The current environment without any scheduler / MPI / job variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not _SCRUB.match(k)}
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, env=env, cwd=cwd)


def _scripts() -> list[Path]:
    return sorted(p for p in JOBS.iterdir() if p.is_file() and p.suffix in (".sh", ".sbatch", ".pbs"))


def _venv_tool(name: str) -> str:
    p = ROOT / ".venv" / "bin" / name
    return str(p) if p.exists() else name


# ---------------------------------------------------------------------------------- syntax, headers
def test_every_script_parses_and_is_executable() -> None:
    scripts = [*_scripts(), ROOT / "tests" / "run_slurm.sh"]
    names = {p.name for p in scripts}
    for stage in STAGES:
        assert {f"slurm_{stage}.sbatch", f"pbs_{stage}.pbs", f"mpirun_{stage}.sh"} <= names
    assert {"bind_gpu.sh", "common.sh", "mpirun_pipeline.sh", "slurm_pipeline.sh", "pbs_pipeline.sh"} <= names
    for p in scripts:
        proc = _run([BASH, "-n", str(p)], _env())
        assert proc.returncode == 0, f"{p.name}: {proc.stderr}"
        if p.name != "common.sh":  # sourced, not run
            assert os.access(p, os.X_OK), f"{p.name} is not executable"
            assert p.read_text().startswith("#!"), f"{p.name} has no shebang"


def _header(path: Path, prefix: str) -> list[str]:
    """The scheduler directives: the comment block at the top of the script."""
    lines = path.read_text().splitlines()[1:]
    out = []
    for line in lines:
        if not line.startswith("#"):
            break
        if line.startswith(prefix + " "):
            out.append(line[len(prefix) + 1 :].strip())
    return out


def _hms(text: str) -> int:
    h, m, s = (int(v) for v in text.split(":"))
    assert 0 <= m < 60 and 0 <= s < 60
    return 3600 * h + 60 * m + s


@pytest.mark.parametrize("stage", STAGES)
def test_slurm_header(stage: str) -> None:
    opts = dict(o[2:].split("=", 1) for o in _header(JOBS / f"slurm_{stage}.sbatch", "#SBATCH"))
    assert int(opts["nodes"]) >= 2  # multi-node
    assert int(opts["ntasks-per-node"]) >= 1
    assert opts["gpus-per-task"] == "1"  # one rank per GPU
    assert int(opts["cpus-per-task"]) >= 1
    assert _hms(opts["time"]) > 0
    assert opts["job-name"] == f"hpctp-{stage}"


@pytest.mark.parametrize("stage", STAGES)
def test_pbs_header(stage: str) -> None:
    lines = _header(JOBS / f"pbs_{stage}.pbs", "#PBS")
    res: dict[str, str] = {}
    for line in lines:
        if line.startswith("-l "):
            for item in line[3:].split(","):
                key, _, value = item.partition("=")
                res[key] = value
    chunks = res["select"].split(":")
    assert int(chunks[0]) >= 2  # nodes
    sel = dict(c.split("=") for c in chunks[1:])
    assert int(sel["mpiprocs"]) >= 1
    assert sel["ngpus"] == sel["mpiprocs"]  # one rank per GPU
    assert _hms(res["walltime"]) > 0
    assert f"-N hpctp-{stage}" in lines


def test_stage_scripts_launch_through_bind_gpu() -> None:
    for stage in STAGES:
        for name, launcher in ((f"slurm_{stage}.sbatch", '"${LAUNCH[@]}"'), (f"pbs_{stage}.pbs", '"$MPIEXEC"')):
            text = (JOBS / name).read_text()
            assert re.search(rf"hpctp_run {re.escape(launcher)} .*\"\$BIND_GPU\" \"\$\{{HPCTP_CMD\[@\]\}}\"", text), (
                name
            )
            assert f"hpctp_stage_cmd {stage}" in text
        slurm = (JOBS / f"slurm_{stage}.sbatch").read_text()
        assert "hpctp_slurm_launch\n" in slurm or "hpctp_slurm_launch  #" in slurm
        assert f"|| hpctp_stage_failed {stage} $?" in slurm
    common = (JOBS / "common.sh").read_text()
    for var in ("MPICH_GPU_SUPPORT_ENABLED=1", "OMPI_MCA_opal_cuda_support=1", "UCX_TLS=", "HPCTP_CUDA_AWARE"):
        assert var in common


# ---------------------------------------------------------------------------------- bind_gpu.sh
def _bind(env: dict[str, str]) -> tuple[str, str]:
    proc = _run(
        [str(JOBS / "bind_gpu.sh"), "sh", "-c", 'echo "${CUDA_VISIBLE_DEVICES-unset} ${HPCTP_LOCAL_RANK-unset}"'], env
    )
    assert proc.returncode == 0, proc.stderr
    gpu, local = proc.stdout.split()
    return gpu, local


@pytest.mark.parametrize("var", LOCAL_RANK_VARS)
@pytest.mark.parametrize("local_rank", ["0", "3", "7"])
def test_bind_gpu_from_each_local_rank_variable(var: str, local_rank: str) -> None:
    assert _bind(_env(**{var: local_rank})) == (local_rank, local_rank)


def test_bind_gpu_rules() -> None:
    # the first variable of the list wins
    assert _bind(_env(SLURM_LOCALID="2", OMPI_COMM_WORLD_LOCAL_RANK="5", MPI_LOCALRANKID="6")) == ("2", "2")
    assert _bind(_env(PALS_LOCAL_RANKID="1", PMI_LOCAL_RANK="4")) == ("1", "1")
    # a list from the launcher: entry local_rank mod length
    assert _bind(_env(OMPI_COMM_WORLD_LOCAL_RANK="2", CUDA_VISIBLE_DEVICES="4,5,6,7")) == ("6", "2")
    assert _bind(_env(OMPI_COMM_WORLD_LOCAL_RANK="5", CUDA_VISIBLE_DEVICES="4,5,6,7")) == ("5", "5")
    # one GPU already bound (srun --gpus-per-task=1): kept
    assert _bind(_env(SLURM_LOCALID="3", CUDA_VISIBLE_DEVICES="1")) == ("1", "3")
    # GPUs per node
    assert _bind(_env(MPI_LOCALRANKID="6", HPCTP_GPUS_PER_NODE="4")) == ("2", "6")
    # disabled, or no MPI launcher: untouched
    assert _bind(_env(SLURM_LOCALID="3", HPCTP_BIND_GPU="0")) == ("unset", "unset")
    assert _bind(_env()) == ("unset", "unset")
    assert _bind(_env(CUDA_VISIBLE_DEVICES="2,3")) == ("2,3", "unset")
    bad = _run([str(JOBS / "bind_gpu.sh"), "true"], _env(SLURM_LOCALID="x1"))
    assert bad.returncode == 2 and "not a rank number" in bad.stderr
    # arguments pass through unchanged, exit status too
    proc = _run(
        [str(JOBS / "bind_gpu.sh"), sys.executable, "-c", "import sys; print(sys.argv[1:]); sys.exit(3)", "a b", ""],
        _env(),
    )
    assert proc.returncode == 3 and proc.stdout.strip() == "['a b', '']"


def test_bind_gpu_under_mpiexec() -> None:
    mpiexec = _venv_tool("mpiexec")
    if shutil.which(mpiexec) is None:
        pytest.skip("no mpiexec")
    # (the ranks stay a second: MPICH's hydra (5.0.2) dies of SIGPIPE when a non-MPI rank ends while it is still
    # starting the others, as on a loaded machine: 12 of 30 plain `sh -c echo` jobs under 3 busy loops, none with it)
    proc = subprocess.run(
        [mpiexec, "-n", "3", str(JOBS / "bind_gpu.sh"), "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES $HPCTP_LOCAL_RANK"; sleep 1'],
        capture_output=True, text=True, timeout=120, env=_env(), stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split("\n")[:-1]) == ["0 0", "1 1", "2 2"]  # one node: GPU = local rank


# ---------------------------------------------------------------------------------- dry runs
def _commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line) for line in stdout.splitlines() if line.strip()]


def test_mpirun_pipeline_dry_run_prints_the_three_stages(tmp_path: Path) -> None:
    env = _env(DRY_RUN="1", NP="3", STAGE_TIMEOUT="120", CONFIG="cfg/x.toml", DATA=str(tmp_path / "d" / "data.h5"),
               RUNDIR=str(tmp_path / "r"))  # fmt: skip
    proc = _run([str(JOBS / "mpirun_pipeline.sh")], env, cwd=tmp_path)  # run from elsewhere: finds the root
    assert proc.returncode == 0, proc.stderr
    cmds = _commands(proc.stdout)
    python = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else "python3"
    mpiexec = str(ROOT / ".venv" / "bin" / "mpiexec") if (ROOT / ".venv" / "bin" / "mpiexec").exists() else "mpiexec"
    prefix = ["timeout", "120", mpiexec, "-n", "3", str(JOBS / "bind_gpu.sh"), python, "-m"]
    data, rundir = str(tmp_path / "d" / "data.h5"), str(tmp_path / "r")
    assert cmds == [
        prefix + ["apps.simulate", "--config", "cfg/x.toml", "--out", data],
        prefix + ["apps.surrogate", "train", "--config", "cfg/x.toml", "--data", data, "--out", rundir],
        prefix + ["apps.surrogate", "evaluate", "--config", "cfg/x.toml", "--data", data,
                  "--checkpoint", rundir + "/checkpoint.h5"],
    ]  # fmt: skip
    assert not (tmp_path / "d").exists() and not (tmp_path / "r").exists()  # a dry run touches nothing


def test_mpirun_pipeline_defaults() -> None:
    proc = _run([str(JOBS / "mpirun_pipeline.sh")], _env(DRY_RUN="1"))
    assert proc.returncode == 0, proc.stderr
    cmds = _commands(proc.stdout)
    assert [c[:2] for c in cmds] == [["timeout", "3600"]] * 3
    assert all(c[3:5] == ["-n", "4"] for c in cmds)
    assert cmds[0][-4:] == ["--config", "apps/configs/default.toml", "--out", "out/data.h5"]
    resumed = (ROOT / "out" / "run" / "checkpoint.h5").exists()  # e.g. after `make demo`: RESUME=auto
    train = [a for a in cmds[1] if a != "--resume"]
    assert train[-2:] == ["--out", "out/run"] and ("--resume" in cmds[1]) == resumed
    assert cmds[2][-2:] == ["--checkpoint", "out/run/checkpoint.h5"]


def test_online_scripts_split_the_job_into_simulation_and_trainer_ranks() -> None:
    """jobs/mpirun_online.sh and jobs/slurm_online.sbatch: one launch of python -m apps.simulate
    --train-online, the last TRAINERS ranks training (separate groups), or every rank (co-located)."""
    proc = _run([str(JOBS / "mpirun_online.sh")], _env(DRY_RUN="1", NP="6", TRAINERS="2", MAX_WAIT="0.5"))
    assert proc.returncode == 0, proc.stderr
    (cmd,) = _commands(proc.stdout)
    assert cmd[1:3] == ["-n", "6"] and cmd[cmd.index("-m") + 1] == "apps.simulate"
    assert "--train-online" in cmd and "--out" not in cmd  # no snapshot file
    sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
    assert sets == ["train.out=out/run", "online.placement=separate", "online.trainer_ranks=2", "online.max_wait=0.5"]
    assert "4 simulate, 2 train" in proc.stderr
    proc = _run([BASH, str(JOBS / "slurm_online.sbatch")], _env(DRY_RUN="1", NP="4", PLACEMENT="colocated"))
    assert proc.returncode == 0, proc.stderr
    (cmd,) = _commands(proc.stdout)
    assert cmd[0] == "srun" and "--kill-on-bad-exit=1" in cmd and "--ntasks=4" in cmd
    sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
    assert sets == ["train.out=out/run", "online.placement=colocated"]


def _train_cmd(tmp_path: Path, **extra: str) -> list[str]:
    proc = _run([str(JOBS / "mpirun_train.sh")], _env(DRY_RUN="1", RUNDIR=str(tmp_path), **extra))
    assert proc.returncode == 0, proc.stderr
    (cmd,) = _commands(proc.stdout)
    return cmd


def test_train_resume(tmp_path: Path) -> None:
    assert "--resume" not in _train_cmd(tmp_path)  # RESUME=auto, no checkpoint yet
    (tmp_path / "checkpoint.h5").write_bytes(b"")
    assert _train_cmd(tmp_path)[-1] == "--resume"  # auto: a checkpoint exists (a restarted job)
    assert "--resume" not in _train_cmd(tmp_path, RESUME="0")
    assert _train_cmd(tmp_path / "none", RESUME="1")[-1] == "--resume"


def test_slurm_script_run_from_a_copy(tmp_path: Path) -> None:
    """Slurm runs a copy of the batch script: the root comes from SLURM_SUBMIT_DIR (root or jobs/)."""
    for stage in STAGES:
        copy = tmp_path / "slurm_script"
        shutil.copy(JOBS / f"slurm_{stage}.sbatch", copy)
        for submit_dir in (ROOT, JOBS):
            env = _env(DRY_RUN="1", SLURM_SUBMIT_DIR=str(submit_dir), SRUN_MPI="site")
            proc = _run([BASH, str(copy)], env, cwd=tmp_path)
            assert proc.returncode == 0, proc.stderr
            (cmd,) = _commands(proc.stdout)
            assert cmd[:4] == ["srun", "--kill-on-bad-exit=1", "--cpu-bind=cores", str(JOBS / "bind_gpu.sh")]
            module = ["apps.simulate"] if stage == "simulate" else ["apps.surrogate", stage]
            assert cmd[5 : 6 + len(module)] == ["-m", *module]
    proc = _run([BASH, str(copy)], _env(DRY_RUN="1", NP="6", SLURM_SUBMIT_DIR=str(ROOT), SRUN_MPI="site"), cwd=tmp_path)
    assert _commands(proc.stdout)[0][:5] == ["srun", "--kill-on-bad-exit=1", "--cpu-bind=cores", "--ntasks=6",
                                             str(JOBS / "bind_gpu.sh")]  # fmt: skip
    proc = _run([BASH, str(copy)], _env(DRY_RUN="1"), cwd=tmp_path)  # nowhere to find the root
    assert proc.returncode != 0 and "set HPCTP_ROOT" in proc.stderr


def test_pbs_script_ranks_and_launcher_flags(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("".join(f"n{i}\n" * 4 for i in range(3)))  # 3 nodes x 4 slots
    copy = tmp_path / "pbs_script"
    shutil.copy(JOBS / "pbs_train.pbs", copy)
    want = {
        "openmpi": ["-n", "12", "--map-by", "ppr:4:node", "--bind-to", "core", "--hostfile", str(nodefile)],
        "mpich": ["-n", "12", "-ppn", "4", "-f", str(nodefile)],
        "pals": ["-n", "12", "--ppn", "4", "--depth", "1", "--cpu-bind", "depth", "--hostfile", str(nodefile)],
    }
    for flavor, args in want.items():
        env = _env(DRY_RUN="1", PBS_O_WORKDIR=str(ROOT), PBS_NODEFILE=str(nodefile), MPI_FLAVOR=flavor,
                   MPIEXEC="mpiexec", OMP_NUM_THREADS="1", RESUME="0")  # fmt: skip
        proc = _run([BASH, str(copy)], env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        (cmd,) = _commands(proc.stdout)
        assert cmd[: 1 + len(args)] == ["mpiexec", *args]
        assert cmd[1 + len(args)] == str(JOBS / "bind_gpu.sh")
        assert cmd[-8:-6] == ["apps.surrogate", "train"]


def test_mpi_flavor_detected_from_mpiexec_version(tmp_path: Path) -> None:
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'mpiexec (Open MPI) 5.0.3'\n")
    fake.chmod(0o755)
    proc = _run([str(JOBS / "mpirun_simulate.sh")], _env(DRY_RUN="1", NP="8", PPN="4", MPIEXEC=str(fake)))
    assert proc.returncode == 0, proc.stderr
    (cmd,) = _commands(proc.stdout)
    assert cmd[:7] == [str(fake), "-n", "8", "--map-by", "ppr:4:node", "--bind-to", "core"]
    real = _venv_tool("mpiexec")  # MPICH hydra in the venv
    if shutil.which(real):
        proc = _run([str(JOBS / "mpirun_simulate.sh")], _env(DRY_RUN="1", NP="2", HOSTFILE="h", MPIEXEC=real))
        assert _commands(proc.stdout)[0][:7] == [real, "-n", "2", "-ppn", "2", "-f", "h"]


def test_submit_pipelines_chain_dependencies() -> None:
    proc = _run([str(JOBS / "slurm_pipeline.sh"), "--account=abc"], _env(DRY_RUN="1"))
    assert proc.returncode == 0, proc.stderr
    cmds = _commands("\n".join(line for line in proc.stderr.splitlines() if line.startswith("sbatch")))
    ids = re.findall(r"simulate (\S+), train (\S+), evaluate (\S+)", proc.stdout)[0]
    assert cmds == [
        ["sbatch", "--parsable", "--account=abc", str(JOBS / "slurm_simulate.sbatch")],
        ["sbatch", "--parsable", f"--dependency=afterok:{ids[0]}", "--account=abc", str(JOBS / "slurm_train.sbatch")],
        [
            "sbatch",
            "--parsable",
            f"--dependency=afterok:{ids[1]}",
            "--account=abc",
            str(JOBS / "slurm_evaluate.sbatch"),
        ],
    ]
    proc = _run([str(JOBS / "pbs_pipeline.sh")], _env(DRY_RUN="1"))
    assert proc.returncode == 0, proc.stderr
    cmds = _commands("\n".join(line for line in proc.stderr.splitlines() if line.startswith("qsub")))
    ids = re.findall(r"simulate (\S+), train (\S+), evaluate (\S+)", proc.stdout)[0]
    assert cmds == [
        ["qsub", "-V", str(JOBS / "pbs_simulate.pbs")],
        ["qsub", "-V", "-W", f"depend=afterok:{ids[0]}", str(JOBS / "pbs_train.pbs")],
        ["qsub", "-V", "-W", f"depend=afterok:{ids[1]}", str(JOBS / "pbs_evaluate.pbs")],
    ]


# ---------------------------------------------------------------------------------- Slurm launcher, waiting
def _fake_bin(tmp_path: Path, **scripts: str) -> str:
    """Executables ``name`` with the given sh bodies in tmp_path/bin; returns a PATH that finds them first."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        exe = bindir / name
        exe.write_text("#!/bin/sh\n" + body)
        exe.chmod(0o755)
    return f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"


def _slurm_dry(stage: str = "train", **extra: str) -> list[str]:
    proc = _run([str(JOBS / f"slurm_{stage}.sbatch")], _env(DRY_RUN="1", RESUME="0", **extra))
    assert proc.returncode == 0, proc.stderr
    (cmd,) = _commands(proc.stdout)
    return cmd


def _launcher(cmd: list[str]) -> list[str]:
    return cmd[: cmd.index(str(JOBS / "bind_gpu.sh"))]


def test_slurm_launch_options() -> None:
    assert _launcher(_slurm_dry(SRUN_MPI="pmi2", NP="3")) == [
        "srun", "--kill-on-bad-exit=1", "--cpu-bind=cores", "--mpi=pmi2", "--ntasks=3"
    ]  # fmt: skip
    assert _launcher(_slurm_dry(SRUN_MPI="site", SRUN_CPU_BIND="")) == ["srun", "--kill-on-bad-exit=1"]
    assert _launcher(_slurm_dry(SRUN_MPI="site", SRUN_CPU_BIND="rank")) == [
        "srun", "--kill-on-bad-exit=1", "--cpu-bind=rank"
    ]  # fmt: skip
    # an MPI that cannot use Slurm's PMI: its own launcher inside the allocation
    assert _launcher(_slurm_dry(MPI_LAUNCHER="mpiexec", MPIEXEC="mpiexec", SLURM_NTASKS="4")) == ["mpiexec", "-n", "4"]
    assert _launcher(_slurm_dry(MPI_LAUNCHER="mpiexec", MPIEXEC="mpiexec", NP="2", MPIEXEC_EXTRA="-v")) == [
        "mpiexec", "-n", "2", "-v"
    ]  # fmt: skip
    cmd = _slurm_dry("evaluate", SRUN_MPI="site", STAGE_ARGS="--set surrogate.width=8  --verbose")
    assert cmd[-3:] == ["--set", "surrogate.width=8", "--verbose"]
    proc = _run([str(JOBS / "slurm_train.sbatch")], _env(DRY_RUN="1", MPI_LAUNCHER="aprun"))
    assert proc.returncode == 2 and "unknown MPI_LAUNCHER 'aprun'" in proc.stderr


@pytest.mark.parametrize(
    ("site_default", "flavor", "want"),
    [
        ("none", "mpich", ["--mpi=pmi2"]),  # MPICH (the venv's wheel) speaks PMI2
        ("none", "openmpi", ["--mpi=pmix"]),
        ("none", "pals", []),
        ("pmix", "mpich", []),  # the site chose: srun's default
        ("pmi2", "openmpi", []),
    ],
)
def test_slurm_pmi_detection(tmp_path: Path, site_default: str, flavor: str, want: list[str]) -> None:
    path = _fake_bin(
        tmp_path,
        scontrol=f'[ "$1 $2" = "show config" ] && echo "MpiDefault              = {site_default}"\n',
        srun='[ "$1" = --mpi=list ] && printf "MPI plugin types are...\\n\\tpmix\\n\\tnone\\n\\tpmi2\\n"\n',
    )
    cmd = _slurm_dry(PATH=path, MPI_FLAVOR=flavor)
    assert _launcher(cmd) == ["srun", "--kill-on-bad-exit=1", "--cpu-bind=cores", *want]
    # no srun that lists pmi2 (or no Slurm at all): no --mpi
    path = _fake_bin(tmp_path, srun='[ "$1" = --mpi=list ] && printf "MPI plugin types are...\\n\\tnone\\n"\n')
    assert _launcher(_slurm_dry(PATH=path, MPI_FLAVOR=flavor)) == ["srun", "--kill-on-bad-exit=1", "--cpu-bind=cores"]


def test_slurm_stage_reports_its_exit_code_and_gpu_choice(tmp_path: Path) -> None:
    path = _fake_bin(tmp_path, srun='echo "bind=${HPCTP_BIND_GPU-unset} args=$*"\nexit "${FAKE_RC:-0}"\n')
    common = dict(PATH=path, SRUN_MPI="site", DATA=str(tmp_path / "d" / "data.h5"), RUNDIR=str(tmp_path / "r"))
    script = str(JOBS / "slurm_simulate.sbatch")
    proc = _run([script], _env(FAKE_RC="7", **common))
    assert proc.returncode == 7, proc.stderr
    assert "simulate: FAILED with exit code 7" in proc.stderr and "simulate: done" not in proc.stderr
    proc = _run([script], _env(FAKE_RC="143", **common))
    assert (
        proc.returncode == 143
        and "simulate: FAILED with exit code 143 (signal 15: the ranks were stopped" in proc.stderr
    )
    proc = _run([script], _env(**common))
    assert proc.returncode == 0 and "simulate: done" in proc.stderr
    assert proc.stdout.startswith("bind=unset args=--kill-on-bad-exit=1 --cpu-bind=cores ")
    for var in ("GPUS_PER_TASK", "SLURM_GPUS_PER_TASK"):  # no GPUs asked for: no binding
        proc = _run([script], _env(**{var: "0"}, **common))
        assert proc.returncode == 0 and proc.stdout.startswith("bind=0 "), proc.stdout
    proc = _run([script], _env(GPUS_PER_TASK="1", **common))
    assert proc.stdout.startswith("bind=unset ")


def _fake_slurm(tmp_path: Path, states: dict[int, str]) -> str:
    """sbatch (ids 1, 2, ...; its arguments logged), scontrol show job -o ID (from state files) and scancel."""
    jobdir = tmp_path / "jobs"
    jobdir.mkdir()
    for job, state in states.items():
        (jobdir / str(job)).write_text(f"JobId={job} JobName=x {state}\n")
    return _fake_bin(
        tmp_path,
        sbatch=f"n=$(($(cat {jobdir}/n 2>/dev/null || echo 0) + 1)); echo $n > {jobdir}/n\n"
        f'echo "$*" >> {jobdir}/sbatch.log\necho "$n;cluster"\n',
        scontrol=f'[ "$1 $2 $3" = "show job -o" ] && cat {jobdir}/$4\n',
        scancel=f'echo "JobId=$1 JobState=CANCELLED Reason=DependencyNeverSatisfied ExitCode=0:0" > {jobdir}/$1\n'
        f'echo "$1" >> {jobdir}/scancel.log\n',
    )


def test_slurm_pipeline_waits_and_reports_the_failed_stage(tmp_path: Path) -> None:
    never = "JobState=PENDING Reason=DependencyNeverSatisfied ExitCode=0:0"
    path = _fake_slurm(tmp_path, {1: "JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0", 2: never, 3: never})
    proc = _run([str(JOBS / "slurm_pipeline.sh"), "-n2"], _env(PATH=path, WAIT="1", HPCTP_WAIT_POLL="0.1"))
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.splitlines() == [
        "submitted: simulate 1, train 2, evaluate 3",
        "simulate (job 1): FAILED, exit code 3",
        "train (job 2): not run or stopped (CANCELLED, DependencyNeverSatisfied)",
        "evaluate (job 3): not run or stopped (CANCELLED, DependencyNeverSatisfied)",
    ]
    assert (tmp_path / "jobs" / "scancel.log").read_text().split() == ["2", "3"]


def test_slurm_pipeline_stages_after_and_gpus(tmp_path: Path) -> None:
    done = "JobState=COMPLETED Reason=None ExitCode=0:0"
    path = _fake_slurm(tmp_path, {1: done, 2: done})
    env = _env(PATH=path, WAIT="1", HPCTP_WAIT_POLL="0.1", STAGES="train evaluate", AFTER="41", GPUS_PER_TASK="0")
    proc = _run([str(JOBS / "slurm_pipeline.sh"), "--ntasks=2"], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "submitted: train 1, evaluate 2",
        "train (job 1): COMPLETED",
        "evaluate (job 2): COMPLETED",
    ]
    assert (tmp_path / "jobs" / "sbatch.log").read_text().splitlines() == [
        f"--parsable --dependency=afterok:41 --gpus-per-task=0 --ntasks=2 {JOBS / 'slurm_train.sbatch'}",
        f"--parsable --dependency=afterok:1 --gpus-per-task=0 --ntasks=2 {JOBS / 'slurm_evaluate.sbatch'}",
    ]
    proc = _run([str(JOBS / "slurm_pipeline.sh")], _env(DRY_RUN="1", STAGES="simulate plot"))
    assert proc.returncode == 2 and "unknown stage 'plot'" in proc.stderr


def test_debug_variables_reach_the_ranks(tmp_path: Path) -> None:
    """HPCTP_TRACE/WATCHDOG/CHECK/TRACE_DIR set when submitting go to Open MPI's mpirun with -x (srun, hydra and
    PALS pass the whole environment on); unset ones are not named."""
    copy = tmp_path / "pbs_script"
    shutil.copy(JOBS / "pbs_train.pbs", copy)
    debug = {"HPCTP_WATCHDOG": "600", "HPCTP_CHECK": "1"}
    for flavor in ("openmpi", "mpich"):
        env = _env(DRY_RUN="1", PBS_O_WORKDIR=str(ROOT), MPI_FLAVOR=flavor, MPIEXEC="mpiexec", NP="2", PPN="2",
                   RESUME="0", **debug)  # fmt: skip
        proc = _run([BASH, str(copy)], env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        (cmd,) = _commands(proc.stdout)
        flags = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"]
        assert flags == (["HPCTP_WATCHDOG", "HPCTP_CHECK"] if flavor == "openmpi" else [])
