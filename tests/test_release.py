"""The release's one version and its files: ``hpctp.__version__`` is the installed metadata's, which is
setup.cfg's, which CMakeLists.txt reads and the C header's macros repeat; the licence and the changelog
name it. (tools/check_release.sh, run by CI, builds and installs the wheel itself.)"""

from __future__ import annotations

import configparser
import re
from importlib import metadata
from pathlib import Path

import hpctp

ROOT = Path(__file__).resolve().parents[1]


def _setup_cfg_version() -> str:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg["metadata"]["version"]


def test_one_version_everywhere() -> None:
    version = _setup_cfg_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), f"setup.cfg's version {version!r} is not X.Y.Z (PEP 440 release)"
    assert hpctp.__version__ == metadata.version("hpctp") == version, (
        f"hpctp.__version__ {hpctp.__version__}, installed metadata {metadata.version('hpctp')}, setup.cfg {version}: "
        "reinstall (make install) after changing setup.cfg"
    )
    header = (ROOT / "capi" / "hpctp.h").read_text()
    macros = [re.search(rf"^#define HPCTP_VERSION_{part} (\d+)$", header, re.M) for part in ("MAJOR", "MINOR", "PATCH")]
    assert all(macros), "capi/hpctp.h lacks one of HPCTP_VERSION_MAJOR/MINOR/PATCH"
    assert ".".join(m.group(1) for m in macros if m) == version
    # CMake takes its project version from setup.cfg's line, not a copy of its own
    assert "project(hpctp_capi VERSION ${HPCTP_VERSION}" in (ROOT / "CMakeLists.txt").read_text()


def test_licence_and_changelog() -> None:
    licence = (ROOT / "LICENSE").read_text()
    assert licence.startswith("BSD 3-Clause License") and "Neither the name of the copyright holder" in licence
    assert metadata.metadata("hpctp")["License"] == "BSD-3-Clause"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    # Keep a Changelog: an Unreleased section, then one per version, newest first, this version among them
    versions = re.findall(r"^## \[([^\]]+)\]", changelog, re.M)
    assert versions[:1] == ["Unreleased"] and _setup_cfg_version() in versions, versions


def test_citation_and_install_name_the_version() -> None:
    """The README's BibTeX and install line and CITATION.cff cite the version being released."""
    version = _setup_cfg_version()
    readme = (ROOT / "README.md").read_text()
    assert f"version = {{{version}}}" in readme, "README's BibTeX entry names another version"
    assert f"hpctp-{version}-py3-none-any.whl" in readme, "README's install line names another wheel"
    assert re.search(rf"^version: {re.escape(version)}$", (ROOT / "CITATION.cff").read_text(), re.M)


def test_readme_is_a_doorway() -> None:
    """At most 200 lines, no dated runs (a figure's date lives on its benchmark page), at most 8 headline rows,
    and every relative link leads to a file of the repository."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, f"README.md has {len(readme.splitlines())} lines (at most 200)"
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", readme)
    assert not dates, f"README.md names dates {dates}: move them to the benchmark pages"
    glance = readme.split("## Performance at a glance", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in glance.splitlines() if line.startswith("| [")]
    assert 1 <= len(rows) <= 8, f"{len(rows)} headline rows (at most 8)"
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme)
    missing = sorted({link for link in links if not (ROOT / link).exists()})
    assert not missing, f"README.md links to missing files: {missing}"
