"""Global losses and reductions equal torch on the gathered field, with exact gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hpctp
from hpctp.comm import allreduce
from hpctp.layout import Layout
from hpctp.nn import loss as L
from hpctp.testing import assert_all, assert_allclose

F64 = torch.float64


def field(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def rel_l2(p: torch.Tensor, t: torch.Tensor, per_sample: bool) -> torch.Tensor:
    if per_sample:
        return (
            torch.linalg.vector_norm((p - t).flatten(1), dim=1) / torch.linalg.vector_norm(t.flatten(1), dim=1)
        ).mean()
    return torch.linalg.vector_norm(p - t) / torch.linalg.vector_norm(t)


CASES = {
    "mse": (lambda p, t, g: L.global_mse_loss(p, t, g), lambda p, t: torch.nn.functional.mse_loss(p, t)),
    "mse_sum": (
        lambda p, t, g: L.global_mse_loss(p, t, g, reduction="sum"),
        lambda p, t: torch.nn.functional.mse_loss(p, t, reduction="sum"),
    ),
    "l1": (lambda p, t, g: L.global_l1_loss(p, t, g), lambda p, t: torch.nn.functional.l1_loss(p, t)),
    "sum": (lambda p, t, g: L.global_sum(p * t, g), lambda p, t: (p * t).sum()),
    "mean": (lambda p, t, g: L.global_mean(p**2 * t, g), lambda p, t: (p**2 * t).mean()),
    "rel_l2": (lambda p, t, g: L.relative_l2_error(p, t, g), lambda p, t: rel_l2(p, t, False)),
    "rel_l2_sample": (lambda p, t, g: L.relative_l2_error(p, t, g, per_sample=True), lambda p, t: rel_l2(p, t, True)),
}


@pytest.mark.mpi
def test_losses_match_torch(grid2d) -> None:  # type: ignore[no-untyped-def]
    shape = (2, 3, 7, 9)
    layout = Layout(shape, grid2d.dims, (None, None, 0, 1))
    sl = layout.local_slices(grid2d.coords)
    p, t = field(shape, 1), field(shape, 2)
    for name, (dist, ref) in CASES.items():
        pg = p.clone().requires_grad_(True)
        want = ref(pg, t)
        want.backward()
        pl = p[sl].clone().requires_grad_(True)
        got = dist(pl, t[sl], grid2d)
        got.backward()
        assert_allclose(grid2d, got.detach(), want.detach(), rtol=1e-12, what=f"{name} value")
        assert_allclose(grid2d, pl.grad, pg.grad[sl], rtol=1e-10, atol=1e-14, what=f"{name} grad")


@pytest.mark.mpi
def test_bfloat16_gradients_as_accurate_as_torchs(grid2d) -> None:  # type: ignore[no-untyped-def]
    """bf16 inputs: every loss's value and gradients (pred and target) are as close to the exact
    float64 ones as torch's own bf16 computation is (within 2x; bf16 keeps ~3 digits)."""
    shape = (2, 3, 7, 9)
    layout = Layout(shape, grid2d.dims, (None, None, 0, 1))
    sl = layout.local_slices(grid2d.coords)
    p, t = field(shape, 5), field(shape, 6)
    t = p + 0.3 * t  # pred near target: the relative error's two gradient terms nearly cancel

    def run(fn, p_, t_):  # type: ignore[no-untyped-def]
        pg, tg = p_.detach().clone().requires_grad_(), t_.detach().clone().requires_grad_()
        val = fn(pg, tg)
        val.backward()
        return val.detach().double(), pg.grad.double(), tg.grad.double()

    bf = torch.bfloat16
    for name, (dist, ref) in CASES.items():
        exact = run(ref, p, t)
        theirs = run(ref, p.to(bf), t.to(bf))
        ours = run(lambda a, b, f=dist: f(a, b, grid2d), p[sl].to(bf), t[sl].to(bf))
        for what, e, th, o in zip(("value", "pred grad", "target grad"), exact, theirs, ours):
            err_theirs = float((th - e).norm() / e.norm())
            if what == "value":
                err_ours = float((o - e).norm() / e.norm())
            else:  # over the whole field: this rank's squared error and norm, summed over the grid
                sums = np.array([float((o - e[sl]).square().sum()), float(e[sl].square().sum())])
                allreduce(grid2d.comm, sums, "sum")
                err_ours = float(np.sqrt(sums[0] / sums[1]))
            ok = err_ours <= 2 * err_theirs + 1e-3
            assert_all(grid2d, ok, f"{name} {what}: bf16 error {err_ours:.3g}, torch's own bf16 error {err_theirs:.3g}")


@pytest.mark.mpi
def test_replicated_axis_counted_once(grid2d) -> None:  # type: ignore[no-untyped-def]
    """Blocks split over grid axis 1 only (replicas along axis 0): axes=(1,) gives the global values."""
    shape = (2, 3, 4, 9)
    layout = Layout(shape, grid2d.dims, (None, None, None, 1))
    sl = layout.local_slices(grid2d.coords)
    p, t = field(shape, 3), field(shape, 4)
    pl = p[sl].clone().requires_grad_(True)
    got = L.global_mse_loss(pl, t[sl], grid2d, axes=(1,))
    got.backward()
    pg = p.clone().requires_grad_(True)
    want = torch.nn.functional.mse_loss(pg, t)
    want.backward()
    assert_allclose(grid2d, got.detach(), want.detach(), rtol=1e-12)
    assert_allclose(grid2d, pl.grad, pg.grad[sl], rtol=1e-10)
    assert_allclose(grid2d, L.global_sum(t[sl], grid2d, axes=(1,)), t.sum(), rtol=1e-12)


@pytest.mark.mpi
def test_empty_blocks_and_float32(grid2d) -> None:  # type: ignore[no-untyped-def]
    """Ranks with empty blocks contribute nothing; float32 inputs give float32 results."""
    shape = (1, 1, 2, 1)  # most ranks of a 2x2 / 4x1 grid hold nothing
    layout = Layout(shape, grid2d.dims, (None, None, 0, 1))
    sl = layout.local_slices(grid2d.coords)
    p = torch.tensor([3.0, 5.0], dtype=torch.float32).reshape(shape)
    got = L.global_mean(p[sl], grid2d)
    assert_allclose(grid2d, got, torch.tensor(4.0), rtol=0)
    assert_allclose(grid2d, int(got.dtype == torch.float32), 1)


@pytest.mark.mpi
def test_bad_inputs_raise_everywhere(grid2d) -> None:  # type: ignore[no-untyped-def]
    p = torch.zeros(2, 3, dtype=F64)
    t = torch.zeros(2, 4 if grid2d.rank == grid2d.size - 1 else 3, dtype=F64)  # wrong on the last rank only
    with pytest.raises(ValueError, match="shape|invalid input"):
        L.global_mse_loss(p, t, grid2d)
    with pytest.raises(ValueError, match="shape|invalid input"):
        L.relative_l2_error(p, t, grid2d, per_sample=True)
    with pytest.raises(ValueError, match="reduction"):
        L.global_l1_loss(p, p, grid2d, reduction="max")
    with pytest.raises(TypeError, match="torch.Tensor"):
        L.global_sum([1.0], grid2d)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ProcessGrid"):
        L.global_mean(p, grid2d.comm)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not an axis"):
        L.global_sum(p, grid2d, axes=(5,))
    if grid2d.size > 1:  # wrong on the last rank only: every rank raises, none waits
        last = grid2d.rank == grid2d.size - 1
        with pytest.raises(ValueError, match=r"same batch size on every rank, got \[2, 3\]"):
            L.relative_l2_error(
                torch.zeros(3 if last else 2, 3, dtype=F64), torch.ones(3 if last else 2, 3), grid2d, per_sample=True
            )
        with pytest.raises((TypeError, ValueError), match="torch.Tensor|invalid input"):
            L.global_mse_loss(p, p.numpy() if last else p, grid2d)  # type: ignore[arg-type]
        with pytest.raises((TypeError, ValueError), match="torch.Tensor|invalid input"):
            L.global_sum(None if last else p, grid2d)  # type: ignore[arg-type]
    # the collective still works afterwards
    assert_allclose(grid2d, L.global_sum(torch.ones(2, dtype=F64), grid2d), torch.tensor(2.0 * grid2d.size))


@pytest.mark.mpi
def test_integer_and_bool_reductions(grid2d) -> None:  # type: ignore[no-untyped-def]
    """Sums of bool/int blocks are int64 (as torch.sum); means of them are float64 (torch refuses)."""
    b = torch.tensor([True, True, False])
    i = torch.tensor([1, 2], dtype=torch.int8)
    s, m = L.global_sum(b, grid2d), L.global_mean(i, grid2d)
    assert_all(grid2d, s.dtype == torch.int64 and int(s) == 2 * grid2d.size, f"bool sum {s}")
    assert_all(grid2d, m.dtype == torch.float64 and float(m) == 1.5, f"int mean {m}")
    big = L.global_sum(torch.full((3,), 100, dtype=torch.int8), grid2d)  # 300 * size overflows int8
    assert_all(grid2d, int(big) == 300 * grid2d.size, f"int8 sum {big}")


def test_single_rank_grid_is_local() -> None:
    from mpi4py import MPI

    with hpctp.ProcessGrid((1,), comm=MPI.COMM_SELF) as g, hpctp.CommCounter() as cc:
        x = field((2, 5), 0)
        torch.testing.assert_close(L.global_mse_loss(x, 2 * x, g), torch.nn.functional.mse_loss(x, 2 * x))
    assert cc.calls == {}
