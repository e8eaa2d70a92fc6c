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
straight into the input gradient buffer (:class:`~hpctp.nn._fetch.GradSink`), so a rank
needs about the memory of torch on its block.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .._util.ints import is_int
from ..comm import ProcessGrid
from ..halo.plan import fetch_plan
from ..halo.run import FetchHandle, begin_fetch
from ..layout import Layout, normalize_split
from ._fetch import Fetch, FetchStrips, GradSink, Slot

__all__ = ["AddInto", "Assemble", "Tie", "conv", "conv_transpose", "full_split", "ntuple", "pool", "windowed"]

_MODES = {"zeros": "zero", "circular": "periodic", "reflect": "reflect", "replicate": "replicate"}
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


def full_split(split: object, nd: int, grid_ndim: int) -> tuple[int | None, ...]:
    """Local. ``(None, None, *spatial)`` from a spatial split (length ``nd``) or a full one."""
    if split is None:
        return (None, None) + tuple(i if i < grid_ndim else None for i in range(nd))
    try:
        items: tuple[Any, ...] = tuple(split)  # type: ignore[call-overload, arg-type]
    except TypeError:
        raise ValueError(f"split must be a sequence of grid axes (or None) per spatial dim, got {split!r}") from None
    if len(items) == nd + 2:
        if items[0] is not None or items[1] is not None:
            raise ValueError(f"split={items}: batch and channel dims cannot be split by these layers")
        items = items[2:]
    if len(items) != nd:
        raise ValueError(f"split={items} must have one entry per spatial dim ({nd}) or per dim ({nd + 2})")
    return normalize_split((None, None) + items, nd + 2, grid_ndim)


def ntuple(v: object, nd: int, name: str, minimum: int = 1) -> tuple[int, ...]:
    """Local. An int or a length-``nd`` sequence of ints as a tuple (validated)."""
    items = (v,) * nd if is_int(v) else tuple(v)  # type: ignore[arg-type]
    if len(items) != nd or not all(is_int(i) for i in items):
        raise ValueError(f"{name}={v!r} must be an int or {nd} ints")
    if any(i < minimum for i in items):
        raise ValueError(f"{name}={v!r} must be >= {minimum}")
    return tuple(int(i) for i in items)


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def windowed(
    x: torch.Tensor,
    layout: Layout,
    grid: ProcessGrid,
    specs: Sequence[tuple[int, int, int, int, int]],
    boundary: Sequence[str],
    fill: float,
    channels: int,
    op: Op,
    overlap: bool,
    params: Sequence[torch.Tensor],
    native_pad: bool = True,
    linear: tuple[Callable[[torch.Tensor], torch.Tensor], Op] | None = None,
) -> tuple[torch.Tensor, Layout]:
    """Collective over grid. Apply a strided window ``op`` to the global field.

    ``specs[d] = (extent, stride, pad_lo, pad_hi, out_len)`` per spatial dim: window extent
    in input cells (``dilation * (k - 1) + 1``), stride, padding and global output length.
    ``op(inp, box, pad)`` applies the op with torch padding ``pad`` (per spatial dim) to an
    input slab and returns the outputs of the local output ``box``. Dims that are whole on
    every rank with zero boundary and symmetric padding (if ``native_pad``) are padded by
    ``op`` itself; the others are fetched exactly (neighbours' data and boundary).

    ``linear = (full_op, corr_op)`` for linear ops (convolutions): when every stride is 1,
    the padding symmetric and the output blocks equal the input blocks, the result is
    ``full_op(x)`` (the op on the own block, zero-padded by ``pad_lo`` everywhere: no
    copy of the block) plus, on the boundary strips, ``corr_op`` applied to the fetched
    halo with the own block zeroed (added in place).
    """
    nd = len(specs)
    out_layout = Layout((layout.global_shape[0], channels, *(s[4] for s in specs)), grid.dims, layout.split)
    native = [
        native_pad and layout.parts(d + 2) == 1 and boundary[d] == "zero" and sp[2] == sp[3]
        for d, sp in enumerate(specs)
    ]
    pad = tuple(sp[2] if nat else 0 for sp, nat in zip(specs, native))
    wants: list[tuple[tuple[int, int], ...]] = [((0, layout.global_shape[0]),), ((0, layout.global_shape[1]),)]
    for d, (ext, st, pl, _, _) in enumerate(specs):
        if native[d]:
            wants.append(((0, layout.global_shape[d + 2]),))
            continue
        oc = out_layout.dim_cuts[d + 2]
        wants.append(
            tuple((o0 * st - pl, (o1 - 1) * st - pl + ext) if o1 > o0 else (0, 0) for o0, o1 in zip(oc[:-1], oc[1:]))
        )
    plan = fetch_plan(layout, grid.rank, tuple(wants), ("zero", "zero", *boundary))
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
    for (ext, st, pl, _, _), (o0, o1), (a, b), nat in zip(specs, obox, ibox, native):
        lo, hi = (o0, o1) if nat else (max(o0, _ceil_div(a + pl, st)), min(o1, (b - ext + pl) // st + 1))
        interior.append((lo - o0, max(lo, hi) - o0))
    has_int = all(hi > lo for lo, hi in interior) and math.prod(out_shape) > 0
    strips = _onion([(0, n) for n in out_shape[2:]], interior if has_int else None)

    def in_slices(box: Box, origin: Sequence[int]) -> tuple[slice, ...]:
        sl = [slice(None), slice(None)]
        for (q0, q1), (ext, st, _, _, _), org, nat in zip(box, specs, origin, native):
            sl.append(slice(None) if nat else slice(q0 * st + org, (q1 - 1) * st + ext + org))
        return tuple(sl)

    need = [in_slices(s, [0] * nd) for s in strips]
    slot = Slot() if x.requires_grad and torch.is_grad_enabled() else None
    x_in = GradSink.apply(x, slot) if slot is not None else x  # adjoint halo lands in x's grad buffer
    if (
        linear is not None
        and math.prod(out_shape) > 0
        and math.prod(x.shape) > 0
        and all(
            sp[1] == 1 and sp[2] == sp[3] and out_layout.dim_cuts[d + 2] == layout.dim_cuts[d + 2]
            for d, sp in enumerate(specs)
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
        origin = [o0 * st - pl - a for (_, st, pl, _, _), (o0, _), (a, _) in zip(specs, obox, ibox)]
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


def _check_input(
    x: torch.Tensor, layout: Layout, weight: torch.Tensor, bias: torch.Tensor | None, nd: int, groups: object,
    transposed: bool,
) -> None:  # fmt: skip
    """Everything torch would reject inside the op, checked before any message is posted
    (from global quantities, so every rank agrees)."""
    if not is_int(groups) or groups < 1:
        raise ValueError(f"groups must be an int >= 1, got {groups!r}")
    groups = int(groups)
    if weight.ndim != nd + 2:
        raise ValueError(f"weight must have {nd + 2} dims, got {weight.ndim}")
    if transposed:  # weight [in, out / groups, *k]
        channels, out_channels = int(weight.shape[0]), int(weight.shape[1]) * groups
    else:  # weight [out, in / groups, *k]
        channels, out_channels = int(weight.shape[1]) * groups, int(weight.shape[0])
    if weight.shape[0] % groups:
        what = "in_channels" if transposed else "out_channels"
        raise ValueError(f"weight dim 0 ({what}={weight.shape[0]}) is not divisible by groups={groups}")
    if layout.global_shape[1] != channels:
        raise ValueError(f"input has {layout.global_shape[1]} channels, the weight expects {channels}")
    if x.dtype != weight.dtype:
        raise ValueError(f"input dtype {x.dtype} differs from the weight dtype {weight.dtype}")
    if bias is not None and tuple(bias.shape) != (out_channels,):
        raise ValueError(
            f"bias must have shape ({out_channels},) for {out_channels} output channels, got {tuple(bias.shape)}"
        )


def conv(
    nd: int,
    x: torch.Tensor,
    layout: Layout,
    grid: ProcessGrid,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: object,
    padding: object,
    dilation: object,
    groups: int,
    padding_mode: str,
    overlap: bool,
) -> tuple[torch.Tensor, Layout]:
    """Collective over grid. Block of the global ``convNd`` and the output layout."""
    if padding_mode not in _MODES:
        raise ValueError(f"padding_mode must be one of {sorted(_MODES)}, got {padding_mode!r}")
    _check_input(x, layout, weight, bias, nd, groups, transposed=False)
    k = tuple(int(v) for v in weight.shape[2:])
    s, dil = ntuple(stride, nd, "stride"), ntuple(dilation, nd, "dilation")
    if isinstance(padding, str):
        if padding == "valid":
            pads = [(0, 0)] * nd
        elif padding == "same":
            if any(v != 1 for v in s):
                raise ValueError("padding='same' is not supported for strided convolutions")
            pads = [(t // 2, t - t // 2) for t in (dd * (kk - 1) for dd, kk in zip(dil, k))]
        else:
            raise ValueError(f"padding must be 'same', 'valid', an int or ints, got {padding!r}")
    else:
        pads = [(p, p) for p in ntuple(padding, nd, "padding", 0)]
    specs = []
    for d in range(nd):
        _check_padding_mode(padding_mode, pads[d], layout.global_shape[d + 2], d)
        ext = dil[d] * (k[d] - 1) + 1
        n = layout.global_shape[d + 2] + pads[d][0] + pads[d][1] - ext
        if n < 0:
            raise ValueError(
                f"spatial dim {d}: input size {layout.global_shape[d + 2]} (padded) is smaller than the kernel extent {ext}"
            )
        specs.append((ext, s[d], pads[d][0], pads[d][1], n // s[d] + 1))
    fn = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]

    def op(inp: torch.Tensor, box: tuple[slice, ...], pad: tuple[int, ...]) -> torch.Tensor:
        return fn(inp, weight, bias, s, pad, dil, groups)

    def full_op(inp: torch.Tensor) -> torch.Tensor:
        return fn(inp, weight, bias, 1, tuple(p[0] for p in pads), dil, groups)

    def corr_op(inp: torch.Tensor, box: tuple[slice, ...], pad: tuple[int, ...]) -> torch.Tensor:
        return fn(inp, weight, None, 1, pad, dil, groups)

    params = [weight] + ([bias] if bias is not None else [])
    return windowed(
        x,
        layout,
        grid,
        specs,
        [_MODES[padding_mode]] * nd,
        0.0,
        weight.shape[0],
        op,
        overlap,
        params,
        linear=(full_op, corr_op),
    )


def pool(
    nd: int,
    kind: str,
    x: torch.Tensor,
    layout: Layout,
    grid: ProcessGrid,
    kernel_size: object,
    stride: object,
    padding: object,
    dilation: object,
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
    overlap: bool,
) -> tuple[torch.Tensor, Layout]:
    """Collective over grid. Block of the global max/avg pooling and the output layout."""
    k = ntuple(kernel_size, nd, "kernel_size")
    s = k if stride is None or (not is_int(stride) and len(stride) == 0) else ntuple(stride, nd, "stride")  # type: ignore[arg-type]
    p, dil = ntuple(padding, nd, "padding", 0), ntuple(dilation, nd, "dilation")
    specs = []
    for d in range(nd):
        ext = dil[d] * (k[d] - 1) + 1
        if 2 * p[d] > k[d]:  # as torch: half the kernel size, dilation or not
            raise ValueError(f"pad should be at most half of the kernel size, got padding={p}, kernel_size={k}")
        n = layout.global_shape[d + 2]
        if kind == "avg" and nd == 3 and n < k[d]:  # torch's avg_pool3d rule (padding not counted)
            raise ValueError(
                f"spatial dim {d}: input size {n} is smaller than kernel_size {k[d]} (as torch's avg_pool3d)"
            )
        num = n + 2 * p[d] - ext + (s[d] - 1 if ceil_mode else 0)
        if num < 0:
            raise ValueError(f"spatial dim {d}: input size {n} is too small for pooling with kernel extent {ext}")
        out = num // s[d] + 1
        if ceil_mode and (out - 1) * s[d] >= n + p[d]:
            out -= 1
        if kind == "max" and (empty := _padding_only_window(n, k[d], s[d], p[d], dil[d], out)) is not None:
            raise ValueError(
                f"spatial dim {d}: max-pooling window {empty} covers only padding (input size {n}, kernel_size "
                f"{k[d]}, stride {s[d]}, padding {p[d]}, dilation {dil[d]}); torch gives -inf there and its "
                f"backward writes out of bounds. Use less padding or dilation"
            )
        specs.append((ext, s[d], p[d], p[d], out))
    if kind == "max":
        fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]

        def op(inp: torch.Tensor, box: tuple[slice, ...], pad: tuple[int, ...]) -> torch.Tensor:
            return fn(inp, k, s, pad, dil, ceil_mode)

        return windowed(x, layout, grid, specs, ["zero"] * nd, float("-inf"), layout.global_shape[1], op, overlap, [])
    if nd == 1:
        raise ValueError("avg pooling is provided for 2-D and 3-D fields")
    afn = (None, F.avg_pool2d, F.avg_pool3d)[nd - 1]
    if divisor_override is not None:
        if not is_int(divisor_override) or divisor_override == 0:
            raise ValueError(f"divisor_override must be a non-zero int or None, got {divisor_override!r}")
        divisor_override = int(divisor_override)

        def aop(inp: torch.Tensor, box: tuple[slice, ...], pad: tuple[int, ...]) -> torch.Tensor:
            return afn(inp, k, s, pad, ceil_mode, True, divisor_override)  # type: ignore[misc]
    else:
        out_layout = Layout((1, 1, *(sp[4] for sp in specs)), grid.dims, layout.split)
        div = _divisor(
            specs, k, out_layout.local_ranges(grid.coords)[2:], layout.global_shape[2:], count_include_pad, x
        )

        def aop(inp: torch.Tensor, box: tuple[slice, ...], pad: tuple[int, ...]) -> torch.Tensor:
            return afn(inp, k, s, pad, ceil_mode, True, 1) / div[(slice(None), slice(None), *box)]  # type: ignore[misc]

    return windowed(x, layout, grid, specs, ["zero"] * nd, 0.0, layout.global_shape[1], aop, overlap, [])


def _check_padding_mode(mode: str, pad: tuple[int, int], n: int, d: int) -> None:
    """torch's limits for padded convolutions: a reflection needs padding < size, a wrap padding <= size.

    (:func:`~hpctp.nn.functional.halo_pad` goes beyond them, as ``numpy.pad``; the layers agree with torch.)
    """
    p = max(pad)
    if (mode == "reflect" and 0 < p and p >= n) or (mode == "circular" and p > n):
        need = "smaller than" if mode == "reflect" else "at most"
        raise ValueError(
            f"padding_mode={mode!r}: padding {pad} of spatial dim {d} must be {need} its size {n} (as in torch); "
            f"use less padding or padding_mode='zeros'/'replicate'"
        )


@functools.lru_cache(maxsize=256)
def _padding_only_window(n: int, k: int, s: int, p: int, dil: int, out: int) -> int | None:
    """Index of the first of ``out`` pooling windows without an input cell (None if all have one)."""
    pos = (np.arange(out) * s - p)[:, None] + np.arange(k) * dil
    empty = np.flatnonzero(~((pos >= 0) & (pos < n)).any(axis=1))
    return int(empty[0]) if empty.size else None


def _divisor(
    specs: Sequence[tuple[int, int, int, int, int]],
    k: Sequence[int],
    obox: Box,
    sizes: Sequence[int],
    count_include_pad: bool,
    like: torch.Tensor,
) -> torch.Tensor:
    """Per-output-cell divisor of average pooling (torch's rule, incl. ceil_mode windows)."""
    div = torch.ones((1, 1) + (1,) * len(specs), dtype=like.dtype)
    for d, ((_, st, pl, _, _), kk, (o0, o1), n) in enumerate(zip(specs, k, obox, sizes)):
        start = np.arange(o0, o1) * st - pl
        end = np.minimum(start + kk, n + pl)
        cnt = end - start if count_include_pad else np.minimum(end, n) - np.maximum(start, 0)
        shape = [1] * (len(specs) + 2)
        shape[d + 2] = o1 - o0
        div = div * torch.from_numpy(cnt.astype(np.float64)).to(like.dtype).reshape(shape)
    return div.to(like.device)


def conv_transpose(
    nd: int,
    x: torch.Tensor,
    layout: Layout,
    grid: ProcessGrid,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: object,
    padding: object,
    output_padding: object,
    groups: int,
    dilation: object,
) -> tuple[torch.Tensor, Layout]:
    """Collective over grid. Block of the global ``conv_transposeNd`` and the output layout."""
    _check_input(x, layout, weight, bias, nd, groups, transposed=True)
    k = tuple(int(v) for v in weight.shape[2:])
    s, dil = ntuple(stride, nd, "stride"), ntuple(dilation, nd, "dilation")
    p, opad = ntuple(padding, nd, "padding", 0), ntuple(output_padding, nd, "output_padding", 0)
    if any(o >= max(a, b) for o, a, b in zip(opad, s, dil)):
        raise ValueError(f"output_padding={opad} must be smaller than stride {s} or dilation {dil}")
    lens = []
    for d in range(nd):
        n = (layout.global_shape[d + 2] - 1) * s[d] - 2 * p[d] + dil[d] * (k[d] - 1) + opad[d] + 1
        if n < 1:
            raise ValueError(f"spatial dim {d}: the transposed convolution output size {n} is < 1")
        lens.append(n)
    out_layout = Layout((layout.global_shape[0], weight.shape[1] * groups, *lens), grid.dims, layout.split)
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
            y = y + bias.reshape((1, -1) + (1,) * nd)
        return Tie.apply(y, xin, *params), out_layout
    fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
    z = fn(xin, weight, None, s, 0, 0, groups, dil)
    pad: list[int] = []
    for d in reversed(range(nd)):  # F.pad wants the last dim first; negative amounts crop
        o0, o1 = out_layout.local_ranges(grid.coords)[d + 2]
        t0 = plan.want[d + 2][0] * s[d]
        pad += [t0 - (o0 + p[d]), (o1 + p[d]) - (t0 + z.shape[d + 2])]
    y = F.pad(z, pad)
    if bias is not None:
        y = y + bias.reshape((1, -1) + (1,) * nd)
    return y, out_layout
