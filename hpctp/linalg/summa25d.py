"""2.5D matmul: SUMMA on a ``(pr, pc, c)`` grid whose ``c`` layers each walk 1/c of the panels.

The inputs are replicated over the ``c`` layers (grid axis 2), as the 2.5D algorithm
(Solomonik and Demmel, 2011) trades memory for communication: layer ``l`` broadcasts
and multiplies only panels ``l, l + c, l + 2c, ...`` (stationary C, within its own
``pr x pc`` grid), then the partial C blocks are summed over the layers with one
all-reduce. Per rank that moves ``1/c`` of SUMMA's panel volume plus one C block.
"""

from __future__ import annotations

from .. import comm as C
from ..layout import Layout
from ..tensor.core import DistTensor
from .local import zeros_like_backend
from .matmul import _check, native
from .plan import layer_plan, plan_25d
from .summa import _no_autograd, _Op, _stationary_c

__all__ = ["matmul_25d", "plan_25d", "layer_plan"]


def matmul_25d(
    a: DistTensor,
    b: DistTensor,
    *,
    panel: int | None = None,
    transpose_a: bool = False,
    transpose_b: bool = False,
) -> DistTensor:
    """Collective over grid. ``op(a) @ op(b)`` by 2.5D SUMMA on a 3-D grid ``(pr, pc, c)``.

    Inputs are moved (with :meth:`DistTensor.redistribute`) to ``op(x)`` split ``(0, 1)``,
    replicated over the ``c`` layers, unless already there; create them that way (e.g.
    ``hpctp.random.normal(shape, grid, (0, 1))`` on the 3-D grid) to avoid the move.

    Parameters
    ----------
    a, b : DistTensor
        2-D tensors on the same 3-D grid, same dtype and backend.
    panel : int, optional
        Panel width of k (default: see :func:`plan_25d`).
    transpose_a, transpose_b : bool
        Use ``a.T`` / ``b.T``.

    Returns
    -------
    DistTensor
        ``C`` split ``(0, 1)``, replicated over grid axis 2 (every layer holds it).

    Raises
    ------
    TypeError
        As :func:`hpctp.linalg.matmul`.
    ValueError
        If the grid is not 3-D, inputs are not 2-D, inner dimensions differ or
        ``panel < 1``; on every rank before any communication.
    """
    width = _check(a, b, transpose_a, transpose_b, panel, grid_ndim=3)
    a, b = native(a), native(b)
    grid = a.grid
    a, b = _placed(a, transpose_a), _placed(b, transpose_b)
    plan = plan_25d(a.layout, b.layout, transpose_a, transpose_b, width)
    layers, layer = grid.dims[2], grid.coords[2]
    mine = layer_plan(plan, layer, layers)
    out = zeros_like_backend(plan.c_layout.local_shape(grid.coords[:2]), a.dtype, a.local)
    with _no_autograd(a.local):
        _stationary_c(mine, grid, _Op(a.local, transpose_a), _Op(b.local, transpose_b), out)
    C.allreduce(grid.sub(2), out)
    c_layout = Layout(plan.c_layout.global_shape, grid.dims, (0, 1), plan.c_layout.cuts)
    return DistTensor(out, grid, c_layout)


def _placed(x: DistTensor, transpose: bool) -> DistTensor:
    """``x`` with ``op(x)`` split ``(0, 1)`` (replicated over the layers), redistributed if needed."""
    split = (1, 0) if transpose else (0, 1)
    return x if x.layout.split == split else x.redistribute(x.layout.with_split(split))
