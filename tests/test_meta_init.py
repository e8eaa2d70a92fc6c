"""Layers built on the meta device: nothing allocated, no message, and materialized to their values of construction."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import hpctp
import hpctp.nn as hnn
from hpctp.nn import materialize
from hpctp.testing import assert_all, assert_equal

F64 = torch.float64
S = 7  # the global seed of the unseeded layers

# every hpctp layer with parameters or buffers, on a 2-D grid (tensor-parallel ones split over axis 1)
LAYERS: dict[str, Callable[[hpctp.ProcessGrid], torch.nn.Module]] = {
    "Conv2d": lambda g: hnn.Conv2d(2, 3, 3, padding=1, grid=g, seed=1, dtype=F64),
    "Conv2d, unseeded": lambda g: hnn.Conv2d(2, 3, 3, padding=1, grid=g, dtype=F64),
    "ConvTranspose2d": lambda g: hnn.ConvTranspose2d(2, 3, 2, stride=2, grid=g, seed=2, dtype=F64),
    "SpectralConv2d": lambda g: hnn.SpectralConv2d(2, 3, 3, grid=g, seed=3, dtype=F64),
    "BatchNorm2d": lambda g: hnn.BatchNorm2d(3, grid=g, dtype=F64),
    "GroupNorm": lambda g: hnn.GroupNorm(1, 3, grid=g, dtype=F64),
    "ColumnParallelLinear": lambda g: hnn.ColumnParallelLinear(4, 5, g, axis=1, seed=4, dtype=F64),
    "RowParallelLinear": lambda g: hnn.RowParallelLinear(5, 4, g, axis=1, seed=5, dtype=F64),
    "Linear2D": lambda g: hnn.Linear2D(5, 3, g, seed=6, dtype=F64),
    "MultiheadAttention": lambda g: hnn.MultiheadAttention(6, 3, g, axis=1, seed=8, dtype=F64),
    "ParallelMLP": lambda g: hnn.ParallelMLP(4, 5, g, axis=1, seed=9, dtype=F64),
    "TransformerBlock": lambda g: hnn.TransformerBlock(6, 3, 2.0, g, axis=1, seed=10, dtype=F64),
    "LayerNorm, split": lambda g: hnn.LayerNorm(5, g, axis=1, dtype=F64),
    "RMSNorm": lambda g: hnn.RMSNorm(5, g, dtype=F64),
    "PatchEmbed2d": lambda g: hnn.PatchEmbed2d(2, 6, 2, g, seed=11, dtype=F64),
    "Unpatch2d": lambda g: hnn.Unpatch2d(6, 2, 2, g, seed=12, dtype=F64),
    "Unpatch2d, unseeded": lambda g: hnn.Unpatch2d(6, 2, 2, g, dtype=F64),
    "NeighborhoodAttention2d": lambda g: hnn.NeighborhoodAttention2d(6, 3, 3, g, seed=13, dtype=F64),
}


def _tensors(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(m.state_dict(keep_vars=True))


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_on_meta_materializes_to_its_construction(grid2d: hpctp.ProcessGrid, name: str) -> None:
    """On meta nothing has storage and no rank sends (an unseeded layer would broadcast); materialized with the
    global seed, every rank's blocks equal those of the layer built for real after torch.manual_seed, bitwise,
    and the parameter objects (with their hpctp_layout) are the same ones."""
    make = LAYERS[name]
    torch.manual_seed(S)
    real = make(grid2d)
    with hpctp.CommCounter() as counter, torch.device("meta"):
        meta = make(grid2d)
    assert_all(grid2d, all(t.is_meta for t in _tensors(meta).values()), f"{name}: a tensor off meta")
    assert_equal(grid2d, counter.messages, 0, f"{name}: messages while building on meta")
    before = {k: (id(p), getattr(p, "hpctp_layout", None)) for k, p in meta.named_parameters()}
    torch.manual_seed(123)  # materialize(seed=S) must not depend on the caller's generator
    materialize(meta, seed=S)
    got, want = _tensors(meta), _tensors(real)
    assert_equal(grid2d, sorted(got), sorted(want), f"{name}: state names")
    for key, value in want.items():
        assert_all(grid2d, not got[key].is_meta, f"{name}.{key} still on meta")
        assert_all(grid2d, torch.equal(got[key], value), f"{name}.{key}: materialized != built")
    for key, (ident, layout) in before.items():
        p = meta.get_parameter(key)
        assert_all(grid2d, id(p) == ident, f"{name}.{key}: a new parameter object")
        assert_all(grid2d, getattr(p, "hpctp_layout", None) == layout, f"{name}.{key}: hpctp_layout lost")


class _Mixed(torch.nn.Module):
    """Plain torch layers drawing from the global generator between hpctp layers with their own seeds."""

    def __init__(self, grid: hpctp.ProcessGrid) -> None:
        super().__init__()
        self.conv = hnn.Conv2d(2, 3, 3, padding=1, grid=grid, seed=1, dtype=F64)
        self.lin = torch.nn.Linear(5, 5, dtype=F64)
        self.attn = hnn.MultiheadAttention(6, 2, grid, seed=2, dtype=F64)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 4, dtype=F64), torch.nn.LayerNorm(4, dtype=F64))
        self.head = torch.nn.Conv2d(3, 1, 1, dtype=F64)


@pytest.mark.mpi
def test_model_from_a_global_seed(grid1d: hpctp.ProcessGrid) -> None:
    """A model mixing torch's and hpctp's layers: materialize(seed) equals building it after manual_seed(seed)
    (the resets run children first, in construction's order)."""
    torch.manual_seed(S)
    real = _Mixed(grid1d)
    with torch.device("meta"):
        meta = _Mixed(grid1d)
    materialize(meta, seed=S)
    for key, value in real.state_dict().items():
        assert_all(grid1d, torch.equal(meta.state_dict()[key], value), key)


class _NoReset(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(3, 3)
        self.scale = torch.nn.Parameter(torch.empty(3))


def test_meta_without_a_reset_is_refused() -> None:
    """A meta tensor nothing can initialise: a ValueError naming it, and nothing is materialized."""
    with torch.device("meta"):
        m = _NoReset()
    with pytest.raises(ValueError, match=r"scale \(_NoReset has no reset_parameters\(\)\).*reset_parameters"):
        materialize(m, seed=0)
    assert all(p.is_meta for p in m.parameters())


def _count_draws(make: Callable[[], Any]) -> int:
    """How many numbers the global generator gave while ``make`` ran."""
    state = torch.get_rng_state()
    make()
    after = torch.rand(1)
    torch.set_rng_state(state)
    fresh = torch.rand(10000)
    return int((fresh == after).nonzero()[0, 0]) if (fresh == after).any() else -1


def test_seeded_layers_leave_the_global_generator_alone() -> None:
    """Construction and reset of a seeded layer draw on a forked generator: the caller's stream is untouched."""
    with hpctp.ProcessGrid((1,)) as grid:
        assert _count_draws(lambda: hnn.Conv2d(2, 3, 3, grid=grid, seed=1)) == 0
        conv = hnn.Conv2d(2, 3, 3, grid=grid, seed=1)
        assert _count_draws(conv.reset_parameters) == 0
