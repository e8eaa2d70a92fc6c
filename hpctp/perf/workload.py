"""What one training step of a model holds and computes, from forward and backward traced on the meta device.

:func:`trace` builds the model on a one-rank :class:`~hpctp.nn.ParallelPlan` whose axes (data, the
spatial axes, tensor) all hold one rank, on the ``meta`` device, and runs a forward, the loss and the
backward of a small sample four times: with 1 and 2 samples, on a field of ``f`` and of ``2 f`` points
per dim. Nothing is computed or allocated (meta tensors have shapes only), so any model size traces
in about a second. A dispatch mode sees every operator; each is attributed to the innermost module
running it (forward: module hooks; backward: the autograd node's module, recorded in forward):

* **memory**: every storage an operator creates is followed until torch frees it, so the trace
  knows the live bytes at each moment, split by owner; a snapshot is kept where the running module
  changes and at each module's largest moment. Across the four probes the snapshots line up, and each
  owner's bytes are fitted as ``c0 + cb b + cp p + cbp b p`` (``b``: samples, ``p``: field points), which
  the planner evaluates at a rank's block. The parameters' gradients are kept apart (the stage of
  sharded data parallelism decides where they live). The same timeline by sharding unit, every
  snapshot (:class:`UnitTimeline`), gives what a pipeline stage holds while it computes.
* **computation**: flops per module, direction and kind (GEMM, convolution, attention, FFT; torch's
  flop formulas), fitted the same way, except kernels whose flops grow with the square of the points
  (attention over every token), which a rank computes for its own queries against all keys; kernel
  launches and the bytes of elementwise work.
* **structure**: every parameter with its layout (which dim the tensor axis splits, whether its
  gradient is partial over the spatial axes), the sharding units (the modules that
  :class:`~hpctp.nn.ShardedDataParallel` gathers one at a time, in forward order), and each module's
  input and output shapes as functions of the sample (for the messages of :mod:`hpctp.perf.layers`).

Tensor parallelism: a module that owns parameters split over the tensor axis computes on its share of
heads or hidden units between a replicated input and a replicated output (Megatron's column-then-row
pattern), so its allocations are divided by the tensor axis's size except those of its input's or
output's shape, and so are its flops. With activation recomputation (``recompute``) the four probes run
again with the model's layers checkpointed, so the recomputed forward shows up in backward.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..comm import ProcessGrid
from ..layout import Layout
from ..nn import ParallelPlan, checkpoint_forward
from ..nn._deferred_weights import recording as linear_recording
from ..nn.spatial._inputs import InputGridError, InputSplitError
from ..nn.spectral import SpectralConv1d, SpectralConv2d, SpectralConv3d
from ..nn.spectral.fourier import split_path_on_whole_fields
from ..tensor.core import DistTensor
from .host import clock_costs, host_count

__all__ = [
    "CATEGORIES",
    "GRADS",
    "HOST_PROBE_BYTES",
    "HOST_STEPS",
    "OUTPUTS",
    "OUTSIDE",
    "PROBE_POINTS",
    "SPLIT_PATH_LAYERS",
    "Builder",
    "Bilinear",
    "Geometry",
    "LayerInfo",
    "ParamInfo",
    "Sample",
    "Trace",
    "UnitInfo",
    "UnitTimeline",
    "WAITS",
    "Workload",
    "default_layers",
    "fft_flops",
    "trace",
]

Builder = Callable[[ParallelPlan], torch.nn.Module]
"""A model builder: takes the training plan, returns the model built on ``plan.model_grid`` (whose
spatial axes split the field, and the tensor axis, if the plan has one, the weights)."""

HOST_PROBE_BYTES = 256 << 20
"""Largest model (bytes of parameters) whose host time :func:`trace` measures with a real small step on this CPU."""
PROBE_POINTS = 32
"""Field points per dim of the smaller probe (the larger one has twice as many per dim): large enough
that halo strips are a small share of a block, small enough to trace fast. Raised to the model's
smallest valid size (e.g. ``2 modes`` of a Fourier layer) when the model refuses it."""

_VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "as_strided", "detach", "alias",
    "unsqueeze", "squeeze", "select", "slice", "narrow", "split", "split_with_sizes", "unbind", "view_as_real",
    "view_as_complex", "_reshape_alias", "unflatten", "flatten", "movedim", "diagonal", "lift_fresh",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_to_copy_meta", "set_", "resize_",
    "sym_size", "sym_stride", "sym_numel", "is_same_size", "_has_compatible_shallow_copy_type",
}  # fmt: skip
_GEMM = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}
_CONV = {"convolution", "_convolution", "convolution_backward", "cudnn_convolution", "_slow_conv2d_forward",
         "convolution_overrideable"}  # fmt: skip
_FFT = {"_fft_r2c", "_fft_c2r", "_fft_c2c"}


def fft_flops(numel: int, points: int) -> float:
    """Local. The flops counted for FFTs of ``points`` points over ``numel`` input elements in all (``2.5 n log2 n`` per
    transform of ``n`` points, the convention of FFT benchmarks; :func:`hpctp.perf.calibrate` uses the same)."""
    return 2.5 * numel * math.log2(max(points, 2))


CATEGORIES = ("gemm", "conv", "attention", "fft", "gemm_small", "softmax")
"""Kinds of computation, each priced at its own rate (:class:`hpctp.perf.ComputeRates`); ``gemm_small`` sums each
GEMM's flops over its smallest dimension (what :attr:`hpctp.perf.ComputeRates.gemm_half` prices: small GEMMs run
below the peak rate); ``softmax`` counts attention scores, not flops (:attr:`hpctp.perf.ComputeRates.softmax`)."""


@dataclass(frozen=True)
class Sample:
    """Local. The global batch a step trains on: ``[batch, channels, *field]``, the field split by the spatial axes.

    Attributes
    ----------
    shape : tuple of int
        ``(B, C, n_1, ..., n_d)``: ``B`` samples per step (the data axes and micro-batches share them).
    dtype : str
        The element type of the inputs and parameters (``"float32"``, ``"float64"``, ``"bfloat16"``).
    spatial_multiple : int
        A spatial cut must fall on a multiple of this (e.g. a ViT's patch): a rank's block is a whole
        number of such cells per dim.
    tensor_units : int, optional
        Indivisible units the tensor axis splits (attention heads): the busiest rank holds
        ``ceil(units / T)`` of them; default: elements, ``1 / T`` of each split tensor.
    """

    shape: tuple[int, ...]
    dtype: str = "float32"
    spatial_multiple: int = 1
    tensor_units: int | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if len(shape) < 3 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
            raise ValueError(
                f"sample shape must be (batch, channels, *field) of positive ints with at least one field dim, "
                f"got {self.shape!r}"
            )
        object.__setattr__(self, "shape", shape)
        if self.dtype not in ("float32", "float64", "bfloat16", "float16"):
            raise ValueError(f"sample dtype must be float32, float64, bfloat16 or float16, got {self.dtype!r}")
        m = self.spatial_multiple
        if not isinstance(m, int) or m < 1 or any(n % m for n in shape[2:]):
            raise ValueError(f"spatial_multiple={m!r} must be a positive int dividing every field dim of {shape}")
        if self.tensor_units is not None and (not isinstance(self.tensor_units, int) or self.tensor_units < 1):
            raise ValueError(f"tensor_units must be a positive int or None, got {self.tensor_units!r}")

    @property
    def batch(self) -> int:
        """Local. Samples per step."""
        return self.shape[0]

    @property
    def field(self) -> tuple[int, ...]:
        """Local. The field's sizes."""
        return self.shape[2:]

    @property
    def torch_dtype(self) -> torch.dtype:
        """Local. The element type as a torch dtype."""
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    @property
    def itemsize(self) -> int:
        """Local. Bytes per element."""
        return torch.empty((), dtype=self.torch_dtype).element_size()


@dataclass(frozen=True)
class Bilinear:
    """Local. ``c0 + cb b + cp p + cbp b p`` of ``b`` samples of ``p`` field points (``quadratic``: ``c b p P``,
    a rank's ``p`` points against the whole field's ``P``)."""

    c: tuple[float, float, float, float]
    quadratic: bool = False

    def __call__(self, b: float, p: float, whole: float | None = None) -> float:
        """Local. The value at ``b`` samples of ``p`` points each (``whole``: the field's points, quadratic only)."""
        if self.quadratic:
            return max(0.0, self.c[0] * b * p * (p if whole is None else whole))
        c0, cb, cp, cbp = self.c
        return max(0.0, c0 + cb * b + cp * p + cbp * b * p)

    @staticmethod
    def fit(
        values: Sequence[float], bs: tuple[float, float], ps: tuple[float, float], square: bool = False
    ) -> Bilinear:
        """Local. Through four values at ``(b0, p0), (b0, p1), (b1, p0), (b1, p1)``; ``square`` tries ``c b p^2`` first."""
        v00, v01, v10, v11 = (float(v) for v in values)
        (b0, b1), (p0, p1) = bs, ps
        if square and v00 > 0 and v11 > 0:
            grow = math.log(max(v01, 1e-300) / v00) / math.log(p1 / p0)
            if grow > 1.5:  # the square of the points: every token against every token
                return Bilinear((v11 / (b1 * p1 * p1), 0.0, 0.0, 0.0), quadratic=True)
        a = np.array([[1, b0, p0, b0 * p0], [1, b0, p1, b0 * p1], [1, b1, p0, b1 * p0], [1, b1, p1, b1 * p1]], float)
        c = np.linalg.solve(a, np.array([v00, v01, v10, v11]))
        c[np.abs(c) < 1e-9 * max(abs(v) for v in (v00, v01, v10, v11, 1.0))] = 0.0
        return Bilinear((float(c[0]), float(c[1]), float(c[2]), float(c[3])))

    @property
    def vector(self) -> np.ndarray:
        """Local. The four coefficients (``quadratic`` ones have none of this form)."""
        return np.array(self.c, float)


class ParamInfo(NamedTuple):
    """Local. One trainable parameter of the model as the trace saw it (global shape)."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    tensor_dim: int | None  # the dim the tensor axis splits, None if replicated over it
    spatial_dims: tuple[int, ...]  # dims a spatial axis splits (rare: parameters are mostly replicated)
    partial_spatial: bool  # its gradient is partial over the spatial axes (summed by the data-parallel wrapper)
    unit: int  # index of its sharding unit in UnitInfo order

    @property
    def numel(self) -> int:
        """Local. Elements of the whole parameter."""
        return math.prod(self.shape)


@dataclass
class Geometry:
    """Local. A tensor's global shape as a function of the sample: which dim holds the samples, which dims scale
    with which field dim (``size = ratio * n_d``), the others constant."""

    shape: tuple[int, ...]  # at the smaller probe with one sample
    batch_dim: int | None
    spatial: dict[int, tuple[int, float]]  # tensor dim -> (field dim, ratio)

    def at(self, batch: int, fieldsizes: Sequence[int]) -> tuple[int, ...]:
        """Local. The shape for ``batch`` samples of a field of ``fieldsizes``."""
        out = list(self.shape)
        if self.batch_dim is not None:
            out[self.batch_dim] = batch
        for d, (fd, ratio) in self.spatial.items():
            out[d] = max(1, round(ratio * fieldsizes[fd]))
        return tuple(out)


@dataclass
class LayerInfo:
    """Local. One module as the trace saw it (operators run directly in it, not in its sub-modules)."""

    fqn: str
    module: torch.nn.Module
    kind: str
    tensor: bool  # owns parameters split over the tensor axis (Megatron's pattern inside)
    unit: int
    calls: int = 0
    inputs: Geometry | None = None
    output: Geometry | None = None
    flops: dict[tuple[str, str], Bilinear] = field(default_factory=dict)  # (phase, category) -> flops
    kernels: dict[str, float] = field(default_factory=dict)  # phase -> kernel launches
    elementwise: dict[str, Bilinear] = field(default_factory=dict)  # phase -> bytes read + written


@dataclass
class UnitInfo:
    """Local. A sharding unit (stage 3 gathers its parameters at once; also the pipeline's cut points)."""

    fqn: str
    params: list[int]  # indices into Workload.params
    layers: list[str]  # fqns of the modules inside it
    order: int  # place in the forward order


@dataclass(frozen=True)
class UnitTimeline:
    """Local. The whole memory timeline of one step (every snapshot, none pruned) by sharding unit: what a pipeline
    stage, a run of units, holds while it computes.

    ``owned[u][j]``: the (rep, split) 8-vector of the activation bytes that unit ``u``'s modules created and still
    hold at snapshot ``j`` (the root's own and those made outside any unit, e.g. the loss, under the root's name);
    ``waiting[u][j]``: what a zero-bubble ``W`` of unit ``u`` would still hold there that backward has freed (its
    linear layers' inputs and output gradients, :data:`WAITS`); ``freed[u][j]``: the bytes of unit ``u``'s output
    (where it is one of the model's layers) that the step has let go of by ``j`` (:data:`OUTPUTS`);
    ``running[j]``: the unit computing at ``j`` (the root's name where no unit is); ``backward``, ``grads`` and
    ``arrived`` as :class:`Trace`'s.
    """

    owned: dict[str, np.ndarray]
    waiting: dict[str, np.ndarray]
    freed: dict[str, np.ndarray]
    running: tuple[str, ...]
    backward: np.ndarray
    grads: np.ndarray
    arrived: np.ndarray
    end_forward: int


@dataclass
class Trace:
    """Local. The fitted memory timeline of one step (with or without recomputation).

    ``rep[j]``, ``split[j]``: coefficient 4-vectors (of ``(1, b, p, b p)``) of the activation bytes alive at
    snapshot ``j``, replicated over the tensor axis and divided by it; ``grads[j]``: the fraction of the
    parameters' gradients that exist at ``j`` (the traced gradients of one rank); ``backward[j]``: whether
    ``j`` is in backward; ``owners[j]``: the module holding most bytes there.
    """

    rep: np.ndarray
    split: np.ndarray
    grads: np.ndarray
    backward: np.ndarray
    owners: list[str]
    end_forward: int  # the last snapshot of forward
    arrived: np.ndarray  # trainable parameters with a gradient at j
    arrival: tuple[int, ...]  # trainable parameters (indices) in the order their gradients arrived
    retained: dict[str, np.ndarray] = field(
        default_factory=dict
    )  # owner -> (rep, split) 8-vector at the end of forward
    deferred: dict[str, np.ndarray] = field(
        default_factory=dict
    )  # owner -> (rep, split) 8-vector: what a zero-bubble stage keeps from B to W ([Note: deferred weight gradients])
    units: UnitTimeline | None = None  # the same timeline by unit, every snapshot
    free: np.ndarray = field(default_factory=lambda: np.zeros((0, 4)))
    # free[j]: the part of rep[j] that layers dividing their point-free work own and that does not grow with the
    # points (:data:`hpctp.perf.layers.POINT_FREE_SHARES`: a Fourier layer's spectra), which a split field divides

    def __post_init__(self) -> None:
        if len(self.free) != len(self.rep):  # (none given, as for a stage's timeline: nothing of it is divided)
            self.free = np.zeros_like(self.rep)

    def pruned(self) -> Trace:
        """Local. The snapshots that can be the largest for some block (the others are dominated)."""
        keep: list[int] = []
        arrived = self.arrived  # (snapshots with different gradients are kept apart: bucket buffers rise and fall)
        vec = np.concatenate([self.rep, self.split, self.rep - self.free, self.grads[:, None], self.backward[:, None]],
                             axis=1)  # fmt: skip
        order = np.argsort(-vec[:, :8].sum(axis=1))
        for j in order:
            if not any(arrived[j] == arrived[k] and np.all(vec[j] <= vec[k] + 1e-9) for k in keep):
                keep.append(int(j))
        if self.end_forward not in keep:
            keep.append(self.end_forward)
        keep.sort()
        idx = np.array(keep, int)
        return Trace(self.rep[idx], self.split[idx], self.grads[idx], self.backward[idx], [self.owners[i] for i in keep],
                     keep.index(self.end_forward), arrived[idx], self.arrival, self.retained, self.deferred,
                     self.units, self.free[idx])  # fmt: skip


@dataclass
class Workload:
    """Local. Everything :func:`hpctp.perf.plan` needs of a model: its parameters, modules, units and step traces.

    Attributes
    ----------
    sample : Sample
    params : list of ParamInfo
    layers : dict
        ``fqn -> LayerInfo`` in the order they first ran.
    units : list of UnitInfo
        In forward order.
    traces : dict
        ``{recompute (bool): Trace}``; ``True`` is missing when the model cannot be checkpointed.
    layer_variants : dict
        ``{recompute: {fqn: LayerInfo}}`` (flops differ: backward recomputes the forward).
    tensor_capable : bool
        Whether the builder accepted a tensor axis and split some parameter over it.
    host : dict
        ``{(recompute, zero stage): (forward, backward, step)}``: the host's own work (a real training step of one
        sample of a small field on one rank, one thread, here), its operators' data work left out, counted in small
        operators (:func:`hpctp.perf.host.host_count`); times the machine's seconds per kernel, the host time of a
        step there.
        Empty for models too large to run here (their host time is then their kernel launches and the optimizer's
        memory traffic).
    model : torch.nn.Module
        The traced model (on ``meta``; its modules carry the hyperparameters the message models read).
    entering : dict
        ``fqn -> Bilinear``: bytes of the tensors that enter each of the model's children (of ``b`` samples of
        ``p`` points): what crosses a pipeline cut before it.
    leaving : dict
        ``fqn -> Bilinear``: bytes of each child's outputs that backward differentiates: the gradient that comes
        back over a pipeline cut after it.
    split_traces : dict
        ``{recompute: Trace}`` as ``traces``, with the layers that take another path on a split field on that path
        (Fourier layers: truncated DFT matrices, :func:`hpctp.nn.spectral.fourier.split_path_on_whole_fields`), for
        the plans that split it; empty where no layer does.
    builder : callable or None
        The model builder traced: :mod:`hpctp.perf.dryrun` runs the model it builds on virtual grids.
    """

    sample: Sample
    params: list[ParamInfo]
    layers: dict[str, LayerInfo]
    units: list[UnitInfo]
    traces: dict[bool, Trace]
    layer_variants: dict[bool, dict[str, LayerInfo]]
    tensor_capable: bool
    host: dict[tuple[bool, int], tuple[float, float, float]]
    model: torch.nn.Module
    probe_field: tuple[int, ...] = ()
    device: str = "cpu"
    entering: dict[str, Bilinear] = field(default_factory=dict)
    leaving: dict[str, Bilinear] = field(default_factory=dict)
    split_traces: dict[bool, Trace] = field(default_factory=dict)
    cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)  # (the planner's memo)
    builder: Builder | None = field(default=None, repr=False, compare=False)

    @property
    def param_bytes(self) -> int:
        """Local. Bytes of every trainable parameter, whole."""
        return sum(p.numel * p.itemsize for p in self.params)

    @property
    def param_count(self) -> int:
        """Local. Elements of every trainable parameter, whole."""
        return sum(p.numel for p in self.params)

    def trace_of(self, recompute: bool, split: bool) -> Trace:
        """Local. The traced step a plan runs: the recomputing one where ``recompute`` (and it was traced), on the
        split path (:attr:`split_traces`) where ``split`` (the plan splits the field) and a layer takes that path."""
        traces = self.split_traces if split and self.split_traces else self.traces
        return traces[recompute and True in traces]


SPLIT_PATH_LAYERS: tuple[type, ...] = (SpectralConv1d, SpectralConv2d, SpectralConv3d)
"""Layers that compute another way on a field split over ranks (Fourier layers: truncated DFT matrices, each rank
mixing its run of the kept modes): :func:`trace` runs the step again with them on that path
(:func:`hpctp.nn.spectral.fourier.split_path_on_whole_fields`) and keeps the bytes they own that do not grow with
the points apart (``Trace.free``), which a split field divides (:data:`hpctp.perf.layers.POINT_FREE_SHARES`)."""

# ---------------------------------------------------------------------------------------------- the probe
OUTSIDE = "<step>"
"""The owner of the operators outside the model (the loss)."""
GRADS = "<grads>"
"""The owner key of the parameters' gradients in a snapshot."""
WAITS = "<waits>"
"""Prefix of the owner keys, in a snapshot, of what a zero-bubble ``W`` would still hold where backward has freed it:
the inputs and output gradients of the linear layers whose backward ran ([Note: deferred weight gradients]), by the
linear's owner (not counted in the snapshot's total)."""
OUTPUTS = "<outputs>"
"""Prefix of the owner keys, in a snapshot, of the bytes of a model's layer's output (a child of the model: a chain's
link, where a pipeline cuts) that the step has freed, by the layer: a pipeline stage holds its output until its
backward ends, wherever the whole model lets go of it (not counted in the snapshot's total)."""


class _Owners:
    """Which module runs now: a stack of module fqns in forward (hooks), the autograd node's owner in backward."""

    def __init__(self) -> None:
        self.stack: list[str] = [OUTSIDE]
        self.nodes: dict[int, str] = {}
        self.keep: list[Any] = []  # the nodes, alive while their ids are keys
        self.last_backward = OUTSIDE

    def current(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            if len(self.stack) > 1:  # a recompute inside backward runs the modules' forward hooks again
                return self.stack[-1]
            node = torch._C._current_autograd_node()
            if node is not None:
                owner = self.nodes.get(id(node))
                if owner is not None:
                    self.last_backward = owner
                    return owner
            return self.last_backward
        return self.stack[-1]

    def note(self, value: Any, owner: str, overwrite: bool = True) -> None:
        if torch._C._current_graph_task_id() != -1:  # a recompute inside backward: its nodes never run backward
            return  # (and keeping them would keep their saved tensors alive)
        for t in _tensors(value):
            node = t.grad_fn
            if node is not None and (overwrite or id(node) not in self.nodes):
                self.nodes[id(node)] = owner
                self.keep.append(node)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, DistTensor):
        return [value.local] if isinstance(value.local, torch.Tensor) else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class _Probe(TorchDispatchMode):
    """Follows the storages operators create, their owners and the flops, kernels and bytes of each module."""

    def __init__(
        self, owners: _Owners, split_of: Callable[[str, tuple[int, ...]], bool], skip: set[int],
        tensor_dims: dict[int, int] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.owners = owners
        self.split_of = split_of
        self.tensor_dims = tensor_dims or {}  # id(parameter) -> the dim the tensor axis splits (its layout's)
        self.param_storages = skip  # storages of parameters, buffers and the inputs (never counted)
        self.live: dict[int, tuple[int, tuple[str, bool]]] = {}
        self.by_key: dict[tuple[str, bool], int] = defaultdict(int)
        self.total = 0
        self.snapshots: list[tuple[dict[tuple[str, bool], int], bool]] = []
        self.snapshot_owner: list[str] = []
        self.snapshot_arrived: list[int] = []  # parameters with a gradient at each snapshot
        self.arrival: list[int] = []  # trainable parameters in the order their gradients arrived
        self.arrival_set: set[int] = set()
        self.cur = ""
        self.cur_phase = False
        self.best = -1
        self.best_snap: dict[tuple[str, bool], int] = {}
        self.flops: dict[tuple[str, str, str], float] = defaultdict(float)  # (owner, phase, op category)
        self.kernels: dict[tuple[str, str], float] = defaultdict(float)
        self.elementwise: dict[tuple[str, str], float] = defaultdict(float)
        self.end_forward = -1
        self.deferred: dict[tuple[str, bool], int] = defaultdict(int)  # what a zero-bubble W keeps, per owner
        self.deferred_inputs: set[int] = set()
        self.kept_for_w: dict[int, tuple[str, bool]] = {}  # storage -> its WAITS key: what W would keep
        self.layer_outputs: dict[int, tuple[str, bool]] = {}  # storage -> its OUTPUTS key

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A linear call whose weight gradient a zero-bubble stage leaves to W (:func:`hpctp.nn.functional.linear`):
        computed as always; W would keep its input's storage and its output's gradient, counted per owner."""
        y = torch.nn.functional.linear(x, weight, bias)
        if torch._C._current_graph_task_id() == -1:  # (forward only: a recomputation in backward is not split)
            owner = self.owners.current()
            x_split, y_split = self._linear_split(owner, x, weight, y)
            key = x.untyped_storage()._cdata
            if key not in self.deferred_inputs:
                self.deferred_inputs.add(key)
                self.deferred[(owner, x_split)] += int(x.untyped_storage().nbytes())
                self.kept_for_w[key] = (WAITS + owner, x_split)
            self.deferred[(owner, y_split)] += y.numel() * y.element_size()
            if y.requires_grad:
                y.register_hook(lambda g, k=(WAITS + owner, y_split): self._kept_by_w(g, k))
        return y

    def _kept_by_w(self, grad: torch.Tensor, key: tuple[str, bool]) -> None:
        """A deferred linear's output gradient arrived: W would keep its storage once backward frees it."""
        self.kept_for_w.setdefault(grad.untyped_storage()._cdata, key)

    def _linear_split(
        self, owner: str, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor
    ) -> tuple[bool, bool]:  # fmt: skip
        """Whether a linear call's input and output are divided by the tensor axis: from its weight's layout where it
        has one (the input where the tensor axis splits the weight's last dim, its input features, as a row-parallel
        layer's; the output where it splits another, as a column-parallel layer's), which one rank's shapes cannot
        tell (a row-parallel layer's input has its owner's input shape when the axis has one rank); else by shape."""
        base = weight if weight._base is None else weight._base
        dim = self.tensor_dims.get(id(base))
        if dim is None:
            return self.split_of(owner, tuple(x.shape)), self.split_of(owner, tuple(y.shape))
        last = dim == base.dim() - 1
        return last, not last

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            nbytes, k = entry
            self.by_key[k] -= nbytes
            self.total -= nbytes
            waits = self.kept_for_w.pop(key, None)
            if waits is not None and torch._C._current_graph_task_id() != -1:  # (backward let go of it; W would not)
                self.by_key[waits] += nbytes
            output = self.layer_outputs.pop(key, None)
            if output is not None:
                self.by_key[output] += nbytes

    def note_output(self, layer: str, value: Any) -> None:
        """A model's layer returned ``value``: the storages it made there count under OUTPUTS once freed."""
        for t in _tensors(value):
            key = t.untyped_storage()._cdata
            entry = self.live.get(key)
            if entry is not None:
                self.layer_outputs.setdefault(key, (OUTPUTS + layer, entry[1][1]))

    def regrade(self, t: torch.Tensor, index: int) -> None:
        """Trainable parameter ``index``'s gradient: note its arrival, move its storage to the gradients' key."""
        if index not in self.arrival_set:  # the moment the wrapper copies it into its bucket: a snapshot of its own
            self._snapshot()  # (the moment before: the running module's largest so far)
            self.arrival_set.add(index)
            self.arrival.append(index)
            self.best, self.best_snap = self.total, dict(self.by_key)
            self._snapshot()  # (this gradient still counts as the module's bytes: autograd frees it after the copy)
            self.best = -1
        key = t.untyped_storage()._cdata
        entry = self.live.get(key)
        if entry is None or entry[1] == (GRADS, False):
            return
        nbytes, old = entry
        self.by_key[old] -= nbytes
        self.by_key[(GRADS, False)] += nbytes
        self.live[key] = (nbytes, (GRADS, False))

    def _snapshot(self) -> None:
        if self.best >= 0:
            self.snapshots.append(({k: v for k, v in self.best_snap.items() if v}, self.cur_phase))
            self.snapshot_owner.append(self.cur)
            self.snapshot_arrived.append(len(self.arrival))

    def mark_end_forward(self) -> None:
        self._snapshot()
        self.best, self.best_snap = self.total, dict(self.by_key)
        self._snapshot()
        self.end_forward = len(self.snapshots) - 1
        self.best = -1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        owner = self.owners.current()
        backward = torch._C._current_graph_task_id() != -1
        phase = "bwd" if backward else "fwd"
        if owner != self.cur or backward != self.cur_phase:
            self._snapshot()
            self.cur, self.cur_phase, self.best = owner, backward, -1
        name = func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else str(func)
        outs = _tensors(out)
        ins = [a for a in _flat_args(args, kwargs) if isinstance(a, torch.Tensor)]
        in_storages = {t.untyped_storage()._cdata for t in ins if _shapes_only(t)}
        fresh = False
        for t in outs:
            if not _shapes_only(t):
                continue
            s = t.untyped_storage()
            key = s._cdata
            if key in self.live or key in in_storages or key in self.param_storages:
                continue
            nbytes = int(s.nbytes())
            fresh = True
            if nbytes == 0:
                continue
            k = (owner, self.split_of(owner, tuple(t.shape)))
            self.live[key] = (nbytes, k)
            self.by_key[k] += nbytes
            self.total += nbytes
            weakref.finalize(s, self._free, key)
        if self.total > self.best:
            self.best, self.best_snap = self.total, dict(self.by_key)
        packet = getattr(func, "_overloadpacket", None)
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
            cat = "conv" if name in _CONV else ("attention" if "attention" in name else "gemm")
            if cat == "gemm" and len(ins) >= 2:
                a, b = ins[-2], ins[-1]
                if a.is_complex():  # (torch counts a complex product's flops as a real one's)
                    flops *= 4.0
                small = min(int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1]))
                self.flops[(owner, phase, "gemm_small")] += flops / max(small, 1)
            self.flops[(owner, phase, cat)] += flops
            if cat == "attention" and len(ins) >= 3:
                self.flops[(owner, phase, "softmax")] += _softmax_scores(name, ins)
            self.kernels[(owner, phase)] += 1
        elif "scaled_dot_product" in name and len(ins) >= 3:  # (kernels torch has no flop formula for: CPU flash)
            back = name.endswith("backward")
            q = ins[1] if back else ins[0]
            scores = _softmax_scores(name, ins)
            self.flops[(owner, phase, "attention")] += (5.0 if back else 4.0) * scores * q.shape[-1]
            self.flops[(owner, phase, "softmax")] += scores
            self.kernels[(owner, phase)] += 1
        elif name in _FFT and ins:
            x, dims = ins[0], args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else range(ins[0].ndim)
            points = math.prod(int(x.shape[d]) for d in dims)
            self.flops[(owner, phase, "fft")] += fft_flops(x.numel(), points)
            self.kernels[(owner, phase)] += 1
        elif name not in _VIEW_OPS and (fresh or name.endswith("_")):
            self.kernels[(owner, phase)] += 1
            self.elementwise[(owner, phase)] += sum(t.numel() * t.element_size() for t in ins + outs)
        if backward:
            return out
        self.owners.note(outs, owner, overwrite=False)
        return out


def _softmax_scores(name: str, ins: list[torch.Tensor]) -> float:
    """Softmax scores of an attention kernel (batch x heads x queries x keys), twice over in backward (which
    recomputes them, then forms their gradient): what :attr:`hpctp.perf.ComputeRates.softmax` prices."""
    back = name.endswith("backward")
    q, keys = (ins[1], ins[2]) if back else (ins[0], ins[1])
    pairs = q.numel() // max(q.shape[-1], 1) * keys.shape[-2]
    return float(pairs) * (2.0 if back else 1.0)


def _shapes_only(t: torch.Tensor) -> bool:
    """A tensor of the probe: fake or on meta (real tensors, e.g. a layer's cached constants, are not counted)."""
    return isinstance(t, FakeTensor) or t.device.type == "meta"


def _flat_args(args: Any, kwargs: Any) -> list[Any]:
    out: list[Any] = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            out += list(a)
        else:
            out.append(a)
    return out


@dataclass
class _Run:
    """One probe's raw record."""

    snapshots: list[tuple[dict[tuple[str, bool], int], bool]]
    owners: list[str]
    end_forward: int
    flops: dict[tuple[str, str, str], float]
    kernels: dict[tuple[str, str], float]
    elementwise: dict[tuple[str, str], float]
    shapes: dict[str, tuple[tuple[int, ...] | None, tuple[int, ...] | None]]
    calls: dict[str, int]
    order: list[str]
    entering: dict[str, int] = field(default_factory=dict)  # unit fqn -> bytes of the tensors it was called with
    arrived: list[int] = field(default_factory=list)  # per snapshot: trainable parameters with a gradient
    arrival: tuple[int, ...] = ()  # trainable parameters in the order their gradients arrived
    deferred: dict[tuple[str, bool], int] = field(default_factory=dict)  # what a zero-bubble W keeps, per owner
    leaving: dict[str, int] = field(default_factory=dict)  # unit fqn -> bytes of its differentiated outputs


def _probe_plan(nspatial: int, tensor: bool) -> ParallelPlan:
    from mpi4py import MPI  # (a one-rank communicator: the probe runs on any rank alike, without messages)

    dims = (1,) * (1 + nspatial + (1 if tensor else 0))
    grid = ProcessGrid(dims, comm=MPI.COMM_SELF)
    spatial = tuple(range(1, 1 + nspatial))
    return ParallelPlan(grid, data=(0,), spatial=spatial, tensor=(nspatial + 1,) if tensor else ())


def _build(builder: Builder, plan: ParallelPlan) -> torch.nn.Module:
    with torch.device("meta"):
        model = builder(plan)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the model builder must return a torch.nn.Module, got {type(model).__name__}")
    return model


def default_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Local. The modules a model is cut at: its children holding trainable parameters, a ModuleList's
    members one by one (what :class:`~hpctp.nn.ShardedDataParallel` gathers as units, and where the
    planner cuts pipeline stages and checkpoints activations)."""
    out: list[torch.nn.Module] = []
    for child in model.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            out += default_layers(child)
        elif any(p.requires_grad for p in child.parameters()):
            out.append(child)
    return out


def _names(model: torch.nn.Module) -> dict[int, str]:
    return {id(m): n or type(model).__name__ for n, m in model.named_modules()}


def _fake(model: torch.nn.Module) -> FakeTensorMode:
    """A fake-tensor mode holding ``model`` (built on meta): its tensors become fake CPU tensors (shapes only), so the
    layers take their CPU paths (e.g. the CPU flash kernels of :func:`hpctp.nn.functional.attention`) and nothing is
    computed or allocated."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model.to_empty(device="cpu")
    model.hpctp_fake_mode = mode  # type: ignore[assignment]
    return mode


def _step(model: torch.nn.Module, plan: ParallelPlan, sample: Sample, batch: int, fieldsizes: tuple[int, ...],
          hooks: tuple[Callable[..., Any], Callable[..., Any]] | None, mode: Any, mark: Callable[[], None] | None,
          backward: bool = True, target_shape: tuple[int, ...] | None = None) -> None:  # fmt: skip
    """One forward (+ loss + backward) of ``batch`` samples of ``fieldsizes`` in the model's fake mode (meta without
    one), with module hooks and a mode."""
    grid = plan.model_grid
    shape = (batch, sample.shape[1], *fieldsizes)
    layout = Layout(shape, grid.dims, (None, None, *plan.spatial))
    handles = []
    if hooks is not None:
        handles = [torch.nn.modules.module.register_module_forward_pre_hook(hooks[0]),
                   torch.nn.modules.module.register_module_forward_hook(hooks[1])]  # fmt: skip
    fake = getattr(model, "hpctp_fake_mode", None)
    try:
        with fake if fake is not None else torch.device("meta"):
            x = DistTensor(torch.empty(shape, dtype=sample.torch_dtype), grid, layout)
            # the loss's target is the batch's, as the input (not counted: the planner counts the batch apart)
            target = torch.empty(target_shape, dtype=sample.torch_dtype) if target_shape is not None else None
            with mode if mode is not None else contextlib.nullcontext():
                out = model(x)
                pred = out.local if isinstance(out, DistTensor) else out
                if target is None:
                    target = torch.empty(pred.shape, dtype=pred.dtype)
                if backward:  # (the loss's messages are priced by the planner; its local work is this)
                    loss = ((pred - target) ** 2).sum().to(torch.float64) / pred.numel()
                    if mark is not None:
                        mark()
                    loss.backward()
                    del loss
                del out, pred
    finally:
        for h in handles:
            h.remove()
        for p in model.parameters():
            p.grad = None


def _shapes(model: torch.nn.Module, plan: ParallelPlan, sample: Sample, batch: int, fieldsizes: tuple[int, ...]
            ) -> tuple[dict[str, tuple[tuple[int, ...] | None, tuple[int, ...] | None]], dict[str, int], list[str]]:  # fmt: skip
    """Each module's first input and output shape, its calls per forward, and the order modules first ran."""
    names = _names(model)
    shapes: dict[str, tuple[tuple[int, ...] | None, tuple[int, ...] | None]] = {}
    calls: dict[str, int] = defaultdict(int)
    order: list[str] = []

    def pre(module: torch.nn.Module, args: Any) -> None:
        name = names.get(id(module))
        if name is None:
            return
        calls[name] += 1
        if name not in shapes:
            order.append(name)
            first = _tensors(args)
            shapes[name] = (tuple(first[0].shape) if first else None, None)

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        name = names.get(id(module))
        if name is None:
            return
        outs = _tensors(output)
        if outs and shapes[name][1] is None:
            shapes[name] = (shapes[name][0], tuple(outs[0].shape))

    _step(model, plan, sample, batch, fieldsizes, (pre, post), None, None, backward=False)
    return shapes, dict(calls), order


def _run_probe(
    model: torch.nn.Module, plan: ParallelPlan, sample: Sample, batch: int, fieldsizes: tuple[int, ...],
    tensor_layers: set[str], tensor_dims: dict[str, int],
) -> _Run:  # fmt: skip
    names = _names(model)
    shapes, calls, order = _shapes(model, plan, sample, batch, fieldsizes)  # (also fills the layers' caches)

    def split_of(owner: str, shape: tuple[int, ...]) -> bool:
        if owner not in tensor_layers:
            return False
        return shape not in shapes.get(owner, (None, None))

    params = list(model.parameters())
    skip = {t.untyped_storage()._cdata for t in (*params, *model.buffers())}
    owners = _Owners()
    by_id = {id(p): tensor_dims[n] for n, p in model.named_parameters() if n in tensor_dims}
    probe = _Probe(owners, split_of, skip, by_id)

    entering: dict[str, int] = {}
    leaving: dict[str, int] = {}
    children = {id(c) for c in model.children()}

    def pre(module: torch.nn.Module, args: Any) -> None:
        name = names.get(id(module))
        if name is not None:
            owners.stack.append(name)
            if id(module) in children and name not in entering:  # (a chain's boundaries: what enters each layer)
                entering[name] = sum(t.numel() * t.element_size() for t in _tensors(args))

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        name = names.get(id(module))
        if name is None:
            return
        if owners.stack and owners.stack[-1] == name:
            owners.stack.pop()
        owners.note(output, name)
        if id(module) in children and torch._C._current_graph_task_id() == -1:
            probe.note_output(name, output)
            if name not in leaving:
                leaving[name] = sum(t.numel() * t.element_size() for t in _tensors(output) if t.requires_grad)

    trainable = [p for p in params if p.requires_grad]  # (the workload's parameters, in its order)
    hooks = [
        p.register_post_accumulate_grad_hook(lambda q, i=i: probe.regrade(q.grad, i)) for i, p in enumerate(trainable)
    ]
    root = names[id(model)]
    try:
        with linear_recording(probe):
            _step(model, plan, sample, batch, fieldsizes, (pre, post), probe, probe.mark_end_forward,
                  target_shape=shapes.get(root, (None, None))[1])  # fmt: skip
    finally:
        for h in hooks:
            h.remove()
    probe._snapshot()
    return _Run(probe.snapshots, probe.snapshot_owner, probe.end_forward, dict(probe.flops), dict(probe.kernels),
                dict(probe.elementwise), shapes, calls, order, entering, probe.snapshot_arrived,
                tuple(probe.arrival), dict(probe.deferred), leaving)  # fmt: skip


def _geometry(
    shapes: list[tuple[int, ...] | None], batches: tuple[int, int], fields: tuple[tuple[int, ...], ...]
) -> Geometry | None:
    """From the shapes of the probes ``(b0, f0), (b0, f1), (b1, f0), (b1, f1)``."""
    if any(s is None for s in shapes) or len({len(s) for s in shapes if s is not None}) != 1:
        return None
    s00, s01, s10, _ = (tuple(s) for s in shapes if s is not None)
    batch_dim = next((d for d in range(len(s00)) if s00[d] == batches[0] and s10[d] == batches[1]), None)
    spatial: dict[int, tuple[int, float]] = {}
    used: set[int] = set()
    for d in range(len(s00)):
        if s00[d] != s01[d]:
            for fd in range(len(fields[0])):
                if fd in used:
                    continue
                r0, r1 = s00[d] / fields[0][fd], s01[d] / fields[1][fd]
                if abs(r0 - r1) < 1e-9 * max(r0, 1):
                    spatial[d] = (fd, r0)
                    used.add(fd)
                    break
    return Geometry(s00, batch_dim, spatial)


def trace(
    builder: Builder,
    sample: Sample,
    *,
    recompute: Callable[[torch.nn.Module], Any] | None | bool = True,
    units: Callable[[torch.nn.Module], Sequence[torch.nn.Module]] | None = None,
    device: str = "cpu",
) -> Workload:
    """Local. Trace one training step of the model that ``builder`` makes (see the module docstring).

    Parameters
    ----------
    builder : callable
        ``builder(plan) -> torch.nn.Module``: the model on ``plan.model_grid`` (called under
        ``torch.device("meta")``); its forward takes the sample as a DistTensor split
        ``(None, None, *plan.spatial)`` and returns a DistTensor or block of the loss target's shape.
        A builder that raises ``ValueError``/``TypeError`` on a plan with a tensor axis is traced without one.
    sample : Sample
    recompute : callable, bool or None
        How activations are recomputed: a function that checkpoints a model's layers in place
        (e.g. ``apps.surrogate.parallel.checkpoint_layers``); ``True``: :func:`hpctp.nn.checkpoint_forward`
        on each module of :func:`default_layers`; ``False``/``None``: recomputation is not planned.
    units : callable, optional
        ``units(model)``: the modules sharded as units at ZeRO stage 3 (default :func:`default_layers`).
    device : {"cpu", "meta"}
        Whose code paths the layers take: ``"cpu"`` traces fake CPU tensors (e.g. the CPU flash kernels of
        attention), ``"meta"`` meta tensors, which take the paths of other devices (GPUs) and trace faster.

    Returns
    -------
    Workload

    Raises
    ------
    ValueError
        If the model does not run on the probe samples (the message names the builder's error).
    """
    if device not in ("cpu", "meta"):
        raise ValueError(f"trace: device must be 'cpu' or 'meta', got {device!r}")
    nsp = len(sample.field)
    plan = _probe_plan(nsp, True)
    tensor_capable = True
    try:
        model = _build(builder, plan)
    except (ValueError, TypeError):
        _free(plan)
        plan = _probe_plan(nsp, False)
        tensor_capable = False
        model = _build(builder, plan)
    try:
        return _trace(builder, model, plan, sample, recompute, units, tensor_capable, device == "cpu")
    finally:
        _free(plan)


def _free(plan: ParallelPlan) -> None:
    plan.free()
    plan.grid.free()


def _builder_fix(error: InputSplitError | InputGridError, nspatial: int) -> str:
    """What the builder must change when its model does not take the planner's input."""
    axes = tuple(range(nspatial))
    split = (None, None, *axes)
    if isinstance(error, InputGridError):
        return (
            f"the model that the builder makes does not take the planner's input: a layer lives on grid dims "
            f"{error.wanted}, the planner feeds it a DistTensor on plan.model_grid (dims {error.given} here: the plan's "
            "spatial and tensor axes); build every layer on plan.model_grid, not on plan.grid"
        )
    return (
        f"the model that the builder makes does not take the planner's input: a layer splits it {error.wanted}, the "
        f"planner gives it split (None, None, *plan.spatial) = {split} (a plan with one spatial axis per field dim, "
        f"plan.spatial = {axes}, numbered on plan.model_grid); the builder must split the input on the plan's "
        "spatial axes: give its layers split=plan.spatial (or leave split= at its default), not a fixed split"
    )


def _probe_fields(sample: Sample, runs: Callable[[tuple[int, ...]], Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The two probe fields: :data:`PROBE_POINTS` per dim (a multiple of the sample's cell), and twice that; doubled
    until the model accepts them."""
    m = sample.spatial_multiple
    base = max(1, -(-PROBE_POINTS // m)) * m
    last: Exception | None = None
    for _ in range(8):
        f0 = tuple(base for _ in sample.field)
        f1 = tuple(2 * n for n in f0)
        try:
            runs(f0)
            runs(f1)
            return f0, f1
        except (InputSplitError, InputGridError) as e:  # not a matter of the field's size: the builder's fix
            raise ValueError(_builder_fix(e, len(sample.field))) from None
        except (ValueError, RuntimeError) as e:
            last = e
            base *= 2
    raise ValueError(f"the model does not run on probe fields of up to {base // 2} points per dim: {last}")


def _trace(
    builder: Builder, model: torch.nn.Module, plan: ParallelPlan, sample: Sample,
    recompute: Callable[[torch.nn.Module], Any] | None | bool, units_of: Callable[[torch.nn.Module], Sequence[torch.nn.Module]] | None,
    tensor_capable: bool, fake: bool,
) -> Workload:  # fmt: skip
    names = _names(model)
    root = type(model).__name__
    tensor_axis = plan.tensor[0] if plan.tensor else None
    unit_mods = list(units_of(model) if units_of is not None else default_layers(model))
    unit_fqns = [root] + [names[id(u)] for u in unit_mods]
    unit_of: dict[str, int] = {}
    for i, u in enumerate(unit_mods):
        for m in u.modules():
            unit_of.setdefault(names[id(m)], i + 1)
    params: list[ParamInfo] = []
    tensor_layers: set[str] = set()
    for mod_name, m in model.named_modules():
        fqn = names[id(m)]
        for pname, p in m.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            lay = getattr(p, "hpctp_layout", None)
            tdim = None
            sdims: tuple[int, ...] = ()
            if isinstance(lay, Layout):
                for d, a in enumerate(lay.split):
                    if a is not None and tensor_axis is not None and a == tensor_axis:
                        tdim = d
                    elif a is not None and a in plan.spatial:
                        sdims += (d,)
            if tdim is not None:
                tensor_layers.add(fqn)
            full = f"{mod_name}.{pname}" if mod_name else pname
            spatial_axes = set(plan.grid_axes(plan.spatial))
            partial = any(a in spatial_axes for a in plan.gradient_axes(p, full))
            params.append(ParamInfo(full, tuple(p.shape), p.element_size(), tdim, sdims, partial, unit_of.get(fqn, 0)))
    if not tensor_layers:
        tensor_capable = False
    if fake:
        _fake(model)
    f0, f1 = _probe_fields(sample, lambda f: _shapes(model, plan, sample, 1, f))
    fields = (f0, f1)
    bs = (1, 2)
    ps = (float(math.prod(f0)), float(math.prod(f1)))
    probes = [(1, f0), (1, f1), (2, f0), (2, f1)]
    tensor_dims = {p.name: p.tensor_dim for p in params if p.tensor_dim is not None}
    runs = [_run_probe(model, plan, sample, b, f, tensor_layers, tensor_dims) for b, f in probes]

    def unit_named(fqn: str) -> str:  # (a module outside every unit, or none: the root)
        return unit_fqns[unit_of.get(fqn, 0)]

    free = frozenset(n for n, m in model.named_modules() if isinstance(m, SPLIT_PATH_LAYERS))
    traces = {False: _fit_trace(runs, bs, ps, unit_named, free)}
    variants = {False: _layers(model, runs, bs, fields, ps, tensor_layers, unit_of)}
    if recompute:
        again = _build(builder, plan)
        if fake:
            _fake(again)
        if recompute is True:
            for m in default_layers(again):
                checkpoint_forward(m)
        elif callable(recompute):
            recompute(again)
        cruns = [_run_probe(again, plan, sample, b, f, tensor_layers, tensor_dims) for b, f in probes]
        traces[True] = _fit_trace(cruns, bs, ps, unit_named, free)
        variants[True] = _layers(again, cruns, bs, fields, ps, tensor_layers, unit_of)
    split_traces: dict[bool, Trace] = {}
    if free:  # (Fourier layers take another path on a split field: its memory traced too)
        with split_path_on_whole_fields():
            for rc, m in [(False, model)] + ([(True, again)] if recompute else []):
                for _ in range(2):  # (a first pass builds the DFT matrices of each probe's shape: cached constants)
                    sruns = [_run_probe(m, plan, sample, b, f, tensor_layers, tensor_dims) for b, f in probes]
                split_traces[rc] = _fit_trace(sruns, bs, ps, unit_named, free)
    host = _host_operations(builder, plan, sample, f0, recompute)
    order = {fqn: i for i, fqn in enumerate(runs[0].order)}
    layers = variants[False]
    infos = []
    for i, fqn in enumerate(unit_fqns):
        inside = [n for n in layers if unit_of.get(n, 0) == i]
        infos.append(UnitInfo(fqn, [], inside, -1 if i == 0 else order.get(fqn, len(order) + i)))
    ranked = [infos[0]] + sorted(infos[1:], key=lambda info: info.order)
    index = {info.fqn: k for k, info in enumerate(ranked)}
    params = [pi._replace(unit=index[unit_fqns[pi.unit]]) for pi in params]
    for k, info in enumerate(ranked):
        info.params = [j for j, pi in enumerate(params) if pi.unit == k]
    for v in variants.values():
        for layer in v.values():
            layer.unit = index[unit_fqns[layer.unit]]
    entering = {fqn: Bilinear.fit([r.entering.get(fqn, 0) for r in runs], bs, ps) for fqn in runs[0].entering}
    leaving = {fqn: Bilinear.fit([r.leaving.get(fqn, 0) for r in runs], bs, ps) for fqn in runs[0].leaving}
    return Workload(sample, params, layers, ranked, traces, variants, tensor_capable, host, model, f0,
                    "cpu" if fake else "meta", entering, leaving, split_traces=split_traces, builder=builder)  # fmt: skip


def _layers(
    model: torch.nn.Module, runs: list[_Run], bs: tuple[int, int], fields: tuple[tuple[int, ...], ...],
    ps: tuple[float, float], tensor_layers: set[str], unit_of: dict[str, int],
) -> dict[str, LayerInfo]:  # fmt: skip
    names = _names(model)
    by_name = {names[id(m)]: m for m in model.modules()}
    out: dict[str, LayerInfo] = {}
    for fqn in [OUTSIDE, *runs[0].order]:
        mod = by_name.get(fqn, model)
        info = LayerInfo(fqn, mod, "step" if fqn == OUTSIDE else type(mod).__name__, fqn in tensor_layers,
                         unit_of.get(fqn, 0), runs[0].calls.get(fqn, 1))  # fmt: skip
        if fqn in runs[0].shapes:
            info.inputs = _geometry([r.shapes.get(fqn, (None, None))[0] for r in runs], bs, fields)
            info.output = _geometry([r.shapes.get(fqn, (None, None))[1] for r in runs], bs, fields)
        for phase in ("fwd", "bwd"):
            for cat in CATEGORIES:
                vals = [r.flops.get((fqn, phase, cat), 0.0) for r in runs]
                if any(vals):
                    fit = Bilinear.fit(vals, bs, ps, square=cat in ("gemm", "attention", "softmax"))
                    cat_fit = "attention" if fit.quadratic and cat != "softmax" else cat
                    if (phase, cat_fit) in info.flops:  # (two categories fitted as attention: add)
                        prev = info.flops[(phase, cat_fit)]
                        fit = Bilinear(tuple(a + b for a, b in zip(prev.c, fit.c)), fit.quadratic)  # type: ignore[arg-type]
                    info.flops[(phase, cat_fit)] = fit
            k = [r.kernels.get((fqn, phase), 0.0) for r in runs]
            if any(k):
                info.kernels[phase] = float(max(k))
            e = [r.elementwise.get((fqn, phase), 0.0) for r in runs]
            if any(e):
                info.elementwise[phase] = Bilinear.fit(e, bs, ps)
        out[fqn] = info
    return out


def _fit_trace(
    runs: list[_Run], bs: tuple[int, int], ps: tuple[float, float], unit_of: Callable[[str], str] = lambda fqn: "",
    free_owners: frozenset[str] = frozenset(),
) -> Trace:  # fmt: skip
    """The runs' timelines fitted in ``(1, b, p, b p)``; ``unit_of(fqn)``: the unit a module belongs to;
    ``free_owners``: the modules whose point-free bytes go to ``Trace.free`` too."""
    if (
        len({len(r.snapshots) for r in runs}) != 1
    ):  # the probes took different paths: each one's end of forward and peaks
        runs = [_coarse(r) for r in runs]
    n = len(runs[0].snapshots)
    rep = np.zeros((n, 4))
    split = np.zeros((n, 4))
    free = np.zeros((n, 4))
    grads = np.zeros(n)
    backward = np.zeros(n)
    owners = []
    owned: dict[str, np.ndarray] = defaultdict(lambda: np.zeros((n, 8)))
    waiting: dict[str, np.ndarray] = defaultdict(lambda: np.zeros((n, 8)))
    freed: dict[str, np.ndarray] = defaultdict(lambda: np.zeros((n, 8)))
    for j in range(n):
        keys = set().union(*(r.snapshots[j][0] for r in runs))
        biggest, big = "", -1.0
        for key in keys:
            vals = [float(r.snapshots[j][0].get(key, 0)) for r in runs]
            if key[0] == GRADS:
                grads[j] = vals[0]
                continue
            vec = Bilinear.fit(vals, bs, ps).vector
            if key[0].startswith(WAITS):
                waiting[unit_of(key[0][len(WAITS) :])][j, _half(key)] += vec
                continue
            if key[0].startswith(OUTPUTS):
                freed[unit_of(key[0][len(OUTPUTS) :])][j, _half(key)] += vec
                continue
            (split if key[1] else rep)[j] += vec
            if key[0] in free_owners and not key[1]:
                free[j, :2] += vec[:2]  # (the bytes at zero points: c0 + cb b)
            owned[unit_of(key[0])][j, _half(key)] += vec
            if vals[-1] > big:
                biggest, big = key[0], vals[-1]
        backward[j] = float(runs[0].snapshots[j][1])
        owners.append(biggest)
    top = grads.max() if grads.size and grads.max() > 0 else 1.0
    end = min(runs[0].end_forward if runs[0].end_forward >= 0 else 0, n - 1)
    retained: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(8))
    for key in set().union(*(r.snapshots[end][0] for r in runs)):
        if key[0] != GRADS and not key[0].startswith((WAITS, OUTPUTS)):
            vec = Bilinear.fit([float(r.snapshots[end][0].get(key, 0)) for r in runs], bs, ps).vector
            retained[key[0]][_half(key)] += vec
    deferred: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(8))
    for key in set().union(*(r.deferred for r in runs)):
        deferred[key[0]][_half(key)] += Bilinear.fit([float(r.deferred.get(key, 0)) for r in runs], bs, ps).vector
    arrived = np.array(runs[0].arrived, dtype=float)
    units = UnitTimeline(dict(owned), dict(waiting), dict(freed), tuple(unit_of(fqn) for fqn in runs[0].owners),
                         backward > 0, grads / top, arrived, end)  # fmt: skip
    return Trace(rep, split, grads / top, backward, owners, end, arrived, runs[0].arrival, dict(retained),
                 dict(deferred), units, free).pruned()  # fmt: skip


def _half(key: tuple[str, bool]) -> slice:
    """Where a snapshot key's bytes go in a (rep, split) 8-vector: the split half when the tensor axis divides them."""
    return slice(4, 8) if key[1] else slice(0, 4)


def _coarse(r: _Run) -> _Run:
    totals = [sum(v for k, v in s[0].items() if not k[0].startswith((WAITS, OUTPUTS))) for s in r.snapshots]
    fwd = [i for i, s in enumerate(r.snapshots) if not s[1]]
    bwd = [i for i, s in enumerate(r.snapshots) if s[1]]
    keep = [max(fwd, key=lambda i: totals[i])] if fwd else []
    keep += [r.end_forward] if r.end_forward >= 0 else []
    keep += [max(bwd, key=lambda i: totals[i])] if bwd else []
    keep = sorted(set(keep))
    return _Run([r.snapshots[i] for i in keep], [r.owners[i] for i in keep],
                keep.index(r.end_forward) if r.end_forward in keep else 0, r.flops, r.kernels, r.elementwise,
                r.shapes, r.calls, r.order, r.entering, [r.arrived[i] for i in keep], r.arrival, r.deferred, r.leaving)  # fmt: skip


HOST_STEPS = 5
"""Timed steps per setting of :func:`trace`'s host measure (after one warm-up step); each part's median count."""


def _host_operations(
    builder: Builder, plan: ParallelPlan, sample: Sample, f0: tuple[int, ...],
    recompute: Callable[[torch.nn.Module], Any] | None | bool,
) -> dict[tuple[bool, int], tuple[float, float, float]]:  # fmt: skip
    """The host's own work (Python, operator dispatch, hooks, the optimizer's loop) in a real training step of one
    sample of the probe field on this CPU, one thread, per recomputation and ZeRO stage
    (:class:`hpctp.nn.ShardedDataParallel` on one rank: its hooks, gathers and frees, no messages): forward,
    backward, and the step after them (the wrapper's and Adam's). Each part is counted by
    :func:`hpctp.perf.host.host_count`: its operators' data work (which the planner prices from the trace at the
    machine's rates) left out, in small operators timed just before each step: a count does not move with this
    machine's speed, which drifts for seconds at a time (1.2-1.5x here) between the steps and the moment the planner
    reads it; the median of :data:`HOST_STEPS` steps. Both are this thread's CPU time, which processes sharing its
    core do not lengthen (in wall time a build beside the trace moved the count 1.6-4x). Empty when the model's
    parameters exceed :data:`HOST_PROBE_BYTES`."""
    from ..nn import ShardedDataParallel

    out: dict[tuple[bool, int], tuple[float, float, float]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rc in (False, True) if recompute else (False,):
            for zero in (0, 1, 2, 3):
                model = _build(builder, plan)
                if sum(p.numel() * p.element_size() for p in model.parameters()) > HOST_PROBE_BYTES:
                    return {}
                model.to_empty(device="cpu")
                with torch.no_grad():
                    for t in (*model.parameters(), *model.buffers()):
                        t.zero_()
                if rc and recompute is True:
                    for m in default_layers(model):
                        checkpoint_forward(m)
                elif rc and callable(recompute):
                    recompute(model)
                sdp = ShardedDataParallel(model, plan, stage=zero)
                opt = torch.optim.Adam(sdp.parameters(), lr=1e-9)
                grid = plan.model_grid
                shape = (1, sample.shape[1], *f0)
                layout = Layout(shape, grid.dims, (None, None, *plan.spatial))
                counts: list[tuple[float, float, float]] = []
                for _ in range(1 + HOST_STEPS):
                    costs = clock_costs()
                    x = DistTensor(torch.zeros(shape, dtype=sample.torch_dtype), grid, layout)
                    f, loss = host_count(partial(_probe_loss, sdp, x), costs)
                    b, _ = host_count(loss.backward, costs)
                    s, _ = host_count(partial(_probe_step, sdp, opt), costs)
                    counts.append((f, b, s))
                f, b, s = (float(np.median([c[i] for c in counts[1:]])) for i in range(3))
                out[(rc, zero)] = (f, b, s)
            # (stages 1 and 2 run the same host code: each gradient copied into its bucket's flat buffer, one
            # message per bucket, a slice stepped; on one rank their times differ by noise alone, which would
            # otherwise decide between two plans whose messages differ)
            same = tuple(min(a, b) for a, b in zip(out[(rc, 1)], out[(rc, 2)]))
            out[(rc, 1)] = out[(rc, 2)] = (same[0], same[1], same[2])
    finally:
        torch.set_num_threads(threads)
    return out


def _probe_loss(model: torch.nn.Module, x: DistTensor) -> torch.Tensor:
    out = model(x)
    pred = out.local if isinstance(out, DistTensor) else out
    return (pred**2).sum()


def _probe_step(model: Any, opt: torch.optim.Optimizer) -> None:
    model.step(opt)
    model.zero_grad(set_to_none=True)
