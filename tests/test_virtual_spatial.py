"""Spatial and spectral layers on a virtual grid send what they send on the real one (issue 54).

Each test runs one training step of one layer kind (forward, a local loss, backward, and
``hpctp.nn.sync_gradients`` where the layer has parameters) on the real grid (float64 on the CPU) and on
its virtual twin playing this rank (``meta`` tensors): every communicator's calls, bytes and messages must
be equal (:func:`helpers.virtual.same_messages`). Where the grid splits the field some rank must send.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from helpers.virtual import Step, same_messages

import hpctp
from hpctp.layout import Layout
from hpctp.nn.spatial import (
    AvgPool2d,
    AvgPool3d,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    GroupNorm,
    MaxPool2d,
    MaxPool3d,
    Redistribute,
    Upsample,
    halo_pad,
)
from hpctp.nn.spectral import SpectralConv1d, SpectralConv2d, SpectralConv3d
from hpctp.testing import assert_all

pytestmark = pytest.mark.mpi

Make = Callable[[hpctp.ProcessGrid, torch.device, torch.dtype], torch.nn.Module]
SHAPE1 = (2, 2, 12)
SPLIT1 = (None, None, 0)
SHAPE2 = (2, 3, 12, 10)  # (10 over 4 ranks: uneven blocks)
SPLIT2 = (None, None, 0, 1)
SHAPE3 = (1, 2, 8, 8, 6)
SPLIT3 = (None, None, 0, 1, 2)


class _Fn(torch.nn.Module):
    """Local. A function of the input as a module without parameters."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Any) -> Any:
        """Local, or as ``fn``. ``fn(x)``."""
        return self.fn(x)


def _field(
    grid: hpctp.ProcessGrid,
    device: torch.device,
    dtype: torch.dtype,
    shape: Sequence[int],
    split: Sequence[int | None],
    plain: bool = False,
) -> Any:
    """Local. This rank's balanced block of a field of ``shape`` (random on the CPU, empty on meta) needing a
    gradient, so that backward runs the input-gradient paths too: a DistTensor, or the plain block."""
    lay = Layout(tuple(shape), grid.dims, tuple(split))
    local = lay.local_shape(grid.coords)
    x = torch.randn(local, dtype=dtype) if device.type != "meta" else torch.empty(local, dtype=dtype, device=device)
    x.requires_grad_()
    return x if plain else hpctp.DistTensor(x, grid, lay)


def _loss(y: Any) -> torch.Tensor:
    """Local. The sum of this rank's output block (of its real and imaginary parts if complex)."""
    t = y.local if isinstance(y, hpctp.DistTensor) else y
    return t.real.sum() + t.imag.sum() if t.is_complex() else t.sum()


def _step(make: Make, shape: Sequence[int], split: Sequence[int | None], plain: bool = False) -> Step:
    """Local. One step of ``make``'s layer on a field of ``shape`` cut as ``split``: forward, the sum of the
    local output, backward and (with parameters) ``sync_gradients``."""

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
        layer = make(grid, device, dtype)
        x = _field(grid, device, dtype, shape, split, plain)

        def run() -> None:
            _loss(layer(x)).backward()
            if any(True for _ in layer.parameters()):
                hpctp.nn.sync_gradients(layer, grid)

        return run

    return step


def _check(
    grid: hpctp.ProcessGrid,
    make: Make,
    shape: Sequence[int],
    split: Sequence[int | None],
    what: str,
    plain: bool = False,
    sends: bool | None = True,
) -> dict:
    """Collective over grid. Real and virtual steps send the same; on more than one rank some rank sends a byte
    (``sends`` True), or no rank sends any (``sends`` False; None: either). Returns the step's counts on this
    rank."""
    got = same_messages(grid, _step(make, shape, split, plain), what)
    sent = grid.comm.allreduce(sum(v[0] for v in got.values()))  # (bytes sent by all ranks)
    ok = sends is None or ((sent > 0 or grid.size == 1) if sends else sent == 0)
    assert_all(grid, ok, f"{what} on {grid.dims}: {sent} bytes sent by all ranks ({got} on this one)")
    return got


def _kw(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Local. A layer's grid, device and dtype keywords."""
    return {"grid": grid, "device": device, "dtype": dtype}


# ----------------------------------------------------------------- convolutions
# (kernel, stride, padding, padding_mode)
CONV2D = [(3, 1, 1, "zeros"), (3, 2, 1, "circular"), (5, 1, 2, "reflect")]


@pytest.mark.parametrize("case", CONV2D, ids=lambda c: "k{}s{}p{}-{}".format(*c))
def test_conv2d(grid2d: hpctp.ProcessGrid, case: tuple) -> None:
    k, s, p, mode = case
    make = lambda g, d, t: Conv2d(3, 4, k, s, p, padding_mode=mode, seed=1, **_kw(g, d, t))  # noqa: E731
    _check(grid2d, make, SHAPE2, SPLIT2, f"Conv2d {case}")


def test_conv2d_plain_block(grid2d: hpctp.ProcessGrid) -> None:
    """A plain block: the layout is inferred with one small collective (blocks of one size: on a virtual grid every
    rank's sizes are the played rank's)."""
    make = lambda g, d, t: Conv2d(3, 2, 3, 1, 1, seed=1, **_kw(g, d, t))  # noqa: E731
    got = _check(grid2d, make, (1, 3, 12, 12), SPLIT2, "Conv2d plain block", plain=True)
    calls = {k: v for s in got.values() for k, v in s[3]}
    ok = grid2d.size == 1 or calls.get("Allgather", 0) >= 1
    assert_all(grid2d, ok, f"no layout inference on a plain block: {calls}")


def test_conv1d(grid1d: hpctp.ProcessGrid) -> None:
    _check(grid1d, lambda g, d, t: Conv1d(2, 3, 5, 2, 2, padding_mode="circular", seed=1, **_kw(g, d, t)),
           SHAPE1, SPLIT1, "Conv1d")  # fmt: skip


def test_conv3d(grid3d: hpctp.ProcessGrid) -> None:
    _check(grid3d, lambda g, d, t: Conv3d(2, 3, 3, 1, 1, seed=1, **_kw(g, d, t)), SHAPE3, SPLIT3, "Conv3d")


# (kernel, stride, padding, output_padding)
CONVT2D = [(4, 2, 1, 0), (3, 1, 1, 0)]


@pytest.mark.parametrize("case", CONVT2D, ids=lambda c: "k{}s{}p{}op{}".format(*c))
def test_conv_transpose2d(grid2d: hpctp.ProcessGrid, case: tuple) -> None:
    k, s, p, op = case
    make = lambda g, d, t: ConvTranspose2d(3, 2, k, s, p, op, seed=1, **_kw(g, d, t))  # noqa: E731
    _check(grid2d, make, (1, 3, 8, 9), SPLIT2, f"ConvTranspose2d {case}")


def test_conv_transpose1d(grid1d: hpctp.ProcessGrid) -> None:
    make = lambda g, d, t: ConvTranspose1d(2, 2, 3, 2, 1, 1, seed=1, **_kw(g, d, t))  # noqa: E731
    _check(grid1d, make, SHAPE1, SPLIT1, "ConvTranspose1d")


def test_conv_transpose3d(grid3d: hpctp.ProcessGrid) -> None:
    make = lambda g, d, t: ConvTranspose3d(2, 2, 3, 2, 1, 1, seed=1, **_kw(g, d, t))  # noqa: E731
    _check(grid3d, make, (1, 2, 4, 4, 4), SPLIT3, "ConvTranspose3d")


# ----------------------------------------------------------------- pooling, upsampling, halos
def test_max_pool2d(grid2d: hpctp.ProcessGrid) -> None:
    _check(grid2d, lambda g, d, t: MaxPool2d(3, 2, 1, grid=g), SHAPE2, SPLIT2, "MaxPool2d")


def test_avg_pool2d(grid2d: hpctp.ProcessGrid) -> None:
    _check(grid2d, lambda g, d, t: AvgPool2d(3, 2, 1, count_include_pad=False, grid=g), SHAPE2, SPLIT2, "AvgPool2d")


def test_pool3d(grid3d: hpctp.ProcessGrid) -> None:
    _check(grid3d, lambda g, d, t: MaxPool3d(3, 2, 1, grid=g), SHAPE3, SPLIT3, "MaxPool3d")
    _check(grid3d, lambda g, d, t: AvgPool3d(3, 2, 1, ceil_mode=True, grid=g), SHAPE3, SPLIT3, "AvgPool3d")


def test_upsample_nearest_sends_nothing(grid2d: hpctp.ProcessGrid) -> None:
    """Nearest upsampling is local: no message on either grid."""
    got = _check(grid2d, lambda g, d, t: Upsample(2, "nearest", grid=g), SHAPE2, SPLIT2, "nearest", sends=False)
    assert_all(grid2d, got == {}, f"nearest upsampling made {got}")


def test_upsample_nearest_balanced(grid2d: hpctp.ProcessGrid) -> None:
    """With ``balanced`` the output moves to the balanced layout of the output shape."""
    make = lambda g, d, t: Upsample(2, "nearest", grid=g, balanced=True)  # noqa: E731
    _check(grid2d, make, (1, 2, 7, 5), SPLIT2, "nearest balanced")  # (over 2 or 4 ranks: not the upsampled blocks)


@pytest.mark.parametrize("align_corners", [False, True])
def test_upsample_bilinear(grid2d: hpctp.ProcessGrid, align_corners: bool) -> None:
    make = lambda g, d, t: Upsample((2, 3), "bilinear", align_corners, grid=g)  # noqa: E731
    _check(grid2d, make, (1, 2, 7, 6), SPLIT2, f"bilinear align_corners={align_corners}")


def test_halo_pad(grid2d: hpctp.ProcessGrid) -> None:
    """The functional halo exchange (a plain block, its layout given) and its adjoint."""

    def make(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        lay = Layout(SHAPE2, grid.dims, SPLIT2)
        return _Fn(lambda x: halo_pad(x, grid, SPLIT2, 2, ("zero", "zero", "periodic", "reflect"), layout=lay))

    _check(grid2d, make, SHAPE2, SPLIT2, "halo_pad", plain=True)


@pytest.mark.parametrize("stencil", ["box", "star"])
def test_halo_exchange(grid2d: hpctp.ProcessGrid, stencil: str) -> None:
    """:class:`hpctp.halo.HaloExchange` and its adjoint, 4 rows deep (beyond the next block on 4 ranks)."""

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
        x = _field(grid, device, dtype, SHAPE2, SPLIT2)
        h = hpctp.halo.HaloExchange(x, (0, 0, 4, (1, 2)), ("zero", "zero", "periodic", "replicate"), stencil=stencil)
        return lambda: h.adjoint(h.exchange(x.local.detach()))

    got = same_messages(grid2d, step, f"HaloExchange {stencil}")
    sent = grid2d.comm.allreduce(sum(v[0] for v in got.values()))
    assert_all(grid2d, grid2d.size == 1 or sent > 0, f"HaloExchange on {grid2d.dims}: {sent} bytes sent")


# ----------------------------------------------------------------- normalisation
BN_CASES = [{}, {"momentum": None}, {"track_running_stats": False, "affine": False}]


@pytest.mark.parametrize("kw", BN_CASES, ids=["default", "cumulative", "batch-stats-no-affine"])
def test_batch_norm2d(grid2d: hpctp.ProcessGrid, kw: dict) -> None:
    _check(grid2d, lambda g, d, t: BatchNorm2d(3, **kw, **_kw(g, d, t)), SHAPE2, SPLIT2, f"BatchNorm2d {kw}")


def test_batch_norm2d_eval_is_local(grid2d: hpctp.ProcessGrid) -> None:
    """In eval mode with running statistics a batch norm is local; its parameters' sync still sends."""
    got = _check(grid2d, lambda g, d, t: BatchNorm2d(3, **_kw(g, d, t)).eval(), SHAPE2, SPLIT2, "BatchNorm2d eval")
    calls = {k: v for s in got.values() for k, v in s[3]}
    assert_all(grid2d, grid2d.size == 1 or calls == {"Allreduce": 1}, f"eval BatchNorm2d step made {calls}")


def test_batch_norm1d(grid1d: hpctp.ProcessGrid) -> None:
    _check(grid1d, lambda g, d, t: BatchNorm1d(2, **_kw(g, d, t)), SHAPE1, SPLIT1, "BatchNorm1d")


def test_batch_norm3d(grid3d: hpctp.ProcessGrid) -> None:
    _check(grid3d, lambda g, d, t: BatchNorm3d(2, **_kw(g, d, t)), SHAPE3, SPLIT3, "BatchNorm3d")


def test_group_norm(grid2d: hpctp.ProcessGrid) -> None:
    _check(grid2d, lambda g, d, t: GroupNorm(2, 4, **_kw(g, d, t)), (2, 4, 12, 10), SPLIT2, "GroupNorm")


# ----------------------------------------------------------------- Fourier layers
@pytest.mark.parametrize("case", [((2, 3, 12, 10), (3, 4)), ((1, 2, 8, 9), (4, 5))], ids=["m34", "m45"])
def test_spectral_conv2d(grid2d: hpctp.ProcessGrid, case: tuple) -> None:
    shape, modes = case
    make = lambda g, d, t: SpectralConv2d(shape[1], 3, modes, seed=1, **_kw(g, d, t))  # noqa: E731
    _check(grid2d, make, shape, SPLIT2, f"SpectralConv2d {modes}")


@pytest.mark.parametrize("split", [(None, None, 0, None), (None, None, None, 0)], ids=["rows", "cols"])
def test_spectral_conv2d_on_a_1d_grid(grid1d: hpctp.ProcessGrid, split: tuple) -> None:
    make = lambda g, d, t: SpectralConv2d(2, 2, (3, 3), split=split[2:], seed=1, **_kw(g, d, t))  # noqa: E731
    _check(grid1d, make, (2, 2, 10, 9), split, "SpectralConv2d on a 1-D grid")


def test_spectral_conv1d(grid1d: hpctp.ProcessGrid) -> None:
    _check(grid1d, lambda g, d, t: SpectralConv1d(2, 3, 4, seed=1, **_kw(g, d, t)), SHAPE1, SPLIT1, "SpectralConv1d")


def test_spectral_conv3d(grid3d: hpctp.ProcessGrid) -> None:
    make = lambda g, d, t: SpectralConv3d(2, 2, (2, 2, 3), seed=1, **_kw(g, d, t))  # noqa: E731
    _check(grid3d, make, SHAPE3, SPLIT3, "SpectralConv3d")


def test_distributed_fft(grid2d: hpctp.ProcessGrid) -> None:
    """``rfftn`` then ``irfftn`` of a field (pencil moves, forward and backward), and its radial spectrum."""
    make = lambda g, d, t: _Fn(lambda x: hpctp.fft.irfftn(hpctp.fft.rfftn(x, (2, 3)), 10, (2, 3)))  # noqa: E731
    _check(grid2d, make, SHAPE2, SPLIT2, "rfftn -> irfftn")

    def spectrum(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
        x = _field(grid, device, dtype, SHAPE2, SPLIT2)
        return lambda: hpctp.fft.radial_spectrum(hpctp.DistTensor(x.local.detach(), grid, x.layout), (2, 3))

    got = same_messages(grid2d, spectrum, "radial_spectrum")
    calls = {k: v for s in got.values() for k, v in s[3]}
    assert_all(grid2d, grid2d.size == 1 or calls.get("Allreduce") == 1, f"radial_spectrum made {calls}")


# ----------------------------------------------------------------- redistribution
@pytest.mark.parametrize("to", [(None, None, 1, 0), (None, None, 0, None)], ids=["swap", "rows"])
def test_redistribute(grid2d: hpctp.ProcessGrid, to: tuple) -> None:
    _check(grid2d, lambda g, d, t: Redistribute(to), SHAPE2, SPLIT2, f"Redistribute to {to}")


def test_redistribute_onto_another_grid(grid2d: hpctp.ProcessGrid) -> None:
    """Onto a 1-D grid of the same ranks (rows split over all of them): the blocks move where the columns were
    split."""
    made: list[hpctp.ProcessGrid] = []

    def make(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        made.append(hpctp.ProcessGrid((grid.size,), comm=grid.comm))
        return Redistribute((None, None, 0, None), grid=made[-1])

    _check(grid2d, make, SHAPE2, SPLIT2, "Redistribute onto a 1-D grid", sends=True if grid2d.dims[1] > 1 else None)
    for g in made:
        g.free()


# ----------------------------------------------------------------- empty blocks
EMPTY: dict[str, Make] = {
    "Conv2d": lambda g, d, t: Conv2d(2, 2, 3, 1, 1, seed=1, **_kw(g, d, t)),
    "BatchNorm2d": lambda g, d, t: BatchNorm2d(2, **_kw(g, d, t)),
    "GroupNorm": lambda g, d, t: GroupNorm(1, 2, **_kw(g, d, t)),
    "SpectralConv2d": lambda g, d, t: SpectralConv2d(2, 2, (1, 2), seed=1, **_kw(g, d, t)),
}


@pytest.mark.parametrize("kind", EMPTY)
def test_empty_blocks(grid2d: hpctp.ProcessGrid, kind: str) -> None:
    """A field of 3 x 2 cells: on 4 ranks some blocks are empty, and the virtual run playing such a rank sends
    what it sends for real (the norms' global count comes from the layout, not from the gathered counts)."""
    _check(grid2d, EMPTY[kind], (2, 2, 3, 2), SPLIT2, f"{kind} on empty blocks")


# ----------------------------------------------------------------- a stack
def test_conv_norm_transpose_stack(grid2d: hpctp.ProcessGrid) -> None:
    """Conv2d -> BatchNorm2d -> ConvTranspose2d, one step, one sync of the three layers' gradients."""

    def make(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        kw = _kw(grid, device, dtype)
        return torch.nn.Sequential(
            Conv2d(3, 4, 3, 2, 1, seed=1, **kw), BatchNorm2d(4, **kw), ConvTranspose2d(4, 2, 4, 2, 1, seed=2, **kw)
        )

    _check(grid2d, make, SHAPE2, SPLIT2, "Conv2d -> BatchNorm2d -> ConvTranspose2d")


def test_virtual_run_differs_where_messages_differ(grid2d: hpctp.ProcessGrid) -> None:
    """The comparison can fail: a step that sends more on the virtual grid than on the real one is caught (on
    one rank nothing is sent either way)."""
    if grid2d.size == 1:
        return

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
        extra = 2 if device.type == "meta" else 1
        buf = np.zeros(extra)
        return lambda: hpctp.comm.allreduce(grid.comm, buf, "sum")

    with pytest.raises(hpctp.testing.CollectiveAssertionError, match="real != virtual"):
        same_messages(grid2d, step, "unequal")
