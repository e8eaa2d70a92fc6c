"""Fourier layers (FNO spectral conv) on partitioned fields vs torch.fft on the gathered field."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from helpers.layers import compare_layer, global_field
from helpers.layouts import make_layout
from mpi4py import MPI

import hpctp
from hpctp.nn import SpectralConv1d, SpectralConv2d, SpectralConv3d, fourier
from hpctp.nn._dft import check_modes, forward_matrix, inverse_matrix, kept_modes
from hpctp.nn.functional import spectral_conv, spectral_conv_fft
from hpctp.testing import assert_all, assert_allclose, assert_equal

F64 = torch.float64


def _weight(cin: int, cout: int, ks: tuple[int, ...], seed: int, dtype: torch.dtype = F64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(cin, cout, *ks, 2, generator=g, dtype=F64).to(dtype)


# ----------------------------------------------------------------- local math (no MPI)
@pytest.mark.parametrize("n", [1, 2, 7, 8, 13])
def test_truncated_dft_matrices_match_torch_fft(n: int) -> None:
    """Row blocks of forward_matrix are torch.fft's kept columns; inverse_matrix inverts them."""
    x = torch.randn(3, n, dtype=F64)
    for half in (False, True):
        mmax = n // 2 + 1 if half else n // 2
        for m in sorted({1, mmax}) if mmax else []:
            k = torch.from_numpy(kept_modes(n, m, half))
            ref = (torch.fft.rfft(x) if half else torch.fft.fft(x))[:, k]
            cut = n // 3
            xc = x.to(torch.complex128)
            parts = xc[:, :cut] @ forward_matrix(n, 0, cut, m, half, F64, torch.device("cpu"))
            parts = parts + xc[:, cut:] @ forward_matrix(n, cut, n, m, half, F64, x.device)
            np.testing.assert_allclose(parts.numpy(), ref.numpy(), rtol=1e-12, atol=1e-12)
            spec = torch.randn(3, len(k), dtype=torch.complex128)
            full = torch.zeros(3, n // 2 + 1 if half else n, dtype=torch.complex128)
            full[:, k] = spec
            want = torch.fft.irfft(full, n=n) if half else torch.fft.ifft(full)
            got = spec @ inverse_matrix(n, 0, n, m, half, F64, x.device)
            got = got.real if half else got
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)


def test_kept_modes_and_limits() -> None:
    assert kept_modes(10, 3, False).tolist() == [0, 1, 2, 7, 8, 9]
    assert kept_modes(10, 3, True).tolist() == [0, 1, 2]
    check_modes(10, 5, False, "d")
    check_modes(10, 6, True, "d")
    with pytest.raises(ValueError, match="6 modes do not fit a dim of size 10"):
        check_modes(10, 6, False, "d")
    with pytest.raises(ValueError, match=r"m <= n // 2 \+ 1 = 6"):
        check_modes(10, 7, True, "d")


def test_fft_reference_is_the_fno_layer() -> None:
    """spectral_conv_fft equals the two-corner layer of Li et al. (weights1/weights2) in 2-D."""
    x = torch.randn(2, 3, 12, 9, dtype=F64)
    w = _weight(3, 4, (6, 4), 0)
    wc = torch.view_as_complex(w)
    xf = torch.fft.rfft2(x)
    of = torch.zeros(2, 4, 12, 5, dtype=torch.complex128)
    of[:, :, :3, :4] = torch.einsum("bixy,ioxy->boxy", xf[:, :, :3, :4], wc[:, :, :3])
    of[:, :, -3:, :4] = torch.einsum("bixy,ioxy->boxy", xf[:, :, -3:, :4], wc[:, :, 3:])
    np.testing.assert_allclose(spectral_conv_fft(x, w).numpy(), torch.fft.irfft2(of, s=(12, 9)).numpy(), rtol=1e-13)


@pytest.mark.parametrize("batch", [1, 3])
def test_mode_mix_equals_einsum(monkeypatch: pytest.MonkeyPatch, batch: int) -> None:
    """The per-mode channel mix, as a broadcast product and as the einsum it replaces (float64)."""
    gen = torch.Generator().manual_seed(batch)
    h = torch.randn(batch, 5, 6, 4, dtype=torch.complex128, generator=gen)
    w = torch.randn(5, 7, 6, 4, dtype=torch.complex128, generator=gen)
    want = torch.einsum("bi...,io...->bo...", h, w)
    got = fourier._mix_modes(h, w)
    assert float((got - want).abs().max()) <= 1e-13 * float(want.abs().max())
    monkeypatch.setattr(fourier, "_BROADCAST_MIX_MAX", 0)
    assert torch.equal(fourier._mix_modes(h, w), want)


def _one_rank_against_fft(
    grid: hpctp.ProcessGrid, shape: tuple[int, ...], path: Callable[[], contextlib.AbstractContextManager[object]]
) -> tuple[torch.Tensor, hpctp.CommCounter, Any]:
    """spectral_conv on a field whole on one rank, under ``path()``, against spectral_conv_fft: output and both
    gradients within 1e-12 (float64). Returns the weight, what the layer sent and the operators it ran."""
    w = _weight(3, 2, (6, 4), 5).requires_grad_()
    x = torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    g = torch.randn(shape[0], 2, *shape[2:], dtype=F64, generator=torch.Generator().manual_seed(5))
    with path(), hpctp.CommCounter() as sent, torch.profiler.profile() as prof:
        y = spectral_conv(x, w, grid=grid, split=(0, 1))
        (y * g).sum().backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    r = spectral_conv_fft(x, w)
    (r * g).sum().backward()
    for got, want in ((y, r), (gx, x.grad), (gw, w.grad)):
        np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=1e-12, atol=1e-13)
    return w, sent, prof


def test_whole_field_fft_path() -> None:
    """A field whole on one rank goes through torch's 1-D FFTs of the kept modes (not the DFT matrices):
    it equals the reference, forward and gradients (float64)."""
    grid = hpctp.ProcessGrid((1, 1), comm=MPI.COMM_SELF)
    w, _, prof = _one_rank_against_fft(grid, (2, 3, 12, 9), contextlib.nullcontext)
    assert any("fft" in e.name for e in prof.events())
    # an empty batch (a data group's empty share): an empty output and a zero weight gradient
    w.grad = None
    e = spectral_conv(torch.zeros(0, 3, 12, 9, dtype=F64), w, grid=grid, split=(0, 1))
    e.sum().backward()
    assert e.shape == (0, 2, 12, 9) and w.grad is not None and not w.grad.any()
    grid.free()


@pytest.mark.parametrize("shape", [(2, 3, 12, 9), (1, 3, 8, 10)])
def test_split_path_on_a_whole_field_equals_the_fft_path(shape: tuple[int, ...]) -> None:
    """``split_path_on_whole_fields`` (what the planner traces for plans that split the field): a whole field goes
    through the DFT matrices and the mix of every mode, no message, and equals torch's FFTs, forward and gradients."""
    grid = hpctp.ProcessGrid((1, 1), comm=MPI.COMM_SELF)
    _, sent, prof = _one_rank_against_fft(grid, shape, fourier.split_path_on_whole_fields)
    assert sent.calls == {} and not any("fft" in e.name for e in prof.events()), sent.calls
    grid.free()


def test_fft_reference_rejects_bad_inputs() -> None:
    w = _weight(2, 2, (2, 3), 0)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got ndarray"):
        spectral_conv_fft(np.zeros((1, 2, 4, 4)), w)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"x has 3 dims; this weight needs \[N, C, \*2 spatial\] \(4 dims\)"):
        spectral_conv_fft(torch.zeros(1, 2, 4, dtype=F64), w)
    with pytest.raises(ValueError, match="3 modes do not fit a dim of size 3"):
        spectral_conv_fft(torch.zeros(1, 2, 4, 3, dtype=F64), w)


# ----------------------------------------------------------------- distributed vs torch.fft
# (shape, modes, skew): odd and even sizes, every mode (2m = n, Nyquist on the last axis),
# blocks of one cell and empty blocks (4 ranks over a dim of 3)
CASES_2D = [
    ((2, 3, 12, 9), (3, 4), False),
    ((1, 2, 8, 10), (4, 6), True),
    ((2, 2, 3, 5), (1, 3), True),
    ((1, 1, 16, 6), (2, 2), False),
]


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES_2D, ids=lambda c: "x".join(map(str, c[0][2:])) + f"-m{c[1][0]}{c[1][1]}")
def test_spectral_conv2d_matches_fft(grid2d: hpctp.ProcessGrid, case: tuple) -> None:
    shape, modes, skew = case
    cin, cout = shape[1], 3
    layer = SpectralConv2d(cin, cout, modes, grid=grid2d, seed=5, dtype=F64)
    w_ref = layer.weight.detach().clone().requires_grad_()
    compare_layer(
        grid2d, layer, lambda X: spectral_conv_fft(X, w_ref), shape, (None, None, 0, 1),
        [layer.weight], [w_ref], skew, sync=layer,
    )  # fmt: skip


@pytest.mark.mpi
@pytest.mark.parametrize("split", [(None, None, 0, None), (None, None, None, 0)], ids=["rows", "cols"])
def test_spectral_conv2d_on_a_1d_grid(grid1d: hpctp.ProcessGrid, split: tuple) -> None:
    """The functional form; the weight's gradient is complete on every rank without any sync."""
    w = _weight(2, 2, (4, 3), 1).requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    compare_layer(
        grid1d, lambda x: spectral_conv(x, w, grid=grid1d, split=split), lambda X: spectral_conv_fft(X, w_ref),
        (2, 2, 7, 6), split, skew=True,
    )  # fmt: skip
    assert_allclose(grid1d, w.grad, w_ref.grad, rtol=1e-10, atol=1e-11, what="weight gradient, no sync")


@pytest.mark.mpi
def test_spectral_conv1d_matches_fft(grid1d: hpctp.ProcessGrid) -> None:
    layer = SpectralConv1d(2, 3, 4, grid=grid1d, seed=2, dtype=F64)
    w_ref = layer.weight.detach().clone().requires_grad_()
    compare_layer(
        grid1d, layer, lambda X: spectral_conv_fft(X, w_ref), (3, 2, 11), (None, None, 0),
        [layer.weight], [w_ref], skew=True, sync=layer,
    )  # fmt: skip


@pytest.mark.mpi
@pytest.mark.parametrize("skew", [False, True])
def test_spectral_conv3d_matches_fft(grid3d: hpctp.ProcessGrid, skew: bool) -> None:
    layer = SpectralConv3d(2, 2, (2, 1, 3), grid=grid3d, seed=3, dtype=F64)
    w_ref = layer.weight.detach().clone().requires_grad_()
    compare_layer(
        grid3d, layer, lambda X: spectral_conv_fft(X, w_ref), (1, 2, 5, 4, 6), (None, None, 0, 1, 2),
        [layer.weight], [w_ref], skew=skew, sync=layer,
    )  # fmt: skip


@pytest.mark.mpi
def test_plain_blocks_and_float32(grid2d: hpctp.ProcessGrid) -> None:
    """A plain block gets a plain block back (layout inferred); float32 agrees to float32 rounding."""
    layer = SpectralConv2d(2, 2, (3, 3), grid=grid2d, seed=4, dtype=torch.float32)
    lay = make_layout(grid2d, (2, 2, 10, 7), (None, None, 0, 1), skew=True)
    X = global_field(lay.global_shape, 0).float()
    with torch.no_grad():
        y = layer(X[lay.local_slices(grid2d.coords)].contiguous())
        ref = spectral_conv_fft(X, layer.weight)
    assert_all(grid2d, type(y) is torch.Tensor and y.dtype == torch.float32, f"got {type(y).__name__}")
    assert_allclose(grid2d, y, ref[lay.local_slices(grid2d.coords)], rtol=1e-5, atol=1e-6, what="float32")


@pytest.mark.mpi
def test_sends_only_the_kept_spectrum(grid2d: hpctp.ProcessGrid) -> None:
    """CommCounter: forward is one reduce-scatter of the kept spectrum into each rank's run of modes and one
    all-gather of the mixed runs; backward the all-gather's adjoint and the all-gather of the weight gradient's runs
    (the input needs no gradient: no all-gather of its spectrum's), whatever the field size; sync_gradients has
    nothing left to send for the (complete) weight gradient."""
    layer = SpectralConv2d(3, 2, (2, 3), grid=grid2d, seed=0, dtype=F64)
    lay = make_layout(grid2d, (2, 3, 20, 16), (None, None, 0, 1), skew=False)
    x = hpctp.DistTensor(global_field(lay.global_shape, 0)[lay.local_slices(grid2d.coords)], grid2d, lay)
    with hpctp.CommCounter() as fwd:
        y = layer(x)
    with hpctp.CommCounter() as bwd:
        y.local.square().sum().backward()
        hpctp.nn.sync_gradients(layer, grid2d)
    q, modes, item = grid2d.size, (2 * 2) * 3, 16  # 2 m_1 x m_2 kept modes, complex128
    mine = modes // q + (grid2d.rank < modes % q)  # this rank's run of modes (mode_cuts)
    spectrum_in, spectrum_out, weight = 2 * 3, 2 * 2, 3 * 2  # batch x C_in, batch x C_out, C_in x C_out per mode
    got = (fwd.calls, fwd.bytes_sent, bwd.calls, bwd.bytes_sent)
    want: tuple[object, ...] = ({}, 0, {}, 0)
    if q > 1:
        want = (
            {"Ireduce_scatter": 1, "Iallgatherv": 1},
            ((modes - mine) * spectrum_in + mine * (q - 1) * spectrum_out) * item,
            {"Ireduce_scatter": 1, "Iallgatherv": 1},
            ((modes - mine) * spectrum_out + mine * (q - 1) * weight) * item,
        )
    assert_all(grid2d, got == want, f"(forward calls, bytes, backward+sync calls, bytes) = {got}, expected {want}")


@pytest.mark.mpi
def test_seeded_weights_are_grid_independent(grid2d: hpctp.ProcessGrid) -> None:
    """seed=s gives torch.manual_seed(s) + uniform_(0, 1/(C_in C_out)): the same on every grid."""
    layer = SpectralConv2d(3, 2, (2, 3), grid=grid2d, seed=11, dtype=F64)
    torch.manual_seed(11)
    want = torch.empty(3, 2, 4, 3, 2, dtype=F64).uniform_(0.0, 1.0 / 6)
    assert_equal(grid2d, layer.weight.detach(), want, "seeded weight")
    unseeded = SpectralConv2d(3, 2, (2, 3), grid=grid2d, dtype=F64)  # rank 0's values broadcast
    g = unseeded.weight.detach().clone()
    hpctp.comm.bcast(grid2d.comm, g, 0)
    assert_equal(grid2d, unseeded.weight.detach(), g, "unseeded weight is rank 0's")
    assert_all(grid2d, "modes=(2, 3)" in repr(layer), repr(layer))


@pytest.mark.mpi
def test_bad_inputs_raise_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    lay = make_layout(grid2d, (1, 2, 6, 5), (None, None, 0, 1), skew=False)
    x = hpctp.DistTensor(global_field(lay.global_shape, 0)[lay.local_slices(grid2d.coords)], grid2d, lay)
    with pytest.raises(ValueError, match="4 modes do not fit a dim of size 6"):
        SpectralConv2d(2, 2, (4, 2), grid=grid2d, seed=0, dtype=F64)(x)
    with pytest.raises(ValueError, match=r"5 modes do not fit a dim of size 5 \(m <= n // 2 \+ 1 = 3\)"):
        SpectralConv2d(2, 2, (1, 5), grid=grid2d, seed=0, dtype=F64)(x)
    with pytest.raises(ValueError, match="input has 2 channels, the weight expects 3"):
        SpectralConv2d(3, 2, 1, grid=grid2d, seed=0, dtype=F64)(x)
    with pytest.raises(ValueError, match="differs from the weight dtype"):
        SpectralConv2d(2, 2, 1, grid=grid2d, seed=0, dtype=torch.float32)(x)
    with pytest.raises(ValueError, match="must be even"):
        spectral_conv(x, _weight(2, 2, (3, 2), 0), grid=grid2d)
    with pytest.raises(ValueError, match="expected a batched 5-D block"):
        spectral_conv(x, _weight(2, 2, (2, 2, 2), 0), grid=grid2d)
    with pytest.raises(TypeError, match="float32 or float64"):
        spectral_conv(x, torch.zeros(2, 2, 2, 2, dtype=torch.complex128), grid=grid2d)
    with pytest.raises(ValueError, match=r"shape \[C_in, C_out, \*modes, 2\]"):
        spectral_conv(x, torch.zeros(2, 2, 2, 3, dtype=F64), grid=grid2d)
    with pytest.raises(ValueError, match="split=.* batch and channel dims cannot be split"):
        SpectralConv2d(2, 2, 1, grid=grid2d, split=(0, None, 1, None), seed=0)
    with pytest.raises(ValueError, match="modes=0 must be >= 1"):
        SpectralConv2d(2, 2, 0, grid=grid2d, seed=0)
    with pytest.raises(ValueError, match="in_channels must be an int >= 1"):
        SpectralConv2d(0, 2, 1, grid=grid2d, seed=0)
    with pytest.raises(TypeError, match="dtype must be torch.float32 or torch.float64"):
        SpectralConv2d(2, 2, 1, grid=grid2d, seed=0, dtype=torch.complex64)
    ok = math.isfinite(float(x.norm()))  # the grid is still usable: nothing was left half-sent
    assert_all(grid2d, ok, "grid usable after the errors")
