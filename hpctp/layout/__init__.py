"""Pure block math: how global tensors map onto process grids. No MPI here."""

from .blocks import block_cuts, block_range, block_sizes, check_cuts, owner_of
from .layout import Layout, grid_coords, grid_rank, normalize_split
from .plan import Piece, RedistributionPlan, intersect, redistribution_plan
from .tiling import tiled_layout

__all__ = [
    "Layout",
    "Piece",
    "RedistributionPlan",
    "block_cuts",
    "block_range",
    "block_sizes",
    "check_cuts",
    "grid_coords",
    "grid_rank",
    "intersect",
    "normalize_split",
    "owner_of",
    "redistribution_plan",
    "tiled_layout",
]
