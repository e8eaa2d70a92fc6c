"""Pure block math (no MPI): balanced blocks, layouts and redistribution plans."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from helpers.layouts import layouts
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctp.layout import (
    Layout,
    block_cuts,
    block_range,
    grid_coords,
    grid_rank,
    owner_of,
    redistribution_plan,
    tiled_layout,
)


@given(n=st.integers(0, 1000), parts=st.integers(1, 64))
def test_block_range_balanced_and_tiling(n: int, parts: int) -> None:
    ranges = [block_range(n, parts, i) for i in range(parts)]
    sizes = [b - a for a, b in ranges]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(parts - 1))
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # first blocks are the larger ones
    assert sum(sizes) == n


@given(n=st.integers(1, 200), parts=st.integers(1, 20), data=st.data())
def test_owner_of_finds_the_block(n: int, parts: int, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, n - 1))
    cuts = block_cuts(n, parts)
    b = owner_of(cuts, i)
    assert cuts[b] <= i < cuts[b + 1]


@pytest.mark.parametrize(
    "args, err",
    [((-1, 2, 0), ValueError), ((5, 0, 0), ValueError), ((5, 2, 2), ValueError), ((5.0, 2, 0), TypeError)],
)
def test_block_range_rejects_bad_input(args: tuple, err: type) -> None:
    with pytest.raises(err):
        block_range(*args)


def _replica_groups(layout: Layout) -> dict[tuple[int, ...], list[tuple[int, ...]]]:
    groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for coords in itertools.product(*(range(g) for g in layout.grid_dims)):
        groups.setdefault(layout.block_index(coords), []).append(coords)
    return groups


@settings(max_examples=200, deadline=None)
@given(layout=layouts())
def test_layout_slices_tile_the_global_shape(layout: Layout) -> None:
    count = np.zeros(layout.global_shape, dtype=int)
    for coords in itertools.product(*(range(g) for g in layout.grid_dims)):
        sl = layout.local_slices(coords)
        assert count[sl].shape == layout.local_shape(coords)
        if layout.is_primary(coords):
            count[sl] += 1
    assert np.all(count == 1)
    # replicas (same block index) hold the same box; each block has exactly one primary
    for members in _replica_groups(layout).values():
        assert len({layout.local_ranges(c) for c in members}) == 1
        assert sum(layout.is_primary(c) for c in members) == 1


def _check_plans(src: Layout, dst: Layout) -> None:
    """Every rank's plan from ``src`` to ``dst``: messages pair up, each destination element
    arrives once, and only elements a rank does not hold already are received."""
    plans = [redistribution_plan(src, dst, r) for r in range(src.nranks)]
    sent = {(r, p.peer): p.box for r, pl in enumerate(plans) for p in pl.sends}
    recv = {(p.peer, r): p.box for r, pl in enumerate(plans) for p in pl.recvs}
    assert sent == recv  # every message has a matching receive with the same box
    for r, plan in enumerate(plans):
        me_src, me_dst = grid_coords(r, src.grid_dims), grid_coords(r, dst.grid_dims)
        cover = np.zeros(dst.local_shape(me_dst), dtype=int)
        for src_sl, dst_sl in plan.local:
            cover[dst_sl] += 1
            # a local copy moves the same global elements
            box = tuple(slice(a.start + o.start, a.stop + o.start) for a, o in zip(src_sl, src.local_slices(me_src)))
            assert box == tuple(
                slice(a.start + o.start, a.stop + o.start) for a, o in zip(dst_sl, dst.local_slices(me_dst))
            )
        for p in plan.recvs:
            cover[p.slices] += 1
        assert np.all(cover == 1)  # every destination element arrives exactly once
        mine = np.zeros(src.global_shape, dtype=bool)
        mine[src.local_slices(me_src)] = True
        needed = int((~mine[dst.local_slices(me_dst)]).sum())
        assert plan.recv_elements == needed


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_redistribution_plan_is_exact(data: st.DataObject) -> None:
    src = data.draw(layouts())
    axes = data.draw(st.permutations(list(range(len(src.grid_dims))) + [None] * src.ndim))
    _check_plans(src, src.with_split(tuple(axes[: src.ndim])))


@st.composite
def factorizations(draw: st.DrawFn, n: int) -> tuple[int, ...]:
    """A grid shape of ``n`` ranks with 1-3 axes."""
    out: list[int] = []
    for _ in range(draw(st.integers(0, 2))):
        out.append(draw(st.sampled_from([f for f in range(1, n + 1) if n % f == 0])))
        n //= out[-1]
    return (*out, n)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_redistribution_plan_between_grid_shapes(data: st.DataObject) -> None:
    """The same ranks on another grid shape (e.g. two axes merged): plans stay exact."""
    src = data.draw(layouts())
    gdims = data.draw(factorizations(src.nranks))
    axes = data.draw(st.permutations(list(range(len(gdims))) + [None] * src.ndim))
    _check_plans(src, Layout(src.global_shape, gdims, tuple(axes[: src.ndim])))
    with pytest.raises(ValueError, match="numbers of ranks must match"):
        redistribution_plan(src, Layout(src.global_shape, (src.nranks + 1,), (None,) * src.ndim), 0)


@given(st.integers(0, 40), st.integers(1, 9))
def test_block_cuts_are_the_block_ranges(n: int, parts: int) -> None:
    """block_cuts (remembered per (n, parts)) lists the stops of block_range, from 0."""
    assert block_cuts(n, parts) == (0,) + tuple(block_range(n, parts, i)[1] for i in range(parts))
    assert block_cuts(np.int64(n), parts) is block_cuts(n, parts)


def test_with_size_and_remembered_ranges() -> None:
    """with_size changes an undivided dim (remembered: the same object again); ranges per position are
    remembered and equal a fresh layout's."""
    lay = Layout((4, 3, 10, 7), (1, 2, 3), (None, None, 1, 2), (None, None, (0, 6, 10), None))
    big = lay.with_size(1, 8)
    assert big == Layout((4, 8, 10, 7), (1, 2, 3), (None, None, 1, 2), (None, None, (0, 6, 10), None))
    assert lay.with_size(1, 8) is big and lay.with_size(1, 3) == lay
    for coords in ((0, 0, 0), (0, 1, 2), (0, 1, 2)):
        fresh = Layout((4, 8, 10, 7), (1, 2, 3), (None, None, 1, 2), (None, None, (0, 6, 10), None))
        assert big.local_ranges(coords) == fresh.local_ranges(list(coords))
    with pytest.raises(ValueError, match="cut into 2 blocks"):
        lay.with_size(2, 5)
    with pytest.raises(ValueError, match="dimension 4"):
        lay.with_size(4, 5)
    with pytest.raises(ValueError, match="coords"):
        big.local_ranges((0, 2, 0))


def test_layout_validation_messages() -> None:
    with pytest.raises(ValueError, match="out of range"):
        Layout((4, 4), (2, 2), (0, 2))
    with pytest.raises(ValueError, match="more than one tensor dim"):
        Layout((4, 4), (2, 2), (1, 1))
    with pytest.raises(ValueError, match="entries"):
        Layout((4, 4), (2, 2), (0,))
    with pytest.raises(TypeError):
        Layout((4, 4), (2, 2), (0, "1"))
    with pytest.raises(ValueError, match="negative"):
        Layout((-1, 4), (2, 2), (0, 1))
    with pytest.raises(ValueError, match="boundaries"):
        Layout((5,), (2,), (0,), ((0, 6, 5),))


def test_check_block_accepts_only_the_block_at_coords() -> None:
    lay = Layout((5, 7), (2, 3), (0, 1))  # rows 3|2, columns 3|2|2
    for coords in itertools.product(range(2), range(3)):
        lay.check_block(lay.local_shape(coords), (2, 3), coords, "block")
    with pytest.raises(ValueError, match=r"A block has shape \(3, 3\) but .* expects \(2, 2\) at grid coords \(1, 2\)"):
        lay.check_block((3, 3), (2, 3), (1, 2), "A block")
    with pytest.raises(ValueError, match=r"is for grid dims \(2, 3\), but the grid has dims \(3, 2\)"):
        lay.check_block((3, 3), (3, 2), (0, 0), "block")


def test_custom_cuts_and_balanced_normalisation() -> None:
    lay = Layout((7,), (3,), (0,), ((0, 1, 5, 7),))
    assert [lay.local_shape((i,)) for i in range(3)] == [(1,), (4,), (2,)]
    assert not lay.is_balanced
    same = Layout((7,), (3,), (0,), (block_cuts(7, 3),))
    assert same == Layout((7,), (3,), (0,)) and same.is_balanced


@given(dims=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_grid_coords_inverse(dims: list[int], data: st.DataObject) -> None:
    r = data.draw(st.integers(0, math.prod(dims) - 1))
    assert grid_rank(grid_coords(r, dims), dims) == r


def test_tiled_layout_of_uneven_blocks() -> None:
    """Blocks a caller holds (rank order, row-major on a 2x3 grid) imply the cuts."""
    rows, cols = (3, 1), (2, 0, 4)
    shapes = [(r, 5, c) for r in rows for c in cols]
    lay = tiled_layout(shapes, (2, 3), (0, None, 1))
    assert lay.global_shape == (4, 5, 6)
    assert lay.dim_cuts == ((0, 3, 4), (0, 5), (0, 2, 2, 6))
    for rank, shape in enumerate(shapes):
        assert lay.local_shape(grid_coords(rank, (2, 3))) == shape
    assert tiled_layout([(), ()], (2,), None) == Layout((), (2,), ())  # 0-d blocks
    bad = list(shapes)
    bad[4] = (1, 5, 3)  # rank 4 (coords (1, 1)) disagrees with rank 1 on dim 2
    with pytest.raises(ValueError, match=r"^from_local: blocks do not tile: dim 2 .* coordinate 1 .* \[0, 3\]"):
        tiled_layout(bad, (2, 3), (0, None, 1), "from_local: ")
    bad[4] = (1, 6, 0)
    with pytest.raises(ValueError, match=r"dim 1 is not split but its local size differs between ranks: \[5, 6\]"):
        tiled_layout(bad, (2, 3), (0, None, 1))
    with pytest.raises(ValueError, match="out of range"):
        tiled_layout(shapes, (2, 3), (0, None, 2))
