"""Sphinx configuration of hpctp's user guide and API reference (``make docs``: warnings are errors).

The reference imports hpctp (autodoc), so it needs the package's own dependencies (numpy, mpi4py,
torch, h5py) but no GPU and no network: cupy is mocked and no intersphinx inventory is fetched.
The guide runs the scripts of ``examples/guide/`` under the venv's ``mpiexec`` (docs/_ext/hpctp_guide.py),
so it also needs matplotlib (the ``apps`` extra) and the apps (the repository root); the benchmark pages'
plots are drawn with matplotlib from ``docs/benchmarks/results/*.json`` (docs/_ext/hpctp_bench.py).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

import hpctp  # noqa: E402

project = "hpctp"
author = "the hpctp developers"
copyright = "the hpctp developers"  # noqa: A001  (Sphinx's name)
version = release = hpctp.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.viewcode",
    "numpydoc",
    "hpctp_docs",  # docs/_ext: the supported-functions tables and the __all__ coverage check
    "hpctp_guide",  # docs/_ext: the guide's scripts, run under mpiexec at build time (hpctp-run)
    "hpctp_bench",  # docs/_ext: the benchmark pages' tables and plots from docs/benchmarks/results/*.json
]

templates_path = ["_templates"]
root_doc = "index"
exclude_patterns = ["guide/_run"]  # the guide scripts' outputs (figures, HDF5 files)

# autodoc / autosummary: one stub page per public object, written to api/generated/ (git-ignored) on
# every build; emptied first, so a stub of a renamed or removed name cannot linger (it would be
# "not included in any toctree")
shutil.rmtree(DOCS / "api" / "generated", ignore_errors=True)
autosummary_generate = True
autosummary_imported_members = False
autodoc_mock_imports = ["cupy"]  # no GPU needed to build the docs
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# methods without a docstring of their own stay undocumented (torch's inherited docstrings of
# forward/backward use labels of torch's docs, which are undefined here)
autodoc_inherit_docstrings = False

# numpydoc: class pages list their members through autodoc (templates/autosummary/class.rst), not
# numpydoc's own member tables (which would list every method a second time)
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False

html_theme = "furo"
html_title = f"hpctp {release}"

# modules that must each have an API page; the coverage check (docs/_ext/hpctp_docs.py) also
# fails the build when a name in a documented module's __all__ is documented nowhere
hpctp_api_modules = [
    "hpctp",
    "hpctp.layout",
    "hpctp.machine",
    "hpctp.comm",
    "hpctp.comm.torch_dist",
    "hpctp.tensor",
    "hpctp.tensor.random",
    "hpctp.tensor.registry",
    "hpctp.tensor.dtensor",
    "hpctp.linalg",
    "hpctp.linalg.cost",
    "hpctp.fft",
    "hpctp.halo",
    "hpctp.nn",
    "hpctp.nn.functional",
    "hpctp.nn.transformer.context_parallel",
    "hpctp.nn.transformer.sequence_parallel",
    "hpctp.nn.transformer.agreement",
    "hpctp.perf",
    "hpctp.perf.planner",
    "hpctp.perf.search",
    "hpctp.perf.memory",
    "hpctp.perf.timing",
    "hpctp.perf.model",
    "hpctp.perf.workload",
    "hpctp.perf.layers",
    "hpctp.perf.machine",
    "hpctp.perf.calibration",
    "hpctp.io",
    "hpctp.testing",
    "hpctp.debug",
    "hpctp.debug.types",
    "hpctp.debug.watcher",
    "hpctp.comm.trace",
    "hpctp.cli",
    "hpctp.cli.command",
    "hpctp.cli.info",
    "hpctp.cli.demo",
    "hpctp.cli.runner",
    "hpctp.cli.trace",
    "hpctp.cli.plan",
    "hpctp.cli.log",
    "hpctp.cli.cbridge",
]
