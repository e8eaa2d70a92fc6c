"""The machine the runtime's automatic choices price with: one machine model for the runtime and the planner.

The runtime chooses some things itself by pricing them: the schedule of
``hpctp.nn.functional.attention(..., schedule="auto")`` and the panel width of ``hpctp.matmul(..., panel="auto")``.
It prices them with the cost models of :mod:`hpctp.linalg.cost` on the alpha-beta-gamma machine
:func:`runtime_cost_machine` gives: :func:`default_machine`'s :meth:`~hpctp.machine.MachineProfile.cost_machine` of
the link level of the grid axes that carry the messages and of the tensors' element type, the function the planner
(:mod:`hpctp.perf`) prices with. :func:`default_machine` is, first to last:

* the profile of the innermost :func:`use_machine` block (the planner runs its dry runs on a virtual grid inside one,
  so the choices it sees there are the ones it prices);
* ``HPCTP_MACHINE``: a machine file (``hpctp perf calibrate --out machine.toml`` writes one for this machine) or the
  name of a profile (:func:`machine_names`: the published ones and ``"cpu"``), read once per value; a value that
  names neither is an error naming the value and the fix (:func:`machine_setting`; a
  :class:`~hpctp.ProcessGrid` checks it when it is built, on every rank);
* the device's: :data:`DEFAULT_GPU` where torch sees a CUDA device, else :data:`CPU_MACHINE` (hpctp's own default
  figures, those of :class:`hpctp.machine.Machine`'s defaults, so a CPU run chooses as it always did).

A choice is computed from arguments every rank shares and from this machine, so it is one choice on every rank
where the ranks price on one machine: give every rank the same ``HPCTP_MACHINE`` and enter :func:`use_machine` on
every rank alike.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from pathlib import Path

from .model import Machine
from .profile import KINDS, ComputeRates, Link, MachineProfile, load_machine, published_machines

__all__ = [
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

ENVIRONMENT = "HPCTP_MACHINE"
"""The environment variable naming the machine the runtime prices with (a machine file or a profile's name)."""
DEFAULT_GPU = "h100-ndr"
"""The published profile :func:`default_machine` gives where torch sees a CUDA device (the planner's default too)."""
DEFAULT_CPU = "cpu"
"""The name of :data:`CPU_MACHINE` (``HPCTP_MACHINE=cpu``)."""

_FIGURES = Machine()
_CPU_RATES = ComputeRates(
    gemm=1.0 / _FIGURES.gamma, gemm_half=_FIGURES.gemm_half, conv=1.0 / _FIGURES.gamma, fft=1.0 / _FIGURES.gamma,
    attention=1.0 / _FIGURES.gamma, bandwidth=1.0 / _FIGURES.beta, kernel=5e-6,
)  # fmt: skip
_CPU_LINKS = {kind: Link(_FIGURES.alpha, _FIGURES.beta) for kind in KINDS}

CPU_MACHINE = MachineProfile(
    name="CPU ranks (hpctp's default figures: 2 us and 5 GB/s per message, 10 GFLOP/s per rank)",
    source="builtin",
    ranks_per_node=1,
    memory_bytes=0,
    compute={"float64": _CPU_RATES, "float32": _CPU_RATES},
    network={"intra": _CPU_LINKS, "inter": _CPU_LINKS},
    note="the figures of hpctp.machine.Machine()'s defaults, on every link and for every element type: what the "
    "runtime's automatic choices price with on CPUs unless HPCTP_MACHINE names a measured machine",
)
"""Local. The profile :func:`default_machine` gives on CPUs: :class:`~hpctp.machine.Machine`'s default figures
(``alpha`` 2 us, ``beta`` 1 / (5 GB/s), 10 GFLOP/s) for every link level, message kind and element type. A measured
machine (``HPCTP_MACHINE=machine.toml``, from ``hpctp perf calibrate``) prices better."""

_CHOSEN: contextvars.ContextVar[MachineProfile | None] = contextvars.ContextVar("hpctp_machine", default=None)
_SIBLINGS = {"float16": "bfloat16", "bfloat16": "float16"}
_gpu: bool | None = None


def machine_names() -> tuple[str, ...]:
    """Local. The names ``HPCTP_MACHINE`` and :func:`resolve_machine` accept besides a file: the published profiles
    (:func:`~hpctp.machine.published_machines`) and :data:`DEFAULT_CPU`."""
    return tuple(sorted((*published_machines(), DEFAULT_CPU)))


def resolve_machine(machine: str | Path) -> MachineProfile:
    """Local. The profile a machine file or a name of :func:`machine_names` gives.

    Raises
    ------
    FileNotFoundError
        If ``machine`` is neither a file nor a name (naming the published profiles).
    ValueError
        On an invalid machine file (naming the key and what is allowed).
    """
    if isinstance(machine, str) and machine.strip() == DEFAULT_CPU:
        return CPU_MACHINE
    return load_machine(machine)


@lru_cache(maxsize=16)
def _setting(raw: str) -> MachineProfile:
    value = raw.strip()
    hint = (
        f"set it to the path of a machine file ('hpctp perf calibrate --out machine.toml' measures this machine and "
        f"writes one) or to one of {', '.join(machine_names())}, or leave it unset ({DEFAULT_GPU} on GPUs, "
        f"{DEFAULT_CPU} on CPUs)"
    )
    try:
        return resolve_machine(value)
    except FileNotFoundError:
        raise ValueError(f"{ENVIRONMENT}={raw!r} is neither a machine file nor a machine's name; {hint}") from None
    except (ValueError, OSError) as e:
        raise ValueError(f"{ENVIRONMENT}={raw!r} is not a valid machine file ({e}); fix the file, or {hint}") from None


def machine_setting() -> MachineProfile | None:
    """Local. ``HPCTP_MACHINE`` as a profile (the file read once per value); None when unset or empty.

    Raises
    ------
    ValueError
        If the value is neither a readable, valid machine file nor a name of :func:`machine_names` (naming the
        value and the fix).
    """
    raw = os.environ.get(ENVIRONMENT, "")
    if not raw.strip():
        return None
    return _setting(raw)


def _has_gpu() -> bool:
    """Whether torch sees a CUDA device (False while torch is not imported: nothing runs on a GPU yet)."""
    global _gpu
    if _gpu is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        _gpu = bool(torch.cuda.is_available())
    return _gpu


@lru_cache(maxsize=1)
def _gpu_machine() -> MachineProfile:
    return load_machine(DEFAULT_GPU)


def default_machine() -> MachineProfile:
    """Local. The machine the runtime's automatic choices price with (see the module docstring for which).

    Returns
    -------
    MachineProfile
        The same object on every call with the same setting, so callers may cache by it.

    Raises
    ------
    ValueError
        On a bad ``HPCTP_MACHINE`` (:func:`machine_setting`).

    Examples
    --------
    >>> from hpctp.machine import default_machine, use_machine
    >>> with use_machine("a100-hdr") as m:
    ...     default_machine() is m
    True
    """
    chosen = _CHOSEN.get()
    if chosen is not None:
        return chosen
    setting = machine_setting()
    if setting is not None:
        return setting
    return _gpu_machine() if _has_gpu() else CPU_MACHINE


@contextlib.contextmanager
def use_machine(machine: MachineProfile | str | Path) -> Iterator[MachineProfile]:
    """Local. A block inside which :func:`default_machine` is ``machine`` (a profile, a machine file or a name of
    :func:`machine_names`): the runtime's automatic choices inside it price on that machine. Blocks nest; each
    thread and task sees its own (a context variable).

    Yields
    ------
    MachineProfile

    Raises
    ------
    TypeError
        If ``machine`` is not a profile, a path or a name.
    FileNotFoundError, ValueError
        As :func:`resolve_machine`.
    """
    if isinstance(machine, MachineProfile):
        profile = machine
    elif isinstance(machine, (str, Path)):
        profile = resolve_machine(machine)
    else:
        raise TypeError(
            f"use_machine needs a MachineProfile, a machine file or a machine's name, got {type(machine).__name__}"
        )
    token = _CHOSEN.set(profile)
    try:
        yield profile
    finally:
        _CHOSEN.reset(token)


def dtype_name(dtype: object) -> str:
    """Local. The element type's name as machine files spell it (``"float32"``): of a numpy or cupy dtype, a torch
    dtype or a name."""
    name = getattr(dtype, "name", None)
    if isinstance(name, str):
        return name
    return str(dtype).removeprefix("torch.")


def _rates_of(profile: MachineProfile, dtype: str) -> str:
    """The element type whose rates price ``dtype``: its own, else its half-width sibling, else float32's."""
    if dtype in profile.compute:
        return dtype
    sibling = _SIBLINGS.get(dtype)
    if sibling in profile.compute:
        return sibling  # type: ignore[return-value]  # (in compute: a str)
    return "float32" if "float32" in profile.compute else sorted(profile.compute)[0]


def runtime_cost_machine(
    dims: Sequence[int], axes: Iterable[int], dtype: object, profile: MachineProfile | None = None
) -> Machine:
    """Local. The alpha-beta-gamma machine an automatic choice of the runtime prices with.

    ``profile.cost_machine(level, dtype)`` (:meth:`~hpctp.machine.MachineProfile.cost_machine`), as the planner
    prices: ``level`` is :meth:`~hpctp.machine.MachineProfile.level` of the grid axes ``axes`` (the axes its
    messages travel) of a grid of ``dims`` (``"intra"`` where the profile has no figures between nodes); a profile
    without rates for ``dtype`` prices it with its half-width sibling's (float16 and bfloat16) or else float32's.

    Parameters
    ----------
    dims : sequence of int
        The grid's dims (ranks row-major, as :class:`~hpctp.ProcessGrid` numbers them).
    axes : iterable of int
        The grid axes the messages travel.
    dtype : numpy, cupy or torch dtype, or str
    profile : MachineProfile, optional
        Default :func:`default_machine`.

    Returns
    -------
    Machine
    """
    prof = default_machine() if profile is None else profile
    level = prof.level(tuple(int(d) for d in dims), tuple(int(a) for a in axes))
    if level not in prof.network:
        level = "intra"
    return prof.cost_machine(level, _rates_of(prof, dtype_name(dtype)))
