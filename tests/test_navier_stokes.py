"""The 2-D Navier-Stokes solver (apps/simulate/navier_stokes.py) against exact solutions (Taylor-Green
decay, a forced single mode), a single-process numpy implementation of the same scheme, and itself on
one process; its random initial field, diagnostics and config path."""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np
import pytest

import hpctp
from apps.common.config import load_config
from apps.simulate.navier_stokes import NavierStokes2D
from apps.simulate.run import save_snapshots, simulate
from hpctp.cli.log import get_logger
from hpctp.tensor.random import block_normal
from hpctp.testing import assert_all, assert_allclose

NS = Path(__file__).resolve().parent.parent / "apps" / "configs" / "ns.toml"
K = 2.0 * np.pi

# the scheme's constants, written out again (Spalart, Moser & Rogers 1991)
GAMMA = (8 / 15, 5 / 12, 3 / 4)
ZETA = (0.0, -17 / 60, -5 / 12)


def _coords(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    return np.meshgrid(np.arange(h) / h, np.arange(w) / w, indexing="ij")


def _taylor_green(h: int, w: int, nu: float, t: float) -> np.ndarray:
    """w = 2 k cos(k x) cos(k y) exp(-2 nu k^2 t), k = 2 pi: an exact solution (u . grad w = 0)."""
    x, y = _coords(h, w)
    return 2 * K * np.cos(K * x) * np.cos(K * y) * np.exp(-2 * nu * K * K * t)


def _field(w: np.ndarray, grid: hpctp.ProcessGrid) -> hpctp.DistTensor:
    return hpctp.distribute(np.ascontiguousarray(w), grid, (0, 1))


def _solo(grid: hpctp.ProcessGrid) -> hpctp.ProcessGrid:
    return hpctp.ProcessGrid([1, 1], comm=grid.comm.Split(grid.rank, 0))


def _numpy_solver(
    w0: np.ndarray, nu: float, amp: float, cfl: float, t_end: float, dt: float | None = None
) -> tuple[np.ndarray, int]:
    """The scheme on the whole field with numpy's FFTs: SMR RK3 (Crank-Nicolson viscosity), 2/3 rule,
    dt = cfl / max(|u| / dx + |v| / dy) taken at each step's first stage, shortened evenly to land on t_end."""
    h, w = w0.shape
    kx = np.fft.fftfreq(h, 1 / h)[:, None]
    ky = np.fft.rfftfreq(w, 1 / w)[None, :]
    k2 = K * K * (kx * kx + ky * ky)
    inv = np.divide(1.0, k2, out=np.zeros_like(k2), where=k2 != 0)
    dx = 1j * K * np.where(2 * np.abs(kx) == h, 0, kx)
    dy = 1j * K * np.where(2 * np.abs(ky) == w, 0, ky)
    keep = (3 * np.abs(kx) < h) & (3 * np.abs(ky) < w)
    x, y = _coords(h, w)
    f_hat = np.fft.rfft2(amp * (np.sin(K * (x + y)) + np.cos(K * (x + y))))
    w_hat = np.fft.rfft2(w0)
    t, steps = 0.0, 0
    while t < t_end:
        prev = w_hat
        step = 0.0
        for k in range(3):
            psi = w_hat * inv
            u = np.fft.irfft2(dy * psi, s=(h, w))
            v = np.fft.irfft2(-dx * psi, s=(h, w))
            adv = u * np.fft.irfft2(dx * w_hat, s=(h, w)) + v * np.fft.irfft2(dy * w_hat, s=(h, w))
            nl = f_hat - keep * np.fft.rfft2(adv)
            if k == 0:
                limit = dt if dt is not None else cfl / float(np.max(np.abs(u) * h + np.abs(v) * w))
                left = t_end - t
                step = left if limit >= left else left / max(1, math.ceil(left / limit - 1e-9))
            c = (GAMMA[k] + ZETA[k]) / 2 * step * nu * k2
            w_hat = ((1 - c) * w_hat + GAMMA[k] * step * nl + ZETA[k] * step * prev) / (1 + c)
            prev = nl
        t = t_end if t_end - (t + step) <= 1e-12 * max(1.0, t_end) else t + step
        steps += 1
    return np.fft.irfft2(w_hat, s=(h, w)), steps


@pytest.mark.mpi
def test_taylor_green_decay_matches_the_exact_solution(grid2d: hpctp.ProcessGrid) -> None:
    """Unforced, CFL-adaptive steps at the default cfl: relative error < 1e-8 after one time unit."""
    n, nu, t = 32, 1e-3, 1.0
    with NavierStokes2D((n, n), grid2d, viscosity=nu, forcing=0.0) as model:
        state = model.state_from(_field(_taylor_green(n, n, nu, 0.0), grid2d))
        steps = model.advance(state, t)
        got = model.vorticity(state)
        assert_all(grid2d, got.layout == hpctp.Layout((1, n, n), grid2d.dims, (None, 0, 1)), "snapshot layout")
        got = got.gather(None)[0]
        exact = _taylor_green(n, n, nu, t)
        err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        assert_all(grid2d, bool(err < 1e-8), f"Taylor-Green relative error {err:.3e} after {steps} steps")
        # CFL-adaptive: max(|u| / dx + |v| / dy) = n exp(-2 nu k^2 t), so between t n e^.. / cfl and t n / cfl steps
        lo, hi = t * n * math.exp(-2 * nu * K * K * t) / model.cfl, t * n / model.cfl + 1
        assert_all(grid2d, lo <= steps <= hi and state.t == t, f"{steps} steps, not in [{lo:.1f}, {hi:.1f}]")


@pytest.mark.mpi
def test_taylor_green_error_is_second_order_in_dt(grid2d: hpctp.ProcessGrid) -> None:
    """With a given dt the error is the time scheme's: it falls by 4 when dt halves."""
    n, nu, t = 8, 0.05, 0.4
    errs = []
    with NavierStokes2D((n, n), grid2d, viscosity=nu, forcing=0.0) as model:
        for dt in (0.1, 0.05):
            state = model.state_from(_field(_taylor_green(n, n, nu, 0.0), grid2d))
            steps = model.advance(state, t, dt=dt)
            assert_all(grid2d, steps == round(t / dt), f"{steps} steps of dt={dt} over {t}")
            got = model.vorticity(state).gather(None)[0]
            exact = _taylor_green(n, n, nu, t)
            errs.append(np.linalg.norm(got - exact) / np.linalg.norm(exact))
    assert_all(grid2d, bool(3.6 < errs[0] / errs[1] < 4.4 and errs[0] < 1e-2), f"errors {errs}")


@pytest.mark.mpi
def test_forced_mode_matches_the_exact_solution(grid2d: hpctp.ProcessGrid) -> None:
    """From rest, Li et al.'s forcing alone drives w = f / (nu |k|^2) (1 - exp(-nu |k|^2 t)) exactly (it
    depends on x + y only, so u . grad w = 0); max_dt bounds the step of a field at rest."""
    n, nu, amp, t = 12, 0.01, 0.1, 1.0
    with NavierStokes2D((n, n), grid2d, viscosity=nu, forcing=amp, max_dt=0.05) as model:
        state = model.state_from(_field(np.zeros((n, n)), grid2d))
        steps = model.advance(state, t)
        got = model.vorticity(state).gather(None)[0]
    x, y = _coords(n, n)
    lam = nu * 2 * K * K
    exact = amp * (np.sin(K * (x + y)) + np.cos(K * (x + y))) / lam * (1 - math.exp(-lam * t))
    err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    # second order: about (nu |k|^2 dt)^2 / 100 = 1.6e-5 here
    assert_all(grid2d, bool(steps == 20 and err < 3e-5), f"forced mode: {steps} steps, relative error {err:.3e}")


@pytest.mark.mpi
def test_solver_equals_numpy_and_one_process(grid2d: hpctp.ProcessGrid) -> None:
    """Li et al.'s problem from their random field on an uneven, non-square grid: the distributed solver
    equals a numpy implementation of the scheme on the gathered field and the solver on one process."""
    shape, nu, amp, t = (20, 18), 1e-3, 0.1, 0.3
    with NavierStokes2D(shape, grid2d, viscosity=nu, forcing=amp) as model:
        state = model.initial_state(seed=5)
        state = model.state_from(model.vorticity(state) * 20.0)  # a stronger, faster flow: more steps
        start = model.vorticity(state).gather(None)[0]
        steps = model.advance(state, t)
        got = model.vorticity(state).gather(None)[0]
    want, want_steps = _numpy_solver(start, nu, amp, model.cfl, t)
    assert_all(grid2d, steps == want_steps and steps > 3, f"{steps} steps, numpy {want_steps}")
    assert_allclose(grid2d, got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max(), what="vs numpy")
    with _solo(grid2d) as solo, NavierStokes2D(shape, solo, viscosity=nu, forcing=amp) as one:
        ref = one.state_from(one.vorticity(one.initial_state(seed=5)) * 20.0)
        one.advance(ref, t)
        alone = one.vorticity(ref).local[0]
    assert_allclose(grid2d, got, alone, rtol=0, atol=0, what="vs one process (bitwise)")


@pytest.mark.mpi
def test_initial_field_is_li_et_al_and_the_same_on_any_grid(grid2d: hpctp.ProcessGrid) -> None:
    """The Gaussian random field: white noise of the seed filtered by sqrt(2 H W) 7^(3/2) (4 pi^2 |k|^2 + 49)^(-5/4)
    with zero mean, computed on the whole field with numpy; and the distributed field equals one process's."""
    h, w = 16, 10
    with NavierStokes2D((h, w), grid2d) as model:
        got = model.vorticity(model.initial_state(seed=11)).gather(None)[0]
    noise = block_normal((1, h, w), [(0, 1), (0, h), (0, w)], 11)[0]
    kx = np.fft.fftfreq(h, 1 / h)[:, None]
    ky = np.fft.rfftfreq(w, 1 / w)[None, :]
    k2 = K * K * (kx * kx + ky * ky)
    filt = np.where(k2 == 0, 0.0, math.sqrt(2 * h * w) * 7**1.5 * (k2 + 49.0) ** -1.25)
    want = np.fft.irfft2(np.fft.rfft2(noise) * filt, s=(h, w))
    assert_allclose(grid2d, got, want, rtol=1e-12, atol=1e-14, what="GRF vs numpy")
    assert_all(grid2d, abs(got.mean()) < 1e-15 and got.std() > 0.05, f"mean {got.mean()}, std {got.std()}")
    with _solo(grid2d) as solo, NavierStokes2D((h, w), solo) as one:
        alone = one.vorticity(one.initial_state(seed=11)).local[0]
    assert_allclose(grid2d, got, alone, rtol=0, atol=0, what="GRF on one process (bitwise)")


@pytest.mark.mpi
def test_energy_and_enstrophy(grid2d: hpctp.ProcessGrid) -> None:
    """The diagnostics equal numpy's on the gathered field; without forcing both decay monotonically."""
    n, nu = 16, 5e-3
    with NavierStokes2D((n, n), grid2d, viscosity=nu, forcing=0.0) as model:
        state = model.initial_state(seed=2)
        w = model.vorticity(state).gather(None)[0]
        w_hat = np.fft.rfft2(w)
        kx = np.fft.fftfreq(n, 1 / n)[:, None]
        ky = np.fft.rfftfreq(n, 1 / n)[None, :]
        k2 = K * K * (kx * kx + ky * ky)
        psi = np.divide(w_hat, k2, out=np.zeros_like(w_hat), where=k2 != 0)
        u = np.fft.irfft2(1j * K * np.where(2 * ky == n, 0, ky) * psi, s=(n, n))  # (odd derivatives: no Nyquist)
        v = np.fft.irfft2(-1j * K * np.where(2 * np.abs(kx) == n, 0, kx) * psi, s=(n, n))
        assert_allclose(grid2d, model.enstrophy(state), 0.5 * np.mean(w * w), rtol=1e-12, what="enstrophy")
        assert_allclose(grid2d, model.energy(state), 0.5 * np.mean(u * u + v * v), rtol=1e-12, what="energy")
        history = [(model.energy(state), model.enstrophy(state))]
        for _ in range(3):
            model.advance(state, 0.5)
            history.append((model.energy(state), model.enstrophy(state)))
    e, z = np.array(history).T
    assert_all(grid2d, bool(np.all(np.diff(e) < 0) and np.all(np.diff(z) < 0)), f"energy {e}, enstrophy {z}")


@pytest.mark.mpi
def test_bad_arguments_raise_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    with pytest.raises(ValueError, match="cfl"):
        NavierStokes2D((8, 8), grid2d, cfl=0.0)
    with pytest.raises(ValueError, match="shape"):
        NavierStokes2D((8, 2), grid2d)
    with NavierStokes2D((8, 8), grid2d) as model:
        state = model.initial_state(seed=1)
        model.advance(state, 0.1)
        with pytest.raises(ValueError, match="target time"):
            model.step_to(state, 0.05)
        with pytest.raises(ValueError, match="does not fit"):
            model.state_from(hpctp.zeros((8, 6), grid2d, (0, 1)))


@pytest.mark.mpi
def test_config_path_writes_vorticity_snapshots(
    grid2d: hpctp.ProcessGrid, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``pde = "navier_stokes"`` through apps.simulate.run: ``[T, 1, H, W]`` under ``fields``, snapshot i
    the solver's state at warmup + i * snapshot_every."""
    sets = [
        "simulation.size=[12, 10]",
        "simulation.snapshots=3",
        "simulation.warmup=0.25",
        "simulation.snapshot_every=0.125",
    ]
    cfg = load_config(NS, sets)["simulation"]
    cfg["grid"] = list(grid2d.dims)
    tmp = np.zeros(256, dtype=np.uint8)  # one directory for all ranks, chosen by rank 0
    if grid2d.rank == 0:
        raw = str(tmp_path_factory.mktemp("ns")).encode()
        tmp[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    grid2d.comm.Bcast(tmp, root=0)
    path = str(Path(tmp.tobytes().rstrip(b"\0").decode()) / "sim.h5")
    snaps = simulate(cfg, grid2d, get_logger("test", grid2d), progress=False)
    save_snapshots(snaps, path, cfg)
    grid2d.comm.Barrier()
    with h5py.File(path, "r") as f:
        data = f["fields"][...]
        pde = f["fields"].attrs["pde"]
    with NavierStokes2D((12, 10), grid2d, viscosity=cfg["viscosity"], forcing=cfg["forcing"], cfl=cfg["cfl"]) as model:
        state = model.initial_state(cfg["seed"])
        model.step_to(state, 0.25)
        first = model.vorticity(state).gather(None)
        model.step_to(state, 0.375)
        model.step_to(state, 0.5)
        last = model.vorticity(state).gather(None)
    assert_all(grid2d, data.shape == (3, 1, 12, 10) and pde == "navier_stokes", f"{data.shape}, {pde}")
    assert_allclose(grid2d, data[0], first, rtol=0, atol=0, what="snapshot 0")
    assert_allclose(grid2d, data[2], last, rtol=0, atol=0, what="snapshot 2")
