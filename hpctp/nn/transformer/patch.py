"""Patch embedding and its inverse on a spatially partitioned field, without communication.

:class:`PatchEmbed2d` / :class:`PatchEmbed3d` map a field ``[N, C, *spatial]`` to a token
field ``[N, embed_dim, *(spatial // p)]``: ``torch.nn.Conv2d(C, embed_dim, kernel_size=p,
stride=p)`` (trailing cells that fill no whole patch are dropped, as torch does). A patch
never straddles two ranks: every cut of the input's layout must lie on a patch boundary
(a multiple of ``p``, or past the last whole patch), so each rank convolves its own
patches and the token field's layout is the input's with its cuts divided by ``p``
(:func:`patched_layout`). Where a cut is not aligned the layer raises a ValueError naming
it; :func:`patch_aligned_layout` gives the nearest aligned layout to redistribute to.

:class:`Unpatch2d` / :class:`Unpatch3d` are the inverse map: a per-token
``torch.nn.Linear(embed_dim, C * prod(p))`` followed by a pixel shuffle (channel
``c * prod(p) + offset``, the patch offset row-major, as ``torch.nn.PixelShuffle``) back into
a field ``[N, C, *(tokens * p)]`` whose cuts are the token field's times ``p``
(:func:`unpatched_layout`): a round trip keeps an aligned layout.

Parameters are replicated (``seed``: equal to the torch layer's init on any grid); after
backward their gradients are this rank's partial sums, to be summed with
:func:`hpctp.nn.sync_gradients`, as for the conv layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..._util.ints import is_int, positive_ints
from ...comm import ProcessGrid, check_grid
from ...layout import Layout, block_cuts
from ..init import SeededReset, init_replicated
from ..spatial._inputs import block_checker, field_input, full_split
from ..spatial._window import Tie

__all__ = [
    "PatchEmbed2d",
    "PatchEmbed3d",
    "Unpatch2d",
    "Unpatch3d",
    "patch_aligned_layout",
    "patched_layout",
    "unpatched_layout",
]


def _patch_sizes(patch_size: object, nd: int) -> tuple[int, ...]:
    """Local. One positive patch size per spatial dim."""
    sizes: tuple[Any, ...] = tuple(patch_size) if isinstance(patch_size, (tuple, list)) else (patch_size,) * nd
    if len(sizes) != nd or not all(is_int(p) and p >= 1 for p in sizes):
        raise ValueError(f"patch_size={patch_size!r} must be a positive int or {nd} of them (one per spatial dim)")
    return tuple(int(p) for p in sizes)


def _field_sizes(layout: Layout, patch_size: object) -> tuple[int, ...]:
    """Local. Patch sizes for the spatial dims of a field layout ``[N, C, *spatial]``."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a hpctp.layout.Layout, got {type(layout).__name__}")
    if layout.ndim < 3:
        raise ValueError(f"{layout} is not a field [N, C, *spatial]: it has {layout.ndim} dims")
    return _patch_sizes(patch_size, layout.ndim - 2)


def misaligned_cuts(layout: Layout, patch_size: object) -> list[tuple[int, tuple[int, ...]]]:
    """Local. ``(spatial dim, cuts)`` of every spatial dim of ``layout`` cut inside a patch.

    A cut ``c`` of a dim of ``n`` cells is aligned when ``c % p == 0`` or
    ``c >= (n // p) * p`` (past the last whole patch).
    """
    sizes = _field_sizes(layout, patch_size)
    out = []
    for d, p in enumerate(sizes):
        cuts, n = layout.dim_cuts[d + 2], layout.global_shape[d + 2]
        end = (n // p) * p
        if any(c % p and c < end for c in cuts):
            out.append((d, cuts))
    return out


def patch_aligned_layout(layout: Layout, patch_size: int | Sequence[int]) -> Layout:
    """Local. ``layout`` with its spatial cuts moved onto patch boundaries.

    Each divided spatial dim is cut into balanced blocks of whole patches (the last block
    also takes the ``n % p`` trailing cells): ``block_cuts(n // p, parts) * p``. Move a
    field there with ``x.redistribute(patch_aligned_layout(x.layout, p))`` before a
    :class:`PatchEmbed2d`.

    Parameters
    ----------
    layout : Layout
        Layout of a field ``[N, C, *spatial]``.
    patch_size : int or sequence of int
        One size for all spatial dims or one per dim.

    Returns
    -------
    Layout
        Same shape, grid and split; batch and channel dims as in ``layout``.

    Raises
    ------
    ValueError, TypeError
        On a layout of fewer than 3 dims or bad patch sizes.
    """
    sizes = _field_sizes(layout, patch_size)
    cuts = list(layout.cuts)
    for d, p in enumerate(sizes):
        n, parts = layout.global_shape[d + 2], layout.parts(d + 2)
        c = [b * p for b in block_cuts(n // p, parts)]
        c[-1] = n
        cuts[d + 2] = tuple(c)
    return Layout(layout.global_shape, layout.grid_dims, layout.split, tuple(cuts))


def patched_layout(layout: Layout, patch_size: int | Sequence[int], channels: int) -> Layout:
    """Local. Layout of the token field a :class:`PatchEmbed2d` makes of a field of ``layout``.

    Parameters
    ----------
    layout : Layout
        Layout of the (patch-aligned) input field ``[N, C, *spatial]``.
    patch_size : int or sequence of int
    channels : int
        Channels of the token field (``embed_dim``).

    Returns
    -------
    Layout
        ``[N, channels, *(spatial // p)]``, same grid and split, cuts ``c // p``.

    Raises
    ------
    ValueError
        If a cut of ``layout`` lies inside a patch (see :func:`patch_aligned_layout`).
    """
    sizes = _field_sizes(layout, patch_size)
    bad = misaligned_cuts(layout, sizes)
    if bad:
        raise ValueError(_misaligned_message("patched_layout", layout, sizes, bad))
    shape = (layout.global_shape[0], int(channels), *(n // p for n, p in zip(layout.global_shape[2:], sizes)))
    cuts = (None, None, *(tuple(c // p for c in layout.dim_cuts[d + 2]) for d, p in enumerate(sizes)))
    return Layout(shape, layout.grid_dims, layout.split, cuts)


def unpatched_layout(layout: Layout, patch_size: int | Sequence[int], channels: int) -> Layout:
    """Local. Layout of the field an :class:`Unpatch2d` makes of a token field of ``layout``.

    Parameters
    ----------
    layout : Layout
        Layout of the token field ``[N, E, *tokens]``.
    patch_size : int or sequence of int
    channels : int
        Channels of the output field.

    Returns
    -------
    Layout
        ``[N, channels, *(tokens * p)]``, same grid and split, cuts ``c * p``.
    """
    sizes = _field_sizes(layout, patch_size)
    shape = (layout.global_shape[0], int(channels), *(n * p for n, p in zip(layout.global_shape[2:], sizes)))
    cuts = (None, None, *(tuple(c * p for c in layout.dim_cuts[d + 2]) for d, p in enumerate(sizes)))
    return Layout(shape, layout.grid_dims, layout.split, cuts)


def _misaligned_message(
    who: str, layout: Layout, sizes: tuple[int, ...], bad: list[tuple[int, tuple[int, ...]]]
) -> str:
    dims = "; ".join(
        f"spatial dim {d} (size {layout.global_shape[d + 2]}, grid axis {layout.split[d + 2]}) is cut at {c}, "
        f"not at multiples of {sizes[d]}"
        for d, c in bad
    )
    fix = patch_aligned_layout(layout, sizes)
    aligned = ", ".join(f"spatial dim {d}: {fix.dim_cuts[d + 2]}" for d, _ in bad)
    return (
        f"{who}: patches of {sizes} would straddle two ranks: {dims}. Move the field onto patch boundaries first, "
        f"x.redistribute(hpctp.nn.transformer.patch.patch_aligned_layout(x.layout, {sizes})) (cuts {aligned}), "
        f"or build its layout with such cuts (hpctp.layout.Layout(..., cuts=...))"
    )


def _adopt(module: torch.nn.Module, ref: Any) -> None:
    """Local. ``ref``'s ``weight`` and ``bias`` (or no bias) as ``module``'s parameters."""
    module.weight = ref.weight
    if ref.bias is not None:
        module.bias = ref.bias
    else:
        module.register_parameter("bias", None)


class _PatchEmbed(SeededReset, torch.nn.Module):
    """Local. The shared code of :class:`PatchEmbed2d` and ``3d``: a conv's ``weight [E, C, *p]``, ``bias [E]``."""

    _nd = 2
    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None

    def _draw_parameters(self) -> None:  # torch's ConvNd draws
        torch.nn.modules.conv._ConvNd.reset_parameters(self)  # type: ignore[arg-type]

    def __init__(
        self,
        in_channels: int,
        embed_dim: int,
        patch_size: int | Sequence[int],
        grid: ProcessGrid,
        *,
        split: Sequence[int | None] | None = None,
        bias: bool = True,
        seed: int | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        grid = check_grid(grid)
        nd = self._nd
        positive_ints(in_channels=in_channels, embed_dim=embed_dim)
        sizes = _patch_sizes(patch_size, nd)
        full = full_split(split, nd, grid.ndim)  # validated before any communication
        super().__init__()
        self.grid, self.split = grid, full[2:]
        self.in_channels, self.embed_dim, self.patch_size = int(in_channels), int(embed_dim), sizes
        self._check_block = block_checker(nd, self.in_channels)
        conv = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)[nd - 1]

        def init() -> None:  # the values of torch's ConvNd(C, E, p, stride=p) built after manual_seed(seed)
            kernel: Any = sizes
            _adopt(self, conv(in_channels, embed_dim, kernel, stride=kernel, bias=bias, device=device, dtype=dtype))

        init_replicated(self, init, grid, seed)

    def output_layout(self, layout: Layout) -> Layout:
        """Local. Layout of the token field for an input field of ``layout`` (:func:`patched_layout`).

        Raises
        ------
        ValueError
            If a cut of ``layout`` lies inside a patch.
        """
        return patched_layout(layout, self.patch_size, self.embed_dim)

    def aligned_layout(self, layout: Layout) -> Layout:
        """Local. ``layout`` with its cuts on this layer's patch boundaries (:func:`patch_aligned_layout`)."""
        return patch_aligned_layout(layout, self.patch_size)

    def forward(self, x: Any, layout: Layout | None = None) -> Any:
        """Collective over grid for a plain block without ``layout`` (one small ``Allgather`` infers
        the layout), else local: no communication. This rank's block of the token field.

        Parameters
        ----------
        x : torch.Tensor or DistTensor
            This rank's block ``[N, in_channels, *spatial]``, or a DistTensor.
        layout : Layout, optional
            Global layout of a plain block.

        Returns
        -------
        torch.Tensor or DistTensor
            ``[N, embed_dim, *(block // p)]``; a DistTensor of :meth:`output_layout`.

        Raises
        ------
        ValueError
            Wrong dims or channels, or a cut inside a patch (naming the cuts and the fix);
            on every rank for a DistTensor or an inferred layout.
        """
        check = self._check_block
        field = field_input(x, self.grid, self.split, self._nd, layout, check=check, collective=layout is None)
        lay = field.global_layout
        bad = misaligned_cuts(lay, self.patch_size)
        if bad:
            raise ValueError(_misaligned_message(type(self).__name__, lay, self.patch_size, bad))
        out_layout = patched_layout(lay, self.patch_size, self.embed_dim)
        blk = field.block
        tokens = tuple(s // p for s, p in zip(blk.shape[2:], self.patch_size))
        params = [p for p in (self.weight, self.bias) if p is not None]
        if math.prod(tokens) == 0 or blk.shape[0] == 0:  # no whole patch here: keep the graph for zero gradients
            return field.wrap(Tie.apply(blk.new_zeros(blk.shape[0], self.embed_dim, *tokens), blk, *params), out_layout)
        trimmed = blk[(slice(None), slice(None), *(slice(0, t * p) for t, p in zip(tokens, self.patch_size)))]
        conv = (F.conv1d, F.conv2d, F.conv3d)[self._nd - 1]
        return field.wrap(conv(trimmed, self.weight, self.bias, stride=self.patch_size), out_layout)

    def extra_repr(self) -> str:
        """Local. Extra text for ``repr``."""
        return (
            f"{self.in_channels}, {self.embed_dim}, patch_size={self.patch_size}, bias={self.bias is not None}, "
            f"grid={self.grid.dims}, split={self.split}"
        )


class _Unpatch(SeededReset, torch.nn.Module):
    """Local. The shared code of :class:`Unpatch2d` and ``3d``: a linear's ``weight [C * prod(p), E]``, ``bias``."""

    _nd = 2
    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None

    def _draw_parameters(self) -> None:  # torch's Linear draws
        torch.nn.Linear.reset_parameters(self)  # type: ignore[arg-type]

    def __init__(
        self,
        embed_dim: int,
        out_channels: int,
        patch_size: int | Sequence[int],
        grid: ProcessGrid,
        *,
        split: Sequence[int | None] | None = None,
        bias: bool = True,
        seed: int | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        grid = check_grid(grid)
        nd = self._nd
        positive_ints(embed_dim=embed_dim, out_channels=out_channels)
        sizes = _patch_sizes(patch_size, nd)
        full = full_split(split, nd, grid.ndim)  # validated before any communication
        super().__init__()
        self.grid, self.split = grid, full[2:]
        self.embed_dim, self.out_channels, self.patch_size = int(embed_dim), int(out_channels), sizes
        self._check_block = block_checker(nd, self.embed_dim)

        def init() -> None:  # the values of torch.nn.Linear(E, C * prod(p)) built after manual_seed(seed)
            _adopt(
                self, torch.nn.Linear(embed_dim, out_channels * math.prod(sizes), bias=bias, device=device, dtype=dtype)
            )

        init_replicated(self, init, grid, seed)

    def output_layout(self, layout: Layout) -> Layout:
        """Local. Layout of the field for a token field of ``layout`` (:func:`unpatched_layout`)."""
        return unpatched_layout(layout, self.patch_size, self.out_channels)

    def forward(self, x: Any, layout: Layout | None = None) -> Any:
        """Local: no communication. This rank's block of the field ``[N, out_channels, *(tokens * p)]``.

        Parameters
        ----------
        x : torch.Tensor or DistTensor
            This rank's block of the token field ``[N, embed_dim, *tokens]``, or a DistTensor.
        layout : Layout, optional
            Global layout of a plain block (only checked against it; the output of a plain
            block is a plain block).

        Returns
        -------
        torch.Tensor or DistTensor
            A DistTensor of :meth:`output_layout` for a DistTensor input.

        Raises
        ------
        ValueError
            Wrong dims or channels (on this rank; on every rank for a DistTensor).
        """
        check = self._check_block
        field = field_input(x, self.grid, self.split, self._nd, layout, check=check, collective=False)
        blk, nd, sizes = field.block, self._nd, self.patch_size
        n, tokens = blk.shape[0], tuple(blk.shape[2:])
        vals = F.linear(blk.movedim(1, -1), self.weight, self.bias)  # [N, *tokens, C * prod(p)]
        vals = vals.reshape(n, *tokens, self.out_channels, *sizes)
        # [N, t0, .., C, p0, ..] -> [N, C, t0, p0, t1, p1, ..] -> [N, C, t0 * p0, ..]
        order = [0, nd + 1] + [i for d in range(nd) for i in (1 + d, nd + 2 + d)]
        y = vals.permute(order).reshape(n, self.out_channels, *(t * p for t, p in zip(tokens, sizes)))
        if field.layout is None:
            return y
        return field.wrap(y, unpatched_layout(field.layout, sizes, self.out_channels))

    def extra_repr(self) -> str:
        """Local. Extra text for ``repr``."""
        return (
            f"{self.embed_dim}, {self.out_channels}, patch_size={self.patch_size}, bias={self.bias is not None}, "
            f"grid={self.grid.dims}, split={self.split}"
        )


_EMBED_DOC = """Collective over grid. Patch embedding of a {nd}-D field cut over ``grid``.

    ``torch.nn.Conv{nd}d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)``,
    each rank convolving its own patches.

    (Construction without ``seed`` broadcasts rank 0's parameters; ``forward`` is local for a
    DistTensor or a given ``layout``.) See :mod:`hpctp.nn.transformer.patch`: the input's cuts must lie on
    patch boundaries (else a ValueError naming them and :func:`patch_aligned_layout`); the
    token field keeps the layout, cuts divided by ``patch_size``.

    Parameters
    ----------
    in_channels, embed_dim : int
    patch_size : int or sequence of int
        One size for all spatial dims or one per dim.
    grid : ProcessGrid
    split : sequence of (int or None), optional
        Grid axis of each spatial dim; default spatial dim ``i`` over grid axis ``i``.
    bias : bool
    seed : int, optional
        Initialise the replicated ``weight [E, C, *p]`` and ``bias [E]`` from this seed (no
        communication; equal to the torch conv built right after ``torch.manual_seed(seed)``).
        Default: rank 0's values are broadcast.
    device, dtype
        Of the parameters.

    Notes
    -----
    Parameter gradients after backward are this rank's partial sums; call
    ``hpctp.nn.sync_gradients(module, grid)`` before stepping.

    Raises
    ------
    ValueError
        On non-positive sizes or a bad split.
    """

_UNPATCH_DOC = """Collective over grid. The inverse of :class:`PatchEmbed{nd}d`: tokens back to a {nd}-D field.

    (Construction without ``seed`` broadcasts rank 0's parameters; ``forward`` is local: no
    communication.)

    A per-token ``torch.nn.Linear(embed_dim, out_channels * prod(patch_size))``, its outputs
    laid into the token's patch as ``torch.nn.PixelShuffle`` does (channel
    ``c * prod(p) + offset``, the offset row-major in the patch). The output field's cuts are
    the token field's times ``patch_size`` (:func:`unpatched_layout`), so
    ``Unpatch(PatchEmbed(x))`` has ``x``'s layout when the field sizes are multiples of
    ``patch_size``.

    Parameters
    ----------
    embed_dim, out_channels : int
    patch_size : int or sequence of int
    grid : ProcessGrid
    split : sequence of (int or None), optional
        Grid axis of each spatial dim; default spatial dim ``i`` over grid axis ``i``.
    bias : bool
    seed : int, optional
        Initialise the replicated ``weight [C * prod(p), E]`` and ``bias`` from this seed (no
        communication; equal to ``torch.nn.Linear`` built right after ``torch.manual_seed(seed)``).
        Default: rank 0's values are broadcast.
    device, dtype
        Of the parameters.

    Notes
    -----
    Parameter gradients after backward are this rank's partial sums; call
    ``hpctp.nn.sync_gradients(module, grid)`` before stepping.

    Raises
    ------
    ValueError
        On non-positive sizes or a bad split.
    """


class PatchEmbed2d(_PatchEmbed):
    __doc__ = _EMBED_DOC.format(nd=2)
    _nd = 2


class PatchEmbed3d(_PatchEmbed):
    __doc__ = _EMBED_DOC.format(nd=3)
    _nd = 3


class Unpatch2d(_Unpatch):
    __doc__ = _UNPATCH_DOC.format(nd=2)
    _nd = 2


class Unpatch3d(_Unpatch):
    __doc__ = _UNPATCH_DOC.format(nd=3)
    _nd = 3
