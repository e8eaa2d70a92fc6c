"""TOML configuration files with ``section.key=value`` overrides (the apps' ``--set``, ``hpctp plan --set``)."""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["read_toml", "apply_overrides"]


def read_toml(path: str | Path) -> dict[str, Any]:
    """Local. The TOML file at ``path``.

    Raises
    ------
    FileNotFoundError
        If it does not exist, or is a directory.
    ValueError
        On invalid TOML, naming the file.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"config file {p} {'is a directory: give a .toml file in it' if p.is_dir() else 'not found'}"
        )
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {p}: {e}") from None


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare string


def apply_overrides(config: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Local. A copy of ``config`` with ``section.key=value`` overrides (values in TOML syntax, else a bare string).

    Raises
    ------
    ValueError
        If an override is not ``key=value`` or names an unknown section or key (the known ones listed).
    """
    out = copy.deepcopy(dict(config))
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value")
        key, text = item.split("=", 1)
        *path, leaf = key.strip().split(".")
        node = out
        for p in path:
            if p not in node or not isinstance(node[p], dict):
                raise ValueError(f"override {item!r}: unknown section {p!r} (known: {sorted(node)})")
            node = node[p]
        if leaf not in node:
            raise ValueError(f"override {item!r}: unknown key {leaf!r} (known: {sorted(node)})")
        node[leaf] = _parse_value(text.strip())
    return out
