"""SUMMA matmul: results against numpy on the gathered tensors, byte counts, validation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import hpctp
from hpctp import perf
from hpctp import random as hrandom
from hpctp.linalg import matmul, matmul_25d, summa_block
from hpctp.linalg.plan import default_panel, merge_pieces, plan_matmul, required_layouts, variant_for
from hpctp.testing import assert_all, assert_allclose, assert_equal

TRANSPOSES = list(itertools.product([False, True], repeat=2))
# (m, k, n): uneven, 1 x k, k smaller than the grid dims, 3 rows on up to 4 ranks, k = 0
SHAPES = [(7, 5, 9), (1, 6, 4), (5, 2, 3), (3, 1, 2), (4, 0, 3)]


def _operands(grid, m, k, n, ta=False, tb=False, split=(0, 1), dtype="float64", like="numpy"):  # type: ignore[no-untyped-def]
    a = hrandom.normal((k, m) if ta else (m, k), grid, split, seed=11, dtype=dtype, like=like)
    b = hrandom.normal((n, k) if tb else (k, n), grid, split, seed=12, dtype=dtype, like=like)
    return a, b


def _reference(a, b, ta, tb):  # type: ignore[no-untyped-def]
    A = np.asarray(hpctp.testing.as_numpy(a.gather(root=None)))
    B = np.asarray(hpctp.testing.as_numpy(b.gather(root=None)))
    return (A.T if ta else A) @ (B.T if tb else B)


# ----------------------------------------------------------------------------- correctness
@pytest.mark.mpi
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_matmul_matches_numpy_all_transposes(grid2d, shape):  # type: ignore[no-untyped-def]
    m, k, n = shape
    for ta, tb in TRANSPOSES:
        a, b = _operands(grid2d, m, k, n, ta, tb)
        c = matmul(a, b, transpose_a=ta, transpose_b=tb)
        assert_equal(grid2d, np.array(c.global_shape), np.array((m, n)), what="shape")
        assert_equal(grid2d, np.array(c.split), np.array((0, 1)), what="C split")
        assert_allclose(grid2d, c.gather(root=None), _reference(a, b, ta, tb), rtol=1e-12, atol=1e-13,
                        what=f"{shape} transpose_a={ta} transpose_b={tb}")  # fmt: skip


@pytest.mark.mpi
@pytest.mark.parametrize("panel", [1, 3])
def test_panel_widths(grid2d, panel):  # type: ignore[no-untyped-def]
    for ta, tb in TRANSPOSES:
        a, b = _operands(grid2d, 7, 5, 9, ta, tb)
        c = matmul(a, b, panel=panel, transpose_a=ta, transpose_b=tb)
        assert_allclose(grid2d, c.gather(root=None), _reference(a, b, ta, tb), rtol=1e-12, atol=1e-13,
                        what=f"panel={panel} {ta} {tb}")  # fmt: skip


@pytest.mark.mpi
def test_operator_and_square(grid2d):  # type: ignore[no-untyped-def]
    a = hrandom.normal((6, 6), grid2d, (0, 1), seed=1)
    b = hrandom.uniform((6, 6), grid2d, (0, 1), seed=2)
    c = a @ b
    assert_allclose(grid2d, c.gather(root=None), _reference(a, b, False, False), rtol=1e-12)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "split_a,split_b",
    [((None, None), (0, None)), ((None, 1), (1, None)), ((1, 0), (1, 0)), ((1, 0), (0, 1)), ((0, 1), (1, 0))],
)
def test_other_layouts(grid2d, split_a, split_b):  # type: ignore[no-untyped-def]
    for ta, tb in TRANSPOSES:
        a = hrandom.normal((7, 5) if not ta else (5, 7), grid2d, split_a, seed=3)
        b = hrandom.normal((5, 4) if not tb else (4, 5), grid2d, split_b, seed=4)
        c = matmul(a, b, transpose_a=ta, transpose_b=tb)
        assert_allclose(grid2d, c.gather(root=None), _reference(a, b, ta, tb), rtol=1e-12, atol=1e-13,
                        what=f"{split_a} {split_b} {ta} {tb}")  # fmt: skip


@pytest.mark.mpi
def test_custom_cuts_from_local(grid2d):  # type: ignore[no-untyped-def]
    """Uneven blocks from a simulation (from_local), incl. an empty one, in every variant."""
    pr, pc = grid2d.dims
    i, j = grid2d.coords
    rows = [2 + 3 * r for r in range(pr)]
    rows[-1] = 0 if pr > 1 else rows[-1]
    cols = [1 + c for c in range(pc)]
    block_a = np.arange(rows[i] * cols[j], dtype=np.float64).reshape(rows[i], cols[j]) + 10 * grid2d.rank
    a = hpctp.from_local(block_a, grid2d, (0, 1))
    b = hrandom.normal((a.global_shape[1], 5), grid2d, (0, 1), seed=7)
    c = matmul(a, b)
    assert_allclose(grid2d, c.gather(root=None), _reference(a, b, False, False), rtol=1e-12, atol=1e-12)
    d = matmul(a, b.redistribute((1, 0)))
    assert_allclose(grid2d, d.gather(root=None), _reference(a, b, False, False), rtol=1e-12, atol=1e-12)
    e = matmul(a, a, transpose_a=True)  # a.T @ a: stationary B needs equal k (row) cuts: fine, same tensor
    assert_allclose(grid2d, e.gather(root=None), _reference(a, a, True, False), rtol=1e-12, atol=1e-12)
    x = hrandom.normal((4, a.global_shape[1]), grid2d, (0, 1), seed=8)
    f = matmul(a, x, transpose_b=True)  # stationary A needs equal k cuts: a is rebalanced first
    assert_allclose(grid2d, f.gather(root=None), _reference(a, x, False, True), rtol=1e-12, atol=1e-12)


@pytest.mark.mpi
def test_float32(grid2d):  # type: ignore[no-untyped-def]
    for ta, tb in TRANSPOSES:
        a, b = _operands(grid2d, 9, 7, 5, ta, tb, dtype="float32")
        c = matmul(a, b, transpose_a=ta, transpose_b=tb, panel=2)
        assert_all(grid2d, c.local.dtype == np.float32, f"dtype {c.local.dtype}")
        assert_allclose(grid2d, c.gather(root=None), _reference(a, b, ta, tb), rtol=2e-5, atol=2e-5)


@pytest.mark.mpi
def test_torch_blocks(grid2d):  # type: ignore[no-untyped-def]
    for ta, tb in TRANSPOSES:
        a, b = _operands(grid2d, 6, 5, 7, ta, tb, like="torch")
        c = matmul(a, b, transpose_a=ta, transpose_b=tb, panel=2)
        assert_all(grid2d, isinstance(c.local, torch.Tensor) and c.local.dtype == torch.float64, repr(c))
        assert_allclose(grid2d, c.gather(root=None), _reference(a, b, ta, tb), rtol=1e-12, atol=1e-13)
    a, b = _operands(grid2d, 6, 5, 7, like="torch", dtype="float32")
    assert_allclose(grid2d, (a @ b).gather(root=None), _reference(a, b, False, False), rtol=2e-5, atol=2e-5)


@pytest.mark.mpi
def test_block_level_summa(grid2d):  # type: ignore[no-untyped-def]
    a, b = _operands(grid2d, 5, 4, 3)
    c, lay = summa_block(a.local, b.local, grid2d, a.layout, b.layout, panel=1)
    got = hpctp.DistTensor(c, grid2d, lay).gather(root=None)
    assert_allclose(grid2d, got, _reference(a, b, False, False), rtol=1e-12)


# ----------------------------------------------------------------------------- communication volume
@pytest.mark.mpi
@pytest.mark.parametrize("shape", [(7, 5, 9), (3, 2, 5)])
def test_bytes_match_model(grid2d, shape):  # type: ignore[no-untyped-def]
    """Stationary C: each rank receives m_i (k - kA_j) words of A and (k - kB_i) n_j of B, exactly."""
    m, k, n = shape
    pr, pc = grid2d.dims
    i, j = grid2d.coords
    a, b = _operands(grid2d, m, k, n)
    with hpctp.CommCounter() as cnt:
        matmul(a, b, panel=2)
    mi = a.layout.local_shape(grid2d.coords)[0]
    nj = b.layout.local_shape(grid2d.coords)[1]
    ka = a.layout.local_shape(grid2d.coords)[1]
    kb = b.layout.local_shape(grid2d.coords)[0]
    a_words = mi * (k - ka) if pc > 1 else 0
    b_words = (k - kb) * nj if pr > 1 else 0
    row = cnt.per_comm["hpctp.grid.axis1"]  # A panels move along grid rows (the axis-1 communicator)
    col = cnt.per_comm["hpctp.grid.axis0"]
    assert_equal(grid2d, np.array([row.bytes_recv, col.bytes_recv]), np.array([8 * a_words, 8 * b_words]))
    assert_equal(
        grid2d, np.array([row.bytes_sent, col.bytes_sent]), np.array([8 * mi * ka * (pc - 1), 8 * kb * nj * (pr - 1)])
    )
    assert_equal(grid2d, np.array(cnt.bytes_recv), np.array(8 * (a_words + b_words)), what="total received")
    sent, recv = perf.matmul_traffic(m, k, n, grid2d.dims)
    assert_equal(grid2d, np.array([cnt.bytes_sent, cnt.bytes_recv]), np.array([sent[grid2d.rank], recv[grid2d.rank]]))
    w = perf.stationary_c_words(m, k, n, grid2d.dims, grid2d.coords)
    assert_equal(grid2d, np.array([cnt.bytes_sent, cnt.bytes_recv]), 8 * np.array(w))
    assert_all(grid2d, set(cnt.calls) <= {"Ibcast"}, f"unexpected calls {cnt.calls}")


@pytest.mark.mpi
def test_transposed_bytes_match_model(grid2d):  # type: ignore[no-untyped-def]
    m, k, n = 6, 7, 5
    for ta, tb in TRANSPOSES:
        a, b = _operands(grid2d, m, k, n, ta, tb, dtype="float32")
        with hpctp.CommCounter() as cnt:
            matmul(a, b, transpose_a=ta, transpose_b=tb, panel=3)
        sent, recv = perf.matmul_traffic(m, k, n, grid2d.dims, itemsize=4, transpose_a=ta, transpose_b=tb)
        assert_equal(grid2d, np.array([cnt.bytes_sent, cnt.bytes_recv]), np.array([sent[grid2d.rank], recv[grid2d.rank]]),
                     what=f"transpose_a={ta} transpose_b={tb}: {cnt.calls}")  # fmt: skip
        redistributed = "Alltoallv" in cnt.calls
        assert_all(grid2d, redistributed == (ta and tb), f"redistribution {cnt.calls} for {ta} {tb}")


# ----------------------------------------------------------------------------- validation
@pytest.mark.mpi
def test_validation_before_communication(grid2d):  # type: ignore[no-untyped-def]
    a, b = _operands(grid2d, 4, 3, 5)
    c3 = hrandom.normal((2, 3, 4), grid2d, (0, 1, None), seed=1)
    other = hpctp.ProcessGrid(grid2d.dims)
    try:
        b_other = hrandom.normal((3, 5), other, (0, 1), seed=12)
        cases = [
            (TypeError, "DistTensor", lambda: matmul(a, b.local)),
            (TypeError, "DistTensor", lambda: a @ np.ones((3, 5))),
            (ValueError, "2-D tensors", lambda: matmul(c3, b)),
            (ValueError, "same ProcessGrid", lambda: matmul(a, b_other)),
            (ValueError, "inner dimensions", lambda: matmul(a, a)),
            (ValueError, "inner dimensions", lambda: matmul(a, b, transpose_a=True)),
            (ValueError, "panel", lambda: matmul(a, b, panel=0)),
            (ValueError, "panel", lambda: matmul(a, b, panel=-3)),
            (TypeError, "panel", lambda: matmul(a, b, panel=2.5)),
            (TypeError, "panel", lambda: matmul(a, b, panel=True)),
            (TypeError, "transpose_a", lambda: matmul(a, b, transpose_a=1)),
            (TypeError, "dtype", lambda: matmul(a, b.astype("float32"))),
            (TypeError, "backend", lambda: matmul(a, b.to("torch"))),
            (TypeError, "boolean blocks", lambda: matmul(a.astype(bool), b.astype(bool))),
            (TypeError, "boolean blocks", lambda: matmul(a.to("torch").astype("bool"), b.to("torch").astype("bool"))),
            (
                TypeError,
                "no matrix product of uint16",
                lambda: matmul(a.to("torch").astype(torch.uint16), b.to("torch").astype(torch.uint16)),
            ),
        ]
        with hpctp.CommCounter() as cnt:
            for exc, text, fn in cases:
                with pytest.raises(exc, match=text):
                    fn()
        assert_all(grid2d, cnt.calls == {}, f"communication before the error: {cnt.calls}")
    finally:
        other.free()


@pytest.mark.mpi
def test_foreign_byte_order_and_bad_blocks_on_one_rank(grid2d):  # type: ignore[no-untyped-def]
    """'>f8' blocks (e.g. from a Fortran file) multiply like native ones, on some ranks or all;
    summa_block with a bad block on one rank raises on every rank instead of hanging."""
    a, b = _operands(grid2d, 5, 3, 4)
    want = _reference(a, b, False, False)
    for odd in (lambda r: True, lambda r: r % 2 == 0):
        big = hpctp.from_local(a.local.astype(">f8") if odd(grid2d.rank) else a.local, grid2d, (0, 1))
        assert_allclose(grid2d, matmul(big, b).gather(None), want, rtol=1e-13, what="big-endian a")
        assert_allclose(grid2d, matmul(b, big, transpose_a=True, transpose_b=True).gather(None), want.T, rtol=1e-13)
    if grid2d.size > 1:
        last = grid2d.rank == grid2d.size - 1
        bad = np.zeros((7, 7)) if last else a.local
        with pytest.raises(ValueError, match=f"rank {grid2d.size - 1}: A block has shape"):
            summa_block(bad, b.local, grid2d, a.layout, b.layout)
        with pytest.raises(TypeError, match="share backend and dtype"):
            summa_block(a.local.astype("float32") if last else a.local, b.local, grid2d, a.layout, b.layout)


@pytest.mark.mpi
def test_non_2d_grids(grid1d):  # type: ignore[no-untyped-def]
    grid3d = hpctp.ProcessGrid([0, 0, 0])
    try:
        for g, split in ((grid1d, (0, None)), (grid3d, (0, 1))):
            a = hrandom.normal((4, 3), g, split, seed=1)
            b = hrandom.normal((3, 2), g, split, seed=2)
            with hpctp.CommCounter() as cnt, pytest.raises(ValueError, match="2-D process grid"):
                matmul(a, b)
            assert_all(g, cnt.calls == {}, f"communication before the error: {cnt.calls}")
    finally:
        grid3d.free()


# ----------------------------------------------------------------------------- planning (pure)
def test_merge_pieces_owners_with_empty_blocks() -> None:
    # k = 5 cut (0,2,2,5) over 3 ranks (block 1 empty) and (0,3,5) over 2 ranks
    pieces = merge_pieces((0, 2, 2, 5), (0, 3, 5), panel=2)
    assert pieces == ((0, 2, 0, 0), (2, 3, 2, 0), (3, 5, 2, 1))
    assert merge_pieces((0, 0), (0, 0), 4) == ()
    assert [p[:2] for p in merge_pieces((0, 7), (0, 7), 3)] == [(0, 3), (3, 6), (6, 7)]


def test_default_panel() -> None:
    assert default_panel((0, 3, 5), (0, 5)) == 3
    assert default_panel((0, 1000), (0, 1000)) == 250  # 4 equal panels of <= 256
    assert default_panel((0, 0), (0, 0)) == 1


def test_variants_and_required_layouts() -> None:
    assert variant_for(0, 1) == "stationary_c"
    assert variant_for(0, 0) == "stationary_a"
    assert variant_for(1, 1) == "stationary_b"
    assert variant_for(1, 0) is None
    dims = (2, 3)
    a = hpctp.Layout((8, 4), dims, (0, 1))
    b = hpctp.Layout((6, 8), dims, (0, 1))
    # A.T @ B.T: nothing fits, the smaller (A) is flipped to (1, 0) -> stationary A
    la, lb = required_layouts(a, b, True, True)
    assert la.split == (1, 0) and lb == b
    assert plan_matmul(la, lb, True, True).variant == "stationary_a"
    # replicated input becomes (0, 1)
    la, _ = required_layouts(hpctp.Layout((8, 4), dims, None), hpctp.Layout((4, 2), dims, (0, 1)))
    assert la.split == (0, 1)
    with pytest.raises(ValueError, match="inner"):
        plan_matmul(a, a)


# ----------------------------------------------------------------------------- 2.5D
@pytest.mark.mpi
def test_matmul_25d(grid3d):  # type: ignore[no-untyped-def]
    for (m, k, n), (ta, tb) in [((7, 5, 9), t) for t in TRANSPOSES] + [((3, 2, 4), (False, False))]:
        a, b = _operands(grid3d, m, k, n, ta, tb)  # split (0, 1): replicated over the layers
        with hpctp.CommCounter() as cnt:
            c = matmul_25d(a, b, transpose_a=ta, transpose_b=tb)
        what = f"{(m, k, n)} transpose_a={ta} transpose_b={tb} on {grid3d.dims}"
        assert_allclose(grid3d, c.gather(root=None), _reference(a, b, ta, tb), rtol=1e-12, atol=1e-13, what=what)
        sent, recv = perf.matmul_traffic(m, k, n, grid3d.dims, transpose_a=ta, transpose_b=tb)
        assert_equal(
            grid3d,
            np.array([cnt.bytes_sent, cnt.bytes_recv]),
            np.array([sent[grid3d.rank], recv[grid3d.rank]]),
            what=what,
        )
    a, b = _operands(grid3d, 4, 6, 3, like="torch")
    assert_allclose(grid3d, matmul_25d(a, b, panel=1).gather(root=None), _reference(a, b, False, False), rtol=1e-12)
    flat = hpctp.ProcessGrid([0, 0])
    try:
        with pytest.raises(ValueError, match="3-D process grid"):
            matmul_25d(*_operands(flat, 2, 2, 2))
    finally:
        flat.free()
