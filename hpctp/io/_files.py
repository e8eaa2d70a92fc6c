"""File-level helpers of hpctp.io: driver choice, opening with clear errors, atomic commit.

Everything here is local to one rank; the collective protocols live in
:mod:`hpctp.io._writer` and the public functions.
"""

from __future__ import annotations

import glob
import os
import time
import uuid
import zlib
from typing import Any

import h5py
import numpy as np

__all__ = [
    "check_path",
    "IOKeyError",
    "METHODS",
    "mpio_available",
    "resolve_method",
    "check_readable",
    "open_checked",
    "open_local",
    "get_dataset",
    "temp_path",
    "remove_stale_temps",
    "STALE_TEMP_S",
    "commit",
    "remove_quietly",
    "check_dataset_name",
]

METHODS = ("auto", "mpio", "serial")
# a save's temporary file untouched this long belongs to a save that died (killed job, lost node)
STALE_TEMP_S = 3600.0


class IOKeyError(KeyError):
    """Local. A KeyError whose message prints as written (plain ``KeyError`` shows its repr)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def mpio_available() -> bool:
    """Local. True when h5py was built against parallel HDF5 (``h5py.get_config().mpi``)."""
    return bool(h5py.get_config().mpi)


def resolve_method(method: str, nranks: int) -> str:
    """Local. ``"mpio"`` or ``"serial"`` for a requested IO ``method``.

    ``"auto"`` picks the MPI-IO driver when h5py has it and more than one rank takes part.

    Raises
    ------
    ValueError
        On an unknown method, or ``"mpio"`` with an h5py built without MPI.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} must be one of {METHODS}")
    if method == "mpio" and not mpio_available():
        raise ValueError(
            "method='mpio' needs h5py built against parallel HDF5 (h5py.get_config().mpi is False); "
            "use method='auto' or 'serial', or install an MPI-enabled h5py"
        )
    if method == "auto":
        return "mpio" if mpio_available() and nranks > 1 else "serial"
    return method


def check_readable(path: str) -> None:
    """Local. Raise a clear error unless ``path`` is an existing HDF5 file.

    Raises
    ------
    FileNotFoundError
        If nothing exists at ``path``.
    IsADirectoryError
        If ``path`` is a directory.
    OSError
        If the file is not HDF5 (wrong signature: corrupt, truncated header or another format).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file; check the path (it is resolved on every rank)")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory, not an HDF5 file")
    if not h5py.is_hdf5(path):
        raise OSError(
            f"{path} is not an HDF5 file (no HDF5 signature: corrupt, truncated or another format); "
            f"re-create it, e.g. with hpctp.io.save_hdf5"
        )


def open_local(path: str, mode: str = "r", **kwargs: Any) -> h5py.File:
    """Local. Open ``path`` with the default (POSIX) driver, turning h5py errors into clear ones.

    Raises
    ------
    FileNotFoundError, OSError
        As :func:`check_readable` (read modes), or when HDF5 cannot open the file.
    """
    if mode in ("r", "r+"):
        check_readable(path)
    return open_checked(path, mode, **kwargs)


def open_checked(path: str, mode: str, **kwargs: Any) -> h5py.File:
    """Local (collective over ``comm`` with ``driver="mpio"``). ``h5py.File`` with errors naming ``path``.

    No checks before the open, so every rank of an MPI-IO open reaches it.

    Raises
    ------
    FileNotFoundError, OSError
        When HDF5 cannot open the file.
    """
    try:
        return h5py.File(path, mode, **kwargs)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise OSError(f"cannot open {path} as HDF5 (mode {mode!r}): {e}; the file may be corrupt or truncated") from e


def get_dataset(f: h5py.File, name: str, path: str) -> h5py.Dataset:
    """Local. The dataset ``name`` of an open file, or a KeyError that lists what is there.

    Raises
    ------
    KeyError
        If ``name`` is missing or is not a dataset.
    ValueError
        If the dataset has a null dataspace (``h5py.Empty``: no shape, no data).
    """
    try:
        obj = f.get(name)
    except (OSError, ValueError, KeyError) as e:  # broken link, bad name
        raise IOKeyError(f"{path}: cannot access {name!r}: {e}") from None
    if obj is None:
        have = sorted(_dataset_names(f))
        shown = ", ".join(have[:20]) + (", ..." if len(have) > 20 else "")
        raise IOKeyError(f"{path} has no dataset {name!r}; datasets in the file: [{shown}]")
    if not isinstance(obj, h5py.Dataset):
        raise IOKeyError(f"{path}: {name!r} is a {type(obj).__name__}, not a dataset")
    if obj.shape is None:
        raise ValueError(f"{path}: {name!r} has a null dataspace (h5py.Empty): it holds no array to load")
    return obj


def native_dtype(ds: h5py.Dataset) -> np.dtype:
    """Local. The dataset's numpy dtype in native byte order (HDF5 converts on read).

    Files written big-endian (e.g. by a Fortran code, or h5py with ``'>f4'``) load as the native
    dtype, which torch requires and which compares equal to a requested ``dtype=``.
    """
    return ds.dtype.newbyteorder("=")


def _dataset_names(f: h5py.File) -> list[str]:
    names: list[str] = []

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset):
            names.append(name)

    f.visititems(visit)
    return names


def check_path(path: object) -> str:
    """Local. A file path (str, bytes or os.PathLike) as a str.

    Raises
    ------
    TypeError
        If ``path`` is none of those (e.g. None).
    """
    try:
        return os.fsdecode(path)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} {path!r}") from None


def check_dataset_name(name: object) -> str:
    """Local. Validate a dataset path inside a file (``"u"``, ``"fields/u"``).

    Raises
    ------
    TypeError
        If ``name`` is not a str.
    ValueError
        If it is empty, the root group, or has empty/``.`` components.
    """
    if not isinstance(name, str):
        raise TypeError(f"dataset name must be a str, got {type(name).__name__}")
    parts = name.strip("/").split("/")
    if not name.strip("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid dataset name {name!r}: use a non-empty path like 'u' or 'fields/u'")
    return "/".join(parts)


def temp_path(path: str) -> str:
    """Local. A fresh hidden name in ``path``'s directory (same file system, so rename is atomic)."""
    d, base = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{_temp_stem(base)}.tmp-{uuid.uuid4().hex[:16]}")


def _temp_stem(base: str) -> str:
    """``base``, or for a name over 200 bytes its first 190 bytes and a checksum of the whole,
    so the temp name of any legal file name fits NAME_MAX (255 bytes)."""
    raw = base.encode()
    if len(raw) <= 200:
        return base
    return f"{raw[:190].decode(errors='ignore')}~{zlib.crc32(raw):08x}"


def remove_stale_temps(path: str, max_age_s: float = STALE_TEMP_S) -> list[str]:
    """Local. Delete temporary files of earlier saves to ``path`` that died part way.

    A save in progress keeps writing its temporary file, so one not modified for
    ``max_age_s`` seconds is left over from a killed job; younger ones (perhaps another
    job's save in progress) are kept. Returns the removed names.
    """
    d, base = os.path.split(os.path.abspath(path))
    now = time.time()
    removed = []
    for name in glob.glob(os.path.join(glob.escape(d), f".{glob.escape(_temp_stem(base))}.tmp-*")):
        try:
            if now - os.path.getmtime(name) > max_age_s:
                os.remove(name)
                removed.append(name)
        except OSError:
            pass  # gone meanwhile, or not ours to delete
    return removed


def commit(tmp: str, path: str) -> None:
    """Local. Make ``tmp`` durable, then atomically rename it to ``path``.

    ``path`` either keeps its old content or gets the complete new file, even if the
    process dies part way.
    """
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    try:  # make the rename itself durable; not supported everywhere
        dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def remove_quietly(path: str | None) -> None:
    """Local. Delete ``path`` if it exists; ignore errors (cleanup after a failure)."""
    if path:
        try:
            os.remove(path)
        except OSError:
            pass
