"""Layers on fields split over the grid along their spatial dims: convolutions, pooling, upsampling, norms.

Every layer takes this rank's block of a field (or a :class:`hpctp.DistTensor`) and returns its block of the
result; neighbours' data arrives through halo fetches (``_fetch``) planned once per layout, and the window
engine (``_window``) computes interior outputs while the halo is in flight. Arguments are checked once into a
frozen :class:`~hpctp.nn.spatial.window_spec.WindowSpec`; ``_inputs`` is the one input path of every layer.
"""

# conv.py
from .conv import Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d

# functional.py
from .functional import (
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

# norm.py
from .norm import BatchNorm1d, BatchNorm2d, BatchNorm3d, GroupNorm

# pool.py
from .pool import AvgPool2d, AvgPool3d, MaxPool2d, MaxPool3d

# upsample.py
from .upsample import Upsample, upsampled_layout

__all__ = [
    # conv.py
    "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    # functional.py
    "avg_pool2d", "avg_pool3d", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "halo_pad", "max_pool2d", "max_pool3d", "spatial_split",
    # norm.py
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "GroupNorm",
    # pool.py
    "AvgPool2d", "AvgPool3d", "MaxPool2d", "MaxPool3d",
    # upsample.py
    "Upsample", "upsampled_layout",
]  # fmt: skip
