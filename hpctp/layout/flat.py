"""Flat packings: several tensors laid end to end in one flat buffer, cut into balanced slices.

Sharded data parallelism (:class:`hpctp.nn.ShardedDataParallel`) keeps a group of parameters as
one flat buffer of which each of ``parts`` ranks owns the contiguous slice
:func:`~hpctp.layout.block_range` gives it. This module is the pure arithmetic of that: where each
tensor sits in the buffer (:class:`FlatPacking`), which part of each tensor a slice holds
(:meth:`FlatPacking.pieces`), and how a contiguous range of a tensor's row-major elements is a
short list of boxes (:func:`flat_range_boxes`), so that a slice can be read from or written to an
N-D dataset (HDF5 hyperslabs) without ever assembling the tensor. No MPI, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from .._util.ints import as_int
from .blocks import block_range

__all__ = ["FlatPacking", "FlatPiece", "flat_range_boxes"]

Box = tuple[slice, ...]


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> tuple[Box, ...]:
    """Local. The elements ``start <= i < stop`` of a row-major array of ``shape`` as boxes.

    Each box is a tuple of one slice per dim (the array's ndim; a 0-d array's only box is
    ``()``); the boxes come in flat order, each is contiguous in flat order, and together they
    hold exactly the range. At most ``2 * ndim - 1`` boxes: a partial first "row" at each
    depth, one run of whole rows, a partial last "row" at each depth.

    Parameters
    ----------
    shape : sequence of int
    start, stop : int
        ``0 <= start <= stop <= prod(shape)``.

    Returns
    -------
    tuple of tuple of slice

    Raises
    ------
    ValueError
        If the range is outside the array or a size is negative.

    Examples
    --------
    >>> flat_range_boxes((3, 4), 2, 9)
    ((slice(0, 1, None), slice(2, 4, None)), (slice(1, 2, None), slice(0, 4, None)), (slice(2, 3, None), slice(0, 1, None)))
    """
    dims = tuple(as_int(n, "shape", 0) for n in shape)
    n = math.prod(dims)
    start, stop = as_int(start, "start"), as_int(stop, "stop")
    if not 0 <= start <= stop <= n:
        raise ValueError(f"flat range [{start}, {stop}) is outside an array of shape {dims} ({n} elements)")
    if start == stop:
        return ()
    out: list[Box] = []
    _boxes(dims, start, stop, (), out)
    return tuple(out)


def _boxes(shape: tuple[int, ...], start: int, stop: int, prefix: Box, out: list[Box]) -> None:
    """Append the boxes of the non-empty range ``[start, stop)`` of ``shape`` (below the fixed ``prefix``)."""
    if not shape:
        out.append(prefix)
        return
    inner = math.prod(shape[1:])
    whole = tuple(slice(0, k) for k in shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:  # inside one row
        _boxes(shape[1:], c0, c1, prefix + (slice(r0, r0 + 1),), out)
        return
    if c0:  # the rest of a first, partial row
        _boxes(shape[1:], c0, inner, prefix + (slice(r0, r0 + 1),), out)
        r0 += 1
    if r1 > r0:
        out.append(prefix + (slice(r0, r1),) + whole)
    if c1:  # the start of a last, partial row
        _boxes(shape[1:], 0, c1, prefix + (slice(r1, r1 + 1),), out)


class FlatPiece(NamedTuple):
    """Local. The part of tensor number ``tensor`` that one slice holds.

    ``start:stop`` are the tensor's own (row-major) element indices; ``at`` is where they begin
    in the slice.
    """

    tensor: int
    start: int
    stop: int
    at: int


@dataclass(frozen=True)
class FlatPacking:
    """Local. Tensors of ``shapes`` packed end to end (row-major each) and cut into ``parts`` slices.

    Parameters
    ----------
    shapes : tuple of tuple of int
        The tensors' shapes, in packing order.
    parts : int
        Number of balanced contiguous slices (:func:`hpctp.layout.block_range`; the first ones
        one larger, empty ones where the buffer is smaller than ``parts``).
    """

    shapes: tuple[tuple[int, ...], ...]
    parts: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "shapes", tuple(tuple(as_int(n, "shape", 0) for n in s) for s in self.shapes))
        object.__setattr__(self, "parts", as_int(self.parts, "parts", 1))

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Local. Where each tensor begins in the buffer, and the buffer's size last."""
        out = [0]
        for s in self.shapes:
            out.append(out[-1] + math.prod(s))
        return tuple(out)

    @property
    def numel(self) -> int:
        """Local. Elements of the whole buffer."""
        return self.offsets[-1]

    @cached_property
    def counts(self) -> tuple[int, ...]:
        """Local. Elements of each part's slice."""
        return tuple(b - a for a, b in (self.slice_range(r) for r in range(self.parts)))

    def slice_range(self, part: int) -> tuple[int, int]:
        """Local. Part ``part``'s ``[lo, hi)`` of the buffer."""
        return block_range(self.numel, self.parts, part)

    def tensor_counts(self, tensor: int) -> tuple[int, ...]:
        """Local. How many elements of tensor number ``tensor`` each part's slice holds (they are
        consecutive in the tensor's row-major order, part after part)."""
        a, b = self.offsets[tensor], self.offsets[tensor + 1]
        out = []
        for part in range(self.parts):
            lo, hi = self.slice_range(part)
            out.append(max(0, min(b, hi) - max(a, lo)))
        return tuple(out)

    def pieces(self, part: int) -> tuple[FlatPiece, ...]:
        """Local. What part ``part``'s slice holds of each tensor, in buffer order (tensors it does not
        touch left out)."""
        lo, hi = self.slice_range(part)
        out = []
        for i, (a, b) in enumerate(zip(self.offsets, self.offsets[1:])):
            s, e = max(a, lo), min(b, hi)
            if s < e:
                out.append(FlatPiece(i, s - a, e - a, s - lo))
        return tuple(out)
