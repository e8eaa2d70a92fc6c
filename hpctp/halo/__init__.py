"""Halo exchange and range fetches of block-distributed fields (PETSc DMDA style).

``plan`` is pure math (no MPI); ``run`` executes plans with non-blocking point-to-point
messages through :mod:`hpctp.comm`; :class:`HaloExchange` is the user-facing object.
"""

from ..tensor.infer import infer_layout
from .exchange import HaloExchange
from .plan import (
    BOUNDARIES,
    FetchPlan,
    Message,
    Piece,
    Segment,
    dim_segments,
    fetch_plan,
    halo_wants,
    normalize_boundary,
    normalize_widths,
    source_index,
)
from .run import FetchHandle, adjoint_fetch, begin_fetch, end_fetch, fetch

__all__ = [
    "BOUNDARIES",
    "FetchHandle",
    "FetchPlan",
    "HaloExchange",
    "Message",
    "Piece",
    "Segment",
    "adjoint_fetch",
    "begin_fetch",
    "dim_segments",
    "end_fetch",
    "fetch",
    "fetch_plan",
    "halo_wants",
    "infer_layout",
    "normalize_boundary",
    "normalize_widths",
    "source_index",
]
