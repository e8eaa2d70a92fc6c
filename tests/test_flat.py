"""Flat packings (no MPI): what each slice holds of each tensor, and flat ranges as boxes of an N-D array."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctp.layout import FlatPacking, FlatPiece, block_range, flat_range_boxes

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@settings(max_examples=300, deadline=None)
@given(shape=shapes, data=st.data())
def test_boxes_are_the_flat_range_in_order(shape: tuple[int, ...], data: st.DataObject) -> None:
    """The boxes hold exactly elements start..stop-1, in flat order, each contiguous, at most 2 ndim - 1 of them."""
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    a = np.arange(n).reshape(shape)
    boxes = flat_range_boxes(shape, start, stop)
    got = np.concatenate([a[box].reshape(-1) for box in boxes]) if boxes else np.zeros(0, dtype=a.dtype)
    np.testing.assert_array_equal(got, np.arange(start, stop))
    for box in boxes:
        assert len(box) == len(shape)
        values = a[box].reshape(-1)
        assert values.size > 0 and np.array_equal(values, np.arange(values[0], values[0] + values.size))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_boxes_examples_and_errors() -> None:
    assert flat_range_boxes((3, 4), 0, 12) == ((slice(0, 3), slice(0, 4)),)
    assert flat_range_boxes((3, 4), 5, 6) == ((slice(1, 2), slice(1, 2)),)
    assert flat_range_boxes((), 0, 1) == ((),)
    assert flat_range_boxes((2, 0), 0, 0) == ()
    with pytest.raises(ValueError, match=r"flat range \[3, 13\) is outside an array of shape \(3, 4\)"):
        flat_range_boxes((3, 4), 3, 13)


@settings(max_examples=200, deadline=None)
@given(st.lists(shapes, min_size=1, max_size=5), st.integers(1, 7))
def test_packing_pieces_cover_each_tensor_once(tensor_shapes: list[tuple[int, ...]], parts: int) -> None:
    """Every element of every tensor lies in exactly one part's piece; pieces sit where the slice says."""
    packing = FlatPacking(tuple(tensor_shapes), parts)
    flat = np.concatenate([np.arange(math.prod(s)) + 1000 * i for i, s in enumerate(tensor_shapes)] + [np.zeros(0)])
    assert packing.numel == flat.size == sum(packing.counts)
    seen: list[list[int]] = [[] for _ in tensor_shapes]
    for part in range(parts):
        lo, hi = packing.slice_range(part)
        assert (lo, hi) == block_range(packing.numel, parts, part)
        mine = flat[lo:hi]
        for piece in packing.pieces(part):
            assert isinstance(piece, FlatPiece)
            values = mine[piece.at : piece.at + piece.stop - piece.start]
            np.testing.assert_array_equal(values, np.arange(piece.start, piece.stop) + 1000 * piece.tensor)
            seen[piece.tensor] += range(piece.start, piece.stop)
    for i, s in enumerate(tensor_shapes):
        assert sorted(seen[i]) == list(range(math.prod(s)))
        counts = packing.tensor_counts(i)
        assert sum(counts) == math.prod(s)
        for part in range(parts):
            held = sum(p.stop - p.start for p in packing.pieces(part) if p.tensor == i)
            assert counts[part] == held
