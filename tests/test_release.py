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
