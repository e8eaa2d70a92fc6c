"""``broadcast_to``: a DistTensor repeated along its size-1 dims (and new leading dims), as
``numpy.broadcast_to``, materialized in blocks.

The result keeps the input's split (new leading dims are whole): dims of unchanged size keep
its cuts, broadcast dims get balanced cuts. A size-1 dim that is divided is first made whole
(the tensor is replicated along that grid axis, one move); then each rank expands its block
locally. For torch blocks the expansion is recorded by autograd: the gradient is summed over
the repeats, and over the ranks that held a replica.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..._util.backend import broadcasts_to
from ..._util.ints import is_int
from ...layout import Layout
from ..align import broadcast_operand
from ..core import DistTensor
from ..creation import empty_in

__all__ = ["broadcast_to", "broadcast_layout"]


def _shape(shape: object) -> tuple[int, ...]:
    items = (shape,) if is_int(shape) else shape
    try:
        out: tuple[object, ...] = tuple(items)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"broadcast_to: shape must be an int or a sequence of ints, got {shape!r}") from None
    if not all(is_int(n) for n in out):
        raise TypeError(f"broadcast_to: shape must hold ints, got {out!r}")
    sizes = tuple(int(n) for n in out)  # type: ignore[call-overload]
    if any(n < 0 for n in sizes):
        raise ValueError(f"broadcast_to: all elements of the shape must be non-negative, got {sizes}")
    return sizes


def broadcast_layout(layout: Layout, shape: Sequence[int]) -> Layout:
    """Local. The layout of ``layout``'s tensor broadcast to ``shape``: its split (new leading
    dims whole), its cuts where the size is unchanged, balanced cuts along broadcast dims."""
    lead = len(shape) - layout.ndim
    same = [layout.global_shape[e] == shape[e + lead] for e in range(layout.ndim)]
    return Layout(
        tuple(shape),
        layout.grid_dims,
        (None,) * lead + layout.split,
        (None,) * lead + tuple(c if s else None for c, s in zip(layout.cuts, same)),
    )


def broadcast_to(x: DistTensor, shape: int | Sequence[int]) -> DistTensor:
    """Collective over grid when a size-1 dim of ``x`` that is broadcast is divided over more
    than one rank (it is replicated first), else Local. ``x`` repeated to ``shape`` as
    ``numpy.broadcast_to`` (also ``np.broadcast_to(x, shape)``), in new memory.

    The result keeps ``x``'s split (new leading dims are whole): dims of unchanged size keep
    its cuts, broadcast dims are cut evenly. Differentiable for torch blocks (the gradient is
    summed over the repeats).

    Parameters
    ----------
    x : DistTensor
    shape : int or sequence of int
        The target shape: ``x.shape`` broadcasts to it by numpy's rule.

    Returns
    -------
    DistTensor

    Raises
    ------
    TypeError
        If ``x`` is not a DistTensor or ``shape`` is not a sequence of ints.
    ValueError
        If ``x.shape`` does not broadcast to ``shape``.
    """
    if not isinstance(x, DistTensor):
        raise TypeError(f"hpctp.broadcast_to needs a DistTensor, got {type(x).__name__}")
    target = _shape(shape)
    if not broadcasts_to(x.shape, target):
        raise ValueError(
            f"broadcast_to: a tensor of shape {x.shape} cannot be broadcast to shape {target} (numpy's rule: "
            f"the target has at least as many dims, and each dim of x is 1 or the target's size)"
        )
    out = empty_in(broadcast_layout(x.layout, target), x.grid, x.local.dtype, x.local)
    block = broadcast_operand(out, x, "broadcast_to")  # (x in the layout that broadcasts against out's blocks)
    out.local[...] = block
    return out
