"""Distributed linear algebra on 2-D process grids: SUMMA matrix products.

* :func:`matmul` -- ``op(a) @ op(b)`` of 2-D :class:`~hpctp.DistTensor` objects.
* :func:`summa_block` -- the same on local blocks and layouts (used by :mod:`hpctp.nn.transformer.linear`).
* :func:`matmul_25d` -- 2.5D SUMMA on a ``(pr, pc, layers)`` grid (inputs replicated over layers).
* :mod:`hpctp.linalg.plan` -- pure planning (variants, panels); :mod:`hpctp.linalg.cost` (also ``hpctp.perf``) models its cost.
"""

from .matmul import matmul
from .plan import MatmulPlan, default_panel, plan_matmul, required_layouts
from .summa import run_plan, summa_block
from .summa25d import matmul_25d

__all__ = [
    "MatmulPlan",
    "default_panel",
    "matmul",
    "matmul_25d",
    "plan_matmul",
    "required_layouts",
    "run_plan",
    "summa_block",
]
