"""The messages each kind of layer sends on a grid, from the plans the layers themselves run.

A *message model* takes a module and a :class:`Site` (the model grid's shape, a rank's coordinates on it
and the layer's global input and output shapes for the plan being priced) and returns the
:class:`Message` list that rank sends in one forward and one backward pass. The figures are those
:class:`hpctp.CommCounter` reports (bytes sent and received, messages), computed from the same pure
plans the layers execute:

* convolutions and pooling (:class:`hpctp.nn.Conv2d` ...): the halo of their windows,
  :func:`hpctp.halo.fetch_plan` in forward and its adjoint in backward;
* Fourier layers (:class:`hpctp.nn.SpectralConv2d` ...): over the axes splitting the field, a reduce-scatter
  of the kept spectrum into each rank's run of modes and an all-gather of the mixed runs in forward; in
  backward their adjoints and the all-gather of the weight gradient's runs;
* tensor-parallel modules (any module owning parameters split over the tensor axis, Megatron's
  column-then-row pattern): one all-reduce of the output over the tensor axis in forward, one of the
  input's gradient in backward;
* the loss (:func:`hpctp.nn.global_mse_loss`): one all-reduce of three float64 over the data and
  spatial axes.

Other modules are local unless a model registers a model for its own modules with
:func:`register_layer` (``apps.surrogate.autoplan`` registers the ViT's global attention, whose
K/V ring is priced by :func:`hpctp.perf.predict_attention`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..halo import fetch_plan
from ..layout import Layout, block_cuts, grid_rank
from ..nn import (
    AvgPool2d,
    AvgPool3d,
    Conv1d,
    Conv2d,
    Conv3d,
    MaxPool2d,
    MaxPool3d,
    SpectralConv1d,
    SpectralConv2d,
    SpectralConv3d,
)
from ..nn.spectral._modes import mode_cuts
from .workload import SPLIT_PATH_LAYERS

__all__ = [
    "Message",
    "Site",
    "MessageModel",
    "FLOPS_OVERRIDES",
    "POINT_FREE_SHARES",
    "register_layer",
    "layer_messages",
    "loss_messages",
    "halo_messages",
    "tensor_messages",
    "window_messages",
    "spectral_messages",
    "spectral_flops",
    "spectral_share",
]

_BOUNDARY = {"zeros": "zero", "circular": "periodic", "reflect": "reflect", "replicate": "replicate"}


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
    held : int
        Bytes of message buffers the layer allocates and holds while it computes this phase, which a one-rank
        trace does not see (buffers of :mod:`hpctp.comm.pool` are not counted: the pool keeps its own).
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
    held: int = 0


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


MessageModel = Callable[[Any, Site], list[Message]]
"""``model(module, site) -> messages``: the message model of a kind of module."""
_REGISTRY: dict[type, MessageModel] = {}


def register_layer(cls: type, model: MessageModel | None = None) -> Any:
    """Local. Price the messages of ``cls``'s modules (and its subclasses') with ``model(module, site)``.

    Usable as a decorator (``@register_layer(MyAttention)``). A model registered for a class takes
    precedence over those of its base classes.

    Parameters
    ----------
    cls : type
        A ``torch.nn.Module`` subclass.
    model : callable, optional
        ``model(module, site) -> list[Message]``.

    Returns
    -------
    callable
        ``model`` (or the decorator).

    Raises
    ------
    TypeError
        If ``cls`` is not a Module class.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise TypeError(f"register_layer takes a torch.nn.Module class, got {cls!r}")
    if model is None:
        return lambda fn: register_layer(cls, fn)
    _REGISTRY[cls] = model
    return model


def _model_of(module: torch.nn.Module) -> MessageModel | None:
    for cls in type(module).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    return None


def layer_messages(module: torch.nn.Module, site: Site, tensor_layer: bool = False) -> list[Message]:
    """Local. The messages ``module`` sends at ``site`` in one forward and backward (its registered model; a
    tensor-parallel module's all-reduces when ``tensor_layer`` and no model is registered for it).

    Parameters
    ----------
    module : torch.nn.Module
    site : Site
    tensor_layer : bool
        The module owns parameters split over the tensor axis.

    Returns
    -------
    list of Message
    """
    model = _model_of(module)
    if model is not None:
        return model(module, site)
    if tensor_layer:
        return tensor_messages(site)
    return []


# ---------------------------------------------------------------------------------------------- helpers
def _allreduce(phase: str, axes: tuple[int, ...], nbytes: int, role: str, dims: tuple[int, ...]) -> list[Message]:
    if math.prod(dims[a] for a in axes) <= 1 or nbytes <= 0:
        return []
    return [Message(phase, "Allreduce", "allreduce", axes, nbytes, nbytes, nbytes, 1, False, role)]


def tensor_messages(site: Site) -> list[Message]:
    """Local. A Megatron-pattern module: all-reduce of its output over the tensor axis in forward, of its
    input's gradient in backward."""
    if site.tensor is None or site.dims[site.tensor] <= 1:
        return []
    out: list[Message] = []
    if site.output is not None:
        block = site.layout(site.output, site.output_dims).local_shape(site.coords)
        out += _allreduce("fwd", (site.tensor,), math.prod(block) * site.itemsize, "tensor", site.dims)
    if site.inputs is not None:
        block = site.layout(site.inputs, site.input_dims).local_shape(site.coords)
        out += _allreduce("bwd", (site.tensor,), math.prod(block) * site.itemsize, "tensor", site.dims)
    return out


def halo_messages(layout: Layout, rank: int, wants: tuple[tuple[tuple[int, int], ...], ...],
                  boundary: tuple[str, ...], itemsize: int, *, adjoint: bool = True, overlap: bool = True
                  ) -> list[Message]:  # fmt: skip
    """Local. The point-to-point messages of fetching ``wants`` (:func:`hpctp.halo.fetch_plan`) and, with
    ``adjoint``, of its adjoint in backward (each message goes back the other way).

    Returns
    -------
    list of Message
        One per direction with messages, or none.
    """
    plan = fetch_plan(layout, rank, wants, boundary)
    axes = tuple(sorted({a for a in layout.split if a is not None and layout.grid_dims[a] > 1}))
    sends = [m.size * itemsize for m in plan.sends]
    recvs = [m.size * itemsize for m in plan.recvs]
    out = []
    if sends or recvs:
        out.append(Message("fwd", "Isend", "p2p", axes, max(sends + recvs), sum(sends), sum(recvs), len(sends),
                           overlap))  # fmt: skip
        if adjoint:
            out.append(Message("bwd", "Isend", "p2p", axes, max(sends + recvs), sum(recvs), sum(sends), len(recvs),
                               overlap))  # fmt: skip
    return out


def _windows(module: Any, nd: int, sizes: Sequence[int], pool: bool) -> list[tuple[int, int, int, int, int]]:
    """(extent, stride, pad_lo, pad_hi, out size) per spatial dim of a torch conv/pool module."""

    def tup(v: Any) -> tuple[int, ...]:
        return tuple(v) if isinstance(v, (tuple, list)) else (int(v),) * nd

    k = tup(module.kernel_size)
    stride = tup(module.stride if module.stride is not None else module.kernel_size)
    dil = tup(getattr(module, "dilation", 1))
    out = []
    for d in range(nd):
        extent = dil[d] * (k[d] - 1) + 1
        pad = module.padding
        if pad == "same":
            lo, hi = (extent - 1) // 2, extent - 1 - (extent - 1) // 2
        elif pad == "valid":
            lo = hi = 0
        else:
            lo = hi = tup(pad)[d]
        size = (sizes[d] + lo + hi - extent) // stride[d] + 1
        out.append((extent, stride[d], lo, hi, size))
    return out


def window_messages(module: torch.nn.Module, site: Site, nd: int, pool: bool = False) -> list[Message]:
    """Local. The halo of a convolution or pooling on the field (what :mod:`hpctp.nn`'s window engine fetches)."""
    if site.inputs is None or not site.spatial_axes():
        return []
    shape = site.inputs
    lay = site.layout(shape, site.input_dims)
    fdims = sorted(site.input_dims)  # the tensor dims holding the field, in field order
    sizes = [shape[d] for d in fdims]
    wins = _windows(module, nd, sizes, pool)
    boundary_d = "zero" if pool else _BOUNDARY.get(getattr(module, "padding_mode", "zeros"), "zero")
    out_cuts = []
    for d, w in zip(fdims, wins):
        parts = lay.parts(d)
        out_cuts.append(block_cuts(w[4], parts))
    wants: list[tuple[tuple[int, int], ...]] = []
    boundary: list[str] = []
    j = 0
    for d in range(len(shape)):
        if d not in site.input_dims:
            wants.append(((0, shape[d]),) * lay.parts(d))
            boundary.append("zero")
            continue
        extent, stride, lo, hi, _ = wins[j]
        native = lay.parts(d) == 1 and boundary_d == "zero" and lo == hi
        if native:
            wants.append(((0, shape[d]),))
        else:
            oc = out_cuts[j]
            wants.append(tuple(
                (o0 * stride - lo, (o1 - 1) * stride - lo + extent) if o1 > o0 else (0, 0)
                for o0, o1 in zip(oc[:-1], oc[1:])
            ))  # fmt: skip
        boundary.append(boundary_d)
        j += 1
    overlap = bool(getattr(module, "overlap", True))
    return halo_messages(lay, site.rank, tuple(wants), tuple(boundary), site.itemsize, overlap=overlap)


def _mode_runs(module: Any, site: Site) -> tuple[tuple[int, ...], list[int], int]:
    """The axes splitting a Fourier layer's field, every rank's run of the kept modes over the ranks of those axes
    (:func:`hpctp.nn.spectral._modes.mode_cuts`) and this rank's index among them (row-major)."""
    axes = site.spatial_axes()
    sizes = tuple(site.dims[a] for a in axes)
    cuts = mode_cuts(math.prod(int(k) for k in module.weight.shape[2:-1]), math.prod(sizes))
    runs = [hi - lo for lo, hi in zip(cuts[:-1], cuts[1:])]
    return axes, runs, grid_rank(tuple(site.coords[a] for a in axes), sizes)


def spectral_messages(module: Any, site: Site) -> list[Message]:
    """Local. A Fourier layer (:mod:`hpctp.nn.spectral._modes`): forward, the kept spectrum of its input
    reduce-scattered into each rank's run of modes and the mixed runs all-gathered; backward, the output spectrum's
    gradient reduce-scattered and the runs of the weight's and the input spectrum's gradients all-gathered. Complex
    values of the weight's dtype."""
    axes, runs, k = _mode_runs(module, site)
    if not axes or site.inputs is None:
        return []
    w = module.weight
    q, kept, mine = len(runs), sum(runs), runs[k]
    others = sum(1 for j, n in enumerate(runs) if n and j != k)
    item = 2 * w.element_size()
    batch, cin, cout = site.inputs[0], int(w.shape[0]), int(w.shape[1])

    # held: what the one-rank trace (no messages) does not see, the modes-first copies the messages read and the
    # buffer a gather fills before its values go back in place: the whole spectrum's and this rank's run
    def scatter(phase: str, rows: int) -> Message:
        return Message(phase, "Ireduce_scatter", "reduce_scatter", axes, kept * rows * item,
                       (kept - mine) * rows * item, mine * rows * item * (q - 1), others, False, "spatial",
                       (kept + mine) * rows * item)  # fmt: skip

    def gather(phase: str, rows: int) -> Message:
        return Message(phase, "Iallgatherv", "allgather", axes, kept * rows * item,
                       mine * rows * item * (q - 1), (kept - mine) * rows * item, q - 1 if mine else 0, False,
                       "spatial", (kept + mine) * rows * item)  # fmt: skip

    return [scatter("fwd", batch * cin), gather("fwd", batch * cout),
            scatter("bwd", batch * cout), gather("bwd", cin * cout), gather("bwd", batch * cin)]  # fmt: skip


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


register_layer(Conv1d, lambda m, s: window_messages(m, s, 1))
register_layer(Conv2d, lambda m, s: window_messages(m, s, 2))
register_layer(Conv3d, lambda m, s: window_messages(m, s, 3))
register_layer(MaxPool2d, lambda m, s: window_messages(m, s, 2, pool=True))
register_layer(MaxPool3d, lambda m, s: window_messages(m, s, 3, pool=True))
register_layer(AvgPool2d, lambda m, s: window_messages(m, s, 2, pool=True))
register_layer(AvgPool3d, lambda m, s: window_messages(m, s, 3, pool=True))
for _cls in (SpectralConv1d, SpectralConv2d, SpectralConv3d):
    register_layer(_cls, spectral_messages)

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
