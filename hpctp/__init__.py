"""hpctp: tensor-partitioned deep learning on MPI process grids.

Individual tensors are cut into blocks over a Cartesian :class:`ProcessGrid`; every
operation computes what one device would compute on the whole tensor.
"""

from . import comm, fft, halo, io, layout, linalg, perf, random
from .broadcast import broadcast_to
from .comm import CommCounter, ProcessGrid
from .differences import diff, gradient, trapezoid
from .factories import distribute, empty, from_local, fromfunction, full, ones, zeros
from .halo import HaloExchange
from .histogram import histogram
from .join import concatenate, stack
from .layout import Layout, block_range
from .linalg import matmul
from .pad import pad
from .quantiles import median, percentile, quantile
from .scan import cumprod, cumsum
from .tensor import DistTensor

__version__ = "0.1.0"

__all__ = [
    "CommCounter",
    "DistTensor",
    "HaloExchange",
    "Layout",
    "ProcessGrid",
    "__version__",
    "block_range",
    "broadcast_to",
    "comm",
    "concatenate",
    "cumprod",
    "cumsum",
    "diff",
    "distribute",
    "empty",
    "fft",
    "from_local",
    "fromfunction",
    "full",
    "gradient",
    "halo",
    "histogram",
    "io",
    "layout",
    "linalg",
    "matmul",
    "median",
    "percentile",
    "perf",
    "ones",
    "pad",
    "quantile",
    "random",
    "stack",
    "trapezoid",
    "zeros",
]
