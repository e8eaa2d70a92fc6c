"""The ``HPCTP_*`` environment settings, parsed strictly.

The GPU paths read ``HPCTP_DEVICE`` and ``HPCTP_CUDA_AWARE``; the flight recorder
(:mod:`hpctp.comm.trace`, :mod:`hpctp.debug`) reads ``HPCTP_TRACE`` (ring entries),
``HPCTP_WATCHDOG`` (seconds), ``HPCTP_CHECK`` (boolean) and ``HPCTP_TRACE_DIR`` (where dumps
and reports go); the runtime's automatic choices price on ``HPCTP_MACHINE`` (a machine file or a
profile's name, :func:`hpctp.machine.machine_setting`). A typo in a batch script
(``HPCTP_CUDA_AWARE=2``, ``HPCTP_DEVICE=gpu1``, ``HPCTP_WATCHDOG=5min``, ``HPCTP_MACHINE=h100``) is an
error naming the variable and its accepted values, not a silent fallback. :class:`~hpctp.ProcessGrid`
checks them all when it is built, collectively, so a bad value on one rank raises on every rank.
"""

from __future__ import annotations

import os

from ..machine import machine_setting

__all__ = [
    "DEBUG_VARIABLES",
    "check_setting",
    "cuda_aware_setting",
    "device_setting",
    "environment_error",
    "flag_set",
    "trace_dir_setting",
    "trace_setting",
    "watchdog_setting",
]

DEBUG_VARIABLES = ("HPCTP_TRACE", "HPCTP_WATCHDOG", "HPCTP_CHECK", "HPCTP_TRACE_DIR")
"""The variables of the flight recorder, the hang watchdog and the mismatch check (``hpctp info`` lists them)."""

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


def trace_setting() -> int | None:
    """Local. ``HPCTP_TRACE`` as the number of entries of the flight recorder's ring; None when unset
    or empty, 0 when off.

    Raises
    ------
    ValueError
        If the value is not a non-negative integer.
    """
    raw = os.environ.get("HPCTP_TRACE", "")
    value = raw.strip()
    if not value:
        return None
    if not value.isdecimal():
        raise ValueError(
            f"HPCTP_TRACE={raw!r} is not a number of entries; set it to an integer >= 0 (the last N MPI calls "
            f"each rank keeps, e.g. 2000; 0 turns the flight recorder off), or leave it unset"
        )
    return int(value)


def watchdog_setting() -> float | None:
    """Local. ``HPCTP_WATCHDOG`` in seconds; None when unset, empty or 0 (no watchdog).

    Raises
    ------
    ValueError
        If the value is not a non-negative number of seconds.
    """
    raw = os.environ.get("HPCTP_WATCHDOG", "")
    value = raw.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(
            f"HPCTP_WATCHDOG={raw!r} is not a number of seconds; set it to the longest time a rank may wait in "
            f"one MPI call before the job is reported and ended (e.g. 600), 0 or unset for no watchdog"
        )
    return seconds or None


def check_setting() -> bool:
    """Local. ``HPCTP_CHECK`` as a bool (unset or empty: False).

    Raises
    ------
    ValueError
        If the value is not one of 0/1, false/true, no/yes, off/on (any case).
    """
    raw = os.environ.get("HPCTP_CHECK", "")
    value = raw.strip().lower()
    if not value or value in _FALSE:
        return False
    if value in _TRUE:
        return True
    raise ValueError(
        f"HPCTP_CHECK={raw!r} is not a boolean; set it to 1 (compare each collective's operation, size, dtype "
        f"and root across the ranks before it runs) or 0, or leave it unset"
    )


def trace_dir_setting() -> str | None:
    """Local. ``HPCTP_TRACE_DIR``, the directory of the recorder's dumps and reports; None when unset or empty."""
    return os.environ.get("HPCTP_TRACE_DIR", "").strip() or None


def environment_error() -> ValueError | None:
    """Local. The first bad ``HPCTP_*`` setting as a ValueError, or None when all parse."""
    try:
        cuda_aware_setting()
        device_setting()
        trace_setting()
        watchdog_setting()
        check_setting()
        machine_setting()
    except ValueError as e:
        return e
    return None
