"""A layer that changes how a field is cut: :class:`Redistribute`."""

from __future__ import annotations

from typing import Any

import torch

from ...comm import ProcessGrid, check_grid
from ...layout import Layout
from ...ops.autograd import redistribute
from ...tensor.core import DistTensor

__all__ = ["Redistribute"]


class Redistribute(torch.nn.Module):
    """Collective over grid. Moves DistTensors to another split, and optionally onto another shape of the same ranks.

    The one place a model changes how its field or tokens are cut (e.g. an encoder on rows x columns, a decoder on
    rows only; or a stage on a 2 x 3 model grid, the next on 6 x 1). Differentiable: backward moves the gradient
    back. In a :class:`~hpctp.nn.PipelineParallel` whose stage starts with it, the previous stage sends each piece
    of its output straight to the rank that keeps it in the new layout (the redistribution fused into the pipeline's
    messages), and this layer then has nothing left to do.

    Parameters
    ----------
    split : split specification
        The target split (balanced blocks; see :class:`hpctp.Layout`), of the grid below.
    grid : ProcessGrid, optional
        Another grid of the input's ranks (the same communicator, another shape) to move onto; default: the input's.

    Raises
    ------
    TypeError
        If ``grid`` is not a ProcessGrid.
    """

    def __init__(self, split: Any, grid: ProcessGrid | None = None) -> None:
        super().__init__()
        self.split = split
        self.grid = None if grid is None else check_grid(grid)
        self._same_ranks: set[int] = set()  # ids of input grids checked against ``grid``

    def target(self, layout: Layout) -> Layout:
        """Local. The layout a tensor of ``layout`` moves to.

        Raises
        ------
        ValueError
            If the split does not fit the tensor or the grid, or the grid has another number of ranks.
        """
        dims = self.grid.dims if self.grid is not None else layout.grid_dims
        out = Layout(layout.global_shape, dims, self.split)
        if out.nranks != layout.nranks:
            raise ValueError(
                f"Redistribute: the grid {dims} has {out.nranks} ranks, the input's {layout.grid_dims} {layout.nranks}; "
                "give a grid of the same ranks"
            )
        return out

    def forward(self, x: Any) -> Any:
        """Collective over grid. ``x`` (a DistTensor, or a tuple whose DistTensors all move) in the target layout;
        plain tensors pass through."""
        if isinstance(x, tuple):
            return tuple(self._move(v) for v in x)
        return self._move(x)

    def _move(self, x: Any) -> Any:
        if not isinstance(x, DistTensor):
            return x
        dst = self.target(x.layout)
        to = self.grid if self.grid is not None else x.grid
        if to is not x.grid and id(x.grid) not in self._same_ranks:
            if not x.grid.same_ranks(to):
                raise ValueError(
                    f"Redistribute: its grid {to.dims} does not hold the input grid's {x.grid.dims} ranks in the same "
                    "order; build both grids on one communicator"
                )
            self._same_ranks.add(id(x.grid))
        if dst == x.layout:
            return x if to is x.grid else DistTensor(x.local, to, dst)
        return DistTensor(redistribute(x.local, x.grid, x.layout, dst), to, dst)

    def extra_repr(self) -> str:
        return f"split={self.split}" + (f", grid={self.grid.dims}" if self.grid is not None else "")
