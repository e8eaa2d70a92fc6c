"""Simulation snapshots ``[N, C, *spatial]`` in HDF5 as (input, target) training samples.

Every rank holds its spatial block of each sample and reads only that hyperslab through
its own read-only file handle. Reads need no coordination, so no MPI call happens in the
reading code (which lets :class:`~hpctp.io.FieldLoader` prefetch from a background thread
without requiring ``MPI_THREAD_MULTIPLE``).

Chunk-aware reading: the chunk cache of the open dataset is sized to hold all chunks a
rank's hyperslab touches in one row of the sample dim (chunks spanning several samples
are then decompressed once, not once per sample), and consecutive sample indices of a
batch are read with one ``read_direct`` call into the preallocated batch array.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np

from .. import comm as C
from .._util.backend import BACKENDS, from_numpy
from .._util.ints import is_int
from ..comm import ProcessGrid, check_grid
from ..layout import Layout
from ..tensor.core import DistTensor
from ._files import check_dataset_name, check_path, get_dataset, native_dtype, open_local
from .hdf5 import check_stored_dtype, layout_for, read_block

__all__ = ["FieldDataset", "chunk_cache_bytes"]


def chunk_cache_bytes(ds: h5py.Dataset, selection: Sequence[slice]) -> int:
    """Local. Bytes of the chunks that one sample's hyperslab ``selection`` (of dims 1..) touches.

    Returns 0 for contiguous datasets.
    """
    if ds.chunks is None:
        return 0
    count = 1
    for sl, c in zip(selection, ds.chunks[1:], strict=True):
        if sl.stop > sl.start:
            count *= (sl.stop - 1) // c - sl.start // c + 1
    return count * math.prod(ds.chunks) * ds.dtype.itemsize


class FieldDataset:
    """Collective over grid. Samples of a ``[N, C, *spatial]`` dataset, split over the grid.

    Sample ``i`` is the pair ``(input[i], target[i])`` with ``input[i] = data[samples[i]]``
    and, depending on ``targets``: ``data[samples[i] + k]`` (int lag ``k``), the same
    index of another dataset of the file (str), or None.

    Parameters
    ----------
    path : str or os.PathLike
    dataset : str
        Input dataset, shape ``[N, *sample_shape]`` (typically ``[N, C, *spatial]``).
    grid : ProcessGrid
    split : split specification
        Grid axis per dim of one sample (``len(sample_shape)`` entries), e.g.
        ``(None, 0, 1)`` for ``[C, H, W]`` on a 2-D grid.
    samples : sequence of int or range, optional
        Leading indices used as inputs (default: all with a valid target).
    targets : int, str or None
        Lag ``k >= 1`` into the same dataset, the name of a target dataset with the same
        leading size (split the same way), or None for inputs only.
    like : {"numpy", "torch", "cuda", "cupy"}
        Backend of the returned blocks (stored dtype kept).
    cache_bytes : int, optional
        HDF5 chunk cache per dataset; default: twice the chunk row a rank touches
        (at least 1 MiB, at most 512 MiB).

    Raises
    ------
    FileNotFoundError, KeyError, OSError
        Missing or corrupt file or dataset.
    ValueError
        Bad split, lag, sample indices, ``cache_bytes``, a null dataspace, a target dataset
        of another leading size, or arguments that differ between ranks.
    TypeError
        Non-integer ``samples`` (floats and bools are not truncated to indices), a ``path``
        that is not a path, a ``grid`` that is not a ProcessGrid.
    All raised on every rank.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        dataset: str,
        grid: ProcessGrid,
        split: object,
        *,
        samples: Sequence[int] | range | None = None,
        targets: int | str | None = None,
        like: str = "numpy",
        cache_bytes: int | None = None,
    ) -> None:
        self.grid = check_grid(grid)
        self.like = like
        self.path = ""
        self._files: list[h5py.File] = []
        error: Exception | None = None
        try:
            self.path = check_path(path)
            if cache_bytes is not None and (not is_int(cache_bytes) or cache_bytes < 0):
                raise ValueError(f"cache_bytes must be None or an int >= 0, got {cache_bytes!r}")
            self._setup(dataset, split, samples, targets, cache_bytes)
        except Exception as e:  # noqa: BLE001 - agree on every failure
            error = e
        try:
            C.agree_arguments(
                grid.comm, "FieldDataset", error, path=os.path.abspath(self.path), dataset=dataset, split=split,
                targets=targets, samples=getattr(self, "samples", None), like=like, cache_bytes=cache_bytes,
            )  # fmt: skip
        except BaseException:
            self.close()
            raise

    def _setup(
        self, dataset: str, split: object, samples: Any, targets: int | str | None, cache_bytes: int | None
    ) -> None:
        if self.like not in BACKENDS:
            raise ValueError(f"like={self.like!r} must be one of {BACKENDS}")
        self.dataset = check_dataset_name(dataset)
        self._x, self.layout = self._open(self.dataset, split, cache_bytes)
        n = self._x.shape[0]
        self.lag = 0
        self.target_dataset: str | None = None
        self._y: h5py.Dataset | None = None
        self.target_layout: Layout | None = None
        if isinstance(targets, str):
            self.target_dataset = check_dataset_name(targets)
            self._y, self.target_layout = self._open(self.target_dataset, split, cache_bytes)
            if self._y.shape[0] != n:
                raise ValueError(
                    f"{self.path}: target dataset {targets!r} has {self._y.shape[0]} samples but "
                    f"{self.dataset!r} has {n}; they must have the same leading size"
                )
        elif is_int(targets):
            if targets < 1:
                raise ValueError(f"targets={targets}: a lag must be >= 1 (or pass a dataset name, or None)")
            self.lag = int(targets)
            self._y = self._x
            self.target_layout = self.layout
        elif targets is not None:
            raise ValueError(f"targets={targets!r} must be an int lag >= 1, a dataset name or None")
        last = n - self.lag
        if samples is None:
            samples = range(max(last, 0))
        raw = np.asarray(list(samples)).reshape(-1)
        if raw.size and raw.dtype.kind not in "iu":
            raise TypeError(f"samples must be integer snapshot indices, got dtype {raw.dtype} ({raw[:4].tolist()}...)")
        idx = raw.astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= last):
            raise ValueError(
                f"samples must lie in 0..{last - 1} for {self.path}:{self.dataset} with {n} snapshots"
                + (f" and target lag {self.lag}" if self.lag else "")
                + f"; got min {idx.min()}, max {idx.max()}"
            )
        self.samples = idx

    def _open(self, name: str, split: object, cache_bytes: int | None) -> tuple[h5py.Dataset, Layout]:
        with open_local(self.path, "r") as f:  # metadata pass: size the chunk cache
            ds = get_dataset(f, name, self.path)
            check_stored_dtype(ds, self.path)
            if ds.ndim < 1:
                raise ValueError(f"{self.path}:{name} is a scalar; a sample dataset needs a leading dim")
            layout = self._layout(ds, split)
            touched = chunk_cache_bytes(ds, layout.local_slices(self.grid.coords))
        nbytes = cache_bytes if cache_bytes is not None else min(max(2 * touched, 2**20), 512 * 2**20)
        f = open_local(self.path, "r", rdcc_nbytes=int(nbytes), rdcc_nslots=10007)
        self._files.append(f)
        return f[name], layout

    def _layout(self, ds: h5py.Dataset, split: object) -> Layout:
        return layout_for(tuple(ds.shape[1:]), self.grid, split, f"{self.path}:{ds.name} sample")

    # ------------------------------------------------------------------ local reads
    def __len__(self) -> int:
        return int(self.samples.size)

    def __getitem__(self, i: int) -> tuple[DistTensor, DistTensor | None]:
        """Local. Sample ``i``: (input, target) blocks of this rank (call on every rank alike).

        Raises
        ------
        IndexError
            If ``i`` is out of range.
        OSError
            If HDF5 fails to read (this rank only: use :class:`FieldLoader` for agreed errors).
        """
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for a dataset of {len(self)} samples")
        x, y = self.read_batch([i])
        return _drop_batch(x), None if y is None else _drop_batch(y)

    def read_batch(self, positions: Sequence[int] | np.ndarray) -> tuple[DistTensor, DistTensor | None]:
        """Local. Samples at ``positions`` (of ``range(len(self))``) as ``[B, *sample_shape]`` tensors.

        Samples are stored in ascending file order (the batch's membership is what
        shuffling decides); inputs and targets stay paired. No communication.

        Returns
        -------
        tuple of DistTensor
            ``(inputs, targets)`` split ``(None, *split)``; ``targets`` is None without targets.

        Raises
        ------
        OSError
            If HDF5 fails to read (raised on this rank only).
        """
        idx = np.sort(self.samples[np.asarray(positions, dtype=np.int64)])
        x = self._read(self._x, self.layout, idx)
        y = None
        if self._y is not None and self.target_layout is not None:
            y = self._read(self._y, self.target_layout, idx + self.lag)
        return x, y

    def _read(self, ds: h5py.Dataset, layout: Layout, idx: np.ndarray) -> DistTensor:
        coords = self.grid.coords
        block = np.empty((idx.size,) + layout.local_shape(coords), dtype=native_dtype(ds))
        slices = layout.local_slices(coords)
        start = 0
        while start < idx.size:  # one read per run of consecutive indices
            stop = start + 1
            while stop < idx.size and idx[stop] == idx[stop - 1] + 1:
                stop += 1
            rows = slice(int(idx[start]), int(idx[stop - 1]) + 1)
            read_block(ds, block[start:stop], (rows,) + slices, self.path)
            start = stop
        batch = Layout((idx.size,) + layout.global_shape, self.grid.dims, (None,) + layout.split, (None,) + layout.cuts)
        return DistTensor(from_numpy(block, self.like), self.grid, batch)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Local. Close the file handles (idempotent)."""
        for f in self._files:
            try:
                f.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
        self._files.clear()

    def __enter__(self) -> FieldDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        tgt = self.target_dataset or (f"lag {self.lag}" if self.lag else None)
        return f"FieldDataset({self.path}:{self.dataset}, samples={len(self)}, targets={tgt}, layout={self.layout})"


def _drop_batch(t: DistTensor) -> DistTensor:
    lay = t.layout
    one = Layout(lay.global_shape[1:], lay.grid_dims, lay.split[1:], lay.cuts[1:])
    return DistTensor(t.local[0, ...], t.grid, one)  # [0, ...]: a 0-d block, not a numpy scalar, for [N] data
