"""examples/ as a user runs them: under mpiexec, each checks itself against numpy/torch in one process.
The README's "A first look" is examples/first_look.py verbatim, so it stays runnable. The user guide's scripts
(examples/guide/) run in every docs build (docs/_ext/hpctp_guide.py); here only their wiring is checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
FIRST_LOOK = ROOT / "examples" / "first_look.py"
GUIDE = ROOT / "docs" / "guide"
GUIDE_SCRIPTS = ROOT / "examples" / "guide"


def test_readme_shows_first_look_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"## A first look\n\n```python\n(.*?)```\n", readme, re.S)
    assert m, "README has no 'A first look' code block"
    assert m.group(1) == FIRST_LOOK.read_text(), "README's first look differs from examples/first_look.py"


@pytest.mark.parametrize("ranks", [1, 3])
def test_first_look_matches_one_process(ranks: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
    proc = subprocess.run(
        [MPIEXEC, "-n", str(ranks), sys.executable, str(FIRST_LOOK)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    errors = dict(re.findall(r"^(\S.*?)\s+max rel\. error vs \w+: (\S+)$", out, re.M))
    assert set(errors) == {"matmul (SUMMA)", "rfftn", "Conv2d -> FNO layer", "conv weight gradient"}, out
    assert float(errors["matmul (SUMMA)"]) < 1e-13 and float(errors["rfftn"]) < 1e-13, out  # float64
    assert float(errors["Conv2d -> FNO layer"]) < 1e-5 and float(errors["conv weight gradient"]) < 1e-5, out  # float32
    grid = "(1, 1)" if ranks == 1 else "(3, 1)"
    assert f"grid {grid}: rank 0 holds a" in out, out


def test_guide_runs_every_guide_script() -> None:
    """Every script of examples/guide/ is run by a page of the guide (``.. hpctp-run::``), every script a page
    runs exists, every page is in the guide's table of contents and ends with "What to read next"."""
    pages = sorted(p for p in GUIDE.glob("*.rst") if p.name != "index.rst")
    assert len(pages) >= 7, f"the user guide has {len(pages)} pages"
    run = {m for p in pages for m in re.findall(r"^\.\. hpctp-run:: (examples/\S+\.py)", p.read_text(), re.M)}
    missing = sorted(s for s in run if not (ROOT / s).is_file())
    assert not missing, f"guide pages run scripts that do not exist: {missing}"
    helpers = {"guide_model.py", "debugging_job.py"}  # imported or launched by the scripts, not run on their own
    scripts = {f"examples/guide/{p.name}" for p in GUIDE_SCRIPTS.glob("*.py") if p.name not in helpers}
    assert scripts <= run, f"guide scripts that no page runs: {sorted(scripts - run)}"
    toc = (GUIDE / "index.rst").read_text()
    for p in pages:
        assert re.search(rf"^   {p.stem}$", toc, re.M), f"{p.name} is not in docs/guide/index.rst's toctree"
        assert "\nWhat to read next\n-----------------\n" in p.read_text(), f"{p.name} has no 'What to read next'"
