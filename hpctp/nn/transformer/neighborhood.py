"""Windowed (neighbourhood) multi-head attention on a spatially partitioned field.

:class:`NeighborhoodAttention2d` / :class:`NeighborhoodAttention3d` take a field
``[batch, embed, *spatial]``: channels-first, like hpctp.nn's conv, pooling and norm layers,
so they compose with them. Every cell is a token; a token attends to the tokens of the
``kernel_size`` window centred on it (odd sizes: ``kernel_size // 2`` cells on each side).

Semantics, equal to ``torch.nn.MultiheadAttention(embed, heads, batch_first=True)`` on the
gathered field's tokens ``[batch, H * W, embed]`` with a boolean ``attn_mask`` that allows
exactly those window pairs:

* q, k, v and the output projection are per-token linears (1x1 convolutions) with
  torch's parameters ``in_proj_weight [3E, E]``, ``in_proj_bias [3E]``, ``out_proj``
  (a ``torch.nn.Linear(E, E)``); scores are scaled by ``1 / sqrt(head_dim)``.
* ``periodic`` False along a dim (the "zero" boundary): window positions outside the field
  are *masked out of the softmax* (not zeros attended to), so a token at the edge attends
  to fewer tokens. True: the window wraps around (a torus), which needs
  ``kernel_size <= size`` along that dim (no token twice in one window).

Distribution: each rank computes the outputs of its own block. The input's halo of
``kernel_size // 2`` cells per side comes from the halo fetch of the conv layers
(:mod:`hpctp.halo`: neighbours' cells inside the field, wrapped cells for a periodic dim,
zeros outside; from any rank when a block is narrower than the halo); backward runs the
adjoint exchange. The halo carries the input (``E`` values per cell) rather than K and V
(``2E``): the halo cells' keys and values are projected locally (``2E^2`` flops per halo
cell), which halves the message volume. Parameters are replicated (``seed``: equal to
torch's init on any grid) and their gradients are this rank's partial sums: call
:func:`hpctp.nn.sync_gradients` before the optimiser step, as for the conv layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..._util.ints import is_int, positive_ints
from ...comm import ProcessGrid, check_grid
from ...halo.plan import fetch_plan
from ...layout import Layout
from ..init import SeededReset, init_replicated
from ..spatial._fetch import Fetch
from ..spatial._inputs import FieldInput, block_checker, field_input, full_split
from ..spatial._window import Tie

__all__ = ["NeighborhoodAttention2d", "NeighborhoodAttention3d", "neighborhood_mask"]


def _per_dim(value: object, nd: int, name: str) -> tuple[Any, ...]:
    """Local. ``value`` repeated ``nd`` times, or the sequence itself (checked to have ``nd`` entries)."""
    if isinstance(value, (tuple, list)):
        if len(value) != nd:
            raise ValueError(f"{name}={value!r} must have one entry per spatial dim ({nd})")
        return tuple(value)
    return (value,) * nd


def _kernel_sizes(kernel_size: object, nd: int) -> tuple[int, ...]:
    """Local. Odd positive window sizes, one per spatial dim."""
    ks = _per_dim(kernel_size, nd, "kernel_size")
    for k in ks:
        if not is_int(k) or k < 1 or k % 2 == 0:
            raise ValueError(f"kernel_size={kernel_size!r}: every size must be an odd int >= 1 (centred window)")
    return tuple(int(k) for k in ks)


def _periodic_flags(periodic: object, nd: int) -> tuple[bool, ...]:
    """Local. One bool per spatial dim."""
    flags = _per_dim(periodic, nd, "periodic")
    for p in flags:
        if not isinstance(p, bool):
            raise TypeError(f"periodic={periodic!r} must be a bool or one bool per spatial dim")
    return tuple(flags)


def neighborhood_mask(
    ranges: Sequence[tuple[int, int]], sizes: Sequence[int], kernel_size: Sequence[int], periodic: Sequence[bool],
    device: Any = None,
) -> torch.Tensor:  # fmt: skip
    """Local. Which window positions of the tokens of a block lie inside the field.

    Parameters
    ----------
    ranges : sequence of (int, int)
        Global ``(start, stop)`` of the block per spatial dim.
    sizes : sequence of int
        Global field size per spatial dim.
    kernel_size : sequence of int
        Odd window size per spatial dim.
    periodic : sequence of bool
        Per spatial dim: every position is inside (wrap-around).
    device : torch.device, optional

    Returns
    -------
    torch.Tensor
        Bool ``[*block, prod(kernel_size)]``: entry ``[i..., w]`` is True when window
        position ``w`` (row-major over the window dims) of token ``i`` is a cell of the field.
    """
    nd = len(ranges)
    block = tuple(hi - lo for lo, hi in ranges)
    valid = torch.ones((1,) * (2 * nd), dtype=torch.bool, device=device)
    for d, ((lo, hi), n, k, per) in enumerate(zip(ranges, sizes, kernel_size, periodic, strict=True)):
        if per:
            continue
        r = k // 2
        pos = torch.arange(lo, hi, device=device).unsqueeze(1) + torch.arange(-r, r + 1, device=device)
        shape = [1] * (2 * nd)
        shape[d], shape[nd + d] = hi - lo, k
        valid = valid & ((pos >= 0) & (pos < n)).reshape(shape)
    return valid.expand(*block, *kernel_size).reshape(*block, math.prod(kernel_size))


def _windows(t: torch.Tensor, nd: int, kernel_size: Sequence[int]) -> torch.Tensor:
    """Local. ``t [B, *(block + k - 1), h, c]`` -> the window of every token, ``[B, *block, h, c, prod(k)]``."""
    for d, k in enumerate(kernel_size):
        t = t.unfold(1 + d, k, 1)  # appends the window dim: [..., h, c, k0, k1, ...]
    return t.flatten(-nd)


class _NeighborhoodAttention(SeededReset, torch.nn.Module):
    """Local. The shared code of :class:`NeighborhoodAttention2d` and ``3d``."""

    _nd = 2
    in_proj_weight: torch.nn.Parameter
    in_proj_bias: torch.nn.Parameter | None
    out_proj: torch.nn.Linear
    hpctp_resets_children = True  # reset_parameters() also draws out_proj's parameters (in construction's order)

    def _draw_parameters(self) -> None:  # torch.nn.MultiheadAttention's order: out_proj, then the in-projection
        self.out_proj.reset_parameters()
        torch.nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            torch.nn.init.zeros_(self.in_proj_bias)
            torch.nn.init.zeros_(self.out_proj.bias)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kernel_size: int | Sequence[int],
        grid: ProcessGrid,
        *,
        split: Sequence[int | None] | None = None,
        periodic: bool | Sequence[bool] = False,
        bias: bool = True,
        seed: int | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        grid = check_grid(grid)
        nd = self._nd
        positive_ints(embed_dim=embed_dim, num_heads=num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        kernel = _kernel_sizes(kernel_size, nd)
        flags = _periodic_flags(periodic, nd)
        full = full_split(split, nd, grid.ndim)  # validated before any communication
        super().__init__()
        self.grid = grid
        self.split = full[2:]
        self.embed_dim, self.num_heads = int(embed_dim), int(num_heads)
        self.head_dim = self.embed_dim // self.num_heads
        self.kernel_size = kernel
        self.periodic = flags
        self._check_block = block_checker(nd, self.embed_dim, "channels (embed_dim)")

        def init() -> None:  # torch.nn.MultiheadAttention's order: out_proj first, then the in-projection
            kw = {"device": device, "dtype": dtype}
            self.in_proj_weight = torch.nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **kw))
            if bias:
                self.in_proj_bias = torch.nn.Parameter(torch.empty(3 * embed_dim, **kw))
            else:
                self.register_parameter("in_proj_bias", None)
            self.out_proj = torch.nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
            torch.nn.init.xavier_uniform_(self.in_proj_weight)
            if self.in_proj_bias is not None:
                torch.nn.init.zeros_(self.in_proj_bias)
                torch.nn.init.zeros_(self.out_proj.bias)

        init_replicated(self, init, grid, seed)

    # ------------------------------------------------------------------ checks
    def _check_field(self, layout: Layout) -> None:
        """Local (the layout is global: the same verdict on every rank). A periodic window must fit the field."""
        for d, (n, k, per) in enumerate(zip(layout.global_shape[2:], self.kernel_size, self.periodic)):
            if per and k > n:
                raise ValueError(
                    f"kernel_size {k} exceeds the size {n} of periodic spatial dim {d}: the wrapped window would "
                    f"hold a token twice; use kernel_size <= {n} or periodic=False there"
                )

    # ------------------------------------------------------------------ forward
    def forward(self, x: Any, layout: Layout | None = None) -> Any:
        """Collective over grid. This rank's block of the attention output (the input's layout).

        Parameters
        ----------
        x : torch.Tensor or DistTensor
            This rank's block ``[N, embed_dim, *spatial]`` (uneven blocks allowed), or a
            DistTensor with a torch block.
        layout : Layout, optional
            Global layout of a plain block (inferred with one small collective when omitted).

        Returns
        -------
        torch.Tensor or DistTensor
            ``[N, embed_dim, *spatial]``, the same kind and layout as ``x``.

        Raises
        ------
        ValueError
            On every rank, before the halo exchange: wrong dims or channels, a split unlike
            the layer's, a periodic dim smaller than the window.
        TypeError
            If ``x`` is neither a torch block nor a DistTensor with one.
        """
        field = field_input(x, self.grid, self.split, self._nd, layout, check=self._check_block)
        self._check_field(field.global_layout)
        return field.wrap(self._attend(field))

    def _attend(self, field: FieldInput) -> torch.Tensor:
        nd, grid, lay = self._nd, self.grid, field.global_layout
        x = field.block
        radius = [k // 2 for k in self.kernel_size]
        wants: list[tuple[tuple[int, int], ...]] = [((0, lay.global_shape[0]),), ((0, lay.global_shape[1]),)]
        for d, r in enumerate(radius):
            cuts = lay.dim_cuts[d + 2]
            wants.append(tuple((a - r, b + r) for a, b in zip(cuts[:-1], cuts[1:])))
        boundary = ("zero", "zero", *("periodic" if p else "zero" for p in self.periodic))
        plan = fetch_plan(lay, grid.rank, tuple(wants), boundary)
        xp = Fetch.apply(x, plan, grid.comm, 0.0)  # [B, E, *(block + 2r)]; backward: the adjoint exchange
        params = [
            p
            for p in (self.in_proj_weight, self.in_proj_bias, self.out_proj.weight, self.out_proj.bias)
            if p is not None
        ]
        if x.numel() == 0:  # an empty block (or batch): nothing to attend, the adjoint still runs
            return Tie.apply(x.new_zeros(x.shape), xp, *params)
        e, h, c = self.embed_dim, self.num_heads, self.head_dim
        w, b = self.in_proj_weight, self.in_proj_bias
        q = F.linear(x.movedim(1, -1), w[:e], None if b is None else b[:e])  # [B, *block, E]
        kv = F.linear(xp.movedim(1, -1), w[e:], None if b is None else b[e:])  # [B, *(block + 2r), 2E]
        k, v = kv.split(e, dim=-1)
        q = q.unflatten(-1, (h, c)) * (1.0 / math.sqrt(c))
        kw = _windows(k.unflatten(-1, (h, c)), nd, self.kernel_size)  # [B, *block, h, c, K]
        vw = _windows(v.unflatten(-1, (h, c)), nd, self.kernel_size)
        scores = torch.einsum("...c,...ck->...k", q, kw)  # [B, *block, h, K]
        ranges, sizes = lay.local_ranges(grid.coords)[2:], lay.global_shape[2:]
        inside = (
            per or (lo - r >= 0 and hi + r <= n) for (lo, hi), n, r, per in zip(ranges, sizes, radius, self.periodic)
        )
        if not all(inside):  # some window reaches past the field's edge: mask those positions out
            valid = neighborhood_mask(ranges, sizes, self.kernel_size, self.periodic, x.device)
            scores = scores.masked_fill(~valid.unsqueeze(-2), float("-inf"))  # (the centre is always valid)
        attn = torch.softmax(scores, dim=-1)
        out = torch.einsum("...k,...ck->...c", attn, vw).flatten(-2)  # [B, *block, E]
        return self.out_proj(out).movedim(-1, 1)

    def extra_repr(self) -> str:
        """Local. Extra text for ``repr``."""
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kernel_size={self.kernel_size}, "
            f"periodic={self.periodic}, grid={self.grid.dims}, split={self.split}"
        )


_DOC = """Collective over grid. Neighbourhood multi-head attention on a {nd}-D field cut over ``grid``.

    Every cell of the field ``[N, embed_dim, {dims}]`` (channels first) is a token that
    attends to the ``kernel_size`` window centred on it; see :mod:`hpctp.nn.transformer.neighborhood`
    for the exact semantics (equal to ``torch.nn.MultiheadAttention(embed_dim, num_heads,
    batch_first=True)`` on the gathered tokens with the window as ``attn_mask``), the halo
    exchange and the gradient convention.

    Parameters
    ----------
    embed_dim : int
        Channels of the field (the token width).
    num_heads : int
        Must divide ``embed_dim``.
    kernel_size : int or sequence of int
        Odd window size, one for all spatial dims or one per dim.
    grid : ProcessGrid
    split : sequence of (int or None), optional
        Grid axis of each spatial dim (or of each block dim); default spatial dim ``i`` over
        grid axis ``i``, like the conv layers.
    periodic : bool or sequence of bool
        Per spatial dim: wrap the window around the field (needs ``kernel_size <= size``);
        False: positions outside the field are masked out of the softmax.
    bias : bool
        Biases of the in- and out-projections (as torch's).
    seed : int, optional
        Initialise the replicated parameters from this seed (no communication; equal to
        ``torch.nn.MultiheadAttention`` built right after ``torch.manual_seed(seed)``, on any
        grid). Default: rank 0's values are broadcast.
    device, dtype
        Of the parameters.

    Notes
    -----
    Parameters (replicated): ``in_proj_weight [3E, E]``, ``in_proj_bias [3E]``,
    ``out_proj.weight [E, E]``, ``out_proj.bias [E]``. After backward their gradients are
    this rank's partial sums; call ``hpctp.nn.sync_gradients(module, grid)`` before stepping.
    Communication per forward: one halo fetch of ``kernel_size // 2`` cells per side of the
    input (``E`` values per cell); backward: its adjoint.

    Raises
    ------
    ValueError
        On every rank: non-positive sizes, ``num_heads`` not dividing ``embed_dim``, an even
        ``kernel_size``, a bad split.
    TypeError
        If ``grid`` is not a ProcessGrid or ``periodic`` holds non-bools.
    """


class NeighborhoodAttention2d(_NeighborhoodAttention):
    __doc__ = _DOC.format(nd=2, dims="H, W")
    _nd = 2


class NeighborhoodAttention3d(_NeighborhoodAttention):
    __doc__ = _DOC.format(nd=3, dims="D, H, W")
    _nd = 3
