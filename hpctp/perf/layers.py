"""What the planner prices per layer beside the trace: its messages as :class:`Message` records, where it runs
(:class:`Site`), and the work of layers that compute another way on a split field.

* :class:`Message`: one collective call, or one pass's point-to-point exchange, on one rank, as
  :class:`hpctp.CommCounter` counts it and as :func:`hpctp.perf.collective_time` prices it. What each layer
  sends is read off its own code run on a virtual grid (:mod:`hpctp.perf.dryrun`): no message model per layer.
* the loss (:func:`hpctp.nn.global_mse_loss`): one all-reduce of three float64 over the data and spatial axes;
* Fourier layers on a split field (:data:`FLOPS_OVERRIDES`, :data:`POINT_FREE_SHARES`): truncated DFTs by matrix
  products and each rank's run of the kept modes, where the one-process trace saw FFTs over all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..layout import Layout, grid_rank
from ..nn import SpectralConv1d, SpectralConv2d, SpectralConv3d
from ..nn.spectral._modes import mode_cuts
from .workload import SPLIT_PATH_LAYERS

__all__ = [
    "Message",
    "Site",
    "FLOPS_OVERRIDES",
    "POINT_FREE_SHARES",
    "loss_messages",
    "spectral_flops",
    "spectral_share",
]


@dataclass(frozen=True)
class Message:
    """Local. One collective call (or one rank's point-to-point messages of one exchange) on one rank.

    Attributes
    ----------
    phase : {"fwd", "bwd", "step"}
    op : str
        The operation as :class:`hpctp.CommCounter` names it (``"Allreduce"``, ``"Isend"``, ...).
    kind : str
        How the machine prices it (:data:`hpctp.perf.machine.KINDS`).
    axes : tuple of int
        The model-grid axes its communicator spans (for a point-to-point exchange: the axes its peers
        differ along).
    nbytes : int
        The size the kind's formula takes (:func:`hpctp.perf.collective_time`): the vector of an
        all-reduce, a point-to-point exchange's largest message.
    sent, recv, count : int
        What :class:`hpctp.CommCounter` counts on this rank: bytes sent, received, messages.
    overlap : bool
        Whether the layer computes while it is in flight.
    role : str
        Which parallelism it belongs to (``"spatial"``, ``"tensor"``, ``"data"``, ``"pipeline"``).
    """

    phase: str
    op: str
    kind: str
    axes: tuple[int, ...]
    nbytes: int
    sent: int
    recv: int
    count: int
    overlap: bool = False
    role: str = "spatial"


@dataclass(frozen=True)
class Site:
    """Local. Where a layer runs: the model grid (spatial axes, then the tensor axis), a rank on it, the shapes.

    Attributes
    ----------
    dims : tuple of int
        The model grid: ``(S_1, ..., S_d, T)`` (``T`` present when the plan has a tensor axis).
    coords : tuple of int
        The rank's coordinates on it.
    spatial : tuple of int
        The model-grid axis of each field dim.
    tensor : int or None
        The model-grid tensor axis.
    inputs, output : tuple of int or None
        The layer's first input's and output's global shapes (batch: one micro-batch of a data group).
    input_dims, output_dims : dict
        ``{tensor dim: field dim}``: which dims of ``inputs`` / ``output`` hold the field.
    itemsize : int
    tensor_units : int or None
    """

    dims: tuple[int, ...]
    coords: tuple[int, ...]
    spatial: tuple[int, ...]
    tensor: int | None
    inputs: tuple[int, ...] | None
    output: tuple[int, ...] | None
    input_dims: dict[int, int] = field(default_factory=dict)
    output_dims: dict[int, int] = field(default_factory=dict)
    itemsize: int = 4
    tensor_units: int | None = None

    @property
    def rank(self) -> int:
        """Local. The rank's row-major index on the model grid."""
        return grid_rank(self.coords, self.dims)

    def layout(self, shape: Sequence[int], field_dims: dict[int, int]) -> Layout:
        """Local. The layout of a tensor of ``shape`` whose dims ``field_dims`` (tensor dim -> field dim) are cut as
        the field."""
        split: list[int | None] = [None] * len(shape)
        for d, fd in field_dims.items():
            split[d] = self.spatial[fd]
        return Layout(tuple(shape), self.dims, tuple(split))

    def spatial_axes(self) -> tuple[int, ...]:
        """Local. The spatial axes that hold more than one rank."""
        return tuple(a for a in self.spatial if self.dims[a] > 1)


# ---------------------------------------------------------------------------------------------- helpers
def _allreduce(phase: str, axes: tuple[int, ...], nbytes: int, role: str, dims: tuple[int, ...]) -> list[Message]:
    if math.prod(dims[a] for a in axes) <= 1 or nbytes <= 0:
        return []
    return [Message(phase, "Allreduce", "allreduce", axes, nbytes, nbytes, nbytes, 1, False, role)]


def _mode_runs(module: Any, site: Site) -> tuple[tuple[int, ...], list[int], int]:
    """The axes splitting a Fourier layer's field, every rank's run of the kept modes over the ranks of those axes
    (:func:`hpctp.nn.spectral._modes.mode_cuts`) and this rank's index among them (row-major)."""
    axes = site.spatial_axes()
    sizes = tuple(site.dims[a] for a in axes)
    cuts = mode_cuts(math.prod(int(k) for k in module.weight.shape[2:-1]), math.prod(sizes))
    runs = [hi - lo for lo, hi in zip(cuts[:-1], cuts[1:])]
    return axes, runs, grid_rank(tuple(site.coords[a] for a in axes), sizes)


def spectral_flops(module: Any, site: Site) -> dict[tuple[str, str], float]:
    """Local. A spatially split Fourier layer's GEMM flops on the rank, forward and backward (truncated DFTs by matrix
    products along each axis, :mod:`hpctp.nn.fourier`; a complex product counts four real ones), and the flops over
    each product's smallest dimension (``"gemm_small"``). One process uses FFTs instead, which the trace saw."""
    if site.inputs is None or not site.spatial_axes():
        return {}
    w = module.weight
    cin, cout = int(w.shape[0]), int(w.shape[1])
    modes = [int(k) for k in w.shape[2:-1]]  # kept modes per axis (2 m; m on the last)
    lay = site.layout(site.inputs, site.input_dims)
    local = lay.local_shape(site.coords)
    n = [local[d] for d in sorted(site.input_dims)]
    b = local[0]
    dft = [0.0, 0.0]  # (flops, flops / smallest dimension) of the transforms
    mix = [0.0, 0.0]

    def gemm(acc: list[float], m: float, k: float, nn: float, factor: float) -> None:
        f = factor * 2.0 * m * k * nn
        acc[0] += f
        acc[1] += f / max(1.0, min(m, k, nn))

    shape = list(n)
    last = len(n) - 1
    gemm(dft, b * cin * math.prod(shape[:last]), shape[last], modes[last], 2.0)  # real block x complex matrix
    shape[last] = modes[last]
    for i in range(last - 1, -1, -1):
        gemm(dft, b * cin * math.prod(shape) / shape[i], shape[i], modes[i], 4.0)
        shape[i] = modes[i]
    _, runs, k = _mode_runs(module, site)  # (the mix: this rank's run of the kept modes)
    run = runs[k]
    gemm(mix, b * run, cin, cout, 4.0)
    mix[1] = 4.0 * 2.0 * b * cin * cout * run / max(1.0, min(b, cin, cout))
    shape = list(modes)
    for i in range(last):
        gemm(dft, b * cout * math.prod(shape) / shape[i], shape[i], n[i], 4.0)
        shape[i] = n[i]
    gemm(dft, b * cout * math.prod(shape[:last]), modes[last], n[last], 2.0)  # complex x matrix, real part
    return {("fwd", "gemm"): dft[0] + mix[0], ("fwd", "gemm_small"): dft[1] + mix[1],
            ("bwd", "gemm"): dft[0] + 2 * mix[0], ("bwd", "gemm_small"): dft[1] + 2 * mix[1]}  # fmt: skip


def loss_messages(loss_axes: tuple[int, ...], dims: tuple[int, ...], whole: bool) -> list[Message]:
    """Local. :func:`hpctp.nn.global_mse_loss`: the sum, the count and an error flag (three float64) all-reduced over
    the data and spatial axes (``loss_axes`` of the grid ``dims``): one call on the whole grid's communicator when
    they are all its axes (``whole``), else one per axis of more than one rank."""
    if whole:
        return _allreduce("fwd", loss_axes, 24, "data", dims)
    return [m for a in loss_axes for m in _allreduce("fwd", (a,), 24, "data", dims)]


FLOPS_OVERRIDES: dict[type, Callable[[Any, Site], dict[tuple[str, str], float]]] = {
    SpectralConv1d: spectral_flops,
    SpectralConv2d: spectral_flops,
    SpectralConv3d: spectral_flops,
}
"""Layers whose computation on a split field differs from the one-process run the trace sees."""


def spectral_share(module: Any, site: Site) -> float:
    """Local. The share of a Fourier layer's work on its kept spectrum that this rank does: its run of the kept modes
    over all of them where the field is split (:mod:`hpctp.nn.spectral._modes`), 1 on a whole field."""
    axes, runs, k = _mode_runs(module, site)
    return runs[k] / sum(runs) if axes and sum(runs) else 1.0


POINT_FREE_SHARES: dict[type, Callable[[Any, Site], float]] = {cls: spectral_share for cls in SPLIT_PATH_LAYERS}
"""Layers whose ranks divide the elementwise work of the one-process trace that does not grow with the field's
points (the fit's value at zero points; a Fourier layer's mix of its kept modes) by the share this gives."""
