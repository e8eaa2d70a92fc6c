"""The machine model: what a computation and a message cost on a machine, for the planner and the runtime alike.

Pure data and arithmetic (numpy; no MPI, no torch): the rooms above price with it, :mod:`hpctp.linalg` and
:mod:`hpctp.nn` their automatic choices, :mod:`hpctp.perf` its plans.

* :class:`MachineProfile` (:mod:`hpctp.machine.profile`): per-rank compute rates per element type and the cost of
  each kind of message per link level, read from machine files (:func:`load_machine`; the published profiles:
  :func:`published_machines`) or measured by :func:`hpctp.perf.calibrate`;
* :class:`Machine` (:mod:`hpctp.machine.model`): the alpha-beta-gamma record of the SUMMA and attention cost models
  (:mod:`hpctp.linalg.cost`), which :meth:`MachineProfile.cost_machine` gives;
* :func:`default_machine` and :func:`use_machine` (:mod:`hpctp.machine.default`): the profile the runtime's
  automatic choices (attention's ``schedule="auto"``, SUMMA's ``panel="auto"``) price with, through
  :func:`runtime_cost_machine`: ``HPCTP_MACHINE`` or the device's default, or the planner's machine inside its dry
  runs.
"""

from .default import (
    CPU_MACHINE,
    DEFAULT_CPU,
    DEFAULT_GPU,
    ENVIRONMENT,
    default_machine,
    dtype_name,
    machine_names,
    machine_setting,
    resolve_machine,
    runtime_cost_machine,
    use_machine,
)
from .model import Machine
from .profile import (
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
    # model.py
    "Machine",
    # profile.py
    "COMPUTE_KEYS",
    "KINDS",
    "LEVELS",
    "MACHINES_DIR",
    "OPTIONAL_COMPUTE_KEYS",
    "SOURCES",
    "ComputeRates",
    "Link",
    "MachineProfile",
    "collective_time",
    "load_machine",
    "profile_from_dict",
    "published_machines",
    # default.py
    "CPU_MACHINE",
    "DEFAULT_CPU",
    "DEFAULT_GPU",
    "ENVIRONMENT",
    "default_machine",
    "dtype_name",
    "machine_names",
    "machine_setting",
    "resolve_machine",
    "runtime_cost_machine",
    "use_machine",
]
