"""DistTensor against numpy on the gathered tensor, on every grid of the current size."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from helpers.checks import Checks
from helpers.layouts import make_layout

import hpctp
from hpctp.comm import CommCounter
from hpctp.layout import Layout
from hpctp.tensor.random import block_normal, block_uniform
from hpctp.testing import assert_all, assert_allclose, assert_equal


def _splits(ndim: int, grid_ndim: int) -> list[tuple[int | None, ...]]:
    """Every way to assign distinct grid axes (or None) to the tensor dims."""
    out = []
    for combo in itertools.product([None, *range(grid_ndim)], repeat=ndim):
        used = [g for g in combo if g is not None]
        if len(used) == len(set(used)):
            out.append(combo)
    return out


def _global(shape: tuple[int, ...], dtype: str = "float64") -> np.ndarray:
    n = int(np.prod(shape))
    return (np.arange(n, dtype=np.float64) * 1.25 - 3.0).astype(dtype).reshape(shape)


SHAPES_2D = [(7, 5), (1, 4), (3, 1), (0, 3), (10, 2)]


@pytest.mark.mpi
def test_distribute_gather_roundtrip_1d(grid1d: hpctp.ProcessGrid) -> None:
    for n in (10, 3, 1, 0, 17):
        a = _global((n,))
        x = hpctp.distribute(a if grid1d.rank == 0 else None, grid1d, (0,))
        start, stop = hpctp.block_range(n, grid1d.size, grid1d.rank)
        assert_equal(grid1d, x.local, a[start:stop], f"local block of n={n}")
        got = x.gather(root=0)
        assert_all(grid1d, (got is None) == (grid1d.rank != 0), "only root gets the gather")
        if grid1d.rank == 0:
            np.testing.assert_array_equal(got, a)
        assert_equal(grid1d, x.gather(root=None), a)


@pytest.mark.mpi
def test_distribute_gather_roundtrip_2d_all_splits(grid2d: hpctp.ProcessGrid) -> None:
    root = grid2d.size - 1
    for shape in SHAPES_2D:
        a = _global(shape)
        for split in _splits(2, 2):
            x = hpctp.distribute(a if grid2d.rank == root else None, grid2d, split, root=root)
            assert_equal(grid2d, x.local, a[x.local_slices], f"{shape} split={split}")
            assert_equal(grid2d, x.gather(root=None), a, f"{shape} split={split}")


@pytest.mark.mpi
def test_distribute_gather_roundtrip_3d(grid3d: hpctp.ProcessGrid) -> None:
    a = _global((5, 4, 3))
    for split in [(0, 1, 2), (2, 0, 1), (None, 2, 0), (1, None, None), (None, None, None)]:
        x = hpctp.distribute(a if grid3d.rank == 0 else None, grid3d, split)
        assert_equal(grid3d, x.gather(root=None), a, f"split={split}")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "int64", "complex128", "bool", "uint8"])
def test_roundtrip_dtypes_numpy(grid2d: hpctp.ProcessGrid, dtype: str) -> None:
    a = _global((6, 5), "float64")
    a = (
        (a + 1j * a).astype(dtype)
        if dtype.startswith("complex")
        else (a > 2).astype(dtype)
        if dtype == "bool"
        else a.astype(dtype)
    )
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (1, 0))
    assert_equal(grid2d, str(x.dtype), dtype)
    assert_equal(grid2d, x.gather(None), a)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int32, torch.bfloat16])
def test_roundtrip_torch(grid2d: hpctp.ProcessGrid, dtype: torch.dtype) -> None:
    a = torch.arange(35, dtype=torch.float64).reshape(7, 5).to(dtype)
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, 1))
    assert_all(grid2d, isinstance(x.local, torch.Tensor) and x.local.dtype == dtype, "torch blocks keep dtype")
    got = x.gather(None)
    assert_all(grid2d, isinstance(got, torch.Tensor) and bool(torch.equal(got, a)), "torch round trip")
    y = x.redistribute((1, None)).gather(None)
    assert_all(grid2d, bool(torch.equal(y, a)), "torch redistribute")


@pytest.mark.mpi
def test_redistribute_all_pairs_2d(grid2d: hpctp.ProcessGrid) -> None:
    for shape in [(7, 5), (2, 9)]:
        a = _global(shape)
        splits = _splits(2, 2)
        for src, dst in itertools.product(splits, splits):
            x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, src)
            y = x.redistribute(dst)
            assert_equal(grid2d, y.split, dst)
            assert_equal(grid2d, y.local, a[y.local_slices], f"{shape}: {src} -> {dst}")


@pytest.mark.mpi
def test_redistribute_3d(grid3d: hpctp.ProcessGrid) -> None:
    a = _global((4, 5, 3))
    splits = [(0, 1, 2), (2, 1, 0), (None, 0, None), (1, None, 2), (None, None, None)]
    for src, dst in itertools.product(splits, splits):
        x = hpctp.distribute(a if grid3d.rank == 0 else None, grid3d, src)
        assert_equal(
            grid3d, x.redistribute(dst).local, a[Layout(a.shape, grid3d.dims, dst).local_slices(grid3d.coords)]
        )


@pytest.mark.mpi
def test_redistribute_onto_another_grid_shape(grid3d: hpctp.ProcessGrid) -> None:
    """The same ranks on every other grid shape: skewed, replicated and empty blocks move exactly."""
    a = _global((5, 4, 3))
    size = grid3d.size
    for src in [(0, 1, 2), (None, 2, 0), (1, None, None)]:
        lay = make_layout(grid3d, a.shape, src, skew=True)
        x = hpctp.DistTensor(a[lay.local_slices(grid3d.coords)].copy(), grid3d, lay)
        for dims in hpctp.testing.grid_shapes(size, 1) + hpctp.testing.grid_shapes(size, 2):
            with hpctp.ProcessGrid(dims) as other:
                for dst in [(0, None, None), (None, None, 0), (None, None, None)] + (
                    [(1, 0, None)] if len(dims) > 1 else []
                ):
                    y = x.redistribute(dst, grid=other)
                    ok = y.grid is other and y.split == dst
                    assert_all(grid3d, ok, f"{src} on {grid3d.dims} -> {dst} on {dims}: grid/split {y.split}")
                    assert_equal(grid3d, y.local, a[y.local_slices], f"{src} on {grid3d.dims} -> {dst} on {dims}")
                    back = y.redistribute(lay, grid=grid3d)
                    assert_equal(grid3d, back.local, x.local, f"{dst} on {dims} -> back to {lay}")


@pytest.mark.mpi
def test_redistribute_onto_another_grid_refuses_other_ranks(world: object) -> None:
    from mpi4py import MPI

    assert isinstance(world, MPI.Intracomm)
    size = world.Get_size()
    with hpctp.ProcessGrid((size,)) as grid:
        x = hpctp.zeros((4, 3), grid, (0, None))
        with pytest.raises(TypeError, match="grid must be a hpctp.ProcessGrid"):
            x.redistribute((0, None), grid="world")  # type: ignore[arg-type]
        with hpctp.ProcessGrid((1, size)) as wide:
            with pytest.raises(ValueError, match="split=.* has 1 entries|out of range"):
                x.redistribute((None, 2), grid=wide)
            with pytest.raises(ValueError, match="grid dims be"):
                x.redistribute(Layout((4, 3), (size,), (0, None)), grid=wide)
        if size > 1:
            reverse = world.Split(0, size - 1 - world.Get_rank())
            try:
                with hpctp.ProcessGrid((size,), comm=reverse) as backwards:
                    with pytest.raises(ValueError, match="does not hold the same ranks in the same order"):
                        x.redistribute((0, None), grid=backwards)
            finally:
                reverse.Free()


@pytest.mark.mpi
def test_redistribute_sends_only_what_changes_owner(grid2d: hpctp.ProcessGrid) -> None:
    a = _global((9, 7))
    for src, dst in [((0, 1), (1, 0)), ((0, None), (None, 1)), ((None, None), (0, 1)), ((0, 1), (None, None))]:
        x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, src)
        with CommCounter() as c:
            y = x.redistribute(dst)
        held = np.zeros(a.shape, dtype=bool)
        held[x.local_slices] = True
        need = int((~held[y.local_slices]).sum()) * a.itemsize
        assert_equal(grid2d, c.bytes_recv, need, f"{src}->{dst}: bytes received = bytes changing owner")
        total = np.array([c.bytes_sent, c.bytes_recv])
        grid2d.comm.Allreduce(hpctp.comm.collectives.MPI.IN_PLACE, total)
        assert_equal(grid2d, total[0], total[1], "bytes sent and received balance")
        assert_all(grid2d, c.calls.get("Alltoallv", 0) == 1 and "Gatherv" not in c.calls, "one all-to-all, no gather")


@pytest.mark.mpi
def test_from_local_balanced_and_uneven(grid2d: hpctp.ProcessGrid) -> None:
    pr, pc = grid2d.dims
    r, c = grid2d.coords
    # simulation-style uneven decomposition: block (r, c) has r+2 rows and c+1 columns
    rows = [i + 2 for i in range(pr)]
    cols = [j + 1 for j in range(pc)]
    shape = (sum(rows), sum(cols))
    a = _global(shape)
    r0, c0 = sum(rows[:r]), sum(cols[:c])
    block = a[r0 : r0 + rows[r], c0 : c0 + cols[c]].copy()
    x = hpctp.from_local(block, grid2d, (0, 1))
    assert_equal(grid2d, x.global_shape, shape)
    assert_all(grid2d, x.local is block, "from_local wraps without copying")
    assert_equal(grid2d, x.gather(None), a)
    assert_equal(grid2d, x.redistribute((1, 0)).gather(None), a, "uneven source redistributes")
    assert_allclose(grid2d, float(x.sum()), a.sum())
    y = hpctp.from_local(torch.from_numpy(block), grid2d, (0, 1), global_shape=shape)
    assert_equal(grid2d, y.gather(None).numpy(), a)


@pytest.mark.mpi
def test_from_local_validation(grid2d: hpctp.ProcessGrid) -> None:
    r, c = grid2d.coords
    with pytest.raises(ValueError, match="global_shape"):
        hpctp.from_local(np.zeros((2, 3)), grid2d, (0, 1), global_shape=(1, 1))
    if grid2d.dims[1] > 1:  # sizes in dim 0 differ between ranks of one grid row: no tiling
        with pytest.raises(ValueError, match="do not tile"):
            hpctp.from_local(np.zeros((2 + c, 3)), grid2d, (0, 1))
    if grid2d.size > 1:
        with pytest.raises(ValueError, match="not split"):
            hpctp.from_local(np.zeros((2, 3 + grid2d.rank)), grid2d, (0, None))
        with pytest.raises(ValueError, match="dtypes"):
            hpctp.from_local(np.zeros((2, 3), dtype="float32" if grid2d.rank else "float64"), grid2d, (0, 1))
        with pytest.raises(TypeError, match="numpy.ndarray"):
            hpctp.from_local([1.0] if grid2d.rank == 1 else np.zeros((1,)), grid2d, (0,) if False else None)  # type: ignore[arg-type]
        mixed = np.zeros((2, 3)) if grid2d.rank else torch.zeros((2, 3), dtype=torch.float64)
        with pytest.raises(ValueError, match=r"different backends \(numpy on ranks \[1.*torch on ranks \[0\]"):
            hpctp.from_local(mixed, grid2d, (0, 1))
    with pytest.raises(ValueError, match="more than one"):
        hpctp.from_local(np.zeros((2, 3)), grid2d, (0, 0))


@pytest.mark.mpi
def test_fromfunction_equals_numpy(grid3d: hpctp.ProcessGrid) -> None:
    """Each rank evaluates its own block: the same tensor as numpy.fromfunction on any grid."""
    shape = (5, 4, 3)  # (6 ranks on one axis leave empty blocks)
    f = lambda i, j, k: np.sin(i) + 10 * j - k / 3  # noqa: E731
    want = np.fromfunction(f, shape)
    for split in [(0, 1, 2), (2, None, 0), (None, None, None)]:
        x = hpctp.fromfunction(f, shape, grid3d, split)
        assert_allclose(grid3d, x.gather(None), want, rtol=1e-15, atol=0, what=f"split={split}")
        assert_all(grid3d, x.split == split, str(x.layout))
    t = hpctp.fromfunction(
        lambda i, j, k: torch.cos(i) * j + k, shape, grid3d, (1, 0, 2), dtype="float32", like="torch"
    )
    ref = np.fromfunction(lambda i, j, k: np.cos(i) * j + k, shape, dtype=np.float32)
    assert_all(grid3d, t.backend == "torch" and t.dtype == torch.float32, repr(t))
    assert_allclose(grid3d, t.gather(None), ref, rtol=1e-6, what="torch float32")
    n = hpctp.fromfunction(lambda i, j, k: 100 * i + 10 * j + k, shape, grid3d, (0, 1, 2), dtype="int64")
    assert_equal(grid3d, n.gather(None), np.fromfunction(lambda i, j, k: 100 * i + 10 * j + k, shape, dtype=np.int64))
    assert_equal(
        grid3d, hpctp.fromfunction(lambda i, j, k: 2.5, shape, grid3d, (0, 1, 2)).gather(None), np.full(shape, 2.5)
    )
    with pytest.raises(TypeError, match="returned a torch array for numpy blocks"):
        hpctp.fromfunction(lambda i, j, k: torch.zeros(1), shape, grid3d, (0, 1, 2))
    with pytest.raises(ValueError, match=r"returned shape \(7,\), which does not broadcast"):
        hpctp.fromfunction(lambda i, j, k: np.zeros(7), shape, grid3d, (0, 1, 2))
    with pytest.raises(TypeError, match="needs a callable"):
        hpctp.fromfunction(3.0, shape, grid3d)  # type: ignore[arg-type]


@pytest.mark.mpi
def test_reductions_match_numpy(grid2d: hpctp.ProcessGrid) -> None:
    with Checks(grid2d) as check:
        for shape in [(7, 5), (3, 2), (1, 6)]:
            a = _global(shape) ** 2 % 7.3 - 2.0
            for split in [(0, 1), (1, 0), (None, 0), (1, None), (None, None)]:
                x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, split)
                for axis in [None, 0, 1, (0, 1), -1]:
                    for keepdims in (False, True):
                        for name in ("sum", "mean", "max", "min"):
                            r = getattr(x, name)(axis=axis, keepdims=keepdims)
                            ref = getattr(np, name)(a, axis=axis, keepdims=keepdims)
                            what = f"{name}{shape} split={split} axis={axis} keepdims={keepdims}"
                            check.equal(r.global_shape, np.shape(ref), what)
                            check.allclose(r.gather(None), ref, rtol=1e-12, atol=1e-13, what=what)
                check.allclose(float(x.norm()), np.linalg.norm(a), rtol=1e-12)


@pytest.mark.mpi
def test_reduction_result_layout(grid2d: hpctp.ProcessGrid) -> None:
    x = hpctp.ones((6, 4), grid2d, (0, 1))
    s0 = x.sum(axis=0)
    assert_equal(grid2d, (s0.split, s0.global_shape), ((1,), (4,)), "columns stay split over grid axis 1")
    s1 = x.sum(axis=1, keepdims=True)
    assert_equal(grid2d, (s1.split, s1.global_shape), ((0, None), (6, 1)))
    assert_equal(grid2d, x.sum().split, ())


@pytest.mark.mpi
def test_reductions_torch_and_integers(grid2d: hpctp.ProcessGrid) -> None:
    a = torch.arange(30, dtype=torch.float64).reshape(5, 6).sin()
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, 1))
    assert_allclose(grid2d, x.sum(1).gather(None).numpy(), a.sum(1).numpy())
    assert_allclose(grid2d, x.max(0).gather(None).numpy(), a.amax(0).numpy())
    assert_allclose(grid2d, float(x.mean()), float(a.mean()))
    i = hpctp.distribute(np.arange(12).reshape(3, 4) if grid2d.rank == 0 else None, grid2d, (1, 0))
    assert_equal(grid2d, int(i.sum()), 66)
    assert_allclose(grid2d, float(i.mean()), 5.5)
    assert_equal(grid2d, int(i.min()), 0)


@pytest.mark.mpi
def test_reductions_of_bool_int_and_complex(grid2d: hpctp.ProcessGrid) -> None:
    """bool max/min over ranks (MPI has no MAX for booleans), norm of ints without overflow,
    complex max refused on every rank, numpy integer axes."""
    flags = np.zeros((5, 4), dtype=bool)
    flags[4, 3] = True  # on the last rank of a split grid only
    for like in ("numpy", "torch"):
        b = hpctp.distribute(flags if grid2d.rank == 0 else None, grid2d, (0, 1))
        b = b if like == "numpy" else b.to("torch")
        assert_equal(grid2d, bool(b.max()), True, f"{like} bool max")
        assert_equal(grid2d, bool(b.min()), False, f"{like} bool min")
        assert_equal(grid2d, np.asarray(b.max(axis=0).gather(root=None)), flags.max(axis=0), f"{like} bool max axis 0")
    big = np.array([[12, 13], [14, 100], [50, 70]], dtype=np.int8)  # squares overflow int8
    x = hpctp.distribute(big if grid2d.rank == 0 else None, grid2d, (0, 1))
    assert_allclose(grid2d, float(x.norm()), np.linalg.norm(big.astype(np.float64)), rtol=1e-14, what="int8 norm")
    assert_allclose(grid2d, float(x.to("torch").norm()), np.linalg.norm(big.astype(np.float64)), rtol=1e-14)
    a = _global((5, 3))
    y = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, 1))
    assert_allclose(grid2d, y.sum(axis=np.int64(0)).gather(root=None), a.sum(axis=0), rtol=1e-14)
    with pytest.raises(ValueError, match="single-element"):  # as numpy: not always true
        bool(y)
    with pytest.raises(ValueError, match="root=True"):  # not taken as rank 1
        y.gather(root=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must hold ints"):  # not truncated to 3
        hpctp.zeros((3.5,), grid2d, None)  # type: ignore[arg-type]
    z = hpctp.distribute((a + 1j) if grid2d.rank == 0 else None, grid2d, (0, 1))
    with pytest.raises(TypeError, match="max of a complex tensor"):
        z.max()


@pytest.mark.mpi
def test_zero_d_broadcasts_on_both_sides_and_foreign_byte_order(grid2d: hpctp.ProcessGrid) -> None:
    a = _global((5, 3))
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, 1))
    s = x.sum()
    for got, want, what in [
        (x * s, a * a.sum(), "x * s"),
        (s * x, a.sum() * a, "s * x"),
        (s - x, a.sum() - a, "s - x"),
    ]:
        assert_allclose(grid2d, got.gather(root=None), want, rtol=1e-14, what=what)
    be = hpctp.distribute(a.astype(">f8") if grid2d.rank == 0 else None, grid2d, (0, 1))  # e.g. read from a file
    assert_all(grid2d, be.local.dtype == np.float64 and be.local.dtype.isnative, f"block dtype {be.local.dtype}")
    assert_equal(grid2d, be.local, a[be.local_slices], "big-endian array scattered")
    assert_allclose(grid2d, float(be.sum()), a.sum(), rtol=1e-14)


@pytest.mark.mpi
def test_zero_d_tensors_stay_zero_d(grid2d: hpctp.ProcessGrid) -> None:
    """numpy's ascontiguousarray makes 0-d arrays 1-d: random, .to() and reductions keep shape ()."""
    z = hpctp.random.normal((), grid2d, None, seed=3)
    assert_equal(grid2d, z.gather(None), block_normal((), [], 3))
    t = hpctp.random.uniform((), grid2d, (), seed=3, like="torch", dtype=torch.float32)
    assert_equal(grid2d, t.gather(None).numpy(), block_uniform((), [], 3).astype(np.float32))
    for like in ("torch", "numpy"):
        y = (z.to(like) * 2).to("torch").to(like)
        assert_equal(grid2d, tuple(y.local.shape), (), f"{like}: .to() of a 0-d block")
        assert_allclose(grid2d, y.item(), 2 * z.item(), rtol=1e-15, what=like)
    x = hpctp.distribute(_global((3, 2)) if grid2d.rank == 0 else None, grid2d, (0, 1)).to("torch")
    assert_equal(grid2d, tuple(x.sum().local.shape), (), "torch full reduction")


@pytest.mark.mpi
def test_torch_blocks_with_any_strides_of_size_0_and_1_dims(grid2d: hpctp.ProcessGrid) -> None:
    """Contiguous torch tensors whose size-0/1 dims carry odd strides (a transposed row, an
    empty tensor from numpy) move through distribute, redistribute and gather."""
    for t in (torch.arange(2.0, dtype=torch.float64).reshape(1, 2).T, torch.from_numpy(np.zeros((0, 3)))):
        x = hpctp.distribute(t if grid2d.rank == 0 else None, grid2d, (0, None))
        assert_equal(grid2d, x.gather(root=None).numpy(), t.numpy(), f"distribute {tuple(t.shape)}")
        assert_equal(grid2d, x.redistribute((None, 0)).gather(root=None).numpy(), t.numpy(), "redistribute")


@pytest.mark.mpi
def test_elementwise(grid2d: hpctp.ProcessGrid) -> None:
    a, b = _global((5, 4)), _global((5, 4)) ** 2 + 1.0
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, 1))
    y = hpctp.distribute(b if grid2d.rank == 0 else None, grid2d, (0, 1))
    cases = {
        "x+y": (x + y, a + b), "x-y": (x - y, a - b), "x*y": (x * y, a * b), "x/y": (x / y, a / b),
        "2+x": (2 + x, 2 + a), "2-x": (2 - x, 2 - a), "x*3": (x * 3, a * 3), "1/y": (1 / y, 1 / b),
        "x**2": (x**2, a**2), "-x": (-x, -a), "abs": (abs(x), abs(a)), "np.float": (np.float64(2) * x, 2 * a),
        "x*sum": (x * x.sum(), a * a.sum()), "2**x": (2**x, 2**a), "x//y": (x // y, a // b),
        "x%y": (x % y, a % b), "7//x": (7 // x, 7 // a), "7%y": (7 % y, 7 % b),
    }  # fmt: skip
    for name, (got, ref) in cases.items():
        assert_allclose(grid2d, got.gather(None), ref, rtol=1e-14, what=name)


@pytest.mark.mpi
def test_comparisons_give_boolean_tensors(grid2d: hpctp.ProcessGrid) -> None:
    a = _global((5, 4))
    b = np.where(np.arange(20).reshape(5, 4) % 3 == 0, a, -a)
    for like in ("numpy", "torch"):
        x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, 1)).to(like)
        y = hpctp.distribute(b if grid2d.rank == 0 else None, grid2d, (0, 1)).to(like)
        cases = {
            "x<y": (x < y, a < b), "x<=y": (x <= y, a <= b), "x>y": (x > y, a > b), "x>=y": (x >= y, a >= b),
            "x==y": (x == y, a == b), "x!=y": (x != y, a != b), "x<0": (x < 0, a < 0), "0<x": (0 < x, 0 < a),
            "np.float==x": (np.float64(-0.5) == x, a == -0.5), "x>sum": (x > x.sum() / 40, a > a.sum() / 40),
            "sum>=x": (x.sum() / 40 >= x, a.sum() / 40 >= a),
        }  # fmt: skip
        for name, (got, ref) in cases.items():
            assert_equal(grid2d, got.gather(None), ref, what=f"{like} {name}")  # strict: bool dtype too
            assert_all(grid2d, got.layout == x.layout, f"{like} {name}: layout {got.layout}")
        assert_all(grid2d, (x == None) is False and (x != "a") is True, "non-numbers compare by identity")  # noqa: E711
        with pytest.raises(TypeError, match="not supported"):
            _ = x < "a"  # type: ignore[operator]
        with pytest.raises(TypeError, match="unhashable"):
            hash(x)


@pytest.mark.mpi
def test_bad_input_raises_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    x = hpctp.zeros((4, 4), grid2d, (0, 1))
    y = hpctp.zeros((4, 4), grid2d, (1, 0))
    with pytest.raises(ValueError, match="same layout"):
        x + y
    with pytest.raises(TypeError, match="unsupported operand"):
        x + "a"  # type: ignore[operator]
    with pytest.raises(TypeError, match=r"one backend, got numpy and torch; convert one with .to\('numpy'\)"):
        x + x.to("torch")
    with pytest.raises(TypeError, match="one backend"):
        x.sum().to("torch") * x
    with pytest.raises(ValueError, match="out of range"):
        hpctp.distribute(np.zeros((4, 4)) if grid2d.rank == 0 else None, grid2d, (0, 2))
    with pytest.raises(ValueError, match="more than one tensor dim"):
        x.redistribute((1, 1))
    with pytest.raises(TypeError, match="root rank"):
        hpctp.distribute(None, grid2d, (0, 1))
    with pytest.raises(ValueError, match="root"):
        hpctp.distribute(None, grid2d, (0, 1), root=grid2d.size)
    with pytest.raises(ValueError, match="axis"):
        x.sum(axis=2)
    with hpctp.ProcessGrid(list(grid2d.dims)) as other:
        z = hpctp.zeros((4, 4), other, (0, 1))
        with pytest.raises(ValueError, match="same ProcessGrid"):
            x + z


@pytest.mark.mpi
def test_random_is_grid_independent(grid2d: hpctp.ProcessGrid) -> None:
    shape = (9, 7)
    whole = [(0, n) for n in shape]
    for split in [(0, 1), (1, None), (None, None)]:
        z = hpctp.random.normal(shape, grid2d, split, seed=42)
        assert_equal(grid2d, z.gather(None), block_normal(shape, whole, 42), f"normal split={split}")
        u = hpctp.random.uniform(shape, grid2d, split, seed=5, low=1.0, high=2.0)
        assert_equal(grid2d, u.gather(None), block_uniform(shape, whole, 5, 1.0, 2.0))
    t = hpctp.random.normal(shape, grid2d, (0, 1), seed=42, dtype=torch.float32, like="torch")
    assert_equal(grid2d, t.gather(None).numpy(), block_normal(shape, whole, 42).astype(np.float32))


@pytest.mark.mpi
def test_local_ops_do_not_communicate(grid2d: hpctp.ProcessGrid) -> None:
    with CommCounter() as c:
        x = hpctp.random.uniform((6, 6), grid2d, (0, 1), seed=1)
        y = (x * 2 + 1).astype("float32").to("torch").to("numpy")
        text = repr(y)
        hpctp.zeros((3,), grid2d, None)
    assert_all(grid2d, c.calls == {} and "split=(0, 1)" in text, f"local ops made MPI calls: {c.calls}")


@pytest.mark.mpi
@pytest.mark.parametrize(
    "case",
    ["distribute_split", "distribute_root", "distribute_bad_root", "from_local_split", "from_local_shape",
     "redistribute", "redistribute_bad", "sum_axis", "max_axis", "sum_bad_axis", "gather_root", "gather_bad_root"],
)  # fmt: skip
def test_argument_differing_on_one_rank_raises_everywhere(grid1d: hpctp.ProcessGrid, case: str) -> None:
    """One rank with another split, root or axis used to hang the others, or return uninitialised
    memory (distribute), different global shapes (from_local) or MPI errors (redistribute)."""
    g = grid1d
    odd = g.size > 1 and g.rank == g.size - 1  # on one rank nothing differs: the call must work
    a = np.arange(12.0).reshape(6, 2)
    x = hpctp.distribute(a if g.rank == 0 else None, g, (0, None))
    block = x.local
    calls = {
        "distribute_split": lambda: hpctp.distribute(a if g.rank == 0 else None, g, (None, 0) if odd else (0, None)),
        "distribute_root": lambda: hpctp.distribute(a, g, (0, None), root=1 if odd else 0),
        "distribute_bad_root": lambda: hpctp.distribute(a, g, (0, None), root=g.size if odd else 0),
        "from_local_split": lambda: hpctp.from_local(block, g, (None, None) if odd else (0, None)),
        "from_local_shape": lambda: hpctp.from_local(block, g, (0, None), (7, 2) if odd else (6, 2)),
        "redistribute": lambda: x.redistribute((None, 0) if odd else (None, None)),
        "redistribute_bad": lambda: x.redistribute((0, 0) if odd else (None, None)),
        "sum_axis": lambda: x.sum(axis=1 if odd else 0),
        "max_axis": lambda: x.max(axis=(0,) if odd else None),
        "sum_bad_axis": lambda: x.sum(axis=5 if odd else 0),
        "gather_root": lambda: x.gather(root=None if odd else 0),
        "gather_bad_root": lambda: x.gather(root=g.size if odd else 0),
    }
    if g.size == 1:
        if "bad" not in case:
            calls[case]()
        return
    with pytest.raises(
        ValueError, match=r"ranks passed different|out of range|must be a rank|more than one tensor dim"
    ):
        calls[case]()


def test_sum_of_0d_torch_ints_promotes_like_torch(grid1d: hpctp.ProcessGrid) -> None:
    for dtype in (torch.int32, torch.bool, torch.uint8):
        t = hpctp.from_local(torch.ones((), dtype=dtype), grid1d, ())
        got = t.sum().local
        assert got.dtype == torch.sum(torch.ones((), dtype=dtype)).dtype == torch.int64, (dtype, got.dtype)
        assert int(got) == 1


@pytest.mark.mpi
@pytest.mark.parametrize("like", ["torch-bfloat16", "torch-float16", "numpy-float16"])
def test_half_precision_reductions_round_once(grid2d: hpctp.ProcessGrid, like: str) -> None:
    """sum/mean/norm of 16-bit floats accumulate in float32 and round once: within half an ulp
    of the exact value (rounding each rank's partial sum first, as before, is off by more)."""
    backend, dtype = like.split("-")
    bits = 8 if dtype == "bfloat16" else 11  # significand bits
    gen = np.random.default_rng(3)
    a64 = gen.uniform(0.5, 1.5, (13, 11))
    ref = torch.from_numpy(a64).to(getattr(torch, dtype)) if backend == "torch" else a64.astype(dtype)
    exact_in = np.asarray(torch.as_tensor(ref).double())  # the 16-bit values, exactly, in float64
    x = hpctp.distribute(ref if grid2d.rank == 0 else None, grid2d, (0, 1))

    def half_ulps(got: object, exact: float) -> float:
        ulp = 2.0 ** (math.floor(math.log2(abs(exact))) - (bits - 1))
        return abs(float(np.asarray(torch.as_tensor(got).double())) - exact) / (ulp / 2)

    for what, got, exact in (
        ("sum", x.sum().local, exact_in.sum()),
        ("mean", x.mean().local, exact_in.mean()),
        ("norm", x.norm().local, float(np.sqrt((exact_in**2).sum()))),
    ):
        err = half_ulps(got, float(exact))
        assert_all(grid2d, err <= 1.0 + 1e-6, f"{like} {what}: {err:.2f} half-ulps from the exact value")
