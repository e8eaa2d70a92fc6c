"""Differentiable spatially partitioned ops on local torch blocks (halo padding, conv, pooling, FNO).

Every function here works on this rank's block of a field that is cut over the grid along
its spatial dims, and returns this rank's block of the result: the result equals what
``torch.nn.functional`` computes on the gathered global field. Forward and backward are
collective over the grid (every rank must call them, in the same order); the backward of
each halo fetch is its adjoint exchange (ghost gradients are sent back and summed into
the owners' blocks). The Fourier layer :func:`spectral_conv` equals :func:`spectral_conv_fft`
(``torch.fft``) on the gathered field. :func:`linear` is torch's linear (local), whose
weight gradient a zero-bubble pipeline stage computes in its ``W`` pass: call it in your
own layers for that.

Inputs are plain local ``torch.Tensor`` blocks or :class:`hpctp.DistTensor` (torch local
block); the result has the same kind. For plain blocks the global layout (which may be
uneven) is inferred collectively with one tiny ``Allgather`` per call; pass ``layout=`` to
skip it.
"""

from ._deferred_weights import linear
from .spatial.functional import (
    avg_pool2d,
    avg_pool3d,
    conv1d,
    conv2d,
    conv3d,
    conv_transpose1d,
    conv_transpose2d,
    conv_transpose3d,
    halo_pad,
    max_pool2d,
    max_pool3d,
    spatial_split,
)
from .spectral.fourier import spectral_conv, spectral_conv_fft
from .transformer.context_parallel import attention

__all__ = [
    "attention",
    "avg_pool2d",
    "avg_pool3d",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "halo_pad",
    "linear",
    "max_pool2d",
    "max_pool3d",
    "spatial_split",
    "spectral_conv",
    "spectral_conv_fft",
]
