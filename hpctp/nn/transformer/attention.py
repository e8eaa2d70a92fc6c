"""Multi-head attention split over whole heads along one grid axis (Megatron's tensor parallelism).

Every rank of ``axis`` holds the inputs ``[batch, tokens, embed]`` (or, with sequence
parallelism, its block of the tokens, all-gathered on entry) and a contiguous range of
heads, ``block_cuts(num_heads, P)``, so uneven counts work (5 heads on 2 ranks: 3 and 2; a
rank may hold none). Its q, k, v projections are the rows of those heads (column-parallel),
it runs :func:`torch.nn.functional.scaled_dot_product_attention` on its heads alone, and
the output projection takes the matching columns (row-parallel): the partial outputs are
summed by one all-reduce forward (a reduce-scatter with sequence parallelism), and the
input gradient by one all-reduce backward.

Inputs may also be :class:`hpctp.DistTensor` ``[batch, tokens, embed]`` (embedding whole):
the tokens whole along ``axis``, or split over it with sequence parallelism; their cuts come
from the layout, which is checked once per layout (the verdict cached), so a call sends no
message beyond its data. With ``schedule`` (``"ring"``, ``"all_to_all"``, ``"auto"``) a
DistTensor's tokens (``[batch, *tokens, embed]``, 1 to 3 token dims) are split over the
*other* grid axes: each rank's heads' q, k and v become DistTensors ``[batch, heads, *tokens,
head_dim]`` (heads over ``axis``, tokens as the input's) and
:func:`hpctp.nn.functional.attention` attends over all the tokens (K/V blocks travel a ring
over the token axes, or move all-to-all), before the row-parallel output projection and its
one all-reduce over ``axis``.

Parameters follow ``torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)``
gathered: ``in_proj_weight`` ``[3E, E]`` (q, k, v stacked), ``in_proj_bias`` ``[3E]``,
``out_proj.weight`` ``[E, E]``, ``out_proj.bias`` ``[E]``. Each rank keeps
``in_proj_weight`` as the block ``[3, E_local, E]`` of the global ``[3, E, E]`` (its heads'
rows of q, k and v; ``hpctp_layout`` describes it), ``in_proj_bias`` as ``[3, E_local]``;
:func:`hpctp.nn.global_state_dict` reshapes them to torch's packing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..._util.ints import is_int, positive_ints
from ...comm import ProcessGrid, check_grid
from ...layout import Layout, block_cuts
from ...tensor.core import DistTensor
from .._amp import autocast_dtype, autocast_input
from .._deferred_weights import linear as _linear
from ..init import BlockReset, derive_seed, init_block
from .agreement import ArgumentAgreement
from .context_parallel import attention as context_attention
from .linear import RowParallelLinear
from .sequence_parallel import enter_parallel_region, leave_parallel_region
from .sequence_parallel import token_cuts as agree_token_cuts

__all__ = ["MultiheadAttention", "attention_mask"]

Cuts = tuple[int, ...]

#: ``MultiheadAttention(schedule=...)``: None (each rank attends over the whole tokens it holds), or the
#: schedule of :func:`hpctp.nn.functional.attention` over tokens split across other grid axes.
SCHEDULES = (None, "ring", "all_to_all", "auto")


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's convention: a bool mask is True where attention is *not* allowed (``-inf``)."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def attention_mask(
    batch: int, heads: tuple[int, int], num_heads: int, q_len: int, k_len: int, dtype: torch.dtype,
    attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, is_causal: bool,
) -> tuple[torch.Tensor | None, bool]:  # fmt: skip
    """Local. The mask and causal flag for ``scaled_dot_product_attention`` on heads ``heads[0]:heads[1]``.

    Follows ``torch.nn.functional.multi_head_attention_forward``: ``attn_mask`` ``[L, S]`` or
    ``[batch * num_heads, L, S]`` and ``key_padding_mask`` ``[batch, S]`` (bool: True masks
    out; float: added) are merged into one additive mask. ``is_causal`` with no padding mask
    is passed on as the causal flag (``attn_mask``, if given, is taken to be the causal
    mask, as torch does); with a padding mask the causal mask is spelled out.

    Returns
    -------
    (mask or None, is_causal)
    """
    if is_causal and key_padding_mask is None:
        return None, True
    if is_causal and attn_mask is None:
        attn_mask = torch.ones(q_len, k_len, dtype=torch.bool).tril_().logical_not_()
        if key_padding_mask is not None:
            attn_mask = attn_mask.to(key_padding_mask.device)
    mask = None
    if attn_mask is not None:
        mask = _float_mask(attn_mask, dtype)
        if mask.ndim == 3:
            mask = mask.reshape(batch, num_heads, q_len, k_len)[:, heads[0] : heads[1]]
    if key_padding_mask is not None:
        pad = _float_mask(key_padding_mask, dtype).reshape(batch, 1, 1, k_len)
        mask = pad if mask is None else mask + pad
    return mask, False


class MultiheadAttention(BlockReset, torch.nn.Module):
    """Local. ``torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)`` split over whole heads.

    See the module docstring for the split and its messages. ``forward`` is collective over
    the ranks of ``axis`` (the other grid axes may hold other data: their ranks never talk
    here). Parameters: ``in_proj_weight`` ``[3, E_local, E]`` and ``in_proj_bias``
    ``[3, E_local]`` (this rank's heads, ``hpctp_layout`` of the global ``[3, E, E]`` /
    ``[3, E]``), ``out_proj`` a :class:`~hpctp.nn.RowParallelLinear` cut at the same head
    boundaries (its bias replicated). Initialisation follows torch's distributions (Xavier
    uniform in-projection, zero biases, ``U(+-1/sqrt(E))`` out-projection) as
    grid-independent values for a ``seed``. Every parameter's gradient is complete along
    ``axis`` after backward (they carry ``hpctp_grad_reduced``), except ``out_proj.bias``
    with sequence parallelism (partial over the token blocks: :func:`hpctp.nn.sync_gradients`
    sums it), and, with tokens split over other grid axes (``schedule``), every gradient is
    partial over those axes (one ``sync_gradients`` sums them).

    Inputs are this rank's blocks as ``torch.Tensor`` (see :meth:`forward`) or
    :class:`hpctp.DistTensor` ``[batch, *tokens, embed]`` with the embedding whole: then the
    token cuts come from the layout (no message per call; the layout is checked once and the
    verdict cached) and the output is a DistTensor of the query's layout. With ``schedule``
    (``"ring"``, ``"all_to_all"`` or ``"auto"``) the tokens of a DistTensor input (1 to 3 token
    dims, e.g. the patch grid of a field) may be split over the grid axes other than ``axis``:
    each rank projects its tokens onto its heads, :func:`hpctp.nn.functional.attention` with
    that schedule attends over all the tokens (the heads dim split over ``axis`` in whole-head
    cuts, the ring over the token axes), and the row-parallel output projection ends with one
    all-reduce over ``axis``.

    Parameters
    ----------
    embed_dim : int
    num_heads : int
        Must divide ``embed_dim``; need not be a multiple of the ranks of ``axis``.
    grid : ProcessGrid
    axis : int
        Grid axis splitting the heads.
    bias : bool
        In- and out-projection biases.
    sequence_parallel : bool
        Inputs and output hold this rank's block of the tokens (dim 1), not all of them.
    schedule : {None, "ring", "all_to_all", "auto"}
        None: every rank attends over all the tokens it holds (the tokens whole, or split over
        ``axis`` with ``sequence_parallel``). Else the schedule of
        :func:`hpctp.nn.functional.attention` over the tokens of DistTensor inputs split over
        other grid axes (exact attention over all of them); needs DistTensor inputs and no masks
        (``is_causal`` with one token dim). With ``sequence_parallel`` one token dim is also split
        over ``axis``: each rank gathers it over ``axis`` on entering (all-gather; backward
        reduce-scatter) and keeps its block of the output (reduce-scatter; backward all-gather).
    seed : int
    dtype : torch.dtype
    device : torch.device or str, optional

    Raises
    ------
    TypeError
        If ``grid`` is not a ProcessGrid.
    ValueError
        On non-positive sizes, ``num_heads`` not dividing ``embed_dim``, a bad ``axis`` or an
        unknown ``schedule``.
    """

    in_proj_weight: torch.nn.Parameter
    in_proj_bias: torch.nn.Parameter | None

    def __init__(
        self, embed_dim: int, num_heads: int, grid: ProcessGrid, *, axis: int = 0, bias: bool = True,
        sequence_parallel: bool = False, schedule: str | None = None, seed: int = 0,
        dtype: torch.dtype = torch.float32, device: Any = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.grid = check_grid(grid)
        positive_ints(embed_dim=embed_dim, num_heads=num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        if not is_int(axis) or not 0 <= axis < grid.ndim:
            raise ValueError(f"axis={axis!r} is not an axis of the {grid.ndim}-D grid {grid.dims}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.schedule = schedule
        self.embed_dim, self.num_heads, self.axis = int(embed_dim), int(num_heads), int(axis)
        self.head_dim = self.embed_dim // self.num_heads
        self.batch_first = True
        self.sequence_parallel = bool(sequence_parallel)
        self.head_cuts = block_cuts(self.num_heads, grid.dims[self.axis])
        r = grid.coords[self.axis]
        self.heads = (self.head_cuts[r], self.head_cuts[r + 1])
        self.feature_cuts = tuple(h * self.head_dim for h in self.head_cuts)
        e = self.embed_dim
        w_layout = Layout((3, e, e), grid.dims, (None, self.axis, None), (None, self.feature_cuts, None))
        bound = math.sqrt(6.0 / (e + 3 * e))  # xavier_uniform_ of torch's [3E, E]
        w = init_block(w_layout, grid.coords, derive_seed(seed, 1), bound, dtype, device)
        self.in_proj_weight = torch.nn.Parameter(w)
        self.in_proj_weight.hpctp_layout = w_layout  # type: ignore[attr-defined]
        self._record_block("in_proj_weight", w_layout, grid.coords, derive_seed(seed, 1), bound)
        self.register_parameter("in_proj_bias", None)
        if bias:
            b_layout = Layout((3, e), grid.dims, (None, self.axis), (None, self.feature_cuts))
            self.in_proj_bias = torch.nn.Parameter(
                torch.zeros(b_layout.local_shape(grid.coords), dtype=dtype, device=device)
            )
            self.in_proj_bias.hpctp_layout = b_layout  # type: ignore[attr-defined]
        self.out_proj = RowParallelLinear(
            e, e, grid, axis=self.axis, bias=bias, seed=derive_seed(seed, 2), dtype=dtype, device=device,
            in_cuts=self.feature_cuts,
        )  # fmt: skip
        if self.out_proj.bias is not None:
            with torch.no_grad():
                self.out_proj.bias.zero_()
        for p in self.parameters():
            p.hpctp_grad_reduced = (self.axis,)  # type: ignore[attr-defined]
        if self.sequence_parallel and self.out_proj.bias is not None:
            self.out_proj.bias.hpctp_grad_reduced = ()  # type: ignore[attr-defined]
        self._agreed = ArgumentAgreement()

    def _after_reset(self) -> None:  # construction's zeroed biases (out_proj's own reset runs before, as its init)
        for b in (self.in_proj_bias, self.out_proj.bias):
            if b is not None:
                b.zero_()

    # ------------------------------------------------------------------ global state (torch's packing)
    def hpctp_export_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Local. Gathered parameters in torch's packing: ``in_proj_weight`` ``[3, E, E] -> [3E, E]``.

        Parameters
        ----------
        state : dict
            This module's gathered state (keys relative to the module).

        Returns
        -------
        dict
        """
        out = dict(state)
        e = self.embed_dim
        if "in_proj_weight" in out:
            out["in_proj_weight"] = out["in_proj_weight"].reshape(3 * e, e)
        if "in_proj_bias" in out:
            out["in_proj_bias"] = out["in_proj_bias"].reshape(3 * e)
        return out

    def hpctp_import_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Local. torch's packing to the gathered layout: ``in_proj_weight`` ``[3E, E] -> [3, E, E]``.

        Parameters
        ----------
        state : dict
            torch's state for this module (keys relative to the module).

        Returns
        -------
        dict
            Entries of other shapes are left alone (the load then names the mismatch).
        """
        out = dict(state)
        e = self.embed_dim
        w, b = out.get("in_proj_weight"), out.get("in_proj_bias")
        if isinstance(w, torch.Tensor) and tuple(w.shape) == (3 * e, e):
            out["in_proj_weight"] = w.reshape(3, e, e)
        if isinstance(b, torch.Tensor) and tuple(b.shape) == (3 * e,):
            out["in_proj_bias"] = b.reshape(3, e)
        return out

    # ------------------------------------------------------------------ forward
    def _check(
        self, tensors: Sequence[torch.Tensor], attn_mask: Any, key_padding_mask: Any, is_causal: Any, need_weights: Any
    ) -> tuple[Exception | None, tuple[Any, ...]]:
        """Local validation; the signature the ranks of the axis must share (token counts aside
        with sequence parallelism, which :func:`token_cuts` gathers)."""
        w = self.in_proj_weight
        for name, t in zip(("query", "key", "value"), tensors):
            if not isinstance(t, torch.Tensor):
                return TypeError(f"MultiheadAttention: {name} must be a torch.Tensor, got {type(t).__name__}"), ()
            if t.ndim != 3 or t.shape[2] != self.embed_dim or t.shape[0] != tensors[0].shape[0]:
                return ValueError(
                    f"MultiheadAttention: {name} must be [batch, tokens, {self.embed_dim}] with query's batch "
                    f"(batch_first), got shape {tuple(t.shape)}"
                ), ()
            if (t.dtype != w.dtype and autocast_dtype(t) is None) or t.device != w.device:  # (autocast casts)
                return TypeError(
                    f"MultiheadAttention: {name} is {t.dtype} on {t.device}, the weights {w.dtype} on {w.device}"
                ), ()
        if tensors[1].shape[1] != tensors[2].shape[1]:
            return ValueError(
                f"MultiheadAttention: key and value must have as many tokens, got {tuple(tensors[1].shape)} "
                f"and {tuple(tensors[2].shape)}"
            ), ()
        if need_weights:
            return ValueError(
                "MultiheadAttention: need_weights=True is not supported (the heads live on different ranks); "
                "pass need_weights=False"
            ), ()
        for name, m in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
            if m is not None and not isinstance(m, torch.Tensor):
                return TypeError(
                    f"MultiheadAttention: {name} must be a torch.Tensor or None, got {type(m).__name__}"
                ), ()
            if m is not None and m.dtype != torch.bool and not m.is_floating_point():
                return TypeError(f"MultiheadAttention: {name} must be bool or floating point, got {m.dtype}"), ()
        if not isinstance(is_causal, bool):
            return TypeError(f"MultiheadAttention: is_causal must be a bool, got {is_causal!r}"), ()
        masks = tuple(None if m is None else (tuple(m.shape), str(m.dtype)) for m in (attn_mask, key_padding_mask))
        same = (tensors[1] is tensors[0], tensors[2] is tensors[1])
        shapes = tuple(tuple(t.shape) if not self.sequence_parallel else (t.shape[0], t.shape[2]) for t in tensors)
        return None, (shapes, same, str(w.dtype), w.device.type, masks, is_causal)

    def _check_masks(self, batch: int, q_len: int, k_len: int, attn_mask: Any, key_padding_mask: Any) -> None:
        """Local (the same verdict on every rank: the shapes were agreed). Mask shapes against the tokens."""
        if attn_mask is not None and tuple(attn_mask.shape) not in (
            (q_len, k_len),
            (batch * self.num_heads, q_len, k_len),
        ):
            raise ValueError(
                f"MultiheadAttention: attn_mask must be [{q_len}, {k_len}] or [{batch * self.num_heads}, {q_len}, "
                f"{k_len}] (batch * num_heads, query tokens, key tokens), got {tuple(attn_mask.shape)}"
            )
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (batch, k_len):
            raise ValueError(
                f"MultiheadAttention: key_padding_mask must be [{batch}, {k_len}] (batch, key tokens), "
                f"got {tuple(key_padding_mask.shape)}"
            )

    def _divided(self, g: int | None) -> bool:
        """Whether grid axis ``g`` (a layout's split entry) cuts a dim into more than one block."""
        return g is not None and self.grid.dims[g] > 1

    def _check_dist(
        self, tensors: Sequence[Any], attn_mask: Any, key_padding_mask: Any, is_causal: Any, need_weights: Any
    ) -> tuple[Exception | None, tuple[Any, ...]]:
        """Local validation of DistTensor inputs (global layouts: the same verdict on every rank, but for
        dtypes, devices and masks); the signature the ranks must share."""
        what, names = "MultiheadAttention", ("query", "key", "value")
        if not all(isinstance(t, DistTensor) for t in tensors):
            kinds = ", ".join(type(t).__name__ for t in tensors)
            return TypeError(
                f"{what}: query, key and value must be all hpctp.DistTensor or all torch.Tensor, got {kinds}"
            ), ()
        w, grid, e, ax = self.in_proj_weight, self.grid, self.embed_dim, self.axis
        ring = self.schedule is not None
        form = f"[batch, *tokens, {e}] with 1 to 3 token dims" if ring else f"[batch, tokens, {e}]"
        q = tensors[0]
        for name, t in zip(names, tensors):
            if not isinstance(t.local, torch.Tensor):
                return TypeError(f"{what}: {name} has {t.backend} blocks; convert it with {name}.to('torch')"), ()
            if t.grid is not grid and t.grid.comm != grid.comm:
                return ValueError(
                    f"{what}: {name} is on another ProcessGrid (dims {t.grid.dims}) than the layer (dims {grid.dims}); "
                    f"create or redistribute it on the layer's grid"
                ), ()
            blk = t.local
            if (blk.dtype != w.dtype and autocast_dtype(blk) is None) or blk.device != w.device:  # (autocast casts)
                return TypeError(
                    f"{what}: {name} is {blk.dtype} on {blk.device}, the weights {w.dtype} on {w.device}"
                ), ()
            if not 3 <= t.ndim <= (5 if ring else 3) or t.global_shape[-1] != e:
                return ValueError(f"{what}: {name} must be {form} (batch_first), got shape {t.global_shape}"), ()
            if self._divided(t.split[-1]):
                return ValueError(
                    f"{what}: {name}'s embedding (last dim) is split over grid axis {t.split[-1]} ({t.layout}); "
                    f"it must be whole on every rank: redistribute it with split[-1]=None"
                ), ()
            if self._divided(t.split[0]) and t.split[0] == ax:
                return ValueError(
                    f"{what}: {name}'s batch (dim 0) is split over grid axis {ax}, which splits the heads (the ranks "
                    f"of axis {ax} attend the same samples); split the batch over another grid axis"
                ), ()
            if (t.global_shape[0], t.split[0], t.layout.dim_cuts[0]) != (
                q.global_shape[0],
                q.split[0],
                q.layout.dim_cuts[0],
            ):
                return ValueError(
                    f"{what}: {name} ({t.layout}) and query ({q.layout}) must share the batch and its cuts"
                ), ()
            for d in range(1, t.ndim - 1):
                g = t.split[d]
                if not self._divided(g):
                    continue
                if g == ax and ring and not self.sequence_parallel:
                    return ValueError(
                        f"{what}: {name}'s tokens (dim {d}) are split over grid axis {ax}, which splits the heads "
                        f"(schedule={self.schedule!r}); split the tokens over the other grid axes, or build the "
                        f"layer with sequence_parallel=True"
                    ), ()
                if g == ax and not self.sequence_parallel:
                    return ValueError(
                        f"{what}: {name}'s tokens (dim 1) are split over grid axis {ax}, the heads' axis, but "
                        f"sequence_parallel=False; build the layer with sequence_parallel=True, or redistribute "
                        f"{name} with the tokens whole (replicated along axis {ax})"
                    ), ()
                if g != ax and not ring:
                    return ValueError(
                        f"{what}: {name}'s tokens (dim {d}) are split over grid axis {g}, but attention split over "
                        f"heads needs every token on the ranks of axis {ax} (sequence_parallel: split over axis {ax} "
                        f"only); use schedule='ring' (TransformerBlock(attention='ring')) for tokens split over other "
                        f"axes, or redistribute"
                    ), ()
            if self.sequence_parallel and self._divided(ax) and not ring and t.split[1] != ax:
                return ValueError(
                    f"{what}: with sequence_parallel=True {name}'s tokens (dim 1) must be split over grid axis {ax}, "
                    f"got {t.layout}"
                ), ()
            if self.sequence_parallel and self._divided(ax) and ring and ax not in t.split[1:-1]:
                return ValueError(
                    f"{what}: with sequence_parallel=True one of {name}'s token dims must be split over grid axis "
                    f"{ax} (the heads' axis), got {t.layout}"
                ), ()
        k, v = tensors[1], tensors[2]
        if ring and not (k.split == q.split and v.split == q.split and k.ndim == q.ndim):
            return ValueError(
                f"{what}: key ({k.layout}) and value ({v.layout}) must have the query's token dims and split "
                f"({q.layout}); redistribute them"
            ), ()
        if k.global_shape[:-1] != v.global_shape[:-1] or k.layout.dim_cuts[:-1] != v.layout.dim_cuts[:-1]:
            return ValueError(
                f"{what}: key ({k.layout}) and value ({v.layout}) must have the same tokens and cuts; "
                f"redistribute value to key's layout"
            ), ()
        if need_weights:
            return ValueError(
                f"{what}: need_weights=True is not supported (the heads live on different ranks); "
                f"pass need_weights=False"
            ), ()
        if not isinstance(is_causal, bool):
            return TypeError(f"{what}: is_causal must be a bool, got {is_causal!r}"), ()
        if ring:
            if attn_mask is not None or key_padding_mask is not None:
                return ValueError(
                    f"{what}: attn_mask and key_padding_mask are not supported with schedule={self.schedule!r} "
                    f"(the tokens live on different ranks); pass is_causal=True for causal attention over one "
                    f"token dim, or use schedule=None with the tokens whole"
                ), ()
            if is_causal and q.ndim != 3:
                return ValueError(
                    f"{what}: is_causal=True needs one token dim with schedule={self.schedule!r}, got query "
                    f"{q.global_shape} (causal order over a token grid is not defined here)"
                ), ()
        else:
            for name, m in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
                if m is not None and not isinstance(m, torch.Tensor):
                    return TypeError(f"{what}: {name} must be a torch.Tensor or None, got {type(m).__name__}"), ()
                if m is not None and m.dtype != torch.bool and not m.is_floating_point():
                    return TypeError(f"{what}: {name} must be bool or floating point, got {m.dtype}"), ()
            try:  # masks: this rank's samples, all the tokens
                self._check_masks(q.local.shape[0], q.global_shape[1], k.global_shape[1], attn_mask, key_padding_mask)
            except ValueError as err:
                return err, ()
        masks = tuple(None if m is None else (tuple(m.shape), str(m.dtype)) for m in (attn_mask, key_padding_mask))
        same = (tensors[1] is tensors[0], tensors[2] is tensors[1])
        layouts = tuple(t.layout for t in tensors)
        dtypes = tuple(str(t.dtype) for t in tensors)
        return None, ("dist", layouts, same, dtypes, str(w.dtype), w.device.type, masks, is_causal)

    def _layout_cuts(self, t: DistTensor) -> Cuts:
        """The token cuts over ``axis`` of a sequence-parallel DistTensor (dim 1)."""
        return t.layout.dim_cuts[1] if t.split[1] == self.axis else (0, t.global_shape[1])

    def agree(
        self, query: Any, key: Any, value: Any, attn_mask: Any = None, key_padding_mask: Any = None,
        is_causal: Any = False, need_weights: Any = False,
    ) -> tuple[Cuts, Cuts] | None:  # fmt: skip
        """Collective over the ranks of ``axis`` (over grid with ``schedule``). Validate the arguments on every rank.

        Without sequence parallelism the verdict is cached per input signature (messages only
        the first time). With it, one small ``Allgather`` per call also collects the token
        counts of torch.Tensor inputs; DistTensor inputs carry them in their layout, so their
        verdict is cached per layout too (no message after the first call). The layout is
        the same on every rank, so the ranks find it in the cache, or miss it, together.

        Parameters
        ----------
        query, key, value : torch.Tensor or DistTensor
            As for :meth:`forward` (all of one kind).
        attn_mask, key_padding_mask, is_causal, need_weights
            As for :meth:`forward`.

        Returns
        -------
        (query cuts, key cuts) or None
            The token cuts over the axis with sequence parallelism, else None.

        Raises
        ------
        TypeError, ValueError
            On invalid arguments (on every rank of the axis, or of the grid with ``schedule``).
        """
        what = "MultiheadAttention"
        dist = any(isinstance(t, DistTensor) for t in (query, key, value))
        if self.schedule is not None or dist:
            comm = self.grid.comm if self.schedule is not None else self.grid.sub(self.axis)
            if dist:
                error, signature = self._check_dist(
                    (query, key, value), attn_mask, key_padding_mask, is_causal, need_weights
                )
            else:
                error, signature = (
                    TypeError(
                        f"{what}: schedule={self.schedule!r} needs hpctp.DistTensor inputs [batch, *tokens, embed] "
                        f"(their layout says how the tokens are split); got {type(query).__name__}"
                    ),
                    (),
                )
            self._agreed.check(comm, what, ("invalid",) if error else signature, error)
            if not self.sequence_parallel:
                return None
            return self._layout_cuts(query), self._layout_cuts(key)
        comm = self.grid.sub(self.axis)
        error, signature = self._check((query, key, value), attn_mask, key_padding_mask, is_causal, need_weights)
        if not self.sequence_parallel:
            self._agreed.check(comm, "MultiheadAttention", ("invalid",) if error else signature, error)
            self._check_masks(query.shape[0], query.shape[1], key.shape[1], attn_mask, key_padding_mask)
            return None
        counts = (0, 0) if error else (query.shape[1], key.shape[1])
        qc, kc = agree_token_cuts(comm, counts, "MultiheadAttention", ("invalid",) if error else signature, error)
        self._check_masks(query.shape[0], qc[-1], kc[-1], attn_mask, key_padding_mask)
        return qc, kc

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None, is_causal: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Local. This rank's heads on whole inputs, inside the tensor-parallel region.

        Returns
        -------
        torch.Tensor
            The partial output ``[batch, L, E]`` of this rank's heads (out-projection without
            bias), to be summed over ``axis``.
        """
        b, lq, e = query.shape
        lk = key.shape[1]
        hl = self.heads[1] - self.heads[0]
        d = self.head_dim
        w, bias = self.in_proj_weight, self.in_proj_bias
        if query is key and key is value:
            qkv = _linear(query, w.reshape(3 * hl * d, e), None if bias is None else bias.reshape(-1))
            q, k, v = qkv.reshape(b, lq, 3, hl, d).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = (
                _linear(t, w[i], None if bias is None else bias[i]).reshape(b, t.shape[1], hl, d).transpose(1, 2)
                for i, t in enumerate((query, key, value))
            )
        mask, causal = attention_mask(
            b, self.heads, self.num_heads, lq, lk, q.dtype, attn_mask, key_padding_mask, is_causal
        )
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.out_proj.partial_forward(o.transpose(1, 2).reshape(b, lq, hl * d))

    def forward(
        self, query: torch.Tensor | DistTensor, key: torch.Tensor | DistTensor | None = None,
        value: torch.Tensor | DistTensor | None = None, key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False, attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
        is_causal: bool = False, *, token_cuts: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor | DistTensor, None]:  # fmt: skip
        """Collective over the ranks of ``axis`` (over grid with ``schedule``). Attention of ``query`` over ``key``/``value``.

        torch's signature. With ``schedule`` (tokens split over the other grid axes) the
        inputs are DistTensors and every rank of the grid takes part (the ring over the token
        axes, the all-reduce over ``axis``).

        Parameters
        ----------
        query : torch.Tensor or DistTensor
            ``[batch, L, E]``, the same on every rank of ``axis`` (with sequence parallelism:
            this rank's block of the ``L`` tokens). Or a DistTensor on the layer's grid, the
            embedding whole: ``[batch, L, E]`` whose tokens are whole along ``axis`` (with
            sequence parallelism: split over ``axis``, any cuts, taken from the layout); with
            ``schedule``, ``[batch, *tokens, E]`` (1 to 3 token dims) whose tokens are split
            over grid axes other than ``axis``. The batch may be split over axes other than
            ``axis`` (data parallelism).
        key, value : torch.Tensor or DistTensor, optional
            ``[batch, S, E]`` (default: ``query``, self-attention; pass the same object for
            one all-reduce backward); DistTensors when ``query`` is one (with ``schedule``:
            the query's token dims and split).
        key_padding_mask : torch.Tensor, optional
            ``[batch, S]`` (all ``S`` tokens; for a DistTensor query, this rank's samples): bool
            True where a key is ignored, or float added. Not with ``schedule``.
        need_weights : bool
            Must be False (torch's default is True: pass it explicitly where porting).
        attn_mask : torch.Tensor, optional
            ``[L, S]`` or ``[batch * num_heads, L, S]`` (for a DistTensor query, this rank's
            samples), bool (True: not allowed) or float (added). Not with ``schedule``.
        average_attn_weights : bool
            Ignored (no weights are returned).
        is_causal : bool
            Causal attention (``attn_mask``, if given, is taken to be the causal mask, as torch).
            With ``schedule``: one token dim only (``causal=`` of
            :func:`hpctp.nn.functional.attention`).
        token_cuts : pair of sequences of int, optional
            With sequence parallelism, the query's and key's token cuts over ``axis`` when the
            caller already agreed on them (:meth:`agree`); skips the exchange. Ignored for
            DistTensor inputs (their layout has them).

        Returns
        -------
        (torch.Tensor or DistTensor, None)
            The output ``[batch, L, E]`` (replicated along ``axis``; with sequence
            parallelism this rank's block of the tokens), a DistTensor of the query's layout
            for a DistTensor query, and no attention weights.

        Raises
        ------
        TypeError, ValueError
            On invalid arguments, on every rank of ``axis`` (of the grid with ``schedule``):
            e.g. a DistTensor on another grid, its embedding split, its tokens split over
            ``axis`` without ``sequence_parallel`` or over other axes without ``schedule``.
        """
        key = query if key is None else key
        value = key if value is None else value
        cuts: Sequence[Sequence[int]] | None = token_cuts
        if cuts is None or not self.sequence_parallel or isinstance(query, DistTensor):
            cuts = self.agree(query, key, value, attn_mask, key_padding_mask, is_causal, need_weights)
        return self.forward_agreed(query, key, value, attn_mask, key_padding_mask, is_causal, cuts)

    def forward_agreed(
        self, query: torch.Tensor | DistTensor, key: torch.Tensor | DistTensor, value: torch.Tensor | DistTensor,
        attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, is_causal: bool,
        cuts: Sequence[Sequence[int]] | None,
    ) -> tuple[torch.Tensor | DistTensor, None]:  # fmt: skip
        """Collective over the ranks of ``axis`` (over grid with ``schedule``). :meth:`forward` on arguments
        :meth:`agree` accepted and returned ``cuts`` for, without validating them again.

        A caller that validated its own input (e.g. :class:`~hpctp.nn.TransformerBlock`, before its
        norm) skips the second check of every call.

        Parameters
        ----------
        query, key, value : torch.Tensor or DistTensor
            As for :meth:`forward` (``key`` and ``value`` given: pass ``query`` itself for self-attention).
        attn_mask, key_padding_mask, is_causal
            As for :meth:`forward`.
        cuts : pair of sequences of int, or None
            What :meth:`agree` returned for these arguments.

        Returns
        -------
        (torch.Tensor or DistTensor, None)
            As :meth:`forward`.
        """
        if isinstance(query, DistTensor) and isinstance(key, DistTensor) and isinstance(value, DistTensor):
            if self.schedule is not None:
                return query.with_local(self._context_forward(query, key, value, is_causal)), None
            ql = query.local
            kl = ql if key is query else key.local
            vl = kl if value is key else value.local
            return query.with_local(self._region(ql, kl, vl, attn_mask, key_padding_mask, is_causal, cuts)), None
        if isinstance(query, DistTensor) or isinstance(key, DistTensor) or isinstance(value, DistTensor):
            raise TypeError("MultiheadAttention: mixed DistTensor and torch.Tensor inputs")  # (agree raised already)
        return self._region(query, key, value, attn_mask, key_padding_mask, is_causal, cuts), None

    def _region(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None, is_causal: bool, cuts: Sequence[Sequence[int]] | None,
    ) -> torch.Tensor:  # fmt: skip
        """Collective over the ranks of ``axis``. The tensor-parallel region on this rank's agreed blocks."""
        comm = self.grid.sub(self.axis)
        qc, kc = (None, None) if cuts is None else (tuple(cuts[0]), tuple(cuts[1]))
        q = enter_parallel_region(autocast_input(query), comm, qc)  # (autocast: tokens travel in its dtype)
        k = q if key is query else enter_parallel_region(autocast_input(key), comm, kc)
        v = k if value is key else enter_parallel_region(autocast_input(value), comm, kc)
        y = leave_parallel_region(self.attend(q, k, v, attn_mask, key_padding_mask, is_causal), comm, qc)
        if self.out_proj.bias is not None:
            y = y + self.out_proj.bias.to(y.dtype)
        return y

    def _head_layout(self, x: DistTensor) -> Layout:
        """Local. The layout of this layer's q, k or v ``[batch, heads, *tokens, head_dim]`` of input ``x``:
        the heads split over ``axis`` in whole-head cuts, batch and tokens as ``x``'s."""
        lay = x.layout
        split: list[int | None] = []
        cuts: list[tuple[int, ...] | None] = []
        for d in range(x.ndim - 1):  # (a token dim split over axis is gathered before: whole here)
            g = lay.split[d] if self._divided(lay.split[d]) and lay.split[d] != self.axis else None
            split.append(g)
            cuts.append(None if g is None else lay.dim_cuts[d])
        heads = self.axis if self._divided(self.axis) else None
        split.insert(1, heads)
        cuts.insert(1, None if heads is None else self.head_cuts)
        shape = (x.global_shape[0], self.num_heads, *x.global_shape[1:-1], self.head_dim)
        return Layout(shape, self.grid.dims, (*split, None), (*cuts, None))

    def _sequence_dim(self, x: DistTensor) -> int | None:
        """Local. With sequence parallelism, the token dim of ``x`` split over ``axis`` (when it divides), else None."""
        if not self.sequence_parallel or not self._divided(self.axis):
            return None
        return next((d for d in range(1, x.ndim - 1) if x.split[d] == self.axis), None)

    def _context_forward(self, query: DistTensor, key: DistTensor, value: DistTensor, is_causal: bool) -> torch.Tensor:
        """Collective over grid. This rank's output block with the tokens split over the other grid axes."""
        comm = self.grid.sub(self.axis)
        hl, d, e = self.heads[1] - self.heads[0], self.head_dim, self.embed_dim
        w, bias = self.in_proj_weight, self.in_proj_bias
        entered: dict[int, torch.Tensor] = {}  # each distinct input enters once (one all-reduce backward each)
        sp = self._sequence_dim(query)  # the token dim split over axis (sequence parallelism), if any
        token_dim = 1 if sp is None else sp

        def enter(t: DistTensor) -> torch.Tensor:
            if id(t) not in entered:
                cuts = None if sp is None else t.layout.dim_cuts[sp]
                entered[id(t)] = enter_parallel_region(autocast_input(t.local), comm, cuts, dim=token_dim)
            return entered[id(t)]

        def heads_first(t: torch.Tensor) -> torch.Tensor:  # [b, *tokens, hl * d] -> [b, hl, *tokens, d]
            return t.unflatten(-1, (hl, d)).movedim(-2, 1).contiguous()

        if key is query and value is query:
            qkv = _linear(enter(query), w.reshape(3 * hl * d, e), None if bias is None else bias.reshape(-1))
            parts = [heads_first(p) for p in qkv.unflatten(-1, (3, hl * d)).unbind(-2)]
        else:
            parts = [
                heads_first(_linear(enter(t), w[i], None if bias is None else bias[i]))
                for i, t in enumerate((query, key, value))
            ]
        dq, dk, dv = (DistTensor(p, self.grid, self._head_layout(t)) for p, t in zip(parts, (query, key, value)))
        o = context_attention(dq, dk, dv, causal=is_causal, schedule=str(self.schedule)).local
        o = o.movedim(1, -2).flatten(-2)  # [b, *tokens, hl * d]
        out_cuts = None if sp is None else query.layout.dim_cuts[sp]  # (sp: this rank's token block of the sum)
        y = leave_parallel_region(self.out_proj.partial_forward(o), comm, out_cuts, dim=token_dim)
        if self.out_proj.bias is not None:
            y = y + self.out_proj.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, heads={self.heads}, grid={self.grid.dims}, "
            f"axis={self.axis}, sequence_parallel={self.sequence_parallel}, schedule={self.schedule!r}"
        )
