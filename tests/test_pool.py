"""Partitioned MaxPool2d/3d and AvgPool2d/3d vs single-process torch on the gathered field."""

from __future__ import annotations

import pytest
import torch
from helpers.layers import compare_layer

import hpctp
from hpctp.nn.pool import AvgPool2d, AvgPool3d, MaxPool2d, MaxPool3d

pytestmark = pytest.mark.mpi

# (kernel, stride, padding, dilation, ceil_mode, skew)
MAX_CASES = [(2, 2, 0, 1, False, False), (3, 2, 1, 1, True, True), (3, 1, 1, 2, False, True), (5, 3, 2, 1, True, False)]
# (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, skew)
AVG_CASES = [
    (2, 2, 0, False, True, None, False),
    (3, 2, 1, True, False, None, True),
    (3, 1, 1, False, True, None, True),
    (5, 2, 2, True, True, None, False),
    (3, 2, 1, False, False, 5, True),
]
SHAPE2 = (1, 2, 11, 9)


@pytest.mark.parametrize("case", MAX_CASES, ids=lambda c: "k{}s{}p{}d{}-ceil{}".format(*c))
def test_max_pool2d(grid2d: hpctp.ProcessGrid, case: tuple) -> None:
    k, s, p, d, ceil, skew = case
    mine = MaxPool2d(k, s, p, d, ceil_mode=ceil, grid=grid2d)
    compare_layer(grid2d, mine, torch.nn.MaxPool2d(k, s, p, d, ceil_mode=ceil), SHAPE2, (None, None, 0, 1), skew=skew)


@pytest.mark.parametrize("case", AVG_CASES, ids=lambda c: "k{}s{}p{}-ceil{}-inc{}-div{}".format(*c))
def test_avg_pool2d(grid2d: hpctp.ProcessGrid, case: tuple) -> None:
    k, s, p, ceil, inc, div, skew = case
    mine = AvgPool2d(k, s, p, ceil, inc, div, grid=grid2d)
    ref = torch.nn.AvgPool2d(k, s, p, ceil, inc, div)
    compare_layer(grid2d, mine, ref, SHAPE2, (None, None, 0, 1), skew=skew)


def test_pool3d(grid3d: hpctp.ProcessGrid) -> None:
    shape = (1, 2, 5, 6, 7)
    compare_layer(
        grid3d, MaxPool3d(3, 2, 1, grid=grid3d), torch.nn.MaxPool3d(3, 2, 1), shape, (None, None, 0, 1, 2), skew=True
    )
    compare_layer(
        grid3d,
        AvgPool3d(2, ceil_mode=True, grid=grid3d),
        torch.nn.AvgPool3d(2, ceil_mode=True),
        shape,
        (None, None, 0, 1, 2),
    )


def test_pool_bad_arguments(grid2d: hpctp.ProcessGrid) -> None:
    with pytest.raises(ValueError, match="return_indices"):
        MaxPool2d(2, return_indices=True, grid=grid2d)
    with pytest.raises(ValueError, match="at most half"):
        MaxPool2d(2, 2, 2, grid=grid2d)(torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match="at most half of the kernel size"):  # as torch, dilation or not
        MaxPool2d(3, 1, 2, dilation=2, grid=grid2d)(torch.zeros(1, 1, 8, 8))
    # kernel 2 dilated over n + 1 cells, padding 1: the one window holds cells -1 and n, both padding
    n1 = grid2d.dims[1]  # 1-cell blocks
    with pytest.raises(ValueError, match="spatial dim 1: max-pooling window 0 covers only padding"):
        MaxPool2d((1, 2), 1, (0, 1), dilation=(1, n1 + 1), grid=grid2d)(torch.zeros(1, 1, 1, 1))
    with pytest.raises(ValueError, match="spatial dim 2: input size 1 is smaller than kernel_size 3"):
        AvgPool3d(3, 1, 1, grid=grid2d)(torch.zeros(1, 1, 3, 3, 1))  # torch's avg_pool3d rule
    with pytest.raises(ValueError, match="divisor_override"):
        AvgPool2d(2, divisor_override=0, grid=grid2d)(torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match="too small"):
        AvgPool2d(5, grid=grid2d)(torch.zeros(1, 1, 1, 1))
    with pytest.raises(ValueError, match="grid axis"):
        AvgPool2d(2, grid=grid2d, split=(0, 0))
