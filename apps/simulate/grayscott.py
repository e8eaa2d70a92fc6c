"""Gray-Scott reaction-diffusion on a block-decomposed periodic grid, stepped with halo exchanges.

u_t = Du lap(u) - u v^2 + F (1 - u),   v_t = Dv lap(v) + u v^2 - (F + k) v

Every element is updated with the same floating-point operations in the same order on
any decomposition, so results are bitwise identical on any rank count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import hpctp
from hpctp.halo import HaloExchange
from hpctp.tensor.random import block_uniform

__all__ = ["GrayScott", "initial_state"]


def initial_state(shape: tuple[int, int], grid: hpctp.ProcessGrid, seed: int, seeds: int) -> hpctp.DistTensor:
    """Local. u = 1, v = 0 with ``seeds`` square patches (u=0.5, v=0.25) at seeded positions.

    The state is a ``[2, H, W]`` DistTensor split ``(None, 0, 1)``; patch positions come
    from a grid-independent generator, so the state is the same on any rank count.
    """
    h, w = shape
    state = hpctp.zeros((2, h, w), grid, (None, 0, 1))
    state.local[0] = 1.0
    pos = block_uniform((seeds, 2), [(0, seeds), (0, 2)], seed)  # same on every rank
    r = max(2, min(h, w) // 16)
    (y0, y1), (x0, x1) = state.layout.local_ranges(grid.coords)[1:]
    ys = np.arange(y0, y1)[:, None]
    xs = np.arange(x0, x1)[None, :]
    for py, px in pos:
        cy, cx = int(py * h), int(px * w)
        dy = np.minimum(np.abs(ys - cy), h - np.abs(ys - cy))  # periodic distance
        dx = np.minimum(np.abs(xs - cx), w - np.abs(xs - cx))
        mask = (dy <= r) & (dx <= r)
        state.local[0][mask] = 0.5
        state.local[1][mask] = 0.25
    return state


@dataclass
class GrayScott:
    """Local. Parameters of the model; :meth:`step` advances a distributed state.

    Attributes
    ----------
    du, dv : float
        Diffusion coefficients.
    feed, kill : float
        Feed and kill rates.
    dt : float
        Time step (explicit Euler; stable for ``dt * max(du, dv) <= 0.25``).
    """

    du: float = 0.16
    dv: float = 0.08
    feed: float = 0.035
    kill: float = 0.065
    dt: float = 1.0

    def __post_init__(self) -> None:
        if self.dt * max(self.du, self.dv) > 0.25:
            raise ValueError(
                f"dt={self.dt} with diffusion {max(self.du, self.dv)} is unstable for explicit Euler; "
                f"use dt <= {0.25 / max(self.du, self.dv):.3g}"
            )
        self._halo: HaloExchange | None = None

    def _exchange(self, state: hpctp.DistTensor) -> HaloExchange:
        if self._halo is None or self._halo.layout != state.layout or self._halo.grid is not state.grid:
            self._halo = HaloExchange(state, (0, 1, 1), boundary="periodic", stencil="star")
        return self._halo

    def step(self, state: hpctp.DistTensor, steps: int = 1) -> hpctp.DistTensor:
        """Collective over grid. Advance ``state`` (``[2, H, W]``, split ``(None, 0, 1)``) in place.

        The halo is in flight while the reaction terms (which need no neighbours) are computed.
        """
        halo = self._exchange(state)
        x = state.local
        for _ in range(steps):
            handle = halo.begin(x)
            u, v = x[0], x[1]
            uvv = u * v * v
            react_u = self.feed * (1.0 - u) - uvv
            react_v = uvv - (self.feed + self.kill) * v
            p = halo.end(handle)
            lap = p[:, :-2, 1:-1] + p[:, 2:, 1:-1] + p[:, 1:-1, :-2] + p[:, 1:-1, 2:] - 4.0 * p[:, 1:-1, 1:-1]
            x[0] = u + self.dt * (self.du * lap[0] + react_u)
            x[1] = v + self.dt * (self.dv * lap[1] + react_v)
        return state

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> GrayScott:
        """Local. Model from the ``[simulation]`` section of a config."""
        return cls(du=cfg["du"], dv=cfg["dv"], feed=cfg["feed"], kill=cfg["kill"], dt=cfg["dt"])
