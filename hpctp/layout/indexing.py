"""Basic indexing of a partitioned tensor: the layout of ``x[key]`` and each block's share (pure).

``x[key]`` with ints, slices, ``...`` and ``None`` selects, along every dim, an arithmetic
progression of global indices; each block keeps the selected indices it holds, so a sliced
dim stays divided over the same grid axis, with the (uneven) cuts where the blocks'
selections meet. A slice with a negative step selects the same indices as a positive one,
in reverse: the blocks keep those cuts and the elements are flipped along the dim (between
ranks when a grid axis divides it). An int removes its dim: where the grid divides that
dim, the one block holding the index has the element and the other blocks along that grid
axis have nothing, so the result is made whole there and is then replicated along that
axis. Both take one move (see :class:`IndexPlan`).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._util.ints import is_int
from .layout import Layout
from .plan import Remap, flip_remap, moves_data

__all__ = ["IndexPlan", "index_plan", "normalize_key"]

Entry = int | slice | None  # per dim: an int (dim removed), a slice (resolved, step > 0); None: a new dim
Key = tuple[tuple[Entry, ...], tuple[int, ...]]  # the entries, and the dims selected in reverse


def _check_index_type(k: object) -> None:
    if k is None or k is Ellipsis or is_int(k) or isinstance(k, slice):
        return
    what = type(k).__name__
    if isinstance(k, (bool, np.bool_, numbers.Number)):
        raise TypeError(f"DistTensor indices must be ints, slices, ... or None, got {what} {k!r}")
    raise TypeError(
        f"DistTensor indices must be ints, slices, ... or None (basic indexing), got {what}; advanced "
        f"(array, list or boolean) indexing is not supported: gather() a small tensor, or select with slices"
    )


def _slice_bound(v: object, what: str) -> None:
    if v is not None and not is_int(v):
        raise TypeError(f"slice {what} must be an int or None, got {type(v).__name__} {v!r}")


def _forward(s: slice, n: int) -> tuple[slice, bool]:
    """The selection of ``s`` on a dim of size ``n`` as a resolved slice with a positive
    step, and whether ``s`` takes it in reverse."""
    r = range(*s.indices(n))
    if r.step > 0:
        return slice(r.start, r.stop, r.step), False
    if not r:
        return slice(0, 0, 1), True
    return slice(r[-1], r[0] + 1, -r.step), True


def normalize_key(key: object, shape: Sequence[int]) -> Key:
    """Local. ``key`` as one entry per result-building step (resolved ints and slices, ``None``)
    and the source dims whose slice runs backwards.

    ``...`` is expanded and missing trailing dims become full slices; ints are made
    non-negative and slices resolved with :meth:`slice.indices`, a negative step to the
    positive slice of the same indices, so the entries hold only in-range values
    (``len(entries) - entries.count(None) == len(shape)``).

    Raises
    ------
    TypeError
        On an index that is not an int, slice, ``...`` or ``None`` (arrays, lists, bools,
        floats: advanced indexing), or a slice bound that is not an int.
    IndexError
        On too many indices, more than one ``...``, or an int out of range (as numpy).
    ValueError
        On a slice step of 0 (as numpy).
    """
    items = key if isinstance(key, tuple) else (key,)
    for k in items:
        _check_index_type(k)
    if sum(k is Ellipsis for k in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(1 for k in items if k is not None and k is not Ellipsis)
    if used > len(shape):
        raise IndexError(f"too many indices for a tensor of {len(shape)} dims: {used} were given")
    fill = (slice(None),) * (len(shape) - used)
    at = next((i for i, k in enumerate(items) if k is Ellipsis), len(items))
    items = items[:at] + fill + items[at + 1 :]
    out: list[Entry] = []
    reverse: list[int] = []
    d = 0
    for k in items:
        if k is None:
            out.append(None)
            continue
        n = int(shape[d])
        if isinstance(k, slice):
            for what, v in (("start", k.start), ("stop", k.stop), ("step", k.step)):
                _slice_bound(v, what)
            if k.step is not None and int(k.step) == 0:
                raise ValueError(f"slice step cannot be zero (dim {d})")
            sel, backwards = _forward(k, n)
            out.append(sel)
            if backwards:
                reverse.append(d)
        else:
            i = int(k)  # type: ignore[call-overload]
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for dim {d} of size {n}")
            out.append(i % n)
        d += 1
    return tuple(out), tuple(reverse)


def _as_slices(entries: tuple[Entry, ...]) -> tuple[slice, ...]:
    """The global selection per source dim, an int as a slice of length 1 (new dims skipped)."""
    return tuple(e if isinstance(e, slice) else slice(e, e + 1, 1) for e in entries if e is not None)


def _count(s: slice) -> int:
    return len(range(s.start, s.stop, s.step))


def _selected_before(s: slice, edge: int) -> int:
    """How many of ``s``'s indices are below ``edge`` (``0..count``)."""
    return min(max(-((s.start - edge) // s.step), 0), _count(s))


@dataclass(frozen=True)
class IndexPlan:
    """Local. How ``x[key]`` is built from the blocks of a tensor in layout ``source``.

    Each rank takes :meth:`local_key` of its block, which holds its block of ``sliced`` (the
    selection with every int kept as a dim of size 1, in increasing index order).
    ``gathered`` is ``sliced`` with the int dims that a grid axis divides made whole, and
    ``remap`` flips the dims selected backwards: one redistribution (with that remap) goes
    from ``sliced`` to ``gathered``, without messages where neither concerns a divided dim
    (:attr:`moves`). Dropping the int dims (``drop``) and inserting new dims of size 1
    (``insert``, positions in the result) then gives the blocks of ``result``.

    Attributes
    ----------
    source, sliced, gathered, result : Layout
    entries : tuple
        The normalized key (see :func:`normalize_key`).
    reverse : tuple of int
        Dims of ``sliced`` selected by a negative step.
    drop : tuple of int
        Dims of ``gathered`` selected by an int.
    insert : tuple of int
        Dims of ``result`` that a ``None`` adds.
    """

    source: Layout
    entries: tuple[Entry, ...]
    sliced: Layout
    gathered: Layout
    result: Layout
    drop: tuple[int, ...]
    insert: tuple[int, ...]
    reverse: tuple[int, ...] = ()

    @property
    def remap(self) -> Remap:
        """The flips from ``sliced`` to ``gathered`` (see :func:`hpctp.layout.redistribution_plan`)."""
        return flip_remap(self.reverse, self.sliced.global_shape)

    @property
    def moves(self) -> bool:
        """True when the plan sends messages: an int selects, or a negative step runs, along a
        divided dim."""
        return moves_data(self.sliced, self.gathered, self.remap)

    @property
    def result_remap(self) -> Remap:
        """The flips that put a tensor in ``result``'s order into the selection's increasing order."""
        return flip_remap(self.result_reverse, self.result.global_shape)

    @property
    def result_reverse(self) -> tuple[int, ...]:
        """Dims of ``result`` selected by a negative step."""
        dims = []
        d = r = 0
        for e in self.entries:
            if e is None or isinstance(e, slice):
                if e is not None and d in self.reverse:
                    dims.append(r)
                r += 1
            d += e is not None
        return tuple(dims)

    @property
    def selections(self) -> tuple[slice, ...]:
        """The global selection per source dim, an int as a slice of length 1."""
        return _as_slices(self.entries)

    def local_key(self, coords: Sequence[int]) -> tuple[slice, ...]:
        """The slices of the block at grid ``coords`` that hold its block of ``sliced``."""
        key = []
        for s, (a, b) in zip(self.selections, self.source.local_ranges(coords)):
            lo, hi = _selected_before(s, a), _selected_before(s, b)
            if hi <= lo:
                key.append(slice(0, 0))
            else:
                first = s.start + s.step * lo
                key.append(slice(first - a, first - a + s.step * (hi - lo - 1) + 1, s.step))
        return tuple(key)


def index_plan(layout: Layout, key: object) -> IndexPlan:
    """Local. The :class:`IndexPlan` of ``x[key]`` for a tensor in ``layout``.

    Parameters
    ----------
    layout : Layout
    key : int, slice, Ellipsis, None or tuple of them
        Basic indexing, as numpy's.

    Returns
    -------
    IndexPlan

    Raises
    ------
    TypeError, IndexError, ValueError
        As :func:`normalize_key`.
    """
    entries, reverse = normalize_key(key, layout.global_shape)
    sel = _as_slices(entries)
    shape = tuple(_count(s) for s in sel)
    cuts = tuple(
        tuple(_selected_before(s, c) for c in layout.dim_cuts[d]) if layout.split[d] is not None else None
        for d, s in enumerate(sel)
    )
    sliced = Layout(shape, layout.grid_dims, layout.split, cuts)
    ints = [d for d, e in enumerate(e for e in entries if e is not None) if not isinstance(e, slice)]
    divided = {d for d in ints if layout.parts(d) > 1}
    gathered = Layout(
        shape,
        layout.grid_dims,
        tuple(None if d in divided else g for d, g in enumerate(layout.split)),
        tuple(None if d in divided else c for d, c in enumerate(sliced.cuts)),
    )
    split: list[int | None] = []
    rcuts: list[tuple[int, ...] | None] = []
    rshape: list[int] = []
    insert: list[int] = []
    d = 0
    for e in entries:
        if e is None:
            insert.append(len(rshape))
            rshape.append(1)
            split.append(None)
            rcuts.append(None)
            continue
        if d not in ints:
            rshape.append(shape[d])
            split.append(gathered.split[d])
            rcuts.append(gathered.cuts[d])
        d += 1
    result = Layout(tuple(rshape), layout.grid_dims, tuple(split), tuple(rcuts))
    return IndexPlan(layout, entries, sliced, gathered, result, tuple(ints), tuple(insert), reverse)
