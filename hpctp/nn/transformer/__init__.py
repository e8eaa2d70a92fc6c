"""Transformer layers split over heads, hidden units and tokens.

``linear`` (tensor-parallel linears), ``sequence_parallel`` (entering and leaving a tensor-parallel region, with
tokens whole or split), ``agreement`` (arguments agreed once per input signature), ``attention`` (multi-head
attention split by heads), ``context_parallel`` (exact attention over tokens split on the grid: a ring or
all-to-all), ``mlp``, ``layer_norm`` (norms over a split hidden dim), ``patch`` (fields to tokens and back),
``neighborhood`` (windowed attention on a token field), ``block`` (the pre-norm transformer block).
"""

# attention.py
from .attention import MultiheadAttention

# block.py
from .block import ATTENTION_KINDS, NORMS, TransformerBlock

# context_parallel.py
from .context_parallel import attention, attention_schedule

# layer_norm.py
from .layer_norm import LayerNorm, RMSNorm

# linear.py
from .linear import ColumnParallelLinear, Linear, Linear2D, RowParallelLinear

# mlp.py
from .mlp import ParallelMLP

# neighborhood.py
from .neighborhood import NeighborhoodAttention2d, NeighborhoodAttention3d

# patch.py
from .patch import (
    PatchEmbed2d,
    PatchEmbed3d,
    Unpatch2d,
    Unpatch3d,
    patch_aligned_layout,
    patched_layout,
    unpatched_layout,
)

__all__ = [
    # attention.py
    "MultiheadAttention",
    # block.py
    "ATTENTION_KINDS", "NORMS", "TransformerBlock",
    # context_parallel.py
    "attention", "attention_schedule",
    # layer_norm.py
    "LayerNorm", "RMSNorm",
    # linear.py
    "ColumnParallelLinear", "Linear", "Linear2D", "RowParallelLinear",
    # mlp.py
    "ParallelMLP",
    # neighborhood.py
    "NeighborhoodAttention2d", "NeighborhoodAttention3d",
    # patch.py
    "PatchEmbed2d", "PatchEmbed3d", "Unpatch2d", "Unpatch3d", "patch_aligned_layout", "patched_layout",
    "unpatched_layout",
]  # fmt: skip
