"""TOML configuration with ``--set section.key=value`` command-line overrides."""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["load_config", "apply_overrides", "DEFAULT_CONFIG"]

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.toml"


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare string


def apply_overrides(config: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Local. A copy of ``config`` with ``section.key=value`` overrides (values in TOML syntax).

    Raises
    ------
    ValueError
        If an override is not ``key=value`` or names an unknown key.
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


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Local. Read a TOML config (the default one if ``path`` is None) and apply overrides.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        On invalid TOML or overrides.
    """
    p = Path(path) if path is not None else DEFAULT_CONFIG
    if not p.is_file():
        raise FileNotFoundError(f"config file {p} not found")
    try:
        config = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {p}: {e}") from None
    return apply_overrides(config, overrides)
