"""Strided window ops (conv, pooling, transposed conv) on spatially partitioned blocks.

Output tiling: the global output is cut into balanced blocks over the same grid axes as
the input. For each block, the exact global input range it needs is computed (it depends
on stride, padding and dilation, so it differs per rank) and fetched with a
:func:`hpctp.halo.fetch_plan` (neighbours' data inside, boundary condition outside).
The interior outputs, whose windows lie inside the own block, are computed while the
messages are in flight; the boundary strips afterwards from the fetched data.

Memory: for "same"-size stride-1 convolutions the whole own block is convolved in place of
the interior (zero-padded, no copy of the block) and the boundary strips receive an in-place
correction from the halo alone; in backward the halo gradients of all layers are added
straight into the input gradient buffer (:class:`~hpctp.nn.spatial._fetch.GradSink`), so a rank
needs about the memory of torch on its block.

Each op takes the layer's input as a :class:`~hpctp.nn.spatial._inputs.FieldInput` (block, global
layout, grid; :func:`~hpctp.nn.spatial._inputs.field_input`) and its arguments as one
:class:`~hpctp.nn.spatial.window_spec.WindowSpec`, and returns the result in the input's kind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...halo.plan import fetch_plan
from ...halo.run import FetchHandle, begin_fetch
from ...layout import Layout
from .._amp import autocast_dtype, autocast_input
from ._fetch import Fetch, FetchStrips, GradSink, Slot
from ._inputs import FieldInput
from .window_spec import DimWindow, WindowSpec

__all__ = ["AddInto", "Assemble", "Tie", "conv", "conv_transpose", "pool", "windowed"]

Box = tuple[tuple[int, int], ...]
Op = Callable[[torch.Tensor, tuple[slice, ...], tuple[int, ...]], torch.Tensor]


class Tie(torch.autograd.Function):
    """Local autograd op. ``y`` (copied), with zero gradients to ``deps``: keeps collective backward nodes in the graph."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, *deps: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.deps = [(d.shape, d.dtype, d.device) for d in deps]
        return y.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return (g, *[torch.zeros((), dtype=t, device=v).expand(s) for s, t, v in ctx.deps])


class Assemble(torch.autograd.Function):
    """Local autograd op. A new tensor of ``shape`` tiled by ``pieces`` at ``boxes``; backward hands out views."""

    @staticmethod
    def forward(
        ctx: Any, shape: tuple[int, ...], boxes: list[tuple[slice, ...]], *pieces: torch.Tensor
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.boxes = boxes
        y = pieces[0].new_empty(shape)
        for b, p in zip(boxes, pieces):
            y[b] = p
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return (None, None, *[g[b] for b in ctx.boxes])


class AddInto(torch.autograd.Function):
    """Local autograd op. ``y[boxes[i]] += corrs[i]`` in place (no copy of ``y`` in forward or backward)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, boxes: list[tuple[slice, ...]], *corrs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.mark_dirty(y)
        ctx.boxes = boxes
        for b, c in zip(boxes, corrs):
            y[b] += c
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return (g, None, *[g[b] for b in ctx.boxes])


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def windowed(
    field: FieldInput,
    windows: Sequence[DimWindow],
    boundary: str,
    channels: int,
    op: Op,
    *,
    fill: float,
    params: Sequence[torch.Tensor],
    overlap: bool,
    linear: tuple[Callable[[torch.Tensor], torch.Tensor], Op] | None = None,
) -> tuple[torch.Tensor, Layout]:
    """Collective over grid. Apply a strided window ``op`` to the global field.

    ``windows[d]`` is spatial dim ``d``'s window (extent in input cells, stride, padding,
    global output length); ``boundary`` the condition outside the global field, ``fill``
    the value of the padding cells fetched (``-inf`` for max pooling), ``channels`` the
    output's. ``op(inp, box, pad)`` applies the op with torch padding ``pad`` (per spatial
    dim) to an input slab and returns the outputs of the local output ``box``. Dims that are
    whole on every rank with zero boundary and symmetric padding are padded by ``op`` itself;
    the others are fetched exactly (neighbours' data and boundary). ``params`` are the op's
    parameters (kept in the graph where a rank has no output). ``overlap``: compute the
    interior while the halo is in flight.

    ``linear = (full_op, corr_op)`` for linear ops (convolutions): when every stride is 1,
    the padding symmetric and the output blocks equal the input blocks, the result is
    ``full_op(x)`` (the op on the own block, zero-padded by ``pad_lo`` everywhere: no
    copy of the block) plus, on the boundary strips, ``corr_op`` applied to the fetched
    halo with the own block zeroed (added in place).
    """
    x, layout, grid = field.block, field.global_layout, field.grid
    nd = len(windows)
    out_layout = Layout((layout.global_shape[0], channels, *(w.size for w in windows)), grid.dims, layout.split)
    native = [layout.parts(d + 2) == 1 and boundary == "zero" and w.pad_lo == w.pad_hi for d, w in enumerate(windows)]
    pad = tuple(w.pad_lo if nat else 0 for w, nat in zip(windows, native))
    wants: list[tuple[tuple[int, int], ...]] = [((0, layout.global_shape[0]),), ((0, layout.global_shape[1]),)]
    for d, w in enumerate(windows):
        if native[d]:
            wants.append(((0, layout.global_shape[d + 2]),))
            continue
        oc = out_layout.dim_cuts[d + 2]
        wants.append(
            tuple(
                (o0 * w.stride - w.pad_lo, (o1 - 1) * w.stride - w.pad_lo + w.extent) if o1 > o0 else (0, 0)
                for o0, o1 in zip(oc[:-1], oc[1:])
            )
        )
    plan = fetch_plan(layout, grid.rank, tuple(wants), ("zero", "zero", *(boundary,) * nd))
    out_shape = out_layout.local_shape(grid.coords)
    obox = out_layout.local_ranges(grid.coords)[2:]
    ibox = layout.local_ranges(grid.coords)[2:]
    if not overlap:
        xin = Fetch.apply(x, plan, grid.comm, fill)
        if math.prod(out_shape) == 0 or math.prod(xin.shape) == 0:
            return Tie.apply(x.new_zeros(out_shape), xin, *params), out_layout
        return op(xin, _slices([(0, n) for n in out_shape[2:]]), pad), out_layout
    # interior: outputs whose whole window lies in this rank's own input block
    interior = []
    for w, (o0, o1), (a, b), nat in zip(windows, obox, ibox, native):
        if nat:
            lo, hi = o0, o1
        else:
            lo, hi = max(o0, _ceil_div(a + w.pad_lo, w.stride)), min(o1, (b - w.extent + w.pad_lo) // w.stride + 1)
        interior.append((lo - o0, max(lo, hi) - o0))
    has_int = all(hi > lo for lo, hi in interior) and math.prod(out_shape) > 0
    strips = _onion([(0, n) for n in out_shape[2:]], interior if has_int else None)

    def in_slices(box: Box, origin: Sequence[int]) -> tuple[slice, ...]:
        sl = [slice(None), slice(None)]
        for (q0, q1), w, org, nat in zip(box, windows, origin, native):
            sl.append(slice(None) if nat else slice(q0 * w.stride + org, (q1 - 1) * w.stride + w.extent + org))
        return tuple(sl)

    need = [in_slices(s, [0] * nd) for s in strips]
    slot = Slot() if x.requires_grad and torch.is_grad_enabled() else None
    x_in = GradSink.apply(x, slot) if slot is not None else x  # adjoint halo lands in x's grad buffer
    if (
        linear is not None
        and math.prod(out_shape) > 0
        and math.prod(x.shape) > 0
        and all(
            w.stride == 1 and w.pad_lo == w.pad_hi and out_layout.dim_cuts[d + 2] == layout.dim_cuts[d + 2]
            for d, w in enumerate(windows)
        )
    ):
        own = (slice(None), slice(None)) + tuple(
            slice(None) if nat else slice(a - w0, b - w0) for (a, b), (w0, _), nat in zip(ibox, plan.want[2:], native)
        )
        handle = begin_fetch(plan, grid.comm, x.detach(), None, fill, need, skip=own)
        with _complete_on_error(handle):
            y = linear[0](x_in)  # the bulk, while the halo is in flight
        outs = FetchStrips.apply(x_in, handle, grid.comm, need, own, slot)
        corrs = [linear[1](inp, _slices(s), pad) for inp, s in zip(outs[:-1], strips)]
        if corrs:
            return AddInto.apply(y, [(slice(None), slice(None), *_slices(s)) for s in strips], *corrs), out_layout
        if plan.sends or plan.recvs:
            return Tie.apply(y, outs[-1]), out_layout
        if slot is not None:
            slot.used = False
        return y, out_layout
    handle = begin_fetch(plan, grid.comm, x.detach(), None, fill, need)
    y_int = None
    if has_int:  # origin: x's first cell relative to the first wanted cell of the own outputs
        origin = [o0 * w.stride - w.pad_lo - a for w, (o0, _), (a, _) in zip(windows, obox, ibox)]
        sl = in_slices(tuple(interior), origin)
        whole = all(s == slice(None) or (s.start == 0 and s.stop == n) for s, n in zip(sl, x.shape))
        with _complete_on_error(handle):
            y_int = op(x_in if whole else x_in[sl], _slices(interior), pad)  # no SliceBackward copy if whole
    outs = FetchStrips.apply(x_in, handle, grid.comm, need, None, slot)
    ys = [op(inp, _slices(s), pad) for inp, s in zip(outs[:-1], strips)]
    if math.prod(out_shape) == 0:
        return Tie.apply(x.new_zeros(out_shape), outs[-1], *params), out_layout
    if y_int is not None and not ys:
        if plan.sends or plan.recvs:
            return Tie.apply(y_int, outs[-1]), out_layout
        if slot is not None:
            slot.used = False
        return y_int, out_layout
    if y_int is None and len(ys) == 1:
        return ys[0], out_layout
    boxes = ([interior] if y_int is not None else []) + list(strips)
    pieces = ([y_int] if y_int is not None else []) + ys
    return Assemble.apply(out_shape, [(slice(None), slice(None), *_slices(b)) for b in boxes], *pieces), out_layout


@contextlib.contextmanager
def _complete_on_error(handle: FetchHandle) -> Iterator[None]:
    """Compute overlapped with a fetch: if it raises, the fetch's messages are completed first,
    so no MPI request outlives the buffers it points to."""
    try:
        yield
    except BaseException:
        handle.wait()
        raise


def _slices(box: Sequence[tuple[int, int]]) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def _onion(full: list[tuple[int, int]], inner: list[tuple[int, int]] | None) -> list[Box]:
    """Disjoint boxes covering ``full`` minus ``inner`` (slabs peeled one dim at a time)."""
    if any(hi <= lo for lo, hi in full):
        return []
    if inner is None:
        return [tuple(full)]
    out: list[Box] = []
    cur = list(full)
    for d, (lo, hi) in enumerate(inner):
        for part in ((cur[d][0], lo), (hi, cur[d][1])):
            if part[1] > part[0]:
                out.append(tuple(cur[:d] + [part] + cur[d + 1 :]))
        cur[d] = (lo, hi)
    return out


def _check_weights(field: FieldInput, weight: torch.Tensor, bias: torch.Tensor | None, spec: WindowSpec) -> None:
    """Everything torch would reject inside the op, checked before any message is posted
    (from global quantities, so every rank agrees)."""
    nd, groups, transposed = spec.nd, spec.groups, spec.kind == "conv_transpose"
    if weight.ndim != nd + 2:
        raise ValueError(f"weight must have {nd + 2} dims, got {weight.ndim}")
    if transposed:  # weight [in, out / groups, *k]
        channels, out_channels = int(weight.shape[0]), int(weight.shape[1]) * groups
    else:  # weight [out, in / groups, *k]
        channels, out_channels = int(weight.shape[1]) * groups, int(weight.shape[0])
    if weight.shape[0] % groups:
        what = "in_channels" if transposed else "out_channels"
        raise ValueError(f"weight dim 0 ({what}={weight.shape[0]}) is not divisible by groups={groups}")
    layout = field.global_layout
    if layout.global_shape[1] != channels:
        raise ValueError(f"input has {layout.global_shape[1]} channels, the weight expects {channels}")
    if field.block.dtype != weight.dtype and autocast_dtype(field.block) is None:  # (autocast casts the weight)
        raise ValueError(f"input dtype {field.block.dtype} differs from the weight dtype {weight.dtype}")
    if bias is not None and tuple(bias.shape) != (out_channels,):
        raise ValueError(
            f"bias must have shape ({out_channels},) for {out_channels} output channels, got {tuple(bias.shape)}"
        )


def _autocast(field: FieldInput) -> FieldInput:
    """The field in autocast's dtype when autocast is on, cast before its halo travels (half the bytes)."""
    block = autocast_input(field.block)
    return field if block is field.block else dataclasses.replace(field, block=block)


@functools.lru_cache(maxsize=256)
def _pointwise_layout(layout: Layout, windows: tuple[DimWindow, ...], channels: int) -> Layout | None:
    """The output layout of a pointwise window op (every window one cell, stride 1, no padding) on a balanced
    ``layout`` (the output blocks are then :func:`windowed`'s) with ``channels`` channels, where every rank's
    block holds cells (torch's convolutions reject empty ones); else None. Global: the same verdict on every
    rank, cached per layout (no Layout built per call)."""
    if any(w != DimWindow(1, 1, 0, 0, w.size) for w in windows) or not layout.is_balanced:
        return None
    if any(min(np.diff(c), default=0) <= 0 for c in layout.dim_cuts[:1] + layout.dim_cuts[2:]):
        return None
    return layout.with_size(1, channels)


def conv(field: FieldInput, weight: torch.Tensor, bias: torch.Tensor | None, spec: WindowSpec, overlap: bool) -> Any:
    """Collective over grid. This rank's block of the global ``convNd`` of ``spec``, in the input's kind.

    A pointwise convolution (1x1, stride 1, no padding) on blocks that all hold cells needs no neighbour's
    cell: it runs on the own block alone, with no message and no window bookkeeping per call.
    """
    field = _autocast(field)
    _check_weights(field, weight, bias, spec)
    windows = spec.windows(field.global_layout.global_shape[2:], weight.shape[2:])
    fn = (F.conv1d, F.conv2d, F.conv3d)[spec.nd - 1]
    s, dil, groups = spec.stride, spec.dilation, spec.groups
    pointwise = _pointwise_layout(field.global_layout, tuple(windows), int(weight.shape[0]))
    if pointwise is not None:
        return field.wrap(fn(field.block, weight, bias, 1, 0, 1, groups), pointwise)

    def op(inp: torch.Tensor, box: tuple[slice, ...], pad: tuple[int, ...]) -> torch.Tensor:
        return fn(inp, weight, bias, s, pad, dil, groups)

    def full_op(inp: torch.Tensor) -> torch.Tensor:
        return fn(inp, weight, bias, 1, tuple(w.pad_lo for w in windows), dil, groups)

    def corr_op(inp: torch.Tensor, box: tuple[slice, ...], pad: tuple[int, ...]) -> torch.Tensor:
        return fn(inp, weight, None, 1, pad, dil, groups)

    params = [weight] + ([bias] if bias is not None else [])
    y, out_layout = windowed(
        field, windows, spec.boundary, weight.shape[0], op,
        fill=0.0, params=params, overlap=overlap, linear=(full_op, corr_op),
    )  # fmt: skip
    return field.wrap(y, out_layout)


def pool(field: FieldInput, spec: WindowSpec, overlap: bool) -> Any:
    """Collective over grid. This rank's block of the global max/avg pooling of ``spec``, in the input's kind."""
    layout, grid = field.global_layout, field.grid
    windows = spec.windows(layout.global_shape[2:])
    k, s, ceil_mode = spec.kernel, spec.stride, spec.ceil_mode
    if spec.kind == "max":
        fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[spec.nd - 1]
        dil = spec.dilation

        def op(inp: torch.Tensor, box: tuple[slice, ...], pad: tuple[int, ...]) -> torch.Tensor:
            return fn(inp, k, s, pad, dil, ceil_mode)

        fill = float("-inf")
    else:
        afn = (F.avg_pool2d, F.avg_pool3d)[spec.nd - 2]
        div = spec.divisor_override
        if div is not None:

            def op(inp: torch.Tensor, box: tuple[slice, ...], pad: tuple[int, ...]) -> torch.Tensor:
                return afn(inp, k, s, pad, ceil_mode, True, div)

        else:  # torch's divisors of the own output block
            obox = Layout((1, 1, *(w.size for w in windows)), grid.dims, layout.split).local_ranges(grid.coords)[2:]
            divisor = _divisor(spec, windows, obox, layout.global_shape[2:], field.block)

            def op(inp: torch.Tensor, box: tuple[slice, ...], pad: tuple[int, ...]) -> torch.Tensor:
                return afn(inp, k, s, pad, ceil_mode, True, 1) / divisor[(slice(None), slice(None), *box)]

        fill = 0.0
    y, out_layout = windowed(field, windows, "zero", layout.global_shape[1], op, fill=fill, params=[], overlap=overlap)
    return field.wrap(y, out_layout)


def _divisor(
    spec: WindowSpec, windows: Sequence[DimWindow], obox: Box, sizes: Sequence[int], like: torch.Tensor
) -> torch.Tensor:
    """Per-output-cell divisor of average pooling (torch's rule, incl. ceil_mode windows)."""
    nd = len(windows)
    div = torch.ones((1, 1) + (1,) * nd, dtype=like.dtype)
    for d, (w, kk, (o0, o1), n) in enumerate(zip(windows, spec.kernel, obox, sizes)):
        start = np.arange(o0, o1) * w.stride - w.pad_lo
        end = np.minimum(start + kk, n + w.pad_lo)
        cnt = end - start if spec.count_include_pad else np.minimum(end, n) - np.maximum(start, 0)
        shape = [1] * (nd + 2)
        shape[d + 2] = o1 - o0
        div = div * torch.from_numpy(cnt.astype(np.float64)).to(like.dtype).reshape(shape)
    return div.to(like.device)


def conv_transpose(field: FieldInput, weight: torch.Tensor, bias: torch.Tensor | None, spec: WindowSpec) -> Any:
    """Collective over grid. This rank's block of the global ``conv_transposeNd`` of ``spec``, in the input's kind."""
    field = _autocast(field)
    _check_weights(field, weight, bias, spec)
    x, layout, grid, nd = field.block, field.global_layout, field.grid, spec.nd
    k = tuple(int(v) for v in weight.shape[2:])
    s, p, dil = spec.stride, spec.padding, spec.dilation
    lens = spec.transposed_sizes(layout.global_shape[2:], k)
    out_layout = Layout((layout.global_shape[0], weight.shape[1] * spec.groups, *lens), grid.dims, layout.split)
    wants: list[tuple[tuple[int, int], ...]] = [((0, layout.global_shape[0]),), ((0, layout.global_shape[1]),)]
    for d in range(nd):
        oc, ext = out_layout.dim_cuts[d + 2], dil[d] * (k[d] - 1)
        rng = []
        for o0, o1 in zip(oc[:-1], oc[1:]):
            lo, hi = _ceil_div(o0 + p[d] - ext, s[d]), (o1 - 1 + p[d]) // s[d] + 1
            rng.append((lo, max(lo, hi)) if o1 > o0 else (0, 0))
        wants.append(tuple(rng))
    plan = fetch_plan(layout, grid.rank, tuple(wants), ("zero",) * (nd + 2))
    xin = Fetch.apply(x, plan, grid.comm, 0.0)
    out_shape = out_layout.local_shape(grid.coords)
    params = [weight] + ([bias] if bias is not None else [])
    if math.prod(out_shape) == 0 or math.prod(xin.shape) == 0:
        y = x.new_zeros(out_shape)
        if bias is not None and math.prod(out_shape) > 0:
            y = y + bias.to(y.dtype).reshape((1, -1) + (1,) * nd)  # (autocast: y's dtype, as torch)
        return field.wrap(Tie.apply(y, xin, *params), out_layout)
    fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
    z = fn(xin, weight, None, s, 0, 0, spec.groups, dil)
    pad: list[int] = []
    for d in reversed(range(nd)):  # F.pad wants the last dim first; negative amounts crop
        o0, o1 = out_layout.local_ranges(grid.coords)[d + 2]
        t0 = plan.want[d + 2][0] * s[d]
        pad += [t0 - (o0 + p[d]), (o1 + p[d]) - (t0 + z.shape[d + 2])]
    y = F.pad(z, pad)
    if bias is not None:
        y = y + bias.to(y.dtype).reshape((1, -1) + (1,) * nd)  # (autocast: y's dtype, as torch)
    return field.wrap(y, out_layout)
