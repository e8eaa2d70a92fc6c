"""Pure layout math of joining tensors along a dim (``concatenate``, ``stack``). No MPI here."""

from __future__ import annotations

from collections.abc import Sequence

from .layout import Layout

__all__ = ["join_layouts"]


def _check_joinable(layouts: Sequence[Layout], axis: int) -> None:
    """Raise ValueError unless every layout has the first one's dims, grid, split and shape
    (except along ``axis``)."""
    first = layouts[0]
    for i, lay in enumerate(layouts[1:], 1):
        if lay.ndim != first.ndim:
            raise ValueError(
                f"all the input tensors must have the same number of dimensions, but the tensor at index 0 has "
                f"{first.ndim} dimension(s) and the tensor at index {i} has {lay.ndim} dimension(s)"
            )
        for d, (a, b) in enumerate(zip(first.global_shape, lay.global_shape)):
            if d != axis and a != b:
                raise ValueError(
                    f"all the input tensor dimensions except for the concatenation axis ({axis}) must match exactly, "
                    f"but along dimension {d}, the tensor at index 0 has size {a} and the tensor at index {i} has "
                    f"size {b}"
                )
        if lay.grid_dims != first.grid_dims:
            raise ValueError(
                f"the tensor at index {i} is on a grid of dims {lay.grid_dims}, the tensor at index 0 on "
                f"{first.grid_dims}; put them on one ProcessGrid"
            )
        if lay.split != first.split:
            raise ValueError(
                f"the tensor at index {i} has split={lay.split} but the tensor at index 0 has split={first.split}; "
                f"call tensors[{i}].redistribute(tensors[0].split) first"
            )


def join_layouts(layouts: Sequence[Layout], axis: int) -> tuple[Layout, tuple[Layout, ...]]:
    """Local. The layout of the concatenation of tensors in ``layouts`` along ``axis``, and
    the layout each input moves into so that every block of the result is its pieces joined.

    The result has the first layout's split and cuts, except along ``axis``: balanced cuts of
    the total length when that dim is divided, else whole. Input ``i``, at offset ``off`` of
    length ``n`` along ``axis``, goes to the result's cuts clipped to its range
    (``clip(cuts - off, 0, n)``; the other dims: the result's cuts), so the block of the
    result at any grid position is the inputs' blocks there joined along ``axis``.

    Parameters
    ----------
    layouts : sequence of Layout
        At least one; of the same number of dims, grid, split and shape except along ``axis``.
    axis : int
        A non-negative dim, ``0 <= axis < ndim``.

    Returns
    -------
    result : Layout
    targets : tuple of Layout
        One per input, of that input's global shape (equal to its layout when it need not move).

    Raises
    ------
    ValueError
        If the layouts are empty, 0-d, differ in dims, grid, split or shape off ``axis``, or
        ``axis`` is out of range.
    """
    if not layouts:
        raise ValueError("need at least one layout to join")
    first = layouts[0]
    if not 0 <= axis < first.ndim:
        raise ValueError(f"axis {axis} is out of range for {first.ndim}-D layouts")
    _check_joinable(layouts, axis)
    total = sum(lay.global_shape[axis] for lay in layouts)
    shape = first.global_shape[:axis] + (total,) + first.global_shape[axis + 1 :]
    result = Layout(shape, first.grid_dims, first.split, first.cuts[:axis] + (None,) + first.cuts[axis + 1 :])
    cuts = result.dim_cuts
    targets = []
    offset = 0
    for lay in layouts:
        n = lay.global_shape[axis]
        along = tuple(min(max(c - offset, 0), n) for c in cuts[axis])
        targets.append(
            Layout(lay.global_shape, result.grid_dims, result.split, cuts[:axis] + (along,) + cuts[axis + 1 :])
        )
        offset += n
    return result, tuple(targets)
