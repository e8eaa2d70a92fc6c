"""``hpctp.matmul``: distributed matrix product of 2-D DistTensors (SUMMA)."""

from __future__ import annotations

from typing import cast

import numpy as np

from .._util.backend import backend_name, is_device, native_order
from ..comm import ProcessGrid
from ..tensor.core import DistTensor
from ..tensor.registry import register
from .local import gemm_dtype_error
from .plan import check_panel, plan_matmul, required_layouts
from .summa import auto_panel, run_plan

__all__ = ["matmul"]


def _same_grid(a: ProcessGrid, b: ProcessGrid) -> bool:
    return a is b or a.comm == b.comm


def _check(
    a: object, b: object, transpose_a: object, transpose_b: object, panel: object, grid_ndim: int = 2
) -> int | None:
    """Local. All of matmul's argument checks (global metadata only, so every rank agrees); ``panel="auto"`` (2-D
    grids) passes as None."""
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, DistTensor):
            raise TypeError(f"matmul: {name} must be a hpctp.DistTensor, got {type(x).__name__}")
    for name, f in (("transpose_a", transpose_a), ("transpose_b", transpose_b)):
        if not isinstance(f, bool):
            raise TypeError(f"matmul: {name} must be a bool, got {f!r}")
    a, b = cast(DistTensor, a), cast(DistTensor, b)  # checked just above
    for name, x in (("a", a), ("b", b)):
        if x.ndim != 2:
            raise ValueError(f"matmul needs 2-D tensors, {name} has shape {x.global_shape}")
    if not _same_grid(a.grid, b.grid):
        raise ValueError("matmul needs a and b on the same ProcessGrid")
    if a.grid.ndim != grid_ndim:
        hint = "[0, 0]" if grid_ndim == 2 else "[pr, pc, layers]"
        raise ValueError(f"matmul runs on a {grid_ndim}-D process grid here, got a {a.grid.ndim}-D grid of dims "
                         f"{a.grid.dims}; make one with hpctp.ProcessGrid({hint})")  # fmt: skip
    k_a = a.global_shape[0] if transpose_a else a.global_shape[1]
    k_b = b.global_shape[1] if transpose_b else b.global_shape[0]
    if k_a != k_b:
        sa = "a.T" if transpose_a else "a"
        sb = "b.T" if transpose_b else "b"
        raise ValueError(f"matmul: inner dimensions differ: {sa} has {k_a} columns, {sb} has {k_b} rows "
                         f"(a {a.global_shape}, b {b.global_shape})")  # fmt: skip
    if backend_name(a.local) != backend_name(b.local) or is_device(a.local) != is_device(b.local):
        raise TypeError(f"matmul: a and b blocks must share a backend and device, got {a.backend} and {b.backend}")
    same_native = isinstance(a.local, np.ndarray) and a.dtype.newbyteorder("=") == b.dtype.newbyteorder("=")
    if a.dtype != b.dtype and not same_native:  # '>f8' and '<f8' multiply (converted below)
        raise TypeError(f"matmul: a and b must have the same dtype, got {a.dtype} and {b.dtype}; use .astype()")
    error = gemm_dtype_error(a.local)
    if error is not None:
        raise error
    if isinstance(panel, str):
        if panel != "auto" or grid_ndim != 2:
            allowed = "a positive int, None or 'auto'" if grid_ndim == 2 else "a positive int or None"
            raise ValueError(f"matmul: panel must be {allowed}, got {panel!r}")
        return None
    return check_panel(panel)


def native(x: DistTensor) -> DistTensor:
    """Local. ``x``, or a copy with blocks in native byte order (``from_local`` of ``'>f8'`` blocks)."""
    local = native_order(x.local)
    return x if local is x.local else DistTensor(local, x.grid, x.layout)


@register("matmul")
def matmul(
    a: DistTensor,
    b: DistTensor,
    *,
    panel: int | str | None = None,
    transpose_a: bool = False,
    transpose_b: bool = False,
) -> DistTensor:
    """Collective over grid. Distributed matrix product ``op(a) @ op(b)`` by SUMMA.

    ``op(x)`` is ``x`` or, with ``transpose_x``, ``x.T`` (never formed: the stored blocks
    are used as transposed views). The canonical layout is split ``(0, 1)`` for A, B and
    C on a grid ``(pr, pc)``; ``a @ b`` on DistTensors calls this function.

    Inputs that do not cut both dims (e.g. split ``(0, None)`` or replicated) are first
    redistributed to ``(0, 1)`` with :meth:`DistTensor.redistribute` (so a
    :class:`~hpctp.CommCounter` sees the move). With both inputs split ``(0, 1)`` the
    product runs without moving them: ``a @ b`` broadcasts panels of A along grid rows and
    of B along grid columns (stationary C); ``transpose_b`` broadcasts panels of B and
    reduces partial C columns (stationary A); ``transpose_a`` broadcasts panels of A and
    reduces partial C rows (stationary B); with both transposes the smaller input is
    redistributed to split ``(1, 0)`` first. See :mod:`hpctp.linalg.plan`.

    Parameters
    ----------
    a, b : DistTensor
        2-D tensors on the same 2-D grid, same dtype (float32/float64 typical) and backend
        (numpy, torch CPU/CUDA, cupy). Sizes may be uneven and blocks empty.
    panel : int or "auto", optional
        Panel width of the walked index. Default: the largest block of the walked index,
        cut into equal panels of at most 256 (:func:`hpctp.linalg.plan.default_panel`).
        ``"auto"``: the width of least predicted time on the machine the runtime prices with
        (:func:`hpctp.linalg.cost.recommend_panel_for` on :func:`hpctp.machine.runtime_cost_machine`:
        ``HPCTP_MACHINE``, or the planner's machine inside :func:`hpctp.machine.use_machine`).
    transpose_a, transpose_b : bool
        Use ``a.T`` / ``b.T``.

    Returns
    -------
    DistTensor
        ``C`` (``m x n``) split ``(0, 1)``, same backend and dtype as the inputs. Its row
        blocks follow ``op(a)``'s when C stays in place (and its column blocks ``op(b)``'s),
        otherwise they are balanced. Not differentiable; see :mod:`hpctp.nn.transformer.linear`.

    Raises
    ------
    TypeError
        If an input is not a DistTensor, dtypes or backends differ, the dtype has no
        product (bool; torch uint16/32/64, integers on a GPU), a transpose flag is not a
        bool, or ``panel`` is not an int, None or ``"auto"``. Blocks in non-native byte order are converted.
    ValueError
        If an input is not 2-D, the grids differ or are not 2-D, the inner dimensions
        differ, ``panel < 1`` or a string other than ``"auto"``. All raised on every rank before any
        communication.

    Examples
    --------
    >>> import numpy as np, hpctp
    >>> grid = hpctp.ProcessGrid([0, 0])
    >>> a = hpctp.random.normal((100, 30), grid, (0, 1), seed=1)
    >>> b = hpctp.random.normal((30, 70), grid, (0, 1), seed=2)
    >>> c = a @ b
    >>> c.shape, c.split
    ((100, 70), (0, 1))
    >>> bool(np.allclose(c.gather(None), a.gather(None) @ b.gather(None)))
    True
    >>> grid.free()
    """
    width = _check(a, b, transpose_a, transpose_b, panel)
    a, b = native(a), native(b)
    la, lb = required_layouts(a.layout, b.layout, transpose_a, transpose_b)
    if la != a.layout:
        a = a.redistribute(la)
    if lb != b.layout:
        b = b.redistribute(lb)
    if isinstance(panel, str):
        width = auto_panel(a.layout, b.layout, transpose_a, transpose_b, a.local)
    plan = plan_matmul(a.layout, b.layout, transpose_a, transpose_b, width)
    local = run_plan(plan, a.local, b.local, a.grid, transpose_a, transpose_b)
    return DistTensor(local, a.grid, plan.c_layout)
