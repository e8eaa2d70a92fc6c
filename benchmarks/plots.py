"""The benchmark pages' results files: validate them and draw their plots (matplotlib, Agg).

Usage::

    python benchmarks/plots.py --out /tmp/plots                          # every docs/benchmarks/results/*.json
    python benchmarks/plots.py docs/benchmarks/results/conv.json --out /tmp/plots

Each benchmark page of the docs (``docs/benchmarks/<name>.rst``) shows the figures of one file,
``docs/benchmarks/results/<name>.json``: the command, what is measured, the machine, the date, tables of
strings as printed and plot specs of numbers. :func:`load` reads and validates one file, :func:`draw`
draws its plots, one PNG per spec, :func:`dump` writes one (the benchmark scripts' ``--json PATH``); the
docs' extension (``docs/_ext/hpctp_bench.py``) calls ``load`` and ``draw`` at build time. Schema (every key
required unless marked optional; no other keys)::

    benchmark   str: the file's stem
    title       str
    command     str: the command that produced the figures
    script      str: the script, a path from the repository root
    machine     str
    date        str: "YYYY-MM-DD" or "YYYY-MM-DD to YYYY-MM-DD"
    measures    str: what is timed or measured, against what
    tables      list of {caption: str, columns: [str], rows: [[str]]}, each row as long as columns
    plots       list of {file: "NAME.png", kind: "bar" | "barh" | "line" | "scatter", title: str,
                         xlabel: str, ylabel: str, x: [str | number], series: {label: [number | null]},
                         logx: bool (optional), logy: bool (optional), hline: number | null (optional),
                         xticks_rotation: number (optional)}

``bar`` draws grouped bars (one bar per series at each x category), ``barh`` the same horizontally (for
long labels: x runs down the value axis's side), ``line`` one line with markers per series (x numeric or
categories), ``scatter`` numeric x against each numeric series. ``hline`` is a reference value drawn as a
dashed line across the value axis (1.0 for a ratio); ``null`` in a series is a missing point. ``xlabel`` and
``ylabel`` name the horizontal and the vertical axis as drawn (for ``barh``: the values and the categories);
``logy`` makes the value axis logarithmic (the horizontal one for ``barh``), ``logx`` the numeric x axis of
``line`` and ``scatter``. Bars are labelled with their values; a legend appears with two series or more.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import textwrap
from pathlib import Path
from typing import Any

__all__ = ["KINDS", "command", "draw", "dump", "load", "machine", "main", "today", "validate"]

#: the plot kinds a spec may name
KINDS = ("bar", "barh", "line", "scatter")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "benchmarks" / "results"

_TOP: dict[str, type] = {
    "benchmark": str,
    "title": str,
    "command": str,
    "script": str,
    "machine": str,
    "date": str,
    "measures": str,
    "tables": list,
    "plots": list,
}
_TABLE: dict[str, type] = {"caption": str, "columns": list, "rows": list}
_PLOT: dict[str, type] = {
    "file": str,
    "kind": str,
    "title": str,
    "xlabel": str,
    "ylabel": str,
    "x": list,
    "series": dict,
}
_PLOT_OPTIONAL = frozenset({"logx", "logy", "hline", "xticks_rotation"})
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}( to \d{4}-\d{2}-\d{2})?")
_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\.png")


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _keys(obj: Any, where: str, required: dict[str, type], optional: frozenset[str] = frozenset()) -> None:
    """Local. ``obj`` is a dict with every required key of the right type and no unknown key."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
    for key, kind in required.items():
        if key not in obj:
            raise ValueError(f"{where}: missing key {key!r} (required: {', '.join(required)})")
        if not isinstance(obj[key], kind):
            raise ValueError(f"{where}.{key}: expected {kind.__name__}, got {type(obj[key]).__name__}")
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        allowed = ", ".join([*required, *sorted(optional)])
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (allowed: {allowed})")


def _strings(values: Any, where: str) -> None:
    if not all(isinstance(v, str) for v in values):
        bad = next(v for v in values if not isinstance(v, str))
        raise ValueError(f"{where}: every entry must be a string (as printed, units included), got {bad!r}")


def _validate_table(t: Any, where: str) -> None:
    _keys(t, where, _TABLE)
    if not t["columns"]:
        raise ValueError(f"{where}.columns: empty; give the column headers")
    _strings(t["columns"], f"{where}.columns")
    for r, row in enumerate(t["rows"]):
        if not isinstance(row, list):
            raise ValueError(f"{where}.rows[{r}]: expected a list of strings, got {type(row).__name__}")
        if len(row) != len(t["columns"]):
            raise ValueError(
                f"{where}.rows[{r}]: {len(row)} cells for {len(t['columns'])} columns; give one string per column"
            )
        _strings(row, f"{where}.rows[{r}]")


def _validate_plot(p: Any, where: str) -> None:
    _keys(p, where, _PLOT, _PLOT_OPTIONAL)
    if not _FILE.fullmatch(p["file"]):
        raise ValueError(f"{where}.file: {p['file']!r} is not a plain file name ending in .png (no folders)")
    if p["kind"] not in KINDS:
        raise ValueError(f"{where}.kind: unknown kind {p['kind']!r}; one of {', '.join(KINDS)}")
    n = len(p["x"])
    if n == 0:
        raise ValueError(f"{where}.x: empty; give the categories or values along x")
    numeric_x = all(_is_number(v) for v in p["x"])
    if not numeric_x and not all(isinstance(v, str) for v in p["x"]):
        raise ValueError(f"{where}.x: all numbers or all strings (categories), got {p['x']!r}")
    if p["kind"] == "scatter" and not numeric_x:
        raise ValueError(f"{where}.x: a scatter plot needs numeric x, got {p['x']!r}")
    if p.get("logx") and p["kind"] in ("bar", "barh"):
        raise ValueError(f"{where}.logx: {p['kind']} plots have categories along x; use logy for the value axis")
    if p.get("logx") and not numeric_x:
        raise ValueError(f"{where}.logx: a log x axis needs numeric x, got {p['x']!r}")
    if not p["series"]:
        raise ValueError(f"{where}.series: empty; give at least one series {{label: [values]}}")
    for name, values in p["series"].items():
        if not isinstance(values, list):
            raise ValueError(f"{where}.series[{name!r}]: expected a list of numbers, got {type(values).__name__}")
        if len(values) != n:
            raise ValueError(
                f"{where}.series[{name!r}]: {len(values)} values for {n} x values; give one per x (null where missing)"
            )
        for i, v in enumerate(values):
            if v is not None and not _is_number(v):
                raise ValueError(f"{where}.series[{name!r}][{i}]: expected a finite number or null, got {v!r}")
            if v is not None and p.get("logy") and v <= 0:
                raise ValueError(f"{where}.series[{name!r}][{i}]: {v} on a log axis; give a positive value")
    for key in ("logx", "logy"):
        if key in p and not isinstance(p[key], bool):
            raise ValueError(f"{where}.{key}: expected true or false, got {p[key]!r}")
    if p.get("hline") is not None and not _is_number(p["hline"]):
        raise ValueError(f"{where}.hline: expected a number or null, got {p['hline']!r}")
    if "xticks_rotation" in p and not _is_number(p["xticks_rotation"]):
        raise ValueError(f"{where}.xticks_rotation: expected a number of degrees, got {p['xticks_rotation']!r}")


def validate(results: Any, where: str = "results") -> dict[str, Any]:
    """Local. Check a results object against the schema (the module docstring).

    Parameters
    ----------
    results
        The parsed JSON object.
    where
        How errors name the object (a file name).

    Returns
    -------
    dict
        ``results`` itself.

    Raises
    ------
    ValueError
        Naming the first key that is missing, unknown or of the wrong type or length.
    """
    _keys(results, where, _TOP)
    if not _DATE.fullmatch(results["date"]):
        raise ValueError(f"{where}.date: {results['date']!r}; give YYYY-MM-DD or 'YYYY-MM-DD to YYYY-MM-DD'")
    for key in ("benchmark", "title", "command", "script", "machine", "measures"):
        if not results[key].strip():
            raise ValueError(f"{where}.{key}: empty")
    for i, t in enumerate(results["tables"]):
        _validate_table(t, f"{where}.tables[{i}]")
    files = [p.get("file") if isinstance(p, dict) else None for p in results["plots"]]
    for i, p in enumerate(results["plots"]):
        _validate_plot(p, f"{where}.plots[{i}]")
        if files.index(p["file"]) != i:
            raise ValueError(f"{where}.plots[{i}].file: {p['file']!r} is also plots[{files.index(p['file'])}]'s")
    return results


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Local. Read one results file and validate it (its ``benchmark`` must be the file's stem).

    Parameters
    ----------
    path
        A ``<name>.json`` file.

    Returns
    -------
    dict
        The validated results.

    Raises
    ------
    ValueError
        If the file is not JSON, has a duplicate key, or breaks the schema (the message names the key).
    FileNotFoundError
        If there is no such file.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        results = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    try:
        validate(results)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if results["benchmark"] != path.stem:
        raise ValueError(
            f"{path}: results.benchmark: {results['benchmark']!r}; name the file {results['benchmark']}.json"
        )
    return results


def _compact(text: str) -> str:
    """Lists of scalars (table rows, x, series) on one line each."""
    scalar = r'(?:"(?:[^"\\]|\\.)*"|-?[0-9][0-9.eE+-]*|null|true|false)'
    pattern = re.compile(r"\[\n(?:\s*" + scalar + r",?\n)+\s*\]")

    def join(m: re.Match[str]) -> str:
        return "[" + ", ".join(line.strip().rstrip(",") for line in m.group(0)[1:-1].splitlines() if line.strip()) + "]"

    return pattern.sub(join, text)


def command(script: str, argv: list[str], ranks: int | None) -> str:
    """Local. The command line of a results file: ``mpiexec -n RANKS python SCRIPT ARGV``, without ``--json PATH``.

    Parameters
    ----------
    script
        The script's path from the repository root.
    argv
        Its arguments (``sys.argv[1:]``).
    ranks
        The rank count; None: a plain ``python`` command.
    """
    import shlex

    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip or arg.startswith("--json="):
            skip = False
            continue
        if arg == "--json":
            skip = True
            continue
        kept.append(arg)
    launch = "python" if ranks is None else f"mpiexec -n {ranks} python"
    return f"{launch} {script} {shlex.join(kept)}".strip()


def machine(threads: str) -> str:
    """Local. The ``machine`` of a results file written now: this host's architecture, CPU count and load, and
    ``threads`` (how the run used them)."""
    import platform

    return f"{platform.machine()} host with {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {threads}"


def today() -> str:
    """Local. The ``date`` of a results file written now."""
    import datetime

    return datetime.date.today().isoformat()


def header(benchmark: str, title: str, ranks: int | None, threads: str, measures: str) -> dict[str, Any]:
    """Local. The keys of a results file that a benchmark script's run fills in the same way everywhere: the
    ``benchmark`` and ``title``, the ``command`` of this run (:func:`command` of ``sys.argv``), the ``script``
    (``benchmarks/BENCHMARK.py``), the ``machine`` (:func:`machine` with ``threads``), today's ``date`` and what it
    ``measures``; the script adds its ``tables`` and ``plots``."""
    import sys

    script = f"benchmarks/{benchmark}.py"
    return {
        "benchmark": benchmark,
        "title": title,
        "command": command(script, sys.argv[1:], ranks),
        "script": script,
        "machine": machine(threads),
        "date": today(),
        "measures": measures,
    }


def dump(results: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Local. Validate ``results`` and write it as a results file (2-space JSON, each list of scalars on one line).

    Parameters
    ----------
    results
        A results object; its ``benchmark`` is the file's stem when the file is read back by :func:`load`.
    path
        The file to write (its folder is created if missing).

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    ValueError
        If ``results`` breaks the schema (nothing is written then).
    """
    validate(results)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_compact(json.dumps(results, indent=2, ensure_ascii=False)) + "\n", encoding="utf-8")
    return path


def _values(values: list[Any]) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def _draw_one(spec: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter, NullLocator

    class _PlainLog(LogFormatter):
        """matplotlib's choice of labelled ticks on a log axis, written as plain numbers."""

        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    kind, x, series = spec["kind"], spec["x"], spec["series"]
    numeric_x = all(_is_number(v) for v in x)
    height = max(3.2, 0.42 * len(x) * (1 + 0.5 * (len(series) - 1)) + 1.4) if kind == "barh" else 4.0
    fig, ax = plt.subplots(figsize=(8.0 if kind == "barh" else 7.0, height), layout="constrained")
    try:
        hline = spec.get("hline")
        if kind in ("bar", "barh"):
            pos = list(range(len(x)))
            width = 0.8 / len(series)
            for k, (name, values) in enumerate(series.items()):
                at = [p - 0.4 + width * (k + 0.5) for p in pos]
                vals = _values(values)
                bars = (
                    ax.barh(at, vals, height=width, label=name)
                    if kind == "barh"
                    else ax.bar(at, vals, width, label=name)
                )
                ax.bar_label(bars, labels=["" if v is None else f"{v:g}" for v in values], padding=2, fontsize=8)
            if kind == "barh":
                ax.set_yticks(pos, [str(v) for v in x])
                ax.invert_yaxis()  # the first category on top, as in the table
                ax.margins(x=0.12)
            else:
                ax.set_xticks(pos, [str(v) for v in x])
                ax.margins(y=0.12)
        elif kind == "line":
            xs = [float(v) for v in x] if numeric_x else list(range(len(x)))
            for name, values in series.items():
                ax.plot(xs, _values(values), marker="o", label=name)
            if not numeric_x:
                ax.set_xticks(xs, [str(v) for v in x])
        else:  # scatter
            for name, values in series.items():
                ax.scatter([float(v) for v in x], _values(values), label=name)
        if hline is not None:
            (ax.axvline if kind == "barh" else ax.axhline)(hline, color="0.35", linestyle="--", linewidth=1)
        logs: list[Any] = []
        if spec.get("logx"):
            ax.set_xscale("log")
            logs.append(ax.xaxis)
        if spec.get("logy"):
            (ax.set_xscale if kind == "barh" else ax.set_yscale)("log")
            logs.append(ax.xaxis if kind == "barh" else ax.yaxis)
        for axis in logs:  # plain numbers (0.5, 20), not powers of ten, at the decades and between them
            axis.set_major_formatter(_PlainLog())
            axis.set_minor_formatter(_PlainLog(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        if kind == "line" and numeric_x and len(x) <= 12:  # tick at each measured x, written plainly
            ax.set_xticks([float(v) for v in x], [f"{v:g}" for v in x])
            ax.xaxis.set_minor_locator(NullLocator())
        if "xticks_rotation" in spec:
            ax.tick_params(axis="x", labelrotation=spec["xticks_rotation"])
        fig.suptitle(textwrap.fill(spec["title"], 80), fontsize=11)  # over the figure: barh labels shift the axes
        ax.set_xlabel(spec["xlabel"])
        ax.set_ylabel(spec["ylabel"])
        ax.grid(True, which="both" if spec.get("logy") else "major", axis="x" if kind == "barh" else "y", alpha=0.3)
        ax.set_axisbelow(True)
        if len(series) > 1:  # below the axes, where it hides no bar or point
            ncols = max(1, min(len(series), 3, 100 // (max(map(len, series)) + 6)))  # as many as fit across
            fig.legend(loc="outside lower center", ncols=ncols, fontsize=8, frameon=False)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
        fig.savefig(tmp, dpi=120, metadata={"Software": None})
        os.replace(tmp, path)  # whole or not at all, for a reader in another process
    finally:
        plt.close(fig)


def draw(results: dict[str, Any], out: str | os.PathLike[str]) -> list[Path]:
    """Local. Draw every plot spec of ``results`` into ``out`` (created if missing), one PNG per spec.

    Parameters
    ----------
    results
        A results object (validated first).
    out
        The folder the PNGs go to, named by each spec's ``file``.

    Returns
    -------
    list of Path
        The PNGs, in the order of ``results["plots"]``.

    Raises
    ------
    ValueError
        If ``results`` breaks the schema.
    """
    validate(results, str(results.get("benchmark", "results")) if isinstance(results, dict) else "results")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for spec in results["plots"]:
        path = out / spec["file"]
        _draw_one(spec, path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Local. The command line: validate the given results files (default: all) and draw their plots into ``--out``."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("files", nargs="*", type=Path, help=f"results files (default: {RESULTS.relative_to(ROOT)}/*.json)")
    p.add_argument("--out", type=Path, required=True, help="folder for the PNGs")
    args = p.parse_args(argv)
    files = args.files or sorted(RESULTS.glob("*.json"))
    if not files:
        p.error(f"no results files in {RESULTS}")
    loaded = [load(f) for f in files]  # every file valid before anything is drawn
    owner: dict[str, Path] = {}
    for f, results in zip(files, loaded):
        for spec in results["plots"]:
            if spec["file"] in owner:
                raise ValueError(f"{f}: plot file {spec['file']!r} is also drawn by {owner[spec['file']]}")
            owner[spec["file"]] = f
    for f, results in zip(files, loaded):
        for path in draw(results, args.out):
            print(f"{f.name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
