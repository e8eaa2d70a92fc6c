"""The repository's scripts (benchmarks/*.py, which are not a package) as modules for the tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative: str, name: str) -> ModuleType:
    """The script at ``ROOT/relative`` imported as module ``name`` (once per process: ``sys.modules``)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / relative)
        assert spec is not None and spec.loader is not None, f"cannot load {relative}"
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
