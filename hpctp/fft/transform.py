"""Distributed n-D FFTs of DistTensors: pencil redistributions around local 1-D transforms.

Torch blocks that require grad stay in the autograd graph: each move is the differentiable
:class:`hpctp.ops.autograd.Redistribute` (backward: the move back) and each 1-D transform
torch's own, so ``backward`` through an FFT is collective over the grid like the layers'.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any, cast

from .. import comm as C
from .._util.backend import array_module, backend_name, dtype_kind, empty_like_backend
from .._util.ints import is_int
from ..layout import Layout, normalize_split
from ..ops.move import move_block
from ..ops.transfer import needs_grad
from ..tensor.core import DistTensor
from .plan import fft_plan, normalize_fft_axes, step_layout

__all__ = ["fftn", "ifftn", "rfftn", "irfftn"]

_NORMS = (None, "backward", "ortho", "forward")


_NUMPY_FFT_DTYPES = ("torch.float32", "torch.float64", "torch.complex64", "torch.complex128")


def _numpy_runs(x: Any) -> bool:
    """Whether a torch block's 1-D transform runs as numpy's FFT on the block's own memory.

    For CPU blocks autograd does not record, numpy's pocketfft on ``x.numpy()`` (no copy) gives
    the same transform about twice as fast as ``torch.fft`` on one thread, and returns it
    C-contiguous where torch returns the transformed dim innermost, which makes the next move's
    packing a transposing copy. Blocks that require grad keep torch's differentiable FFT; half
    precision (no numpy FFT) keeps torch's too."""
    return x.device.type == "cpu" and not x.requires_grad and str(x.dtype) in _NUMPY_FFT_DTYPES


def _local(x: Any, kind: str, axis: int, n: int | None, norm: object) -> Any:
    """This block's 1-D ``kind`` transform along ``axis`` with its own backend's FFT.

    An empty block (a rank with no batch/channel entries: a moved grid axis can divide a dim
    into more parts than it has entries) gets the transform of a one-entry stand-in, cut back
    to empty: the right shape and dtype, and no call into an FFT library that refuses it."""
    name = backend_name(x)
    if name == "torch" and str(x.dtype) == "torch.bfloat16":  # no bfloat16 FFT: float32, as torch's autocast
        x = x.float()
    if name == "torch" and _numpy_runs(x):  # (numpy's FFT on the same memory: see _numpy_runs)
        import torch

        return torch.from_numpy(_local(x.detach().resolve_conj().numpy(), kind, axis, n, norm))
    if name == "torch":
        import torch

        fn, where = getattr(torch.fft, kind), {"dim": axis}
    else:
        fn, where = getattr(array_module(x).fft, kind), {"axis": axis}
    if all(int(s) for s in x.shape):
        return fn(x, n=n, norm=norm, **where)
    probe = empty_like_backend(tuple(max(int(s), 1) for s in x.shape), x.dtype, x)
    probe[...] = 0
    out = fn(probe, n=n, norm=norm, **where)
    out = out[tuple(slice(0, int(s)) if d != axis else slice(None) for d, s in enumerate(x.shape))]
    if name == "torch" and x.requires_grad:  # keep the (empty) block in the graph: its backward is collective
        out = out + x.abs().sum() * 0  # (a real zero: an irfft's output stays real)
    return out


_Plan = tuple[tuple[Any, ...], Layout, "int | None"]
_PLANS: weakref.WeakKeyDictionary[Any, dict[Hashable, _Plan]] = weakref.WeakKeyDictionary()
"""Per grid: the validated, agreed plan of every transform signature seen (steps, output layout, n)."""


def _frozen(value: object) -> Hashable:
    """A hashable stand-in for an argument (sequences as tuples); unhashable ones give a fresh object
    (never found again: no caching)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return object()
    return cast(Hashable, value)


def _run(
    x: DistTensor, what: str, axes: object, norm: object, out_split: object, half: str | None, s_last: object = None
) -> DistTensor:
    key: Hashable = None
    if isinstance(x, DistTensor):  # the arguments' signature: validated and agreed on once per grid
        key = (what, x.layout, _frozen(axes), _frozen(norm), _frozen(out_split), _frozen(s_last),
               needs_grad(x.local), dtype_kind(x.local), half)  # fmt: skip
        cached = _PLANS.get(x.grid, {}).get(key)
        if cached is not None:
            return _execute(x, what, half, norm, *cached)
    error: Exception | None = None
    steps: tuple[Any, ...] = ()
    target: Layout | None = None
    n_last: int | None = None
    try:
        if not isinstance(x, DistTensor):
            raise TypeError(f"{what} needs a hpctp.DistTensor, got {type(x).__name__}")
        if norm not in _NORMS:
            raise ValueError(f"norm must be None, 'backward', 'ortho' or 'forward', got {norm!r}")
        ax = normalize_fft_axes(axes, x.ndim)
        shape = list(x.global_shape)
        if any(shape[a] == 0 for a in ax) and half != "irfft":
            raise ValueError(f"{what}: cannot transform an empty dim (shape {tuple(shape)}, axes {ax})")
        if half == "irfft":
            m = shape[ax[-1]]
            if s_last is not None and (not is_int(s_last) or s_last < 1):
                raise ValueError(f"{what}: n={s_last!r} (the last axis' output length) must be an int >= 1")
            n_last = int(s_last) if s_last is not None else 2 * (m - 1)
            if n_last < 1:
                raise ValueError(f"{what}: the last axis has {m} modes; give n (its output length) explicitly")
        if half == "rfft" and dtype_kind(x.local) == "c":
            raise TypeError(f"{what} transforms real data; got a {x.dtype} tensor (use fftn)")
        first, last = (ax[-1], None) if half == "rfft" else (None, ax[-1]) if half == "irfft" else (None, None)
        steps = fft_plan(x.split, shape, x.grid.dims, ax, first, last)
        if half == "rfft":
            shape[ax[-1]] = shape[ax[-1]] // 2 + 1
        elif n_last is not None:  # irfft
            shape[ax[-1]] = n_last
        if isinstance(out_split, str) and out_split == "same":
            out = x.split
        elif isinstance(out_split, str) and out_split == "any":
            out = steps[-1].split if steps[-1].grid_dims is None else x.split  # (a merged grid's: not ours)
        else:
            out = normalize_split(out_split, x.ndim, x.grid.ndim)
        target = step_layout(x.layout, shape, out)
    except (TypeError, ValueError) as e:
        error = e
    if not isinstance(x, DistTensor):  # no communicator to tell the other ranks
        raise error if error is not None else TypeError(f"{what} needs a hpctp.DistTensor")
    grad = needs_grad(x.local)  # (the key's: agreed below, as the other arguments)
    C.agree_arguments(
        x.grid.comm, what, error, axes=axes, norm=norm, out_split=out_split, n=s_last, requires_grad=grad
    )  # (a backward on some ranks only would wait forever in its moves)
    plan: _Plan = (steps, cast(Layout, target), n_last)  # (set: no rank failed the checks)
    table = _PLANS.setdefault(x.grid, {})
    if len(table) >= 256:  # (forgotten together on every rank: the ranks see the same signatures)
        table.clear()
    table[key] = plan
    return _execute(x, what, half, norm, *plan)


def _execute(
    x: DistTensor,
    what: str,
    half: str | None,
    norm: object,
    steps: tuple[Any, ...],
    out_layout: Layout,
    n_last: int | None,
) -> DistTensor:
    """Collective over grid. Run an agreed plan: the moves between steps and each step's 1-D transforms."""
    grid, grad = x.grid, needs_grad(x.local)
    base = "ifft" if half == "irfft" or what == "ifftn" else "fft"
    block, lay = x.local, x.layout
    for i, step in enumerate(steps):
        want = step_layout(lay, lay.global_shape, step.split, step.grid_dims or grid.dims)
        if want != lay:
            block, lay = move_block(block, grid, lay, want, grad), want
        kind, n = base, None
        if (half == "rfft" and i == 0) or (half == "irfft" and i == len(steps) - 1):
            kind, n = half, n_last
        block = _local(block, kind, step.axis, n, norm)
        new_shape = list(lay.global_shape)
        new_shape[step.axis] = int(block.shape[step.axis])
        lay = step_layout(lay, new_shape, step.split)
    if out_layout != lay:
        block = move_block(block, grid, lay, out_layout, grad)
    return DistTensor(block, grid, out_layout)


def fftn(x: DistTensor, axes: object = None, norm: str | None = None, out_split: object = "same") -> DistTensor:
    """Collective over grid. n-D discrete Fourier transform of a distributed tensor (``numpy.fft.fftn``).

    Each 1-D transform runs on whole pencils: a dim divided by the grid first hands its grid
    axis to another dim (one ``Alltoallv``; see :func:`hpctp.fft.fft_plan`), then every rank
    transforms its block with its own backend (numpy, torch or cupy FFT). A tensor divided
    along every dim (a 2-D field on a 2-D grid) is transformed in slabs or pencils over
    merged grid axes and moved back. Differentiable for torch blocks that require grad
    (the backward is collective over grid).

    Parameters
    ----------
    x : DistTensor
    axes : int or sequence of int, optional
        Dims to transform (default: all).
    norm : {None, "backward", "ortho", "forward"}
        As numpy.
    out_split : "same", "any" or split specification
        Layout of the result: the input's (default), whatever the last transform left
        (saves the final redistribution: the transposed output of pencil FFTs; the input's
        when that was on a merged grid), or a split.

    Returns
    -------
    DistTensor
        Complex, of the backend's complex dtype; equals the backend's ``fftn`` on the
        gathered tensor.

    Raises
    ------
    ValueError
        On every rank: bad axes or norm, an empty dim to transform, or a 1-D tensor divided
        by the grid.
    TypeError
        If ``x`` is not a DistTensor.
    """
    return _run(x, "fftn", axes, norm, out_split, None)


def ifftn(x: DistTensor, axes: object = None, norm: str | None = None, out_split: object = "same") -> DistTensor:
    """Collective over grid. Inverse of :func:`fftn` (``numpy.fft.ifftn``); same parameters."""
    return _run(x, "ifftn", axes, norm, out_split, None)


def rfftn(x: DistTensor, axes: object = None, norm: str | None = None, out_split: object = "same") -> DistTensor:
    """Collective over grid. n-D FFT of a real distributed tensor (``numpy.fft.rfftn``).

    The last of ``axes`` is transformed first, with ``rfft``, and shrinks to ``n // 2 + 1``;
    see :func:`fftn` for the rest.

    Raises
    ------
    TypeError
        On a complex tensor (use :func:`fftn`) or a non-DistTensor.
    ValueError
        As :func:`fftn`.
    """
    return _run(x, "rfftn", axes, norm, out_split, "rfft")


def irfftn(
    x: DistTensor, n: int | None = None, axes: object = None, norm: str | None = None, out_split: object = "same"
) -> DistTensor:
    """Collective over grid. Inverse of :func:`rfftn` (``numpy.fft.irfftn``).

    The last of ``axes`` is transformed last, with ``irfft``, to length ``n`` (default
    ``2 * (m - 1)`` for ``m`` modes, as numpy); the others with ``ifft``.

    Parameters
    ----------
    x : DistTensor
        Complex.
    n : int, optional
        Output length of the last axis (numpy's ``s[-1]``).
    axes, norm, out_split
        As :func:`fftn`.

    Returns
    -------
    DistTensor
        Real.
    """
    return _run(x, "irfftn", axes, norm, out_split, "irfft", n)
