"""hpctp.io.save_checkpoint / load_checkpoint: restart on other grids and rank counts, validation."""

from __future__ import annotations

import os
import subprocess
import sys
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
from hpctp.testing import assert_all, assert_allclose, assert_equal

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ckpt_job import Net, gathered, train_step  # noqa: E402

WORLD = MPI.COMM_WORLD
METHODS = ["serial", "mpio"] if hpctp.io.mpio_available() else ["serial"]  # see tests/test_io.py
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One empty directory, created by rank 0 and used by every rank."""
    mine = str(tmp_path_factory.mktemp("ckpt")).encode() if WORLD.rank == 0 else None
    return Path(bcast_bytes(WORLD, mine).decode())


def trained(grid: hpctp.ProcessGrid, steps: int = 2) -> tuple[Net, torch.optim.Adam]:
    net = Net(grid, seed=0)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    for _ in range(steps):
        train_step(net, opt)
    return net, opt


def fresh(grid: hpctp.ProcessGrid) -> tuple[Net, torch.optim.Adam]:
    net = Net(grid, seed=42)
    return net, torch.optim.Adam(net.parameters(), lr=0.5)


def local_values(net: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: t.detach().numpy().copy() for k, t in net.state_dict().items()}


# ---------------------------------------------------------------------------- restarts in one job
@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
def test_restart_on_another_grid_shape(grid2d: hpctp.ProcessGrid, shared_dir: Path, method: str) -> None:
    """Saved on a 1 x size grid, restored on every 2-D grid of the same size."""
    with hpctp.ProcessGrid((1, WORLD.size)) as save_grid:
        net, opt = trained(save_grid)
        hpctp.io.save_checkpoint(shared_dir / "c.h5", net, opt, 2, save_grid, method=method)
        want_params = gathered(net)
        want_losses = [train_step(net, opt) for _ in range(2)]
    net2, opt2 = fresh(grid2d)
    step = hpctp.io.load_checkpoint(shared_dir / "c.h5", net2, opt2, grid2d, method=method)
    assert_all(grid2d, step == 2, f"step {step}")
    got = gathered(net2)
    for name in want_params:
        assert_equal(grid2d, got[name], want_params[name], name)
    assert_all(grid2d, opt2.param_groups[0]["lr"] == 0.05, "param_groups restored")
    steps = [tuple(st["step"].shape) for st in opt2.state.values()]
    assert_all(grid2d, steps == [()] * len(opt.state), f"Adam's 0-d step counters came back as {steps}")
    losses = [train_step(net2, opt2) for _ in range(2)]
    assert_allclose(grid2d, losses, want_losses, rtol=1e-12, what="next losses (Adam moments restored)")


@pytest.mark.mpi
def test_model_only_and_global_datasets(grid2d: hpctp.ProcessGrid, shared_dir: Path) -> None:
    net, _ = trained(grid2d, steps=1)
    path = shared_dir / "m.h5"
    hpctp.io.save_checkpoint(path, net, None, 5, grid2d)
    full = gathered(net)
    ok, msg = True, ""
    if grid2d.rank == 0:  # plain h5py sees global, unsharded tensors
        with h5py.File(path, "r") as f:
            ok = np.array_equal(f["model/w"][...], full["w"]) and np.array_equal(f["model/b"][...], full["b"])
            ok = ok and "optimizer" not in f and int(f.attrs["step"]) == 5 and f["model/w"].attrs["split"] == "[0, 1]"
            msg = "global datasets"
    assert_all(grid2d, ok, msg)
    net2, opt2 = fresh(grid2d)
    with pytest.raises(KeyError, match="no optimizer state"):
        hpctp.io.load_checkpoint(path, net2, opt2, grid2d)
    assert_all(grid2d, hpctp.io.load_checkpoint(path, net2, None, grid2d) == 5)
    assert_equal(grid2d, gathered(net2)["w"], full["w"])


# ---------------------------------------------------------------------------- validation
class Other(Net):
    """Net with an extra sharded parameter ``extra`` and ``w`` of another global shape."""

    def __init__(self, grid: hpctp.ProcessGrid, rows: int = 6) -> None:
        super().__init__(grid, seed=3)
        layout = Layout((rows, 10), grid.dims, (0, 1))
        self.w = torch.nn.Parameter(torch.zeros(layout.local_shape(grid.coords), dtype=torch.float64))
        self.w.hpctp_layout = layout  # type: ignore[attr-defined]
        self.extra = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))


@pytest.mark.mpi
def test_load_validation_leaves_model_untouched(grid2d: hpctp.ProcessGrid, shared_dir: Path) -> None:
    net, opt = trained(grid2d, steps=1)
    path = shared_dir / "c.h5"
    hpctp.io.save_checkpoint(path, net, opt, 1, grid2d)
    other = Other(grid2d)
    before = local_values(other)
    with pytest.raises(KeyError, match=r"missing keys \['model/extra'\]"):
        hpctp.io.load_checkpoint(path, other, None, grid2d)
    del other.extra
    lost = Net(grid2d, seed=1)
    del lost.b
    with pytest.raises(KeyError, match=r"unexpected keys \['model/b'\].*strict=False"):
        hpctp.io.load_checkpoint(path, lost, None, grid2d)
    other7 = Other(grid2d, rows=7)
    del other7.extra
    with pytest.raises(ValueError, match=r"model/w: file \(6, 10\) float64, model \(7, 10\) float64"):
        hpctp.io.load_checkpoint(path, other7, None, grid2d)
    after = local_values(other)
    assert_all(grid2d, all(np.array_equal(before[k], v) for k, v in after.items()), "model unchanged")
    net2 = Net(grid2d, seed=5)
    opt2 = torch.optim.Adam([{"params": [net2.w]}, {"params": [net2.b, net2.lin.weight, net2.lin.bias]}])
    with pytest.raises(ValueError, match="optimizer param groups differ"):
        hpctp.io.load_checkpoint(path, net2, opt2, grid2d)
    sgd = torch.optim.SGD(net2.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"saved from torch\.optim\.adam\.Adam, but the optimizer is .*SGD"):
        hpctp.io.load_checkpoint(path, net2, sgd, grid2d)
    with pytest.raises(FileNotFoundError, match="nothing.h5"):
        hpctp.io.load_checkpoint(shared_dir / "nothing.h5", net2, None, grid2d)
    x = hpctp.zeros((3,), grid2d, None)
    hpctp.io.save_hdf5(x, shared_dir / "plain.h5", "u")
    with pytest.raises(ValueError, match="not an hpctp checkpoint"):
        hpctp.io.load_checkpoint(shared_dir / "plain.h5", net2, None, grid2d)


@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
def test_save_validation_and_failed_save_keeps_old(
    grid2d: hpctp.ProcessGrid, shared_dir: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    net, opt = trained(grid2d, steps=1)
    path = shared_dir / "c.h5"
    hpctp.io.save_checkpoint(path, net, opt, 1, grid2d, method=method)
    before = path.read_bytes()
    bad = Net(grid2d, seed=0)
    bad.w.hpctp_layout = Layout((6, 10), tuple(reversed(grid2d.dims)) + (1,), (0, 1))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="grid dims"):
        hpctp.io.save_checkpoint(path, bad, None, 2, grid2d)
    with pytest.raises(ValueError, match="step must be"):
        hpctp.io.save_checkpoint(path, net, opt, -1, grid2d)
    if grid2d.size > 1:
        odd = Net(grid2d, seed=0)
        if grid2d.rank == 1:
            odd.extra = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        with pytest.raises(ValueError, match="differs between ranks"):
            hpctp.io.save_checkpoint(path, odd, None, 2, grid2d)
        tiled = Net(grid2d, seed=0)  # same names, shapes and dtypes, but each rank's own tiling
        mine = Layout((4, 4), grid2d.dims, (0, 1) if grid2d.rank != 1 else (1, 0))
        tiled.w = torch.nn.Parameter(torch.zeros(mine.local_shape(grid2d.coords), dtype=torch.float64))
        tiled.w.hpctp_layout = mine  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="differs between ranks.*layouts"):
            hpctp.io.save_checkpoint(path, tiled, None, 2, grid2d)
    original = h5py.Dataset.write_direct

    def failing_write(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, **kwargs)
        if "dest_sel" in kwargs:  # a rank's hyperslab write (not rank 0 laying out the file)
            raise OSError("node lost (injected)")

    monkeypatch.setattr(h5py.Dataset, "write_direct", failing_write)
    train_step(net, opt)
    with pytest.raises(OSError, match="injected"):
        hpctp.io.save_checkpoint(path, net, opt, 2, grid2d, method=method)
    assert_all(grid2d, path.read_bytes() == before and os.listdir(shared_dir) == ["c.h5"], "old checkpoint kept")


# ---------------------------------------------------------------------------- other rank counts
def _mpiexec(n: int, *args: str, timeout: float = 240) -> None:
    mpiexec = Path(sys.executable).with_name("mpiexec")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_", "MPIR_CVAR_"))
    }
    env.update(OMP_NUM_THREADS="1", MPIR_CVAR_ENABLE_HEAVY_YIELD="1", PYTHONUNBUFFERED="1")
    cmd = [str(mpiexec), "-n", str(n), sys.executable, str(ROOT / "tests/scripts/ckpt_job.py"), *args]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(WORLD.size > 1, reason="launches its own mpiexec jobs; run from the 1-rank session")
def test_saved_on_4_ranks_restores_on_1_2_3(tmp_path: Path) -> None:
    _mpiexec(4, "save", str(tmp_path), "2x2")
    saved = np.load(tmp_path / "save_2x2.npz", allow_pickle=False)
    for n, dims in ((1, "1x1"), (2, "1x2"), (3, "3x1")):
        _mpiexec(n, "load", str(tmp_path), dims)
        got = np.load(tmp_path / f"load_{dims}.npz", allow_pickle=False)
        assert int(got["step"]) == int(saved["step"]) == 3
        for name in ("w", "b", "lin.weight", "lin.bias"):
            np.testing.assert_array_equal(got[name], saved[name], err_msg=f"{name} restored on {dims}")
        np.testing.assert_allclose(got["losses"], saved["losses"], rtol=1e-12, err_msg=f"next losses on {dims}")
        assert float(got["lr"]) == 0.05
