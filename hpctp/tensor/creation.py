"""Ways to make a DistTensor: scatter from one rank, wrap existing blocks, or fill."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import comm as C
from .._util.backend import (
    BACKENDS,
    Array,
    astype,
    backend_name,
    broadcasts_to,
    check_array,
    empty_like_backend,
    from_numpy,
    native_order,
)
from .._util.dtypes import dtype_code, dtype_from_code
from .._util.ints import is_int
from ..comm import ProcessGrid, check_grid
from ..layout import Layout, normalize_split, tiled_layout
from ..ops.transfer import scatter_block
from .core import DistTensor
from .registry import implementation

__all__ = ["distribute", "from_local", "from_dtensor", "empty", "zeros", "ones", "full", "fromfunction"]

_MAX_NDIM = 32


def _backend_key(x: Array) -> str:
    name = backend_name(x)
    if name == "torch" and x.device.type != "cpu":
        return "cuda"
    return name


def distribute(array: Array | None, grid: ProcessGrid, split: object, root: int = 0) -> DistTensor:
    """Collective over grid. Scatter a global array held on ``root`` into blocks.

    Parameters
    ----------
    array : array or None
        The global tensor on ``root`` (numpy, torch or cupy); ignored (pass None) elsewhere.
    grid : ProcessGrid
    split : split specification
        Grid axis per tensor dim (see :class:`hpctp.layout.Layout`).
    root : int
        Rank holding ``array``.

    Returns
    -------
    DistTensor
        Blocks on the root's backend and dtype (CUDA blocks on each rank's current device).

    Raises
    ------
    TypeError
        If ``array`` on root is not a supported array (raised on every rank).
    ValueError
        If ``root`` or ``split`` is invalid or differs between ranks (raised on every rank).
    """
    grid = check_grid(grid)
    header = None
    error: Exception | None = None
    root_ok = is_int(root) and 0 <= root < grid.size
    if not root_ok:
        error = ValueError(f"root={root!r} must be a rank in 0..{grid.size - 1}")
    elif grid.rank == root:
        try:
            check_array(array, "distribute(array=...) on the root rank")
            array = native_order(array)  # e.g. '>f8' read from a file: receivers allocate native blocks
            if array.ndim > _MAX_NDIM:  # type: ignore[union-attr]
                raise ValueError(f"at most {_MAX_NDIM} dims are supported, got {array.ndim}")  # type: ignore[union-attr]
            header = [array.ndim, dtype_code(array.dtype), BACKENDS.index(_backend_key(array))]  # type: ignore[union-attr]
            header += list(array.shape) + [0] * (_MAX_NDIM - array.ndim)  # type: ignore[union-attr]
        except (TypeError, ValueError) as e:
            error = e
    C.agree_arguments(grid.comm, "distribute", error, split=split, root=root)
    root = int(root)
    h = C.bcast_ints(grid.comm, header, 3 + _MAX_NDIM, root=root)
    ndim, code, backend = int(h[0]), int(h[1]), BACKENDS[int(h[2])]
    shape = tuple(int(s) for s in h[3 : 3 + ndim])
    layout = Layout(shape, grid.dims, normalize_split(split, ndim, grid.ndim))
    dtype = array.dtype if grid.rank == root else dtype_from_code(code, backend)  # type: ignore[union-attr]
    like = array if grid.rank == root else backend
    local = scatter_block(array, grid, layout, dtype, like, root=root)
    return DistTensor(local, grid, layout)


def from_local(block: Array, grid: ProcessGrid, split: object, global_shape: Sequence[int] | None = None) -> DistTensor:
    """Collective over grid. Wrap the blocks a simulation code already holds, without copying.

    Block sizes along a split dim may be uneven (any sizes, e.g. a simulation's own
    decomposition); they must agree among ranks sharing a grid coordinate and tile the
    global shape.

    Parameters
    ----------
    block : array
        This rank's block (numpy, torch or cupy); used as the local block as is.
    grid : ProcessGrid
    split : split specification
        Grid axis per tensor dim.
    global_shape : sequence of int, optional
        Expected global shape; inferred from the blocks when omitted.

    Returns
    -------
    DistTensor

    Raises
    ------
    TypeError
        If a rank's block is not a supported array.
    ValueError
        If dims, dtypes or backends (numpy, torch CPU, torch CUDA, cupy) differ between
        ranks, blocks do not tile, or ``global_shape`` does not match. Raised on every rank.
    """
    grid = check_grid(grid)
    error: Exception | None = None
    info = [-1] * (3 + _MAX_NDIM)
    try:
        check_array(block, "from_local(block=...)")
        if block.ndim > _MAX_NDIM:
            raise ValueError(f"at most {_MAX_NDIM} dims are supported, got {block.ndim}")
        info = [block.ndim, dtype_code(block.dtype), BACKENDS.index(_backend_key(block))]
        info += list(block.shape) + [0] * (_MAX_NDIM - block.ndim)
    except (TypeError, ValueError) as e:
        error = e
    C.agree_arguments(grid.comm, "from_local", error, split=split, global_shape=global_shape)
    table = C.allgather_ints(grid.comm, info)
    layout = _infer_layout(table, grid.dims, split, global_shape)
    return DistTensor(block, grid, layout)


def from_dtensor(t: Any, grid: ProcessGrid) -> DistTensor:
    """Collective over grid. The DistTensor of a torch ``DTensor`` on the grid's mesh, holding
    ``t.to_local()`` as its block, without copying (the inverse of :meth:`DistTensor.to_dtensor`).

    ``Shard(d)`` on mesh dim ``i`` divides tensor dim ``d`` over grid axis ``i``, with
    ``torch.chunk``'s cuts; ``Replicate()`` leaves the grid axis replicated. Implemented in
    :mod:`hpctp.tensor.dtensor`, loaded on first use (it imports torch).

    Parameters
    ----------
    t : torch.distributed.tensor.DTensor
        On a mesh of shape ``grid.dims`` whose coordinates are the grid's
        (:func:`hpctp.comm.torch_dist.device_mesh`).
    grid : ProcessGrid

    Returns
    -------
    DistTensor

    Raises
    ------
    TypeError
        If ``t`` is not a DTensor or ``grid`` not a ProcessGrid.
    ValueError
        On every rank: if the mesh is not the grid's, a placement is ``Partial`` or a strided
        shard, or two mesh dims shard one tensor dim (the message gives the ``t.redistribute``
        that fixes it), or a local tensor's shape is not its ``torch.chunk`` block's.
    """
    return implementation("from_dtensor")(t, grid)  # type: ignore[no-any-return]


def _infer_layout(
    table: np.ndarray, grid_dims: tuple[int, ...], split: object, global_shape: Sequence[int] | None
) -> Layout:
    """Same on every rank: the layout implied by every rank's (ndim, dtype, backend, shape)."""
    ndims = set(table[:, 0].tolist())
    if len(ndims) != 1:
        raise ValueError(f"from_local: blocks have different numbers of dims on different ranks: {sorted(ndims)}")
    ndim = ndims.pop()
    codes = set(table[:, 1].tolist())
    if len(codes) != 1:
        raise ValueError("from_local: blocks have different dtypes on different ranks; cast them to one dtype")
    backends: dict[str, list[int]] = {}
    for r, b in enumerate(table[:, 2].tolist()):
        backends.setdefault(BACKENDS[int(b)], []).append(r)
    if len(backends) != 1:
        found = ", ".join(f"{name} on ranks {ranks}" for name, ranks in sorted(backends.items()))
        raise ValueError(
            f"from_local: blocks are on different backends ({found}); convert them to one "
            f"(e.g. torch.from_numpy(block) or block.cpu()) so every rank runs the same code"
        )
    layout = tiled_layout([row[3 : 3 + ndim] for row in table.tolist()], grid_dims, split, "from_local: ")
    shape = layout.global_shape
    if global_shape is not None and tuple(int(n) for n in global_shape) != tuple(shape):
        raise ValueError(
            f"from_local: blocks tile a global shape {shape} but global_shape={tuple(global_shape)} was given"
        )
    return layout


def empty(
    shape: Sequence[int], grid: ProcessGrid, split: object = None, dtype: object = "float64", like: object = "numpy"
) -> DistTensor:
    """Local. An uninitialised distributed tensor.

    Parameters
    ----------
    shape : sequence of int
        Global shape.
    grid : ProcessGrid
    split : split specification
    dtype : dtype
        In numpy or torch spelling.
    like : str or array
        ``"numpy"``, ``"torch"``, ``"cuda"``, ``"cupy"``, or an array whose backend/device to use.

    Raises
    ------
    ValueError
        On a bad shape, split or backend.
    """
    grid = check_grid(grid)
    return empty_in(Layout(tuple(shape), grid.dims, split), grid, dtype, like)  # type: ignore[arg-type]


def empty_in(layout: Layout, grid: ProcessGrid, dtype: object, like: object) -> DistTensor:
    """Local. An uninitialised distributed tensor of ``layout`` on ``grid`` (``dtype`` and
    ``like`` as for :func:`empty`; e.g. ``x.local.dtype`` and ``x.local`` for ``x``'s kind)."""
    return DistTensor(empty_like_backend(layout.local_shape(grid.coords), dtype, like), grid, layout)


def full(
    shape: Sequence[int],
    value: object,
    grid: ProcessGrid,
    split: object = None,
    dtype: object = "float64",
    like: object = "numpy",
) -> DistTensor:
    """Local. A distributed tensor filled with ``value``; arguments as for :func:`empty`."""
    t = empty(shape, grid, split, dtype, like)
    t.local[...] = value
    return t


def zeros(
    shape: Sequence[int], grid: ProcessGrid, split: object = None, dtype: object = "float64", like: object = "numpy"
) -> DistTensor:
    """Local. A distributed tensor of zeros; arguments as for :func:`empty`."""
    return full(shape, 0, grid, split, dtype, like)


def ones(
    shape: Sequence[int], grid: ProcessGrid, split: object = None, dtype: object = "float64", like: object = "numpy"
) -> DistTensor:
    """Local. A distributed tensor of ones; arguments as for :func:`empty`."""
    return full(shape, 1, grid, split, dtype, like)


def fromfunction(
    function: Callable[..., Any],
    shape: Sequence[int],
    grid: ProcessGrid,
    split: object = None,
    dtype: object = "float64",
    like: object = "numpy",
) -> DistTensor:
    """Local. The tensor whose element at global index ``(i, j, ...)`` is ``function(i, j, ...)``.

    As ``numpy.fromfunction``, but each rank calls ``function`` once, for its own block: with
    one coordinate array per dim holding the block's global indices along it, in ``dtype``,
    on the blocks' backend, and shaped to broadcast (as ``numpy.ogrid``: ``[n0, 1]``,
    ``[1, n1]``) instead of full index arrays. An elementwise ``function`` gives the same
    tensor on any grid: initial conditions and coordinate fields of a simulation, without a
    message.

    Parameters
    ----------
    function : callable
        Takes ``len(shape)`` coordinate arrays; returns an array (or number) that broadcasts
        to the block's shape, of the blocks' backend.
    shape, grid, split, dtype, like
        As for :func:`empty`.

    Returns
    -------
    DistTensor

    Raises
    ------
    ValueError
        On a bad shape, split or backend, or a result that does not broadcast to the block.
    TypeError
        If ``function`` is not callable or returns an array of another backend.
    """
    if not callable(function):
        raise TypeError(f"fromfunction needs a callable, got {type(function).__name__}")
    t = empty(shape, grid, split, dtype, like)
    ranges = t.layout.local_ranges(grid.coords)
    coords = []
    for d, (a, b) in enumerate(ranges):
        index = np.arange(a, b, dtype=np.int64).reshape([-1 if e == d else 1 for e in range(len(ranges))])
        coords.append(astype(from_numpy(index, t.local), dtype))
    value = function(*coords)
    if hasattr(value, "shape") and not isinstance(value, np.generic):
        if backend_name(value) != t.backend:
            raise TypeError(f"fromfunction: function returned a {backend_name(value)} array for {t.backend} blocks")
        if not broadcasts_to(tuple(value.shape), tuple(t.local.shape)):
            raise ValueError(
                f"fromfunction: function returned shape {tuple(value.shape)}, which does not broadcast to the "
                f"block's shape {tuple(t.local.shape)}"
            )
    t.local[...] = value
    return t
