"""Distributed FFTs of DistTensors (``numpy.fft``-style): pencil plans and their execution.

:func:`fft_plan` is the pure part (which layout each 1-D transform runs in);
:func:`fftn`, :func:`ifftn`, :func:`rfftn` and :func:`irfftn` run it with one ``Alltoallv``
per moved grid axis and the blocks' own FFT library; :func:`radial_spectrum` bins a field's
power spectrum in shells of ``|k|`` (the energy spectrum E(k)); :func:`frequencies` gives
each rank the frequencies of its block of a spectrum (derivatives, solvers, filters). For the Fourier layers of a neural
operator, which keep a few modes only, see :mod:`hpctp.nn.spectral.fourier` (no redistribution).
"""

from .freqs import frequencies, hermitian_weights, wavenumbers
from .plan import FFTStep, fft_plan, normalize_fft_axes, step_layout
from .spectrum import radial_spectrum
from .transform import fftn, ifftn, irfftn, rfftn

__all__ = [
    "FFTStep",
    "fft_plan",
    "fftn",
    "frequencies",
    "hermitian_weights",
    "ifftn",
    "irfftn",
    "normalize_fft_axes",
    "radial_spectrum",
    "rfftn",
    "step_layout",
    "wavenumbers",
]
