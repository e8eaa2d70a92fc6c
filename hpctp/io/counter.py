"""Counters of the bytes hpctp's IO reads from and writes to HDF5 files, on this rank."""

from __future__ import annotations

from typing import Any

__all__ = ["IOCounter", "count_read", "count_write"]

_active: list[IOCounter] = []


class IOCounter:
    """Local. Context manager that counts the dataset bytes this rank reads and writes through :mod:`hpctp.io`.

    Every hyperslab read (:func:`hpctp.io.load_hdf5`, checkpoints, datasets) and write (saves,
    checkpoints) adds its payload, in the file's element size; file metadata is not counted.
    Counters nest: each active one counts.

    Attributes
    ----------
    bytes_read, bytes_written : int
    reads, writes : int
        Hyperslab reads and writes (HDF5 calls).

    Examples
    --------
    >>> import pathlib, tempfile, hpctp
    >>> from mpi4py import MPI
    >>> grid = hpctp.ProcessGrid([1], comm=MPI.COMM_SELF)  # this rank alone (its temporary directory is its own)
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "u.h5"
    >>> hpctp.io.save_hdf5(hpctp.ones((64, 64), grid, (0, None)), path, "u")
    >>> with IOCounter() as io:
    ...     u = hpctp.io.load_hdf5(path, "u", grid, (0, None))
    >>> io.bytes_read, io.reads
    (32768, 1)
    >>> grid.free()
    """

    def __init__(self) -> None:
        self.bytes_read = self.bytes_written = self.reads = self.writes = 0

    def __enter__(self) -> IOCounter:
        _active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.remove(self)


def count_read(nbytes: int) -> None:
    """Local. Add one read of ``nbytes`` to every active counter."""
    for c in _active:
        c.bytes_read += int(nbytes)
        c.reads += 1


def count_write(nbytes: int) -> None:
    """Local. Add one write of ``nbytes`` to every active counter."""
    for c in _active:
        c.bytes_written += int(nbytes)
        c.writes += 1
