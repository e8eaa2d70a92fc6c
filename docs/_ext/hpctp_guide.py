"""Sphinx extension of hpctp's user guide: its example scripts run under ``mpiexec`` at build time.

``.. hpctp-run:: examples/guide/NAME.py`` (a path from the repository root; or ``-m MODULE ARGS``)
runs the script as a user would, ``mpiexec -n RANKS python SCRIPT OUTDIR``, with the venv's
``mpiexec`` (beside ``sys.executable``), from the repository root, with ``OMP_NUM_THREADS=1``,
``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` (ranks oversubscribing the cores yield instead of spinning),
``MPLBACKEND=Agg`` and the repository first on ``PYTHONPATH``, and shows rank 0's stdout beneath
(the other ranks' stdout is dropped, every rank's stderr kept for the error message). A script
that fails or runs past its timeout fails the build (a :class:`~sphinx.errors.ExtensionError`,
whatever ``-W`` says), with the tail of its output. Options:

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
from sphinx.errors import ExtensionError
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


def run_script(argv: list[str], ranks: int, timeout: float) -> tuple[str, float]:
    """``mpiexec -n ranks python argv...`` from the repository root; rank 0's stdout and the wall time.

    Raises
    ------
    ExtensionError
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
        raise ExtensionError(
            f"hpctp-run: `{shown}` ran past its timeout of {timeout:.0f} s (killed)\n{(out + err)[-_TAIL:]}"
        ) from None
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise ExtensionError(
            f"hpctp-run: `{shown}` failed with exit code {proc.returncode}\n"
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
        out, seconds = run_script(argv, ranks, timeout)
        logger.info(f"hpctp-run: {shlex.join(argv)} on {ranks} ranks: {seconds:.1f} s")
        seconds_run = getattr(self.env, "hpctp_guide_seconds", {})
        seconds_run[f"{self.env.docname}: {shlex.join(words)} (-n {ranks})"] = seconds
        self.env.hpctp_guide_seconds = seconds_run  # type: ignore[attr-defined]
        text = out.rstrip("\n") or "(no output)"
        block = nodes.literal_block(text, text, language="text")
        self.set_source_info(block)
        caption = f"Output (rank 0) of ``mpiexec -n {ranks} python {shlex.join(words)}``"
        return [container_wrapper(self, block, caption)]


def _merge_seconds(_app: Sphinx, env: Any, _docnames: Any, other: Any) -> None:
    """Parallel reads: the run times measured in the worker processes."""
    mine = getattr(env, "hpctp_guide_seconds", {})
    mine.update(getattr(other, "hpctp_guide_seconds", {}))
    env.hpctp_guide_seconds = mine


def _purge_seconds(_app: Sphinx, env: Any, docname: str) -> None:
    seconds_run = getattr(env, "hpctp_guide_seconds", {})
    for key in [k for k in seconds_run if k.startswith(f"{docname}: ")]:
        del seconds_run[key]


def _report_seconds(app: Sphinx, exception: Exception | None) -> None:
    seconds_run = getattr(app.env, "hpctp_guide_seconds", {}) if app.env is not None else {}
    if exception is None and seconds_run:
        logger.info(f"hpctp-run: {len(seconds_run)} guide runs, {sum(seconds_run.values()):.1f} s in all")


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the directive and the bookkeeping of run times."""
    app.add_directive("hpctp-run", RunDirective)
    app.connect("env-merge-info", _merge_seconds)
    app.connect("env-purge-doc", _purge_seconds)
    app.connect("build-finished", _report_seconds)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
