"""numpy's protocols on DistTensors: its ufuncs (``np.exp(x)``) and a few functions (``np.where``).

numpy hands a call with a DistTensor operand to ``DistTensor.__array_ufunc__`` or
``__array_function__``, which land here. Elementwise work runs on each rank's blocks with
the blocks' own backend (numpy, torch or cupy); functions that reduce (``np.sum``,
``np.allclose``) are the collective ones of :class:`~hpctp.DistTensor`. Any other numpy
function raises a TypeError naming what is supported, instead of numpy's conversion of the
tensor to an object array.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .. import comm as C
from .._util.backend import array_module, is_torch
from ..ops.elementwise import torch_operand, ufunc_for
from .core import DistTensor, layout_source, operand_block
from .functions.broadcast import broadcast_to
from .functions.calculus import diff, gradient, trapezoid
from .functions.histogram import histogram
from .functions.join import concatenate, numpy_style, stack
from .functions.nanfunctions import nanmax, nanmean, nanmin, nanstd, nansum, nanvar
from .functions.pad import pad
from .functions.quantiles import median, percentile, quantile
from .functions.statistics import resolve_ddof
from .registry import register

__all__ = ["apply_ufunc", "apply_function", "FUNCTIONS"]


def _operands(inputs: tuple[Any, ...], name: str) -> tuple[DistTensor, list[Any]]:
    """The tensor whose layout the result takes (the first with dims) and every operand's block
    (numbers and 0-d numpy arrays pass through as scalars)."""
    inputs = tuple(a[()] if isinstance(a, np.ndarray) and a.ndim == 0 else a for a in inputs)
    ref = layout_source(inputs)
    return ref, [ref.local if a is ref else operand_block(ref, a, name) for a in inputs]


@register("array_ufunc")
def apply_ufunc(ufunc: np.ufunc, method: str, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Local (collective for ``np.matmul``). ``ufunc`` applied blockwise; see ``DistTensor.__array_ufunc__``."""
    name = f"numpy.{ufunc.__name__}"
    if ufunc is np.matmul and method == "__call__" and not kwargs and len(inputs) == 2:
        a, b = inputs
        if isinstance(a, DistTensor):
            return a @ b
    if method != "__call__" or kwargs or ufunc.nout != 1 or ufunc.signature is not None:
        used = f"{name}.{method}" if method != "__call__" else name
        extra = f" with {', '.join(sorted(kwargs))}=" if kwargs else ""
        raise TypeError(
            f"{used}{extra} is not supported on DistTensors: elementwise calls with one output and no "
            f"keywords are (for reductions use x.sum(), x.max(), x.min(), x.mean())"
        )
    ref, blocks = _operands(inputs, name)
    return ref.with_local(ufunc_for(ufunc, ref.local)(*blocks))


def _where(condition: Any, x: Any = None, y: Any = None) -> DistTensor:
    if x is None or y is None:
        raise TypeError("numpy.where(condition) (the indices of true elements) is not supported on DistTensors")
    ref, (c, a, b) = _operands((condition, x, y), "numpy.where")
    if is_torch(ref.local):
        import torch

        return ref.with_local(torch.where(c, torch_operand(a, ref.local), torch_operand(b, ref.local)))
    return ref.with_local(array_module(ref.local).where(c, a, b))


def _isclose(a: Any, b: Any, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> DistTensor:
    ref, (u, v) = _operands((a, b), "numpy.isclose")
    if is_torch(ref.local):
        import torch

        u, v = (torch_operand(w, ref.local, ref.local.dtype) for w in (u, v))
        return ref.with_local(torch.isclose(u, v, rtol=rtol, atol=atol, equal_nan=equal_nan))
    return ref.with_local(array_module(ref.local).isclose(u, v, rtol=rtol, atol=atol, equal_nan=equal_nan))


def _allclose(a: Any, b: Any, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> bool:
    close = _isclose(a, b, rtol, atol, equal_nan)
    return C.all_true(close.grid.comm, bool(close.local.all()))


def _clip(a: DistTensor, a_min: Any = None, a_max: Any = None, out: None = None, **bounds: Any) -> DistTensor:
    if out is not None or set(bounds) - {"min", "max"}:
        raise TypeError("numpy.clip on a DistTensor takes the bounds only (no out= or other keywords)")
    lo = bounds.get("min", a_min)
    hi = bounds.get("max", a_max)
    return a.clip(None if lo is np._NoValue else lo, None if hi is np._NoValue else hi)  # type: ignore[attr-defined]


def _norm(x: DistTensor, ord: object = None, axis: object = None, keepdims: bool = False) -> DistTensor:
    if ord is not None or axis is not None or keepdims:
        raise TypeError("numpy.linalg.norm on a DistTensor: only the Frobenius norm of the whole tensor (x.norm())")
    return x.norm()


def _flip(m: DistTensor, axis: Any = None) -> DistTensor:
    return m.flip(axis)


def _roll(a: DistTensor, shift: Any, axis: Any = None) -> DistTensor:
    return a.roll(shift, axis)


def _diff(a: DistTensor, n: int = 1, axis: int = -1, prepend: Any = np._NoValue, append: Any = np._NoValue) -> Any:  # type: ignore[attr-defined]
    if prepend is not np._NoValue or append is not np._NoValue:  # type: ignore[attr-defined]
        raise TypeError("numpy.diff on a DistTensor takes n and axis only (no prepend= or append=)")
    return diff(a, n, axis)


def _pad(array: DistTensor, pad_width: Any, mode: Any = "constant", **kwargs: Any) -> Any:
    allowed = {"constant": {"constant_values"}, "reflect": {"reflect_type"}, "symmetric": {"reflect_type"}}
    extra = set(kwargs) - allowed.get(mode, set()) if isinstance(mode, str) else set()
    if extra:
        raise ValueError(f"unsupported keyword arguments for mode {mode!r}: {sorted(extra)}")
    return pad(array, pad_width, mode, **kwargs)


def _order_statistic(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """numpy's ``quantile``/``percentile`` signature onto :mod:`hpctp.tensor.functions.quantiles` (``out=``,
    ``weights=`` and ``interpolation=`` refused; ``overwrite_input`` is moot: blocks are not sorted)."""

    def call(
        a: Any, q: Any, axis: Any = None, out: Any = None, overwrite_input: bool = False, method: str = "linear",
        keepdims: bool = False, *, weights: Any = None, interpolation: Any = None,
    ) -> Any:  # fmt: skip
        if out is not None or weights is not None or interpolation is not None:
            raise TypeError(f"numpy.{name} on DistTensors takes no out=, weights= or interpolation= (use method=)")
        return fn(a, q, axis, method, keepdims)

    return call


def _median(a: Any, axis: Any = None, out: Any = None, overwrite_input: bool = False, keepdims: bool = False) -> Any:
    if out is not None:
        raise TypeError("numpy.median on DistTensors takes no out=: use the returned tensor")
    return median(a, axis, keepdims)


def _nan_reduction(fn: Callable[..., Any], dtype_arg: bool, moments: bool = False) -> Callable[..., Any]:
    """numpy's signature of a NaN-skipping reduction onto :mod:`hpctp.tensor.functions.nanfunctions`: ``axis``,
    ``keepdims``, ``dtype`` (converts first), ``ddof``/``correction`` for the moments; ``out``,
    ``initial``, ``where`` and ``mean`` refused."""

    def call(a: Any, axis: Any = None, *args: Any, **kwargs: Any) -> Any:
        names = (["dtype"] if dtype_arg else []) + ["out"] + (["ddof"] if moments else []) + ["keepdims"]
        kwargs.update(zip(names, args))
        unsupported = {k for k, v in kwargs.items() if k in ("out", "initial", "where", "mean") and v is not None}
        if unsupported or set(kwargs) - {"dtype", "out", "ddof", "keepdims", "correction", "initial", "where", "mean"}:
            raise TypeError(
                f"numpy.{fn.__name__} on DistTensors takes axis, keepdims, dtype and (for the moments) ddof "
                f"only, got {sorted(kwargs)}"
            )
        if kwargs.get("dtype") is not None:
            a = a.astype(kwargs["dtype"])
        extra = {"ddof": resolve_ddof(kwargs.get("ddof", 0), kwargs.get("correction"))} if moments else {}
        return fn(a, axis, keepdims=bool(kwargs.get("keepdims", False)), **extra)

    return call


def _method(func: Callable[..., Any]) -> Callable[..., Any]:
    """numpy's own implementation, which calls the DistTensor's method of that name (for
    functions whose implementation does not retry a TypeError on a converted array, as
    ``np.argmax``'s does: those call the method directly)."""
    return func._implementation  # type: ignore[attr-defined, no-any-return]


_COLLECTIVE: dict[Callable[..., Any], Callable[..., Any]] = {  # reductions: collective over grid
    **{f: _method(f) for f in (np.sum, np.mean, np.max, np.min, np.amax, np.amin)},
    **{f: _method(f) for f in (np.var, np.std, np.any, np.all)},
    np.argmax: lambda a, axis=None, out=None, *, keepdims=False: a.argmax(axis, keepdims, out=out),
    np.argmin: lambda a, axis=None, out=None, *, keepdims=False: a.argmin(axis, keepdims, out=out),
    np.cumsum: lambda a, axis=None, dtype=None, out=None: a.cumsum(axis, dtype, out),  # (numpy's retries a
    np.cumprod: lambda a, axis=None, dtype=None, out=None: a.cumprod(axis, dtype, out),  # TypeError: call direct)
    np.allclose: _allclose,
    np.linalg.norm: _norm,
    np.trapezoid: trapezoid,
    np.histogram: histogram,
    np.nansum: _nan_reduction(nansum, True),
    np.nanmean: _nan_reduction(nanmean, True),
    np.nanmax: _nan_reduction(nanmax, False),
    np.nanmin: _nan_reduction(nanmin, False),
    np.nanvar: _nan_reduction(nanvar, True, moments=True),
    np.nanstd: _nan_reduction(nanstd, True, moments=True),
    np.quantile: _order_statistic("quantile", quantile),
    np.percentile: _order_statistic("percentile", percentile),
    np.median: _median,
}
_MOVING: dict[Callable[..., Any], Callable[..., Any]] = {  # collective over grid where they move data
    np.flip: _flip,
    np.flipud: lambda m: _flip(m, 0),
    np.fliplr: lambda m: _flip(m, 1),
    np.roll: _roll,
    np.diff: _diff,
    np.gradient: gradient,
    np.concatenate: numpy_style(concatenate),
    np.stack: numpy_style(stack),
    np.pad: _pad,
    np.broadcast_to: lambda array, shape, subok=False: broadcast_to(array, shape),
}
_ELEMENTWISE: dict[Callable[..., Any], Callable[..., Any]] = {  # local, collective for operands cut differently
    np.where: _where,
    np.isclose: _isclose,
    np.clip: _clip,
}
_LOCAL: dict[Callable[..., Any], Callable[..., Any]] = {  # local
    **{f: _method(f) for f in (np.real, np.imag, np.shape, np.ndim, np.size, np.transpose)},
}

FUNCTIONS: dict[Callable[..., Any], Callable[..., Any]] = {**_COLLECTIVE, **_MOVING, **_ELEMENTWISE, **_LOCAL}
"""The numpy functions DistTensors support (``__array_function__``), each with its implementation;
:func:`apply_function`'s docstring lists them by kind, generated from this table."""


def _numpy_name(func: Callable[..., Any]) -> str:
    """``np.sum``, ``np.linalg.norm``: ``func`` as a user spells it."""
    return f"np.{'linalg.' if func is np.linalg.norm else ''}{func.__name__}"


def _listed(kinds: dict[str, Iterable[Callable[..., Any]]]) -> str:
    """A numpydoc Notes section (indented as a function's docstring) naming the functions of each kind."""
    lines = ["", "    Notes", "    -----"]
    for kind, funcs in kinds.items():
        names = ", ".join(f"``{n}``" for n in sorted(_numpy_name(f) for f in funcs))
        lines += [f"    {kind}", textwrap.fill(names, 100, initial_indent=" " * 8, subsequent_indent=" " * 8)]
    return "\n".join(lines) + "\n    "


@register("array_function")
def apply_function(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Collective over grid for the reductions, and for the functions that move data where they
    do (along divided dims, or inputs cut differently), else Local: see the Notes, generated from
    :data:`FUNCTIONS`. ``func(*args, **kwargs)`` for the numpy functions in :data:`FUNCTIONS`; see
    ``DistTensor.__array_function__``.

    Raises
    ------
    TypeError
        For any other numpy function (naming the supported ones).
    """
    impl = FUNCTIONS.get(func)
    if impl is None:
        names = ", ".join(sorted({_numpy_name(f) for f in FUNCTIONS}))
        raise TypeError(
            f"numpy.{getattr(func, '__name__', func)} is not supported on DistTensors (supported: {names}, and "
            f"numpy's elementwise ufuncs); apply it to x.local blockwise (x.with_local(...)) or to a gathered array"
        )
    return impl(*args, **kwargs)


if apply_function.__doc__ is not None:  # (None under python -OO)
    apply_function.__doc__ += _listed(
        {
            "Collective over grid": _COLLECTIVE,
            "Collective over grid where they move data, else Local": _MOVING,
            "Local (Collective over grid for DistTensor operands cut differently)": _ELEMENTWISE,
            "Local": _LOCAL,
        }
    )
