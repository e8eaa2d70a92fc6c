"""The planner's machine: :mod:`hpctp.machine`'s profiles, re-exported under their planner names.

The machine model lives in :mod:`hpctp.machine` (a room below :mod:`hpctp.linalg` and :mod:`hpctp.nn`, so the
runtime's automatic choices price on the machine the planner prices on): :class:`MachineProfile`, machine files
(:func:`load_machine`, :func:`profile_from_dict`), the published profiles (:func:`published_machines`) and
:func:`collective_time` are :mod:`hpctp.machine.profile`'s.
"""

from __future__ import annotations

from ..machine.model import Machine
from ..machine.profile import (
    COMPUTE_KEYS,
    KINDS,
    LEVELS,
    MACHINES_DIR,
    OPTIONAL_COMPUTE_KEYS,
    SOURCES,
    ComputeRates,
    Link,
    MachineProfile,
    collective_time,
    load_machine,
    profile_from_dict,
    published_machines,
)

__all__ = [
    "COMPUTE_KEYS",
    "KINDS",
    "LEVELS",
    "MACHINES_DIR",
    "OPTIONAL_COMPUTE_KEYS",
    "SOURCES",
    "Machine",
    "ComputeRates",
    "Link",
    "MachineProfile",
    "collective_time",
    "load_machine",
    "profile_from_dict",
    "published_machines",
]
