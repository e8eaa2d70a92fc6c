"""Fourier layers (FNO) as modules: :class:`SpectralConv2d` and its 1-D and 3-D siblings.

The computation and its communication are described in :mod:`hpctp.nn.spectral.fourier`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..._util.ints import is_int
from ...comm import ProcessGrid, check_grid
from ..init import SeededReset, init_replicated
from ..spatial._inputs import full_split
from ..spatial.conv import _Spatial
from ..spatial.window_spec import ntuple
from .fourier import spectral_conv

__all__ = ["SpectralConv1d", "SpectralConv2d", "SpectralConv3d", "spectral_weight"]


def spectral_weight(in_channels: int, out_channels: int, modes: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Local. A Fourier layer's initial weight ``[C_in, C_out, 2 m_1, ..., m_d, 2]``, from the global RNG.

    Real and imaginary parts uniform in ``[0, 1 / (C_in C_out))`` (Li et al.), drawn on the
    CPU so that a seed gives the same values on any device. After ``torch.manual_seed(s)``
    this is the weight of ``SpectralConv*d(..., seed=s)``: a single-process reference built
    with it starts from the same values.
    """
    ks = tuple(2 * int(m) for m in modes[:-1]) + (int(modes[-1]),)
    w = torch.empty((in_channels, out_channels) + ks + (2,), dtype=dtype)
    return w.uniform_(0.0, 1.0 / (in_channels * out_channels))


class _SpectralConvNd(SeededReset, _Spatial, torch.nn.Module):
    _nd = 2
    weight: torch.nn.Parameter

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        modes: int | Sequence[int],
        *,
        grid: ProcessGrid,
        split: Sequence[int | None] | None = None,
        seed: int | None = None,
        dtype: torch.dtype | None = None,
        device: Any = None,
    ) -> None:
        grid = check_grid(grid)
        full_split(split, self._nd, grid.ndim)  # validate before any communication
        for name, v in (("in_channels", in_channels), ("out_channels", out_channels)):
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.modes = ntuple(modes, self._nd, "modes")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        torch.nn.Module.__init__(self)
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)

        def init() -> None:
            w = spectral_weight(self.in_channels, self.out_channels, self.modes, dtype)
            self.weight = torch.nn.Parameter(w.to(device))

        init_replicated(self, init, grid, seed)
        self._setup(grid, split, self._nd, overlap=False)
        # backward completes the weight's gradient over the grid axes that split the field
        self.weight.hpctp_grad_reduced = tuple(g for g in self.split if g is not None)  # type: ignore[attr-defined]

    def _draw_parameters(self) -> None:
        w = spectral_weight(self.in_channels, self.out_channels, self.modes, self.weight.dtype)
        self.weight.copy_(w)

    def forward(self, x: Any) -> Any:
        """Collective over grid. This rank's output block (see :func:`spectral_conv`)."""
        return spectral_conv(x, self.weight, grid=self.grid, split=self.split)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, modes={self.modes}" + self._grid_repr()


class SpectralConv1d(_SpectralConvNd):
    """Collective over grid. Fourier layer on a partitioned 1-D field; see :class:`SpectralConv2d`."""

    _nd = 1


class SpectralConv2d(_SpectralConvNd):
    """Collective over grid. Fourier layer (FNO) on a spatially partitioned 2-D field.

    Keeps ``modes[0]`` non-negative and as many negative frequencies along the first
    spatial dim and ``modes[1]`` along the last (real) one; see :func:`spectral_conv`. The
    complex weight is stored as a real parameter ``[C_in, C_out, 2 m_1, m_2, 2]``,
    replicated. Backward completes its gradient over the grid axes that split the field
    (it carries ``hpctp_grad_reduced``): :func:`hpctp.nn.sync_gradients` on the whole model
    skips it there and still sums the other layers' partial gradients.

    Parameters
    ----------
    in_channels, out_channels : int
    modes : int or sequence of int
        Modes kept per spatial dim (``2m <= n``; ``m <= n // 2 + 1`` on the last).
    grid : ProcessGrid
    split : sequence, optional
        Grid axis per spatial dim (default: dim ``i`` over grid axis ``i``).
    seed : int, optional
        Same weights on any grid and device (else rank 0's are broadcast: collective).
    dtype : torch.dtype, optional
        float32 or float64 (default: torch's default dtype).
    device : optional

    Raises
    ------
    ValueError
        On channels or modes below 1, or an invalid split.
    TypeError
        On a complex or integer dtype, or a grid that is not a ProcessGrid.
    """

    _nd = 2


class SpectralConv3d(_SpectralConvNd):
    """Collective over grid. Fourier layer on a partitioned 3-D field; see :class:`SpectralConv2d`."""

    _nd = 3
