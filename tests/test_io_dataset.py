"""hpctp.io.FieldDataset and FieldLoader: spatial blocks of snapshot pairs, shuffling, prefetch, errors."""

from __future__ import annotations

import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpctp
import hpctp.comm
import hpctp.io
from hpctp.comm.io_calls import bcast_bytes
from hpctp.io.dataset import chunk_cache_bytes
from hpctp.testing import assert_all, assert_equal

WORLD = MPI.COMM_WORLD
N, C, H, W = 7, 2, 5, 6


@pytest.fixture
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One empty directory, created by rank 0 and used by every rank."""
    mine = str(tmp_path_factory.mktemp("io")).encode() if WORLD.rank == 0 else None
    return Path(bcast_bytes(WORLD, mine).decode())


def snapshots() -> np.ndarray:
    """[N, C, H, W]; every value encodes its snapshot: floor(value / 1000) == n."""
    a = np.arange(C * H * W, dtype=np.float32).reshape(1, C, H, W)
    return 1000 * np.arange(N, dtype=np.float32).reshape(N, 1, 1, 1) + a


@pytest.fixture
def sim_file(shared_dir: Path) -> Path:
    """u: [N, C, H, W] chunked across samples and space (compressed); v: [N, 1, H, W] targets."""
    path = shared_dir / "sim.h5"
    ok = True
    if WORLD.rank == 0:
        with h5py.File(path, "w") as f:
            f.create_dataset("u", data=snapshots(), chunks=(2, 2, 3, 4), compression="gzip")
            f.create_dataset("v", data=-snapshots()[:, :1])
            f.create_dataset("short", data=snapshots()[:3])
    assert_all(WORLD, ok)  # also a barrier: the file exists for every rank
    return path


def ids(x: hpctp.DistTensor) -> np.ndarray:
    """Snapshot index of every sample in a batch block (from its first element)."""
    local = hpctp.testing.as_numpy(x.local)
    if local.size == 0:
        return np.full(local.shape[0], -1)
    return np.floor(np.abs(local.reshape(local.shape[0], -1)[:, 0]) / 1000).astype(np.int64)


def known_ids(grid: hpctp.ProcessGrid, mine: np.ndarray) -> np.ndarray:
    """The snapshot indices that the ranks with non-empty blocks found (:func:`ids` gives -1 on
    a rank whose block is empty, e.g. 6 ranks over H = 5)."""
    out = np.empty_like(mine)
    grid.comm.Allreduce(mine, out, op=MPI.MAX)
    return out


def same_on_all_ranks(grid: hpctp.ProcessGrid, values: np.ndarray, what: str) -> None:
    root = np.ascontiguousarray(values, dtype=np.int64).copy()
    hpctp.comm.bcast(grid.comm, root)
    assert_equal(grid, values.astype(np.int64), root, what)


# ---------------------------------------------------------------------------- dataset
@pytest.mark.mpi
def test_samples_are_spatial_blocks_with_lag(grid2d: hpctp.ProcessGrid, sim_file: Path) -> None:
    a = snapshots()
    with hpctp.io.FieldDataset(sim_file, "u", grid2d, (None, 0, 1), targets=2) as ds:
        assert_all(grid2d, len(ds) == N - 2, f"len {len(ds)}")
        for i in (0, 3, len(ds) - 1):
            x, y = ds[i]
            assert_equal(grid2d, x.local, a[i][x.local_slices], f"input {i}")
            assert_equal(grid2d, y.local, a[i + 2][y.local_slices], f"target {i}")  # type: ignore[union-attr]
        batch_x, batch_y = ds.read_batch([4, 0, 1, 2])  # stored in file order; runs read at once
        assert_equal(grid2d, batch_x.local, a[[0, 1, 2, 4]][(slice(None),) + x.local_slices])
        assert_equal(grid2d, batch_y.local, a[[2, 3, 4, 6]][(slice(None),) + x.local_slices])  # type: ignore[union-attr]


@pytest.mark.mpi
def test_separate_target_dataset_and_torch(grid2d: hpctp.ProcessGrid, sim_file: Path) -> None:
    a = snapshots()
    ds = hpctp.io.FieldDataset(sim_file, "u", grid2d, (None, 1, 0), samples=range(1, 6, 2), targets="v", like="torch")
    x, y = ds[1]  # sample 1 -> snapshot 3
    assert_all(grid2d, isinstance(x.local, torch.Tensor) and y.global_shape == (1, H, W), "torch blocks, [1, H, W]")
    assert_equal(grid2d, x.local, a[3][x.local_slices])
    assert_equal(grid2d, y.local, -a[3, :1][y.local_slices])  # type: ignore[union-attr]
    ds.close()


@pytest.mark.mpi
def test_scalar_samples_of_a_1d_dataset(grid1d: hpctp.ProcessGrid, shared_dir: Path) -> None:
    """An [N] dataset has 0-d samples: ds[i] gave a numpy scalar, which is not a block."""
    path = shared_dir / "series.h5"
    values = np.arange(6.0) * 1.5
    hpctp.io.save_hdf5(hpctp.distribute(values if grid1d.rank == 0 else None, grid1d, (None,)), path, "t")
    for like in ("numpy", "torch"):
        with hpctp.io.FieldDataset(path, "t", grid1d, (), targets=1, like=like) as ds:
            x, y = ds[2]
            assert y is not None
            assert_all(grid1d, x.shape == () and y.shape == () and x.local.shape == (), f"{like}: {x.local!r}")
            assert_all(grid1d, float(x.local) == 3.0 and float(y.local) == 4.5, f"{like}: {x.local}, {y.local}")


@pytest.mark.mpi
def test_dataset_errors(grid1d: hpctp.ProcessGrid, sim_file: Path) -> None:
    with pytest.raises(ValueError, match="lag must be >= 1"):
        hpctp.io.FieldDataset(sim_file, "u", grid1d, (None, 0, None), targets=0)
    with pytest.raises(ValueError, match=r"samples must lie in 0\.\.5"):
        hpctp.io.FieldDataset(sim_file, "u", grid1d, (None, 0, None), targets=1, samples=[0, 6])
    for bad in ([1.7, 2.2], np.array([0.9]), [True, False]):  # never truncated to indices
        with pytest.raises(TypeError, match="samples must be integer snapshot indices"):
            hpctp.io.FieldDataset(sim_file, "u", grid1d, (None, 0, None), targets=1, samples=bad)
    with pytest.raises(ValueError, match="same leading size"):
        hpctp.io.FieldDataset(sim_file, "u", grid1d, (None, 0, None), targets="short")
    with pytest.raises(KeyError, match="no dataset 'w'"):
        hpctp.io.FieldDataset(sim_file, "w", grid1d, (None, 0, None))
    with pytest.raises(ValueError, match="sample has shape"):
        hpctp.io.FieldDataset(sim_file, "u", grid1d, (0, None))


def test_chunk_cache_covers_the_touched_chunk_row(sim_file: Path) -> None:
    with h5py.File(sim_file, "r") as f:
        ds = f["u"]  # chunks (2, 2, 3, 4) of float32 = 192 bytes
        assert chunk_cache_bytes(ds, (slice(0, 2), slice(0, 5), slice(2, 6))) == 1 * 2 * 2 * 192
        assert chunk_cache_bytes(ds, (slice(0, 2), slice(3, 3), slice(0, 6))) == 1 * 1 * 2 * 192
        assert chunk_cache_bytes(f["v"], (slice(0, 1), slice(0, 5), slice(0, 6))) == 0  # contiguous


# ---------------------------------------------------------------------------- loader
@pytest.mark.mpi
def test_loader_shuffles_identically_and_covers_every_sample(grid2d: hpctp.ProcessGrid, sim_file: Path) -> None:
    a = snapshots()
    ds = hpctp.io.FieldDataset(sim_file, "u", grid2d, (None, 0, 1), targets=1)  # 6 samples
    loader = hpctp.io.FieldLoader(ds, batch_size=4, seed=5)
    epochs = []
    for _ in range(2):
        seen = []
        for x, y in loader:
            assert_equal(grid2d, y.local, a[ids(x) + 1][(slice(None),) + y.local_slices[1:]], "target = input + 1")
            seen.append(ids(x))
        mine = np.concatenate(seen)
        order = known_ids(grid2d, mine)
        assert_all(grid2d, bool(np.all((mine == order) | (mine == -1))), "every rank sees the same samples")
        assert_all(grid2d, sorted(order.tolist()) == list(range(6)) and [len(s) for s in seen] == [4, 2], str(seen))
        epochs.append(order)
    assert_all(grid2d, epochs[0].tolist() != epochs[1].tolist(), "epochs are shuffled differently")
    again = hpctp.io.FieldLoader(ds, batch_size=4, seed=5, prefetch=0, drop_last=True)
    first = [known_ids(grid2d, ids(x)) for x, _ in again]
    assert_all(grid2d, len(first) == 1 == len(again) and first[0].tolist() == epochs[0][:4].tolist(), "reproducible")
    ds.close()


@pytest.mark.mpi
def test_loader_reads_next_batch_in_background(
    grid1d: hpctp.ProcessGrid, sim_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = hpctp.io.FieldDataset(sim_file, "u", grid1d, (None, None, 0))
    started = threading.Event()
    threads: list[str] = []
    real = ds.read_batch

    def read_batch(positions):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        if len(threads) == 2:
            started.set()
        return real(positions)

    monkeypatch.setattr(ds, "read_batch", read_batch)
    adopted: list[tuple[str, int | None]] = []  # the current GPU is per thread: the reader takes ours
    monkeypatch.setattr(hpctp.comm, "current_device", lambda: 3)
    monkeypatch.setattr(hpctp.comm, "use_device", lambda d: adopted.append((threading.current_thread().name, d)))
    batches = iter(hpctp.io.FieldLoader(ds, batch_size=2, shuffle=False, prefetch=1))
    x0, _ = next(batches)
    prefetching = started.wait(timeout=30)  # batch 1 is read while we still hold batch 0
    rest = [ids(x).tolist() for x, _ in batches]
    assert_all(grid1d, prefetching, "the second batch was not read ahead")
    assert_all(grid1d, all(t.startswith("hpctp-io-prefetch") for t in threads), f"reader threads {threads}")
    ok = [(t.startswith("hpctp-io-prefetch"), d) for t, d in adopted] == [(True, 3)]
    assert_all(grid1d, ok, f"the reader thread makes the caller's GPU current: {adopted}")
    assert_all(grid1d, ids(x0).tolist() in ([0, 1], [-1, -1]) and rest[-1] in ([6], [-1]), f"{ids(x0)} {rest}")
    ds.close()


@pytest.mark.mpi
def test_loader_read_error_reaches_every_rank(
    grid1d: hpctp.ProcessGrid, sim_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = hpctp.io.FieldDataset(sim_file, "u", grid1d, (None, 0, None))
    calls = []
    real = ds.read_batch

    def read_batch(positions):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2 and grid1d.rank == grid1d.size - 1:
            raise OSError("bad chunk (injected)")
        return real(positions)

    monkeypatch.setattr(ds, "read_batch", read_batch)
    got = 0
    with pytest.raises(OSError, match="injected"):
        for _ in hpctp.io.FieldLoader(ds, batch_size=3, seed=1):
            got += 1
    assert_all(grid1d, got == 1, f"failed at batch {got}, expected 1")
    ds.close()


@pytest.mark.mpi(min_size=2)
def test_loader_rejects_different_seeds(grid1d: hpctp.ProcessGrid, sim_file: Path) -> None:
    ds = hpctp.io.FieldDataset(sim_file, "u", grid1d, (None, 0, None))
    with pytest.raises(ValueError, match="differ between ranks"):
        hpctp.io.FieldLoader(ds, batch_size=2, seed=grid1d.rank)
    with pytest.raises(ValueError, match="batch_size"):
        hpctp.io.FieldLoader(ds, batch_size=0)
    ds.close()
    r = grid1d.rank % 2  # same number of samples, different ones: the batches would not match up
    with pytest.raises(ValueError, match="FieldDataset: ranks passed different samples"):
        hpctp.io.FieldDataset(sim_file, "u", grid1d, (None, 0, None), samples=[r, 2 + r])
    ds = hpctp.io.FieldDataset(sim_file, "u", grid1d, (None, 0, None), samples=[0, 2])
    ds.samples = ds.samples + r  # changed after construction: the loader still compares them
    with pytest.raises(ValueError, match="samples checksum"):
        hpctp.io.FieldLoader(ds, batch_size=2)
    ds.close()


@pytest.mark.mpi
def test_loader_thread_start_failure_reaches_every_rank(
    grid1d: hpctp.ProcessGrid, sim_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefetch thread selecting the GPU fails on one rank: every rank raises, none waits."""

    def use_device(device: object) -> None:
        if grid1d.rank == grid1d.size - 1:
            raise RuntimeError("CUDA error: invalid device ordinal (injected)")

    monkeypatch.setattr(hpctp.comm, "use_device", use_device)
    ds = hpctp.io.FieldDataset(sim_file, "u", grid1d, (None, 0, None))
    with pytest.raises(Exception, match="initializer failed|injected") as info:
        for _ in hpctp.io.FieldLoader(ds, batch_size=3, seed=1):
            pass
    ok = grid1d.rank != grid1d.size - 1 or "BrokenThreadPool" in type(info.value).__name__
    assert_all(grid1d, ok, f"the failing rank raised {info.value!r}")
    ds.close()
