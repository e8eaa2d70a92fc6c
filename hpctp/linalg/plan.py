"""SUMMA planning: which algorithm variant, which panels, which roots. Pure math, no MPI.

Notation: ``C (m x n) = op(A) (m x k) @ op(B) (k x n)`` on a 2-D grid, where ``op(X)`` is
``X`` or ``X.T``. Every operand is cut over both grid axes (split ``(0, 1)`` or ``(1, 0)``).
Each of the indices m, k, n appears in two of the three matrices; the variant is the
one whose two *aligned* indices (same grid axis in both matrices holding them) let one
matrix stay where it is (van de Geijn and Watts, SUMMA, 1997):

====================  =========================  ===========================================
variant               stays                      per panel of the walked index
====================  =========================  ===========================================
``stationary_c``      C (walk k)                 broadcast A's column panel along its grid
                                                 row, B's row panel along its grid column
``stationary_a``      A (walk n)                 broadcast op(B)'s column panel, reduce the
                                                 partial C columns onto their owners
``stationary_b``      B (walk m)                 broadcast op(A)'s row panel, reduce the
                                                 partial C rows onto their owners
====================  =========================  ===========================================

C is always split ``(0, 1)``. With both inputs split ``(0, 1)``: ``A @ B`` is
stationary-C, ``A @ B.T`` stationary-A, ``A.T @ B`` stationary-B; ``A.T @ B.T`` (and any
pair of layouts for which no variant fits) needs one input redistributed first, see
:func:`required_layouts`.

Panels walk the union of the two cut sets of the walked index (so each panel lies in one
block of both matrices holding it), each piece further cut to at most ``panel`` wide.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .._util.ints import is_int
from ..layout import Layout, block_cuts

__all__ = [
    "VARIANTS",
    "Piece",
    "MatmulPlan",
    "logical_axes",
    "variant_for",
    "merge_pieces",
    "default_panel",
    "plan_matmul",
    "required_layouts",
    "check_panel",
    "plan_25d",
    "layer_plan",
]

VARIANTS = ("stationary_c", "stationary_a", "stationary_b")
DEFAULT_MAX_PANEL = 256

Piece = tuple[int, int, int, int]  # (start, stop, owner in cut set x, owner in cut set y)


def check_panel(panel: object) -> int | None:
    """Local. Validate a panel width: None or a positive int.

    Raises
    ------
    TypeError
        If ``panel`` is not None or an int.
    ValueError
        If ``panel < 1``.
    """
    if panel is None:
        return None
    if not is_int(panel):
        raise TypeError(f"panel must be None or a positive int, got {type(panel).__name__} {panel!r}")
    if panel < 1:
        raise ValueError(f"panel must be a positive int (the SUMMA panel width), got {panel}")
    return int(panel)


def logical_axes(layout: Layout, transpose: bool) -> tuple[tuple[int, tuple[int, ...]], tuple[int, tuple[int, ...]]]:
    """Local. ``((row_axis, row_cuts), (col_axis, col_cuts))`` of ``op(X)`` for a 2-D split layout.

    Raises
    ------
    ValueError
        If the layout does not cut both dims of a 2-D tensor over a 2-D grid.
    """
    if layout.ndim != 2 or len(layout.grid_dims) != 2 or sorted(s for s in layout.split if s is not None) != [0, 1]:
        raise ValueError(f"SUMMA needs a 2-D tensor split over both axes of a 2-D grid, got {layout}")
    rows = (layout.split[0], layout.dim_cuts[0])
    cols = (layout.split[1], layout.dim_cuts[1])
    return (cols, rows) if transpose else (rows, cols)  # type: ignore[return-value]


def variant_for(m_axis_a: int, n_axis_b: int) -> str | None:
    """Local. The SUMMA variant producing C split ``(0, 1)`` from the grid axes of m in op(A) and n in op(B).

    Returns
    -------
    str or None
        One of :data:`VARIANTS`, or None when no variant fits (an input must be redistributed).
    """
    return {(0, 1): "stationary_c", (0, 0): "stationary_a", (1, 1): "stationary_b"}.get((m_axis_a, n_axis_b))


def merge_pieces(cuts_x: Sequence[int], cuts_y: Sequence[int], panel: int) -> tuple[Piece, ...]:
    """Local. Non-empty pieces covering ``[0, n)`` that each lie in one block of both cut sets.

    Parameters
    ----------
    cuts_x, cuts_y : sequence of int
        Two block decompositions of the same range ``[0, n)`` (may contain empty blocks).
    panel : int
        Maximum piece width; each merged interval is cut into widths ``panel`` (last one shorter).

    Returns
    -------
    tuple of (start, stop, owner_x, owner_y)
        In increasing order; ``owner_x`` is the block of ``cuts_x`` holding the piece.

    Raises
    ------
    ValueError
        If the cut sets cover different ranges or ``panel < 1``.
    """
    if cuts_x[-1] != cuts_y[-1] or cuts_x[0] != 0 or cuts_y[0] != 0:
        raise ValueError(f"cut sets {tuple(cuts_x)} and {tuple(cuts_y)} do not cover the same range")
    if panel < 1:
        raise ValueError(f"panel must be >= 1, got {panel}")
    bounds = sorted(set(cuts_x) | set(cuts_y))
    out: list[Piece] = []
    for lo, hi in itertools.pairwise(bounds):
        ox = bisect.bisect_right(cuts_x, lo) - 1
        oy = bisect.bisect_right(cuts_y, lo) - 1
        for s in range(lo, hi, panel):
            out.append((s, min(s + panel, hi), ox, oy))
    return tuple(out)


def default_panel(cuts_x: Sequence[int], cuts_y: Sequence[int], max_panel: int = DEFAULT_MAX_PANEL) -> int:
    """Local. Default panel width from the block sizes of the walked index.

    The largest merged block, cut into equal panels of at most ``max_panel`` (so big
    blocks give several pipelined panels and small blocks are sent whole).

    Returns
    -------
    int
        At least 1.
    """
    bounds = sorted(set(cuts_x) | set(cuts_y))
    widest = max((b - a for a, b in itertools.pairwise(bounds)), default=1)
    widest = max(widest, 1)
    return math.ceil(widest / math.ceil(widest / max_panel))


@dataclass(frozen=True)
class MatmulPlan:
    """Local. Everything SUMMA needs to know, identical on every rank.

    Attributes
    ----------
    variant : str
        One of :data:`VARIANTS`.
    m, k, n : int
        Global sizes of ``op(A) (m x k) @ op(B) (k x n)``.
    c_layout : Layout
        Layout of C (split ``(0, 1)``).
    axis_x, axis_y : int
        Grid axes of the two walked cut sets: broadcasts of the first operand go along
        ``axis_x`` (its sub-communicator); the second operand's broadcasts
        (stationary-C) or C's reductions (other variants) go along ``axis_y``.
    cuts_x, cuts_y : tuple of int
        The walked index's cuts over ``axis_x`` and ``axis_y``.
    pieces : tuple of (start, stop, root_x, root_y)
        Panels in order, with the coordinates (on ``axis_x``/``axis_y``) that own them.
    panel : int
        Panel width used.
    """

    variant: str
    m: int
    k: int
    n: int
    c_layout: Layout
    axis_x: int
    axis_y: int
    cuts_x: tuple[int, ...]
    cuts_y: tuple[int, ...]
    pieces: tuple[Piece, ...]
    panel: int


def _shape_of_op(layout: Layout, transpose: bool) -> tuple[int, int]:
    r, c = layout.global_shape
    return (c, r) if transpose else (r, c)


def plan_matmul(
    a: Layout, b: Layout, transpose_a: bool = False, transpose_b: bool = False, panel: int | None = None
) -> MatmulPlan:
    """Local. Plan ``op(A) @ op(B)`` for inputs already in a layout some variant accepts.

    Parameters
    ----------
    a, b : Layout
        Layouts of the stored matrices (2-D, split over both axes of the same 2-D grid).
    transpose_a, transpose_b : bool
        Use ``A.T`` / ``B.T``.
    panel : int, optional
        Panel width (default :func:`default_panel`).

    Returns
    -------
    MatmulPlan

    Raises
    ------
    ValueError
        If the layouts are not 2-D splits of one grid, the inner sizes differ, no variant
        fits (call :func:`required_layouts` first) or the aligned k cuts differ.
    """
    if a.grid_dims != b.grid_dims:
        raise ValueError(f"A and B are on grids of dims {a.grid_dims} and {b.grid_dims}")
    (ma, mcuts), (ka, kcuts_a) = logical_axes(a, transpose_a)
    (kb, kcuts_b), (nb, ncuts) = logical_axes(b, transpose_b)
    m, k = _shape_of_op(a, transpose_a)
    k2, n = _shape_of_op(b, transpose_b)
    if k != k2:
        raise ValueError(f"inner dimensions differ: op(A) is {m} x {k}, op(B) is {k2} x {n}")
    variant = variant_for(ma, nb)
    if variant is None:
        raise ValueError(
            f"no SUMMA variant fits op(A) rows on grid axis {ma} and op(B) columns on axis {nb}; "
            f"redistribute an input first (see hpctp.linalg.plan.required_layouts)"
        )
    dims = a.grid_dims
    panel = check_panel(panel)
    if variant == "stationary_c":
        c_layout = Layout((m, n), dims, (0, 1), (mcuts, ncuts))
        ax, ay, cx, cy = ka, kb, kcuts_a, kcuts_b
    else:
        if kcuts_a != kcuts_b:
            raise ValueError(
                f"{variant} needs the same k cuts in op(A) and op(B), got {kcuts_a} and {kcuts_b}; "
                f"redistribute to balanced layouts first"
            )
        if variant == "stationary_a":  # walk n: B's n cuts (axis nb) and C's n cuts (axis 1)
            c_layout = Layout((m, n), dims, (0, 1), (mcuts, block_cuts(n, dims[1])))
            ax, ay, cx, cy = nb, 1, ncuts, c_layout.dim_cuts[1]
        else:  # stationary_b: walk m: A's m cuts (axis ma) and C's m cuts (axis 0)
            c_layout = Layout((m, n), dims, (0, 1), (block_cuts(m, dims[0]), ncuts))
            ax, ay, cx, cy = ma, 0, mcuts, c_layout.dim_cuts[0]
    width = panel if panel is not None else default_panel(cx, cy)
    pieces = merge_pieces(cx, cy, width)
    return MatmulPlan(variant, m, k, n, c_layout, ax, ay, tuple(cx), tuple(cy), pieces, width)


def _flipped(layout: Layout) -> Layout:
    return layout.with_split(tuple(reversed(layout.split)))


def required_layouts(
    a: Layout, b: Layout, transpose_a: bool = False, transpose_b: bool = False
) -> tuple[Layout, Layout]:
    """Local. The layouts to move A and B to (often their own) so that :func:`plan_matmul` applies.

    Rules, cheapest first: a layout that does not cut both dims becomes balanced ``(0, 1)``;
    if then no variant fits, the smaller of A and B is flipped to the reversed split; if
    the chosen variant needs equal k cuts and they differ, custom-cut inputs become balanced.

    Returns
    -------
    tuple of Layout
        Target layouts of A and B (equal to the input when no move is needed).
    """

    def two_d(x: Layout) -> Layout:
        if sorted(s for s in x.split if s is not None) == [0, 1]:
            return x
        return x.with_split((0, 1))

    a2, b2 = two_d(a), two_d(b)
    (ma, _), _ = logical_axes(a2, transpose_a)
    _, (nb, _) = logical_axes(b2, transpose_b)
    if variant_for(ma, nb) is None:
        if math.prod(a2.global_shape) < math.prod(b2.global_shape):
            a2 = _flipped(a2)
        else:
            b2 = _flipped(b2)
        (ma, _), _ = logical_axes(a2, transpose_a)
        _, (nb, _) = logical_axes(b2, transpose_b)
    if variant_for(ma, nb) != "stationary_c":
        _, (_, kcuts_a) = logical_axes(a2, transpose_a)
        (_, kcuts_b), _ = logical_axes(b2, transpose_b)
        if kcuts_a != kcuts_b:
            a2 = a2 if a2.is_balanced else a2.with_split(a2.split)
            b2 = b2 if b2.is_balanced else b2.with_split(b2.split)
    return a2, b2


# ---------------------------------------------------------------- 2.5D (hpctp.linalg.matmul_25d)
def _flat_2d(layout: Layout) -> Layout:
    """The layout seen by one layer: the same tensor on the first two grid axes."""
    return Layout(layout.global_shape, layout.grid_dims[:2], layout.split, layout.cuts)


def plan_25d(
    a: Layout, b: Layout, transpose_a: bool = False, transpose_b: bool = False, panel: int | None = None
) -> MatmulPlan:
    """Local. The stationary-C plan of all layers (before :func:`layer_plan` picks one layer's panels).

    Parameters
    ----------
    a, b : Layout
        Layouts on a 3-D grid ``(pr, pc, c)`` in which ``op(A)`` and ``op(B)`` are split
        ``(0, 1)`` (replicated over grid axis 2).
    transpose_a, transpose_b : bool
    panel : int, optional
        Default: :func:`~hpctp.linalg.plan.default_panel`, reduced to ``ceil(w / c)`` where
        ``w`` is the widest merged block of the contraction dim, so that block gives at least
        ``c`` panels (narrower blocks may give fewer, and some layers then idle on them).

    Returns
    -------
    MatmulPlan
        Its ``c_layout`` is on the 2-D grid ``(pr, pc)``.

    Raises
    ------
    ValueError
        If the layouts do not give the stationary-C variant.
    """
    p2 = plan_matmul(_flat_2d(a), _flat_2d(b), transpose_a, transpose_b, panel)
    if p2.variant != "stationary_c":
        raise ValueError(f"2.5D matmul needs op(A) and op(B) split (0, 1), got the {p2.variant} variant")
    if panel is None:
        c = a.grid_dims[2]
        bounds = sorted(set(p2.cuts_x) | set(p2.cuts_y))
        widest = max([hi - lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)] + [1])
        width = max(1, min(default_panel(p2.cuts_x, p2.cuts_y), math.ceil(widest / c)))
        p2 = dataclasses.replace(p2, panel=width, pieces=merge_pieces(p2.cuts_x, p2.cuts_y, width))
    return p2


def layer_plan(plan: MatmulPlan, layer: int, layers: int) -> MatmulPlan:
    """Local. The panels layer ``layer`` of ``layers`` walks: every ``layers``-th, starting at ``layer``."""
    return dataclasses.replace(plan, pieces=plan.pieces[layer::layers])
