"""Surrogate architectures built from hpctp.nn layers on a spatially partitioned field.

All four (a residual CNN, a U-Net, a Fourier neural operator and a vision transformer,
:mod:`apps.surrogate.vit`) map a state ``[B, C, H, W]`` (a DistTensor split ``(None, None, 0, 1)``) to the state
``horizon`` snapshots later as ``x + s * f(x)``, with circular padding (the domain is periodic);
``s`` (buffer ``delta_scale``) is the RMS change between paired snapshots, set by
:func:`apps.surrogate.train.fit_delta_scale`, so ``f`` learns an O(1) target.
Parameters are replicated, initialised from the config seed (identical on any grid);
call :func:`hpctp.nn.sync_gradients` after backward.

With ``grid=None`` the same classes build plain ``torch.nn`` layers with the same initial
weights: the single-process reference that the distributed model must reproduce.
"""

from __future__ import annotations

from typing import Any

import torch

import hpctp
from hpctp.nn import Conv2d, MaxPool2d, SpectralConv2d, Upsample
from hpctp.nn.functional import spectral_conv_fft
from hpctp.nn.spectral import spectral_weight

from .blocks import ResidualScale, cat_channels, pointwise, with_local, zero_
from .vit import ViT

__all__ = ["FNO", "MODELS", "ResidualCNN", "UNet", "ViT", "ZeroConv2d", "build_model"]

MODELS = ("fno", "cnn", "unet", "vit")
"""The ``surrogate.model`` names :func:`build_model` knows."""


def _conv(
    cin: int, cout: int, k: int, grid: hpctp.ProcessGrid | None, seed: int, dtype: torch.dtype
) -> torch.nn.Module:
    if grid is None:  # one process: torch's layer after manual_seed(seed) == hpctp's Conv2d(seed=seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return torch.nn.Conv2d(cin, cout, k, padding=k // 2, padding_mode="circular", dtype=dtype)
    return Conv2d(
        cin, cout, k, padding=k // 2, padding_mode="circular", grid=grid, split=(0, 1), seed=seed, dtype=dtype
    )


class ZeroConv2d(Conv2d):
    """Collective over grid. :class:`hpctp.nn.Conv2d` whose ``reset_parameters()`` also zeroes it (the head), so a
    model built on the meta device materializes to the same values as one built for real."""

    def reset_parameters(self) -> None:
        """Local. Torch's draws (kept: the seed's stream stays as in construction), then zeros."""
        super().reset_parameters()
        zero_(self)


def _head(cin: int, cout: int, grid: hpctp.ProcessGrid | None, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """The zeroed 1x1 head."""
    if grid is None:
        return zero_(_conv(cin, cout, 1, grid, seed, dtype))
    return ZeroConv2d(cin, cout, 1, padding=0, padding_mode="circular", grid=grid, split=(0, 1), seed=seed, dtype=dtype)


class ResidualCNN(ResidualScale):
    """Collective over grid. ``depth`` 3x3 conv + GELU layers of ``width`` channels, then a 1x1 conv."""

    def __init__(
        self, channels: int, width: int, depth: int, grid: hpctp.ProcessGrid | None, seed: int, dtype: torch.dtype
    ):
        super().__init__()
        layers = [_conv(channels, width, 3, grid, seed, dtype)]
        layers += [_conv(width, width, 3, grid, seed + i + 1, dtype) for i in range(depth - 1)]
        self.body = torch.nn.ModuleList(layers)
        self.head = _head(width, channels, grid, seed + depth, dtype)
        self._scale_buffer(dtype)

    def forward(self, x: Any) -> Any:
        """Collective over grid. The predicted state (same layout as ``x``)."""
        h = x
        for conv in self.body:
            h = pointwise(torch.nn.functional.gelu, conv(h))
        return x + pointwise(lambda t: t * self.delta_scale, self.head(h))


class UNet(ResidualScale):
    """Collective over grid. A U-Net: per level two 3x3 convs, 2x2 max-pool down, nearest upsample
    and skip concatenation up, a 1x1 head; ``levels`` poolings."""

    def __init__(
        self, channels: int, width: int, levels: int, grid: hpctp.ProcessGrid | None, seed: int, dtype: torch.dtype
    ):
        super().__init__()
        s = iter(range(seed, seed + 1000))
        widths = [width * 2**i for i in range(levels + 1)]
        self.down = torch.nn.ModuleList()
        cin = channels
        for w in widths:
            self.down.append(
                torch.nn.ModuleList([_conv(cin, w, 3, grid, next(s), dtype), _conv(w, w, 3, grid, next(s), dtype)])
            )
            cin = w
        if grid is None:
            self.pool: torch.nn.Module = torch.nn.MaxPool2d(2)
            self.up: torch.nn.Module = torch.nn.Upsample(scale_factor=2, mode="nearest")
        else:
            self.pool = MaxPool2d(2, grid=grid, split=(0, 1))
            self.up = Upsample(scale_factor=2, mode="nearest", grid=grid, split=(0, 1), balanced=True)
        self.merge = torch.nn.ModuleList()
        for w_hi, w_lo in zip(widths[-2::-1], widths[:0:-1]):
            self.merge.append(
                torch.nn.ModuleList(
                    [_conv(w_lo + w_hi, w_hi, 3, grid, next(s), dtype), _conv(w_hi, w_hi, 3, grid, next(s), dtype)]
                )
            )
        self.head = _head(width, channels, grid, next(s), dtype)
        self._scale_buffer(dtype)

    @staticmethod
    def _pair(convs: Any, h: Any) -> Any:
        for conv in convs:
            h = pointwise(torch.nn.functional.gelu, conv(h))
        return h

    def forward(self, x: Any) -> Any:
        """Collective over grid. The predicted state (same layout as ``x``)."""
        skips = []
        h = x
        for i, convs in enumerate(self.down):
            if i:
                h = self.pool(h)
            h = self._pair(convs, h)
            skips.append(h)
        for convs, skip in zip(self.merge, skips[-2::-1]):
            h = self._pair(convs, cat_channels(self.up(h), skip))
        return x + pointwise(lambda t: t * self.delta_scale, self.head(h))


class _FFTSpectralConv2d(torch.nn.Module):
    """One process: hpctp's SpectralConv2d(seed=seed) computed with torch.fft (the reference)."""

    def __init__(self, cin: int, cout: int, modes: int, seed: int, dtype: torch.dtype):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.weight = torch.nn.Parameter(spectral_weight(cin, cout, (modes, modes), dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return spectral_conv_fft(x, self.weight)


def _spectral(
    cin: int, cout: int, modes: int, grid: hpctp.ProcessGrid | None, seed: int, dtype: torch.dtype
) -> torch.nn.Module:
    if grid is None:
        return _FFTSpectralConv2d(cin, cout, modes, seed, dtype)
    return SpectralConv2d(cin, cout, modes, grid=grid, split=(0, 1), seed=seed, dtype=dtype)


def _add(a: Any, b: Any) -> Any:
    """Sum of two tensors of one layout (DistTensor blocks, or plain tensors)."""
    return a + b if isinstance(a, torch.Tensor) else with_local(a, a.local + b.local)


class FNO(ResidualScale):
    """Collective over grid. A Fourier neural operator (Li et al., 2021): a 1x1 lift to ``width``
    channels, ``depth`` Fourier layers ``gelu(K h + W h)`` (``K`` keeps ``modes`` frequencies per
    direction and sign, ``W`` a 1x1 conv), a zeroed 1x1 head. The field is never transposed:
    each Fourier layer sends one spectrum-sized Allreduce (see :mod:`hpctp.nn.spectral.fourier`)."""

    def __init__(
        self,
        channels: int,
        width: int,
        depth: int,
        modes: int,
        grid: hpctp.ProcessGrid | None,
        seed: int,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.lift = _conv(channels, width, 1, grid, seed, dtype)
        self.spectral = torch.nn.ModuleList(
            [_spectral(width, width, modes, grid, seed + 1 + 2 * i, dtype) for i in range(depth)]
        )
        self.pointwise = torch.nn.ModuleList(
            [_conv(width, width, 1, grid, seed + 2 + 2 * i, dtype) for i in range(depth)]
        )
        self.head = _head(width, channels, grid, seed + 1 + 2 * depth, dtype)
        self._scale_buffer(dtype)

    def forward(self, x: Any) -> Any:
        """Collective over grid. The predicted state (same layout as ``x``)."""
        h = self.lift(x)
        for k, w in zip(self.spectral, self.pointwise):
            h = pointwise(torch.nn.functional.gelu, _add(k(h), w(h)))
        return x + pointwise(lambda t: t * self.delta_scale, self.head(h))


def build_model(
    cfg: dict[str, Any], channels: int, grid: hpctp.ProcessGrid | None, tensor_axis: int | None = None
) -> torch.nn.Module:
    """Local. The model of the ``[surrogate]`` config section (``grid=None``: one-process torch reference).

    ``tensor_axis`` (ViT only) is the grid axis that splits the heads and hidden units.

    ``model = "vit"`` reads ``patch``, ``embed``, ``depth``, ``heads``, ``mlp_ratio``, ``attention``
    (``"global"`` or ``"neighborhood"``), ``kernel_size`` and ``schedule`` (defaults: 4, 32, 2, 4, 2.0,
    "global", 5, "ring"; see :class:`apps.surrogate.vit.ViT`).

    Raises
    ------
    ValueError
        On an unknown model name or dtype, or invalid ViT keys.
    """
    dtype = {"float32": torch.float32, "float64": torch.float64}.get(cfg["dtype"])
    if dtype is None:
        raise ValueError(f"surrogate.dtype must be 'float32' or 'float64', got {cfg['dtype']!r}")
    if tensor_axis is not None and cfg["model"] != "vit":
        raise ValueError(f"a tensor axis splits the ViT's weights; the {cfg['model']!r} model has none to split")
    if cfg["model"] == "unet":
        return UNet(channels, cfg["width"], cfg["levels"], grid, cfg["seed"], dtype)
    if cfg["model"] == "cnn":
        return ResidualCNN(channels, cfg["width"], cfg["depth"], grid, cfg["seed"], dtype)
    if cfg["model"] == "fno":
        return FNO(channels, cfg["width"], cfg["depth"], cfg["modes"], grid, cfg["seed"], dtype)
    if cfg["model"] == "vit":
        return ViT(
            channels,
            patch=cfg.get("patch", 4),
            embed=cfg.get("embed", 32),
            depth=cfg.get("depth", 2),
            heads=cfg.get("heads", 4),
            mlp_ratio=float(cfg.get("mlp_ratio", 2.0)),
            attention=cfg.get("attention", "global"),
            kernel_size=cfg.get("kernel_size", 5),
            schedule=cfg.get("schedule", "ring"),
            grid=grid,
            seed=cfg["seed"],
            dtype=dtype,
            tensor_axis=tensor_axis,
        )
    raise ValueError(f"surrogate.model must be one of {MODELS}, got {cfg['model']!r}")
