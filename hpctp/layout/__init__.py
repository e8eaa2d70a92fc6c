"""Pure block math: how global tensors map onto process grids. No MPI here."""

from .blocks import block_cuts, block_range, block_sizes, check_cuts, owner_of
from .flat import FlatPacking, FlatPiece, flat_range_boxes
from .groups import GroupPiece, GroupTransferPlan, group_transfer_plan
from .layout import Layout, grid_coords, grid_rank, normalize_split
from .plan import (
    Piece,
    RedistributionPlan,
    Remap,
    check_remap,
    flip_remap,
    intersect,
    inverse_remap,
    moves_data,
    redistribution_plan,
)
from .tiling import tiled_layout

__all__ = [
    "FlatPacking",
    "FlatPiece",
    "GroupPiece",
    "GroupTransferPlan",
    "Layout",
    "Piece",
    "RedistributionPlan",
    "Remap",
    "block_cuts",
    "block_range",
    "block_sizes",
    "check_cuts",
    "check_remap",
    "flat_range_boxes",
    "flip_remap",
    "grid_coords",
    "grid_rank",
    "group_transfer_plan",
    "intersect",
    "inverse_remap",
    "moves_data",
    "normalize_split",
    "owner_of",
    "redistribution_plan",
    "tiled_layout",
]
