"""Grid-independent random tensors: pure block generator properties (no MPI)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctp.tensor.random import block_normal, block_uniform


@settings(max_examples=50, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    seed=st.integers(0, 2**63 - 1),
    data=st.data(),
)
def test_any_box_equals_the_slice_of_the_whole(shape: list[int], seed: int, data: st.DataObject) -> None:
    full_n = block_normal(shape, [(0, n) for n in shape], seed)
    full_u = block_uniform(shape, [(0, n) for n in shape], seed)
    box = []
    for n in shape:
        lo = data.draw(st.integers(0, n))
        hi = data.draw(st.integers(lo, n))
        box.append((lo, hi))
    sl = tuple(slice(a, b) for a, b in box)
    np.testing.assert_array_equal(block_normal(shape, box, seed), full_n[sl])
    np.testing.assert_array_equal(block_uniform(shape, box, seed), full_u[sl])


def test_distribution_moments_and_seed_dependence() -> None:
    n = 200_000
    z = block_normal((n,), [(0, n)], seed=7)
    u = block_uniform((n,), [(0, n)], seed=7, low=-2.0, high=3.0)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    assert u.min() >= -2.0 and u.max() < 3.0 and abs(u.mean() - 0.5) < 0.02
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 0.01  # neighbours uncorrelated
    assert not np.array_equal(z, block_normal((n,), [(0, n)], seed=8))


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True])
def test_bad_seed(seed: object) -> None:
    with pytest.raises(ValueError, match="seed"):
        block_normal((3,), [(0, 3)], seed)  # type: ignore[arg-type]


def test_zero_d_box_is_zero_d() -> None:
    """A 0-d tensor's box is 0-d (not shape (1,)), with the value of the 1-element tensor."""
    for fn in (block_normal, block_uniform):
        z = fn((), [], 11)
        assert isinstance(z, np.ndarray) and z.shape == () and z.dtype == np.float64
        assert z == fn((1,), [(0, 1)], 11)[0]
