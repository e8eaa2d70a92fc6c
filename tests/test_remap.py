"""Flipping and rolling partitioned tensors.

The plans (pure, no MPI): every rank's destination block, assembled from its plan as the
executor does, equals numpy.flip/roll. The DistTensor methods (MPI): x.flip and x.roll equal
numpy's and torch's on the gathered tensor, values and gradients, on every grid.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers.checks import Checks
from helpers.layouts import layouts
from helpers.tensors import SHAPE, check_gradient, global_array, make_tensor, splits_for
from hypothesis import given, settings
from hypothesis import strategies as st

import hpctp
from hpctp.layout import Layout, check_remap, grid_coords, inverse_remap, moves_data, redistribution_plan
from hpctp.testing import assert_all, assert_allclose, assert_equal


def _apply(x: np.ndarray, remap: tuple) -> np.ndarray:
    """``y[..., j, ...] = x[..., m(j), ...]`` per dim, as the plan's docstring defines it."""
    for d, (reverse, shift) in enumerate(remap):
        n = x.shape[d]
        j = np.arange(n)
        x = np.take(x, ((n - 1 - j if reverse else j) - shift) % n if n else j, axis=d)
    return x


def _uneven(layout: Layout, draw: st.DrawFn) -> Layout:
    """``layout`` with drawn cuts (empty blocks allowed) on its divided dims."""
    cuts = []
    for d, n in enumerate(layout.global_shape):
        if layout.split[d] is None:
            cuts.append(None)
            continue
        inner = sorted(draw(st.lists(st.integers(0, n), min_size=layout.parts(d) - 1, max_size=layout.parts(d) - 1)))
        cuts.append((0, *inner, n))
    return Layout(layout.global_shape, layout.grid_dims, layout.split, tuple(cuts))


def _run(src: Layout, dst: Layout, remap: tuple, x: np.ndarray) -> list[np.ndarray]:
    """Every rank's destination block, built from the plans as ``redistribute_block`` does."""
    plans = [redistribution_plan(src, dst, r, remap) for r in range(src.nranks)]
    mail: dict[tuple[int, int], list[np.ndarray]] = {}
    for r, plan in enumerate(plans):
        mine = x[src.local_slices(grid_coords(r, src.grid_dims))]
        for p in plan.sends:
            mail.setdefault((r, p.peer), []).append(np.flip(mine[p.slices], plan.reversed_dims).copy())
    out = []
    for r, plan in enumerate(plans):
        mine = x[src.local_slices(grid_coords(r, src.grid_dims))]
        block = np.full(dst.local_shape(grid_coords(r, dst.grid_dims)), -1.0)
        cover = np.zeros(block.shape, dtype=int)
        for src_sl, dst_sl in plan.local:
            block[dst_sl] = np.flip(mine[src_sl], plan.reversed_dims)
            cover[dst_sl] += 1
        for p in plan.recvs:
            block[p.slices] = mail[(p.peer, r)].pop(0)
            cover[p.slices] += 1
        assert np.all(cover == 1)  # every destination element arrives exactly once
        out.append(block)
    assert all(not v for v in mail.values())  # every message sent is received
    return out


@st.composite
def remaps(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple:
    return tuple((draw(st.booleans()), draw(st.integers(-12, 12))) for _ in shape)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_remapped_plans_flip_and_roll(data: st.DataObject) -> None:
    src = _uneven(data.draw(layouts()), data.draw)
    axes = data.draw(st.permutations(list(range(len(src.grid_dims))) + [None] * src.ndim))
    dst = data.draw(st.sampled_from([src, src.with_split(tuple(axes[: src.ndim]))]))
    remap = data.draw(remaps(src.global_shape))
    x = np.arange(float(np.prod(src.global_shape))).reshape(src.global_shape)
    y = _apply(x, remap)
    for r, block in enumerate(_run(src, dst, remap, x)):
        np.testing.assert_array_equal(block, y[dst.local_slices(grid_coords(r, dst.grid_dims))])
    # the inverse remap (the gradient's way back) restores x
    back = check_remap(inverse_remap(check_remap(remap, src.global_shape)), src.global_shape)
    np.testing.assert_array_equal(_apply(y, back or ((False, 0),) * src.ndim), x)


def test_roll_sends_only_the_wrapped_rows() -> None:
    """Rolling a 10-row field on 2 row blocks by 1: each block sends its last row onward."""
    layout = Layout((10, 4), (2,), (0, None))
    for r in range(2):
        plan = redistribution_plan(layout, layout, r, ((False, 1), (False, 0)))
        assert [(p.peer, p.box) for p in plan.sends] == [(1 - r, ((4 + 5 * r, 5 + 5 * r), (0, 4)))]
        assert plan.recv_elements == 4


def test_moves_data_only_for_divided_dims() -> None:
    layout = Layout((6, 5), (2, 1), (0, 1))
    assert not moves_data(layout, layout, ((False, 0), (True, 2)))  # dim 1 is whole on every rank
    assert moves_data(layout, layout, ((True, 0), (False, 0)))
    assert moves_data(layout, layout.with_split((None, 0)), ())


@pytest.mark.parametrize("remap", [((True, 0),), ((False,),), (("yes", 1), (False, 0)), ((1, 0), (False, 0))])
def test_bad_remaps_are_refused(remap: tuple) -> None:
    with pytest.raises(ValueError, match="one \\(reverse: bool, shift: int\\) pair per dim"):
        check_remap(remap, (3, 4))


def test_identity_remap_is_no_remap() -> None:
    assert check_remap(((False, 4), (False, 0)), (4, 3)) == ()
    assert check_remap(((True, 0), (False, -1)), (4, 3)) == ((True, 0), (False, 2))
    layout = Layout((4, 3), (2,), (0, None))
    for r, c in itertools.product(range(2), [(), ((False, 4), (False, 3))]):
        assert redistribution_plan(layout, layout, r, c).remap == ()


# ---------------------------------------------------------------------------- DistTensor.flip / roll
FLIPS = [None, 0, 1, -1, (0, 2)]
ROLLS = [(1, 0), (-3, 1), (7, 0), ((2, -1), (0, 1)), (13, (0, 1, 2)), ((1, 2), 2), (0, 0)]


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_flip_and_roll_equal_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    with Checks(grid2d) as check:
        a = global_array(SHAPE)
        for split, skew in itertools.product(splits_for(grid2d), (False, True)):
            x = make_tensor(grid2d, split, skew, backend)
            for axis in FLIPS:
                y = x.flip(axis)
                got = y.gather(None)
                got = got.numpy() if backend == "torch" else got
                check.equal(got, np.flip(a, axis), f"flip({axis}) split={split} skew={skew}")
                check.true(y.layout == x.layout, f"flip keeps the layout: {y.layout}")
            for shift, axis in ROLLS:
                y = x.roll(shift, axis)
                got = y.gather(None)
                got = got.numpy() if backend == "torch" else got
                check.equal(got, np.roll(a, shift, axis), f"roll({shift}, {axis}) split={split} skew={skew}")
                check.true(y.layout == x.layout, f"roll keeps the layout: {y.layout}")


@pytest.mark.mpi
def test_flip_and_roll_3d_grid_torch(grid3d: hpctp.ProcessGrid) -> None:
    a = torch.from_numpy(global_array(SHAPE))
    x = make_tensor(grid3d, (0, 1, 2), True, "torch")
    assert_equal(grid3d, x.flip((0, 1)).gather(None), torch.flip(a, (0, 1)))
    assert_equal(grid3d, x.roll((3, -2, 1), (0, 1, 2)).gather(None), torch.roll(a, (3, -2, 1), (0, 1, 2)))


@pytest.mark.mpi
def test_flip_and_roll_gradients(grid2d: hpctp.ProcessGrid) -> None:
    """d/dX sum(W * f(X)) on the blocks equals torch's on the gathered tensor."""
    ops = [
        (lambda t: t.flip((0, 1)), lambda t: torch.flip(t, (0, 1))),
        (lambda t: t.roll(2, 0), lambda t: torch.roll(t, 2, 0)),
        (lambda t: t.roll((-1, 4), (1, 0)).flip(2), lambda t: torch.flip(torch.roll(t, (-1, 4), (1, 0)), (2,))),
    ]
    for skew, (i, (op, ref_op)) in itertools.product((False, True), enumerate(ops)):
        check_gradient(grid2d, op, ref_op, skew, f"op {i}")


@pytest.mark.mpi
def test_roll_sends_only_the_rows_that_leave(grid1d: hpctp.ProcessGrid) -> None:
    """A shift of one row along a divided dim: each rank sends one row to the next rank, nothing else."""
    n = 4 * grid1d.size
    x = hpctp.DistTensor(np.ones((4, 3)), grid1d, Layout((n, 3), grid1d.dims, (0, None)))
    with hpctp.CommCounter() as c:
        x.roll(1, 0)
    want = 0 if grid1d.size == 1 else 3 * 8
    assert_all(grid1d, c.bytes_sent == want, f"sent {c.bytes_sent} bytes, expected {want}")
    with hpctp.CommCounter() as c:
        y = x.roll(1, 1).flip(1)  # along the whole dim 1: within each block
    assert_all(grid1d, not c.calls and y.layout == x.layout, f"no messages: {c}")


@pytest.mark.mpi
def test_periodic_stencil_with_roll(grid2d: hpctp.ProcessGrid) -> None:
    """A 5-point periodic Laplacian written with roll, as one would in numpy."""
    a = np.sin(global_array((9, 7)))
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, 1 if grid2d.ndim > 1 else None))
    lap = x.roll(1, 0) + x.roll(-1, 0) + x.roll(1, 1) + x.roll(-1, 1) - 4 * x
    want = np.roll(a, 1, 0) + np.roll(a, -1, 0) + np.roll(a, 1, 1) + np.roll(a, -1, 1) - 4 * a
    assert_allclose(grid2d, lap.gather(None), want, rtol=1e-12, atol=1e-14)


@pytest.mark.mpi
def test_flip_and_roll_errors_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    x = make_tensor(grid2d, (0, 1, None), True)
    with pytest.raises(ValueError, match=r"roll needs axis= for a tensor of 3 dims"):
        x.roll(1)
    with pytest.raises(ValueError, match="axis 3 is out of range"):
        x.roll(1, 3)
    with pytest.raises(ValueError, match="do not broadcast"):
        x.roll((1, 2, 3), (0, 1))
    with pytest.raises(TypeError, match="int shifts and axes"):
        x.roll(1.5, 0)
    with pytest.raises(ValueError, match="repeated"):
        x.flip((0, 0))
    if grid2d.dims[0] > 1:
        with pytest.raises(ValueError, match="roll: ranks passed different shift"):
            x.roll(grid2d.rank % 2, 0)
    v = hpctp.DistTensor(np.arange(3.0), grid2d, Layout((3,), grid2d.dims, (None,)))
    assert_equal(grid2d, v.roll(1).local, np.roll(np.arange(3.0), 1), "a 1-D tensor rolls without axis")
