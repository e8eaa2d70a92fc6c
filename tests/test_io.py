"""hpctp.io.load_hdf5 / save_hdf5: round trips, interop with plain h5py, modes, atomicity, errors."""

from __future__ import annotations

import os
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpctp
import hpctp.io
from hpctp.comm.io_calls import bcast_bytes
from hpctp.layout import Layout
from hpctp.testing import assert_all, assert_equal

WORLD = MPI.COMM_WORLD
# every write/read method this h5py can run: "mpio" where h5py is built against parallel HDF5
# (the parallel-HDF5 leg of tests/run_all.sh), "serial" everywhere
METHODS = ["serial", "mpio"] if hpctp.io.mpio_available() else ["serial"]


@pytest.fixture
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One empty directory, created by rank 0 and used by every rank."""
    mine = str(tmp_path_factory.mktemp("io")).encode() if WORLD.rank == 0 else None
    return Path(bcast_bytes(WORLD, mine).decode())


def field(shape: tuple[int, ...], dtype: str = "float64") -> np.ndarray:
    """A deterministic global array whose every element is distinct."""
    a = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) * 0.5 - 3
    if dtype == "bool":
        return (np.arange(a.size) % 3 == 0).reshape(shape)
    if dtype.startswith("complex"):
        return (a + 1j * a[::-1]).astype(dtype)
    return a.astype(dtype)


def on_root(grid: hpctp.ProcessGrid, fn) -> None:  # type: ignore[no-untyped-def]
    """Run ``fn`` on rank 0 only; every rank learns whether it failed."""
    ok, msg = True, ""
    if grid.rank == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            ok, msg = False, repr(e)
    assert_all(grid, ok, msg)


def read_all(path: Path, name: str) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f[name][...]


def names_in(path: Path) -> list[str]:
    with h5py.File(path, "r") as f:
        return sorted(f)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ---------------------------------------------------------------------------- round trips
@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("split_save,split_load", [((0, 1), (1, 0)), ((1, None), (0, 1)), (None, (0, None))])
def test_roundtrip_2d_uneven(grid2d: hpctp.ProcessGrid, shared_dir: Path, split_save, split_load, method: str) -> None:
    a = field((7, 5))
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, split_save)
    path = shared_dir / "f.h5"
    hpctp.io.save_hdf5(x, path, "u", method=method)
    y = hpctp.io.load_hdf5(path, "u", grid2d, split_load, method=method)
    assert_equal(grid2d, y.local, a[y.local_slices], "each rank holds its block of the stored field")
    assert_equal(grid2d, y.gather(root=None), a)


@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
def test_roundtrip_3d_torch(grid3d: hpctp.ProcessGrid, shared_dir: Path, method: str) -> None:
    a = field((5, 3, 4), "float32")
    x = hpctp.distribute(torch.from_numpy(a) if grid3d.rank == 0 else None, grid3d, (0, 1, 2))
    path = shared_dir / "f3.h5"
    hpctp.io.save_hdf5(x, path, "fields/t", chunks="layout", attrs={"time": 0.25, "units": "K"}, method=method)
    y = hpctp.io.load_hdf5(path, "fields/t", grid3d, (2, None, 0), like="torch", method=method)
    assert_all(grid3d, isinstance(y.local, torch.Tensor) and y.local.dtype == torch.float32, "torch float32 block")
    assert_equal(grid3d, y.local, a[y.local_slices])
    z = hpctp.io.load_hdf5(path, "fields/t", grid3d, (0, 2), index=-1, method=method)  # last slab of dim 0
    assert_equal(grid3d, z.gather(root=None), a[-1])


@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", ["int32", "complex128", "bool", "float16"])
def test_dtypes_preserved(grid1d: hpctp.ProcessGrid, shared_dir: Path, dtype: str, method: str) -> None:
    a = field((6, 3), dtype)
    x = hpctp.distribute(a if grid1d.rank == 0 else None, grid1d, (0, None))
    path = shared_dir / "d.h5"
    hpctp.io.save_hdf5(x, path, "a", method=method)
    y = hpctp.io.load_hdf5(path, "a", grid1d, (None, 0), dtype=dtype, method=method)
    assert_equal(grid1d, y.local, a[y.local_slices])


@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
def test_replicated_blocks_written_once(grid2d: hpctp.ProcessGrid, shared_dir: Path, method: str) -> None:
    """split over grid axis 1 only: replicas along axis 0 must not write (same file either way)."""
    a = field((3, 9))
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (None, 1))
    path = shared_dir / "r.h5"
    hpctp.io.save_hdf5(x, path, "a", method=method)
    on_root(grid2d, lambda: np.testing.assert_array_equal(read_all(path, "a"), a))


# ---------------------------------------------------------------------------- interop with plain h5py
@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
def test_plain_h5py_file_loads_distributed(grid2d: hpctp.ProcessGrid, shared_dir: Path, method: str) -> None:
    a = field((4, 2, 9, 7), "float32")  # [N, C, H, W] written by one process, chunked + compressed
    path = shared_dir / "plain.h5"

    def write() -> None:
        with h5py.File(path, "w") as f:
            f.create_dataset("snap", data=a, chunks=(1, 2, 4, 4), compression="gzip")

    on_root(grid2d, write)
    for i in range(a.shape[0]):
        y = hpctp.io.load_hdf5(path, "snap", grid2d, (None, 0, 1), index=i, method=method)
        assert_equal(grid2d, y.local, a[i][y.local_slices], f"snapshot {i}")


@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
def test_distributed_write_reads_back_in_one_process(grid2d: hpctp.ProcessGrid, shared_dir: Path, method: str) -> None:
    a = field((9, 6), "float64")
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (1, 0))
    path = shared_dir / "dist.h5"
    hpctp.io.save_hdf5(x, path, "u", compression="gzip", attrs={"step": 7}, method=method)

    def check() -> None:
        with h5py.File(path, "r") as f:
            np.testing.assert_array_equal(f["u"][...], a)
            assert f["u"].dtype == np.float64 and int(f["u"].attrs["step"]) == 7
            assert f["u"].compression == "gzip" and f["u"].chunks is not None

    on_root(grid2d, check)


@pytest.mark.mpi
@pytest.mark.parametrize("chunks", [None, "layout"])
def test_serial_fallback_gives_the_same_file(grid2d: hpctp.ProcessGrid, shared_dir: Path, chunks) -> None:
    """method='serial' (token passing, one rank after another) vs the automatic choice (MPI-IO
    on more than one rank where h5py has it): byte-identical files."""
    a = field((5, 8))
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, 1))
    with hpctp.CommCounter() as counter:
        hpctp.io.save_hdf5(x, shared_dir / "serial.h5", "u", method="serial", chunks=chunks, attrs={"t": 0.5})
    tokens = counter.calls.get("Send", 0) + counter.calls.get("Recv", 0)
    expected = (grid2d.rank > 0) + (grid2d.rank < grid2d.size - 1)
    assert_all(grid2d, tokens == expected, f"token messages {tokens}, expected {expected}")
    hpctp.io.save_hdf5(x, shared_dir / "auto.h5", "u", method="auto", chunks=chunks, attrs={"t": 0.5})
    on_root(
        grid2d,
        lambda: np.testing.assert_array_equal(
            read_all(shared_dir / "serial.h5", "u"), read_all(shared_dir / "auto.h5", "u")
        ),
    )
    same = (shared_dir / "serial.h5").read_bytes() == (shared_dir / "auto.h5").read_bytes()
    assert_all(grid2d, same, "serial and auto writes give byte-identical files")
    y = hpctp.io.load_hdf5(shared_dir / "serial.h5", "u", grid2d, (1, 0), method="serial")
    assert_equal(grid2d, y.local, a[y.local_slices])


@pytest.mark.skipif(hpctp.io.mpio_available(), reason="h5py has MPI here")
@pytest.mark.mpi
def test_mpio_without_mpi_h5py_is_a_clear_error(grid1d: hpctp.ProcessGrid, shared_dir: Path) -> None:
    x = hpctp.zeros((4,), grid1d, 0)
    with pytest.raises(ValueError, match="parallel HDF5"):
        hpctp.io.save_hdf5(x, shared_dir / "m.h5", "u", method="mpio")
    assert_all(grid1d, not (shared_dir / "m.h5").exists(), "nothing written")


# ---------------------------------------------------------------------------- several datasets per file
@pytest.mark.mpi
def test_modes_keep_replace_and_refuse(grid1d: hpctp.ProcessGrid, shared_dir: Path) -> None:
    path = shared_dir / "multi.h5"
    a, b = field((6, 2)), field((3,), "int64")

    def title() -> None:
        with h5py.File(path, "w") as f:
            f.attrs["title"] = "run 1"

    on_root(grid1d, title)
    xa = hpctp.distribute(a if grid1d.rank == 0 else None, grid1d, (0, None))
    xb = hpctp.distribute(b if grid1d.rank == 0 else None, grid1d, (0,))
    hpctp.io.save_hdf5(xa, path, "a")
    hpctp.io.save_hdf5(xb, path, "grp/b")
    hpctp.io.save_hdf5(xa * 2, path, "a")  # replaces "a", keeps the rest

    def check_multi() -> None:
        with h5py.File(path, "r") as f:
            assert f.attrs["title"] == "run 1"
            np.testing.assert_array_equal(f["a"][...], 2 * a)
            np.testing.assert_array_equal(f["grp/b"][...], b)

    on_root(grid1d, check_multi)
    before = path.read_bytes()
    with pytest.raises(FileExistsError if grid1d.rank == 0 else OSError, match="exists"):
        hpctp.io.save_hdf5(xa, path, "c", mode="x")
    assert_all(grid1d, path.read_bytes() == before, "mode='x' must not touch the file")
    hpctp.io.save_hdf5(xb, path, "only", mode="w")
    on_root(grid1d, lambda: np.testing.assert_equal(names_in(path), ["only"]))
    assert_all(grid1d, sorted(os.listdir(shared_dir)) == ["multi.h5"], f"leftovers: {os.listdir(shared_dir)}")


# ---------------------------------------------------------------------------- bad inputs
@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
def test_big_endian_file_loads_as_native(grid2d: hpctp.ProcessGrid, shared_dir: Path, method: str) -> None:
    """A dataset stored big-endian (a Fortran code, h5py with '>f4') loads as the native dtype:
    as torch (which refuses foreign byte order), with dtype= the native name, and as numpy."""
    a = field((5, 7), "float32")
    path = shared_dir / "be.h5"

    def write() -> None:
        with h5py.File(path, "w") as f:
            f.create_dataset("u", data=a.astype(">f4"))
            f.create_dataset("s", data=np.stack([a, -a]).astype(">f4"))

    on_root(grid2d, write)
    x = hpctp.io.load_hdf5(path, "u", grid2d, (0, 1), like="torch", method=method)
    assert_all(grid2d, x.local.dtype == torch.float32, f"torch block dtype {x.local.dtype}")
    assert_equal(grid2d, x.gather(root=None).numpy(), a)
    y = hpctp.io.load_hdf5(path, "u", grid2d, (1, 0), dtype="float32", method=method)
    assert_all(grid2d, y.local.dtype == np.dtype("float32") and y.local.dtype.isnative, f"{y.local.dtype}")
    assert_equal(grid2d, y.gather(root=None), a)
    with hpctp.io.FieldDataset(path, "s", grid2d, (0, 1), like="torch") as ds:
        got, _ = ds[1]
        assert_equal(grid2d, got.gather(root=None).numpy(), -a)


@pytest.mark.mpi
def test_save_keeps_permissions_and_symlinks(grid2d: hpctp.ProcessGrid, shared_dir: Path) -> None:
    """Re-saving a private file keeps it private; saving through a symbolic link replaces the
    file it points to and keeps the link; a file name of 250 bytes (temp name over 255) works."""
    a = field((4, 6))
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, 1))
    path, target, link = shared_dir / "private.h5", shared_dir / "target.h5", shared_dir / "latest.h5"
    hpctp.io.save_hdf5(x, path, "u")
    on_root(grid2d, lambda: os.chmod(path, 0o600))
    hpctp.io.save_hdf5(x * 2, path, "v", mode="a")
    hpctp.io.save_hdf5(x * 3, path, "u", mode="w")
    mode = oct(os.stat(path).st_mode & 0o777)
    assert_all(grid2d, mode == "0o600", f"mode after re-saving a 0o600 file: {mode}")
    hpctp.io.save_hdf5(x, target, "u")
    on_root(grid2d, lambda: os.symlink(target.name, link))
    hpctp.io.save_hdf5(x * 5, link, "u")
    assert_all(grid2d, os.path.islink(link), "the symbolic link was replaced by a file")
    assert_equal(grid2d, hpctp.io.load_hdf5(target, "u", grid2d, (1, 0)).gather(root=None), a * 5)
    long = shared_dir / ("n" * 247 + ".h5")
    hpctp.io.save_hdf5(x, long, "u")
    hpctp.io.save_hdf5(x * 7, long, "u")
    assert_equal(grid2d, hpctp.io.load_hdf5(long, "u", grid2d, (0, 1)).gather(root=None), a * 7)
    left = sorted(p.name for p in shared_dir.iterdir() if p.name.startswith("."))
    assert_all(grid2d, left == [], f"temporary files left: {left}")


@pytest.mark.mpi
def test_load_errors_are_clear_on_every_rank(grid2d: hpctp.ProcessGrid, shared_dir: Path) -> None:
    a = field((6, 4), "float32")
    path = shared_dir / "ok.h5"
    hpctp.io.save_hdf5(hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, 1)), path, "u")
    with pytest.raises(FileNotFoundError, match="nope.h5"):
        hpctp.io.load_hdf5(shared_dir / "nope.h5", "u", grid2d, (0, 1))
    with pytest.raises(KeyError, match=r"no dataset 'v'.*\[u\]"):
        hpctp.io.load_hdf5(path, "v", grid2d, (0, 1))
    wrong = Layout((6, 5), grid2d.dims, (0, 1))
    with pytest.raises(ValueError, match=r"shape \(6, 4\) but the layout expects \(6, 5\)"):
        hpctp.io.load_hdf5(path, "u", grid2d, wrong)
    with pytest.raises(ValueError, match="has 3 entries"):
        hpctp.io.load_hdf5(path, "u", grid2d, (0, 1, None))
    with pytest.raises(ValueError, match="index=6 is out of range"):
        hpctp.io.load_hdf5(path, "u", grid2d, (0,), index=6)
    with pytest.raises(ValueError, match="stored as float32 but dtype=float64"):
        hpctp.io.load_hdf5(path, "u", grid2d, (0, 1), dtype="float64")
    with pytest.raises(ValueError, match="like="):
        hpctp.io.load_hdf5(path, "u", grid2d, (0, 1), like="jax")
    on_root(grid2d, lambda: _add_null_dataset(path))
    with pytest.raises(ValueError, match="'nothing' has a null dataspace"):
        hpctp.io.load_hdf5(path, "nothing", grid2d, (0, 1))


def _add_null_dataset(path: Path) -> None:
    with h5py.File(path, "a") as f:
        f.create_dataset("nothing", data=h5py.Empty("f4"))


@pytest.mark.mpi
def test_corrupt_and_truncated_files(grid1d: hpctp.ProcessGrid, shared_dir: Path) -> None:
    junk, cut = shared_dir / "junk.h5", shared_dir / "cut.h5"
    a = field((64, 64))

    def make() -> None:
        junk.write_bytes(b"this is not HDF5" * 100)
        with h5py.File(cut, "w") as f:
            f.create_dataset("u", data=a)
        data = cut.read_bytes()
        cut.write_bytes(data[: len(data) // 2])  # header survives, data does not

    on_root(grid1d, make)
    with pytest.raises(OSError, match="not an HDF5 file"):
        hpctp.io.load_hdf5(junk, "u", grid1d, (0, None))
    with pytest.raises(OSError, match="cut.h5"):
        hpctp.io.load_hdf5(cut, "u", grid1d, (0, None))
    x = hpctp.zeros((4,), grid1d, 0)
    with pytest.raises(OSError, match="not an HDF5 file"):  # mode='a' must read the old file first
        hpctp.io.save_hdf5(x, junk, "u")
    assert_all(grid1d, junk.read_bytes() == b"this is not HDF5" * 100, "corrupt file left as it was")


@pytest.mark.mpi
def test_save_errors(grid1d: hpctp.ProcessGrid, shared_dir: Path) -> None:
    x = hpctp.zeros((4, 3), grid1d, (0, None))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hpctp.io.save_hdf5(x, shared_dir / "missing" / "f.h5", "u")
    with pytest.raises(ValueError, match="invalid dataset name"):
        hpctp.io.save_hdf5(x, shared_dir / "f.h5", "a//b")
    with pytest.raises(ValueError, match="bfloat16"):
        hpctp.io.save_hdf5(x.to("torch").astype(torch.bfloat16), shared_dir / "f.h5", "u")
    with pytest.raises(ValueError, match="chunks"):
        hpctp.io.save_hdf5(x, shared_dir / "f.h5", "u", chunks=(2,))
    with pytest.raises(ValueError, match="mode="):
        hpctp.io.save_hdf5(x, shared_dir / "f.h5", "u", mode="r")
    assert_all(grid1d, os.listdir(shared_dir) == [], f"nothing written: {os.listdir(shared_dir)}")


# ---------------------------------------------------------------------------- atomicity
@pytest.mark.mpi
def test_failed_save_keeps_previous_file(grid2d: hpctp.ProcessGrid, shared_dir: Path) -> None:
    a = field((5, 6))
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, 1))
    path = shared_dir / "keep.h5"
    hpctp.io.save_hdf5(x, path, "grp/u")
    before = snapshot(shared_dir)
    with pytest.raises(ValueError, match="existing group"):  # fails while rank 0 prepares
        hpctp.io.save_hdf5(x * 3, path, "grp")
    assert_all(grid2d, snapshot(shared_dir) == before, "bad dataset name: file unchanged, no temp left")


@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
def test_error_injected_mid_write_keeps_previous_file(
    grid2d: hpctp.ProcessGrid, shared_dir: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    a = field((6, 7))
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, 1))
    path = shared_dir / "keep.h5"
    hpctp.io.save_hdf5(x, path, "u", method=method)
    before = snapshot(shared_dir)
    original = h5py.Dataset.write_direct
    last = grid2d.size - 1

    def failing_write(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, **kwargs)  # the data reaches the temporary file ...
        if grid2d.rank == last:
            raise OSError("disk full (injected)")  # ... then the last writer fails

    monkeypatch.setattr(h5py.Dataset, "write_direct", failing_write)
    with pytest.raises(OSError, match="injected"):
        hpctp.io.save_hdf5(x * 2, path, "u", method=method)
    monkeypatch.undo()
    assert_all(grid2d, snapshot(shared_dir) == before, "injected failure: file unchanged, no temp left")
    y = hpctp.io.load_hdf5(path, "u", grid2d, (1, 0), method=method)
    assert_equal(grid2d, y.local, a[y.local_slices], "old values still load")


@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
def test_killed_save_leftovers_removed_by_next_save(grid1d: hpctp.ProcessGrid, shared_dir: Path, method: str) -> None:
    """A job killed mid-save leaves a hidden temp file; the next save removes it once stale."""
    path = shared_dir / "f.h5"
    stale, fresh = shared_dir / ".f.h5.tmp-dead", shared_dir / ".f.h5.tmp-busy"
    other = shared_dir / ".g.h5.tmp-dead"  # another target's: not ours to touch

    def leave_temps() -> None:
        for p in (stale, fresh, other):
            p.write_bytes(b"partial")
        hour_ago = time.time() - 2 * 3600
        os.utime(stale, (hour_ago, hour_ago))
        os.utime(other, (hour_ago, hour_ago))

    on_root(grid1d, leave_temps)
    a = field((5, 3))
    hpctp.io.save_hdf5(hpctp.distribute(a if grid1d.rank == 0 else None, grid1d, (0, None)), path, "u", method=method)
    left = sorted(p.name for p in shared_dir.iterdir())
    assert_all(grid1d, left == [".f.h5.tmp-busy", ".g.h5.tmp-dead", "f.h5"], f"files left: {left}")
    assert_equal(grid1d, hpctp.io.load_hdf5(path, "u", grid1d, (0, None)).gather(root=None), a)


@pytest.mark.mpi
def test_empty_blocks_and_scalars(grid1d: hpctp.ProcessGrid, shared_dir: Path) -> None:
    """Blocks that are empty on some ranks (2 rows over up to 4 ranks), empty tensors, 0-d tensors."""
    path = shared_dir / "small.h5"
    a = field((2, 3))
    hpctp.io.save_hdf5(hpctp.distribute(a if grid1d.rank == 0 else None, grid1d, (0, None)), path, "a")
    hpctp.io.save_hdf5(hpctp.zeros((0, 4), grid1d, (None, 0)), path, "e", compression="gzip")
    hpctp.io.save_hdf5(hpctp.full((), 2.5, grid1d, ()), path, "s")
    assert_equal(grid1d, hpctp.io.load_hdf5(path, "a", grid1d, (0, None)).gather(root=None), a)
    assert_equal(grid1d, hpctp.io.load_hdf5(path, "e", grid1d, (0, None)).local.shape, (0, 4))
    assert_equal(grid1d, hpctp.io.load_hdf5(path, "s", grid1d, ()).local, np.array(2.5))


# ---------------------------------------------------------------------------- arguments agreed
@pytest.mark.mpi
@pytest.mark.parametrize(
    "case",
    ["load_path", "load_dataset", "load_split", "load_index", "save_path", "save_mode", "save_compression",
     "save_layout", "dataset_split", "dataset_targets", "ckpt_step", "ckpt_load_path", "ckpt_optimizer"],
)  # fmt: skip
def test_arguments_that_differ_on_one_rank_raise_everywhere(grid1d: hpctp.ProcessGrid, shared_dir: Path, case) -> None:  # type: ignore[no-untyped-def]
    """A collective call whose last rank passes another file, dataset, split, ... used to return mixed
    or uninitialised data, or write only rank 0's choice (a replicated layout on one rank lost rows)."""
    g = grid1d
    odd = g.rank == g.size - 1 and g.size > 1  # on one rank, nothing can differ: the call must succeed
    a, b = shared_dir / "a.h5", shared_dir / "b.h5"
    x = hpctp.distribute(field((6, 2)) if g.rank == 0 else None, g, (0, None))
    hpctp.io.save_hdf5(x, a, "u")
    hpctp.io.save_hdf5(x * 2.0, a, "v")
    hpctp.io.save_hdf5(x, b, "u")
    whole = x.redistribute((None, None))  # the same data, replicated: another layout
    model = torch.nn.Linear(2, 2)
    hpctp.io.save_checkpoint(shared_dir / "c1.h5", model, None, 1, g)
    hpctp.io.save_checkpoint(shared_dir / "c2.h5", model, None, 2, g)
    calls = {
        "load_path": lambda: hpctp.io.load_hdf5(b if odd else a, "u", g, (0, None)),
        "load_dataset": lambda: hpctp.io.load_hdf5(a, "v" if odd else "u", g, (0, None)),
        "load_split": lambda: hpctp.io.load_hdf5(a, "u", g, (None, None) if odd else (0, None)),
        "load_index": lambda: hpctp.io.load_hdf5(a, "u", g, (0,), index=np.int64(1) if odd else 0),
        "save_path": lambda: hpctp.io.save_hdf5(x, b if odd else a, "w"),
        "save_mode": lambda: hpctp.io.save_hdf5(x, a, "w", mode="w" if odd else "a"),
        "save_compression": lambda: hpctp.io.save_hdf5(x, a, "w", compression="gzip" if odd else None),
        "save_layout": lambda: hpctp.io.save_hdf5(whole if odd else x, a, "w"),
        "dataset_split": lambda: hpctp.io.FieldDataset(a, "u", g, (None,) if odd else (0,)).close(),
        "dataset_targets": lambda: hpctp.io.FieldDataset(a, "u", g, (0,), targets=2 if odd else 1).close(),
        "ckpt_step": lambda: hpctp.io.save_checkpoint(shared_dir / "c3.h5", model, None, 9 if odd else 3, g),
        "ckpt_load_path": lambda: hpctp.io.load_checkpoint(shared_dir / ("c2.h5" if odd else "c1.h5"), model, None, g),
        "ckpt_optimizer": lambda: hpctp.io.load_checkpoint(
            shared_dir / "c1.h5", model, torch.optim.SGD(model.parameters(), 0.1) if odd else None, g
        ),
    }
    before = snapshot(shared_dir)
    if g.size == 1:
        calls[case]()
        return
    with pytest.raises(ValueError, match=r"ranks passed different .*a collective call needs the same arguments"):
        calls[case]()
    if case.startswith("save") or case == "ckpt_step":
        assert_all(g, snapshot(shared_dir) == before, "a refused save changed the files")


@pytest.mark.mpi
def test_bad_path_on_one_rank_raises_everywhere(grid1d: hpctp.ProcessGrid, shared_dir: Path) -> None:
    """os.fspath(None) raised on that rank alone, before any agreement: the others hung."""
    g = grid1d
    odd = g.rank == g.size - 1
    good = shared_dir / "f.h5"
    x = hpctp.zeros((4,), g, 0)
    hpctp.io.save_hdf5(x, good, "u")
    model = torch.nn.Linear(2, 2)
    for call in (
        lambda p: hpctp.io.save_hdf5(x, p, "u"),
        lambda p: hpctp.io.load_hdf5(p, "u", g, (0,)),
        lambda p: hpctp.io.FieldDataset(p, "u", g, ()).close(),
        lambda p: hpctp.io.save_checkpoint(p, model, None, 1, g),
        lambda p: hpctp.io.load_checkpoint(p, model, None, g),
    ):
        with pytest.raises(TypeError, match="path must be a str or os.PathLike, got NoneType"):
            call(None if odd else good)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        hpctp.io.save_checkpoint(shared_dir / "c.h5", None if odd else model, None, 1, g)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="grid must be a hpctp.ProcessGrid"):
        hpctp.io.load_hdf5(good, "u", "grid", (0,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache_bytes must be None or an int >= 0, got -1"):
        hpctp.io.FieldDataset(good, "u", g, (), cache_bytes=-1 if odd else None)
    hpctp.io.save_hdf5(x, str(good).encode(), "b")  # bytes paths work for saving, as for loading
    assert_equal(g, hpctp.io.load_hdf5(str(good).encode(), "b", g, (0,)).gather(root=None), np.zeros(4))


@pytest.mark.mpi
def test_os_errors_keep_their_type_on_every_rank(grid1d: hpctp.ProcessGrid, shared_dir: Path) -> None:
    """Other ranks raised plain OSError (or RuntimeError) for what rank 0 saw as a FileExistsError."""
    x = hpctp.zeros((4,), grid1d, 0)
    hpctp.io.save_hdf5(x, shared_dir / "f.h5", "u")
    with pytest.raises(FileExistsError, match="exists and mode='x'"):
        hpctp.io.save_hdf5(x, shared_dir / "f.h5", "u", mode="x")
    with pytest.raises(IsADirectoryError, match="it is a directory"):
        hpctp.io.save_hdf5(x, shared_dir, "u")


@pytest.mark.mpi
def test_scalar_with_compression_and_float_chunks(grid1d: hpctp.ProcessGrid, shared_dir: Path) -> None:
    """A 0-d tensor ignores compression as an empty one does (HDF5 cannot chunk either); chunk
    extents must be ints (1.5 was truncated to 1)."""
    path = shared_dir / "s.h5"
    hpctp.io.save_hdf5(hpctp.full((), 2.5, grid1d, ()), path, "s", compression="gzip")
    assert_equal(grid1d, hpctp.io.load_hdf5(path, "s", grid1d, ()).local, np.array(2.5))
    with pytest.raises(TypeError, match=r"chunks=\(1.5,\) must hold ints"):
        hpctp.io.save_hdf5(hpctp.zeros((4,), grid1d, 0), path, "c", chunks=(1.5,))
