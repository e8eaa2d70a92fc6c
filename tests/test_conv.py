"""Partitioned Conv1d/2d/3d and ConvTranspose2d/3d vs single-process torch on the gathered field."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.layers import compare_layer, global_field
from helpers.layouts import make_layout

import hpctp
from hpctp.layout import Layout
from hpctp.nn import functional as HF
from hpctp.nn.conv import Conv1d, Conv2d, Conv3d, ConvTranspose2d, ConvTranspose3d
from hpctp.nn.pool import MaxPool2d
from hpctp.testing import assert_all, assert_allclose, assert_equal

pytestmark = pytest.mark.mpi
F64 = torch.float64

# (kernel, stride, dilation, padding, padding_mode, groups, bias, skew): a representative subset
CONV2D_CASES = [
    (1, 1, 1, 0, "zeros", 1, True, False),
    (3, 1, 1, 1, "zeros", 1, True, True),
    (3, 2, 1, 1, "circular", 1, True, False),
    (5, 1, 2, 3, "reflect", 1, False, True),
    (5, 2, 1, 2, "zeros", 2, True, True),
    (3, 2, 2, 0, "replicate", 1, True, False),
    ((3, 5), 1, 1, "same", "zeros", 1, True, True),
    (3, 2, 1, 9, "circular", 1, False, True),  # padding = size of dim 1: torch's largest wrap
    (3, 1, 1, 8, "reflect", 1, True, False),  # padding = size - 1 of dim 1: torch's largest reflection
]


def _pair(torch_cls: type, ours: type, grid: hpctp.ProcessGrid, *args: object, **kw: object) -> tuple:
    mine = ours(*args, grid=grid, seed=7, dtype=F64, **kw)
    torch.manual_seed(7)
    ref = torch_cls(*args, dtype=F64, **kw)
    return mine, ref


@pytest.mark.parametrize("case", CONV2D_CASES, ids=lambda c: "k{}s{}d{}p{}-{}-g{}".format(*c[:6]))
def test_conv2d_matches_torch(grid2d: hpctp.ProcessGrid, case: tuple) -> None:
    k, s, d, p, mode, groups, bias, skew = case
    mine, ref = _pair(torch.nn.Conv2d, Conv2d, grid2d, 4, 4, k, s, p, d, groups, bias, mode)
    assert_equal(grid2d, mine.weight.detach(), ref.weight.detach(), "seeded init equals torch's")
    params = [mine.weight] + ([mine.bias] if bias else [])
    rparams = [ref.weight] + ([ref.bias] if bias else [])
    compare_layer(grid2d, mine, ref, (2, 4, 11, 9), (None, None, 0, 1), params, rparams, skew)


@pytest.mark.parametrize("shape, skew", [((2, 4, 11, 9), False), ((2, 4, 11, 9), True), ((1, 4, 2, 5), False)])
def test_pointwise_conv(grid2d: hpctp.ProcessGrid, shape: tuple, skew: bool) -> None:
    """A 1x1 convolution equals torch on balanced, uneven and partly empty layouts; on a balanced layout
    whose blocks all hold cells it runs on the own block alone (no message, forward or backward)."""
    mine, ref = _pair(torch.nn.Conv2d, Conv2d, grid2d, 4, 3, 1)
    compare_layer(grid2d, mine, ref, shape, (None, None, 0, 1), [mine.weight, mine.bias], [ref.weight, ref.bias], skew)
    lay = make_layout(grid2d, shape, (None, None, 0, 1), skew=skew)
    x = global_field(shape, 2)[lay.local_slices(grid2d.coords)].clone().requires_grad_()
    with hpctp.CommCounter() as cnt:
        mine(hpctp.DistTensor(x, grid2d, lay)).local.sum().backward()
    holds_cells = all(min(np.diff(c)) > 0 for c in lay.dim_cuts[2:])
    if not skew and holds_cells:
        assert_all(grid2d, cnt.bytes_sent == 0 and not cnt.calls, f"pointwise conv sent {cnt.calls}")


def test_conv2d_no_overlap_and_plain_blocks(grid2d: hpctp.ProcessGrid) -> None:
    """overlap=False gives the same result; plain-tensor input infers the (uneven) layout."""
    mine, ref = _pair(torch.nn.Conv2d, Conv2d, grid2d, 2, 3, 3, 2, 1)
    lay = make_layout(grid2d, (1, 2, 10, 7), (None, None, 0, 1), skew=True)
    X = global_field(lay.global_shape, 3)
    x = X[lay.local_slices(grid2d.coords)].contiguous()
    y_plain = mine(x)
    mine.overlap = False
    y_dist = mine(hpctp.DistTensor(x, grid2d, lay))
    R = ref(X)
    assert_allclose(grid2d, y_plain.detach(), y_dist.local.detach(), rtol=1e-13, what="overlap vs not")
    assert_allclose(grid2d, y_plain.detach(), R.detach()[y_dist.layout.local_slices(grid2d.coords)], rtol=1e-10)


def test_conv1d_matches_torch(grid1d: hpctp.ProcessGrid) -> None:
    mine, ref = _pair(torch.nn.Conv1d, Conv1d, grid1d, 2, 3, 5, 2, 2, 1, 1, True, "circular")
    compare_layer(
        grid1d, mine, ref, (2, 2, 13), (None, None, 0), [mine.weight, mine.bias], [ref.weight, ref.bias], True
    )


@pytest.mark.parametrize("case", [(3, 1, 1, 1, "zeros"), (3, 2, 2, 2, "circular")], ids=["k3s1", "k3s2d2-circ"])
def test_conv3d_matches_torch(grid3d: hpctp.ProcessGrid, case: tuple) -> None:
    k, s, d, p, mode = case
    mine, ref = _pair(torch.nn.Conv3d, Conv3d, grid3d, 2, 3, k, s, p, d, 1, True, mode)
    compare_layer(
        grid3d,
        mine,
        ref,
        (1, 2, 5, 6, 7),
        (None, None, 0, 1, 2),
        [mine.weight, mine.bias],
        [ref.weight, ref.bias],
        skew=True,
    )


@pytest.mark.parametrize(
    "case",
    [(3, 1, 0, 0, 1), (3, 2, 1, 1, 1), (2, 3, 0, 1, 2), (1, 2, 0, 0, 1)],
    ids=lambda c: "k{}s{}p{}op{}d{}".format(*c),
)
def test_conv_transpose2d_matches_torch(grid2d: hpctp.ProcessGrid, case: tuple) -> None:
    k, s, p, op, d = case
    mine, ref = _pair(torch.nn.ConvTranspose2d, ConvTranspose2d, grid2d, 3, 2, k, s, p, op, 1, True, d)
    compare_layer(
        grid2d, mine, ref, (1, 3, 5, 4), (None, None, 0, 1), [mine.weight, mine.bias], [ref.weight, ref.bias], True
    )


def test_conv_transpose3d_matches_torch(grid3d: hpctp.ProcessGrid) -> None:
    mine, ref = _pair(torch.nn.ConvTranspose3d, ConvTranspose3d, grid3d, 2, 2, 3, 2, 1, 1)
    compare_layer(
        grid3d, mine, ref, (1, 2, 3, 4, 3), (None, None, 0, 1, 2), [mine.weight, mine.bias], [ref.weight, ref.bias]
    )


def test_conv_stack_trains_like_torch(grid2d: hpctp.ProcessGrid) -> None:
    """Conv -> ReLU -> strided conv -> transposed conv: outputs, and weight gradients after
    ``hpctp.nn.sync_gradients``."""
    a, ra = _pair(torch.nn.Conv2d, Conv2d, grid2d, 2, 3, 3, 1, 1)
    b, rb = _pair(torch.nn.Conv2d, Conv2d, grid2d, 3, 3, 3, 2, 1)
    c, rc = _pair(torch.nn.ConvTranspose2d, ConvTranspose2d, grid2d, 3, 2, 2, 2)

    def mine(t: hpctp.DistTensor) -> hpctp.DistTensor:
        h = a(t)
        return c(b(hpctp.DistTensor(torch.relu(h.local), h.grid, h.layout)))

    def ref(t: torch.Tensor) -> torch.Tensor:
        return rc(rb(torch.relu(ra(t))))

    ps = [m.weight for m in (a, b, c)] + [m.bias for m in (a, b, c)]
    rs = [m.weight for m in (ra, rb, rc)] + [m.bias for m in (ra, rb, rc)]
    compare_layer(
        grid2d, mine, ref, (1, 2, 9, 10), (None, None, 0, 1), ps, rs, skew=True, sync=torch.nn.ModuleList([a, b, c])
    )


def test_conv_sends_exactly_the_needed_input(grid2d: hpctp.ProcessGrid) -> None:
    """CommCounter: a DistTensor forward sends only the input cells other ranks' outputs need."""
    conv = Conv2d(2, 2, 3, stride=2, padding=1, grid=grid2d, seed=1, dtype=F64)
    lay = make_layout(grid2d, (1, 2, 11, 9), (None, None, 0, 1), skew=False)
    x = hpctp.DistTensor(global_field(lay.global_shape, 0)[lay.local_slices(grid2d.coords)], grid2d, lay)
    with hpctp.CommCounter() as cnt, torch.no_grad():
        y = conv(x)
    out = y.layout
    recv = 0
    me = lay.local_ranges(grid2d.coords)
    o = out.local_ranges(grid2d.coords)
    need = (
        [(o[d][0] * 2 - 1, (o[d][1] - 1) * 2 - 1 + 3) for d in (2, 3)]
        if math.prod(out.local_shape(grid2d.coords))
        else None
    )
    if need:
        cells = [max(0, min(hi, n) - max(lo, 0)) for (lo, hi), n in zip(need, lay.global_shape[2:])]
        own = [max(0, min(hi, b) - max(lo, a)) for (lo, hi), (a, b) in zip(need, me[2:])]
        recv = (math.prod(cells) - math.prod(own)) * 2 * 8
    ok = cnt.bytes_recv == recv and set(cnt.calls) <= {"Isend", "Irecv"}
    assert_all(grid2d, ok, f"received {cnt.bytes_recv} bytes via {cnt.calls}, expected {recv} via Isend/Irecv")
    total = np.array([cnt.bytes_sent, cnt.bytes_recv], dtype=np.int64)
    hpctp.comm.allreduce(grid2d.comm, total, "sum")
    assert_all(grid2d, total[0] == total[1], f"sent {total[0]} != received {total[1]} over the grid")


def test_bad_inputs_raise_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    conv = Conv2d(2, 2, 3, grid=grid2d, seed=0, dtype=F64)
    with pytest.raises(ValueError, match="expected a batched 4-D"):
        conv(torch.zeros(2, 5, 5, dtype=F64))
    with pytest.raises(ValueError, match="channels"):
        conv(torch.zeros(1, 3, 5, 5, dtype=F64))
    with pytest.raises(ValueError, match="kernel extent"):  # global field smaller than the kernel
        conv(torch.zeros(1, 2, 1, 1, dtype=F64))
    with pytest.raises(ValueError, match="batch and channel"):
        Conv2d(2, 2, 3, grid=grid2d, split=(0, None, None, 1))
    with pytest.raises(ValueError, match="one entry per spatial dim"):
        Conv2d(2, 2, 3, grid=grid2d, split=(0,))
    if grid2d.size > 1:
        with pytest.raises(ValueError, match="differs between ranks"):  # batch sizes disagree
            conv(torch.zeros(1 + grid2d.rank, 2, 4, 4, dtype=F64))
    with pytest.raises(ValueError, match="output_size"):
        ConvTranspose2d(2, 2, 3, grid=grid2d, seed=0)(torch.zeros(1, 2, 4, 4), output_size=(9, 9))
    # what torch would reject inside the op, after the halo messages were posted: refused before
    x = torch.zeros(1, 2, 6, 6, dtype=F64)
    for kwargs, match in [
        (dict(weight=torch.zeros(3, 1, 3, 3, dtype=F64), groups=2), "out_channels=3.*not divisible by groups=2"),
        (dict(weight=torch.zeros(2, 2, 3, 3, dtype=F64), groups=0), "groups must be an int >= 1"),
        (
            dict(weight=torch.zeros(2, 2, 3, 3, dtype=F64), bias=torch.zeros(3, dtype=F64)),
            r"bias must have shape \(2,\)",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            HF.conv2d(x, grid=grid2d, split=(0, 1), **kwargs)
    n0 = 2 * grid2d.dims[0]  # global size of spatial dim 0 for 2x2 blocks
    for mode, pad in [("reflect", n0), ("circular", n0 + 1)]:  # torch's F.pad limits, per side
        with pytest.raises(ValueError, match=f"padding_mode='{mode}': padding \\({pad}, {pad}\\) of spatial dim 0"):
            Conv2d(2, 2, 1, padding=(pad, 1), padding_mode=mode, grid=grid2d, seed=0, dtype=F64)(x[..., :2, :2])
    with pytest.raises(ValueError, match="in_channels=2.*not divisible by groups=4"):
        HF.conv_transpose2d(x, torch.zeros(2, 1, 3, 3, dtype=F64), groups=4, grid=grid2d, split=(0, 1))
    if grid2d.size > 1:  # a plain block unlike `layout` on the last rank only: every rank raises
        lay = Layout((1, 2, 2 * grid2d.dims[0], 2 * grid2d.dims[1]), grid2d.dims, (None, None, 0, 1))
        blk = torch.zeros(1, 2, 2, 3 if grid2d.rank == grid2d.size - 1 else 2, dtype=F64)
        for fn in (HF.max_pool2d, HF.avg_pool2d):
            with pytest.raises(ValueError, match="block has shape"):
                fn(blk, 2, grid=grid2d, split=(0, 1), layout=lay)
        with pytest.raises(ValueError, match="block has shape"):
            HF.conv2d(blk, torch.zeros(2, 2, 3, 3, dtype=F64), grid=grid2d, split=(0, 1), layout=lay)
    if grid2d.size > 1:  # a block of another ndim on one rank: every rank raises, none waits
        with pytest.raises(ValueError, match="dims"):
            conv(torch.zeros(2, 5, 5, dtype=F64) if grid2d.rank == 0 else torch.zeros(1, 2, 5, 5, dtype=F64))
        with pytest.raises(ValueError, match="dims"):
            HF.halo_pad(torch.zeros(4, 4) if grid2d.rank == 0 else torch.zeros(1, 4, 4), grid2d, (0, 1), 1)


def test_error_in_overlapped_compute_completes_the_halo(
    grid2d: hpctp.ProcessGrid, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch failing while the halo is in flight: every rank raises, the posted messages are
    completed (no request outlives its buffer), and the next call is exact."""
    conv = Conv2d(2, 3, 3, padding=1, grid=grid2d, seed=0, dtype=F64)
    X = global_field((1, 2, 7, 6), 3)
    lay = make_layout(grid2d, X.shape, (None, None, 0, 1), skew=True)
    real = torch.nn.functional.conv2d

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("CUDA out of memory (injected)")

    monkeypatch.setattr(torch.nn.functional, "conv2d", failing)
    with pytest.raises(RuntimeError, match="injected"):
        conv(X[lay.local_slices(grid2d.coords)])
    monkeypatch.setattr(torch.nn.functional, "conv2d", real)
    y = conv(X[lay.local_slices(grid2d.coords)])
    R = real(X, conv.weight.detach(), conv.bias.detach(), 1, 1)  # conv weights are whole on every rank
    out = hpctp.layout.Layout(R.shape, grid2d.dims, (None, None, 0, 1))
    assert_allclose(grid2d, y.detach(), R[out.local_slices(grid2d.coords)], rtol=1e-12)


def test_default_init_is_identical_everywhere(grid2d: hpctp.ProcessGrid) -> None:
    torch.manual_seed(100 + grid2d.rank)  # different RNG per rank: the broadcast makes them equal
    conv = Conv2d(2, 3, 3, grid=grid2d)
    w = conv.weight.detach().clone()
    hpctp.comm.bcast(grid2d.comm, w, 0)
    assert_equal(grid2d, conv.weight.detach(), w, "weights equal rank 0's")


def test_functional_conv_plain_blocks(grid1d: hpctp.ProcessGrid) -> None:
    """Functional API on plain blocks with a 1-D grid splitting H only (W whole)."""
    X = global_field((1, 2, 9, 6), 4)
    lay = make_layout(grid1d, X.shape, (None, None, 0, None), skew=True)
    w = global_field((3, 2, 3, 3), 5)
    y = HF.conv2d(X[lay.local_slices(grid1d.coords)], w, None, 1, 1, grid=grid1d, split=(0, None))
    R = torch.nn.functional.conv2d(X, w, None, 1, 1)
    out = hpctp.layout.Layout(R.shape, grid1d.dims, (None, None, 0, None))
    assert_allclose(grid1d, y, R[out.local_slices(grid1d.coords)], rtol=1e-10)


def test_empty_blocks(grid2d: hpctp.ProcessGrid) -> None:
    """H smaller than the grid: some ranks hold empty input and/or output blocks."""
    for stride in (1, 2):
        mine, ref = _pair(torch.nn.Conv2d, Conv2d, grid2d, 2, 2, 3, stride, 1)
        compare_layer(
            grid2d, mine, ref, (1, 2, 2, 5), (None, None, 0, 1), [mine.weight, mine.bias], [ref.weight, ref.bias]
        )
    compare_layer(
        grid2d, MaxPool2d(2, 1, 1, grid=grid2d), torch.nn.MaxPool2d(2, 1, 1), (1, 1, 1, 3), (None, None, 0, 1)
    )
