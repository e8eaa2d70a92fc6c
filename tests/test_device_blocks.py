"""Device blocks through every layer of hpctp: comm, core ops, SUMMA, halo, nn layers, HDF5.

Each test runs once per *kind* of block, and must equal numpy/torch on the gathered tensor:

* ``cpu-staged`` (everywhere, CI included): torch CPU blocks that the comm layer treats as
  device memory, so every message goes through the pinned staging pool. This covers the
  staging logic (copies in and out, buffer reuse) without a GPU.
* ``cuda-staged`` / ``cupy-staged`` (a GPU is visible): torch CUDA tensors / cupy arrays with
  ``HPCTP_CUDA_AWARE=0``, staged through pinned host buffers.
* ``cuda-aware`` / ``cupy-aware`` (a GPU, and an MPI library that reports CUDA support, or
  device memory allocated as CUDA managed memory, which any MPI can read: see
  ``_managed_memory``): device buffers handed to MPI directly, nothing staged.

``benchmarks/gpu_check.sh`` runs this file on 1, 2 and 4 ranks; where the MPI library is not
CUDA-aware it runs the aware kinds once more on managed memory (``-k aware``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.layers import compare_layer
from helpers.linear import param_block, reference_linear
from mpi4py import MPI

import hpctp
import hpctp.comm.buffers as B
from hpctp._util.backend import from_numpy, is_cupy, is_torch
from hpctp.comm.io_calls import bcast_bytes
from hpctp.nn.conv import Conv2d
from hpctp.nn.functional import spectral_conv_fft
from hpctp.nn.linear import ColumnParallelLinear, Linear2D, RowParallelLinear
from hpctp.nn.norm import BatchNorm2d
from hpctp.nn.pool import MaxPool2d
from hpctp.nn.spectral import SpectralConv2d
from hpctp.testing import assert_all, assert_allclose, assert_equal

WORLD = MPI.COMM_WORLD
F64 = torch.float64


@dataclass(frozen=True)
class Kind:
    """One kind of local block: ``like`` is the backend name the factories and IO take."""

    name: str
    like: str  # "torch" (CPU, staged as if on a device), "cuda" or "cupy"
    aware: bool

    @property
    def device(self) -> str:
        """torch device of the blocks (cupy kinds: not used)."""
        return "cuda" if self.like == "cuda" else "cpu"

    def block(self, a: np.ndarray) -> Any:
        return from_numpy(np.ascontiguousarray(a), self.like)

    def holds(self, x: Any) -> bool:
        """``x`` is a block of this kind (same backend, same memory)."""
        if self.like == "cupy":
            return is_cupy(x)
        return is_torch(x) and x.device.type == self.device


def _managed_memory() -> bool:
    """``HPCTP_TEST_MANAGED_ALLOC=<benchmarks/managed_alloc.c built as a .so>``: allocate torch CUDA
    and cupy memory as CUDA managed memory, which the CPU can read and write too. An MPI library
    that is not CUDA-aware can then be handed device buffers directly, so the CUDA-aware path of
    the comm layer (nothing staged) runs on a GPU machine without a CUDA-aware MPI."""
    path = os.environ.get("HPCTP_TEST_MANAGED_ALLOC", "")
    if not path or not torch.cuda.is_available():
        return False
    managed = torch.cuda.memory.CUDAPluggableAllocator(path, "hpctp_managed_malloc", "hpctp_managed_free")
    torch.cuda.memory.change_current_allocator(managed)  # before the first CUDA tensor
    try:
        import cupy

        cupy.cuda.set_allocator(cupy.cuda.MemoryPool(cupy.cuda.malloc_managed).malloc)
    except ImportError:
        pass
    return True


def _gpu_kinds() -> list[Kind]:
    if not torch.cuda.is_available():
        return []
    # forcing the CUDA-aware path on a plain MPI would crash, unless device memory is managed
    aware = hpctp.comm.cuda_aware_reason(override=False)[0] or _managed_memory()
    out = [Kind("cuda-staged", "cuda", False)] + ([Kind("cuda-aware", "cuda", True)] if aware else [])
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            out += [Kind("cupy-staged", "cupy", False)] + ([Kind("cupy-aware", "cupy", True)] if aware else [])
    except Exception:  # no cupy, or cupy without a driver
        pass
    return out


KINDS = [Kind("cpu-staged", "torch", False), *_gpu_kinds()]
TORCH_KINDS = [k for k in KINDS if k.like != "cupy"]


@pytest.fixture(params=KINDS, ids=lambda k: k.name)
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Kind:
    k: Kind = request.param
    monkeypatch.setenv("HPCTP_CUDA_AWARE", "1" if k.aware else "0")
    if k.name == "cpu-staged":  # the comm layer sees CPU tensors as device memory
        real = B.is_device
        monkeypatch.setattr(B, "is_device", lambda x: is_torch(x) or real(x))
        monkeypatch.setattr(B, "synchronize", lambda x: None)
    else:
        hpctp.comm.select_device(WORLD)
    monkeypatch.setattr(B, "_pinned", {})  # an empty staging pool for this test
    return k


@pytest.fixture
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One empty directory, created by rank 0 and used by every rank."""
    mine = str(tmp_path_factory.mktemp("dev")).encode() if WORLD.rank == 0 else None
    return Path(bcast_bytes(WORLD, mine).decode())


def _twice_with_reused_staging(grid: hpctp.ProcessGrid, kind: Kind, run: Any) -> None:
    """Run ``run`` twice: the second run must add no staging buffer (the pool is reused);
    device kinds must stage on a multi-rank grid unless MPI is CUDA-aware."""
    run()
    first = hpctp.comm.staging_pool()
    run()
    assert_equal(grid, np.array(hpctp.comm.staging_pool()), np.array(first), "second run reuses the staging pool")
    if kind.aware:
        assert_equal(grid, np.array(first), np.array((0, 0)), "CUDA-aware MPI: nothing staged")
    elif grid.size > 1:
        assert_all(grid, first[0] > 0, f"device blocks staged through host buffers, pool {first}")


# ----------------------------------------------------------------------------- core ops
@pytest.mark.mpi
def test_core_ops_keep_blocks_on_the_device(grid2d: hpctp.ProcessGrid, kind: Kind) -> None:
    a = np.arange(63, dtype=np.float64).reshape(9, 7) ** 1.5
    rank0 = grid2d.rank == 0
    x = hpctp.distribute(kind.block(a) if rank0 else None, grid2d, (0, 1))
    b = hpctp.distribute(kind.block(a.T * 0.5) if rank0 else None, grid2d, (1, 0))
    b3 = a[None] * (1 - 0.5j)
    x3 = hpctp.distribute(kind.block(b3) if rank0 else None, grid2d, (None, 0, 1))
    assert_all(grid2d, kind.holds(x.local) and kind.holds(b.local), "distribute: blocks of this kind")

    def run() -> None:
        for split in [(1, 0), (None, 0), (None, None), (0, None)]:
            y = x.redistribute(split)
            assert_all(grid2d, kind.holds(y.local), f"redistribute {split} keeps the kind")
            assert_equal(grid2d, y.gather(None), a, f"redistribute {split}")
        g = x.gather(0)
        assert_all(grid2d, g is None if not rank0 else kind.holds(g), "gather on the root keeps the kind")
        assert_allclose(grid2d, float(x.sum()), a.sum(), what="sum")
        m = x.max(0)
        assert_all(grid2d, kind.holds(m.local), "reduction keeps the kind")
        assert_allclose(grid2d, m.gather(None), a.max(0), what="max over axis 0")
        assert_allclose(grid2d, x.mean(1).gather(None), a.mean(1), what="mean over axis 1")
        c = hpctp.matmul(x, b)
        assert_all(grid2d, kind.holds(c.local), "SUMMA result keeps the kind")
        assert_allclose(grid2d, c.gather(None), a @ (a.T * 0.5), rtol=1e-12, what="SUMMA")
        h = hpctp.HaloExchange(x, 1, boundary="periodic")
        padded = h.end(h.begin(x.local))
        assert_all(grid2d, kind.holds(padded), "halo exchange keeps the kind")
        r0, c0 = x.local_offsets
        want = np.pad(a, 1, mode="wrap")[r0 : r0 + padded.shape[0], c0 : c0 + padded.shape[1]]
        assert_equal(grid2d, padded, want, "periodic halo of width 1")
        f = hpctp.fft.rfftn(x)  # the backend's own FFT on the blocks (divided along both dims: merged grid)
        assert_all(grid2d, kind.holds(f.local), "FFT keeps the kind")
        assert_allclose(grid2d, f.gather(None), np.fft.rfftn(a), rtol=1e-12, atol=1e-9, what="rfftn")
        back = hpctp.fft.irfftn(f, n=a.shape[1])  # the backend's ifft, then its irfft
        assert_all(grid2d, kind.holds(back.local), "inverse FFT keeps the kind")
        assert_allclose(grid2d, back.gather(None), a, rtol=1e-12, atol=1e-9, what="irfftn(rfftn(x))")
        z = hpctp.fft.fftn(x3, axes=(1, 2))  # on a 2x2 grid some ranks hold empty blocks in a step
        assert_allclose(grid2d, z.gather(None), np.fft.fftn(b3, axes=(1, 2)), rtol=1e-12, atol=1e-9, what="fftn")
        z = hpctp.fft.ifftn(z, axes=(1, 2))
        assert_all(grid2d, kind.holds(z.local), "complex inverse FFT keeps the kind")
        assert_allclose(grid2d, z.gather(None), b3, rtol=1e-12, atol=1e-9, what="ifftn(fftn(x))")
        e = hpctp.fft.radial_spectrum(x)  # binned with the backend's own bincount
        want = hpctp.fft.radial_spectrum(x.to("numpy"))
        assert_allclose(grid2d, e, want, rtol=1e-12, atol=1e-12, what="radial_spectrum vs numpy blocks")
        assert_allclose(grid2d, e.sum(), (a**2).mean(), rtol=1e-12, what="Parseval")
        row = x[4, 1::2]  # an int along a divided dim: the row's owners send it along grid axis 0
        assert_all(grid2d, kind.holds(row.local), "x[int, slice] keeps the kind")
        assert_equal(grid2d, row.gather(None), a[4, 1::2], "x[4, 1::2]")
        u = np.hypot(np.sin(x), 2.0)  # numpy ufuncs on the device blocks (torch's or cupy's functions)
        assert_all(grid2d, kind.holds(u.local), "numpy ufuncs keep the kind")
        assert_allclose(grid2d, u.gather(None), np.hypot(np.sin(a), 2.0), rtol=1e-14, what="hypot(sin(x), 2)")
        y = x.copy()
        y[2:, 3] = np.arange(7.0)  # a host value written into the device blocks
        want = a.copy()
        want[2:, 3] = np.arange(7.0)
        assert_equal(grid2d, y.gather(None), want, "x[2:, 3] = host array")
        s = np.roll(x, (1, -2), (0, 1)) + x[::-1, ::-1]  # remapped moves: leaving rows, reversed pieces
        assert_all(grid2d, kind.holds(s.local), "roll and reversed slices keep the kind")
        assert_equal(grid2d, s.gather(None), np.roll(a, (1, -2), (0, 1)) + a[::-1, ::-1], "roll + x[::-1, ::-1]")
        d = x[1:] - x[:-1]  # operands cut differently: the right one aligned
        assert_equal(grid2d, d.gather(None), np.diff(a, axis=0), "x[1:] - x[:-1]")
        j = hpctp.concatenate([x, x[:3]], axis=0)
        assert_all(grid2d, kind.holds(j.local), "concatenate keeps the kind")
        assert_equal(grid2d, j.gather(None), np.concatenate([a, a[:3]], axis=0), "concatenate")
        p = np.pad(x, ((1, 2), (3, 0)), mode="wrap") + np.pad(x, ((1, 2), (3, 0)), constant_values=-1.0)
        assert_all(grid2d, kind.holds(p.local), "pad keeps the kind")
        want = np.pad(a, ((1, 2), (3, 0)), mode="wrap") + np.pad(a, ((1, 2), (3, 0)), constant_values=-1.0)
        assert_equal(grid2d, p.gather(None), want, "np.pad wrap + constant")
        bt = np.broadcast_to(x[3:4], (2, 9, 7))  # the row is replicated along grid axis 0 first
        assert_all(grid2d, kind.holds(bt.local), "broadcast_to keeps the kind")
        assert_equal(grid2d, bt.gather(None), np.broadcast_to(a[3:4], (2, 9, 7)), "np.broadcast_to")
        gr = np.gradient(x, 0.5, axis=1, edge_order=2)
        assert_allclose(grid2d, gr.gather(None), np.gradient(a, 0.5, axis=1, edge_order=2), rtol=1e-14, what="gradient")
        cs = np.cumsum(x, axis=0) - x.var(1, keepdims=True)  # a scan and a variance on the device blocks
        assert_all(grid2d, kind.holds(cs.local), "cumsum and var keep the kind")
        want = np.cumsum(a, axis=0) - a.var(1, keepdims=True)
        assert_allclose(grid2d, cs.gather(None), want, rtol=1e-13, what="cumsum - var")
        md = np.median(x, axis=0) + np.quantile(x, 0.3)  # order statistics (searched on the host)
        assert_all(grid2d, kind.holds(md.local), "median and quantile keep the kind")
        assert_equal(grid2d, md.gather(None), np.median(a, axis=0) + np.quantile(a, 0.3), "median + quantile")
        mesh = np.cumsum(np.linspace(0.5, 2.0, 9))  # coordinates: numpy's weights as profiles on the device
        gr = np.gradient(x, mesh, axis=0)
        assert_all(grid2d, kind.holds(gr.local), "gradient with coordinates keeps the kind")
        assert_allclose(grid2d, gr.gather(None), np.gradient(a, mesh, axis=0), rtol=1e-14, what="gradient, coordinates")
        if kind.like != "cupy":  # torch's pointwise functions and a differentiable sum on the device blocks
            xg = x.with_local(x.local.clone().requires_grad_(True))
            loss = (torch.tanh(xg * 0.01) - xg.mean()).sum()
            loss.local.backward()
            assert_all(grid2d, kind.holds(xg.local.grad), "gradient on the device")
            t = np.tanh(a * 0.01)
            assert_allclose(grid2d, float(loss.local.detach()), (t - a.mean()).sum(), rtol=1e-12, what="loss")
            want = (0.01 * (1 - t**2) - 1.0)[x.local_slices]  # d/dx of sum(tanh(x/100) - mean(x))
            assert_allclose(grid2d, xg.local.grad, want, rtol=1e-12, atol=1e-14, what="gradient")

    _twice_with_reused_staging(grid2d, kind, run)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", TORCH_KINDS, ids=lambda k: k.name, indirect=True)
def test_staging_keeps_every_dtype(world: MPI.Intracomm, kind: Kind) -> None:
    """bfloat16 (moved as int16, reduced as float32), complex and int blocks survive a broadcast,
    a sum to every rank and a sum to one root, from device memory."""
    size, root = world.Get_size(), world.Get_size() - 1
    for dtype in (torch.bfloat16, torch.complex128, torch.int32):
        want = (torch.arange(6, dtype=torch.float64) * 1.5 - 2).to(dtype)  # exact in every dtype
        if dtype.is_complex:
            want = want * (1 - 2j)
        x = (want.clone() if world.rank == root else torch.zeros(6, dtype=dtype)).to(kind.device)
        hpctp.comm.bcast(world, x, root=root)
        assert_all(world, kind.holds(x), f"{dtype} stays on the device")
        assert_equal(world, x.cpu().to(torch.complex128), want.to(torch.complex128), f"bcast {dtype}")
        total = want.to(torch.complex128) * size  # exact too
        s = want.clone().to(kind.device)
        hpctp.comm.allreduce(world, s, "sum")
        assert_equal(world, s.cpu().to(torch.complex128), total, f"allreduce {dtype}")
        r = want.clone().to(kind.device)
        hpctp.comm.ireduce(world, r, root=root).wait()
        if world.rank == root:
            assert_equal(world, r.cpu().to(torch.complex128), total, f"ireduce {dtype}")
        else:
            assert_equal(world, r.cpu().to(torch.complex128), want.to(torch.complex128), f"ireduce {dtype}: input kept")


# ----------------------------------------------------------------------------- nn layers
@pytest.mark.mpi
@pytest.mark.parametrize("kind", TORCH_KINDS, ids=lambda k: k.name, indirect=True)
def test_layers_forward_backward_on_the_device(grid2d: hpctp.ProcessGrid, kind: Kind) -> None:
    dev = kind.device
    conv = Conv2d(2, 3, 3, padding=1, grid=grid2d, seed=7, dtype=F64).to(dev)
    torch.manual_seed(7)
    ref = torch.nn.Conv2d(2, 3, 3, padding=1, dtype=F64)
    params, rparams = [conv.weight, conv.bias], [ref.weight, ref.bias]
    compare_layer(grid2d, conv, ref, (1, 2, 9, 7), (None, None, 0, 1), params, rparams, skew=True, device=dev)
    pool = MaxPool2d(2, 1, 1, grid=grid2d)
    compare_layer(grid2d, pool, torch.nn.MaxPool2d(2, 1, 1), (1, 1, 5, 7), (None, None, 0, 1), device=dev)
    norm = BatchNorm2d(2, grid=grid2d, dtype=F64).to(dev)
    ref_norm = torch.nn.BatchNorm2d(2, dtype=F64)
    w = [norm.weight, norm.bias]
    compare_layer(grid2d, norm, ref_norm, (2, 2, 5, 6), (None, None, 0, 1), w, [ref_norm.weight, ref_norm.bias],
                  sync=norm, device=dev)  # fmt: skip
    assert_allclose(grid2d, norm.running_mean, ref_norm.running_mean, rtol=1e-12, what="running mean")
    spec = SpectralConv2d(2, 3, (2, 3), grid=grid2d, seed=1, dtype=F64).to(dev)  # DFT matrices on the device
    w_ref = spec.weight.detach().cpu().clone().requires_grad_()
    compare_layer(grid2d, spec, lambda X: spectral_conv_fft(X, w_ref), (2, 2, 7, 6), (None, None, 0, 1),
                  [spec.weight], [w_ref], skew=True, sync=spec, device=dev)  # fmt: skip

    # Linear2D (SUMMA inside autograd), then a Megatron column -> tanh -> row MLP
    gen = torch.Generator().manual_seed(3)
    X, G1, G2 = (torch.randn(*s, generator=gen, dtype=F64) for s in ((5, 7), (5, 6), (5, 4)))
    lin = Linear2D(7, 6, grid2d, dtype=F64, panel=2, seed=5, device=dev)
    col = ColumnParallelLinear(7, 8, grid2d, axis=1, dtype=F64, seed=1, device=dev)
    row = RowParallelLinear(8, 4, grid2d, axis=1, dtype=F64, seed=2, device=dev)
    r_lin, r_col, r_row = (reference_linear(m, grid2d, m.in_features, m.out_features) for m in (lin, col, row))
    xr1, xr2 = X.clone().requires_grad_(), X.clone().requires_grad_()
    ((r_lin(xr1) * G1).sum() + (r_row(torch.tanh(r_col(xr2))) * G2).sum()).backward()
    xl = hpctp.Layout((5, 7), grid2d.dims, (0, 1)).local_slices(grid2d.coords)
    yl = hpctp.Layout((5, 6), grid2d.dims, (0, 1)).local_slices(grid2d.coords)
    x1, x2 = X[xl].clone().to(dev).requires_grad_(), X.clone().to(dev).requires_grad_()
    y1, y2 = lin(x1), row(torch.tanh(col(x2)))
    assert_all(grid2d, y1.device.type == dev and y2.device.type == dev, "outputs on the device")
    ((y1 * G1[yl].to(dev)).sum() + (y2 * G2.to(dev)).sum()).backward()
    assert_allclose(grid2d, y1.detach(), r_lin(X).detach()[yl], rtol=1e-12, atol=1e-14, what="Linear2D output")
    assert_allclose(grid2d, y2.detach(), r_row(torch.tanh(r_col(X))).detach(), rtol=1e-12, atol=1e-14, what="MLP")
    assert_allclose(grid2d, x1.grad, xr1.grad[xl], rtol=1e-12, atol=1e-14, what="Linear2D input gradient")
    assert_allclose(grid2d, x2.grad, xr2.grad, rtol=1e-12, atol=1e-14, what="MLP input gradient")
    for layer, r in ((lin, r_lin), (col, r_col), (row, r_row)):
        assert_all(grid2d, layer.weight.grad.device.type == dev, "weight gradient on the device")
        assert_allclose(
            grid2d, layer.weight.grad, param_block(layer.weight, r.weight.grad, grid2d), rtol=1e-12, atol=1e-14
        )
        assert_allclose(grid2d, layer.bias.grad, param_block(layer.bias, r.bias.grad, grid2d), rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- HDF5
@pytest.mark.mpi
def test_hdf5_keeps_device_blocks(grid2d: hpctp.ProcessGrid, kind: Kind, shared_dir: Path) -> None:
    a = np.arange(2 * 9 * 7, dtype=np.float32).reshape(2, 9, 7) / 7
    path = shared_dir / "u.h5"
    x = hpctp.distribute(kind.block(a) if grid2d.rank == 0 else None, grid2d, (None, 0, 1))
    hpctp.io.save_hdf5(x, path, "u", mode="w")
    y = hpctp.io.load_hdf5(path, "u", grid2d, (None, 1, 0), like=kind.like)
    assert_all(grid2d, kind.holds(y.local), "load_hdf5(like=...) gives blocks of this kind")
    assert_equal(grid2d, y.gather(None), a, "HDF5 round trip")
    ds = hpctp.io.FieldDataset(path, "u", grid2d, (0, 1), targets=1, like=kind.like)
    for inputs, targets in hpctp.io.FieldLoader(ds, batch_size=1, prefetch=1):
        on_mine = kind.holds(inputs.local) and kind.holds(targets.local)
        if kind.like == "cuda":  # the prefetch thread made them on this rank's device
            on_mine = on_mine and inputs.local.device.index == torch.cuda.current_device()
        assert_all(grid2d, on_mine, "prefetched batches on this rank's device")
        assert_equal(grid2d, targets.gather(None), a[1:], "target of sample 0")
    ds.close()


@pytest.mark.mpi
@pytest.mark.parametrize("kind", TORCH_KINDS, ids=lambda k: k.name, indirect=True)
def test_checkpoint_of_a_model_on_the_device(grid2d: hpctp.ProcessGrid, kind: Kind, shared_dir: Path) -> None:
    dev = kind.device
    net = Linear2D(6, 5, grid2d, dtype=F64, seed=4, device=dev)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2)
    X = torch.randn(3, 6, generator=gen, dtype=F64)
    xl = hpctp.Layout((3, 6), grid2d.dims, (0, 1)).local_slices(grid2d.coords)
    net(X[xl].to(dev)).square().sum().backward()
    opt.step()
    hpctp.io.save_checkpoint(shared_dir / "c.h5", net, opt, 1, grid2d)
    net2 = Linear2D(6, 5, grid2d, dtype=F64, seed=9, device=dev)
    opt2 = torch.optim.Adam(net2.parameters(), lr=0.1)
    step = hpctp.io.load_checkpoint(shared_dir / "c.h5", net2, opt2, grid2d)
    assert_equal(grid2d, np.array(step), np.array(1), "step")
    for p, q in zip(net.parameters(), net2.parameters()):
        assert_all(grid2d, q.device.type == dev, "loaded parameters stay on the device")
        assert_equal(grid2d, q.detach(), p.detach(), "parameter")
        for key in ("exp_avg", "exp_avg_sq"):
            s = opt2.state[q][key]
            assert_all(grid2d, s.device.type == dev, f"optimizer {key} on the parameter's device")
            assert_equal(grid2d, s, opt.state[p][key], f"optimizer {key}")
