"""2-D incompressible Navier-Stokes in vorticity form on the periodic unit square, pseudo-spectral.

    dw/dt + u . grad w = nu lap w + f,    u = (d psi / dy, -d psi / dx),    -lap psi = w

on ``[0, 1)^2`` (dim 0 of a field is ``x``, dim 1 is ``y``), with the forcing of Li et al. (2021,
the Fourier neural operator paper) ``f = A (sin 2 pi (x + y) + cos 2 pi (x + y))``, ``A = 0.1``,
and their Gaussian random field as initial vorticity.

Discretisation
    Fourier pseudo-spectral with :mod:`hpctp.fft`: the state is the half spectrum ``w_hat``
    (``rfftn`` over the two space dims) distributed over the grid's ranks. The nonlinear term
    is ``u w_x + v w_y`` evaluated in physical space (``u``, ``v``, ``w_x``, ``w_y`` in one
    batched ``irfftn``, the product in one ``rfftn``) and dealiased with the 2/3 rule (modes
    with ``3 |k| >= n`` along either axis dropped from it). Odd derivatives drop the Nyquist mode.

Time stepping
    The low-storage IMEX Runge-Kutta scheme of Spalart, Moser & Rogers (1991): three explicit
    RK3 stages for advection and forcing, Crank-Nicolson for the viscous term within each
    stage (third order for the explicit part, second order overall; the implicit solve is a
    division per mode). The time step is CFL-adaptive: ``dt = cfl / max(|u| / dx + |v| / dy)``
    over the field (one ``Allreduce`` of the max, so every rank takes the same ``dt``), taken at
    the start of each step; the steps to an output time are shortened evenly so that the
    output time is hit exactly (``advance``/``step_to`` never overshoot).

Decomposition
    The caller's grid (2-D, as Gray-Scott's: ``[H, W]`` cut over both axes) is merged into a
    1-D grid of the same ranks, on which the field lives in slabs: physical fields split along
    ``x``, spectra along ``k_y``. A 2-D field cut over both grid axes has no third dim to take a
    grid axis, so :func:`hpctp.fft.rfftn` runs it on that merged grid anyway; keeping it there
    between transforms makes each transform one ``Alltoallv``, where a round trip through the
    2-D layout would cost three. :meth:`NavierStokes2D.vorticity` hands the field back in the
    grid's own ``(None, 0, 1)`` layout (snapshots, the surrogate).

Reproducibility
    Every mode is updated with the same operations on any decomposition; the random initial
    field is white noise that depends only on ``(seed, global index)``
    (:func:`hpctp.random.normal`) filtered in spectral space; ``dt`` is an exact all-reduced max. The
    solution on any rank count equals one process's to rounding of the FFTs (in practice to
    the bit on the grids tested).

Config keys (``[simulation]`` with ``pde = "navier_stokes"``): ``size`` ``[H, W]``,
``viscosity``, ``forcing`` (amplitude A; 0 for none), ``cfl``, ``snapshot_every`` (time units
between snapshots, a float), ``warmup`` (time before the first snapshot), ``snapshots``
(count), ``seed`` (initial field), ``grid``, ``out``, optionally ``max_dt``; see ``apps/configs/ns.toml``.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

import hpctp
from hpctp import comm as C
from hpctp.fft import frequencies, hermitian_weights, irfftn, rfftn

__all__ = ["NSState", "NavierStokes2D", "simulate_navier_stokes"]

# Spalart, Moser & Rogers (1991), appendix A: u_{k+1} = u_k + dt (gamma_k N_k + zeta_k N_{k-1})
# + dt (alpha_k L u_k + beta_k L u_{k+1}); alpha_k = beta_k = (gamma_k + zeta_k) / 2 (Crank-Nicolson).
_GAMMA = (8.0 / 15.0, 5.0 / 12.0, 3.0 / 4.0)
_ZETA = (0.0, -17.0 / 60.0, -5.0 / 12.0)
_HALF = tuple((g + z) / 2.0 for g, z in zip(_GAMMA, _ZETA))

# Li et al.'s GaussianRF(2, s, alpha=2.5, tau=7): covariance sigma^2 (-lap + tau^2)^-alpha, sigma = tau^(alpha - 1)
_GRF_ALPHA = 2.5
_GRF_TAU = 7.0


@dataclass
class NSState:
    """Local. A solution of :class:`NavierStokes2D`: its vorticity spectrum and where it is in time.

    Attributes
    ----------
    w_hat : DistTensor
        ``rfftn`` of the vorticity over its two space dims, ``[1, H, W // 2 + 1]`` complex128 on
        the solver's slab grid (the layout :meth:`NavierStokes2D.initial_state` gives).
    t : float
        Time.
    steps : int
        Time steps taken since the state was made (each of three Runge-Kutta stages).
    """

    w_hat: hpctp.DistTensor
    t: float = 0.0
    steps: int = 0


class NavierStokes2D:
    """Collective over grid. The solver for one field size on one grid: wavenumbers, dealiasing
    mask and forcing spectrum of this rank's block, computed once.

    Parameters
    ----------
    shape : (int, int)
        ``(H, W)``: grid points along ``x`` and ``y`` (``dx = 1 / H``, ``dy = 1 / W``), each >= 4.
    grid : ProcessGrid
        1-D or 2-D; the snapshots are ``[1, H, W]`` split ``(None, 0, 1)`` over it (``(None, 0, None)`` on 1-D).
    viscosity : float
        ``nu >= 0``.
    forcing : float
        Amplitude ``A`` of ``A (sin 2 pi (x + y) + cos 2 pi (x + y))`` (Li et al.: 0.1); 0 for none.
    cfl : float
        ``dt = cfl / max(|u| / dx + |v| / dy)``, in ``(0, 2]``. The explicit RK3 part is stable for
        ``|lambda dt| <= sqrt(3)``; advection on the 2/3-dealiased spectrum has ``|lambda| <=
        (2 pi / 3) max(|u| / dx + |v| / dy)``, so ``cfl <= 3 sqrt(3) / (2 pi) = 0.83`` is stable for
        any flow. The default 0.8 is just under that bound.
    max_dt : float, optional
        Upper bound on the step (e.g. for a field at rest, whose CFL step is infinite).

    Raises
    ------
    ValueError, TypeError
        On every rank, on bad parameters or parameters that differ between ranks.
    """

    def __init__(
        self,
        shape: Sequence[int],
        grid: hpctp.ProcessGrid,
        viscosity: float = 1e-3,
        forcing: float = 0.1,
        cfl: float = 0.8,
        max_dt: float | None = None,
    ) -> None:
        error: Exception | None = None
        try:
            if not isinstance(grid, hpctp.ProcessGrid):
                raise TypeError(f"grid must be a hpctp.ProcessGrid, got {type(grid).__name__}")
            if grid.ndim not in (1, 2):
                raise ValueError(f"NavierStokes2D needs a 1-D or 2-D grid, got dims {grid.dims}")
            shp = tuple(int(s) for s in shape)
            if len(shp) != 2 or any(s < 4 for s in shp) or shp != tuple(shape):
                raise ValueError(f"shape must be two ints >= 4 (H, W), got {tuple(shape)!r}")
            if not (math.isfinite(viscosity) and viscosity >= 0):
                raise ValueError(f"viscosity must be finite and >= 0, got {viscosity!r}")
            if not math.isfinite(forcing):
                raise ValueError(f"forcing must be a finite amplitude, got {forcing!r}")
            if not (math.isfinite(cfl) and 0 < cfl <= 2):
                raise ValueError(f"cfl must be in (0, 2] (stable for any flow up to 0.83), got {cfl!r}")
            if max_dt is not None and not (math.isfinite(max_dt) and max_dt > 0):
                raise ValueError(f"max_dt must be None or a positive number, got {max_dt!r}")
        except (TypeError, ValueError) as e:
            error = e
        if not isinstance(grid, hpctp.ProcessGrid):
            raise error if error is not None else TypeError("grid must be a hpctp.ProcessGrid")
        C.agree_arguments(
            grid.comm, "NavierStokes2D", error, shape=shape, viscosity=viscosity, forcing=forcing, cfl=cfl,
            max_dt=max_dt,
        )  # fmt: skip
        self.grid = grid
        self.shape: tuple[int, int] = (int(shape[0]), int(shape[1]))
        self.viscosity = float(viscosity)
        self.forcing = float(forcing)
        self.cfl = float(cfl)
        self.max_dt = None if max_dt is None else float(max_dt)
        h, w = self.shape
        self.slab = hpctp.ProcessGrid((grid.size,), comm=grid.comm)  # the same ranks, in row-major order
        self.layout = hpctp.Layout((1, h, w), grid.dims, (None, 0, 1) if grid.ndim == 2 else (None, 0, None))
        self._phys = hpctp.Layout((1, h, w), self.slab.dims, (None, 0, None))
        (x0, x1), (y0, y1) = self._phys.local_ranges(self.slab.coords)[1:]
        xs = (np.arange(x0, x1, dtype=np.float64) / h)[:, None]
        ys = (np.arange(y0, y1, dtype=np.float64) / w)[None, :]
        phase = 2.0 * np.pi * (xs + ys)
        f = self.forcing * (np.sin(phase) + np.cos(phase))
        f_hat = rfftn(hpctp.DistTensor(f[None], self.slab, self._phys), axes=(1, 2), out_split="any")
        self._spec = f_hat.layout
        self._f_hat = f_hat.local
        self._spec4 = hpctp.Layout((4, h, w // 2 + 1), self.slab.dims, self._spec.split, (None, *self._spec.cuts[1:]))
        self._phys_of: dict[hpctp.Layout, hpctp.Layout] = {}
        kx, ky = frequencies(f_hat, axes=(1, 2), d=(1.0 / h, 1.0 / w), n=w)  # integer wavenumbers
        kx, ky = np.asarray(kx), np.asarray(ky)
        self._k2 = (2.0 * np.pi) ** 2 * (kx * kx + ky * ky)  # |k|^2 of the unit box, [1, H, w_block]
        self._inv_k2 = np.divide(1.0, self._k2, out=np.zeros_like(self._k2), where=self._k2 != 0)
        self._dx = 2j * np.pi * np.where(2 * np.abs(kx) == h, 0.0, kx)  # d/dx, Nyquist dropped
        self._dy = 2j * np.pi * np.where(2 * np.abs(ky) == w, 0.0, ky)
        self._mask = ((3 * np.abs(kx) < h) & (3 * np.abs(ky) < w)).astype(np.float64)  # the 2/3 rule
        self._lam = self.viscosity * self._k2
        self._weights = np.asarray(hermitian_weights(w))[self._spec.local_slices(self.slab.coords)[2]][None, None, :]
        self._u2 = (np.abs(self._dx) ** 2 + np.abs(self._dy) ** 2) * self._inv_k2**2  # |u_hat|^2 / |w_hat|^2
        self._rates = (float(h), float(w))  # 1 / dx, 1 / dy

    def close(self) -> None:
        """Collective over grid. Release the slab grid's communicators."""
        self.slab.free()

    def __enter__(self) -> NavierStokes2D:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ states
    def initial_state(self, seed: int) -> NSState:
        """Collective over grid. Li et al.'s random initial vorticity, the same on any grid.

        ``w0 ~ N(0, sigma^2 (-lap + tau^2 I)^-alpha)`` with ``alpha = 2.5``, ``tau = 7``,
        ``sigma = tau^(alpha - 1) = 7^(3/2)`` and zero mean, scaled as their ``GaussianRF``
        generator: real white noise (:func:`hpctp.random.normal`, a function of the seed and the global
        index only) filtered by ``sqrt(2 H W) sigma (4 pi^2 |k|^2 + tau^2)^(-alpha / 2)``.

        Parameters
        ----------
        seed : int
            Non-negative.

        Returns
        -------
        NSState
            At ``t = 0``.
        """
        h, w = self.shape
        noise = hpctp.random.normal((1, h, w), self.slab, (None, 0, None), seed)
        spec = self._to_spectrum(noise)
        sigma = _GRF_TAU ** (_GRF_ALPHA - 1.0)
        filt = math.sqrt(2.0 * h * w) * sigma * (self._k2 + _GRF_TAU**2) ** (-_GRF_ALPHA / 2.0)
        filt = np.where(self._k2 == 0, 0.0, filt)
        return NSState(spec.with_local(spec.local * filt))

    def state_from(self, vorticity: hpctp.DistTensor, t: float = 0.0) -> NSState:
        """Collective over grid. The state of a given vorticity field.

        Parameters
        ----------
        vorticity : DistTensor
            ``[H, W]`` or ``[1, H, W]`` real, on this solver's grid (any layout).
        t : float
            Its time.

        Raises
        ------
        ValueError
            If the shape or grid does not fit (on every rank).
        """
        error = None
        h, w = self.shape
        if not isinstance(vorticity, hpctp.DistTensor):
            raise TypeError(f"vorticity must be a hpctp.DistTensor, got {type(vorticity).__name__}")
        if vorticity.global_shape not in ((h, w), (1, h, w)) or vorticity.grid.dims != self.grid.dims:
            error = ValueError(
                f"vorticity of shape {vorticity.global_shape} on grid {vorticity.grid.dims} does not fit the solver's "
                f"[{h}, {w}] on {self.grid.dims}"
            )
        C.raise_if_any(self.grid.comm, error)
        target = hpctp.Layout(
            vorticity.global_shape, self.slab.dims, (0, None) if vorticity.ndim == 2 else (None, 0, None)
        )
        field = vorticity.redistribute(target, grid=self.slab)
        block = np.ascontiguousarray(np.asarray(field.local, dtype=np.float64)).reshape(
            self._phys.local_shape(self.slab.coords)
        )
        return NSState(self._to_spectrum(hpctp.DistTensor(block, self.slab, self._phys)), float(t))

    def _to_spectrum(self, x: hpctp.DistTensor) -> hpctp.DistTensor:
        y = rfftn(x, axes=(1, 2), out_split="any")
        return y if y.layout == self._spec else y.redistribute(self._spec)

    def vorticity(self, state: NSState) -> hpctp.DistTensor:
        """Collective over grid. The vorticity ``[1, H, W]`` (float64, numpy blocks) in the grid's own
        layout :attr:`layout` (``(None, 0, 1)``: a Gray-Scott-style snapshot)."""
        x = irfftn(state.w_hat, n=self.shape[1], axes=(1, 2), out_split="any")
        return x.redistribute(self.layout, grid=self.grid)

    def _spectral_sum(self, values: np.ndarray) -> float:
        """Collective. ``sum |f|^2 / (H W)^2`` over the full spectrum, from the half one in ``values``."""
        local = np.array([float((values * self._weights).sum())])
        C.allreduce(self.slab.comm, local, "sum")
        h, w = self.shape
        return float(local[0]) / float(h * w) ** 2

    def enstrophy(self, state: NSState) -> float:
        """Collective over grid. ``mean(w^2) / 2`` over the box (Parseval on the spectrum)."""
        return 0.5 * self._spectral_sum(np.abs(state.w_hat.local) ** 2)

    def energy(self, state: NSState) -> float:
        """Collective over grid. Kinetic energy ``mean(|u|^2) / 2`` over the box (of the solver's
        velocity, whose odd derivatives drop the Nyquist modes)."""
        return 0.5 * self._spectral_sum(np.abs(state.w_hat.local) ** 2 * self._u2)

    # ------------------------------------------------------------------ time stepping
    def _nonlinear(self, w_hat: np.ndarray, want_rate: bool) -> tuple[np.ndarray, float]:
        """Collective. ``f - P(u w_x + v w_y)`` (P: the 2/3-rule mask) of the block ``w_hat``, and,
        if ``want_rate``, this rank's ``max(|u| / dx + |v| / dy)``."""
        psi = w_hat * self._inv_k2
        fields = np.empty((4, *w_hat.shape[1:]), dtype=np.complex128)
        np.multiply(self._dy[0], psi[0], out=fields[0])  # u = d psi / dy
        np.multiply(self._dx[0], psi[0], out=fields[1])
        np.negative(fields[1], out=fields[1])  # v = -d psi / dx
        np.multiply(self._dx[0], w_hat[0], out=fields[2])  # w_x
        np.multiply(self._dy[0], w_hat[0], out=fields[3])  # w_y
        phys = irfftn(hpctp.DistTensor(fields, self.slab, self._spec4), n=self.shape[1], axes=(1, 2), out_split="any")
        u, v, wx, wy = phys.local
        adv = u * wx
        adv += v * wy
        lay = self._phys_of.get(phys.layout)
        if lay is None:
            lay = self._phys_of.setdefault(
                phys.layout, hpctp.Layout((1, *self.shape), self.slab.dims, phys.split, (None, *phys.layout.cuts[1:]))
            )
        a_hat = self._to_spectrum(hpctp.DistTensor(adv[None], self.slab, lay)).local
        out = self._f_hat - self._mask * a_hat
        rate = 0.0
        if want_rate and u.size:
            rate = float(np.max(np.abs(u) * self._rates[0] + np.abs(v) * self._rates[1]))
        return out, rate

    def _step_size(self, rate: float, remaining: float, dt: float | None) -> float:
        """Collective. The step: the fixed ``dt`` or the CFL one (max over the ranks), capped by
        ``max_dt`` and shortened evenly so that ``remaining`` is a whole number of steps."""
        if dt is None:
            r = np.array([rate if math.isfinite(rate) else math.inf])
            C.allreduce(self.slab.comm, r, "max")
            if not math.isfinite(float(r[0])):
                raise FloatingPointError(
                    f"NavierStokes2D: the velocity is not finite (the solution blew up); lower cfl (now {self.cfl})"
                )
            limit = self.cfl / float(r[0]) if r[0] > 0 else math.inf
        else:
            limit = dt
        if self.max_dt is not None:
            limit = min(limit, self.max_dt)
        if limit >= remaining:
            return remaining
        n = max(1, math.ceil(remaining / limit - 1e-9))
        return remaining / n

    def step_to(self, state: NSState, t: float, dt: float | None = None) -> int:
        """Collective over grid. Advance ``state`` in place to time ``t`` exactly.

        Parameters
        ----------
        state : NSState
        t : float
            Target time, ``>= state.t``.
        dt : float, optional
            A fixed step instead of the CFL-adaptive one (shortened evenly to land on ``t``).

        Returns
        -------
        int
            The number of time steps taken (each three Runge-Kutta stages, i.e. three
            nonlinear-term evaluations of five transforms).

        Raises
        ------
        ValueError
            If ``t`` is before ``state.t`` or not finite, ``dt`` not positive, ``state`` not of
            this solver, or the arguments differ between ranks (on every rank).
        FloatingPointError
            If the solution blows up (the CFL step is then not finite).
        """
        error: Exception | None = None
        if not isinstance(state, NSState) or state.w_hat.layout != self._spec:
            error = ValueError("step_to: state is not one of this solver's (make it with initial_state or state_from)")
        elif not (math.isfinite(t) and t >= state.t):
            error = ValueError(f"step_to: target time {t!r} must be finite and >= the state's time {state.t}")
        elif dt is not None and not (math.isfinite(dt) and dt > 0):
            error = ValueError(f"step_to: dt must be None (CFL-adaptive) or > 0, got {dt!r}")
        C.agree_arguments(self.grid.comm, "NavierStokes2D.step_to", error, t=t, dt=dt, start=getattr(state, "t", None))
        w = state.w_hat.local
        taken = 0
        while state.t < t:
            n_prev = np.empty(0)
            step = 0.0
            for k in range(3):
                nl, rate = self._nonlinear(w, want_rate=k == 0 and dt is None)
                if k == 0:
                    step = self._step_size(rate, t - state.t, dt)
                c = (_HALF[k] * step) * self._lam
                rhs = (1.0 - c) * w
                rhs += (_GAMMA[k] * step) * nl
                if k:
                    rhs += (_ZETA[k] * step) * n_prev
                w = rhs / (1.0 + c)
                n_prev = nl
            state.t = t if t - (state.t + step) <= 1e-12 * max(1.0, abs(t)) else state.t + step
            taken += 1
        state.w_hat = state.w_hat.with_local(w)
        state.steps += taken
        return taken

    def advance(self, state: NSState, duration: float, dt: float | None = None) -> int:
        """Collective over grid. Advance ``state`` in place by ``duration`` time units
        (:meth:`step_to` ``state.t + duration``); returns the number of time steps taken."""
        return self.step_to(state, state.t + float(duration), dt)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], grid: hpctp.ProcessGrid) -> NavierStokes2D:
        """Collective over grid. The solver of a ``[simulation]`` config section (``pde = "navier_stokes"``)."""
        return cls(
            tuple(cfg["size"]), grid, viscosity=float(cfg["viscosity"]), forcing=float(cfg["forcing"]),
            cfl=float(cfg.get("cfl", 0.8)), max_dt=cfg.get("max_dt"),
        )  # fmt: skip


def simulate_navier_stokes(
    cfg: dict[str, Any], grid: hpctp.ProcessGrid, log: Any, progress: bool = True
) -> hpctp.DistTensor:
    """Collective over grid. Run a ``[simulation]`` config with ``pde = "navier_stokes"``.

    Returns
    -------
    DistTensor
        ``[T, 1, H, W]`` (vorticity) split ``(None, None, 0, 1)``: snapshot ``i`` is the state at
        time ``warmup + i * snapshot_every`` from the random field of ``seed``; ``T = snapshots``.

    Raises
    ------
    ValueError
        On a bad ``snapshot_every``, ``warmup`` or ``snapshots`` (on every rank: the config is the same).
    """
    every, warmup, count = float(cfg["snapshot_every"]), float(cfg["warmup"]), int(cfg["snapshots"])
    if not (every > 0 and warmup >= 0 and count >= 1):
        raise ValueError(f"need snapshot_every > 0, warmup >= 0 and snapshots >= 1, got {every}, {warmup}, {count}")
    h, w = cfg["size"]
    t0 = time.perf_counter()
    with NavierStokes2D.from_config(cfg, grid) as model:
        state = model.initial_state(int(cfg["seed"]))
        model.step_to(state, warmup)
        first = model.vorticity(state)
        snaps = np.empty((count, *first.local.shape), dtype=np.float64)
        snaps[0] = first.local
        show = progress and grid.rank == 0 and sys.stderr.isatty()
        bar = tqdm(total=count - 1, desc="simulate", unit="snap", disable=not show)
        for i in range(1, count):
            model.step_to(state, warmup + i * every)
            snaps[i] = model.vorticity(state).local
            bar.update()
        bar.close()
        energy, enstrophy = model.energy(state), model.enstrophy(state)
        layout = hpctp.Layout((count, 1, h, w), grid.dims, (None, *model.layout.split))
    result = hpctp.DistTensor(snaps, grid, layout)
    log.info(
        "Navier-Stokes %dx%d, nu=%g: t = %g in %d steps (mean dt %.3g, cfl %g) on %s in %.2f s; %d snapshots; "
        "final energy %.4g, enstrophy %.4g",
        h, w, model.viscosity, state.t, state.steps, state.t / max(state.steps, 1), model.cfl, grid.dims,
        time.perf_counter() - t0, count, energy, enstrophy,
    )  # fmt: skip
    return result
