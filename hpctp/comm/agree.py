"""Agreement on the arguments of a collective call: every rank must pass the same ones.

A collective call whose ranks name different files, datasets, splits or roots reads mixed or
uninitialised data, writes only rank 0's choice, or hangs. :func:`agree_arguments` compares
a digest of each argument across ranks in the one ``Allgather`` that also agrees on the local
validation result (where a call already agreed on errors, it takes that message's place).
"""

from __future__ import annotations

import reprlib
import zlib
from collections.abc import Mapping

import numpy as np
from mpi4py import MPI

from . import trace as T
from .collectives import raise_if_any

__all__ = ["agree_arguments", "digest"]

_SHORT = reprlib.Repr()  # arguments in messages: long enough for a path or a Layout, not for an array
_SHORT.maxstring = _SHORT.maxother = 200


def _canonical(value: object) -> object:
    """A value whose ``repr`` is the same for equal arguments on every rank."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        data = np.asarray(value, order="C")
        return ("ndarray", data.dtype.str, data.shape, zlib.crc32(data.tobytes()))
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _canonical(v)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return tuple(_canonical(v) for v in value)
    if type(value).__repr__ is object.__repr__:  # the default repr holds an address: compare the type only
        return type(value).__qualname__
    return repr(value)


def digest(value: object) -> int:
    """Local. A 32-bit digest of ``value`` that is equal on ranks that passed equal arguments.

    Numbers compare by value (``np.int64(2)`` like ``2``), sequences and mappings by their
    items, arrays by dtype, shape and bytes, other objects by ``repr`` (by type when their
    ``repr`` is the default one, which holds an address).
    """
    try:
        text = repr(_canonical(value))
    except Exception:  # noqa: BLE001 - an odd object still gets a digest (its type)
        text = type(value).__qualname__
    return zlib.crc32(text.encode(errors="replace"))


def agree_arguments(
    comm: MPI.Intracomm, what: str, error: Exception | None, *, fixes: Mapping[str, str] | None = None,
    **arguments: object,
) -> None:  # fmt: skip
    """Collective over ``comm``. Agree on a local validation result and on the arguments.

    One ``Allgather`` of ``1 + len(arguments)`` int64 per rank. If a rank's ``error`` is set,
    the first failing rank's error is raised on every rank (as :func:`raise_if_any`);
    otherwise, if an argument differs between ranks, a ValueError naming it is raised on
    every rank.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
    what : str
        The call, for the message (e.g. ``"load_hdf5"``).
    error : Exception or None
        This rank's local validation result.
    fixes : mapping of str to str, optional
        What to do when an argument differs, by its name, added to the message (for arguments that the
        caller did not pass itself, such as the state of torch's generator).
    **arguments
        The arguments that must be the same on every rank (see :func:`digest`).

    Raises
    ------
    Exception
        ``error`` of the lowest failing rank, on every rank.
    ValueError
        If an argument differs between ranks (on every rank).
    """
    names = list(arguments)
    row = np.array([0 if error is None else 1] + [digest(arguments[n]) for n in names], dtype=np.int64)
    table = np.empty((comm.Get_size(), row.size), dtype=np.int64)
    # control traffic: not counted by CommCounter (it counts the data an op moves), but a flight-recorder entry
    # of its own type: it is where a rank that skipped or failed validation leaves the others waiting
    e = T.begin(comm, "Agree", row.nbytes, row, detail=what) if T.on and comm.Get_size() > 1 else None
    comm.Allgather(row, table)
    if e is not None:
        T.end(e)
    if table[:, 0].any():
        raise_if_any(comm, error)  # every rank sees the same flags, so every rank enters
    differ = [n for i, n in enumerate(names) if (table[:, 1 + i] != table[0, 1 + i]).any()]
    if differ:
        ranks = [r for r in range(table.shape[0]) if (table[r, 1:] != table[0, 1:]).any()]
        mine = ", ".join(f"{n}={_SHORT.repr(arguments[n])}" for n in differ)
        hints = "".join(f"; {fixes[n]}" for n in differ if fixes and n in fixes)
        raise ValueError(
            f"{what}: ranks passed different {', '.join(differ)} (rank 0 and rank(s) {ranks} differ; "
            f"rank {comm.Get_rank()} has {mine}); a collective call needs the same arguments on every rank{hints}"
        )
