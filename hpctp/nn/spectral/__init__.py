"""Fourier layers (FNO) on fields split over the grid: each rank transforms its own block with truncated DFT
matrices (``_dft``); a spectrum-sized reduce-scatter and all-gather join the ranks, each mixing its own run of the
kept modes (``_modes``); the field never moves."""

# conv.py
from .conv import SpectralConv1d, SpectralConv2d, SpectralConv3d, spectral_weight

# fourier.py
from .fourier import spectral_conv, spectral_conv_fft

__all__ = [
    # conv.py
    "SpectralConv1d", "SpectralConv2d", "SpectralConv3d", "spectral_weight",
    # fourier.py
    "spectral_conv", "spectral_conv_fft",
]  # fmt: skip
