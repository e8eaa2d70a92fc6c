"""The ``HPCTP_*`` environment settings of the GPU paths, parsed strictly.

A typo in a batch script (``HPCTP_CUDA_AWARE=2``, ``HPCTP_DEVICE=gpu1``) is an error naming
the variable and its accepted values, not a silent fallback. :class:`~hpctp.ProcessGrid`
checks both when it is built, collectively, so a bad value on one rank raises on every rank.
"""

from __future__ import annotations

import os

__all__ = ["cuda_aware_setting", "device_setting", "environment_error", "flag_set"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def flag_set(name: str) -> bool:
    """Local. Whether another library's boolean variable ``name`` is set to a true value
    (1/true/yes/on); anything else, unset included, reads as not set (it is not ours to refuse)."""
    return os.environ.get(name, "").strip().lower() in _TRUE


def cuda_aware_setting() -> bool | None:
    """Local. ``HPCTP_CUDA_AWARE`` as a bool; None when unset or empty (detect).

    Raises
    ------
    ValueError
        If the value is not one of 0/1, false/true, no/yes, off/on (any case).
    """
    raw = os.environ.get("HPCTP_CUDA_AWARE", "")
    value = raw.strip().lower()
    if not value:
        return None
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"HPCTP_CUDA_AWARE={raw!r} is not a boolean; set it to 1 (pass device buffers to MPI), "
        f"0 (stage through host memory), or leave it unset to detect"
    )


def device_setting() -> int | None:
    """Local. ``HPCTP_DEVICE`` as a device index; None when unset or empty (node-local rank).

    Raises
    ------
    ValueError
        If the value is not a non-negative integer.
    """
    raw = os.environ.get("HPCTP_DEVICE", "")
    value = raw.strip()
    if not value:
        return None
    if not value.isdecimal():
        raise ValueError(
            f"HPCTP_DEVICE={raw!r} is not a device index; set it to an integer >= 0 (a CUDA device "
            f"number as seen by this rank), or leave it unset to use the node-local rank"
        )
    return int(value)


def environment_error() -> ValueError | None:
    """Local. The first bad ``HPCTP_*`` setting as a ValueError, or None when all parse."""
    try:
        cuda_aware_setting()
        device_setting()
    except ValueError as e:
        return e
    return None
