"""hpctp.concatenate / hpctp.stack (and np.concatenate / np.stack) against numpy on the gathered tensors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import hpctp
from hpctp.layout import Layout
from hpctp.layout.join import join_layouts
from hpctp.testing import assert_all, assert_allclose, assert_equal

SPLITS = [(0, 1), (1, None), (None, 0)]  # divided and undivided joined dims, on a 2-D grid


def _global(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) * 0.25 + seed


def _dist(grid: hpctp.ProcessGrid, a: np.ndarray, split: object, backend: str = "numpy") -> hpctp.DistTensor:
    return hpctp.distribute(torch.from_numpy(a) if backend == "torch" else a, grid, split)


def _numpy(x: object) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


# ---------------------------------------------------------------------------- pure layout math
@pytest.mark.parametrize("dims", [(1,), (3,), (3, 2), (2, 1, 3)])
def test_join_layouts_blocks_are_the_inputs_blocks_joined(dims: tuple[int, ...]) -> None:
    """At every grid position the result's block is the inputs' target blocks concatenated."""
    rng = np.random.default_rng(len(dims))
    split = (0, None, 1 if len(dims) > 1 else None)
    for axis, lengths in itertools.product(range(3), ((4,), (3, 0, 5), (0, 1, 7, 2))):
        shapes = [tuple(n if d == axis else s for d, s in enumerate((5, 4, 3))) for n in lengths]
        layouts = []
        for shape in shapes:  # random uneven cuts on every divided dim
            cuts = [
                None if g is None else (0, *sorted(rng.integers(0, n + 1, dims[g] - 1)), n)
                for n, g in zip(shape, split)
            ]
            layouts.append(Layout(shape, dims, split, cuts))
        arrays = [rng.standard_normal(s) for s in shapes]
        result, targets = join_layouts(layouts, axis)
        whole = np.concatenate(arrays, axis)
        assert result.global_shape == whole.shape and result.split == layouts[0].split
        for d in range(3):
            want = layouts[0].dim_cuts[d] if d != axis else Layout(whole.shape, dims, split).dim_cuts[d]
            assert result.dim_cuts[d] == want, (d, axis)
        for coords in itertools.product(*(range(g) for g in dims)):
            pieces = [a[t.local_slices(coords)] for a, t in zip(arrays, targets)]
            np.testing.assert_array_equal(np.concatenate(pieces, axis), whole[result.local_slices(coords)])
        if split[axis] is None:
            assert targets[0] == layouts[0], "the first input keeps its layout along an undivided dim"


def test_join_layouts_errors() -> None:
    a = Layout((4, 3), (2,), (0, None))
    with pytest.raises(ValueError, match="along dimension 1, the tensor at index 0 has size 3 and the tensor at"):
        join_layouts([a, Layout((4, 2), (2,), (0, None))], 0)
    with pytest.raises(ValueError, match=r"index 1 has split=\(None, 0\).*redistribute\(tensors\[0\].split\)"):
        join_layouts([a, Layout((4, 3), (2,), (None, 0))], 0)
    with pytest.raises(ValueError, match="same number of dimensions"):
        join_layouts([a, Layout((4,), (2,), (0,))], 0)
    with pytest.raises(ValueError, match="grid of dims"):
        join_layouts([a, Layout((4, 3), (1,), (0, None))], 0)
    with pytest.raises(ValueError, match="out of range"):
        join_layouts([a], 2)


# ---------------------------------------------------------------------------- against numpy
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_concatenate_equals_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    """Different lengths (one empty) along a divided and an undivided dim, inputs cut unevenly by slicing."""
    for split, axis in itertools.product(SPLITS, (0, -1)):
        a, b, c = _global((7, 5), 0), _global((7, 5), 100), _global((7, 5), -50)
        x, y, z = (_dist(grid2d, m, split, backend) for m in (a, b, c))
        empty = np.s_[:0] if axis == 0 else np.s_[:, :0]
        third = np.s_[2:, 1:] if axis == 0 else np.s_[:-1, 2:]  # (the sliced inputs match off axis)
        cases = {
            "lengths": ([x, y[empty], z], [a, b[empty], c]),
            "sliced": ([x[1:, 1:], y[:-1, :-1], z[third]], [a[1:, 1:], b[:-1, :-1], c[third]]),
            "one": ([x[2:]], [a[2:]]),
        }
        for what, (tensors, arrays) in cases.items():
            got = hpctp.concatenate(tensors, axis=axis)
            want = np.concatenate(arrays, axis=axis)
            ok = got.split == split and got.backend == backend
            assert_all(grid2d, ok, f"{what}: split {got.split}, backend {got.backend}")
            assert_equal(grid2d, _numpy(got.gather(None)), want, f"{what} split={split} axis={axis}")


@pytest.mark.mpi
def test_joining_along_an_undivided_dim_sends_nothing(grid1d: hpctp.ProcessGrid) -> None:
    a, b = _global((5, 7), 0), _global((3, 7), 1)
    x, y = _dist(grid1d, a, (None, 0)), _dist(grid1d, b, (None, 0))
    with hpctp.CommCounter() as c:
        got = hpctp.concatenate([x, y])
        stacked = hpctp.stack([x, x * 2], axis=-1)
    assert_all(grid1d, not c.calls and c.bytes_sent == 0, f"no messages: {c}")
    assert_all(grid1d, not np.shares_memory(got.local, x.local), "the result is new memory")
    assert_equal(grid1d, got.gather(None), np.concatenate([a, b]))
    assert_equal(grid1d, stacked.gather(None), np.stack([a, a * 2], axis=-1))
    assert_all(grid1d, stacked.split == (None, 0, None), str(stacked.layout))


@pytest.mark.mpi
def test_stack_and_numpy_dispatch(grid2d: hpctp.ProcessGrid) -> None:
    a, b = _global((6, 5), 0), _global((6, 5), 9)
    x, y = _dist(grid2d, a, (0, 1)), _dist(grid2d, b, (0, 1))
    for axis in (0, 1, -1, -3):
        got = np.stack([x, y], axis=axis)
        assert_equal(grid2d, got.gather(None), np.stack([a, b], axis=axis), f"axis={axis}")
    # inputs cut differently (the second moves into the first's cuts)
    got = hpctp.stack((x[1:, :-1], y[:-1, 1:]), axis=1)
    assert_equal(grid2d, got.gather(None), np.stack([a[1:, :-1], b[:-1, 1:]], axis=1))
    assert_all(grid2d, got.layout.dim_cuts[0] == x[1:, :-1].layout.dim_cuts[0], str(got.layout))
    # 0-d tensors stack into a 1-d one; dtypes promote as numpy's
    assert_equal(grid2d, hpctp.stack([x.sum(), y.max()]).gather(None), np.array([a.sum(), b.max()]))
    ints = _dist(grid2d, np.arange(10).reshape(2, 5), (0, 1))
    assert_equal(
        grid2d, np.concatenate((ints, x), axis=0).gather(None), np.concatenate([np.arange(10).reshape(2, 5), a])
    )
    assert_equal(grid2d, np.concatenate([x, y], 1).gather(None), np.concatenate([a, b], 1))


# ---------------------------------------------------------------------------- autograd
@pytest.mark.mpi
def test_concatenate_gradient(grid2d: hpctp.ProcessGrid) -> None:
    """d/dX sum(W * concatenate(...)) on the blocks equals torch's on the gathered tensors."""
    a, b = torch.from_numpy(_global((7, 5), 0)), torch.from_numpy(_global((4, 5), 3))
    for axis, stacked in ((0, False), (1, False), (-1, True)):
        x, y = _dist(grid2d, a.numpy(), (0, 1), "torch"), _dist(grid2d, b.numpy()[:, :4], (0, 1), "torch")
        x.local.requires_grad_(True)
        y.local.requires_grad_(True)
        parts = [x[1:, 1:], y] if axis == 0 else [x[3:, :-1], y, x[:4, 1:]]
        ref_x, ref_y = a.clone().requires_grad_(True), b[:, :4].clone().requires_grad_(True)
        refs = [ref_x[1:, 1:], ref_y] if axis == 0 else [ref_x[3:, :-1], ref_y, ref_x[:4, 1:]]
        z = hpctp.stack(parts, axis) if stacked else hpctp.concatenate(parts, axis)
        ref = torch.stack(refs, axis) if stacked else torch.cat(refs, axis)
        w = torch.cos(torch.arange(ref.numel(), dtype=torch.float64)).reshape(ref.shape)
        (z.local * w[z.local_slices]).sum().backward()
        (ref * w).sum().backward()
        for t, r in ((x, ref_x), (y, ref_y)):
            assert_allclose(grid2d, t.local.grad, r.grad[t.local_slices], rtol=1e-12, atol=0, what=f"axis={axis}")
    # an input without grad (another rank agreeing) is moved without autograd
    x = _dist(grid2d, a.numpy(), (0, 1), "torch")
    x.local.requires_grad_(True)
    z = hpctp.concatenate([_dist(grid2d, b.numpy(), (0, 1), "torch"), x])
    (z.local * 2).sum().backward()
    assert_equal(grid2d, x.local.grad, torch.full(tuple(x.local.shape), 2.0, dtype=torch.float64))


# ---------------------------------------------------------------------------- errors
@pytest.mark.mpi
def test_errors_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    a = _global((4, 3), 0)
    x, y = _dist(grid2d, a, (0, 1)), _dist(grid2d, a[:, :2].copy(), (0, 1))
    with pytest.raises(
        ValueError, match="along dimension 1, the tensor at index 0 has size 3 and the tensor at index 1"
    ):
        hpctp.concatenate([x, y])
    with pytest.raises(ValueError, match=r"split=\(1, 0\) but the tensor at index 0 has split=\(0, 1\)"):
        hpctp.concatenate([x, x.redistribute((1, 0))], axis=1)
    with pytest.raises(ValueError, match="same number of dimensions"):
        hpctp.concatenate([x, x[0]])
    with pytest.raises(ValueError, match="zero-dimensional arrays cannot be concatenated"):
        hpctp.concatenate([x.sum(), x.sum()])
    with pytest.raises(ValueError, match="need at least one array to concatenate"):
        hpctp.concatenate([])
    with pytest.raises(ValueError, match="need at least one array to stack"):
        hpctp.stack(())
    with pytest.raises(ValueError, match="all input arrays must have the same shape"):
        np.stack([x, y])
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        np.concatenate([x, x], axis=2)
    with pytest.raises(ValueError, match="axis=None"):
        np.concatenate([x, x], axis=None)
    with pytest.raises(TypeError, match="int axis"):
        hpctp.stack([x, x], axis=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="index 1 is a ndarray.*hpctp.distribute"):
        np.concatenate([x, a])
    with pytest.raises(TypeError, match="got one DistTensor"):
        hpctp.concatenate(x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="no out=, dtype="):
        np.concatenate([x, x], dtype=np.float32)
    with pytest.raises(TypeError, match="one backend.*torch"):
        hpctp.concatenate([x, x.to("torch")])
    other = hpctp.ProcessGrid(grid2d.dims)
    try:
        with pytest.raises(ValueError, match="same ProcessGrid"):
            hpctp.stack([x, _dist(other, a, (0, 1))])
    finally:
        other.free()
