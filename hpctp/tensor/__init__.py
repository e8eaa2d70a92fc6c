"""The DistTensor room: the class (:mod:`.core`), its creation functions (:mod:`.creation`,
:mod:`.random`, :mod:`.infer`), numpy's and torch's protocols on it (:mod:`.numpy_protocol`,
:mod:`.torch_protocol`) and the array functions grouped by kind (:mod:`.functions`). The
operands of elementwise operations are aligned and broadcast by :mod:`.align`, below the class.

Methods of :class:`DistTensor` that belong to a function module reach it through
:mod:`.registry`; importing this package registers every implementation.
"""

# importing numpy_protocol and the functions modules registers DistTensor's methods (see .registry)
from . import numpy_protocol, random  # noqa: F401
from .core import DistTensor
from .creation import distribute, empty, from_dtensor, from_local, fromfunction, full, ones, zeros
from .functions import scan, search, statistics  # noqa: F401
from .functions.broadcast import broadcast_to
from .functions.calculus import diff, gradient, trapezoid
from .functions.histogram import histogram
from .functions.join import concatenate, stack
from .functions.pad import pad
from .functions.quantiles import median, percentile, quantile
from .functions.scan import cumprod, cumsum
from .registry import register_lazy

register_lazy("torch_function", "hpctp.tensor.torch_protocol")  # (imports torch: loaded on first use)
register_lazy("to_dtensor", "hpctp.tensor.dtensor")  # (torch as well)
register_lazy("from_dtensor", "hpctp.tensor.dtensor")

__all__ = [
    "DistTensor",
    "broadcast_to",
    "concatenate",
    "cumprod",
    "cumsum",
    "diff",
    "distribute",
    "empty",
    "from_dtensor",
    "from_local",
    "fromfunction",
    "full",
    "gradient",
    "histogram",
    "median",
    "ones",
    "pad",
    "percentile",
    "quantile",
    "random",
    "stack",
    "trapezoid",
    "zeros",
]
