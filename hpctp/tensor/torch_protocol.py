"""torch's function protocol on DistTensors with torch blocks: ``torch.relu(x)``, ``F.gelu(x)``.

torch hands a call with a DistTensor operand to ``DistTensor.__torch_function__``, which
lands here. Pointwise functions (activations, elementwise math, comparisons, ``torch.where``:
:data:`POINTWISE`) run on each rank's blocks, differentiably, with numbers, 0-d tensors and
DistTensors of the same shape and split as the other operands (cut differently, they are
aligned first, as in numpy's protocol). The collective ones (:data:`MOVES`: reductions, joins,
flips, rolls, padding, scans) map onto hpctp's own DistTensor operations, taking torch's
arguments (``dim``, ``keepdim``, ``correction``/``unbiased``, whose default is 1).
:func:`apply_torch_function`'s docstring lists both, generated from the tables. Anything else
(``torch.max``/``min`` with their indices, ``softmax`` along a dim that may be divided, random
``dropout``, a plain tensor broadcast against a block) raises a TypeError: blockwise, it would
not be the single-process result.
"""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from .core import DistTensor, layout_source, operand_block
from .functions.join import concatenate, stack
from .functions.pad import pad as numpy_pad
from .registry import register

__all__ = ["MOVES", "POINTWISE", "apply_torch_function"]

_TORCH = (
    "abs absolute acos acosh add angle asin asinh atan atan2 atanh ceil clamp clip conj_physical copysign cos cosh "
    "deg2rad div eq erf erfc erfinv exp exp2 expm1 float_power floor fmax fmin fmod frac ge gt heaviside hypot imag "
    "isclose isfinite isinf isnan le lerp lgamma log log10 log1p log2 logical_and logical_not logical_or logical_xor "
    "logit lt maximum minimum mul nan_to_num ne neg negative pow rad2deg real reciprocal relu remainder round rsqrt "
    "sgn sigmoid sign signbit sin sinc sinh sqrt square sub tan tanh trunc where xlogy"
)
_FUNCTIONAL = (
    "celu elu gelu hardshrink hardsigmoid hardswish hardtanh leaky_relu logsigmoid mish relu relu6 selu sigmoid "
    "silu softplus softshrink softsign tanh tanhshrink threshold"
)


_POINTWISE_NAMES = [f"torch.{n}" for n in _TORCH.split()] + [f"torch.nn.functional.{n}" for n in _FUNCTIONAL.split()]


@functools.cache
def _pointwise() -> dict[Callable[..., Any], str]:
    modules = {"torch": torch, "torch.nn.functional": F}
    return {getattr(modules[name.rpartition(".")[0]], name.rpartition(".")[2]): name for name in _POINTWISE_NAMES}


POINTWISE = _pointwise
"""The supported pointwise functions, each with its name (a call: the table is built on first use)."""


def _flip(x: DistTensor, dims: Any) -> DistTensor:
    return x.flip(dims)


def _roll(x: DistTensor, shifts: Any, dims: Any = None) -> DistTensor:
    return x.roll(shifts, dims)


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def _pad(x: DistTensor, pad: Any, mode: str = "constant", value: Any = None) -> DistTensor:
    """``F.pad``: pairs for the last dims first, torch's mode names (negative pads, which crop,
    are refused by :func:`hpctp.pad`)."""
    flat = list(pad)
    if len(flat) % 2 or len(flat) // 2 > x.ndim or mode not in _PAD_MODES:
        raise ValueError(
            f"F.pad on a DistTensor: pad={tuple(flat)} must hold one (left, right) pair per padded dim, last dim "
            f"first, for at most {x.ndim} dims, and mode={mode!r} one of {', '.join(_PAD_MODES)}"
        )
    widths = [(0, 0)] * (x.ndim - len(flat) // 2) + [(flat[i], flat[i + 1]) for i in range(len(flat) - 2, -1, -2)]
    return numpy_pad(x, widths, _PAD_MODES[mode], constant_values=0 if value is None else value)


def _cumsum(x: DistTensor, dim: int, *, dtype: Any = None) -> DistTensor:
    return x.cumsum(dim, dtype)


def _cumprod(x: DistTensor, dim: int, *, dtype: Any = None) -> DistTensor:
    return x.cumprod(dim, dtype)


def _dims(dim: Any) -> Any:
    """torch's ``dim`` (None or ``()``: every dim) as numpy's ``axis``."""
    return None if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0) else dim


def _correction(correction: Any, unbiased: Any) -> Any:
    if unbiased is not None and correction is not None:
        raise TypeError("torch.var/std: give correction or unbiased, not both")
    if unbiased is not None:
        return 1 if unbiased else 0
    return 1 if correction is None else correction  # (torch's default: the unbiased estimate)


def _sum(x: DistTensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> DistTensor:
    return x.sum(_dims(dim), keepdim, dtype=dtype)


def _mean(x: DistTensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> DistTensor:
    return x.mean(_dims(dim), keepdim, dtype=dtype)


def _amax(x: DistTensor, dim: Any = (), keepdim: bool = False) -> DistTensor:
    return x.max(_dims(dim), keepdim)


def _amin(x: DistTensor, dim: Any = (), keepdim: bool = False) -> DistTensor:
    return x.min(_dims(dim), keepdim)


def _var(
    x: DistTensor, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *, correction: Any = None
) -> DistTensor:
    return x.var(_dims(dim), ddof=_correction(correction, unbiased), keepdims=keepdim)


def _std(
    x: DistTensor, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *, correction: Any = None
) -> DistTensor:
    return x.std(_dims(dim), ddof=_correction(correction, unbiased), keepdims=keepdim)


def _cat(tensors: Any, dim: int = 0) -> DistTensor:
    return concatenate(tensors, dim)


def _stack(tensors: Any, dim: int = 0) -> DistTensor:
    return stack(tensors, dim)


MOVES: dict[Callable[..., Any], Callable[..., DistTensor]] = {
    torch.cat: _cat,
    torch.concatenate: _cat,
    torch.stack: _stack,
    torch.sum: _sum,
    torch.mean: _mean,
    torch.amax: _amax,
    torch.amin: _amin,
    torch.var: _var,
    torch.std: _std,
    torch.flip: _flip,
    torch.roll: _roll,
    F.pad: _pad,
    torch.cumsum: _cumsum,
    torch.cumprod: _cumprod,
}
"""The supported collective torch functions, each with the hpctp operation that implements it."""


def _block(value: Any, ref: DistTensor, name: str) -> Any:
    if isinstance(value, DistTensor):
        return ref.local if value is ref else operand_block(ref, value, name)
    if isinstance(value, torch.Tensor) and value.ndim > 0:
        raise TypeError(
            f"{name}: a plain torch.Tensor of shape {tuple(value.shape)} next to a DistTensor would broadcast "
            f"against each rank's block, not the global tensor; make it a DistTensor of the same layout "
            f"(x.with_local(...)) or a number"
        )
    return value


@register("torch_function")
def apply_torch_function(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> DistTensor:
    """Local for the pointwise functions (Collective over grid for DistTensor operands cut
    differently), Collective over grid for the functions of :data:`MOVES` (reductions, joins,
    moves): see the Notes, generated from the tables. ``func(*args, **kwargs)`` on the blocks;
    see ``DistTensor.__torch_function__``.

    Raises
    ------
    TypeError
        For a function that is neither pointwise nor in :data:`MOVES` (see the Notes), blocks that are not
        torch tensors, or a plain tensor operand with dims.
    ValueError
        On DistTensor operands of different layouts or grids.
    """
    first = args[0] if args else kwargs.get("tensors", kwargs.get("input"))
    joined = isinstance(first, (list, tuple)) and any(isinstance(t, DistTensor) for t in first)
    if func in MOVES and (isinstance(first, DistTensor) or joined):
        return MOVES[func](*args, **kwargs)
    name = _pointwise().get(func)
    if name is None:
        what = getattr(func, "__name__", repr(func))
        raise TypeError(
            f"torch function {what} is not supported on DistTensors: only pointwise ones are (activations, "
            f"elementwise math, comparisons, torch.where; also torch.flip, torch.roll, F.pad, torch.cat/stack, "
            f"torch.cumsum/cumprod, "
            f"torch.sum/mean/amax/amin/var/std; x.max(), x.argmax(), ...); apply it to "
            f"x.local and wrap the result with x.with_local(...) where that is right"
        )
    ref = layout_source((*args, *kwargs.values()))
    if ref.backend != "torch":
        raise TypeError(f"{name} needs torch blocks, got {ref.backend}; convert with x.to('torch') (or use numpy's)")
    out = func(*(_block(a, ref, name) for a in args), **{k: _block(v, ref, name) for k, v in kwargs.items()})
    return ref.with_local(out)


def _listed(kinds: dict[str, list[str]]) -> str:
    """A numpydoc Notes section (indented as a function's docstring) naming the functions of each kind."""
    lines = ["", "    Notes", "    -----"]
    for kind, names in kinds.items():
        text = ", ".join(f"``{n}``" for n in sorted(names))
        lines += [f"    {kind}", textwrap.fill(text, 100, initial_indent=" " * 8, subsequent_indent=" " * 8)]
    return "\n".join(lines) + "\n    "


if apply_torch_function.__doc__ is not None:  # (None under python -OO)
    apply_torch_function.__doc__ += _listed(
        {
            "Collective over grid": [f"{f.__module__}.{f.__name__}" for f in MOVES],
            "Local, pointwise (Collective over grid for DistTensor operands cut differently)": _POINTWISE_NAMES,
        }
    )
