"""hpctp: tensor-partitioned deep learning on MPI process grids.

Individual tensors are cut into blocks over a Cartesian :class:`ProcessGrid`; every
operation computes what one device would compute on the whole tensor.
"""

from importlib import metadata as _metadata

from . import comm, debug, fft, halo, io, layout, linalg
from ._util.memory import PeakMemory
from .comm import CommCounter, ProcessGrid
from .halo import HaloExchange
from .layout import Layout, block_range
from .linalg import matmul
from .tensor import random
from .tensor.core import DistTensor
from .tensor.creation import distribute, empty, from_dtensor, from_local, fromfunction, full, ones, zeros
from .tensor.functions.broadcast import broadcast_to
from .tensor.functions.calculus import diff, gradient, trapezoid
from .tensor.functions.histogram import histogram
from .tensor.functions.join import concatenate, stack
from .tensor.functions.pad import pad
from .tensor.functions.quantiles import median, percentile, quantile
from .tensor.functions.scan import cumprod, cumsum

try:
    __version__ = _metadata.version("hpctp")  # the one version: setup.cfg's, as installed
except _metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> object:
    """``hpctp.perf`` (the cost models and the planner) on first use: it loads torch, which ``import hpctp`` does not."""
    if name == "perf":
        import importlib

        return importlib.import_module(".perf", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CommCounter",
    "DistTensor",
    "HaloExchange",
    "Layout",
    "PeakMemory",
    "ProcessGrid",
    "__version__",
    "block_range",
    "broadcast_to",
    "comm",
    "concatenate",
    "cumprod",
    "cumsum",
    "debug",
    "diff",
    "distribute",
    "empty",
    "fft",
    "from_dtensor",
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
