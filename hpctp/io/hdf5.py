"""Distributed HDF5 load and save: every rank reads or writes only its own hyperslab.

Chunk alignment
---------------
HDF5 reads and writes whole chunks. A hyperslab that cuts through chunks makes every rank
touching a chunk read (and decompress) all of it, and parallel writers of one chunk must
serialise. Files written by :func:`save_hdf5` with ``chunks="layout"`` (the default when
compressing) use the block shape of the writing layout as chunk shape, so each rank's
block is exactly one chunk (balanced splits; blocks may be one element larger than
chunks, which then straddle a boundary by one row). Reading on another grid stays correct
but may touch neighbouring chunks. Uncompressed files default to contiguous storage, where
any hyperslab maps to strided reads with no waste beyond the file system's blocks.
Reads go into preallocated arrays with ``read_direct`` (no temporary copies).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import h5py
import numpy as np

from .. import comm as C
from .._util.backend import BACKENDS, from_numpy, numpy_dtype, to_numpy
from .._util.dtypes import dtype_name
from .._util.ints import is_int
from ..comm import ProcessGrid, check_grid
from ..layout import Layout
from ..tensor.core import DistTensor
from ._files import (
    check_dataset_name,
    check_path,
    check_readable,
    get_dataset,
    native_dtype,
    open_checked,
    open_local,
    resolve_method,
)
from ._writer import atomic_write
from .counter import count_read, count_write

__all__ = [
    "load_hdf5",
    "save_hdf5",
    "open_for_read",
    "create_dataset",
    "read_block",
    "write_block",
    "layout_for",
    "block_chunks",
    "check_stored_dtype",
]

_MAX_CHUNK_BYTES = 64 * 2**20


def check_stored_dtype(ds: h5py.Dataset, path: str, dtype: object = None) -> np.dtype:
    """Local. The numpy dtype of a stored dataset, checked to be a tensor dtype (and ``dtype`` if given).

    Raises
    ------
    ValueError
        If the dataset holds a non-numeric type, or differs from the requested ``dtype``.
    """
    stored = native_dtype(ds)
    try:
        dtype_name(stored)
    except TypeError:
        raise ValueError(
            f"{path}:{ds.name} has HDF5 type {stored}, which is not a tensor dtype (bool, int, uint, float, complex)"
        ) from None
    if dtype is not None and numpy_dtype(dtype) != stored:
        raise ValueError(
            f"{path}:{ds.name} is stored as {stored} but dtype={dtype_name(dtype)} was requested; "
            f"omit dtype= to load it as stored and convert with .astype()"
        )
    return np.dtype(stored)


def layout_for(shape: tuple[int, ...], grid: ProcessGrid, split: object, where: str) -> Layout:
    """Local. The layout of a stored array of ``shape`` for ``split`` (a split spec or a Layout).

    Raises
    ------
    ValueError
        If ``split`` does not fit the array's dims, or a given Layout is for another shape or grid.
    """
    if isinstance(split, Layout):
        if split.grid_dims != grid.dims:
            raise ValueError(f"{where}: layout is for grid dims {split.grid_dims}, but the grid has dims {grid.dims}")
        if split.global_shape != tuple(shape):
            raise ValueError(
                f"{where} has shape {tuple(shape)} but the layout expects {split.global_shape}; "
                f"pass a split or a Layout for shape {tuple(shape)}"
            )
        return split
    try:
        return Layout(tuple(shape), grid.dims, split)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} has shape {tuple(shape)}: {e}") from None


def read_block(ds: h5py.Dataset, out: np.ndarray, selection: tuple[Any, ...], path: str) -> None:
    """Local. Read ``ds[selection]`` into the preallocated ``out`` (one ``H5Dread``).

    Raises
    ------
    OSError
        If HDF5 fails to read (e.g. a corrupt or truncated chunk), naming file and dataset.
    """
    if out.size == 0:
        return
    try:
        ds.read_direct(out, source_sel=selection)
    except (OSError, RuntimeError) as e:
        raise OSError(f"reading {path}:{ds.name} failed: {e}; the file may be corrupt or truncated") from e
    count_read(out.nbytes)


def write_block(ds: h5py.Dataset, data: np.ndarray, selection: tuple[Any, ...] | None = None) -> None:
    """Local. Write the contiguous ``data`` into ``ds[selection]`` (everything: None) with one ``H5Dwrite``."""
    if data.size == 0:
        return
    if selection is None:
        ds.write_direct(data)
    else:
        ds.write_direct(data, dest_sel=selection)
    count_write(data.nbytes)


def load_hdf5(
    path: str | os.PathLike[str],
    dataset: str,
    grid: ProcessGrid,
    split: object,
    *,
    index: int | None = None,
    like: str = "numpy",
    dtype: object = None,
    method: str = "auto",
) -> DistTensor:
    """Collective over grid. Load a stored array as a DistTensor; each rank reads only its block.

    Parameters
    ----------
    path : str or os.PathLike
        The HDF5 file (resolved on every rank).
    dataset : str
        Dataset path inside the file, e.g. ``"u"`` or ``"fields/u"``.
    grid : ProcessGrid
    split : split specification or Layout
        Grid axis per dim of the loaded tensor (after dropping ``index``'s dim), or a full
        :class:`~hpctp.layout.Layout` (e.g. uneven blocks of a simulation).
    index : int, optional
        Load only ``dataset[index]`` (one sample or time step of the leading dim); the
        result drops that dim. Negative values count from the end.
    like : {"numpy", "torch", "cuda", "cupy"}
        Backend of the blocks; the stored dtype is kept.
    dtype : dtype, optional
        Expected stored dtype; a different one is an error (nothing is converted).
    method : {"auto", "mpio", "serial"}
        ``"mpio"``: open with the MPI-IO driver (needs an MPI-enabled h5py); ``"serial"``:
        every rank opens the file read-only itself; ``"auto"``: mpio when available.

    Returns
    -------
    DistTensor
        Blocks read by their owners (replicas read their copy themselves).

    Raises
    ------
    FileNotFoundError
        If the file does not exist.
    KeyError
        If the dataset is missing.
    TypeError
        If ``path`` is not a path or ``grid`` not a ProcessGrid.
    ValueError
        If the split or layout does not fit the dataset's shape, ``index`` is out of range,
        the dtype differs from ``dtype``, ``like``/``method`` is invalid, or the ranks passed
        different arguments (another file, dataset, split, index, ...).
    OSError
        If the file is not HDF5 or is corrupt.
    All raised on every rank.
    """
    grid = check_grid(grid)
    error: Exception | None = None
    fname = ""
    try:
        fname = check_path(path)
        if like not in BACKENDS:
            raise ValueError(f"like={like!r} must be one of {BACKENDS}")
        name = check_dataset_name(dataset)
        resolved = resolve_method(method, grid.size)
    except Exception as e:  # noqa: BLE001 - agree on every failure
        error = e
    C.agree_arguments(
        grid.comm, "load_hdf5", error, path=os.path.abspath(fname), dataset=dataset, split=split, index=index,
        like=like, dtype=dtype, method=method,
    )  # fmt: skip
    f = open_for_read(fname, grid, resolved)
    try:
        local = _read_local(f, fname, name, grid, split, index, dtype)
    finally:
        f.close()
    block, layout = local
    return DistTensor(from_numpy(block, like), grid, layout)


def open_for_read(path: str, grid: ProcessGrid, method: str) -> h5py.File:
    """Collective over grid. Open ``path`` read-only: with MPI-IO (``method="mpio"``) or per rank.

    Raises
    ------
    FileNotFoundError, OSError
        If the file is missing, not HDF5 or corrupt (on every rank).
    """
    error: Exception | None = None
    f = None
    if method == "mpio":  # agree that the file is readable before the collective open
        try:
            check_readable(path)
        except Exception as e:  # noqa: BLE001
            error = e
        C.raise_if_any(grid.comm, error)
    try:
        if method == "mpio":
            f = open_checked(path, "r", driver="mpio", comm=grid.comm)
        else:
            f = open_local(path, "r")
    except Exception as e:  # noqa: BLE001
        error = e
    try:
        C.raise_if_any(grid.comm, error)
    except BaseException:
        if f is not None:
            f.close()
        raise
    return f  # type: ignore[return-value]


def _read_local(
    f: h5py.File, path: str, name: str, grid: ProcessGrid, split: object, index: int | None, dtype: object
) -> tuple[np.ndarray, Layout]:
    error: Exception | None = None
    out: tuple[np.ndarray, Layout] | None = None
    try:
        ds = get_dataset(f, name, path)
        stored = check_stored_dtype(ds, path, dtype)
        shape = tuple(ds.shape)
        lead: tuple[int, ...] = ()
        if index is not None:
            if not is_int(index):
                raise ValueError(f"index must be an int or None, got {index!r}")
            if not shape or not -shape[0] <= index < shape[0]:
                raise ValueError(
                    f"index={index} is out of range for {path}:{name} of shape {shape} "
                    f"(valid: {-shape[0] if shape else 0}..{shape[0] - 1 if shape else -1})"
                )
            lead, shape = (int(index) % shape[0],), shape[1:]
        layout = layout_for(shape, grid, split, f"{path}:{name}" + (f"[{index}]" if lead else ""))
        block = np.empty(layout.local_shape(grid.coords), dtype=stored)
        read_block(ds, block, lead + layout.local_slices(grid.coords), path)
        out = (block, layout)
    except Exception as e:  # noqa: BLE001
        error = e
    C.raise_if_any(grid.comm, error)
    return out  # type: ignore[return-value]


def block_chunks(layout: Layout, itemsize: int, max_bytes: int = _MAX_CHUNK_BYTES) -> tuple[int, ...]:
    """Local. Chunk shape equal to the largest block of ``layout``, halved until at most ``max_bytes``.

    Returns
    -------
    tuple of int
        Positive chunk extents (HDF5 needs >= 1 even for empty dims).
    """
    chunk = [max(1, max(layout.block_sizes(d))) for d in range(layout.ndim)]
    while math.prod(chunk) * itemsize > max_bytes and max(chunk) > 1:
        d = chunk.index(max(chunk))
        chunk[d] = (chunk[d] + 1) // 2
    return tuple(chunk)


def _chunk_spec(chunks: object, compression: object, layout: Layout, itemsize: int) -> Any:
    if chunks is None:
        chunks = "layout" if compression is not None else None
    if chunks is None or chunks is True:
        return chunks
    if chunks == "layout":
        return block_chunks(layout, itemsize) if layout.ndim else None
    if isinstance(chunks, (tuple, list)):
        if not all(is_int(v) for v in chunks):
            raise TypeError(f"chunks={tuple(chunks)} must hold ints (extents are not truncated)")
        c = tuple(int(v) for v in chunks)
        if len(c) != layout.ndim or any(v < 1 for v in c):
            raise ValueError(
                f"chunks={tuple(chunks)} must give one positive extent per dim of shape {layout.global_shape}"
            )
        return c
    raise ValueError(f"chunks={chunks!r} must be None, True, 'layout' or a tuple of ints")


def save_hdf5(
    x: DistTensor,
    path: str | os.PathLike[str],
    dataset: str,
    *,
    mode: str = "a",
    chunks: object = None,
    compression: str | None = None,
    compression_opts: object = None,
    attrs: Mapping[str, Any] | None = None,
    method: str = "auto",
) -> None:
    """Collective over grid. Write a DistTensor as one global dataset, atomically.

    The file is built under a temporary name in the same directory and renamed onto
    ``path`` by rank 0 after every rank wrote: a failure or crash leaves an existing
    ``path`` unchanged (a killed job's hidden ``.NAME.tmp-*`` file is removed by a later
    save to ``path`` once untouched for an hour). Only primary replicas
    (:meth:`Layout.is_primary`) write.

    Parameters
    ----------
    x : DistTensor
    path : str or os.PathLike
    dataset : str
        Dataset path inside the file (intermediate groups are created).
    mode : {"a", "w", "x"}
        ``"a"`` (default): keep the other objects of an existing file and replace
        ``dataset`` if present (the file is copied to the temporary name, so this costs
        a copy of the file); ``"w"``: the file holds only this dataset afterwards;
        ``"x"``: fail if ``path`` exists.
    chunks : None, True, "layout" or tuple of int
        ``None``: contiguous, or ``"layout"`` when compressing; ``"layout"``: one chunk per
        block of ``x``'s layout (see the module docstring); ``True``: h5py's guess.
    compression : str, optional
        An HDF5 filter such as ``"gzip"`` or ``"lzf"``. Filtered datasets are written in
        turns even when MPI-IO is available. Ignored (with ``chunks``) for a 0-d or empty
        tensor, which HDF5 cannot chunk.
    compression_opts : optional
        Filter options (e.g. the gzip level).
    attrs : mapping, optional
        Attributes of the dataset (str keys; numbers, strings, arrays).
    method : {"auto", "mpio", "serial"}
        ``"mpio"``: all ranks write together through MPI-IO; ``"serial"``: ranks write
        their hyperslabs one after another (token passing); the file is the same.

    Raises
    ------
    TypeError
        If ``x`` is not a DistTensor (raised where it is not), ``path`` is not a path, an
        attribute key is not a str, or ``chunks`` holds non-integers.
    ValueError
        On an invalid dataset name, mode, chunks or method, a dtype HDF5 cannot hold
        (bfloat16), when ``dataset`` names an existing group, or when the ranks passed
        different arguments (path, mode, layout of ``x``, compression, attrs, ...).
    FileNotFoundError
        If the directory of ``path`` does not exist.
    FileExistsError
        If ``mode="x"`` and ``path`` exists.
    OSError
        If an existing file (``mode="a"``) is not valid HDF5, or writing fails.
    All raised on every rank; ``path`` is left as it was.
    """
    if not isinstance(x, DistTensor):  # (no grid to agree on: a rank passing another object cannot tell the others)
        raise TypeError(f"save_hdf5 needs a DistTensor, got {type(x).__name__}")
    grid, layout = x.grid, x.layout
    error: Exception | None = None
    fname = ""
    try:
        fname = check_path(path)
        name = check_dataset_name(dataset)
        stored = _storable_dtype(x.dtype)
        chunk_spec = _chunk_spec(chunks, compression, layout, stored.itemsize)
        if layout.ndim == 0 or math.prod(layout.global_shape) == 0:  # HDF5 cannot chunk (or filter) these
            chunk_spec, compression, compression_opts = None, None, None
        attrs = dict(attrs or {})
        if any(not isinstance(k, str) for k in attrs):
            raise TypeError("attrs keys must be str")
        resolved = resolve_method(method, grid.size)
        if compression is not None:
            resolved = "serial"  # parallel writes to filtered datasets need collective IO
    except Exception as e:  # noqa: BLE001
        error = e
    C.agree_arguments(
        grid.comm, "save_hdf5", error, layout=layout, dtype=str(x.dtype), path=os.path.abspath(fname),
        dataset=dataset, mode=mode, chunks=chunks, compression=compression, compression_opts=compression_opts,
        attrs=attrs, method=method,
    )  # fmt: skip

    scalar = np.asarray(to_numpy(x.local)) if layout.ndim == 0 and grid.rank == 0 else None

    def prepare(f: h5py.File) -> None:
        ds = create_dataset(f, name, layout.global_shape, stored, chunk_spec, compression, compression_opts, attrs)
        if scalar is not None:  # a 0-d tensor is replicated; rank 0 writes it while laying out the file
            write_block(ds, np.asarray(scalar, order="C"))  # (an MPI-IO write to a scalar dataspace hangs)

    write = None
    coords = grid.coords
    if layout.ndim > 0 and layout.is_primary(coords) and math.prod(layout.local_shape(coords)) > 0:
        block = np.asarray(to_numpy(x.local), order="C")

        def write(f: h5py.File) -> None:
            write_block(f[name], block, layout.local_slices(coords))

    atomic_write(grid, fname, mode=mode, prepare=prepare, write=write, method=resolved, replace=[name])


def _storable_dtype(dtype: object) -> np.dtype:
    name = dtype_name(dtype)
    if name == "bfloat16":
        raise ValueError("HDF5 has no bfloat16; save x.astype('float32') instead")
    return np.dtype(name)


def create_dataset(
    f: h5py.Group,
    name: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    chunks: Any = None,
    compression: object = None,
    compression_opts: object = None,
    attrs: Mapping[str, Any] | None = None,
) -> h5py.Dataset:
    """Local. Create a dataset laid out for parallel hyperslab writes.

    Space is allocated at creation when unfiltered (needed for independent MPI-IO writes,
    and done the same way for turn-based writes so both give the same file); timestamps
    are off so identical data gives identical files.
    """
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    if compression is None:
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    if name in f:
        del f[name]
    ds = f.create_dataset(
        name, shape=shape, dtype=dtype, chunks=chunks, compression=compression,
        compression_opts=compression_opts, track_times=False, dcpl=dcpl,
    )  # fmt: skip
    for k, v in (attrs or {}).items():
        ds.attrs[k] = v
    return ds
