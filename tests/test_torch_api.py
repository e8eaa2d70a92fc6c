"""torch's pointwise functions on DistTensors (``__torch_function__``) against torch on the gathered tensor."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from helpers.tensors import SHAPE, global_array, make_tensor, splits_for

import hpctp
from hpctp.testing import assert_all, assert_allclose


@pytest.mark.mpi
def test_pointwise_functions_and_gradients_equal_torch(grid2d: hpctp.ProcessGrid) -> None:
    a = torch.from_numpy(global_array(SHAPE) / 10)
    b = torch.from_numpy(np.cos(global_array(SHAPE)))
    cases = {
        "relu": (lambda x, y: torch.relu(x), lambda x, y: torch.relu(x)),
        "F.gelu tanh": (lambda x, y: F.gelu(x, approximate="tanh"), lambda x, y: F.gelu(x, approximate="tanh")),
        "F.leaky_relu": (lambda x, y: F.leaky_relu(x, 0.1), lambda x, y: F.leaky_relu(x, 0.1)),
        "F.silu * y": (lambda x, y: F.silu(x) * y, lambda x, y: F.silu(x) * y),
        "where": (lambda x, y: torch.where(x > y, x, 0.5 * y), lambda x, y: torch.where(x > y, x, 0.5 * y)),
        "atan2": (lambda x, y: torch.atan2(x, y), lambda x, y: torch.atan2(x, y)),
        "clamp": (lambda x, y: torch.clamp(x, min=-0.3, max=0.2), lambda x, y: torch.clamp(x, min=-0.3, max=0.2)),
        "flip * y": (lambda x, y: torch.flip(x, (0, 2)) * y, lambda x, y: torch.flip(x, (0, 2)) * y),  # collective
        "roll + y": (lambda x, y: torch.roll(x, (2, -1), (0, 1)) + y, lambda x, y: torch.roll(x, (2, -1), (0, 1)) + y),
        "exp - sum": (lambda x, y: torch.exp(x) - x.sum(), lambda x, y: torch.exp(x) - x.sum()),  # 0-d operand
    }
    for split, skew in itertools.product(splits_for(grid2d), (False, True)):
        x0 = make_tensor(grid2d, split, skew, "torch")
        for what, (dist, ref) in cases.items():
            x = x0.with_local((a[x0.local_slices] * 1).requires_grad_(True))
            y = x0.with_local(b[x0.local_slices].clone())
            out = dist(x, y)
            assert_all(grid2d, isinstance(out, hpctp.DistTensor) and out.layout == x.layout, what)
            ag = a.clone().requires_grad_(True)
            want = ref(ag, b)
            assert_allclose(grid2d, out.gather(None), want.detach(), rtol=1e-14, atol=1e-12, what=f"{what} {split}")
            weights = torch.from_numpy(np.sin(global_array(SHAPE)))
            (out * x0.with_local(weights[out.local_slices])).sum().local.backward()  # replicated loss
            (want * weights).sum().backward()
            assert_allclose(grid2d, x.local.grad, ag.grad[x.local_slices], rtol=1e-13, atol=1e-15, what=f"d {what}")


@pytest.mark.mpi
def test_torch_functions_refused(grid2d: hpctp.ProcessGrid) -> None:
    x = make_tensor(grid2d, (0, 1, None), True, "torch")
    for call in (lambda: torch.softmax(x, 0), lambda: F.dropout(x), lambda: torch.max(x, 0), lambda: torch.sort(x)):
        with pytest.raises(TypeError, match="is not supported on DistTensors: only pointwise"):
            call()
    with pytest.raises(TypeError, match="plain torch.Tensor of shape .* would broadcast"):
        torch.maximum(x, torch.zeros(SHAPE[-1], dtype=torch.float64))
    with pytest.raises(TypeError, match="torch.relu needs torch blocks, got numpy"):
        torch.relu(x.to("numpy"))
    with pytest.raises(ValueError, match="same layout|does not broadcast"):
        torch.add(x, x.redistribute((None, None, None)) if grid2d.size > 1 else x[1:])


@pytest.mark.mpi
def test_sum_mean_norm_are_differentiable(grid2d: hpctp.ProcessGrid) -> None:
    """DistTensor reductions of torch blocks that require grad: the single-process gradient on every block."""
    a = torch.from_numpy(global_array(SHAPE) / 10)
    for split in splits_for(grid2d):
        x0 = make_tensor(grid2d, split, True, "torch")
        for what, dist, ref in (
            ("sum", lambda x: x.sum() * 3, lambda x: x.sum() * 3),
            ("mean axis 1 squared", lambda x: (x.mean(axis=1) ** 2).sum(), lambda x: (x.mean(1) ** 2).sum()),
            ("norm", lambda x: x.norm(), lambda x: torch.linalg.vector_norm(x)),
            ("sum (0, 2) of tanh", lambda x: torch.tanh(x).sum(axis=(0, 2)).sum(), lambda x: torch.tanh(x).sum()),
        ):
            x = x0.with_local(a[x0.local_slices].clone().requires_grad_(True))
            loss = dist(x)
            loss.local.backward()  # a replicated 0-d tensor: every rank runs the same backward
            ag = a.clone().requires_grad_(True)
            ref(ag).backward()
            assert_allclose(grid2d, loss.local.detach(), ref(a), rtol=1e-13, what=what)
            assert_allclose(grid2d, x.local.grad, ag.grad[x.local_slices], rtol=1e-12, atol=1e-15, what=f"d {what}")


@pytest.mark.mpi
def test_torch_reductions_and_joins(grid2d: hpctp.ProcessGrid) -> None:
    """torch.sum/mean/amax/amin/var/std (torch's arguments and defaults) and torch.cat/stack on
    DistTensors equal torch on the gathered tensor, gradients too."""
    a = torch.from_numpy(np.round(np.sin(global_array(SHAPE)) * 3))  # ties for amax/amin
    cases = [
        ("sum dim 1", lambda t: torch.sum(t, 1)),
        ("sum keepdim", lambda t: torch.sum(t, dim=(0, 2), keepdim=True)),
        ("mean", lambda t: torch.mean(t)),
        ("amax", lambda t: torch.amax(t, dim=0)),
        ("amin all", lambda t: torch.amin(t)),
        ("var (unbiased by default)", lambda t: torch.var(t, dim=1)),
        ("var unbiased=False", lambda t: torch.var(t, 2, False, True)),
        ("std correction=0", lambda t: torch.std(t, dim=(0, 1), correction=0)),
        ("cat", lambda t: torch.cat([t, t[:2] * 2], dim=0)),
        ("stack", lambda t: torch.stack((t, t * 3), dim=1)),
    ]
    for split, (what, fn) in itertools.product(splits_for(grid2d), cases):
        x0 = make_tensor(grid2d, split, True, "torch")
        x = x0.with_local(a[x0.local_slices].clone().requires_grad_(True))
        out = fn(x)
        ag = a.clone().requires_grad_(True)
        want = fn(ag)
        assert_allclose(
            grid2d, out.gather(None).detach(), want.detach(), rtol=1e-13, atol=1e-13, what=f"{what} {split}"
        )
        w = torch.cos(torch.arange(want.numel(), dtype=torch.float64)).reshape(want.shape)
        (out.local * w[out.local_slices]).sum().backward()  # the rank's part of a replicated loss
        (want * w).sum().backward()
        assert_allclose(grid2d, x.local.grad, ag.grad[x.local_slices], rtol=1e-12, atol=1e-14, what=f"d {what} {split}")
