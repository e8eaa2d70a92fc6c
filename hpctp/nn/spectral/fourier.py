"""Fourier layers (FNO) on spatially partitioned fields: truncated spectra without transposes.

A Fourier neural operator layer transforms the field, multiplies its lowest modes by
learned complex weights (mixing channels) and transforms back; every other mode is
dropped. Only ``2m`` frequencies per axis survive (``m`` on the last, real axis), so the
distributed layer never moves the field: each rank applies the truncated DFT to its own
block (one small matmul per axis, see :mod:`hpctp.nn.spectral._dft`), the shares of the kept
spectrum are summed by a reduce-scatter over the grid axes that split the field into each
rank's run of the modes, every rank multiplies its run by the weights (the mix divided among
the ranks, :mod:`hpctp.nn.spectral._modes`), an all-gather gives every rank the whole output
spectrum, and each rank evaluates the inverse transform on its own output block. Backward is
the adjoint, and the weight gradient's runs are all-gathered, so the weight's gradient is
complete on every rank (no gradient synchronisation of its own). The cost per axis is
``O(n m)`` instead of an FFT's ``O(n log n)``, with messages of the truncated spectrum's
size instead of pencil transposes of the whole field: the right trade for the ``m`` of 8
to 32 that FNOs use.

The result equals :func:`spectral_conv_fft` (``torch.fft.rfftn`` -> keep the corner modes ->
weights -> ``torch.fft.irfftn``, the layer of Li et al., 2021) on the gathered field.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ...comm import ProcessGrid, check_grid
from ...layout import Layout
from .._amp import autocast_dtype, autocast_off
from ..spatial._inputs import field_input
from ._dft import check_modes, forward_matrix, inverse_matrix, kept_modes
from ._modes import gather_modes, mode_cuts, scatter_modes, weight_modes

__all__ = ["spectral_conv", "spectral_conv_fft", "split_path_on_whole_fields"]

_SPLIT_PATH = contextvars.ContextVar("hpctp_spectral_split_path", default=False)


@contextlib.contextmanager
def split_path_on_whole_fields() -> Iterator[None]:
    """Local. Within it, :func:`spectral_conv` on a field whole on its rank takes a split field's path (truncated
    DFT matrices, the mix of every kept mode, no message) instead of torch's FFTs: the computation and memory that
    :func:`hpctp.perf.trace` records, on one rank, for the plans that split the field. The DFT matrices built within
    are dropped from their cache on leaving (under a trace they are fake tensors, which a real layer must not get)."""
    token = _SPLIT_PATH.set(True)
    try:
        yield
    finally:
        _SPLIT_PATH.reset(token)
        forward_matrix.cache_clear()
        inverse_matrix.cache_clear()


def _as_complex(weight: torch.Tensor) -> torch.Tensor:
    """A real weight ``[..., 2]`` as complex: a view, or a view of a copy where its storage offset is odd (a
    parameter packed into a flat buffer at any element, e.g. by :class:`hpctp.nn.ShardedDataParallel` at stages
    1-2), which ``torch.view_as_complex`` cannot view."""
    return torch.view_as_complex(weight if weight.storage_offset() % 2 == 0 else weight.clone())


def _modes_of(weight: torch.Tensor) -> tuple[int, ...]:
    """Modes per spatial axis from a weight ``[C_in, C_out, 2 m_1, ..., 2 m_{d-1}, m_d, 2]``."""
    ks = [int(k) for k in weight.shape[2:-1]]
    if any(k % 2 for k in ks[:-1]):
        raise ValueError(
            f"weight shape {tuple(weight.shape)}: every spectral dim but the last holds 2m modes "
            f"(m non-negative and m negative frequencies), so it must be even"
        )
    return tuple(k // 2 for k in ks[:-1]) + tuple(ks[-1:])


def _check_weight(weight: object) -> int:
    """Spatial dims of a valid spectral weight (raises ValueError/TypeError otherwise)."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype not in (torch.float32, torch.float64):
        raise TypeError(
            f"weight dtype must be float32 or float64 (complex values as a trailing dim of 2), got {weight.dtype}"
        )
    if weight.ndim < 4 or weight.shape[-1] != 2:
        raise ValueError(
            f"weight must have shape [C_in, C_out, *modes, 2] (real and imaginary parts last), got {tuple(weight.shape)}"
        )
    if any(int(k) < 1 for k in weight.shape[:-1]):
        raise ValueError(f"weight shape {tuple(weight.shape)} has an empty dim")
    return weight.ndim - 3


def _check_input(shape: Sequence[int], dtype: torch.dtype, weight: torch.Tensor, modes: Sequence[int]) -> None:
    """Global checks (every rank agrees): channels, dtype and that the modes fit the field."""
    if int(shape[1]) != int(weight.shape[0]):
        raise ValueError(f"input has {shape[1]} channels, the weight expects {weight.shape[0]}")
    if dtype != weight.dtype:
        raise ValueError(f"input dtype {dtype} differs from the weight dtype {weight.dtype}")
    nd = len(modes)
    for i, (n, m) in enumerate(zip(shape[2:], modes)):
        check_modes(int(n), m, i == nd - 1, f"spatial dim {i}")


def spectral_conv_fft(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Local. The Fourier layer on a whole field with ``torch.fft``: the single-process definition.

    ``irfftn(W * rfftn(x)[kept])``, the kept modes being the ``m`` lowest non-negative and
    ``m`` highest (negative) frequencies of each axis but the last, and ``m`` of the last.

    Parameters
    ----------
    x : torch.Tensor
        ``[N, C_in, *spatial]``, float32 or float64.
    weight : torch.Tensor
        ``[C_in, C_out, 2 m_1, ..., 2 m_{d-1}, m_d, 2]``, real and imaginary parts last.

    Returns
    -------
    torch.Tensor
        ``[N, C_out, *spatial]``, differentiable.

    Raises
    ------
    TypeError
        If ``x`` or ``weight`` is not a tensor, or the weight is not float32/float64.
    ValueError
        On a malformed weight, mismatched dims, channels or dtype, or modes that do not fit.
    """
    nd = _check_weight(weight)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != nd + 2:
        raise ValueError(f"x has {x.ndim} dims; this weight needs [N, C, *{nd} spatial] ({nd + 2} dims)")
    modes = _modes_of(weight)
    _check_input(x.shape, x.dtype, weight, modes)
    dims = tuple(range(2, nd + 2))
    spatial = tuple(int(n) for n in x.shape[2:])
    spec = torch.fft.rfftn(x, dim=dims)
    idx = [torch.from_numpy(kept_modes(n, m, i == nd - 1)).to(x.device) for i, (n, m) in enumerate(zip(spatial, modes))]
    for d, ix in zip(dims, idx):
        spec = spec.index_select(d, ix)
    out = _mix_modes(spec, _as_complex(weight))
    for d, ix, n in zip(dims, idx, spatial[:-1] + (spatial[-1] // 2 + 1,)):
        shape = list(out.shape)
        shape[d] = n
        out = out.new_zeros(shape).index_copy(d, ix, out)
    return torch.fft.irfftn(out, s=spatial, dim=dims)


def _spectral_conv_truncated(x: torch.Tensor, weight: torch.Tensor, modes: tuple[int, ...]) -> torch.Tensor:
    """:func:`spectral_conv_fft` on validated arguments with 1-D FFTs that transform only what the kept modes
    need: the half (last) axis first, keeping its ``m`` lowest modes, then each other axis on those columns only
    (keeping ``2m``); back the same way, zero-padded. Half or less of the full ``rfftn``/``irfftn`` work, and no
    gather or scatter of the kept modes."""
    nd = len(modes)
    last = x.ndim - 1
    spatial = tuple(int(n) for n in x.shape[2:])
    y = torch.fft.rfft(x, dim=last).narrow(last, 0, modes[-1])
    for i in range(nd - 1):
        d, m, n = 2 + i, modes[i], spatial[i]
        y = torch.fft.fft(y, dim=d)
        y = torch.cat([y.narrow(d, 0, m), y.narrow(d, n - m, m)], dim=d)
    y = _mix_modes(y, _as_complex(weight))
    for i in range(nd - 1):
        d, m, n = 2 + i, modes[i], spatial[i]
        gap = list(y.shape)
        gap[d] = n - 2 * m
        y = torch.fft.ifft(torch.cat([y.narrow(d, 0, m), y.new_zeros(gap), y.narrow(d, m, m)], dim=d), dim=d)
    return torch.fft.irfft(y, n=spatial[-1], dim=last)


_BROADCAST_MIX_MAX = 1 << 20  # most elements of the [batch, C_in, C_out, *modes] product _mix_modes forms


def _mix_modes(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Local. ``einsum("bi...,io...->bo...", h, w)``: per kept mode, the ``[batch, C_in]`` spectrum times the
    ``[C_in, C_out]`` complex weight.

    Up to :data:`_BROADCAST_MIX_MAX` elements as one broadcast multiply and a sum over ``C_in``: torch
    runs the einsum as a batched complex matmul of tiny matrices, 3-10x slower on the CPU at the usual
    FNO sizes (width 16-32, 12 modes). Larger mixes take the einsum, which holds no such product.

    Parameters
    ----------
    h : torch.Tensor
        ``[batch, C_in, *modes]``, complex.
    w : torch.Tensor
        ``[C_in, C_out, *modes]``, complex.

    Returns
    -------
    torch.Tensor
        ``[batch, C_out, *modes]``.
    """
    if h.shape[0] * w.numel() <= _BROADCAST_MIX_MAX:
        return (h.unsqueeze(2) * w.unsqueeze(0)).sum(1)
    return torch.einsum("bi...,io...->bo...", h, w)


def _along(h: torch.Tensor, d: int, mat: torch.Tensor) -> torch.Tensor:
    """``mat`` applied along dim ``d`` of ``h`` (``h``'s dim ``d`` contracted with ``mat``'s rows)."""
    return torch.movedim(torch.movedim(h, d, -1) @ mat, -1, d)


def _along_real(x: torch.Tensor, d: int, mat: torch.Tensor) -> torch.Tensor:
    """:func:`_along` for a real ``x``, without a complex copy of it: one real product by the matrix's real and
    imaginary parts side by side (``[n, 2m]``, interleaved as :func:`torch.view_as_real` lays out complex values)."""
    xt = torch.movedim(x, d, -1)
    both = torch.view_as_real(mat).reshape(mat.shape[0], 2 * mat.shape[1])
    return torch.movedim(torch.view_as_complex((xt @ both).unflatten(-1, (mat.shape[1], 2))), -1, d)


def _real_part_along(h: torch.Tensor, d: int, mat: torch.Tensor) -> torch.Tensor:
    """The real part of :func:`_along`, computed directly (no complex result of the full size): ``h``'s real and
    imaginary parts, interleaved, times the rows ``Re M`` and ``-Im M`` interleaved, in one real product (the
    parts as strided views would make torch copy every batch's matrix apart)."""
    pairs = torch.view_as_real(torch.movedim(h, d, -1).contiguous()).flatten(-2)
    rows = torch.stack((mat.real, -mat.imag), dim=1).reshape(2 * mat.shape[0], mat.shape[1])
    return torch.movedim(pairs @ rows, -1, d).contiguous()


def spectral_conv(
    x: Any,
    weight: torch.Tensor,
    *,
    grid: ProcessGrid,
    split: object = None,
    layout: Layout | None = None,
) -> Any:
    """Collective over grid. The Fourier layer on a spatially partitioned field (FNO spectral conv).

    Equals :func:`spectral_conv_fft` on the gathered field. Each rank transforms its own
    block with truncated DFT matrices, a reduce-scatter sums the kept spectrum over the grid
    axes that split the field into each rank's run of the modes, each rank mixes its run, an
    all-gather joins the runs, and each rank transforms back onto its own block: the
    output has the input's layout (with ``C_out`` channels). The backward pass runs the
    adjoints and all-gathers the weight gradient's runs, so the weight's gradient is *complete*
    on every rank after backward (not a partial sum): leave it out of
    :func:`hpctp.nn.sync_gradients` along those grid axes (:class:`hpctp.nn.SpectralConv2d` marks its
    weight with ``hpctp_grad_reduced`` so that one ``sync_gradients`` call stays right).

    Parameters
    ----------
    x : torch.Tensor or DistTensor
        This rank's ``[N, C_in, *spatial]`` block (float32/float64, possibly uneven), or a
        DistTensor with a torch block. Batch and channel dims are not split.
    weight : torch.Tensor
        ``[C_in, C_out, 2 m_1, ..., 2 m_{d-1}, m_d, 2]``, identical on every rank; ``d``
        (1, 2 or 3 in practice) is the number of spatial dims.
    grid : ProcessGrid
    split : sequence, optional
        Grid axis per spatial dim (or per dim); default: spatial dim ``i`` over grid axis ``i``.
    layout : Layout, optional
        Global layout of a plain block; inferred with one small collective when omitted.

    Returns
    -------
    torch.Tensor or DistTensor
        This rank's ``[N, C_out, *spatial]`` block, of the same kind as ``x``.

    Raises
    ------
    TypeError
        On a weight that is not a float tensor, or an input that is not a torch block.
    ValueError
        On every rank: mismatched channels or dtype, a weight of the wrong shape, more
        modes than an axis holds (``2m <= n``; ``m <= n // 2 + 1`` on the last), or blocks
        that do not tile.
    """
    check_grid(grid)
    nd = _check_weight(weight)
    modes = _modes_of(weight)
    field = field_input(x, grid, split, nd, layout)
    local, lay = field.block, field.global_layout
    if autocast_dtype(local) is not None and local.dtype in (torch.float16, torch.bfloat16):
        local = local.to(weight.dtype)  # autocast: the transforms in float32, as torch's FFTs
    _check_input(lay.global_shape, local.dtype, weight, modes)
    with autocast_off(local):
        out = _spectral_conv_block(local, weight, lay, grid, modes)
    return field.wrap(out, lay.with_size(1, int(weight.shape[1])))


def _mix_own_modes(h: torch.Tensor, weight: torch.Tensor, comm: Any) -> torch.Tensor:
    """Collective over ``comm``. :func:`_mix_modes` of the sum over ``comm``'s ranks of their spectra ``h``, each rank
    mixing only its run of the kept modes (:mod:`hpctp.nn.spectral._modes`); the whole output spectrum on every
    rank."""
    kept = tuple(h.shape[2:])
    total = math.prod(kept)
    cuts = mode_cuts(total, comm.Get_size())
    flat = h.reshape(*h.shape[:2], total)
    mine = scatter_modes(flat, comm, cuts, 2)
    w = weight_modes(weight.reshape(*weight.shape[:2], total, 2), comm, cuts, 2)
    y = _mix_modes(mine, _as_complex(w))
    return gather_modes(y, comm, cuts, 2).reshape(*y.shape[:2], *kept)


def _spectral_conv_block(
    local: torch.Tensor, weight: torch.Tensor, lay: Layout, grid: ProcessGrid, modes: tuple[int, ...]
) -> torch.Tensor:
    """This rank's output block of :func:`spectral_conv` (validated arguments)."""
    nd = len(modes)
    spatial = lay.global_shape[2:]
    ranges = lay.local_ranges(grid.coords)[2:]
    axes = sorted({g for g in lay.split[2:] if g is not None and grid.dims[g] > 1})
    if not axes and local.numel() and not _SPLIT_PATH.get():  # the whole field on this rank: torch's FFTs of the
        # kept modes (no DFT matrices; not for an empty block, e.g. a data group's empty share: MKL rejects empty FFTs)
        return _spectral_conv_truncated(local, weight, modes)
    real, dev = local.dtype, local.device
    last = nd - 1

    h = _along_real(local, 1 + nd, forward_matrix(spatial[last], *ranges[last], modes[last], True, real, dev))
    for i in range(last - 1, -1, -1):  # the last (half) axis first, on the real block: it shrinks it most
        h = _along(h, 2 + i, forward_matrix(spatial[i], *ranges[i], modes[i], False, real, dev))
    if axes:  # each rank mixes its own run of the kept modes, summed over the blocks (_modes)
        y = _mix_own_modes(h, weight, grid.axes_comm(axes))
    else:
        y = _mix_modes(h, _as_complex(weight))
    for i in range(last):
        y = _along(y, 2 + i, inverse_matrix(spatial[i], *ranges[i], modes[i], False, real, dev))
    return _real_part_along(y, 1 + nd, inverse_matrix(spatial[last], *ranges[last], modes[last], True, real, dev))
