"""Sphinx extension of hpctp's benchmark pages: each page's figures from one results file.

``.. bench-results:: results/NAME.json`` (a path relative to the page, as for ``figure``) reads the
file with ``benchmarks/plots.py``'s ``load`` (the schema is that module's docstring) and renders:

* a field list: Command (a code block), Script, Measures, Machine, Date;
* every table, with its caption as the table's title;
* every plot as a figure, its title as the caption, drawn at build time by ``benchmarks/plots.py``'s
  ``draw`` into ``docs/benchmarks/_plots/NAME/`` (git-ignored; the config value ``hpctp_bench_plots``, a
  folder relative to the source folder, moves it), which the figure references, so Sphinx copies the PNG
  into the build.

Option ``:only:`` places the parts apart, so that a page may put prose between them: ``tables``
renders the field list and the tables, ``plots`` the figures. Strings of the file (the measures, the
machine, captions, table cells) may mark code with backticks (Markdown's single or rST's double) and
bold with ``**``; no other markup is read. A missing file or one that breaks the schema is an error at
the directive's line that fails the build whatever ``-W`` says (the exit status is set at the end, so
one build reports every bad file). The results file and ``benchmarks/plots.py`` are dependencies of
the page: an incremental build reads the page again when either changes.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

DOCS = Path(__file__).resolve().parent.parent
ROOT = DOCS.parent
PLOTS_PY = ROOT / "benchmarks" / "plots.py"

_INLINE = re.compile(r"``(.+?)``|`([^`]+)`|\*\*(.+?)\*\*")


def plots_module() -> ModuleType:
    """``benchmarks/plots.py`` (not a package: loaded from its path, once per process)."""
    name = "hpctp_bench_plots"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, PLOTS_PY)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {PLOTS_PY}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def inline(text: str) -> list[nodes.Node]:
    """Text with ``code`` (one or two backticks) and **bold** as docutils inline nodes."""
    out: list[nodes.Node] = []
    pos = 0
    for m in _INLINE.finditer(text):
        if m.start() > pos:
            out.append(nodes.Text(text[pos : m.start()]))
        code = m.group(1) or m.group(2)
        out.append(nodes.literal(code, code) if code is not None else nodes.strong(m.group(3), m.group(3)))
        pos = m.end()
    if pos < len(text):
        out.append(nodes.Text(text[pos:]))
    return out


def _paragraph(text: str) -> nodes.paragraph:
    return nodes.paragraph(text, "", *inline(text))


def _field(name: str, *body: nodes.Node) -> nodes.field:
    return nodes.field("", nodes.field_name(name, name), nodes.field_body("", *body))


def fields(results: dict[str, Any]) -> nodes.field_list:
    """The command, script, what is measured, the machine and the date."""
    command = nodes.literal_block(results["command"], results["command"], language="console")
    script = nodes.paragraph("", "", nodes.literal(results["script"], results["script"]))
    return nodes.field_list(
        "",
        _field("Command", command),
        _field("Script", script),
        _field("Measures", _paragraph(results["measures"])),
        _field("Machine", _paragraph(results["machine"])),
        _field("Date", nodes.paragraph(results["date"], results["date"])),
    )


def table(spec: dict[str, Any]) -> nodes.table:
    """One table of strings, its caption as the title; a column whose cells all start with a digit is right-aligned."""
    columns = spec["columns"]
    numeric = [
        bool(cells) and all(re.match(r"[-+−~<>≈]?\.?\d", c) for c in cells)
        for cells in ([row[j] for row in spec["rows"] if row[j].strip()] for j in range(len(columns)))
    ]
    group = nodes.tgroup(cols=len(columns))
    for _ in columns:
        group += nodes.colspec(colwidth=1)

    def row(cells: list[str], align: bool) -> nodes.row:
        out = nodes.row()
        for j, cell in enumerate(cells):
            entry = nodes.entry("", _paragraph(cell) if cell else nodes.paragraph())
            if align and numeric[j]:
                entry["classes"].append("text-right")
            out += entry
        return out

    group += nodes.thead("", row(columns, False))
    group += nodes.tbody("", *(row(r, True) for r in spec["rows"]))
    out = nodes.table("", nodes.title(spec["caption"], "", *inline(spec["caption"])), group)
    out["classes"].append("bench-table")
    return out


class BenchResults(SphinxDirective):
    """``.. bench-results:: results/NAME.json`` (see the module docstring)."""

    required_arguments = 1
    option_spec = {"only": lambda arg: directives.choice(arg, ("tables", "plots"))}

    def run(self) -> list[nodes.Node]:
        rel, path = self.env.relfn2path(self.arguments[0], self.env.docname)
        self.env.note_dependency(rel)
        self.env.note_dependency(str(PLOTS_PY))
        only = self.options.get("only")
        try:
            plots = plots_module()
            results = plots.load(path)
            folder = Path(self.env.srcdir) / self.config.hpctp_bench_plots / results["benchmark"]
            drawn = plots.draw(results, folder) if only in (None, "plots") else []
        except (OSError, ValueError) as e:
            logger.error(f"bench-results: {self.arguments[0]}: {e}", location=self.get_location())
            failed = getattr(self.env, "hpctp_bench_failed", {})
            self.env.hpctp_bench_failed = failed  # type: ignore[attr-defined]
            failed.setdefault(self.env.docname, []).append(f"{self.arguments[0]}: {e}")
            return []
        out: list[nodes.Node] = []
        if only in (None, "tables"):
            out.append(fields(results))
            out.extend(table(t) for t in results["tables"])
        if only in (None, "plots"):
            srcdir = Path(self.env.srcdir)
            for spec, png in zip(results["plots"], drawn):
                uri = "/" + png.relative_to(srcdir).as_posix()  # from the source folder: any page may show it
                image = nodes.image(uri=uri, alt=spec["title"])
                out.append(nodes.figure("", image, nodes.caption(spec["title"], spec["title"])))
        return out


def _merge(_app: Sphinx, env: Any, _docnames: Any, other: Any) -> None:
    """Parallel reads: the failures seen in the worker processes."""
    mine = getattr(env, "hpctp_bench_failed", {})
    mine.update(getattr(other, "hpctp_bench_failed", {}))
    env.hpctp_bench_failed = mine


def _purge(_app: Sphinx, env: Any, docname: str) -> None:
    getattr(env, "hpctp_bench_failed", {}).pop(docname, None)


def _finish(app: Sphinx, exception: Exception | None) -> None:
    """A bad or missing results file fails the build (exit status 1), with or without ``-W``."""
    failed = getattr(app.env, "hpctp_bench_failed", {}) if app.env is not None else {}
    if failed:
        errors = "; ".join(f"{doc}: {e}" for doc, errs in sorted(failed.items()) for e in errs)
        logger.error(f"bench-results: {sum(map(len, failed.values()))} bad results file(s): {errors}")
        app.statuscode = 1


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the directive and the bookkeeping of bad results files."""
    app.add_config_value("hpctp_bench_plots", "benchmarks/_plots", "env")
    app.add_directive("bench-results", BenchResults)
    app.connect("env-merge-info", _merge)
    app.connect("env-purge-doc", _purge)
    app.connect("build-finished", _finish)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
