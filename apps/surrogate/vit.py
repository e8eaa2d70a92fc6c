"""A vision-transformer surrogate on the spatially partitioned field (``model = "vit"``).

The state ``[B, C, H, W]`` (a DistTensor split ``(None, None, 0, 1)``) is cut into ``patch x patch``
patches (:class:`hpctp.nn.PatchEmbed2d`, local), each a token of ``embed`` channels plus a fixed
sin/cos embedding of its global token coordinates (periodic in the domain, so it does not depend on
the rank count). ``depth`` pre-norm blocks follow, per token ``t``::

    t = t + attn(LayerNorm(t))            # multi-head, q/k/v/out projections per token
    t = t + mlp(LayerNorm(t))             # Linear(E, r E) -> GELU -> Linear(r E, E)

where ``attn`` is exact attention over *all* tokens of the field
(:func:`hpctp.nn.functional.attention`, ``attention = "global"``: the token dims stay split as the
field, K/V blocks travel a ring or move all-to-all) or over the ``kernel_size`` window of each token
on the torus (:class:`hpctp.nn.NeighborhoodAttention2d`, ``attention = "neighborhood"``: one halo
exchange). A last LayerNorm and :class:`hpctp.nn.Unpatch2d` (zero-initialised, so the untrained model
is persistence, as the other surrogates) give ``f(x)``; the prediction is ``x + s * f(x)``.

The token layout is the field's with its cuts divided by ``patch``. Where a cut of the field is not on
a patch boundary (e.g. 64 rows over 3 ranks), the input moves once onto
:func:`hpctp.nn.patch_aligned_layout` and the output moves back (both differentiable). LayerNorm, the
projections and the MLP are per token, hence local: their replicated parameters get partial gradients
that :func:`hpctp.nn.sync_gradients` sums, as for the conv layers.

With ``grid=None`` the same parameters (same seeds) run with plain torch ops (a strided conv,
``scaled_dot_product_attention`` over the flattened tokens, with the periodic window as a boolean
mask for the neighbourhood kind): the one-process reference.

With a ``tensor_axis`` (the model grid's third axis, ``train.tensor > 1``), the heads and the MLP's
hidden units are split over it (Megatron's column-then-row pattern): each rank holds the q/k/v rows of
its whole heads and the matching columns of the output projection (``hpctp_layout`` on each, so
checkpoints and :func:`hpctp.nn.global_state_dict` see the global tensors), the ring runs over the
spatial axes for those heads only, and one all-reduce over the tensor axis ends the attention and one
the MLP (forward; their adjoints in backward). The token field is replicated along the tensor axis.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F

import hpctp
from hpctp.layout import block_cuts, block_range
from hpctp.nn import NeighborhoodAttention2d, PatchEmbed2d, Unpatch2d, patch_aligned_layout
from hpctp.nn.functional import attention, linear
from hpctp.nn.init import seeded
from hpctp.ops.autograd import allreduce_sum, sum_gradients
from hpctp.ops.move import move_block

from .blocks import ResidualScale, zero_

__all__ = ["ViT", "periodic_window_mask", "sincos_position"]

ATTENTION_KINDS = ("global", "neighborhood")
SCHEDULES = ("ring", "all_to_all", "auto")


def _seeded(seed: int, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Local. ``make()`` with torch's RNG forked and seeded (the same values on every rank and grid)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def sincos_position(
    embed: int,
    sizes: tuple[int, int],
    ranges: tuple[tuple[int, int], tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Local. The fixed positional embedding of the tokens ``ranges`` of an ``sizes`` token grid.

    Channel groups of ``m = embed // 4``: ``sin(2 pi k i / n_0)``, ``cos(...)`` of the row ``i``, then
    the same of the column ``j``, with integer wavenumbers ``k = 1 + (c mod max(n // 2, 1))``, so the
    embedding is periodic on the torus; the ``embed mod 4`` last channels are zero.

    Parameters
    ----------
    embed : int
        Channels of a token.
    sizes : (int, int)
        Global token counts per spatial dim.
    ranges : ((int, int), (int, int))
        Global ``(start, stop)`` of this block's tokens per spatial dim.
    dtype : torch.dtype
    device : torch.device or str, optional
        Where to compute it (default: torch's default device); the block it is added to's.

    Returns
    -------
    torch.Tensor
        ``[rows, cols, embed]`` (channels last).
    """
    m = embed // 4
    (r0, r1), (c0, c1) = ranges
    out = torch.zeros(r1 - r0, c1 - c0, embed, dtype=torch.float64, device=device)
    for d, ((lo, hi), n) in enumerate(zip(ranges, sizes)):
        k = 1 + torch.arange(m, dtype=torch.float64, device=device) % max(n // 2, 1)
        phase = 2 * math.pi * torch.arange(lo, hi, dtype=torch.float64, device=device).unsqueeze(1) * k / n
        shape = (-1, 1, m) if d == 0 else (1, -1, m)
        out[..., 2 * d * m : (2 * d + 1) * m] = torch.sin(phase).reshape(shape)
        out[..., (2 * d + 1) * m : (2 * d + 2) * m] = torch.cos(phase).reshape(shape)
    return out.to(dtype)


def periodic_window_mask(sizes: tuple[int, int], kernel_size: int) -> torch.Tensor:
    """Local. Bool ``[L, L]`` over the row-major flattened tokens: True where key ``b`` lies in the
    ``kernel_size`` window centred on query ``a`` on the torus (the one-process neighbourhood attention)."""
    r = kernel_size // 2
    near = []
    for n in sizes:
        i = torch.arange(n)
        dist = (i.unsqueeze(1) - i.unsqueeze(0)) % n
        near.append(torch.minimum(dist, n - dist) <= r)  # [n, n]
    return (near[0][:, None, :, None] & near[1][None, :, None, :]).reshape(sizes[0] * sizes[1], -1)


class _TensorSplit:
    """Local. This rank's part of ``n`` units (heads, hidden units) over the model grid's tensor axis,
    in units of ``width`` elements: ``[lo, hi)`` and the cuts of all ranks (whole units per rank)."""

    def __init__(self, grid: hpctp.ProcessGrid | None, axis: int | None, n: int, width: int):
        self.grid, self.axis = grid, axis
        parts = 1 if grid is None or axis is None else grid.dims[axis]
        index = 0 if grid is None or axis is None else grid.coords[axis]
        lo, hi = block_range(n, parts, index)
        self.lo, self.hi = lo * width, hi * width
        self.units = hi - lo
        self.cuts = tuple(c * width for c in block_cuts(n, parts))

    @property
    def split(self) -> bool:
        return self.grid is not None and self.axis is not None

    def slice(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """Local. This rank's slice of ``full`` along ``dim`` (all of it without a tensor axis)."""
        if self.grid is None or self.axis is None:
            return full
        return full.narrow(dim, self.lo, self.hi - self.lo)

    def shard(self, full: torch.Tensor, dim: int) -> torch.nn.Parameter:
        """Local. This rank's slice of ``full`` along ``dim`` as a parameter that knows its place."""
        if self.grid is None or self.axis is None:
            return torch.nn.Parameter(full)
        p = torch.nn.Parameter(self.slice(full, dim).clone())
        split: list[int | None] = [None] * full.ndim
        cuts: list[tuple[int, ...] | None] = [None] * full.ndim
        split[dim], cuts[dim] = self.axis, self.cuts
        p.hpctp_layout = hpctp.Layout(tuple(full.shape), self.grid.dims, tuple(split), tuple(cuts))  # type: ignore[attr-defined]
        return p

    def enter(self, t: torch.Tensor) -> torch.Tensor:
        """Collective over the tensor axis. Identity forward; backward sums the input's gradient."""
        if self.grid is None or self.axis is None:
            return t
        return sum_gradients(t, self.grid, (self.axis,))

    def leave(self, t: torch.Tensor) -> torch.Tensor:
        """Collective over the tensor axis. Sum of the ranks' partial outputs; identity backward."""
        if self.grid is None or self.axis is None:
            return t
        return allreduce_sum(t, self.grid, (self.axis,))


class _GlobalAttention(torch.nn.Module):
    """Collective over grid (local for ``grid=None``). Multi-head attention of every token to every token.

    Parameters and their initial values are ``torch.nn.MultiheadAttention``'s (and
    :class:`hpctp.nn.NeighborhoodAttention2d`'s) viewed per projection: ``qkv_weight [3, E, E]`` (xavier
    over ``[3E, E]``), ``qkv_bias [3, E]`` (zeros), ``out_weight [E, E]``, ``out_bias [E]`` (zero). With a
    tensor axis, each rank keeps the rows of its heads of ``qkv_*`` and those columns of ``out_weight``.
    """

    def __init__(
        self,
        embed: int,
        heads: int,
        schedule: str,
        grid: hpctp.ProcessGrid | None,
        dtype: torch.dtype,
        tensor_axis: int | None = None,
        seed: int = 0,
    ):
        super().__init__()
        self.embed, self.heads, self.schedule, self.grid, self.seed = embed, heads, schedule, grid, seed
        self.part = _TensorSplit(grid, tensor_axis, heads, embed // heads)
        with seeded(seed):
            w, out = self._draw(dtype)
        self.qkv_weight = self.part.shard(w, 1)
        self.qkv_bias = self.part.shard(torch.zeros(3, embed, dtype=dtype), 1)
        self.out_weight = self.part.shard(out, 1)
        self.out_bias = torch.nn.Parameter(torch.zeros(embed, dtype=dtype))

    def _draw(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole ``[3, E, E]`` in-projection and ``[E, E]`` out-projection, in torch's order of draws."""
        e = self.embed
        w = torch.empty(3 * e, e, dtype=dtype)
        out = torch.nn.Linear(e, e, dtype=dtype)  # (torch's order: its init draws after in_proj's empty)
        torch.nn.init.xavier_uniform_(w)
        return w.reshape(3, e, e), out.weight.detach()

    def reset_parameters(self) -> None:
        """Local. The values of construction (the whole projections drawn on the CPU, this rank's heads kept)."""
        with torch.no_grad(), seeded(self.seed), torch.device("cpu"):
            w, out = self._draw(self.qkv_weight.dtype)
            self.qkv_weight.copy_(self.part.slice(w, 1))
            self.out_weight.copy_(self.part.slice(out, 1))
            self.qkv_bias.zero_()
            self.out_bias.zero_()

    def forward(self, t: torch.Tensor, layout: hpctp.Layout | None) -> torch.Tensor:
        """Collective over grid when ``layout`` is given. ``t``: the token block ``[N, rows, cols, E]``."""
        n, rows, cols, e = t.shape
        d = e // self.heads
        h = self.part.units
        qkv = linear(self.part.enter(t), self.qkv_weight.flatten(0, 1), self.qkv_bias.flatten())  # [.., 3 h d]
        q, k, v = (a.unflatten(-1, (h, d)).permute(0, 3, 1, 2, 4) for a in qkv.split(h * d, dim=-1))
        if layout is None:  # one process: SDPA over the flattened tokens
            y = F.scaled_dot_product_attention(q.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3))
            y = y.unflatten(2, (rows, cols))
        else:
            grid = self.grid
            if grid is None:
                raise ValueError("a token layout needs the model's grid")
            shape = (layout.global_shape[0], self.heads, *layout.global_shape[2:], d)
            heads_cuts = tuple(c // d for c in self.part.cuts) if self.part.split else None
            lay = hpctp.Layout(
                shape,
                grid.dims,
                (None, self.part.axis if self.part.split else None, *layout.split[2:], None),
                (None, heads_cuts, *layout.dim_cuts[2:], None),
            )
            dq, dk, dv = (hpctp.DistTensor(a.contiguous(), grid, lay) for a in (q, k, v))
            y = attention(dq, dk, dv, schedule=self.schedule).local
        partial = linear(y.permute(0, 2, 3, 1, 4).reshape(n, rows, cols, h * d), self.out_weight)
        return self.part.leave(partial) + self.out_bias


class _MLP(torch.nn.Module):
    """Collective over the tensor axis (local without one). ``Linear(E, R) -> GELU -> Linear(R, E)``
    with torch's initial values; with a tensor axis the hidden units are split (column, then row)."""

    def __init__(
        self, embed: int, hidden: int, grid: hpctp.ProcessGrid | None, tensor_axis: int | None, dtype: torch.dtype,
        seed: int = 0,
    ):  # fmt: skip
        super().__init__()
        self.embed, self.hidden, self.seed = embed, hidden, seed
        self.part = _TensorSplit(grid, tensor_axis, hidden, 1)
        with seeded(seed):
            fc1, fc2 = self._draw(dtype)
        self.fc1_weight = self.part.shard(fc1.weight.detach().clone(), 0)
        self.fc1_bias = self.part.shard(fc1.bias.detach().clone(), 0)
        self.fc2_weight = self.part.shard(fc2.weight.detach().clone(), 1)
        self.fc2_bias = torch.nn.Parameter(fc2.bias.detach().clone())

    def _draw(self, dtype: torch.dtype) -> tuple[torch.nn.Linear, torch.nn.Linear]:
        return torch.nn.Linear(self.embed, self.hidden, dtype=dtype), torch.nn.Linear(
            self.hidden, self.embed, dtype=dtype
        )

    def reset_parameters(self) -> None:
        """Local. The values of construction (torch's two linears drawn whole on the CPU, this rank's units kept)."""
        with torch.no_grad(), seeded(self.seed), torch.device("cpu"):
            fc1, fc2 = self._draw(self.fc1_weight.dtype)
            self.fc1_weight.copy_(self.part.slice(fc1.weight, 0))
            self.fc1_bias.copy_(self.part.slice(fc1.bias, 0))
            self.fc2_weight.copy_(self.part.slice(fc2.weight, 1))
            self.fc2_bias.copy_(fc2.bias)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        a = F.gelu(linear(self.part.enter(t), self.fc1_weight, self.fc1_bias))
        return self.part.leave(linear(a, self.fc2_weight)) + self.fc2_bias


class _TorchWindowAttention(torch.nn.Module):
    """Local. One process: :class:`hpctp.nn.NeighborhoodAttention2d`'s parameters (torch's
    ``MultiheadAttention`` names and initial values) and the periodic window as a boolean mask."""

    def __init__(self, embed: int, heads: int, kernel_size: int, dtype: torch.dtype):
        super().__init__()
        self.heads, self.kernel_size = heads, kernel_size
        self.in_proj_weight = torch.nn.Parameter(torch.empty(3 * embed, embed, dtype=dtype))
        self.in_proj_bias = torch.nn.Parameter(torch.zeros(3 * embed, dtype=dtype))
        self.out_proj = torch.nn.Linear(embed, embed, dtype=dtype)  # (torch's order: its init draws first)
        torch.nn.init.xavier_uniform_(self.in_proj_weight)
        with torch.no_grad():
            self.out_proj.bias.zero_()

    def forward(self, t: torch.Tensor, layout: None) -> torch.Tensor:
        """Local. ``t``: the token field ``[N, rows, cols, E]``."""
        n, rows, cols, e = t.shape
        qkv = linear(t, self.in_proj_weight, self.in_proj_bias)
        q, k, v = (a.unflatten(-1, (self.heads, e // self.heads)).permute(0, 3, 1, 2, 4) for a in qkv.split(e, -1))
        mask = periodic_window_mask((rows, cols), self.kernel_size)
        y = F.scaled_dot_product_attention(q.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3), attn_mask=mask)
        return self.out_proj(y.unflatten(2, (rows, cols)).permute(0, 2, 3, 1, 4).reshape(n, rows, cols, e))


class _NeighborhoodAttention(torch.nn.Module):
    """Collective over grid (local for ``grid=None``). :class:`hpctp.nn.NeighborhoodAttention2d` (periodic)
    on a channels-last token block; one process: the same parameters, SDPA with the window as a mask."""

    def __init__(
        self, embed: int, heads: int, kernel_size: int, grid: hpctp.ProcessGrid | None, seed: int, dtype: torch.dtype
    ):
        super().__init__()
        if grid is None:
            self.attn: torch.nn.Module = _seeded(seed, lambda: _TorchWindowAttention(embed, heads, kernel_size, dtype))
        else:
            self.attn = NeighborhoodAttention2d(
                embed, heads, kernel_size, grid, split=(0, 1), periodic=True, seed=seed, dtype=dtype
            )

    def forward(self, t: torch.Tensor, layout: hpctp.Layout | None) -> torch.Tensor:
        """Collective over grid when ``layout`` is given. ``t``: the token block ``[N, rows, cols, E]``."""
        if layout is None:
            return self.attn(t, None)
        return self.attn(t.movedim(-1, 1), layout).movedim(1, -1)


class _Block(torch.nn.Module):
    """Collective over grid. A pre-norm transformer block on a channels-last token block."""

    def __init__(
        self,
        embed: int,
        heads: int,
        mlp_ratio: float,
        kind: str,
        kernel_size: int,
        schedule: str,
        grid: hpctp.ProcessGrid | None,
        seed: int,
        dtype: torch.dtype,
        tensor_axis: int | None = None,
    ):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(embed, dtype=dtype)
        if kind == "neighborhood":
            self.attn: torch.nn.Module = _NeighborhoodAttention(embed, heads, kernel_size, grid, seed, dtype)
        else:
            self.attn = _GlobalAttention(embed, heads, schedule, grid, dtype, tensor_axis, seed)
        self.norm2 = torch.nn.LayerNorm(embed, dtype=dtype)
        self.mlp = _MLP(embed, hidden_units(embed, mlp_ratio), grid, tensor_axis, dtype, seed + 1)

    def forward(self, xt: tuple[Any, Any]) -> tuple[Any, Any]:
        """Collective over grid for a DistTensor token field. ``(x, tokens) -> (x, block(tokens))``."""
        x, tokens = xt
        t, layout = _channels_last(tokens)
        t = t + self.attn(self.norm1(t), layout)
        return x, _channels_first(t + self.mlp(self.norm2(t)), tokens)


def hidden_units(embed: int, mlp_ratio: float) -> int:
    """Local. The MLP's hidden width."""
    return max(1, round(embed * mlp_ratio))


class _ZeroUnpatch2d(Unpatch2d):
    """Collective over grid (local: no communication). :class:`hpctp.nn.Unpatch2d`, zeroed by its reset too."""

    def reset_parameters(self) -> None:
        """Local. Torch's draws (the seed's stream as in construction), then zeros."""
        super().reset_parameters()
        zero_(self)


class _TorchUnpatch(torch.nn.Module):
    """Local. One process: :class:`hpctp.nn.Unpatch2d` (per-token Linear + pixel shuffle) with torch ops."""

    def __init__(self, embed: int, channels: int, patch: int, dtype: torch.dtype):
        super().__init__()
        lin = torch.nn.Linear(embed, channels * patch * patch, dtype=dtype)
        self.weight, self.bias = lin.weight, lin.bias
        self.patch = patch

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        y = linear(t.movedim(1, -1), self.weight, self.bias).movedim(-1, 1)  # [N, C p^2, rows, cols]
        return F.pixel_shuffle(y, self.patch)


class ViT(torch.nn.Sequential):
    """Collective over grid. A vision transformer over the patches of the field (see :mod:`apps.surrogate.vit`).

    A chain of layers (``embed``, ``block0`` .. ``block{depth - 1}``, ``norm``, ``head``) whose activations
    are ``(x, tokens)``: the input carried to the residual output beside the token field ``[N, E, rows,
    cols]`` (a DistTensor split as the patch-aligned field), so :class:`hpctp.nn.PipelineParallel` cuts it
    between any two (``train.pipeline``).

    Parameters
    ----------
    channels : int
        Fields of the state (2 for Gray-Scott).
    patch : int
        Patch edge; the field's sizes must be multiples of it.
    embed, depth, heads : int
        Token channels, transformer blocks, attention heads (dividing ``embed``).
    mlp_ratio : float
        Hidden width of the MLP over ``embed``.
    attention : {"global", "neighborhood"}
        Every token to every token, or to the ``kernel_size`` window around it (periodic).
    kernel_size : int
        Odd window edge (in tokens) of the neighbourhood attention.
    schedule : {"ring", "all_to_all", "auto"}
        Of the global attention (:func:`hpctp.nn.functional.attention`).
    grid : ProcessGrid or None
        None: the one-process torch reference.
    seed : int
    dtype : torch.dtype
    tensor_axis : int, optional
        The grid axis that splits the heads and the MLP's hidden units (global attention only); the
        field is split over the grid's first two axes.

    Raises
    ------
    ValueError
        On non-positive sizes, ``heads`` not dividing ``embed``, an unknown attention kind or schedule,
        an even ``kernel_size``, or a tensor axis with neighbourhood attention or fewer heads than its ranks.
    """

    def __init__(
        self,
        channels: int,
        patch: int,
        embed: int,
        depth: int,
        heads: int,
        mlp_ratio: float,
        attention: str,
        kernel_size: int,
        schedule: str,
        grid: hpctp.ProcessGrid | None,
        seed: int,
        dtype: torch.dtype,
        tensor_axis: int | None = None,
    ):
        for name, value in (("patch", patch), ("embed", embed), ("depth", depth), ("heads", heads)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"surrogate.{name} must be a positive int, got {value!r}")
        if embed % heads:
            raise ValueError(f"surrogate.heads={heads} must divide surrogate.embed={embed}")
        if not mlp_ratio > 0:
            raise ValueError(f"surrogate.mlp_ratio must be positive, got {mlp_ratio!r}")
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"surrogate.attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"surrogate.schedule must be one of {SCHEDULES}, got {schedule!r}")
        if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(
                f"surrogate.kernel_size must be an odd positive int (a centred window), got {kernel_size!r}"
            )
        if tensor_axis is not None and grid is not None:
            parts = grid.dims[tensor_axis]
            if attention != "global":
                raise ValueError(
                    "a tensor axis splits the heads of the global attention; use surrogate.attention = 'global'"
                )
            if heads < parts or hidden_units(embed, mlp_ratio) < parts:
                raise ValueError(
                    f"the tensor axis has {parts} ranks but the ViT {heads} heads and "
                    f"{hidden_units(embed, mlp_ratio)} hidden units; give each rank at least one of both"
                )
        if grid is None:
            proj: torch.nn.Module = _seeded(
                seed, lambda: torch.nn.Conv2d(channels, embed, patch, stride=patch, dtype=dtype)
            )
        else:
            proj = PatchEmbed2d(channels, embed, patch, grid, split=(0, 1), seed=seed, dtype=dtype)
        layers: dict[str, torch.nn.Module] = {"embed": _Embed(proj, grid, patch, embed, attention, kernel_size)}
        for i in range(depth):
            layers[f"block{i}"] = _Block(
                embed, heads, mlp_ratio, attention, kernel_size, schedule, grid, seed + 1 + 2 * i, dtype, tensor_axis
            )
        layers["norm"] = _TokenNorm(embed, dtype=dtype)
        last = seed + 1 + 2 * depth
        if grid is None:
            unpatch: torch.nn.Module = _seeded(last, lambda: _TorchUnpatch(embed, channels, patch, dtype))
        else:
            unpatch = _ZeroUnpatch2d(embed, channels, patch, grid, split=(0, 1), seed=last, dtype=dtype)
        zero_(unpatch)
        layers["head"] = _Head(unpatch, grid, patch, dtype)
        super().__init__(OrderedDict(layers))
        self.grid = grid  # (global_state_dict finds the grid of the sharded weights here)

    @property
    def delta_scale(self) -> torch.Tensor:
        """Local. The output scale (the head's buffer)."""
        return self.get_buffer("head.delta_scale")


def _channels_last(tokens: Any) -> tuple[torch.Tensor, hpctp.Layout | None]:
    """Local. A token field's block, channels last, and its layout (None in one process)."""
    if isinstance(tokens, hpctp.DistTensor):
        return tokens.local.movedim(1, -1), tokens.layout
    return tokens.movedim(1, -1), None


def _channels_first(t: torch.Tensor, like: Any) -> Any:
    """Local. A channels-last block back as a token field like ``like``."""
    out = t.movedim(-1, 1)
    return like.with_local(out) if isinstance(like, hpctp.DistTensor) else out


class _Embed(torch.nn.Module):
    """Collective over grid. ``x -> (x, tokens)``: the field moved onto patch-aligned cuts where a cut is not on a
    patch boundary, patches embedded, the positional embedding added."""

    def __init__(
        self, proj: torch.nn.Module, grid: hpctp.ProcessGrid | None, patch: int, embed: int, kind: str,
        kernel_size: int,
    ) -> None:  # fmt: skip
        super().__init__()
        self.proj = proj
        self.grid, self.patch, self.embed_dim, self.kind, self.kernel_size = grid, patch, embed, kind, kernel_size

    def _check(self, shape: tuple[int, ...]) -> None:
        """Local (global shapes: the same verdict on every rank)."""
        sizes = shape[2:]
        if len(sizes) != 2 or any(s % self.patch for s in sizes):
            raise ValueError(
                f"the ViT surrogate needs a 2-D field whose sizes are multiples of surrogate.patch={self.patch}, "
                f"got {tuple(sizes)}; choose simulation.size or surrogate.patch accordingly"
            )
        rows, cols = sizes[0] // self.patch, sizes[1] // self.patch
        if self.kind == "neighborhood" and self.kernel_size > min(rows, cols):
            raise ValueError(
                f"surrogate.kernel_size={self.kernel_size} exceeds the token grid {rows} x {cols} "
                f"(field {tuple(sizes)} / patch {self.patch}); use kernel_size <= {min(rows, cols)}"
            )

    def forward(self, x: Any) -> tuple[Any, Any]:
        """Collective over grid for a DistTensor ``x``.

        Raises
        ------
        ValueError
            If the field's sizes are not multiples of the patch, or the window exceeds the token grid.
        """
        if isinstance(x, torch.Tensor):
            self._check(tuple(x.shape))
            t = self.proj(x)
            sizes = (t.shape[2], t.shape[3])
            return x, t + _position(self.embed_dim, sizes, ((0, sizes[0]), (0, sizes[1])), t.dtype, t.device)
        grid = self.grid
        if grid is None:
            raise TypeError("the one-process ViT (grid=None) takes a torch.Tensor, got a DistTensor")
        self._check(x.global_shape)
        lay = x.layout
        aligned = patch_aligned_layout(lay, self.patch)
        grad = torch.is_grad_enabled() and x.local.requires_grad
        xa = x if aligned == lay else hpctp.DistTensor(move_block(x.local, grid, lay, aligned, grad), grid, aligned)
        t = self.proj(xa)  # DistTensor token field [N, E, rows, cols]
        lr = t.layout.local_ranges(grid.coords)
        sizes = (t.layout.global_shape[2], t.layout.global_shape[3])
        local = t.local
        return x, t.with_local(local + _position(self.embed_dim, sizes, (lr[2], lr[3]), local.dtype, local.device))


def _position(
    embed: int, sizes: tuple[int, int], ranges: Any, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Local. :func:`sincos_position` channels first (``[E, rows, cols]``) on ``device``."""
    return sincos_position(embed, sizes, ranges, dtype, device).movedim(-1, 0)


class _TokenNorm(torch.nn.LayerNorm):
    """Local. The last LayerNorm, over each token's channels: ``(x, tokens) -> (x, norm(tokens))``."""

    def forward(self, xt: tuple[Any, Any]) -> tuple[Any, Any]:  # type: ignore[override]
        x, tokens = xt
        t, _ = _channels_last(tokens)
        return x, _channels_first(super().forward(t), tokens)


class _Head(ResidualScale):
    """Collective over grid. ``(x, tokens) -> x + s * unpatch(tokens)``, moved back onto ``x``'s cuts where the
    embedding moved it onto patch-aligned ones; ``s`` the ``delta_scale`` buffer."""

    def __init__(self, unpatch: torch.nn.Module, grid: hpctp.ProcessGrid | None, patch: int, dtype: torch.dtype):
        super().__init__()
        self.unpatch = unpatch
        self.grid, self.patch = grid, patch
        self._scale_buffer(dtype)

    def forward(self, xt: tuple[Any, Any]) -> Any:
        x, tokens = xt
        if isinstance(x, torch.Tensor):
            return x + self.unpatch(tokens) * self.delta_scale
        grid = cast(hpctp.ProcessGrid, self.grid)
        lay = x.layout
        aligned = patch_aligned_layout(lay, self.patch)
        out = self.unpatch(tokens).local  # the aligned layout
        if aligned != lay:
            out = move_block(out, grid, aligned, lay, torch.is_grad_enabled() and out.requires_grad)
        return hpctp.DistTensor(x.local + out * self.delta_scale, grid, lay)
