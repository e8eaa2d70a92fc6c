"""global_state_dict / load_global_state_dict: every hpctp.nn layer round-trips with its single-process torch model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers.transformer import F64, normal
from mpi4py import MPI

import hpctp
from hpctp.nn import BatchNorm2d, ColumnParallelLinear, Conv2d, GroupNorm, Linear2D, RowParallelLinear, SpectralConv2d
from hpctp.nn.attention import MultiheadAttention
from hpctp.nn.layer_norm import LayerNorm, RMSNorm
from hpctp.nn.mlp import ParallelMLP
from hpctp.nn.state_dict import global_state_dict, load_global_state_dict
from hpctp.nn.transformer import TransformerBlock
from hpctp.testing import assert_all, assert_allclose, assert_equal

Factory = Callable[[hpctp.ProcessGrid, int], torch.nn.Module]


def _mlp_twin() -> torch.nn.Module:
    return torch.nn.ModuleDict(
        {"linear1": torch.nn.Linear(10, 15, dtype=F64), "linear2": torch.nn.Linear(15, 10, dtype=F64)}
    )


# name -> (the partitioned layer on a 2-D grid with a seed, its single-process torch twin or None)
LAYERS: dict[str, tuple[Factory, Callable[[], torch.nn.Module] | None]] = {
    "column": (
        lambda g, s: ColumnParallelLinear(7, 5, g, axis=1, seed=s, dtype=F64),
        lambda: torch.nn.Linear(7, 5, dtype=F64),
    ),
    "row": (
        lambda g, s: RowParallelLinear(7, 5, g, axis=0, seed=s, dtype=F64),
        lambda: torch.nn.Linear(7, 5, dtype=F64),
    ),
    "linear2d": (lambda g, s: Linear2D(7, 5, g, seed=s, dtype=F64), lambda: torch.nn.Linear(7, 5, dtype=F64)),
    "conv2d": (
        lambda g, s: Conv2d(3, 4, 3, grid=g, seed=s, dtype=F64),
        lambda: torch.nn.Conv2d(3, 4, 3, dtype=F64),
    ),
    "batchnorm2d": (lambda g, s: BatchNorm2d(4, grid=g, dtype=F64), lambda: torch.nn.BatchNorm2d(4, dtype=F64)),
    "groupnorm": (lambda g, s: GroupNorm(2, 4, grid=g, dtype=F64), lambda: torch.nn.GroupNorm(2, 4, dtype=F64)),
    "spectral2d": (lambda g, s: SpectralConv2d(3, 4, (2, 2), grid=g, seed=s, dtype=F64), None),
    "layernorm": (lambda g, s: LayerNorm(10, g, axis=1, dtype=F64), lambda: torch.nn.LayerNorm(10, dtype=F64)),
    "rmsnorm": (lambda g, s: RMSNorm(10, g, axis=0, dtype=F64), lambda: torch.nn.RMSNorm(10, dtype=F64)),
    "attention": (
        lambda g, s: MultiheadAttention(10, 5, g, axis=1, seed=s, dtype=F64),
        lambda: torch.nn.MultiheadAttention(10, 5, batch_first=True, dtype=F64),
    ),
    "mlp": (lambda g, s: ParallelMLP(10, 15, g, axis=0, seed=s, dtype=F64), _mlp_twin),
    "block": (
        lambda g, s: TransformerBlock(10, 5, 1.5, g, axis=1, sequence_parallel=True, seed=s, dtype=F64),
        lambda: torch.nn.TransformerEncoderLayer(10, 5, 15, batch_first=True, norm_first=True, dtype=F64),
    ),
}

SEEDED = ("column", "row", "linear2d", "conv2d", "spectral2d", "attention", "mlp", "block")


def _random_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Local. ``module``'s state with every float tensor replaced by seeded normal values (same on every rank)."""
    out = {}
    for i, (k, v) in enumerate(module.state_dict().items()):
        out[k] = normal(tuple(v.shape), 100 + i).abs() + 0.1 if v.is_floating_point() else v + 3
    return out


def _assert_same_state(grid, got, want, what):  # type: ignore[no-untyped-def]
    assert_equal(grid, sorted(got), sorted(want), f"{what}: keys")
    for k in want:
        ok = got[k].shape == want[k].shape and got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])
        assert_all(grid, ok, f"{what}: {k} differs ({tuple(got[k].shape)} vs {tuple(want[k].shape)})")


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_torch_state_round_trip(grid2d, name):  # type: ignore[no-untyped-def]
    """A single-process torch state loads into the partitioned layer (each rank its block) and comes back
    unchanged, on every rank or on a root only; the gathered state loads into the torch twin (strict)."""
    make, twin = LAYERS[name]
    layer = make(grid2d, 1)
    source = _random_state(twin()) if twin is not None else global_state_dict(make(grid2d, 7))
    load_global_state_dict(layer, source)
    _assert_same_state(grid2d, global_state_dict(layer), source, f"{name} every rank")
    other = make(grid2d, 2)
    load_global_state_dict(other, source if grid2d.rank == 0 else None, root=0)
    for (k, a), b in zip(layer.state_dict().items(), other.state_dict().values()):
        assert_all(grid2d, torch.equal(a, b), f"{name}: {k}'s block differs after loading from root 0")
    last = grid2d.size - 1
    back = global_state_dict(other, root=last)
    if grid2d.rank == last:
        _assert_same_state(MPI.COMM_SELF, back, source, f"{name} root {last}")
    assert_all(grid2d, (len(back) > 0) == (grid2d.rank == last), "only the root receives the state")
    if twin is not None:
        ref = twin()
        ref.load_state_dict(global_state_dict(layer))  # strict: torch's names, shapes and packing
        _assert_same_state(grid2d, ref.state_dict(), source, f"{name} in torch")


@pytest.mark.mpi
@pytest.mark.parametrize("name", SEEDED)
def test_gathered_initial_parameters_do_not_depend_on_the_grid(grid2d, name):  # type: ignore[no-untyped-def]
    make, _ = LAYERS[name]
    solo = hpctp.ProcessGrid((1, 1), comm=MPI.COMM_SELF)
    _assert_same_state(grid2d, global_state_dict(make(grid2d, 5)), global_state_dict(make(solo, 5)), name)
    solo.free()


@pytest.mark.mpi
def test_loaded_linear_layers_compute_as_torch(grid1d):  # type: ignore[no-untyped-def]
    """A pretrained torch MLP loaded into column- and row-parallel layers gives torch's output."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)  # the same "pretrained" model on every rank
        ref = torch.nn.Sequential(torch.nn.Linear(6, 9, dtype=F64), torch.nn.Tanh(), torch.nn.Linear(9, 4, dtype=F64))
    col = ColumnParallelLinear(6, 9, grid1d, dtype=F64)
    row = RowParallelLinear(9, 4, grid1d, dtype=F64)
    load_global_state_dict(col, {k[2:]: v for k, v in ref.state_dict().items() if k.startswith("0.")})
    load_global_state_dict(row, {k[2:]: v for k, v in ref.state_dict().items() if k.startswith("2.")})
    X = normal((5, 6), 1)
    assert_allclose(grid1d, row(torch.tanh(col(X))).detach(), ref(X).detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.mpi
def test_float32_source_and_strict_errors(grid1d):  # type: ignore[no-untyped-def]
    layer = MultiheadAttention(10, 5, grid1d, dtype=F64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        torch_state = torch.nn.MultiheadAttention(10, 5, batch_first=True).state_dict()  # float32
    load_global_state_dict(layer, torch_state)
    back = global_state_dict(layer)
    for k, v in torch_state.items():
        assert_all(grid1d, back[k].dtype == F64 and torch.equal(back[k], v.double()), f"{k} cast to float64")
    missing = {k: v for k, v in torch_state.items() if k != "out_proj.bias"}
    with pytest.raises(KeyError, match="missing keys.*out_proj.bias"):
        load_global_state_dict(layer, missing)
    with pytest.raises(KeyError, match="unexpected keys.*extra"):
        load_global_state_dict(layer, {**torch_state, "extra": torch.zeros(1)})
    bad = {**torch_state, "out_proj.weight": torch.zeros(10, 11)}
    with pytest.raises(ValueError, match="global shape"):
        load_global_state_dict(layer, bad)
    if grid1d.size > 1:  # only rank 0's state is wrong: every rank raises, none waits in a scatter
        with pytest.raises(ValueError, match="global shape"):
            load_global_state_dict(layer, bad if grid1d.rank == 0 else None, root=0)
    load_global_state_dict(layer, {"out_proj.bias": torch.ones(10)}, strict=False)
    assert_all(grid1d, bool((layer.out_proj.bias == 1).all()), "strict=False loads what is there")
    with pytest.raises(ValueError, match="root"):
        global_state_dict(layer, root=grid1d.size)
