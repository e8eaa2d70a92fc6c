"""NeighborhoodAttention2d/3d vs torch.nn.MultiheadAttention with an explicit window mask on the gathered field."""

from __future__ import annotations

import pytest
import torch
from helpers.layers import compare_layer, global_field
from helpers.layouts import make_layout

import hpctp
from hpctp.nn.neighborhood import NeighborhoodAttention2d, NeighborhoodAttention3d, neighborhood_mask
from hpctp.testing import assert_allclose, assert_equal

pytestmark = pytest.mark.mpi
F64 = torch.float64


def window_mask(shape: tuple[int, ...], kernel: tuple[int, ...], periodic: tuple[bool, ...]) -> torch.Tensor:
    """Local. ``attn_mask`` over the row-major tokens of a field of ``shape``: True where a key is
    *not* in the query's window (torch's boolean convention)."""
    grids = torch.meshgrid(*[torch.arange(n) for n in shape], indexing="ij")
    coords = torch.stack(grids, -1).reshape(-1, len(shape))
    diff = coords[None, :, :] - coords[:, None, :]  # key - query, [Q, K, nd]
    ok = torch.ones(diff.shape[:2], dtype=torch.bool)
    for d, (n, k, per) in enumerate(zip(shape, kernel, periodic)):
        r, dd = k // 2, diff[..., d]
        if per:
            dd = dd % n
            ok &= (dd <= r) | (dd >= n - r)
        else:
            ok &= dd.abs() <= r
    return ~ok


def reference(mha: torch.nn.MultiheadAttention, kernel: tuple[int, ...], periodic: tuple[bool, ...]):  # type: ignore[no-untyped-def]
    """Local. The single-process layer: ``mha`` on the field's tokens with the window mask."""

    def ref(X: torch.Tensor) -> torch.Tensor:
        shape = tuple(X.shape[2:])
        t = X.flatten(2).transpose(1, 2)  # [B, tokens, E]
        y = mha(t, t, t, attn_mask=window_mask(shape, kernel, periodic), need_weights=False)[0]
        return y.transpose(1, 2).reshape(X.shape)

    return ref


def _pair(cls: type, grid: hpctp.ProcessGrid, embed: int, heads: int, kernel: object, **kw: object) -> tuple:
    mine = cls(embed, heads, kernel, grid, seed=11, dtype=F64, **kw)
    torch.manual_seed(11)
    ref = torch.nn.MultiheadAttention(embed, heads, batch_first=True, dtype=F64, bias=kw.get("bias", True))
    names = [n for n, _ in mine.named_parameters()]
    assert_equal(grid, names, [n for n, _ in ref.named_parameters()], "torch's parameter names")
    for (n, p), q in zip(mine.named_parameters(), ref.parameters()):
        assert_equal(grid, p.detach(), q.detach(), f"seeded init of {n} equals torch's")
    return mine, ref


# (shape [B, E, H, W], heads, kernel, periodic, split, skew)
CASES_2D = [
    ((2, 8, 7, 6), 2, 3, False, (0, 1), True),
    ((1, 8, 7, 6), 2, 5, (True, False), (0, 1), True),  # halo wider than the 1-cell skewed blocks
    ((1, 6, 5, 6), 3, (3, 5), True, (1, 0), False),  # periodic both ways, grid axes swapped
    ((1, 4, 3, 4), 1, 3, (False, True), (0, 1), False),  # empty blocks on 4 and 6 ranks
    ((1, 4, 6, 5), 2, 7, False, (0, 1), True),  # window larger than the field: masked
]


@pytest.mark.parametrize("case", CASES_2D, ids=lambda c: f"k{c[2]}-p{c[3]}-s{c[4]}".replace(" ", ""))
def test_neighborhood_attention2d_matches_masked_mha(grid2d: hpctp.ProcessGrid, case: tuple) -> None:
    shape, heads, kernel, periodic, split, skew = case
    mine, ref = _pair(NeighborhoodAttention2d, grid2d, shape[1], heads, kernel, split=split, periodic=periodic)
    ks = (kernel,) * 2 if isinstance(kernel, int) else kernel
    per = (periodic,) * 2 if isinstance(periodic, bool) else periodic
    params = [p for _, p in mine.named_parameters()]
    compare_layer(
        grid2d, mine, reference(ref, ks, per), shape, (None, None, *split), params, list(ref.parameters()), skew,
        sync=mine,
    )  # fmt: skip


def test_neighborhood_attention2d_no_bias_plain_blocks(grid2d: hpctp.ProcessGrid) -> None:
    """bias=False; a plain block (layout inferred, or given) gives the DistTensor's result."""
    mine, ref = _pair(NeighborhoodAttention2d, grid2d, 4, 2, 3, periodic=True, bias=False)
    lay = make_layout(grid2d, (2, 4, 5, 7), (None, None, 0, 1), skew=True)
    X = global_field(lay.global_shape, 5)
    x = X[lay.local_slices(grid2d.coords)].contiguous()
    y_plain, y_given = mine(x), mine(x, layout=lay)
    y_dist = mine(hpctp.DistTensor(x, grid2d, lay))
    assert_equal(grid2d, y_plain.detach(), y_dist.local.detach(), "plain block vs DistTensor")
    assert_equal(grid2d, y_given.detach(), y_dist.local.detach(), "plain block with layout vs DistTensor")
    assert_equal(grid2d, y_dist.layout == lay, True, "the output keeps the input's layout")
    R = reference(ref, (3, 3), (True, True))(X)
    assert_allclose(grid2d, y_plain.detach(), R.detach()[lay.local_slices(grid2d.coords)], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("periodic", [False, (True, False, True)], ids=["zero", "mixed"])
def test_neighborhood_attention3d_matches_masked_mha(grid3d: hpctp.ProcessGrid, periodic: object) -> None:
    shape = (1, 4, 4, 3, 5)
    mine, ref = _pair(NeighborhoodAttention3d, grid3d, 4, 2, 3, periodic=periodic)
    per = (periodic,) * 3 if isinstance(periodic, bool) else periodic
    params = [p for _, p in mine.named_parameters()]
    compare_layer(
        grid3d, mine, reference(ref, (3, 3, 3), per), shape, (None, None, 0, 1, 2), params, list(ref.parameters()),
        skew=True, sync=mine,
    )  # fmt: skip


def test_neighborhood_mask_counts() -> None:
    """Zero boundary: edge tokens see fewer positions; periodic: all of them."""
    m = neighborhood_mask([(0, 4)], [4], [3], [False])
    assert m.tolist() == [[False, True, True], [True, True, True], [True, True, True], [True, True, False]]
    assert bool(neighborhood_mask([(1, 3), (0, 2)], [3, 2], [3, 3], [True, True]).all())
    assert tuple(neighborhood_mask([(1, 3), (0, 2)], [3, 2], [3, 5], [False, False]).shape) == (2, 2, 15)


def test_bad_arguments_raise(grid2d: hpctp.ProcessGrid) -> None:
    with pytest.raises(ValueError, match="odd int"):
        NeighborhoodAttention2d(4, 2, 4, grid2d, seed=0)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        NeighborhoodAttention2d(6, 4, 3, grid2d, seed=0)
    with pytest.raises(ValueError, match="one entry per spatial dim"):
        NeighborhoodAttention2d(4, 2, (3, 3, 3), grid2d, seed=0)
    with pytest.raises(TypeError, match="periodic"):
        NeighborhoodAttention2d(4, 2, 3, grid2d, periodic="yes", seed=0)
    with pytest.raises(ValueError, match="batch and channel"):
        NeighborhoodAttention2d(4, 2, 3, grid2d, split=(0, None, None, 1), seed=0)
    layer = NeighborhoodAttention2d(4, 2, 5, grid2d, periodic=(False, True), seed=0, dtype=F64)
    lay = make_layout(grid2d, (1, 4, 6, 4), (None, None, 0, 1), skew=False)
    x = hpctp.DistTensor(torch.zeros(lay.local_shape(grid2d.coords), dtype=F64), grid2d, lay)
    with pytest.raises(ValueError, match="kernel_size 5 exceeds the size 4 of periodic spatial dim 1"):
        layer(x)
    with pytest.raises(ValueError, match="expected 4 channels"):
        layer(torch.zeros(1, 3, 2, 2, dtype=F64))
    with pytest.raises(ValueError, match="expected a batched 4-D block"):
        layer(torch.zeros(4, 2, 2, dtype=F64))
