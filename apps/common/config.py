"""TOML configuration with ``--set section.key=value`` command-line overrides."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpctp._util.toml_config import apply_overrides, read_toml

__all__ = ["load_config", "apply_overrides", "DEFAULT_CONFIG"]

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.toml"


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Local. Read a TOML config (the default one if ``path`` is None) and apply overrides.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        On invalid TOML or overrides.
    """
    return apply_overrides(read_toml(path if path is not None else DEFAULT_CONFIG), overrides)
