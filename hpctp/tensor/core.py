"""DistTensor: a global tensor whose blocks live on the ranks of a ProcessGrid."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from .. import comm as C
from .._util.backend import (
    BACKENDS,
    Array,
    array_module,
    astype,
    backend_name,
    check_array,
    convert,
    dtype_kind,
    is_cupy,
    is_device,
    is_torch,
)
from .._util.dtypes import dtype_name
from .._util.ints import is_int
from ..comm import ProcessGrid, check_grid
from ..layout import Layout, check_remap, flip_remap
from ..layout.indexing import index_plan
from ..ops.indexing import put_block, take_block
from ..ops.move import move_block
from ..ops.reduce import check_nonempty, normalize_axes, ordered_axes, reduce_block
from ..ops.transfer import gather_block, needs_grad, redistribute_block
from .align import aligned, broadcast_operand, broadcast_scalar, check_partner
from .registry import implementation

__all__ = ["DistTensor", "layout_source", "operand_block"]


def _arithmetic(fn: Callable[[Any, Any], Any], op: str) -> tuple[Callable[..., DistTensor], Callable[..., DistTensor]]:
    """Local. The operator ``op`` and its reflected form, elementwise on the blocks (Collective
    over grid when an operand must move first: cut differently, :func:`~hpctp.tensor.align.aligned`,
    or a smaller operand broadcast in another layout, :func:`~hpctp.tensor.align.broadcast_operand`)."""

    def forward(self: DistTensor, other: object) -> DistTensor:
        return self._binary(other, fn, op)

    def reflected(self: DistTensor, other: object) -> DistTensor:
        return self._binary(other, fn, op, reflected=True)

    return forward, reflected


def _comparison(fn: Callable[[Any, Any], Any], op: str) -> Callable[..., Any]:
    """Local (Collective over grid for operands cut differently, as :func:`_arithmetic`). The
    comparison ``op``: a boolean tensor; operands that are neither numbers nor DistTensors are
    left to Python (``x == None`` is False)."""

    def compare(self: DistTensor, other: object) -> Any:
        if not isinstance(other, (DistTensor, numbers.Number, np.generic)):
            return NotImplemented
        return self._binary(other, fn, op)

    return compare


class DistTensor:
    """Local. A global tensor cut into blocks over a :class:`~hpctp.ProcessGrid`.

    Usually made by :func:`hpctp.distribute`, :func:`hpctp.from_local`, :func:`hpctp.zeros`
    or :mod:`hpctp.random` rather than directly.

    Parameters
    ----------
    local : numpy.ndarray, torch.Tensor or cupy.ndarray
        This rank's block; its shape must be ``layout.local_shape(grid.coords)``.
    grid : ProcessGrid
    layout : Layout
        Must be on a grid of shape ``grid.dims``.

    Raises
    ------
    TypeError
        If ``local`` is not a supported array.
    ValueError
        If the block's shape or the layout's grid does not match.
    """

    __array_priority__ = 1000  # numpy scalars defer to our reflected operators

    def __init__(self, local: Array, grid: ProcessGrid, layout: Layout) -> None:
        check_array(local, "DistTensor local block")
        check_grid(grid)
        if not isinstance(layout, Layout):
            raise TypeError(f"layout must be a hpctp.layout.Layout, got {type(layout).__name__}")
        layout.check_block(local.shape, grid.dims, grid.coords, f"rank {grid.rank}: local block")
        self.local = local
        self.grid = grid
        self.layout = layout

    # ------------------------------------------------------------------ properties (local)
    @property
    def split(self) -> tuple[int | None, ...]:
        """Grid axis per tensor dimension (None: not divided)."""
        return self.layout.split

    @property
    def global_shape(self) -> tuple[int, ...]:
        """Shape of the global tensor."""
        return self.layout.global_shape

    shape = global_shape

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return self.layout.ndim

    @property
    def size(self) -> int:
        """Number of elements of the global tensor."""
        return math.prod(self.global_shape)

    @property
    def dtype(self) -> Any:
        """dtype of the blocks (as their backend spells it)."""
        return self.local.dtype

    @property
    def backend(self) -> str:
        """``"numpy"``, ``"torch"`` or ``"cupy"``."""
        return backend_name(self.local)

    @property
    def local_slices(self) -> tuple[slice, ...]:
        """Global index slices of this rank's block."""
        return self.layout.local_slices(self.grid.coords)

    @property
    def local_offsets(self) -> tuple[int, ...]:
        """Global index of this rank's first element along each dimension."""
        return tuple(s.start for s in self.local_slices)

    def __repr__(self) -> str:
        dev = f", device={self.local.device}" if is_device(self.local) else ""
        return (
            f"DistTensor(shape={self.global_shape}, split={self.split}, grid={self.grid.dims}, "
            f"dtype={self.dtype}, backend={self.backend}{dev}, rank={self.grid.rank}, "
            f"local_shape={tuple(self.local.shape)})"
        )

    def _new(self, local: Array, layout: Layout | None = None) -> DistTensor:
        if isinstance(local, np.generic):  # numpy turns 0-d results into scalars
            local = np.asarray(local)
        return DistTensor(local, self.grid, self.layout if layout is None else layout)

    def with_local(self, block: Array) -> DistTensor:
        """Local. A tensor of this layout and grid whose block on this rank is ``block``.

        For blockwise results of any function of the backend (``x.with_local(torch.erf(x.local))``).

        Raises
        ------
        TypeError, ValueError
            If ``block`` is not an array of this rank's block shape.
        """
        return self._new(block)

    # ------------------------------------------------------------------ indexing
    def __getitem__(self, key: object) -> DistTensor:
        """Collective over grid when an int selects, or a negative step runs, along a divided
        dim, else Local. ``x[key]``.

        Basic indexing as numpy's: ints, slices, ``...`` and ``None``; every rank must pass
        the same key. Sliced dims stay divided over their grid axes (uneven blocks where the
        selection meets them). A negative step keeps those blocks and reverses the elements
        (mirror ranks along the grid axis swap them). An int along a divided dim removes it:
        the element's owners send it along that grid axis, and the result is replicated
        there. Either is one redistribution, recorded by autograd for torch blocks.

        Returns
        -------
        DistTensor
            Without communication the block is a view of ``self``'s (as numpy's basic
            indexing; a torch block reversed along a whole dim is a copy); call ``.copy()``
            for independent memory.

        Raises
        ------
        TypeError
            On arrays, lists, bools or floats as indices (advanced indexing).
        IndexError
            On an int out of range or too many indices.
        ValueError
            On a slice step of 0.
        """
        plan = index_plan(self.layout, key)
        grad = needs_grad(self.local)
        if plan.moves:  # (ranks that disagree would pair different moves: check first)
            key = (plan.entries, plan.reverse)
            C.agree_arguments(self.grid.comm, "DistTensor[key]", None, key=key, requires_grad=grad)
        return self._new(take_block(self.local, self.grid, plan, grad), plan.result)

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        """Local. Refused: a DistTensor is not one array on any rank (numpy would otherwise read
        it element by element, one ``x[i]`` at a time).

        Raises
        ------
        TypeError
            Always, saying to call ``x.gather()`` (collective) or use ``x.local``.
        """
        raise TypeError(
            "a DistTensor does not convert to a numpy array: call x.gather() for the global tensor (collective) "
            "or use x.local, this rank's block"
        )

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Local for torch's pointwise functions (Collective over grid for operands cut
        differently), Collective over grid for the reductions, joins and moves that map onto
        hpctp's operations: torch's functions on DistTensors with torch blocks.

        Pointwise functions (``torch.relu(x)``, ``torch.nn.functional.gelu(x)``,
        ``torch.where(c, x, y)``) run blockwise, differentiably; collective ones
        (``torch.flip(x, dims)`` is :meth:`flip`, ``torch.sum(x, dim)`` is :meth:`sum`) call
        hpctp's. The supported functions are the tables ``POINTWISE`` and ``MOVES`` of
        :mod:`hpctp.tensor.torch_protocol`; :func:`~hpctp.tensor.torch_protocol.apply_torch_function`'s
        docstring lists them, generated from the tables.

        Raises
        ------
        TypeError
            For other functions, non-torch blocks, or plain tensors broadcast against the blocks.
        """
        return implementation("torch_function")(func, args, kwargs or {})

    def __len__(self) -> int:
        """Local. The global size of dim 0, as ``len`` of a numpy array.

        Raises
        ------
        TypeError
            For a 0-d tensor.
        """
        if self.ndim == 0:
            raise TypeError("len() of a 0-d DistTensor")
        return self.global_shape[0]

    def __iter__(self) -> Iterator[DistTensor]:
        """Collective over grid when dim 0 is divided, else Local. ``x[0], x[1], ...`` in turn.

        Raises
        ------
        TypeError
            For a 0-d tensor.
        """
        for i in range(len(self)):
            yield self[i]

    def __setitem__(self, key: object, value: object) -> None:
        """Local, unless ``value`` is a DistTensor cut differently from ``x[key]`` or ``key`` runs
        backwards along a divided dim (then Collective over grid: the value's blocks are aligned
        with the selection first, in one move). ``x[key] = value``: each rank writes the part of
        the selection it holds.

        Parameters
        ----------
        key : index
            As :meth:`__getitem__`.
        value : scalar, DistTensor or array
            A number; a DistTensor of ``x[key]``'s shape and split (0-d: a number), such as
            ``u[2:] - u[:-2]`` for ``u[1:-1]``; or a whole
            numpy/torch/cupy array, the same on every rank, that broadcasts to ``x[key]``'s
            shape (numpy's rule; each rank uses its part).

        Raises
        ------
        TypeError, IndexError, ValueError
            On a bad key (as :meth:`__getitem__`), a DistTensor value of another shape,
            split, grid or backend, or a value that does not broadcast.
        """
        plan = index_plan(self.layout, key)
        op = "x[key] = value"
        if isinstance(value, (list, tuple)):
            value = np.asarray(value)
        if isinstance(value, DistTensor) and value.ndim > 0:
            check_partner(self, value, op)
            block = value.local
            if value.layout != plan.result or plan.result_remap:  # (reversed dims: the value's order is flipped)
                block = aligned(self.grid, value, plan.result, op, plan.result_remap)
            put_block(self.local, plan, self.grid.coords, block, "block")
        elif isinstance(value, (DistTensor, numbers.Number, np.generic)):
            put_block(self.local, plan, self.grid.coords, operand_block(self, value, op), "scalar")
        elif isinstance(value, np.ndarray) or is_torch(value) or is_cupy(value):
            put_block(self.local, plan, self.grid.coords, value, "global")
        else:
            raise TypeError(f"{op} needs a number, a DistTensor or an array as value, got {type(value).__name__}")

    # ------------------------------------------------------------------ communication
    @overload
    def gather(self, root: None) -> Array: ...
    @overload
    def gather(self, root: int = 0) -> Array | None: ...
    def gather(self, root: int | None = 0) -> Array | None:
        """Collective over grid. The global tensor, assembled on ``root`` (on every rank if None).

        Returns
        -------
        array or None
            Same backend and device as the blocks on ``root``; None on other ranks.

        Raises
        ------
        ValueError
            If ``root`` is not a rank of the grid.
        """
        error = None
        if root is not None and not (is_int(root) and 0 <= root < self.grid.size):
            error = ValueError(f"root={root!r} must be a rank in 0..{self.grid.size - 1} or None")
        C.agree_arguments(self.grid.comm, "gather", error, root=root)
        return gather_block(self.local, self.grid, self.layout, None if root is None else int(root))

    def redistribute(self, split: object, grid: ProcessGrid | None = None) -> DistTensor:
        """Collective over grid. The same tensor in another layout, moved in one all-to-all.

        Parameters
        ----------
        split : split specification or Layout
            Target split (balanced blocks), or a full target :class:`Layout`.
        grid : ProcessGrid, optional
            Another grid of the same ranks (:meth:`ProcessGrid.same_ranks`: e.g. built on the
            same communicator with another shape) to move the tensor onto; ``split`` then
            refers to its axes. Default: this tensor's grid.

        Returns
        -------
        DistTensor
            A new tensor; ``self`` is unchanged. Ranks send only the elements whose owner
            changes. When the layout (and grid) is already the target, the result shares
            ``self``'s block (no copy, as ``numpy.asarray``); call ``.copy()`` for
            independent memory.

        Raises
        ------
        ValueError
            If the target split is invalid, the layout is for another tensor or grid shape,
            or ``grid`` holds other ranks.
        TypeError
            If ``grid`` is not a ProcessGrid.
        """
        error: Exception | None = None
        target, to = self.layout, self.grid
        try:
            to = self.grid if grid is None else check_grid(grid)
            if to is not self.grid and not self.grid.same_ranks(to):
                raise ValueError(
                    f"rank {self.grid.rank}: grid {to.dims} does not hold the same ranks in the same order as the "
                    f"tensor's grid {self.grid.dims}; build both grids on one communicator"
                )
            target = split if isinstance(split, Layout) else Layout(self.global_shape, to.dims, split)  # type: ignore[arg-type]
            if target.global_shape != self.global_shape or target.grid_dims != to.dims:
                raise ValueError(
                    f"cannot redistribute {self.layout} to {target}: the shape must match and the grid dims be {to.dims}"
                )
        except (TypeError, ValueError) as e:
            error = e
        C.agree_arguments(self.grid.comm, "redistribute", error, target=target)  # (a message plan per rank)
        if target == self.layout:
            return DistTensor(self.local, to, target)
        return DistTensor(redistribute_block(self.local, self.grid, self.layout, target), to, target)

    # ------------------------------------------------------------------ reductions
    def _reduce(self, op: str, axis: int | Sequence[int] | None, keepdims: bool) -> DistTensor:
        error: Exception | None = None
        axes: tuple[int, ...] | None = None
        grad = needs_grad(self.local)  # agreed: every rank takes the same (differentiable or plain) path
        try:
            axes = normalize_axes(axis, self.ndim)
        except (TypeError, ValueError) as e:
            error = e
        C.agree_arguments(self.grid.comm, op, error, axes=axes, keepdims=bool(keepdims), requires_grad=grad)
        local, layout = reduce_block(self.local, self.grid, self.layout, op, axis, keepdims)
        return self._new(local, layout)

    def _numpy_style(self, what: str, dtype: object, out: object) -> DistTensor:
        """``self`` in ``dtype`` (None: as is) for a reduction called as numpy calls it
        (``np.sum(x)`` calls ``x.sum(axis=None, out=None)``); ``out=`` is refused."""
        if out is not None:
            raise TypeError(f"{what}(out=...) is not supported on DistTensors: use the returned tensor")
        return self if dtype is None else self.astype(dtype)

    def sum(
        self, axis: int | Sequence[int] | None = None, keepdims: bool = False, *, dtype: object = None, out: None = None
    ) -> DistTensor:
        """Collective over grid. Sum over ``axis`` (all dims if None).

        ``np.sum(x, axis)`` calls this too; ``dtype`` converts the blocks first, ``out`` must be None.
        Differentiable for torch blocks that require grad (every rank must agree): backward
        hands each rank the gradient of the replicated result, as the global losses do.

        Returns
        -------
        DistTensor
            Reduced dims are removed (kept with size 1 if ``keepdims``); the result is
            replicated along the grid axes that split them.

        Raises
        ------
        ValueError
            On a bad axis, or ranks that pass different arguments or ``requires_grad``.
        """
        if dtype is not None or out is not None:
            return self._numpy_style("sum", dtype, out).sum(axis, keepdims)
        if self._is_half():  # accumulate in float32, round to 16 bits once
            return self.astype("float32")._reduce("sum", axis, keepdims).astype(self.local.dtype)
        return self._reduce("sum", axis, keepdims)

    def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False, *, out: None = None) -> DistTensor:
        """Collective over grid. Maximum over ``axis`` (also ``np.max(x)``); layout as for :meth:`sum`."""
        self._numpy_style("max", None, out)
        check_nonempty(self.global_shape, axis, "max")
        return self._reduce("max", axis, keepdims)

    def min(self, axis: int | Sequence[int] | None = None, keepdims: bool = False, *, out: None = None) -> DistTensor:
        """Collective over grid. Minimum over ``axis`` (also ``np.min(x)``); layout as for :meth:`sum`."""
        self._numpy_style("min", None, out)
        check_nonempty(self.global_shape, axis, "min")
        return self._reduce("min", axis, keepdims)

    def argmax(self, axis: int | None = None, keepdims: bool = False, *, out: None = None) -> DistTensor:
        """Collective over grid. Index of the largest element (also ``np.argmax(x)``); see
        :func:`hpctp.tensor.functions.search.argmax`."""
        self._numpy_style("argmax", None, out)
        return implementation("argmax")(self, axis, keepdims)

    def argmin(self, axis: int | None = None, keepdims: bool = False, *, out: None = None) -> DistTensor:
        """Collective over grid. Index of the smallest element (also ``np.argmin(x)``); see
        :func:`hpctp.tensor.functions.search.argmin`."""
        self._numpy_style("argmin", None, out)
        return implementation("argmin")(self, axis, keepdims)

    def mean(
        self, axis: int | Sequence[int] | None = None, keepdims: bool = False, *, dtype: object = None, out: None = None
    ) -> DistTensor:
        """Collective over grid. Mean over ``axis`` (also ``np.mean(x)``); layout as for :meth:`sum`.

        Integer tensors give float64 (float32 stays float32; float16/bfloat16 are summed and
        divided in float32, then rounded once); ``dtype`` converts the blocks first."""
        if dtype is not None or out is not None:
            return self._numpy_style("mean", dtype, out).mean(axis, keepdims)
        axes = normalize_axes(axis, self.ndim)
        count = math.prod(self.global_shape[d] for d in axes)
        if self._is_half():
            return (self.astype("float32")._reduce("sum", axes, keepdims) / count).astype(self.local.dtype)
        src = self if self._is_inexact() else self.astype("float64")
        return src._reduce("sum", axes, keepdims) / count

    def var(
        self,
        axis: int | Sequence[int] | None = None,
        dtype: object = None,
        out: None = None,
        ddof: float = 0,
        keepdims: bool = False,
        *,
        correction: float | None = None,
        where: object = None,
        mean: object = None,
    ) -> DistTensor:
        """Collective over grid. Variance over ``axis`` (also ``np.var(x)``); see :func:`hpctp.tensor.functions.statistics.var`.

        ``correction`` is numpy's other name for ``ddof``; ``where=`` and ``mean=`` are refused."""
        ddof = implementation("resolve_ddof")(ddof, correction, where, mean)
        return implementation("var")(self._numpy_style("var", dtype, out), axis, ddof, keepdims)

    def std(
        self,
        axis: int | Sequence[int] | None = None,
        dtype: object = None,
        out: None = None,
        ddof: float = 0,
        keepdims: bool = False,
        *,
        correction: float | None = None,
        where: object = None,
        mean: object = None,
    ) -> DistTensor:
        """Collective over grid. Standard deviation over ``axis`` (also ``np.std(x)``); as :meth:`var`."""
        ddof = implementation("resolve_ddof")(ddof, correction, where, mean)
        return implementation("std")(self._numpy_style("std", dtype, out), axis, ddof, keepdims)

    def any(self, axis: int | Sequence[int] | None = None, out: None = None, keepdims: bool = False) -> DistTensor:
        """Collective over grid. Whether any element over ``axis`` is nonzero (also ``np.any(x)``)."""
        return implementation("any")(self._numpy_style("any", None, out), axis, keepdims)

    def all(self, axis: int | Sequence[int] | None = None, out: None = None, keepdims: bool = False) -> DistTensor:
        """Collective over grid. Whether every element over ``axis`` is nonzero (also ``np.all(x)``)."""
        return implementation("all")(self._numpy_style("all", None, out), axis, keepdims)

    def cumsum(self, axis: int | None = None, dtype: object = None, out: None = None) -> DistTensor:
        """Collective over grid (on more than one rank). Cumulative sum (also ``np.cumsum(x)``); see
        :func:`hpctp.tensor.functions.scan.cumsum`."""
        return implementation("cumsum")(self._numpy_style("cumsum", None, out), axis, dtype)

    def cumprod(self, axis: int | None = None, dtype: object = None, out: None = None) -> DistTensor:
        """Collective over grid (on more than one rank). Cumulative product (also ``np.cumprod(x)``);
        see :func:`hpctp.tensor.functions.scan.cumprod`."""
        return implementation("cumprod")(self._numpy_style("cumprod", None, out), axis, dtype)

    def _is_half(self) -> bool:
        """float16 or bfloat16 blocks (reduced in float32, as torch accumulates them)."""
        return dtype_name(self.local.dtype) in ("float16", "bfloat16")

    def _is_inexact(self) -> bool:
        """Floating point or complex blocks (bool and int ones are reduced in float64)."""
        return dtype_kind(self.local) in "fc"

    def norm(self) -> DistTensor:
        """Collective over grid. Frobenius (2-) norm of the whole tensor, as a replicated 0-d tensor."""
        if self._is_half():  # squares and sum in float32, rounded to 16 bits once
            return self.astype("float32").norm().astype(self.local.dtype)
        src = self if self._is_inexact() else self.astype("float64")  # int squares overflow
        x = src.local
        sq = (x.abs() ** 2) if backend_name(x) == "torch" else abs(x) ** 2
        total = self._new(sq).sum()
        root = total.local**0.5
        return total._new(root)

    # ------------------------------------------------------------------ conversions (local)
    def astype(self, dtype: object) -> DistTensor:
        """Local. Same tensor with blocks converted to ``dtype`` (any backend's spelling)."""
        return self._new(astype(self.local, dtype))

    def to(self, backend: str) -> DistTensor:
        """Local. Same tensor with blocks on another backend: ``"numpy"``, ``"torch"``, ``"cuda"``, ``"cupy"``."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be 'numpy', 'torch', 'cuda' or 'cupy', got {backend!r}")
        return self._new(convert(self.local, backend))

    def to_dtensor(self, mesh: Any) -> Any:
        """Collective over grid. This tensor as a torch ``DTensor`` on ``mesh`` (the grid's
        :func:`~hpctp.comm.torch_dist.device_mesh`), sharing this rank's block:
        :func:`hpctp.tensor.dtensor.to_dtensor`, which documents the placements and errors."""
        return implementation("to_dtensor")(self, mesh)

    def copy(self) -> DistTensor:
        """Local. A deep copy of the local block, same layout."""
        x = self.local
        return self._new(x.clone() if backend_name(x) == "torch" else x.copy())

    def item(self) -> Any:
        """Local. The value of a 0-d (or single-element, replicated) tensor as a Python scalar.

        Raises
        ------
        ValueError
            If the tensor has more than one element or this rank's block is empty.
        """
        if self.size != 1 or math.prod(self.local.shape) != 1:
            raise ValueError(f"item() needs a single-element tensor held on this rank, got shape {self.global_shape}")
        return self.local.reshape(()).item() if hasattr(self.local, "item") else self.local.reshape(())[()]

    def __float__(self) -> float:
        return float(self.item())

    def __bool__(self) -> bool:
        """Local. Truth of a single-element tensor, as numpy (``if x.max():``); a tensor of more
        elements raises ValueError instead of always being true."""
        return bool(self.item())

    def __int__(self) -> int:
        return int(self.item())

    @property
    def real(self) -> DistTensor:
        """Local. The real part (the tensor itself when it is real), as ``numpy.real``."""
        x = self.local
        if dtype_kind(x) != "c":
            return self
        return self._new(x.real)

    @property
    def imag(self) -> DistTensor:
        """Local. The imaginary part (zeros of the tensor's dtype when it is real), as ``numpy.imag``."""
        x = self.local
        if dtype_kind(x) == "c":
            return self._new(x.imag)
        if is_torch(x):
            return self._new(x.new_zeros(x.shape))
        return self._new(array_module(x).zeros_like(x))

    def clip(self, min: object = None, max: object = None) -> DistTensor:  # noqa: A002 - numpy's names
        """Local. Values limited to ``[min, max]`` (numbers, or tensors of this layout), as ``numpy.clip``."""
        lo = None if min is None else operand_block(self, min, "clip")
        hi = None if max is None else operand_block(self, max, "clip")
        x = self.local
        if lo is None and hi is None:
            return self.copy()
        if is_torch(x):
            return self._new(x.clamp(lo, hi))
        return self._new(array_module(x).clip(x, lo, hi))

    def transpose(self, *axes: int | Sequence[int]) -> DistTensor:
        """Local. The tensor with its dims permuted (reversed by default), as ``numpy.transpose``.

        Each dim keeps its grid axis and cuts, so no data moves: the block is a view of this
        one's (``numpy.transpose`` / ``torch.permute``).

        Parameters
        ----------
        *axes : int or a sequence of int
            A permutation of ``0 .. ndim - 1`` (negative entries count from the end).

        Raises
        ------
        ValueError
            If ``axes`` is not a permutation of the dims.
        """
        given = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        n = self.ndim
        perm = tuple(range(n))[::-1]
        if given:
            ints = [int(a) for a in given if is_int(a)]
            perm = tuple(a % n if -n <= a < n else -1 for a in ints)
            if len(ints) != len(given) or sorted(perm) != list(range(n)):
                raise ValueError(
                    f"axes={given!r} is not a permutation of the {n} dims of a tensor of shape {self.shape}"
                )
        lay = self.layout
        layout = Layout(
            tuple(lay.global_shape[d] for d in perm),
            lay.grid_dims,
            tuple(lay.split[d] for d in perm),
            tuple(lay.cuts[d] for d in perm),
        )
        x = self.local
        return self._new(x.permute(perm) if is_torch(x) else x.transpose(perm), layout)

    def flip(self, axis: int | Sequence[int] | None = None) -> DistTensor:
        """Collective over grid when a flipped dim is divided, else Local. The tensor reversed
        along ``axis`` (every dim if None), as ``numpy.flip``, in this tensor's layout.

        Mirror ranks along the grid axes of the flipped dims exchange their blocks (one
        ``Alltoallv``, which also evens out uneven cuts); other dims flip within the block.
        Differentiable for torch blocks that require grad (every rank must agree).

        Raises
        ------
        ValueError
            If an axis is out of range or repeated.
        """
        axes = normalize_axes(axis, self.ndim)
        return self._remapped(flip_remap(axes, self.global_shape), "flip", axes, axis=axes)

    def roll(self, shift: int | Sequence[int], axis: int | Sequence[int] | None = None) -> DistTensor:
        """Collective over grid when a rolled dim is divided, else Local. The tensor with its
        elements shifted cyclically by ``shift`` along ``axis``, as ``numpy.roll``, in this
        tensor's layout (``x.roll(1, 0)[i] == x[i - 1]``).

        Each block sends only the rows that leave it (one ``Alltoallv``: for a shift smaller
        than a block, ``shift`` rows to the next rank along the grid axis), so periodic
        stencils written as ``np.roll(u, 1, 0) + np.roll(u, -1, 0) - 2 * u`` stay cheap.
        Differentiable for torch blocks that require grad (every rank must agree).

        Parameters
        ----------
        shift : int or sequence of int
            Broadcast against ``axis``, as numpy's; shifts of a repeated axis add up.
        axis : int or sequence of int, optional
            Required unless the tensor is 1-D (numpy's ``axis=None`` rolls the flattened
            array, which a partitioned tensor does not have).

        Raises
        ------
        TypeError
            If a shift or axis is not an int.
        ValueError
            If ``axis`` is None for a tensor of more than one dim, out of range, or does not
            broadcast against ``shift``.
        """
        if axis is None:
            if self.ndim != 1:
                raise ValueError(
                    f"roll needs axis= for a tensor of {self.ndim} dims (numpy's axis=None rolls the flattened array, "
                    f"which a partitioned tensor does not have): e.g. x.roll({shift!r}, axis=0)"
                )
            axis = 0
        shifts, axes = np.asarray(shift), np.asarray(axis)
        if any(v.dtype.kind not in "iu" or v.ndim > 1 for v in (shifts, axes)):
            raise TypeError(
                f"roll takes int shifts and axes (or sequences of them), got shift={shift!r}, axis={axis!r}"
            )
        if shifts.size != axes.size and 1 not in (shifts.size, axes.size):
            raise ValueError(f"shift={shift!r} and axis={axis!r} do not broadcast against each other")
        total = [0] * self.ndim
        dims = set()
        for s, a in np.broadcast(shifts, axes):
            d = ordered_axes(int(a), self.ndim)[0]
            total[d] += int(s)
            dims.add(d)
        return self._remapped(tuple((False, s) for s in total), "roll", dims, shift=tuple(total))

    def _remapped(
        self, remap: tuple[tuple[bool, int], ...], what: str, dims: Iterable[int], **arguments: Any
    ) -> DistTensor:
        """This tensor in its own layout with ``remap`` (acting on ``dims``) applied (see
        :func:`hpctp.layout.redistribution_plan`); collective when one of ``dims`` is divided."""
        remap = check_remap(remap, self.global_shape)
        grad = needs_grad(self.local)
        if any(self.layout.parts(d) > 1 for d in dims):  # (a decision from the axes alone: a shift of 0 agrees too)
            C.agree_arguments(self.grid.comm, what, None, requires_grad=grad, **arguments)
        return self._new(move_block(self.local, self.grid, self.layout, self.layout, grad, remap))

    @property
    def T(self) -> DistTensor:  # noqa: N802 - numpy's name
        """Local. The tensor with its dims reversed (:meth:`transpose`)."""
        return self.transpose()

    # ------------------------------------------------------------------ elementwise (local)
    def _binary(self, other: object, fn: Callable[[Any, Any], Any], op: str, reflected: bool = False) -> DistTensor:
        if isinstance(other, DistTensor) and other is not self and layout_source((self, other)) is other:
            # a smaller tensor (e.g. x.sum(), x.mean(0)) broadcasts on the left too: the result has other's layout
            return other._binary(self, fn, op, reflected=not reflected)
        o = operand_block(self, other, op)
        out = fn(o, self.local) if reflected else fn(self.local, o)
        return self._new(out)

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """Local (Collective over grid for operands cut differently). numpy's elementwise functions
        on DistTensors: ``np.exp(x)``, ``np.maximum(x, y)``.

        Each rank applies the ufunc to its blocks (torch blocks: the torch function of the
        same meaning; cupy blocks: cupy's), with numbers and tensors of the same layout as the
        other operands. Tensors of the same shape and split whose cuts differ (``u[1:]`` and
        ``u[:-1]``) are aligned to the first one's layout by one redistribution that moves only
        the rows between the cuts; smaller tensors broadcast against the largest, as numpy's
        (``x - x.mean(0)``), in its layout. ``np.matmul(a, b)`` is ``a @ b`` (collective).

        Raises
        ------
        TypeError
            On reductions and other ufunc methods (use ``x.sum()``, ``x.max()``), ``out=``
            and other keywords, ufuncs with several outputs, numpy arrays as operands, or a
            ufunc torch has no counterpart of.
        ValueError
            On operands of one shape but different splits, shapes that do not broadcast against
            the largest one, or different grids.
        """
        return implementation("array_ufunc")(ufunc, method, inputs, kwargs)

    def __array_function__(self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Collective over grid for the reductions (``np.sum(x)``, ``np.allclose(x, y)``) and,
        where they move data, the moves (``np.roll(x, 1, 0)`` along a divided dim), else Local
        (``np.where``, ``np.shape``): numpy functions on DistTensors.

        The supported functions are the table ``FUNCTIONS`` of
        :mod:`hpctp.tensor.numpy_protocol`; :func:`~hpctp.tensor.numpy_protocol.apply_function`'s
        docstring lists them by kind, generated from the table.

        Raises
        ------
        TypeError
            For other numpy functions (they would otherwise see an opaque object).
        """
        return implementation("array_function")(func, args, kwargs)

    __add__, __radd__ = _arithmetic(operator.add, "+")
    __sub__, __rsub__ = _arithmetic(operator.sub, "-")
    __mul__, __rmul__ = _arithmetic(operator.mul, "*")
    __truediv__, __rtruediv__ = _arithmetic(operator.truediv, "/")
    __pow__, __rpow__ = _arithmetic(operator.pow, "**")
    __floordiv__, __rfloordiv__ = _arithmetic(operator.floordiv, "//")
    __mod__, __rmod__ = _arithmetic(operator.mod, "%")

    # comparisons give boolean tensors of the same layout, as numpy and torch; operands
    # that are neither numbers nor DistTensors are left to Python (``x == None`` is False)
    __hash__ = None  # type: ignore[assignment]  # elementwise ==, as numpy arrays: not hashable

    __eq__ = _comparison(operator.eq, "==")  # type: ignore[assignment]
    __ne__ = _comparison(operator.ne, "!=")  # type: ignore[assignment]
    __lt__ = _comparison(operator.lt, "<")
    __le__ = _comparison(operator.le, "<=")
    __gt__ = _comparison(operator.gt, ">")
    __ge__ = _comparison(operator.ge, ">=")

    def __matmul__(self, other: object) -> DistTensor:
        """Collective over grid. Distributed matrix product, see :func:`hpctp.linalg.matmul`."""
        if not isinstance(other, DistTensor):
            raise TypeError(f"'@' needs two DistTensors, got DistTensor and {type(other).__name__}")
        return implementation("matmul")(self, other)

    def __neg__(self) -> DistTensor:
        return self._new(-self.local)

    def __abs__(self) -> DistTensor:
        return self._new(abs(self.local))


def layout_source(operands: Sequence[object]) -> DistTensor:
    """Local. The operand whose layout an elementwise result takes: the first DistTensor of the
    largest shape (most dims, then most elements), against which the others broadcast (numpy's
    rule).

    Parameters
    ----------
    operands : sequence
        The operands of the operation, DistTensors among numbers and other objects.

    Returns
    -------
    DistTensor

    Raises
    ------
    ValueError
        If no operand is a DistTensor (``max`` of an empty sequence).
    """
    tensors = [a for a in operands if isinstance(a, DistTensor)]
    return max(tensors, key=lambda t: (t.ndim, t.size))  # (max keeps the first of equals)


def operand_block(x: DistTensor, other: object, op: str) -> Any:
    """Collective over grid when ``other`` is a DistTensor that must move first (cut differently
    from ``x``, or a smaller tensor in another layout), else Local. ``other`` as an operand of
    an elementwise operation on ``x``'s block, whose layout the result takes
    (:func:`layout_source`).

    Parameters
    ----------
    x : DistTensor
    other : DistTensor or number
    op : str
        The operation, for the messages (``"+"``, ``"numpy.where"``, ``"clip"``).

    Returns
    -------
    array or number
        A number as is; a DistTensor's block: as is in ``x``'s layout; a 0-d tensor's block
        (:func:`~hpctp.tensor.align.broadcast_scalar`); a smaller tensor's block in the layout
        that broadcasts against ``x``'s (:func:`~hpctp.tensor.align.broadcast_operand`); a
        tensor of ``x``'s shape and split, cut differently, moved into ``x``'s layout
        (:func:`~hpctp.tensor.align.aligned`).

    Raises
    ------
    TypeError
        If ``other`` is neither a number nor a DistTensor, or its blocks are of another backend.
    ValueError
        If ``other`` is on another grid, of ``x``'s shape but another split, or of a shape
        that does not broadcast against ``x``'s.
    """
    if isinstance(other, DistTensor):
        check_partner(x, other, op)
        if other.layout != x.layout:
            if other.ndim == 0:
                return broadcast_scalar(x, other.local)
            if other.global_shape != x.global_shape:
                return broadcast_operand(x, other, op)
            return aligned(x.grid, other, x.layout, op)
        return other.local
    if isinstance(other, (numbers.Number, np.generic)):
        return other
    raise TypeError(
        f"unsupported operand for '{op}': DistTensor and {type(other).__name__} "
        f"(use a scalar or a DistTensor of the same layout)"
    )
