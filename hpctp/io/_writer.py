"""The collective, atomic write protocol shared by :func:`save_hdf5` and :func:`save_checkpoint`.

1. Rank 0 validates the target, creates a temporary file next to it (copying the objects
   of an existing file that are kept), and lays out every dataset (``prepare``).
2. Every rank writes its hyperslabs (``write``): all together through the MPI-IO driver,
   or without it one rank after another, handing a token from rank to rank.
3. Rank 0 fsyncs and renames the temporary file onto the final name.

A job killed mid-save leaves its temporary file (never the final name) behind; the next save
to the same path deletes it once it is an hour old (:func:`~hpctp.io._files.remove_stale_temps`).

Errors of any rank at any stage are agreed on (:func:`hpctp.comm.raise_if_any`), the
temporary file is removed and the final name is never touched, so a failed save leaves
the previous file as it was.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence

import h5py

from .. import comm as C
from ..comm import ProcessGrid
from ..comm.io_calls import bcast_bytes, pass_turn, wait_turn
from ._files import commit, open_local, remove_quietly, remove_stale_temps, temp_path

__all__ = ["atomic_write", "MODES"]

MODES = ("a", "w", "x")
Writer = Callable[[h5py.File], None]


def atomic_write(
    grid: ProcessGrid,
    path: str,
    *,
    mode: str,
    prepare: Writer,
    write: Writer | None,
    method: str,
    replace: Sequence[str] = (),
) -> None:
    """Collective over grid. Write one HDF5 file atomically (see the module docstring).

    Parameters
    ----------
    grid : ProcessGrid
    path : str
        Final file name. If it is a symbolic link, the link is kept and the file it points
        to is replaced; an existing file's permissions carry over to the new one.
    mode : {"a", "w", "x"}
        ``"a"``: keep the objects of an existing file except ``replace``; ``"w"``: a new
        file replaces any old one; ``"x"``: fail if ``path`` exists.
    prepare : callable
        Run on rank 0 with the open temporary file: create datasets, write small data.
    write : callable or None
        This rank's hyperslab writes into the open temporary file (None: nothing here).
    method : {"mpio", "serial"}
        Resolved write method.
    replace : sequence of str
        Object paths of an existing file not to copy (they are re-created by ``prepare``);
        replacing an existing group is refused (ValueError), so no group is lost by accident.

    Raises
    ------
    FileNotFoundError, FileExistsError, OSError, ValueError, KeyError
        On every rank, with the temporary file removed and ``path`` untouched.
    """
    path = os.path.realpath(path)  # a symbolic link stays: the file it points to is replaced
    tmp = _prepare_on_root(grid, path, mode, prepare, replace)
    error = _write_mpio(grid, tmp, write) if method == "mpio" else _write_in_turns(grid, tmp, write)
    if C.all_true(grid.comm, error is None):
        if grid.rank == 0:
            try:
                if os.path.exists(path):
                    os.chmod(tmp, _mode_of(path))  # the new file keeps the old one's permissions
                commit(tmp, path)
            except Exception as e:  # noqa: BLE001 - every failure must reach every rank
                error = OSError(f"could not move the new file into place at {path}: {e}")
                remove_quietly(tmp)
    elif grid.rank == 0:
        remove_quietly(tmp)  # before the agreement below, so no rank returns while it exists
    C.raise_if_any(grid.comm, error)


def _prepare_on_root(grid: ProcessGrid, path: str, mode: str, prepare: Writer, replace: Sequence[str]) -> str:
    error: Exception | None = None
    tmp = ""
    if grid.rank == 0:
        try:
            tmp = _create_temp(path, mode, prepare, replace)
        except Exception as e:  # noqa: BLE001
            error = e
    C.raise_if_any(grid.comm, error)
    return bcast_bytes(grid.comm, tmp.encode() if grid.rank == 0 else None).decode()


def _mode_of(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _create_temp(path: str, mode: str, prepare: Writer, replace: Sequence[str]) -> str:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES} ('a': add to / update an existing file)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path}: directory {folder} does not exist; create it first")
    if os.path.isdir(path):
        raise IsADirectoryError(f"cannot write {path}: it is a directory")
    exists = os.path.exists(path)
    if exists and mode == "x":
        raise FileExistsError(f"{path} exists and mode='x'; use mode='a' to update it or 'w' to replace it")
    remove_stale_temps(path)  # left by saves to this path that were killed
    tmp = temp_path(path)
    # never more open than an existing file while the hidden temporary is written (HDF5's
    # truncating open keeps the inode and its mode); the owner may write; exact mode at commit
    perms = (_mode_of(path) if exists else 0o666) | 0o600
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, perms))
    try:
        if exists and mode == "a":
            with open_local(path, "r") as src, h5py.File(tmp, "w") as dst:
                for name in replace:
                    if isinstance(src.get(name), h5py.Group):
                        raise ValueError(f"{path}: {name!r} is an existing group; choose another dataset name")
                copy_except(src, dst, {"/" + r.strip("/") for r in replace})
                prepare(dst)
        else:
            with h5py.File(tmp, "w") as dst:
                prepare(dst)
    except BaseException:
        remove_quietly(tmp)
        raise
    return tmp


def copy_except(src: h5py.Group, dst: h5py.Group, skip: set[str]) -> None:
    """Local. Copy attributes and members of ``src`` into ``dst``, leaving out the paths in ``skip``."""
    for key in src.attrs:
        dst.attrs.create(key, src.attrs[key], dtype=src.attrs.get_id(key).dtype)
    for name in src:
        link = src.get(name, getlink=True)
        full = f"{src.name.rstrip('/')}/{name}"
        if full in skip:
            continue
        if isinstance(link, (h5py.SoftLink, h5py.ExternalLink)):
            dst[name] = link
            continue
        obj = src[name]
        if isinstance(obj, h5py.Group) and any(s.startswith(full + "/") for s in skip):
            copy_except(obj, dst.create_group(name), skip)
        else:
            src.copy(obj, dst, name=name)


def write_turn(tmp: str, write: Writer) -> None:
    """Local. One rank's turn of the serial protocol: open the temporary file, write, close."""
    with h5py.File(tmp, "r+") as f:
        write(f)


def _write_in_turns(grid: ProcessGrid, tmp: str, write: Writer | None) -> Exception | None:
    """This rank's error (or None); ranks after a failed one skip their turn."""
    ok = wait_turn(grid.comm)
    error: Exception | None = None
    if ok and write is not None:
        try:
            write_turn(tmp, write)
        except Exception as e:  # noqa: BLE001
            error = e
    pass_turn(grid.comm, ok and error is None)
    return error


def _write_mpio(grid: ProcessGrid, tmp: str, write: Writer | None) -> Exception | None:
    """This rank's error (or None): collective open, independent hyperslab writes, collective close."""
    error: Exception | None = None
    f = None
    try:
        f = h5py.File(tmp, "r+", driver="mpio", comm=grid.comm)
    except Exception as e:  # noqa: BLE001
        error = e
    if not C.all_true(grid.comm, error is None):
        if f is not None:
            f.close()
        return error or OSError(f"another rank could not open {tmp} with the MPI-IO driver")
    try:
        if write is not None:
            write(f)  # datasets were allocated early by rank 0, so no collective metadata change
    except Exception as e:  # noqa: BLE001
        error = e
    finally:
        f.close()  # type: ignore[union-attr]  # collective
    return error
