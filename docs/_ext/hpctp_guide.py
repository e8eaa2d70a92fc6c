"""Sphinx extension of hpctp's user guide: its example scripts run under ``mpiexec`` at build time.

``.. hpctp-run:: examples/guide/NAME.py`` (a path from the repository root; or ``-m MODULE ARGS``)
runs the script as a user would, ``mpiexec -n RANKS python SCRIPT OUTDIR``, with the venv's
``mpiexec`` (beside ``sys.executable``), from the repository root, with ``OMP_NUM_THREADS=1``,
``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` (ranks oversubscribing the cores yield instead of spinning),
``MPLBACKEND=Agg`` and the repository first on ``PYTHONPATH``, and shows rank 0's stdout beneath
(the other ranks' stdout is dropped, every rank's stderr kept for the error message). A script
that fails or runs past its timeout is an error at the directive's line, with the tail of its output,
and fails the build whatever ``-W`` says (the exit status is set at the end, after every page was
read, so one build reports every failing script). Options:

``:ranks:``
    The rank count (default 2).
``:timeout:``
    Seconds before the run is killed, with its whole process group (default 180).
``:outdir:``
    The name of the script's output folder (default: the script's stem); two runs that name
    the same one share it (e.g. a checkpoint saved on 4 ranks and restored on 2; runs of one
    page go in document order). The folder is emptied before each run that does not set
    ``:keep:``.
``:keep:``
    Keep the output folder's files (the second run of a shared folder).

OUTDIR is ``docs/guide/_run/<outdir>`` (git-ignored); the figures a script writes there are
shown by the page with ``.. figure:: _run/<outdir>/NAME.png``, which Sphinx copies into the
build (a missing figure is a warning, so ``-W`` fails). The script is a dependency of its page:
an incremental build reads the page again when the script changes. Each run's wall time is
logged (``sphinx-build`` without ``-q``) and summed at the end of the build.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.directives.code import container_wrapper
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

DOCS = Path(__file__).resolve().parent.parent
ROOT = DOCS.parent
RUN_DIR = DOCS / "guide" / "_run"

#: rank 0 keeps its stdout, the other ranks' goes to /dev/null (the rank from MPICH's, Open MPI's,
#: PMIx's or Slurm's variable); stderr of every rank is kept
_RANK0_STDOUT = (
    "r=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${SLURM_PROCID:-0}}}}; "
    'if [ "$r" = 0 ]; then exec "$@"; else exec "$@" >/dev/null; fi'
)

_TAIL = 6000  # characters of a failed run's output shown in the error


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MPIR_CVAR_ENABLE_HEAVY_YIELD="1", MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class RunFailed(Exception):
    """A guide script failed or ran past its timeout (the message holds the tail of its output)."""


def run_script(argv: list[str], ranks: int, timeout: float) -> tuple[str, float]:
    """``mpiexec -n ranks python argv...`` from the repository root; rank 0's stdout and the wall time.

    Raises
    ------
    RunFailed
        If the run fails or exceeds ``timeout`` (its process group is killed then).
    """
    mpiexec = Path(sys.executable).with_name("mpiexec")
    launcher = str(mpiexec) if mpiexec.exists() else "mpiexec"
    cmd = [launcher, "-n", str(ranks), "sh", "-c", _RANK0_STDOUT, "sh", sys.executable, *argv]
    shown = f"mpiexec -n {ranks} python {shlex.join(argv)}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise RunFailed(f"`{shown}` ran past its timeout of {timeout:.0f} s (killed)\n{(out + err)[-_TAIL:]}") from None
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RunFailed(
            f"`{shown}` failed with exit code {proc.returncode}\n"
            f"--- stdout (rank 0) ---\n{out[-_TAIL:]}\n--- stderr ---\n{err[-_TAIL:]}"
        )
    return out, seconds


class RunDirective(SphinxDirective):
    """``.. hpctp-run:: SCRIPT`` (see the module docstring)."""

    required_arguments = 1
    final_argument_whitespace = True
    option_spec = {
        "ranks": directives.positive_int,
        "timeout": directives.positive_int,
        "outdir": directives.unchanged_required,
        "keep": directives.flag,
    }

    def run(self) -> list[nodes.Node]:
        words = shlex.split(self.arguments[0])
        ranks = int(self.options.get("ranks", 2))
        timeout = float(self.options.get("timeout", 180))
        if words[0] == "-m":
            argv = words
            name = self.options.get("outdir", "")
        else:
            script = ROOT / words[0]
            if not script.is_file():
                raise self.error(f"hpctp-run: no script {words[0]} (paths are relative to the repository root)")
            self.env.note_dependency(str(script))
            name = self.options.get("outdir", script.stem)
            argv = words
        if name:
            outdir = RUN_DIR / name
            if "keep" not in self.options:
                shutil.rmtree(outdir, ignore_errors=True)
            outdir.mkdir(parents=True, exist_ok=True)
            argv = [*argv, os.path.relpath(outdir, ROOT)]
        key = f"{self.env.docname}: {shlex.join(words)} (-n {ranks})"
        runs = getattr(self.env, "hpctp_guide_runs", {})
        self.env.hpctp_guide_runs = runs  # type: ignore[attr-defined]
        try:
            out, seconds = run_script(argv, ranks, timeout)
        except RunFailed as e:
            logger.error(f"hpctp-run: {e}", location=self.get_location())
            runs[key] = None  # fails the build at its end (_finish)
            return []
        logger.info(f"hpctp-run: {shlex.join(argv)} on {ranks} ranks: {seconds:.1f} s")
        runs[key] = seconds
        text = out.rstrip("\n") or "(no output)"
        block = nodes.literal_block(text, text, language="text")
        self.set_source_info(block)
        caption = f"Output (rank 0) of ``mpiexec -n {ranks} python {shlex.join(words)}``"
        return [container_wrapper(self, block, caption)]


def _merge_runs(_app: Sphinx, env: Any, _docnames: Any, other: Any) -> None:
    """Parallel reads: the runs made in the worker processes."""
    mine = getattr(env, "hpctp_guide_runs", {})
    mine.update(getattr(other, "hpctp_guide_runs", {}))
    env.hpctp_guide_runs = mine


def _purge_runs(_app: Sphinx, env: Any, docname: str) -> None:
    runs = getattr(env, "hpctp_guide_runs", {})
    for key in [k for k in runs if k.startswith(f"{docname}: ")]:
        del runs[key]


def _finish(app: Sphinx, exception: Exception | None) -> None:
    """The total run time; a failed run fails the build (exit status 1), with or without ``-W``."""
    runs = getattr(app.env, "hpctp_guide_runs", {}) if app.env is not None else {}
    failed = sorted(k for k, v in runs.items() if v is None)
    if failed:
        logger.error(f"hpctp-run: {len(failed)} guide script(s) failed: {'; '.join(failed)}")
        app.statuscode = 1
    elif exception is None and runs:
        logger.info(f"hpctp-run: {len(runs)} guide runs, {sum(runs.values()):.1f} s in all")


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the directive and the bookkeeping of run times."""
    app.add_directive("hpctp-run", RunDirective)
    app.connect("env-merge-info", _merge_runs)
    app.connect("env-purge-doc", _purge_runs)
    app.connect("build-finished", _finish)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
