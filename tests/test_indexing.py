"""x[key] and x[key] = value on DistTensors against numpy/torch on the gathered tensor."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers.checks import Checks
from helpers.tensors import SHAPE, check_gradient, global_array, make_tensor, splits_for

import hpctp
from hpctp.layout import Layout
from hpctp.layout.indexing import index_plan
from hpctp.testing import assert_all, assert_allclose, assert_equal

KEYS = [
    (),
    (slice(None),),
    (slice(1, 6, 2), 3, slice(None, None, 4)),
    (Ellipsis, 2),
    (None, -4, Ellipsis, None),
    (-1, -2, -3),
    (slice(2, 2),),
    (slice(10, 20), slice(-3, None)),
    (slice(0, 7, 3), slice(1, 4), 5),
    (np.int64(3), Ellipsis),
    (slice(1, None), None, slice(None, -1, 2)),
    4,
]
REVERSED = [  # negative steps: the elements flip (between ranks along a divided dim)
    (slice(None, None, -1),),
    (slice(5, 0, -2), 3, slice(None, None, -4)),
    (Ellipsis, slice(None, 1, -1), None),
    (2, slice(None, None, -1), slice(1, 5)),
    (slice(None, None, -3), slice(0, 0, -1)),
    (slice(1, 2, -1), -1),
    (-1, -2, slice(None, None, -1)),
]


# ---------------------------------------------------------------------------- pure block math
@pytest.mark.parametrize("dims", [(1,), (3,), (3, 2), (2, 1, 3)])
def test_plan_blocks_tile_the_numpy_selection(dims: tuple[int, ...]) -> None:
    """Every block's local_key selects its block of the selection, and the result has numpy's shape."""
    a = global_array(SHAPE)
    split = tuple(range(len(dims))) + (None,) * (3 - len(dims))
    for skew, key in itertools.product((False, True), KEYS + REVERSED):
        cuts = ((0, 1, 1, 7), None, None) if skew and dims[0] == 3 else ()
        lay = Layout(SHAPE, dims, split, cuts)
        plan = index_plan(lay, key)
        assert plan.result.global_shape == a[key].shape, key
        sel = a[plan.selections]
        np.testing.assert_array_equal(np.flip(sel, plan.reverse).reshape(a[key].shape), a[key], err_msg=str(key))
        for coords in itertools.product(*(range(g) for g in dims)):
            got = a[lay.local_slices(coords)][plan.local_key(coords)]
            np.testing.assert_array_equal(got, sel[plan.sliced.local_slices(coords)], err_msg=f"{key} at {coords}")
        divided = any(
            (not isinstance(e, slice) or d in plan.reverse) and lay.parts(d) > 1
            for d, e in enumerate(e for e in plan.entries if e is not None)
        )
        assert plan.moves == divided, key


def test_plan_refuses_bad_keys() -> None:
    lay = Layout(SHAPE, (2,), (0, None, None))
    with pytest.raises(IndexError, match="index 7 is out of bounds for dim 0 of size 7"):
        index_plan(lay, 7)
    with pytest.raises(IndexError, match="index -6 is out of bounds for dim 1 of size 5"):
        index_plan(lay, (0, -6))
    with pytest.raises(IndexError, match="too many indices .* 3 dims: 4"):
        index_plan(lay, (0, 0, 0, 0))
    with pytest.raises(IndexError, match="single ellipsis"):
        index_plan(lay, (Ellipsis, 0, Ellipsis))
    with pytest.raises(ValueError, match="slice step cannot be zero \\(dim 1\\)"):
        index_plan(lay, (slice(None), slice(None, None, 0)))
    for bad in ([0, 1], np.array([1, 2]), True, np.bool_(False), 1.0):
        with pytest.raises(TypeError, match="ints, slices, ... or None"):
            index_plan(lay, bad)
    with pytest.raises(TypeError, match="slice stop must be an int or None, got float"):
        index_plan(lay, slice(0, 2.5))


# ---------------------------------------------------------------------------- x[key]
@pytest.mark.mpi
def test_getitem_equals_numpy(grid2d: hpctp.ProcessGrid) -> None:
    with Checks(grid2d) as check:
        a = global_array(SHAPE)
        for split, skew in itertools.product(splits_for(grid2d), (False, True)):
            x = make_tensor(grid2d, split, skew)
            for key in KEYS + REVERSED:
                y = x[key]
                check.equal(y.gather(None), a[key], f"split={split} skew={skew} key={key}")
                check.true(y.layout.global_shape == a[key].shape, f"{key}: {y.layout}")


@pytest.mark.mpi
def test_getitem_3d_grid_torch(grid3d: hpctp.ProcessGrid) -> None:
    a = torch.from_numpy(global_array(SHAPE))
    x = make_tensor(grid3d, (0, 1, 2), True, "torch")
    for key in KEYS:
        assert_equal(grid3d, x[key].gather(None), a[key], f"key={key}")
    for key in REVERSED:  # (torch has no negative steps: numpy's result)
        assert_equal(grid3d, x[key].gather(None).numpy(), a.numpy()[key], f"key={key}")


@pytest.mark.mpi
def test_getitem_views_and_moves(grid2d: hpctp.ProcessGrid) -> None:
    """Slices are views of the block and move nothing; an int along a divided dim replicates the row."""
    x = make_tensor(grid2d, (0, 1, None), False)
    with hpctp.CommCounter() as sliced:
        y = x[1:5, ::2]
    view = y.local.size == 0 or np.shares_memory(y.local, x.local)
    assert_all(grid2d, not sliced.calls and view, f"a view, no messages: {sliced}")
    row = x[3]
    assert_all(grid2d, row.split == (1, None) and 0 in row.layout.replicated_axes, str(row.layout))
    assert_equal(grid2d, row.local, global_array(SHAPE)[3][row.local_slices], "every rank holds its part of the row")


@pytest.mark.mpi
def test_getitem_gradient(grid2d: hpctp.ProcessGrid) -> None:
    """d/dX sum(W * X[key]) on the blocks equals torch's on the gathered tensor."""
    for key in ((2, slice(1, 4)), (slice(None, None, 2), -1, None), (6, 4, 5), (slice(1, 6, 3),)):
        check_gradient(grid2d, lambda t, k=key: t[k], lambda t, k=key: t[k], True, f"key={key}")
    w_full = torch.from_numpy(np.cos(global_array(SHAPE)))
    for key in REVERSED:  # (torch has no negative steps: the gradient is W scattered back, as numpy writes it)
        x = make_tensor(grid2d, (0, 1, None), True, "torch")
        x.local.requires_grad_(True)
        y = x[key]
        w = w_full.numpy()[key]
        (y.local * torch.from_numpy(w[y.local_slices].copy())).sum().backward()
        want = np.zeros(SHAPE)
        want[key] = w
        assert_equal(grid2d, x.local.grad.numpy(), want[x.local_slices], f"key={key}")


@pytest.mark.mpi
def test_getitem_errors_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    x = make_tensor(grid2d, (0, 1, None), True)
    with pytest.raises(IndexError, match="out of bounds"):
        x[0, 5]
    with pytest.raises(TypeError, match="advanced"):
        x[[0, 1]]
    with pytest.raises(ValueError, match="cannot be zero"):
        x[::0]
    if grid2d.dims[0] > 1:
        with pytest.raises(ValueError, match=r"DistTensor\[key\]: ranks passed different key"):
            x[grid2d.rank % 2]


# ---------------------------------------------------------------------------- x[key] = value
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_setitem_equals_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    cases = [
        ((0,), 7.5),
        ((slice(1, 6, 2), 3), np.arange(3.0)[:, None] + 100),
        ((Ellipsis, 2), np.arange(5.0)[None, :] * -1),
        ((slice(None), slice(1, 4), slice(0, 6, 5)), np.array([[1.0], [2.0], [3.0]])),
        ((6, 4, 5), np.float64(-2.0)),
        ((None, 3, slice(2, None)), [[9.0] * 6] * 3),
        ((slice(None, None, -1), 1), np.arange(6.0) * 3),
        ((slice(5, 0, -2), slice(None, None, -1), slice(4, None, -3)), np.arange(30.0).reshape(3, 5, 2)),
        ((Ellipsis, slice(None, None, -2)), np.arange(3.0) - 10),
    ]
    for split, skew in itertools.product(splits_for(grid2d), (False, True)):
        a = global_array(SHAPE)
        x = make_tensor(grid2d, split, skew, backend)
        for key, value in cases:
            a[key] = value
            x[key] = torch.as_tensor(value) if backend == "torch" and isinstance(value, np.ndarray) else value
        assert_equal(grid2d, x.gather(None), a, f"split={split} skew={skew}")


@pytest.mark.mpi
def test_setitem_from_disttensors(grid2d: hpctp.ProcessGrid) -> None:
    a = global_array(SHAPE)
    x = make_tensor(grid2d, (0, 1, None), True)
    for key in ((2,), (slice(1, 6, 2), slice(None), 3), (Ellipsis, None, 1)):
        x[key] = x[key] * 3 + 1
        a[key] = a[key] * 3 + 1
    for key, source in (
        ((slice(5, 0, -2), slice(None), 3), (slice(1, 6, 2), slice(None), 3)),  # rows 5, 3, 1 <- 1, 3, 5
        ((slice(None, None, -1), slice(None, None, -2)), (slice(None), slice(0, 5, 2))),
    ):
        x[key] = x[source]
        a[key] = a[source].copy()
    x[4, 2] = x.max()  # a replicated 0-d tensor is a number
    a[4, 2] = a.max()
    assert_equal(grid2d, x.gather(None), a)
    with pytest.raises(ValueError, match="x\\[key\\] = value. needs tensors with the same layout"):
        x[1:3] = x[2:4].redistribute((None, None, None)) if grid2d.size > 1 else x[1:4]
    with pytest.raises(TypeError, match="one backend"):
        x[1] = x[1].to("torch")
    with pytest.raises(
        ValueError, match=r"could not broadcast a value of shape \(4,\) into x\[key\] of shape \(5, 6\)"
    ):
        x[0] = np.zeros(4)
    with pytest.raises(TypeError, match="a number, a DistTensor or an array"):
        x[0] = "zero"


@pytest.mark.mpi
def test_len_and_iteration(grid2d: hpctp.ProcessGrid) -> None:
    a = global_array(SHAPE)
    x = make_tensor(grid2d, (0, 1, None), True)
    rows = [r.gather(None) for r in x]  # one collective x[i] per row of the divided dim 0
    assert_all(grid2d, len(x) == 7 and len(rows) == 7, f"len {len(x)}, {len(rows)} rows")
    assert_equal(grid2d, np.stack(rows), a, "the rows in order")
    s = x.sum()
    with pytest.raises(TypeError, match="len.. of a 0-d DistTensor"):
        len(s)
    with pytest.raises(TypeError, match="len.. of a 0-d DistTensor"):
        list(s)
    for convert in (np.asarray, np.array, lambda v: np.asarray([v, v])):
        with pytest.raises(TypeError, match=r"call x.gather\(\) for the global tensor"):
            convert(x)


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_transpose_is_a_view_with_permuted_layout(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    a = global_array(SHAPE)
    for split, skew in itertools.product(splits_for(grid2d), (False, True)):
        x = make_tensor(grid2d, split, skew, backend)
        for perm in [None, (1, 0, 2), (2, 0, 1), (-1, -3, 1)]:
            y = x.transpose() if perm is None else x.transpose(*perm)
            want = a.transpose(perm)
            assert_equal(grid2d, y.gather(None), want, f"split={split} perm={perm}")
            assert_all(grid2d, y.split == tuple(x.split[d % 3] for d in (perm or (2, 1, 0))), str(y.layout))
        assert_equal(grid2d, x.T.gather(None), a.T, "x.T")
        assert_equal(grid2d, np.transpose(x, (0, 2, 1)).gather(None), np.transpose(a, (0, 2, 1)), "np.transpose")
    m = hpctp.distribute(global_array((6, 4)), grid2d, (0, 1)).to(backend)
    assert_allclose(
        grid2d, (m @ m.T).gather(None), global_array((6, 4)) @ global_array((6, 4)).T, rtol=1e-13, what="m @ m.T"
    )
    for bad in [(0, 1), (0, 0, 1), (0, 1, 3), (0, 1, 2.0)]:
        with pytest.raises(ValueError, match="is not a permutation of the 3 dims"):
            x.transpose(*bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- operands cut differently
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_differently_cut_operands_align(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    """``u[1:] - u[:-1]`` and the stencil update ``u[1:-1] = ... u[2:] ... u[:-2]`` as in numpy."""
    for split, skew in itertools.product(splits_for(grid2d), (False, True)):
        a = global_array(SHAPE)
        x = make_tensor(grid2d, split, skew, backend)
        diff = x[1:] - x[:-1]
        assert_all(grid2d, diff.layout == x[1:].layout, f"the left operand's layout: {diff.layout}")
        assert_equal(
            grid2d,
            diff.gather(None),
            torch.from_numpy(np.diff(a, axis=0)) if backend == "torch" else np.diff(a, axis=0),
        )
        x[1:-1, 1:-1] = x[1:-1, 1:-1] + 0.125 * (
            x[2:, 1:-1] + x[:-2, 1:-1] + x[1:-1, 2:] + x[1:-1, :-2] - 4 * x[1:-1, 1:-1]
        )
        a[1:-1, 1:-1] = a[1:-1, 1:-1] + 0.125 * (
            a[2:, 1:-1] + a[:-2, 1:-1] + a[1:-1, 2:] + a[1:-1, :-2] - 4 * a[1:-1, 1:-1]
        )
        x[::-2] = np.minimum(x[::-2], x[0::2])  # a reversed target, the value cut differently
        a[::-2] = np.minimum(a[::-2], a[0::2])
        got = x.gather(None)
        assert_allclose(
            grid2d, got.numpy() if backend == "torch" else got, a, rtol=1e-14, atol=1e-14, what=f"{split} {skew}"
        )


@pytest.mark.mpi
def test_aligning_moves_only_the_rows_between_cuts(grid1d: hpctp.ProcessGrid) -> None:
    x = hpctp.DistTensor(np.ones((4, 3)), grid1d, Layout((4 * grid1d.size, 3), grid1d.dims, (0, None)))
    with hpctp.CommCounter() as c:
        x[1:] - x[:-1]
    assert_all(grid1d, c.bytes_sent <= 3 * 8, f"at most one row of 3 float64 per rank, sent {c.bytes_sent} bytes")


@pytest.mark.mpi
def test_aligned_operand_gradient(grid2d: hpctp.ProcessGrid) -> None:
    for skew in (False, True):
        check_gradient(grid2d, lambda t: t[2:] - 2 * t[1:-1] + t[:-2], lambda t: t[2:] - 2 * t[1:-1] + t[:-2], skew, "")
    x = make_tensor(grid2d, (0, 1, None), True)
    with pytest.raises(ValueError, match=r"same layout.*call other.redistribute\(x.layout\)"):
        x[1:] + x[1:].redistribute((None, None, None))
