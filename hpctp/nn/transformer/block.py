"""A pre-norm transformer block with tensor parallelism over one grid axis, optionally sequence-parallel.

``x = x + dropout(attention(norm1(x)))``, then ``x = x + dropout(mlp(norm2(x)))``: torch's
``TransformerEncoderLayer(norm_first=True, batch_first=True)``. The attention (split over
heads, :class:`~hpctp.nn.MultiheadAttention`) and the MLP (:class:`~hpctp.nn.ParallelMLP`)
are the tensor-parallel regions; the norms, dropout and residual additions lie between them.

Without sequence parallelism the ranks of ``axis`` all hold the whole ``[batch, tokens,
embed]`` activations between the regions; each region ends with one all-reduce forward and
starts with one backward. With ``sequence_parallel=True`` they hold only their block of the
tokens (dim 1, any cuts): entering a region all-gathers the tokens, leaving it
reduce-scatters them, which moves the bytes of a bandwidth-optimal all-reduce while the
norms, dropout and residuals keep ``1/P`` of the activations. The token cuts and the
arguments are agreed in one small ``Allgather`` per block call for torch.Tensor inputs; a
:class:`hpctp.DistTensor` input carries its cuts in its layout, which is checked once per
layout (the verdict cached): no message per call beyond the data.

The input may be a DistTensor ``[batch, tokens, embed]`` (embedding whole; the batch may be
split over grid axes other than ``axis``): the tokens whole along ``axis``, or split over it
with sequence parallelism; the output is a DistTensor of the same layout. With
``attention="ring"`` (or ``"all_to_all"``, ``"auto"``: the schedule of
:func:`hpctp.nn.functional.attention`) the input is a DistTensor ``[batch, *tokens, embed]``
with 1 to 3 token dims (a sequence, or the patch grid of a 2-D/3-D field) split over grid
axes *other than* ``axis``: the heads stay split over ``axis`` (column-parallel q, k, v by
whole heads), each rank's heads attend over all the tokens of the grid (K/V blocks travel a
ring over the token axes, or move all-to-all), the output projection is row-parallel (one
all-reduce over ``axis``), and the norms, residuals and the MLP are per token (local, the
MLP's one all-reduce over ``axis``). With sequence parallelism as well, one token dim is also
split over ``axis`` between the regions: each region gathers it over ``axis`` on entering and
reduce-scatters its output (the MLP, per token, on the flattened token blocks).

Gradients: every parameter's gradient is complete along ``axis`` after backward and marked
``hpctp_grad_reduced``, except, with sequence parallelism, those of the norms and of the
two output biases (each rank saw only its tokens): one
``hpctp.nn.sync_gradients(block, grid)`` sums them over ``axis``, and everything over
data-parallel axes (and, with ``attention="ring"``, over the token axes: every gradient is
partial there, and the same call sums it).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._util.ints import is_int
from ...comm import ProcessGrid, check_grid
from ...layout import Layout
from ...tensor.core import DistTensor
from ..init import derive_seed
from .attention import MultiheadAttention
from .layer_norm import LayerNorm, RMSNorm
from .mlp import ParallelMLP

__all__ = ["TransformerBlock", "ATTENTION_KINDS", "NORMS"]

#: Attention kinds a :class:`TransformerBlock` can hold: ``"heads"`` (each rank attends over all the
#: tokens it holds; :class:`~hpctp.nn.MultiheadAttention` split over heads), and ``"ring"``,
#: ``"all_to_all"``, ``"auto"``: the same heads split, attending over tokens split across the
#: other grid axes with that schedule of :func:`hpctp.nn.functional.attention` (DistTensor inputs).
#: Another kind plugs in through :func:`_attention_layer`: a module with an ``agree(h, h, h, attn_mask,
#: key_padding_mask, is_causal)`` returning the token cuts and a ``forward_agreed(h, h, h, attn_mask,
#: key_padding_mask, is_causal, cuts) -> (y, None)`` with ``h`` and ``y`` in the block's token layout
#: (torch.Tensor blocks, or DistTensors in, DistTensors out).
ATTENTION_KINDS = ("heads", "ring", "all_to_all", "auto")

NORMS: dict[str, type[LayerNorm] | type[RMSNorm]] = {"layer": LayerNorm, "rms": RMSNorm}

# torch.nn.TransformerEncoderLayer's names of the MLP's linears, and this block's
_TORCH_NAMES = (("linear1.", "mlp.linear1."), ("linear2.", "mlp.linear2."))


def _attention_layer(kind: str, embed_dim: int, num_heads: int, grid: ProcessGrid, **kwargs: Any) -> MultiheadAttention:
    """Local. The block's attention module of ``kind`` (see :data:`ATTENTION_KINDS`)."""
    if kind == "heads":
        return MultiheadAttention(embed_dim, num_heads, grid, **kwargs)
    if kind in ATTENTION_KINDS:
        return MultiheadAttention(embed_dim, num_heads, grid, schedule=kind, **kwargs)
    raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {kind!r}")


@functools.lru_cache(maxsize=256)
def _flat_token_cuts(layout: Layout, coords: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """Local. Cuts over grid ``axis`` of the flattened token blocks (dims ``1..-2``) that ``layout``'s ranks along
    ``axis`` at ``coords``' other coordinates hold, in rank order: ``(0, n_0, n_0 + n_1, ...)``."""
    counts = []
    at = list(coords)
    for c in range(layout.grid_dims[axis]):
        at[axis] = c
        counts.append(math.prod(layout.local_shape(at)[1:-1]))
    return tuple(int(v) for v in itertools.accumulate(counts, initial=0))


def _block(t: torch.Tensor | DistTensor) -> torch.Tensor:
    """Local. This rank's block of a sublayer's output (a DistTensor's, or the tensor itself)."""
    return t.local if isinstance(t, DistTensor) else t


def _renamed(state: dict[str, Any], prefixes: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Local. ``state`` with each key's leading ``old`` replaced by ``new``, for every ``(old, new)`` in turn."""
    out = {}
    for k, v in state.items():
        for old, new in prefixes:
            if k.startswith(old):
                k = new + k[len(old) :]
        out[k] = v
    return out


class TransformerBlock(torch.nn.Module):
    """Local. A pre-norm transformer block, tensor-parallel over grid ``axis`` (see the module docstring).

    Gathered (:func:`hpctp.nn.global_state_dict`), its state is that of
    ``torch.nn.TransformerEncoderLayer(embed_dim, num_heads, int(mlp_ratio * embed_dim),
    dropout, activation, layer_norm_eps=eps, batch_first=True, norm_first=True, bias=bias)``
    (``norm="layer"``): ``self_attn.*``, ``linear1.*``, ``linear2.*``, ``norm1.*``, ``norm2.*``.

    Parameters
    ----------
    embed_dim : int
    num_heads : int
        Divides ``embed_dim``; split over the ranks of ``axis`` (unevenly if need be).
    mlp_ratio : float
        Hidden features of the MLP: ``int(mlp_ratio * embed_dim)``.
    grid : ProcessGrid
    axis : int
        The tensor-parallel grid axis; ranks along other axes hold other data (data parallelism)
        or, with ``attention="ring"``, other tokens.
    sequence_parallel : bool
        Inputs and outputs are this rank's block of the tokens (dim 1; for a DistTensor with
        ``attention="ring"``, any one token dim), split over ``axis``.
    attention : {"heads", "ring", "all_to_all", "auto"}
        ``"heads"``: :class:`~hpctp.nn.MultiheadAttention` split over heads, every rank
        attending over the tokens it holds (whole, or gathered with sequence parallelism).
        ``"ring"``, ``"all_to_all"``, ``"auto"``: the same split of the heads over ``axis``,
        attending over DistTensor inputs whose tokens are split over the other grid axes with
        that schedule of :func:`hpctp.nn.functional.attention` (``"auto"``: the one
        :mod:`hpctp.perf` predicts faster); with ``sequence_parallel`` one token dim is also
        split over ``axis`` (gathered on entering each region, reduce-scattered on leaving).
    norm : {"layer", "rms"}
        :class:`~hpctp.nn.LayerNorm` or :class:`~hpctp.nn.RMSNorm` over the (whole) embedding.
    activation : str or callable
        The MLP's activation (see :class:`~hpctp.nn.ParallelMLP`).
    dropout : float
        Dropout probability of the two residual branches in training (torch's ``dropout1`` and
        ``dropout2``; the MLP's hidden units and the attention weights are not dropped). Without
        sequence parallelism the ranks of ``axis`` draw the same masks, so replicas stay equal.
    bias : bool
        Biases of the projections and of the norms.
    eps : float
        The norms' epsilon.
    seed : int
        Grid-independent initial values.
    dtype : torch.dtype
    device : torch.device or str, optional

    Raises
    ------
    TypeError
        If ``grid`` is not a ProcessGrid.
    ValueError
        On invalid sizes, ``axis``, ``attention``, ``norm``, ``activation`` or ``dropout``.
    """

    hpctp_generators = ("_generator",)  # the dropout masks' generator, replayed by hpctp.nn.checkpoint

    def __init__(
        self, embed_dim: int, num_heads: int, mlp_ratio: float, grid: ProcessGrid, *, axis: int = 0,
        sequence_parallel: bool = False, attention: str = "heads", norm: str = "layer",
        activation: str | Callable[[torch.Tensor], torch.Tensor] = "gelu", dropout: float = 0.0,
        bias: bool = True, eps: float = 1e-5, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.grid = check_grid(grid)
        if not is_int(embed_dim) or embed_dim < 1:
            raise ValueError(f"embed_dim must be a positive int, got {embed_dim!r}")
        if not isinstance(mlp_ratio, (int, float)) or int(mlp_ratio * embed_dim) < 1:
            raise ValueError(f"mlp_ratio={mlp_ratio!r} leaves the MLP no hidden feature (embed_dim={embed_dim})")
        if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {sorted(NORMS)}, got {norm!r}")
        self.sequence_parallel = bool(sequence_parallel)
        self.dropout = float(dropout)
        self.attention = attention
        kw: dict[str, Any] = {"axis": axis, "bias": bias, "sequence_parallel": sequence_parallel}
        kw.update(dtype=dtype, device=device)
        self.self_attn = _attention_layer(attention, embed_dim, num_heads, grid, seed=derive_seed(seed, 1), **kw)
        self.axis = self.self_attn.axis
        hidden = int(mlp_ratio * embed_dim)
        self.mlp = ParallelMLP(embed_dim, hidden, grid, activation=activation, seed=derive_seed(seed, 2), **kw)
        norm_kw: dict[str, Any] = {"eps": eps, "dtype": dtype, "device": device}
        if norm == "layer":
            norm_kw["bias"] = bias
        self.norm1 = NORMS[norm](embed_dim, grid, **norm_kw)
        self.norm2 = NORMS[norm](embed_dim, grid, **norm_kw)
        if not self.sequence_parallel:  # whole tokens on every rank of axis: the norms' gradients are complete
            for p in list(self.norm1.parameters()) + list(self.norm2.parameters()):
                p.hpctp_grad_reduced = (self.axis,)  # type: ignore[attr-defined]
        coords = list(grid.coords)
        if not self.sequence_parallel:
            coords[self.axis] = 0  # the ranks of axis draw the same dropout masks
        self._dropout_seed = derive_seed(derive_seed(seed, 3), grid.rank_of(tuple(coords)))
        self._generator: torch.Generator | None = None

    # ------------------------------------------------------------------ global state (torch's names)
    def hpctp_export_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Local. Gathered state under ``torch.nn.TransformerEncoderLayer``'s names (``mlp.linear1.`` -> ``linear1.``).

        Parameters
        ----------
        state : dict
            This module's gathered state (keys relative to the module).

        Returns
        -------
        dict
        """
        return _renamed(state, [(ours, torch_name) for torch_name, ours in _TORCH_NAMES])

    def hpctp_import_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Local. ``torch.nn.TransformerEncoderLayer``'s names to this block's (``linear1.`` -> ``mlp.linear1.``).

        Parameters
        ----------
        state : dict
            torch's state for this module (keys relative to the module).

        Returns
        -------
        dict
        """
        return _renamed(state, _TORCH_NAMES)

    # ------------------------------------------------------------------ forward
    def _drop(self, y: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0.0:
            return y
        if self._generator is None or self._generator.device != y.device:
            self._generator = torch.Generator(device=y.device).manual_seed(self._dropout_seed)
        keep = torch.rand(y.shape, generator=self._generator, device=y.device, dtype=y.dtype) >= self.dropout
        return y * keep / (1.0 - self.dropout)

    def forward(
        self, x: torch.Tensor | DistTensor, *, attn_mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None, is_causal: bool = False,
    ) -> torch.Tensor | DistTensor:  # fmt: skip
        """Collective over the ranks of ``axis`` (over grid with ``attention="ring"``). One block.

        Parameters
        ----------
        x : torch.Tensor or DistTensor
            ``[batch, tokens, embed]``, the same on every rank of ``axis`` (with sequence
            parallelism: this rank's block of the tokens). Or a DistTensor on the block's grid,
            the embedding whole, the batch whole or split over axes other than ``axis``:
            ``[batch, tokens, embed]`` with the tokens whole along ``axis`` (with sequence
            parallelism: split over ``axis``, any cuts); with ``attention="ring"`` (or
            ``"all_to_all"``, ``"auto"``) ``[batch, *tokens, embed]``, 1 to 3 token dims split
            over grid axes other than ``axis`` (or whole).
        attn_mask, key_padding_mask, is_causal
            As for :class:`~hpctp.nn.MultiheadAttention` (over all the tokens). With
            ``attention="ring"``: no masks, ``is_causal`` for one token dim only.

        Returns
        -------
        torch.Tensor or DistTensor
            Same shape and layout as ``x`` (a DistTensor of ``x``'s layout for a DistTensor).

        Raises
        ------
        TypeError, ValueError
            On invalid arguments, on every rank of ``axis`` (of the grid with
            ``attention="ring"``), before any data moves: e.g. a DistTensor on another grid,
            its embedding split, its tokens split over ``axis`` without ``sequence_parallel``,
            or over other axes without ``attention="ring"``; a torch.Tensor with ``"ring"``.
        """
        # before the norm, which checks only locally: an input wrong on one rank raises on all of the axis
        # (without sequence parallelism, or for a DistTensor, the verdict is cached); the sublayers then run
        # on these agreed arguments without checking them again
        cuts = self.self_attn.agree(x, x, x, attn_mask, key_padding_mask, is_causal)
        if isinstance(x, DistTensor):
            hd = x.with_local(self.norm1(x.local))
            ad, _ = self.self_attn.forward_agreed(hd, hd, hd, attn_mask, key_padding_mask, is_causal, cuts)
            y = x.local + self._drop(_block(ad))
            z = self.norm2(y)
            if self.sequence_parallel:  # per token: the flattened token blocks of the ranks of axis
                flat = _flat_token_cuts(x.layout, self.grid.coords, self.axis)
                md = self.mlp.forward_agreed(z.flatten(1, -2), flat).reshape(z.shape)
            else:
                md = self.mlp.forward_agreed(z, None)
            return x.with_local(y + self._drop(md))
        h = self.norm1(x)
        a, _ = self.self_attn.forward_agreed(h, h, h, attn_mask, key_padding_mask, is_causal, cuts)
        x = x + self._drop(_block(a))
        m = self.mlp.forward_agreed(self.norm2(x), None if cuts is None else tuple(cuts[0]))
        return x + self._drop(m)

    def extra_repr(self) -> str:
        return (
            f"grid={self.grid.dims}, axis={self.axis}, sequence_parallel={self.sequence_parallel}, "
            f"attention={self.attention!r}, dropout={self.dropout}"
        )
