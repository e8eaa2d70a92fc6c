"""The ViT surrogate (apps/surrogate/vit.py) against its one-process torch reference: forward values,
input and parameter gradients on every 2-D grid, in float64; patch-misaligned cuts included."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hpctp
from apps.surrogate.models import build_model
from apps.surrogate.vit import periodic_window_mask, sincos_position
from hpctp.nn import sync_gradients
from hpctp.testing import assert_allclose

SHAPE = (2, 2, 12, 10)  # patch 2 -> 6 x 5 tokens: the 10 columns over 2x2, 1x4, 3 ranks cut inside a patch


def _cfg(attention: str, schedule: str = "ring") -> dict[str, Any]:
    return {
        "model": "vit", "dtype": "float64", "seed": 3, "patch": 2, "embed": 8, "depth": 2, "heads": 2,
        "mlp_ratio": 2.0, "attention": attention, "kernel_size": 3, "schedule": schedule,
    }  # fmt: skip


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Same nonzero values on every rank (the zeroed head too, so the output depends on every layer)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, dtype=p.dtype, generator=gen))
        model.delta_scale.fill_(0.7)


def _compare_forward_backward(
    model: torch.nn.Module, ref: torch.nn.Module, grid: hpctp.ProcessGrid, axes: tuple[int, ...] | None
) -> None:
    """Collective over grid. Forward and backward of ``model`` on the field split over grid axes 0 and 1
    against ``ref`` on the whole field: the output (in the input's layout) and the input gradient; the
    parameters' gradients are left summed over ``axes`` (:func:`sync_gradients`) for the caller."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(*SHAPE, dtype=torch.float64, generator=gen)
    dy = torch.randn(*SHAPE, dtype=torch.float64, generator=gen)
    lay = hpctp.Layout(SHAPE, grid.dims, (None, None, 0, 1))
    sl = lay.local_slices(grid.coords)
    block = x[sl].clone().requires_grad_(True)
    out = model(hpctp.DistTensor(block, grid, lay))
    assert out.layout == lay
    (out.local * dy[sl]).sum().backward()
    sync_gradients(model, grid, axes=axes)
    leaf = x.clone().requires_grad_(True)
    want = ref(leaf)
    (want * dy).sum().backward()
    assert_allclose(grid, out.local.detach(), want.detach()[sl], rtol=1e-10, atol=1e-12, what="output")
    assert_allclose(grid, block.grad, leaf.grad[sl], rtol=1e-9, atol=1e-12, what="input gradient")


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("attention", "schedule"), [("global", "ring"), ("global", "all_to_all"), ("neighborhood", "ring")]
)
def test_vit_forward_backward_matches_single_process(grid2d: hpctp.ProcessGrid, attention: str, schedule: str) -> None:
    cfg = _cfg(attention, schedule)
    model, ref = build_model(cfg, 2, grid2d), build_model(cfg, 2, None)
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()], "parameter names differ from the reference's"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):  # the seeded initial values
        assert_allclose(grid2d, p.detach(), q.detach(), rtol=0, what=f"initial {name}")
    _randomise(model, 11)
    _randomise(ref, 11)
    _compare_forward_backward(model, ref, grid2d, None)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_allclose(grid2d, p.grad, q.grad, rtol=1e-9, atol=1e-12, what=f"gradient of {name}")


def test_untrained_vit_is_persistence() -> None:
    model = build_model(_cfg("global"), 2, None)
    x = torch.randn(*SHAPE, dtype=torch.float64)
    torch.testing.assert_close(model(x), x, rtol=0, atol=0)


def test_position_and_window_helpers() -> None:
    pos = sincos_position(10, (6, 5), ((2, 4), (1, 5)), torch.float64)
    full = sincos_position(10, (6, 5), ((0, 6), (0, 5)), torch.float64)
    assert pos.shape == (2, 4, 10)
    torch.testing.assert_close(pos, full[2:4, 1:5], rtol=0, atol=0)  # a block is a slice of the whole table
    torch.testing.assert_close(full[0, 0, :2], torch.zeros(2, dtype=torch.float64))  # sin(0) of the rows
    torch.testing.assert_close(full[..., 8:], torch.zeros(6, 5, 2, dtype=torch.float64))  # 10 % 4 channels
    torch.testing.assert_close(full[3, 2, 2], torch.tensor(-1.0, dtype=torch.float64))  # cos(2 pi 3 / 6)
    mask = periodic_window_mask((4, 5), 3)
    assert mask.shape == (20, 20) and int(mask.sum()) == 20 * 9
    assert bool(mask[0, 3 * 5 + 4]) and not bool(mask[0, 2 * 5])  # (0,0) sees (3,4) across both edges, not (2,0)


def test_vit_config_errors() -> None:
    with pytest.raises(ValueError, match="heads=3 must divide"):
        build_model({**_cfg("global"), "heads": 3}, 2, None)
    with pytest.raises(ValueError, match="attention must be one of"):
        build_model({**_cfg("global"), "attention": "local"}, 2, None)
    with pytest.raises(ValueError, match="kernel_size must be an odd"):
        build_model({**_cfg("neighborhood"), "kernel_size": 4}, 2, None)
    model = build_model({**_cfg("global"), "patch": 4}, 2, None)
    with pytest.raises(ValueError, match="multiples of surrogate.patch=4"):
        model(torch.zeros(*SHAPE, dtype=torch.float64))
    model = build_model({**_cfg("neighborhood"), "kernel_size": 7}, 2, None)
    with pytest.raises(ValueError, match="exceeds the token grid 6 x 5"):
        model(torch.zeros(*SHAPE, dtype=torch.float64))


@pytest.mark.mpi
def test_vit_heads_split_over_a_tensor_axis(grid3d: hpctp.ProcessGrid) -> None:
    """The field over grid axes 0 and 1, heads and hidden units over axis 2: the one-process values."""
    cfg = {**_cfg("global"), "heads": 4, "embed": 8, "mlp_ratio": 1.5}  # 4 heads of 2, 12 hidden units
    if grid3d.dims[2] > 4:
        with pytest.raises(ValueError, match="at least one"):
            build_model(cfg, 2, grid3d, tensor_axis=2)
        return
    model, ref = build_model(cfg, 2, grid3d, tensor_axis=2), build_model(cfg, 2, None)
    _randomise(ref, 11)
    hpctp.nn.load_global_state_dict(model, ref.state_dict())  # each rank keeps its heads' rows
    _compare_forward_backward(model, ref, grid3d, (0, 1))  # the tensor axis holds whole gradients
    sharded = 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        layout = getattr(p, "hpctp_layout", None)
        g = q.grad if layout is None else q.grad[layout.local_slices(grid3d.coords)]
        sharded += layout is not None
        assert_allclose(grid3d, p.grad, g, rtol=1e-9, atol=1e-12, what=f"gradient of {name}")
    assert sharded == 2 * 6  # per block: qkv weight and bias, out weight, fc1 weight and bias, fc2 weight
    state = hpctp.nn.global_state_dict(model)
    for name, t in ref.state_dict().items():
        assert_allclose(grid3d, state[name], t, rtol=0, atol=0, what=f"global state {name}")
