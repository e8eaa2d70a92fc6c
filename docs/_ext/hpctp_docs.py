"""Sphinx extension of hpctp's docs: pages built from the code, so they cannot drift from it.

* ``.. hpctp-supported:: TABLE`` renders one of the tables of what works on a DistTensor, read at
  build time from the code that decides it: ``numpy-functions`` (``FUNCTIONS`` of
  :mod:`hpctp.tensor.numpy_protocol`, by kind: the kind tables it is the union of), ``numpy-ufuncs`` (numpy's ufuncs that
  ``__array_ufunc__`` accepts; for torch blocks, those :func:`hpctp.ops.elementwise.ufunc_for`
  maps onto torch), ``torch-pointwise`` and ``torch-collective`` (``POINTWISE`` and ``MOVES`` of
  :mod:`hpctp.tensor.torch_protocol`), ``registry`` (:func:`hpctp.tensor.registry.registered`).
* autosummary's tables show what an object does: hpctp's docstrings open with their
  collectiveness ("Local." / "Collective over grid."), which would otherwise be the whole summary;
  the summary becomes that tag, shortened, followed by the next sentence.
* numpydoc's complaints about a docstring (an unknown section), which it sends through
  :mod:`warnings`, become Sphinx warnings, so ``-W`` fails on them too.
* Class pages name public base classes only.
* A coverage check, after all pages are read: every name in the ``__all__`` of a documented module
  is documented somewhere (under that name or another public one), every module-level object
  documented is in its module's ``__all__``, no private module (``_name``) is documented, and every
  module of the config value ``hpctp_api_modules`` has a page. A miss is a warning, so ``make docs``
  (``-W``) fails on it.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import numpy as np
from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.domains.python import PythonDomain
from sphinx.environment import BuildEnvironment
from sphinx.ext import autosummary
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

_TABLE_MODULES = (
    "hpctp.tensor.numpy_protocol",
    "hpctp.tensor.torch_protocol",
    "hpctp.tensor.registry",
    "hpctp.ops.elementwise",
)


def _literals(names: Iterable[str]) -> list[str]:
    """One paragraph: the names as inline literals, comma-separated, sorted."""
    return [", ".join(f"``{n}``" for n in sorted(set(names))), ""]


def _numpy_name(func: Callable[..., Any]) -> str:
    for prefix, namespace in (("np.linalg.", np.linalg), ("np.fft.", np.fft), ("np.", np)):
        if getattr(namespace, func.__name__, None) is func:
            return prefix + func.__name__
    return f"{func.__module__}.{func.__name__}"


def _torch_name(func: Callable[..., Any]) -> str:
    import torch
    import torch.nn.functional as F  # noqa: N812

    for prefix, namespace in (("torch.nn.functional.", F), ("torch.", torch)):
        if getattr(namespace, func.__name__, None) is func:
            return prefix + func.__name__
    return repr(func)


# numpy_protocol's kind tables (private: FUNCTIONS is their union), in the order the page lists them
NUMPY_KINDS = {
    "_COLLECTIVE": "Collective over grid (reductions)",
    "_MOVING": "Collective over grid where they move data (along divided dims, or inputs cut differently), else local",
    "_ELEMENTWISE": "Local (collective over grid for DistTensor operands cut differently)",
    "_LOCAL": "Local",
}


def numpy_functions() -> list[str]:
    """``np.<name>`` of every numpy function ``__array_function__`` implements on DistTensors, by kind.

    Raises
    ------
    sphinx.errors.ExtensionError
        If a function of ``FUNCTIONS`` is in none of the kind tables, or a kind table is gone.
    """
    from sphinx.errors import ExtensionError

    from hpctp.tensor import numpy_protocol

    lines: list[str] = []
    listed: set[Callable[..., Any]] = set()
    for table, kind in NUMPY_KINDS.items():
        funcs = getattr(numpy_protocol, table, None)
        if funcs is None:
            raise ExtensionError(f"hpctp.tensor.numpy_protocol.{table} is gone: update NUMPY_KINDS in {__file__}")
        listed.update(funcs)
        lines += [f"{kind}:", ""] + _literals(_numpy_name(f) for f in funcs)
    unlisted = set(numpy_protocol.FUNCTIONS) - listed
    if unlisted:
        names = ", ".join(sorted(_numpy_name(f) for f in unlisted))
        raise ExtensionError(f"numpy_protocol.FUNCTIONS has {names} in no kind table: update NUMPY_KINDS in {__file__}")
    return lines


def numpy_ufuncs() -> list[str]:
    """numpy's ufuncs that DistTensors accept: all blocks, and torch blocks."""
    import torch

    from hpctp.ops.elementwise import ufunc_for

    ufuncs = {u for u in vars(np).values() if isinstance(u, np.ufunc) and u.nout == 1 and u.signature is None}
    like = torch.empty(0)
    on_torch, numpy_only = [], []
    for u in ufuncs:
        try:
            ufunc_for(u, like)
        except TypeError:
            numpy_only.append(f"np.{u.__name__}")
        else:
            on_torch.append(f"np.{u.__name__}")
    lines = ["On blocks of every backend (numpy, cupy, torch):", ""]
    lines += _literals(on_torch)
    lines += ["On numpy and cupy blocks only (torch has no counterpart):", ""]
    return lines + (_literals(numpy_only) if numpy_only else ["(none)", ""])


def torch_pointwise() -> list[str]:
    """torch's pointwise functions that run blockwise on DistTensors with torch blocks."""
    from hpctp.tensor.torch_protocol import POINTWISE

    return _literals(POINTWISE().values())


def torch_collective() -> list[str]:
    """torch functions that call hpctp's collective operations (reductions, joins, moves)."""
    from hpctp.tensor.torch_protocol import MOVES

    return _literals(_torch_name(f) for f in MOVES)


def registry_table() -> list[str]:
    """Every DistTensor operation in :mod:`hpctp.tensor.registry` and the module implementing it."""
    from hpctp.tensor.registry import registered

    lines = [".. list-table::", "   :header-rows: 1", "   :widths: 1 2", "", "   * - operation", "     - module"]
    for name, module in registered().items():
        lines += [f"   * - ``{name}``", f"     - ``{module}``"]
    return [*lines, ""]


TABLES: dict[str, Callable[[], list[str]]] = {
    "numpy-functions": numpy_functions,
    "numpy-ufuncs": numpy_ufuncs,
    "torch-pointwise": torch_pointwise,
    "torch-collective": torch_collective,
    "registry": registry_table,
}


class SupportedDirective(SphinxDirective):
    """``.. hpctp-supported:: TABLE``: one of :data:`TABLES`, rendered from the code."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        table = self.arguments[0]
        if table not in TABLES:
            raise self.error(f"hpctp-supported: unknown table {table!r}; one of {', '.join(TABLES)}")
        import hpctp  # noqa: F401  (registers every implementation)
        from hpctp.tensor.registry import registered

        # rebuild this page whenever a module that decides what is supported changes
        for module in {*_TABLE_MODULES, *registered().values()}:
            path = getattr(importlib.import_module(module), "__file__", None)
            if path:
                self.env.note_dependency(path)
        container = nodes.container()
        self.state.nested_parse(StringList(TABLES[table]()), self.content_offset, container)
        return container.children


_SPACES = re.compile(r"\s+")


def collectiveness_tag(sentence: str) -> str | None:
    """``"Local."``, ``"Collective."`` or ``"Collective or local."`` for a docstring's opening
    sentence that states its collectiveness, else None."""
    words = sentence.lower()
    if not words.startswith(("local", "collective")):
        return None
    if "local" in words and "collective" in words:
        return "Collective or local."
    return "Local." if words.startswith("local") else "Collective."


_extract_summary = autosummary.extract_summary


def extract_summary(doc: Sequence[str], settings: Any) -> str:
    """autosummary's summary of ``doc``, with the collectiveness sentence shortened to its tag and
    followed by the sentence after it."""
    summary = _extract_summary(doc, settings)
    tag = collectiveness_tag(summary)
    start = next((i for i, line in enumerate(doc) if line.strip()), None)
    if tag is None or start is None:
        return summary
    end = next((i for i in range(start, len(doc)) if not doc[i].strip()), len(doc))
    stanza = _SPACES.sub(" ", " ".join(line.strip() for line in doc[start:end]))
    first = _SPACES.sub(" ", summary)
    if not stanza.startswith(first):
        return summary
    rest = stanza[len(first) :].strip()
    what = _extract_summary([rest] if rest else list(doc[end:]), settings)
    return f"{tag} {what}" if what and not what.startswith(":") else tag


def _resolve(fullname: str) -> tuple[Any, list[str], Any] | None:
    """(module, attribute path below it, object) for a dotted name, or None."""
    parts = fullname.split(".")
    for i in range(len(parts), 0, -1):
        modname = ".".join(parts[:i])
        module = sys.modules.get(modname)
        if module is None:
            try:
                module = importlib.import_module(modname)
            except ImportError:
                continue
        obj: Any = module
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return module, parts[i:], obj
    return None


_MODULE_LEVEL = {"module", "class", "function", "exception", "data"}


def check_coverage(app: Sphinx, env: BuildEnvironment) -> None:
    """Warn (an error under ``-W``) where the reference and the modules' ``__all__`` disagree."""
    objects = cast(PythonDomain, env.get_domain("py")).objects
    documented: dict[int, str] = {}
    modules: dict[str, str] = {}
    for fullname, entry in objects.items():
        if entry.objtype not in _MODULE_LEVEL or entry.aliased:
            continue
        found = _resolve(fullname)
        if found is None:
            logger.warning("%s is documented but cannot be imported", fullname, location=entry.docname)
            continue
        module, path, obj = found
        if any(part.startswith("_") and not part.startswith("__") for part in fullname.split(".")):
            logger.warning("%s is private (a leading _) but documented", fullname, location=entry.docname)
        if not path:
            modules[fullname] = entry.docname
        elif len(path) == 1 and path[0] not in getattr(module, "__all__", path):
            logger.warning(
                "%s is documented but not in %s.__all__: document public names only",
                fullname,
                module.__name__,
                location=entry.docname,
            )
        documented.setdefault(id(obj), fullname)
    for modname in app.config.hpctp_api_modules:
        if modname not in modules:
            logger.warning("module %s has no API page (automodule) in the docs", modname, location="index")
    for modname, docname in sorted(modules.items()):
        module = sys.modules[modname]
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if id(obj) in documented:
                continue
            what = "module" if inspect.ismodule(obj) else "name"
            logger.warning(
                "%s.%s (a public %s, in __all__) is documented nowhere: list it in an autosummary on %s",
                modname,
                name,
                what,
                env.doc2path(docname),
                location=docname,
            )


def drop_private_bases(app: Sphinx, name: str, obj: Any, options: Any, bases: list[Any]) -> None:
    """``Bases:`` lines name public classes only (``_ConvMixin`` and the like are implementation)."""
    bases[:] = [b for b in bases if not getattr(b, "__name__", "").startswith("_")] or [object]


_showwarning = warnings.showwarning


def show_numpydoc_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                          file: Any = None, line: str | None = None) -> None:  # fmt: skip
    """numpydoc reports a docstring's unknown section with :func:`warnings.warn`, which ``-W`` does
    not see: make it a Sphinx warning (every other warning is shown as Python shows it)."""
    if "numpydoc" in filename.replace("\\", "/").split("/"):
        logger.warning("%s", message, type="numpydoc")
    else:
        _showwarning(message, category, filename, lineno, file, line)


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the directive, the coverage check and its config value."""
    warnings.showwarning = show_numpydoc_warning
    autosummary.extract_summary = extract_summary  # (looked up at call time by autosummary's tables)
    app.add_config_value("hpctp_api_modules", [], "env", [list])
    app.add_directive("hpctp-supported", SupportedDirective)
    app.connect("autodoc-process-bases", drop_private_bases)
    app.connect("env-check-consistency", check_coverage)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
