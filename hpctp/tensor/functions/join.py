"""Joining DistTensors along a dim: ``concatenate`` and ``stack`` (numpy semantics).

The result takes the first tensor's layout, with balanced cuts along the joined dim when it
is divided. Each input moves (one ``Alltoallv``, recorded by autograd for torch blocks that
require grad) into the layout whose blocks are its share of the result's blocks; each rank
then joins its pieces with the blocks' own ``concatenate``/``torch.cat``, which promote
dtypes as the backend does. Inputs already cut as needed (always so along an undivided
dim, hence for ``stack``) do not move.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ... import comm as C
from ..._util.backend import Array, array_module, is_torch
from ..._util.ints import is_int
from ...layout.join import join_layouts
from ...ops.move import move_block
from ...ops.reduce import ordered_axes
from ...ops.transfer import needs_grad
from ..align import check_partner
from ..core import DistTensor

__all__ = ["concatenate", "stack", "numpy_style"]


def _tensors(tensors: object, what: str) -> list[DistTensor]:
    """``tensors`` as a non-empty list of DistTensors on one grid with blocks of one backend and
    memory; raises (on every rank alike) otherwise."""
    if isinstance(tensors, DistTensor):
        raise TypeError(f"{what} takes a sequence of DistTensors, got one DistTensor; pass a list, e.g. [x, y]")
    try:
        items = list(tensors)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{what} takes a sequence of DistTensors, got {type(tensors).__name__}") from None
    if not items:
        raise ValueError(f"need at least one array to {what}: pass a non-empty list of DistTensors")
    for i, t in enumerate(items):
        if not isinstance(t, DistTensor):
            raise TypeError(
                f"{what} takes DistTensors, but the entry at index {i} is a {type(t).__name__}; "
                f"make it one with hpctp.distribute or hpctp.from_local"
            )
    for t in items[1:]:
        check_partner(items[0], t, what)
    return items


def _axis(axis: object, ndim: int, what: str) -> int:
    """``axis`` of a ``ndim``-D result as a non-negative int (negative ones count from the end)."""
    if axis is None:
        raise ValueError(
            f"{what}(axis=None) (numpy's join of the flattened arrays) is not supported: a partitioned "
            f"tensor has no flat order; give an int axis"
        )
    if not is_int(axis):
        raise TypeError(f"{what} takes an int axis, got {axis!r}")
    return ordered_axes(int(axis), ndim)[0]


def _cat(blocks: list[Array], axis: int) -> Array:
    """The blocks joined along ``axis`` by their backend (which promotes dtypes)."""
    if is_torch(blocks[0]):
        import torch  # (loaded: the blocks are torch tensors)

        return torch.cat(blocks, dim=axis)
    return array_module(blocks[0]).concatenate(blocks, axis=axis)


def _join(tensors: list[DistTensor], axis: int, what: str) -> DistTensor:
    """Checked ``tensors`` concatenated along the non-negative ``axis``."""
    result, targets = join_layouts([t.layout for t in tensors], axis)
    grid = tensors[0].grid
    grads = tuple(needs_grad(t.local) for t in tensors)
    moves = [t.layout != target for t, target in zip(tensors, targets)]
    if any(moves):  # (the backward moves must pair up: agree on requires_grad first)
        layouts = tuple(t.layout for t in tensors)
        C.agree_arguments(grid.comm, what, None, axis=axis, layouts=layouts, requires_grad=grads)
    pieces = [
        move_block(t.local, grid, t.layout, target, grad) if move else t.local
        for t, target, grad, move in zip(tensors, targets, grads, moves)
    ]
    return DistTensor(_cat(pieces, axis), grid, result)


def concatenate(tensors: Sequence[DistTensor], axis: int = 0) -> DistTensor:
    """Collective over grid when an input is divided along ``axis`` or cut differently from the
    first (off ``axis``), else Local. The tensors joined along an existing dim, as
    ``numpy.concatenate`` (also ``np.concatenate([x, y], axis)``).

    The result has the first tensor's split and cuts, except along ``axis``: balanced blocks
    of the total length where that dim is divided. Each input that must move is sent in one
    ``Alltoallv`` into its share of the result's blocks (ranks keep what they hold); then each
    rank joins its pieces locally. Differentiable for torch blocks that require grad (every
    rank must agree). The result's blocks are new memory.

    Parameters
    ----------
    tensors : sequence of DistTensor
        At least one; on one grid, of the same number of dims (at least 1), split, and shape
        except along ``axis``; blocks of one backend and memory. Dtypes are promoted as the
        backend's own concatenation promotes them.
    axis : int
        The dim to join along; negative counts from the end.

    Returns
    -------
    DistTensor

    Raises
    ------
    TypeError
        If ``tensors`` is not a sequence of DistTensors, ``axis`` not an int, or the blocks
        are of different backends or memories.
    ValueError
        If ``tensors`` is empty, a tensor is 0-d, they are on different grids, differ in dims,
        split or shape off ``axis``, ``axis`` is out of range or None, or ranks disagree.
    """
    items = _tensors(tensors, "concatenate")
    if any(t.ndim == 0 for t in items):
        raise ValueError("zero-dimensional arrays cannot be concatenated: use hpctp.stack for 0-d tensors")
    return _join(items, _axis(axis, items[0].ndim, "concatenate"), "concatenate")


def stack(tensors: Sequence[DistTensor], axis: int = 0) -> DistTensor:
    """Collective over grid when an input is cut differently from the first, else Local. The
    tensors joined along a new dim ``axis`` of the result, as ``numpy.stack`` (also
    ``np.stack([x, y], axis)``).

    The new dim is undivided and the others keep the first tensor's split and cuts, so
    tensors of one layout are stacked without messages. Differentiable for torch blocks that
    require grad. The result's blocks are new memory.

    Parameters
    ----------
    tensors : sequence of DistTensor
        At least one, of identical shapes (0-d ones too); on one grid, of one split, blocks
        of one backend and memory. Dtypes are promoted as the backend promotes them.
    axis : int
        The position of the new dim in the result (``-1``: last); negative counts from the end.

    Returns
    -------
    DistTensor
        Of shape ``shape[:axis] + (len(tensors),) + shape[axis:]``.

    Raises
    ------
    TypeError
        As :func:`concatenate`.
    ValueError
        If ``tensors`` is empty, the shapes differ, ``axis`` is out of range or None, the
        tensors are on different grids or splits, or ranks disagree.
    """
    items = _tensors(tensors, "stack")
    shapes = [t.shape for t in items]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(f"all input arrays must have the same shape to stack, got shapes {shapes}")
    axis = _axis(axis, items[0].ndim + 1, "stack")
    key = (slice(None),) * axis + (None,)  # (a new undivided dim of size 1: a local view)
    return _join([t[key] for t in items], axis, "stack")


def numpy_style(join: Callable[..., DistTensor]) -> Callable[..., DistTensor]:
    """Local. ``join`` (:func:`concatenate` or :func:`stack`) with numpy's signature, for
    ``np.concatenate`` / ``np.stack`` on DistTensors; ``out=``, ``dtype=`` and another
    ``casting=`` raise a TypeError."""

    def call(arrays: Any, axis: Any = 0, out: Any = None, *, dtype: Any = None, casting: str = "same_kind") -> Any:
        if out is not None or dtype is not None or casting != "same_kind":
            raise TypeError(
                f"numpy.{join.__name__} on DistTensors takes the tensors and axis only (no out=, dtype= or "
                f"casting=); convert the result with .astype(dtype)"
            )
        return join(arrays, axis)

    return call
