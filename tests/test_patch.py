"""PatchEmbed2d/3d vs torch.nn.Conv2d/3d(kernel=p, stride=p) and Unpatch2d/3d vs Linear + pixel shuffle,
on the gathered field; layouts (cuts divided / multiplied by p), round trips, no communication."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers.layers import global_field
from helpers.layouts import skewed_cuts

import hpctp
from hpctp.layout import Layout
from hpctp.nn.patch import (
    PatchEmbed2d,
    PatchEmbed3d,
    Unpatch2d,
    Unpatch3d,
    patch_aligned_layout,
    patched_layout,
    unpatched_layout,
)
from hpctp.testing import assert_all, assert_allclose, assert_equal

pytestmark = pytest.mark.mpi
F64 = torch.float64
RTOL = 1e-10


def aligned_layout(grid: hpctp.ProcessGrid, shape: tuple[int, ...], patch: tuple[int, ...], skew: bool) -> Layout:
    """Local. A field layout, spatial dim ``d`` over grid axis ``d``, cut on patch boundaries: balanced in
    patches, or skewed (a one-patch first block) when ``skew``; trailing cells go to the last block."""
    cuts: list[tuple[int, ...] | None] = [None, None]
    for d, p in enumerate(patch):
        n, parts = shape[d + 2], grid.dims[d]
        c = [b * p for b in (skewed_cuts(n // p, parts) if skew else hpctp.layout.block_cuts(n // p, parts))]
        c[-1] = n
        cuts.append(tuple(c))
    return Layout(shape, grid.dims, (None, None, *range(len(patch))), tuple(cuts))


def check_layer(
    grid: hpctp.ProcessGrid,
    layer: torch.nn.Module,
    ref: Callable[[torch.Tensor], torch.Tensor],
    layout: Layout,
    out_layout: Layout,
    params: list[torch.Tensor],
    ref_params: list[torch.Tensor],
) -> hpctp.DistTensor:
    """Collective over grid. Output block, output layout, input gradient and summed parameter gradients
    of ``layer`` on a DistTensor of ``layout`` vs ``ref`` on the whole field (float64)."""
    X = global_field(layout.global_shape, 1)
    x = X[layout.local_slices(grid.coords)].clone().requires_grad_()
    y = layer(hpctp.DistTensor(x, grid, layout))
    assert_all(grid, y.layout == out_layout, f"output layout {y.layout} (cuts {y.layout.dim_cuts}), want {out_layout}")
    Xr = X.clone().requires_grad_()
    R = ref(Xr)
    assert_equal(grid, tuple(y.global_shape), tuple(R.shape), "global output shape")
    sl = out_layout.local_slices(grid.coords)
    assert_allclose(grid, y.local.detach(), R.detach()[sl], rtol=RTOL, atol=1e-12, what="forward")
    GY = global_field(R.shape, 2)
    (y.local * GY[sl]).sum().backward()
    (R * GY).sum().backward()
    assert_allclose(grid, x.grad, Xr.grad[layout.local_slices(grid.coords)], rtol=RTOL, atol=1e-12, what="input grad")
    hpctp.nn.sync_gradients(layer, grid)
    for p, q in zip(params, ref_params):
        assert_allclose(grid, p.grad, q.grad, rtol=RTOL, atol=1e-11, what="parameter grad (summed over the grid)")
    return y


def pixel_shuffle_nd(v: torch.Tensor, channels: int, patch: tuple[int, ...]) -> torch.Tensor:
    """Local. ``[N, C * prod(p), *tokens]`` -> ``[N, C, *(tokens * p)]`` by strided writes (channel ``c *
    prod(p) + offset``, the offset row-major in the patch), independent of the layer's reshapes."""
    n, tokens = v.shape[0], v.shape[2:]
    out = v.new_zeros(n, channels, *(t * p for t, p in zip(tokens, patch)))
    offsets = list(torch.cartesian_prod(*[torch.arange(p) for p in patch]).reshape(-1, len(patch)).tolist())
    for o, off in enumerate(offsets):
        sl = tuple(slice(i, None, p) for i, p in zip(off, patch))
        out[(slice(None), slice(None), *sl)] = v[:, o :: len(offsets)]
    return out


def _embed_pair(cls: type, torch_cls: type, grid: hpctp.ProcessGrid, c: int, e: int, patch: tuple[int, ...]) -> tuple:
    mine = cls(c, e, patch, grid, seed=3, dtype=F64)
    torch.manual_seed(3)
    ref = torch_cls(c, e, patch, stride=patch, dtype=F64)
    assert_equal(grid, mine.weight.detach(), ref.weight.detach(), "seeded weight equals torch's conv")
    assert_equal(grid, mine.bias.detach(), ref.bias.detach(), "seeded bias equals torch's conv")
    return mine, ref


def _unpatch_pair(cls: type, grid: hpctp.ProcessGrid, e: int, c: int, patch: tuple[int, ...]) -> tuple:
    mine = cls(e, c, patch, grid, seed=4, dtype=F64)
    torch.manual_seed(4)
    ref = torch.nn.Linear(e, c * int(torch.tensor(patch).prod()), dtype=F64)
    assert_equal(grid, mine.weight.detach(), ref.weight.detach(), "seeded weight equals torch's linear")
    return mine, ref


@pytest.mark.parametrize(
    "shape, patch, skew",
    [((2, 3, 8, 12), (2, 2), True), ((1, 2, 9, 8), (2, 4), False), ((1, 2, 13, 7), (3, 1), True)],
    ids=["p2-skew", "p2x4-trailing-row", "p3x1-trailing"],
)
def test_patch_embed2d_matches_conv(grid2d: hpctp.ProcessGrid, shape: tuple, patch: tuple, skew: bool) -> None:
    mine, ref = _embed_pair(PatchEmbed2d, torch.nn.Conv2d, grid2d, shape[1], 5, patch)
    lay = aligned_layout(grid2d, shape, patch, skew)
    out = patched_layout(lay, patch, 5)
    check_layer(grid2d, mine, ref, lay, out, [mine.weight, mine.bias], [ref.weight, ref.bias])


def test_patch_embed3d_matches_conv(grid3d: hpctp.ProcessGrid) -> None:
    shape, patch = (1, 2, 4, 7, 6), (2, 3, 2)
    mine, ref = _embed_pair(PatchEmbed3d, torch.nn.Conv3d, grid3d, 2, 3, patch)
    lay = aligned_layout(grid3d, shape, patch, skew=True)
    check_layer(grid3d, mine, ref, lay, patched_layout(lay, patch, 3), [mine.weight, mine.bias], [ref.weight, ref.bias])


@pytest.mark.parametrize("patch, skew", [((2, 2), True), ((3, 1), False)], ids=["p2-skew", "p3x1"])
def test_unpatch2d_matches_linear_pixel_shuffle(grid2d: hpctp.ProcessGrid, patch: tuple, skew: bool) -> None:
    e, c = 6, 2
    mine, ref = _unpatch_pair(Unpatch2d, grid2d, e, c, patch)
    tokens = (1, e, 5, 4)
    cuts = [None, None] + [skewed_cuts(n, grid2d.dims[d]) if skew else None for d, n in enumerate(tokens[2:])]
    lay = Layout(tokens, grid2d.dims, (None, None, 0, 1), tuple(cuts))

    def torch_unpatch(T: torch.Tensor) -> torch.Tensor:
        v = ref(T.movedim(1, -1)).movedim(-1, 1)
        if patch[0] == patch[1]:  # torch's own pixel shuffle where it applies
            return F.pixel_shuffle(v, patch[0])
        return pixel_shuffle_nd(v, c, patch)

    out = unpatched_layout(lay, patch, c)
    check_layer(grid2d, mine, torch_unpatch, lay, out, [mine.weight, mine.bias], [ref.weight, ref.bias])


def test_unpatch3d_matches_linear_shuffle(grid3d: hpctp.ProcessGrid) -> None:
    e, c, patch = 4, 2, (2, 1, 3)
    mine, ref = _unpatch_pair(Unpatch3d, grid3d, e, c, patch)
    tokens = (1, e, 3, 4, 2)
    cuts = [None, None] + [skewed_cuts(n, grid3d.dims[d]) for d, n in enumerate(tokens[2:])]
    lay = Layout(tokens, grid3d.dims, (None, None, 0, 1, 2), tuple(cuts))

    def torch_unpatch(T: torch.Tensor) -> torch.Tensor:
        return pixel_shuffle_nd(ref(T.movedim(1, -1)).movedim(-1, 1), c, patch)

    out = unpatched_layout(lay, patch, c)
    check_layer(grid3d, mine, torch_unpatch, lay, out, [mine.weight, mine.bias], [ref.weight, ref.bias])


def test_round_trip_keeps_layout_without_messages(grid2d: hpctp.ProcessGrid) -> None:
    """PatchEmbed -> Unpatch: the field's layout back, no message forward or backward (DistTensors);
    plain blocks with ``layout=`` give the same blocks."""
    patch, c, e = (2, 3), 3, 4
    embed = PatchEmbed2d(c, e, patch, grid2d, seed=1, dtype=F64)
    unpatch = Unpatch2d(e, c, patch, grid2d, seed=2, dtype=F64)
    lay = aligned_layout(grid2d, (2, c, 10, 12), patch, skew=True)
    x = global_field(lay.global_shape, 7)[lay.local_slices(grid2d.coords)].clone().requires_grad_()
    with hpctp.CommCounter() as cnt:
        t = embed(hpctp.DistTensor(x, grid2d, lay))
        y = unpatch(t)
        (y.local**2).sum().backward()
    assert_equal(grid2d, dict(cnt.calls), {}, "patching and unpatching exchange nothing")
    assert_all(grid2d, y.layout == lay, f"round trip layout {y.layout} cuts {y.layout.dim_cuts} != {lay.dim_cuts}")
    assert_all(grid2d, t.layout == embed.output_layout(lay), "token layout is output_layout(layout)")
    tp = embed(x.detach(), layout=lay)
    yp = unpatch(tp, layout=t.layout)
    assert_equal(grid2d, tp, t.local.detach(), "plain block with layout= vs DistTensor (tokens)")
    assert_equal(grid2d, yp.detach(), y.local.detach(), "plain block with layout= vs DistTensor (field)")
    assert_equal(grid2d, embed(x.detach()).detach(), tp.detach(), "plain block, inferred layout")


def test_patch_aligned_layout() -> None:
    lay = Layout((1, 2, 11, 8), (3, 2), (None, None, 0, 1))
    fix = patch_aligned_layout(lay, 2)
    assert fix.dim_cuts[2:] == ((0, 4, 8, 11), (0, 4, 8))
    assert fix.global_shape == lay.global_shape and fix.split == lay.split
    assert patched_layout(fix, 2, 5).dim_cuts == ((0, 1), (0, 5), (0, 2, 4, 5), (0, 2, 4))
    assert unpatched_layout(patched_layout(fix, 2, 2), 2, 2).dim_cuts[2:] == ((0, 4, 8, 10), (0, 4, 8))
    with pytest.raises(ValueError, match=r"spatial dim 0 \(size 11, grid axis 0\) is cut at \(0, 4, 8, 11\)"):
        patched_layout(fix, 3, 5)


def test_misaligned_cuts_raise_naming_the_fix(grid2d: hpctp.ProcessGrid) -> None:
    p0 = grid2d.dims[0]
    shape = (1, 2, 4 * p0 + 2, 4)
    lay = Layout(shape, grid2d.dims, (None, None, 0, 1))  # balanced: the first cut is 5 when p0 > 1
    layer = PatchEmbed2d(2, 3, (4, 1), grid2d, seed=0, dtype=F64)
    x = hpctp.DistTensor(torch.zeros(lay.local_shape(grid2d.coords), dtype=F64), grid2d, lay)
    if p0 > 1:
        fixed = patch_aligned_layout(lay, (4, 1))
        msg = f"spatial dim 0 (size {shape[2]}, grid axis 0) is cut at {lay.dim_cuts[2]}"
        with pytest.raises(ValueError, match=re.escape(msg)):
            layer(x)
        with pytest.raises(ValueError, match="patch_aligned_layout"):
            layer(x)
        y = layer(x.redistribute(fixed))  # the fix the message names
        assert_all(grid2d, y.layout == patched_layout(fixed, (4, 1), 3), "aligned after the redistribution")
    else:
        assert_equal(grid2d, tuple(layer(x).global_shape), (1, 3, 1, 4), "one rank along H: always aligned")
    with pytest.raises(ValueError, match="expected 2 channels"):
        layer(torch.zeros(1, 3, 4, 4, dtype=F64))
    with pytest.raises(ValueError, match="patch_size"):
        PatchEmbed2d(2, 3, (2, 2, 2), grid2d, seed=0)
    with pytest.raises(ValueError, match="patch_size"):
        Unpatch2d(2, 3, 0, grid2d, seed=0)
