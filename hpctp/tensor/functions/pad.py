"""``pad``: a DistTensor padded as ``numpy.pad`` pads it (modes ``constant``, ``edge``,
``wrap``, ``reflect``, ``symmetric``, ``empty``).

The copying modes are built from operations a numpy user would write. Along each padded dim
in turn, numpy's result is a sequence of the tensor's own rows. :func:`pad_runs` turns that
sequence (``numpy.pad`` of ``arange(n)``, so numpy decides which row goes where, for any pad
width) into runs: forward slices, reversed slices, and one row repeated. They are joined
with :func:`hpctp.concatenate`, so later dims are padded from the tensor already padded along
earlier ones, as numpy does. ``constant`` writes the values into a new tensor and moves ``x``
into its middle in one move.

The result keeps ``x``'s split, with balanced cuts along the padded dims. Everything is
differentiable for torch blocks.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from ... import comm as C
from ..._util.ints import is_int
from ...layout import Layout
from ...ops.transfer import needs_grad
from ..core import DistTensor
from ..creation import empty_in
from .broadcast import broadcast_to
from .join import concatenate

__all__ = ["pad", "pad_runs", "MODES"]

MODES = ("constant", "edge", "wrap", "reflect", "symmetric", "empty")
Run = tuple[int, int, int]  # (first source row, step -1/0/+1, count)


def pad_runs(n: int, before: int, after: int, mode: str) -> list[Run]:
    """Local. The rows of a dim of length ``n`` padded by ``(before, after)`` in a copying
    ``mode``, as runs ``(first, step, count)``: rows ``first, first + step, ...``.

    Raises
    ------
    ValueError
        As ``numpy.pad`` (an empty dim cannot be extended by copying).
    """
    rows = np.pad(np.arange(n), (before, after), mode=mode).tolist()  # type: ignore[call-overload]
    runs: list[Run] = []
    i = 0
    while i < len(rows):
        j, step = i + 1, 1
        if j < len(rows) and rows[j] - rows[i] in (-1, 0, 1):
            step = rows[j] - rows[i]
            while j < len(rows) and rows[j] - rows[j - 1] == step:
                j += 1
        runs.append((rows[i], step, j - i))
        i = j
    return runs


def _pairs(value: object, ndim: int, what: str, ints: bool) -> list[tuple[Any, Any]]:
    """``value`` broadcast to one ``(before, after)`` pair per dim, as numpy's ``pad`` does."""
    arr = np.asarray(value, dtype=object)
    try:
        pairs = np.broadcast_to(arr, (ndim, 2)).tolist()
    except ValueError:
        raise ValueError(
            f"pad: {what}={value!r} does not broadcast to one (before, after) pair per dim ({ndim} dims); "
            f"give a number, (before, after), or ((before_0, after_0), ...)"
        ) from None
    for pair in pairs:
        for v in pair:
            if ints and not is_int(v):
                raise TypeError(f"pad: {what} must hold ints, got {value!r}")
            if ints and int(v) < 0:
                raise ValueError(f"pad: {what} can't contain negative values, got {value!r}")
            if not ints and not isinstance(v, (numbers.Number, np.generic)):
                raise TypeError(f"pad: {what} must hold numbers, got {value!r}")
    return [(int(b), int(a)) if ints else (b, a) for b, a in pairs]


def _along(ndim: int, d: int, key: slice, rest: list[slice] | None = None) -> tuple[slice, ...]:
    out = list(rest) if rest is not None else [slice(None)] * ndim
    out[d] = key
    return tuple(out)


def _run_piece(y: DistTensor, d: int, run: Run) -> DistTensor:
    first, step, count = run
    if step == 0:
        row = y[_along(y.ndim, d, slice(first, first + 1))]
        return broadcast_to(row, y.shape[:d] + (count,) + y.shape[d + 1 :]) if count > 1 else row
    stop = first + step * count
    return y[_along(y.ndim, d, slice(first, None if stop < 0 else stop, step))]


def _copying(x: DistTensor, widths: list[tuple[int, int]], mode: str) -> DistTensor:
    y = x
    for d, (before, after) in enumerate(widths):
        if before == after == 0:
            continue
        pieces = [_run_piece(y, d, run) for run in pad_runs(y.shape[d], before, after, mode)]
        y = concatenate(pieces, d) if len(pieces) > 1 else pieces[0]
    return y if y is not x else x.copy()


def _constant(x: DistTensor, widths: list[tuple[int, int]], values: list[tuple[Any, Any]]) -> DistTensor:
    shape = tuple(n + b + a for n, (b, a) in zip(x.shape, widths))
    padded = [b + a > 0 for b, a in widths]
    layout = Layout(shape, x.layout.grid_dims, x.split, tuple(None if p else c for p, c in zip(padded, x.layout.cuts)))
    out = empty_in(layout, x.grid, x.local.dtype, x.local)
    inner = [slice(b, b + n) for n, (b, _) in zip(x.shape, widths)]
    for d, ((before, after), (v0, v1)) in enumerate(zip(widths, values)):  # numpy's order: later dims win corners
        rest = [slice(None)] * d + inner[d:]
        if before:
            out[_along(x.ndim, d, slice(0, before), rest)] = v0
        if after:
            out[_along(x.ndim, d, slice(shape[d] - after, None), rest)] = v1
    out[tuple(inner)] = x
    return out


def pad(
    x: DistTensor,
    pad_width: object,
    mode: str = "constant",
    constant_values: object = 0,
    reflect_type: str = "even",
) -> DistTensor:
    """Collective over grid when a padded dim is divided, else Local. ``x`` padded as
    ``numpy.pad`` pads it (also ``np.pad(x, pad_width, mode, ...)``).

    The result keeps ``x``'s split; padded dims get balanced cuts. ``constant`` (and
    ``empty``, which fills zeros) moves ``x`` once, into the middle of the new tensor; the
    copying modes join slices of ``x`` along each padded dim in turn (one
    :func:`hpctp.concatenate` per dim), so corners are filled as numpy fills them, for any
    pad width. Differentiable for torch blocks.

    Parameters
    ----------
    x : DistTensor
    pad_width : int or sequence
        numpy's forms: ``n``, ``(before, after)`` or one ``(before, after)`` per dim.
    mode : {"constant", "edge", "wrap", "reflect", "symmetric", "empty"}
    constant_values : number or sequence
        For ``constant``, in the forms of ``pad_width``; cast to ``x``'s dtype as numpy casts.
    reflect_type : {"even"}
        numpy's default; ``"odd"`` is not supported.

    Returns
    -------
    DistTensor
        New memory, of shape ``x.shape[d] + before_d + after_d`` along each dim.

    Raises
    ------
    TypeError
        If ``x`` is not a DistTensor, or ``pad_width`` / ``constant_values`` hold other things
        than ints / numbers.
    ValueError
        On a mode other than those above, ``reflect_type="odd"``, negative or unbroadcastable
        widths, or a copying mode that extends an empty dim.
    """
    if not isinstance(x, DistTensor):
        raise TypeError(f"hpctp.pad needs a DistTensor, got {type(x).__name__}")
    error: Exception | None = None
    widths: list[tuple[int, int]] = []
    values: list[tuple[Any, Any]] = []
    try:
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(
                f"pad: mode {mode!r} is not supported on DistTensors; use one of {', '.join(MODES)} "
                f"(statistic and ramp modes: pad x.local blockwise, or a gathered array)"
            )
        if reflect_type != "even":
            raise ValueError(f"pad: reflect_type={reflect_type!r} is not supported; only 'even' (numpy's default)")
        widths = _pairs(pad_width, x.ndim, "pad_width", ints=True)
        if mode in ("constant", "empty"):
            values = _pairs(0 if mode == "empty" else constant_values, x.ndim, "constant_values", ints=False)
        for d, ((before, after), n) in enumerate(zip(widths, x.shape)):
            if n == 0 and before + after > 0 and not values:
                raise ValueError(f"pad: can't extend empty axis {d} using modes other than 'constant' or 'empty'")
    except (TypeError, ValueError) as e:
        error = e
    if x.grid.size > 1:  # (ranks padding differently would pair different moves)
        C.agree_arguments(
            x.grid.comm, "pad", error, pad_width=widths, mode=mode, values=values, requires_grad=needs_grad(x.local)
        )
    elif error is not None:
        raise error
    if x.ndim == 0:
        return x.copy()
    return _constant(x, widths, values) if values else _copying(x, widths, mode)
