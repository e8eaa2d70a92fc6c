"""The alpha-beta-gamma machine of the SUMMA and attention cost models (:mod:`hpctp.linalg.cost`).

A message of ``b`` bytes costs ``alpha + beta * b`` seconds, a flop ``gamma`` seconds; a local GEMM whose panel
width is ``w`` runs at the fraction ``w / (w + gemm_half)`` of its peak rate. A
:class:`~hpctp.machine.MachineProfile` gives one per link level and element type
(:meth:`~hpctp.machine.MachineProfile.cost_machine`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = ["Machine"]


@dataclass(frozen=True)
class Machine:
    """Local. Machine parameters of the alpha-beta-gamma model.

    Parameters
    ----------
    alpha : float
        Latency per message, seconds.
    beta : float
        Seconds per byte (inverse bandwidth of one rank's link).
    gamma : float
        Seconds per flop of one rank at peak GEMM speed.
    gemm_half : float
        Panel width at which a local GEMM reaches half of its peak rate.

    Raises
    ------
    TypeError
        If a parameter is not a real number.
    ValueError
        If a parameter is negative, NaN or infinite (or ``gamma`` not positive).
    """

    alpha: float = 2e-6
    beta: float = 1.0 / 5e9
    gamma: float = 1.0 / 1e10
    gemm_half: float = 16.0

    def __post_init__(self) -> None:
        values = {name: getattr(self, name) for name in ("alpha", "beta", "gamma", "gemm_half")}
        for name, v in values.items():
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"Machine.{name} must be a real number, got {type(v).__name__} {v!r}")
        if not all(math.isfinite(v) for v in values.values()):
            raise ValueError(f"machine parameters must be finite, got {self}")
        if min(self.alpha, self.beta, self.gemm_half) < 0 or self.gamma <= 0:
            raise ValueError(f"machine parameters must be >= 0 (gamma > 0), got {self}")
