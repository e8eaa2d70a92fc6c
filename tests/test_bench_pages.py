"""The benchmark pages: benchmarks/plots.py (the results files' schema, one PNG per plot spec), every committed
results file valid and shown by its page, every page in the benchmarks' toctree, and the Sphinx directive."""

from __future__ import annotations

import copy
import json
import re
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "benchmarks"
RESULTS = PAGES / "results"
#: the pages the benchmarks' index must list (docs/benchmarks/<name>.rst, results/<name>.json)
NAMES = {
    "conv", "fno", "fft", "stencil", "io", "matmul", "moves", "trace_overhead", "gpu",
    "attention", "memory", "pipeline", "planner", "surrogate", "neuraloperator", "online",
}  # fmt: skip


plots = load_script("benchmarks/plots.py", "bench_plots_under_test")


def _results() -> dict[str, Any]:
    return {
        "benchmark": "demo",
        "title": "Demo",
        "command": "mpiexec -n 2 python benchmarks/demo.py",
        "script": "benchmarks/demo.py",
        "machine": "2-core x86-64 CI machine",
        "date": "2026-12-01 to 2026-12-02",
        "measures": "time per step of `demo` against numpy, in the same run",
        "tables": [
            {"caption": "times", "columns": ["", "time"], "rows": [["hpctp", "1.0 s"], ["numpy", "2.0 s"]]},
        ],
        "plots": [
            {"file": "demo_bar.png", "kind": "bar", "title": "bars", "xlabel": "", "ylabel": "s",
             "x": ["a", "b", "c"], "series": {"hpctp": [1.0, 2.0, None], "numpy": [2, 3, 4]}, "hline": 1.0},
            {"file": "demo_barh.png", "kind": "barh", "title": "ratios", "xlabel": "ratio", "ylabel": "",
             "x": ["a long label", "b"], "series": {"ratio": [0.5, 2.0]}, "logy": True, "hline": 1.0},
            {"file": "demo_line.png", "kind": "line", "title": "scaling", "xlabel": "n", "ylabel": "s",
             "x": [256, 512, 1024], "series": {"t": [0.1, 0.8, 6.4]}, "logx": True, "logy": True,
             "xticks_rotation": 30},
            {"file": "demo_scatter.png", "kind": "scatter", "title": "predicted vs measured", "xlabel": "measured",
             "ylabel": "predicted", "x": [1.0, 2.0, 3.5], "series": {"plans": [1.1, 1.9, None]}, "logx": False,
             "logy": False, "hline": None},
        ],
    }  # fmt: skip


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def test_draw_writes_one_png_per_spec(tmp_path: Path) -> None:
    results = _results()
    paths = plots.draw(results, tmp_path / "out")
    assert [p.name for p in paths] == ["demo_bar.png", "demo_barh.png", "demo_line.png", "demo_scatter.png"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in paths)  # no temp files
    # 120 dpi: 7 x 4 inches, horizontal bars 8 inches wide
    assert _png_size(paths[0]) == (840, 480)
    assert _png_size(paths[1])[0] == 960
    assert _png_size(paths[2]) == (840, 480)
    assert results == _results()  # drawing does not change the results


def test_load_reads_a_valid_file_and_the_command_line_draws_it(tmp_path: Path) -> None:
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(_results()), encoding="utf-8")
    assert plots.load(path) == _results()
    assert plots.main([str(path), "--out", str(tmp_path / "png")]) == 0
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == [
        "demo_bar.png", "demo_barh.png", "demo_line.png", "demo_scatter.png",
    ]  # fmt: skip


def _set(path: str, value: Any) -> Any:
    """A change of the demo results: ``value`` at ``path`` (keys and indices split by '/'; DELETE removes it)."""

    def change(results: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        obj: Any = results
        for key in parents:
            obj = obj[int(key)] if isinstance(obj, list) else obj[key]
        key = int(last) if isinstance(obj, list) else last
        if value is DELETE:
            del obj[key]
        else:
            obj[key] = value

    return change


DELETE = object()
MALFORMED = {
    "missing key": (_set("date", DELETE), "missing key 'date'"),
    "unknown top-level key": (_set("notes", "x"), r"unknown key\(s\) 'notes'"),
    "bad date": (_set("date", "5 Dec 2026"), r"\.date: '5 Dec 2026'"),
    "table row length": (_set("tables/0/rows/1", ["numpy"]), r"tables\[0\]\.rows\[1\]: 1 cells for 2 columns"),
    "table cell not a string": (_set("tables/0/rows/0/1", 1.0), r"tables\[0\]\.rows\[0\]"),
    "unknown kind": (_set("plots/0/kind", "pie"), r"plots\[0\]\.kind: unknown kind 'pie'"),
    "series length": (_set("plots/0/series/numpy", [1, 2]), r"plots\[0\]\.series\['numpy'\]: 2 values for 3"),
    "series value": (_set("plots/0/series/numpy", [1, "2", 3]), r"plots\[0\]\.series\['numpy'\]\[1\]"),
    "plot key missing": (_set("plots/1/ylabel", DELETE), r"plots\[1\]: missing key 'ylabel'"),
    "plot key unknown": (_set("plots/1/color", "red"), r"plots\[1\]: unknown key\(s\) 'color'"),
    "file with a folder": (_set("plots/2/file", "../x.png"), r"plots\[2\]\.file"),
    "same file twice": (_set("plots/1/file", "demo_bar.png"), r"plots\[1\]\.file: 'demo_bar.png' is also plots\[0\]"),
    "scatter of categories": (_set("plots/3/x", ["a", "b", "c"]), r"plots\[3\]\.x: a scatter plot needs numeric x"),
    "log x on bars": (_set("plots/0/logx", True), r"plots\[0\]\.logx"),
    "zero on a log axis": (_set("plots/1/series/ratio", [0.0, 1.0]), r"plots\[1\]\.series\['ratio'\]\[0\]"),
    "hline not a number": (_set("plots/0/hline", "1"), r"plots\[0\]\.hline"),
    "tables not a list": (_set("tables", {}), r"\.tables: expected list"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_results_raise_naming_the_key(case: str, tmp_path: Path) -> None:
    change, message = MALFORMED[case]
    results = copy.deepcopy(_results())
    change(results)
    with pytest.raises(ValueError, match=message):
        plots.validate(results, "demo")
    with pytest.raises(ValueError, match=message):  # draw validates before drawing anything
        plots.draw(results, tmp_path)
    assert not list(tmp_path.iterdir())
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(results), encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        plots.load(path)


def test_load_refuses_bad_json_a_duplicate_key_and_a_file_named_otherwise(tmp_path: Path) -> None:
    (tmp_path / "demo.json").write_text('{"benchmark": "demo",', encoding="utf-8")
    with pytest.raises(ValueError, match="demo.json: not JSON"):
        plots.load(tmp_path / "demo.json")
    (tmp_path / "demo.json").write_text('{"benchmark": "demo", "benchmark": "demo"}', encoding="utf-8")
    with pytest.raises(ValueError, match="duplicate key 'benchmark'"):
        plots.load(tmp_path / "demo.json")
    (tmp_path / "other.json").write_text(json.dumps(_results()), encoding="utf-8")
    with pytest.raises(ValueError, match="other.json: results.benchmark: 'demo'; name the file demo.json"):
        plots.load(tmp_path / "other.json")
    with pytest.raises(FileNotFoundError):
        plots.load(tmp_path / "missing.json")


def test_command_line_refuses_two_files_drawing_the_same_png(tmp_path: Path) -> None:
    for name in ("demo", "demo2"):
        results = _results()
        results["benchmark"] = name
        (tmp_path / f"{name}.json").write_text(json.dumps(results), encoding="utf-8")
    with pytest.raises(ValueError, match="plot file 'demo_bar.png' is also drawn by"):
        plots.main([str(tmp_path / "demo.json"), str(tmp_path / "demo2.json"), "--out", str(tmp_path / "png")])
    assert not (tmp_path / "png").exists()


def _toctree(index: str) -> list[str]:
    """The entries of the toctree directives of an rst file."""
    entries: list[str] = []
    for block in re.findall(r"^\.\. toctree::\n((?:[ \t]+.*\n|\n)*)", index, re.M):
        entries += [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith(":")]
    return entries


def test_every_results_file_is_valid_and_shown_by_its_page() -> None:
    files = sorted(RESULTS.glob("*.json"))
    assert files, RESULTS
    for path in files:
        results = plots.load(path)
        page = PAGES / f"{path.stem}.rst"
        assert page.is_file(), f"{path.name} has no page {page.relative_to(ROOT)}"
        text = page.read_text(encoding="utf-8")
        assert f".. bench-results:: results/{path.name}" in text, f"{page.name} does not show {path.name}"
        assert "\nReproduce\n---------" in text and "\nWhat the figures mean\n" in text, page.name
        assert results["plots"], f"{path.name} has no plot"
    for page in PAGES.glob("*.rst"):  # and every page's directive names a file that exists
        for arg in re.findall(r"^\.\. bench-results:: (\S+)", page.read_text(encoding="utf-8"), re.M):
            assert (PAGES / arg).is_file(), f"{page.name}: no {arg}"


def test_every_page_is_in_the_benchmarks_toctree() -> None:
    entries = _toctree((PAGES / "index.rst").read_text(encoding="utf-8"))
    pages = {p.stem for p in PAGES.glob("*.rst")} - {"index"}
    assert len(entries) == len(set(entries)), entries
    assert pages <= set(entries), f"pages missing from docs/benchmarks/index.rst: {sorted(pages - set(entries))}"
    assert set(entries) == NAMES, sorted(set(entries) ^ NAMES)
    assert "benchmarks/index" in _toctree((ROOT / "docs" / "index.rst").read_text(encoding="utf-8"))


def _build(src: Path, page: str) -> tuple[int, str, Path]:
    """A small Sphinx project with the directive: (exit status, warnings, output folder)."""
    sphinx_app = pytest.importorskip("sphinx.application")
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        (src / "index.rst").write_text(page, encoding="utf-8")
        conf = 'extensions = ["hpctp_bench"]\nhpctp_bench_plots = "_plots"\n'
        (src / "conf.py").write_text(conf, encoding="utf-8")
        out = src / "_build"
        warnings: list[str] = []

        class Sink:
            def write(self, text: str) -> None:
                warnings.append(text)

            def flush(self) -> None:
                pass

        app = sphinx_app.Sphinx(str(src), str(src), str(out), str(out / ".doctrees"), "html",
                                status=None, warning=Sink(), freshenv=True)  # fmt: skip
        app.build()
        return app.statuscode, "".join(warnings), out
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))


def test_directive_renders_fields_tables_and_figures(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "demo.json").write_text(json.dumps(_results()), encoding="utf-8")
    status, warnings, out = _build(tmp_path, "Demo\n====\n\n.. bench-results:: results/demo.json\n")
    assert status == 0 and "WARNING" not in warnings and "ERROR" not in warnings, warnings
    html = (out / "index.html").read_text(encoding="utf-8")
    for text in ("Command", "mpiexec -n 2 python benchmarks/demo.py", "2026-12-01 to 2026-12-02", "1.0 s"):
        assert text in html, text
    assert '<code class="docutils literal notranslate"><span class="pre">demo</span></code>' in html  # `demo`
    pngs = ["demo_bar.png", "demo_barh.png", "demo_line.png", "demo_scatter.png"]
    assert sorted(p.name for p in (tmp_path / "_plots" / "demo").iterdir()) == pngs  # hpctp_bench_plots
    assert sorted(p.name for p in (out / "_images").iterdir()) == pngs
    # a broken or missing file is an error that fails the build, with or without -W
    (tmp_path / "results" / "demo.json").write_text(json.dumps({**_results(), "date": "soon"}), encoding="utf-8")
    status, warnings, _ = _build(tmp_path, "Demo\n====\n\n.. bench-results:: results/demo.json\n")
    assert status == 1 and "demo.json" in warnings and "results.date" in warnings, warnings
    status, warnings, _ = _build(tmp_path, "Demo\n====\n\n.. bench-results:: results/none.json\n")
    assert status == 1 and "none.json" in warnings, warnings


def test_dump_writes_a_file_that_loads_back_and_command_drops_json(tmp_path: Path) -> None:
    path = plots.dump(_results(), tmp_path / "sub" / "demo.json")
    assert plots.load(path) == _results()
    assert '"rows": [\n        ["hpctp", "1.0 s"],' in path.read_text(encoding="utf-8")  # a list of scalars per line
    with pytest.raises(ValueError, match="missing key 'title'"):
        plots.dump({k: v for k, v in _results().items() if k != "title"}, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()
    argv = ["--size", "32", "--json", "out.json", "--json=x.json", "--name", "a b"]
    assert (
        plots.command("benchmarks/conv.py", argv, 2) == "mpiexec -n 2 python benchmarks/conv.py --size 32 --name 'a b'"
    )
    assert plots.command("benchmarks/memory.py", [], None) == "python benchmarks/memory.py"
