"""Every example in hpctp's docstrings runs (``doctest``), on one rank, and shows what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import hpctp


def _modules() -> list[str]:
    """Every module of the package (private ones too: their classes and functions are public elsewhere)."""
    return sorted(
        ["hpctp"] + [m.name for m in pkgutil.walk_packages(hpctp.__path__, "hpctp.") if not m.name.endswith("__main__")]
    )


def _examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    found: list[doctest.DocTest] = []
    for name in _modules():
        module = importlib.import_module(name)
        found += [t for t in finder.find(module, name) if t.examples]
    return sorted(found, key=lambda t: t.name)


EXAMPLES = _examples()


def test_the_examples_are_found_and_none_is_skipped() -> None:
    """The collector finds the examples (a broken walk would pass with none), and none opts out of running."""
    names = {t.name for t in EXAMPLES}
    for wanted in ("hpctp.nn.distributed.sharded.ShardedDataParallel", "hpctp.linalg.matmul.matmul",
                   "hpctp.comm.counter.CommCounter", "hpctp.halo.exchange.HaloExchange"):  # fmt: skip
        assert wanted in names, f"{wanted}'s example was not collected: {sorted(names)}"
    skipped = [t.name for t in EXAMPLES for e in t.examples if e.options.get(doctest.SKIP)]
    assert not skipped, f"docstring examples marked '# doctest: +SKIP' do not run: {skipped}; make them run"


@pytest.mark.parametrize("test", EXAMPLES, ids=[t.name for t in EXAMPLES])
def test_docstring_example_runs(test: doctest.DocTest) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    lines: list[str] = []
    result = runner.run(test, out=lines.append)
    assert result.failed == 0, f"the example of {test.name} ({test.filename}:{test.lineno}) fails:\n" + "".join(lines)
