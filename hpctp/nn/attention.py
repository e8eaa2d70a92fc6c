"""Multi-head attention split over whole heads along one grid axis (Megatron's tensor parallelism).

Every rank of ``axis`` holds the inputs ``[batch, tokens, embed]`` (or, with sequence
parallelism, its block of the tokens, all-gathered on entry) and a contiguous range of
heads, ``block_cuts(num_heads, P)``, so uneven counts work (5 heads on 2 ranks: 3 and 2; a
rank may hold none). Its q, k, v projections are the rows of those heads (column-parallel),
it runs :func:`torch.nn.functional.scaled_dot_product_attention` on its heads alone, and
the output projection takes the matching columns (row-parallel): the partial outputs are
summed by one all-reduce forward (a reduce-scatter with sequence parallelism), and the
input gradient by one all-reduce backward.

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

from .._util.ints import is_int, positive_ints
from ..comm import ProcessGrid, check_grid
from ..layout import Layout, block_cuts
from .linear import RowParallelLinear, derive_seed, init_block
from .sequence_parallel import ArgumentAgreement, enter_parallel_region, leave_parallel_region
from .sequence_parallel import token_cuts as agree_token_cuts

__all__ = ["MultiheadAttention", "attention_mask"]

Cuts = tuple[int, ...]


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


class MultiheadAttention(torch.nn.Module):
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
    sums it).

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
    seed : int
    dtype : torch.dtype
    device : torch.device or str, optional

    Raises
    ------
    TypeError
        If ``grid`` is not a ProcessGrid.
    ValueError
        On non-positive sizes, ``num_heads`` not dividing ``embed_dim`` or a bad ``axis``.
    """

    in_proj_weight: torch.nn.Parameter
    in_proj_bias: torch.nn.Parameter | None

    def __init__(
        self, embed_dim: int, num_heads: int, grid: ProcessGrid, *, axis: int = 0, bias: bool = True,
        sequence_parallel: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.grid = check_grid(grid)
        positive_ints(embed_dim=embed_dim, num_heads=num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        if not is_int(axis) or not 0 <= axis < grid.ndim:
            raise ValueError(f"axis={axis!r} is not an axis of the {grid.ndim}-D grid {grid.dims}")
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
            if t.dtype != w.dtype or t.device != w.device:
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

    def agree(
        self, query: Any, key: Any, value: Any, attn_mask: Any = None, key_padding_mask: Any = None,
        is_causal: Any = False, need_weights: Any = False,
    ) -> tuple[Cuts, Cuts] | None:  # fmt: skip
        """Collective over the ranks of ``axis``. Validate the arguments on every rank of the axis.

        Without sequence parallelism the verdict is cached per input signature (messages only
        the first time). With it, one small ``Allgather`` per call also collects the token
        counts.

        Returns
        -------
        (query cuts, key cuts) or None
            The token cuts over the axis with sequence parallelism, else None.

        Raises
        ------
        TypeError, ValueError
            On invalid arguments (on every rank of the axis).
        """
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
            qkv = torch.nn.functional.linear(
                query, w.reshape(3 * hl * d, e), None if bias is None else bias.reshape(-1)
            )
            q, k, v = qkv.reshape(b, lq, 3, hl, d).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = (
                torch.nn.functional.linear(t, w[i], None if bias is None else bias[i])
                .reshape(b, t.shape[1], hl, d)
                .transpose(1, 2)
                for i, t in enumerate((query, key, value))
            )
        mask, causal = attention_mask(
            b, self.heads, self.num_heads, lq, lk, q.dtype, attn_mask, key_padding_mask, is_causal
        )
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.out_proj.partial_forward(o.transpose(1, 2).reshape(b, lq, hl * d))

    def forward(
        self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None, need_weights: bool = False,
        attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True, is_causal: bool = False,
        *, token_cuts: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, None]:  # fmt: skip
        """Collective over the ranks of ``axis``. Attention of ``query`` over ``key``/``value`` (torch's signature).

        Parameters
        ----------
        query : torch.Tensor
            ``[batch, L, E]``, the same on every rank of ``axis`` (with sequence parallelism:
            this rank's block of the ``L`` tokens).
        key, value : torch.Tensor, optional
            ``[batch, S, E]`` (default: ``query``, self-attention; pass the same object for
            one all-reduce backward).
        key_padding_mask : torch.Tensor, optional
            ``[batch, S]`` (all ``S`` tokens): bool True where a key is ignored, or float added.
        need_weights : bool
            Must be False (torch's default is True: pass it explicitly where porting).
        attn_mask : torch.Tensor, optional
            ``[L, S]`` or ``[batch * num_heads, L, S]``, bool (True: not allowed) or float (added).
        average_attn_weights : bool
            Ignored (no weights are returned).
        is_causal : bool
            Causal attention (``attn_mask``, if given, is taken to be the causal mask, as torch).
        token_cuts : pair of sequences of int, optional
            With sequence parallelism, the query's and key's token cuts over ``axis`` when the
            caller already agreed on them (:meth:`agree`); skips the exchange.

        Returns
        -------
        (torch.Tensor, None)
            The output ``[batch, L, E]`` (replicated along ``axis``; with sequence
            parallelism this rank's block of the tokens), and no attention weights.

        Raises
        ------
        TypeError, ValueError
            On invalid arguments, on every rank of ``axis``.
        """
        key = query if key is None else key
        value = key if value is None else value
        comm = self.grid.sub(self.axis)
        cuts: Sequence[Sequence[int]] | None = token_cuts
        if cuts is None or not self.sequence_parallel:
            cuts = self.agree(query, key, value, attn_mask, key_padding_mask, is_causal, need_weights)
        qc, kc = (None, None) if cuts is None else (tuple(cuts[0]), tuple(cuts[1]))
        q = enter_parallel_region(query, comm, qc)
        k = q if key is query else enter_parallel_region(key, comm, kc)
        v = k if value is key else enter_parallel_region(value, comm, kc)
        y = leave_parallel_region(self.attend(q, k, v, attn_mask, key_padding_mask, is_causal), comm, qc)
        if self.out_proj.bias is not None:
            y = y + self.out_proj.bias
        return y, None

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, heads={self.heads}, grid={self.grid.dims}, "
            f"axis={self.axis}, sequence_parallel={self.sequence_parallel}"
        )
