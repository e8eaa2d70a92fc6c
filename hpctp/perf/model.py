"""One plan's predicted step: peak memory per rank by kind, and step time by component, on a machine.

A :class:`Candidate` says how the grid's axes are used: ``pipeline x data x spatial... x tensor`` ranks
(in that row-major order: the tensor axis innermost, so its ranks share a node first), the ZeRO stage
of :class:`hpctp.nn.ShardedDataParallel`, activation recomputation, and the pipeline schedule and
micro-batches. :func:`predict` prices it from a :class:`~hpctp.perf.workload.Workload`:

**Memory** (the busiest rank; :mod:`hpctp.perf.memory`): parameters, gradients and Adam's two moments
from the parameters' layouts and the stage (stage 0 keeps all three whole; 1 shards the moments over
the data axes and keeps a flat slice beside the whole parameters; 2 also the gradients; 3 also the
parameters, which it gathers a unit at a time, two units at most, beside one unit's gradient);
activations from the traced timeline at the rank's block (micro-batch samples times field points,
divided by the tensor axis inside tensor-parallel modules), times the micro-batches a pipeline
schedule keeps in flight; the batch itself; the optimizer's temporaries at its step.

**Time** (:mod:`hpctp.perf.timing`): each module's flops at the machine's rate for their kind, its
kernel launches and elementwise bytes, its messages (:mod:`hpctp.perf.layers`) at the machine's
latency and bandwidth for the link they cross, overlapped only where hpctp overlaps them (halo
exchanges and the attention ring with the layer's own computation, gradient messages with backward,
stage 3's gathers with the previous unit); the pipeline's bubble from its schedule's action lists
(:meth:`hpctp.nn.pipeline_parallel.Schedule.simulate` with each stage's costs); the optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Candidate", "MemoryBreakdown", "TimeBreakdown", "Prediction", "ROLES"]

ROLES = ("pipeline", "data", "spatial", "tensor")
"""The roles of a plan's grid axes, outermost first."""


@dataclass(frozen=True, order=True)
class Candidate:
    """Local. One way to train on ``ranks`` ranks.

    Attributes
    ----------
    data : int
        Ranks holding different samples (data parallelism, sharded by ``zero``).
    spatial : tuple of int
        Ranks per field dim.
    tensor : int
        Ranks splitting the weights (heads, hidden units).
    pipeline : int
        Pipeline stages (consecutive layers per rank).
    zero : int
        The :class:`hpctp.nn.ShardedDataParallel` stage (0-3).
    recompute : bool
        Activation checkpointing of every layer.
    schedule : str
        The pipeline schedule (``""`` without a pipeline).
    microbatches : int
        Micro-batches per step (1 without a pipeline).
    chunks : int
        Stages per rank (the interleaved schedule's ``v``).
    """

    data: int
    spatial: tuple[int, ...]
    tensor: int = 1
    pipeline: int = 1
    zero: int = 0
    recompute: bool = False
    schedule: str = ""
    microbatches: int = 1
    chunks: int = 1

    @property
    def dims(self) -> tuple[int, ...]:
        """Local. The grid: ``(pipeline, data, *spatial, tensor)``."""
        return (self.pipeline, self.data, *self.spatial, self.tensor)

    @property
    def ranks(self) -> int:
        """Local. Ranks of the grid."""
        return math.prod(self.dims)

    @property
    def splits_field(self) -> bool:
        """Local. Whether the spatial axes split the field (over more than one rank): its layers then take their split
        paths, whose trace is :meth:`hpctp.perf.workload.Workload.trace_of`'s ``split``."""
        return math.prod(self.spatial) > 1

    @property
    def axes(self) -> dict[str, tuple[int, ...]]:
        """Local. ``role -> axes`` of :attr:`dims`."""
        n = len(self.spatial)
        return {"pipeline": (0,), "data": (1,), "spatial": tuple(range(2, 2 + n)), "tensor": (2 + n,)}

    def label(self) -> str:
        """Local. A short name, e.g. ``D2 S2x1 T1 Z1 R``: data, spatial, tensor ranks, ZeRO stage, recompute,
        and ``P2 1f1b m8`` for a pipeline."""
        text = f"D{self.data} S{'x'.join(map(str, self.spatial))} T{self.tensor} Z{self.zero}"
        if self.recompute:
            text += " R"
        if self.pipeline > 1:
            text += f" P{self.pipeline} {self.schedule} m{self.microbatches}"
            if self.chunks > 1:
                text += f" v{self.chunks}"
        return text


@dataclass(frozen=True)
class MemoryBreakdown:
    """Local. Predicted peak bytes on the busiest rank, by kind, at the moment of the peak.

    Attributes
    ----------
    params, grads, optimizer, activations, buffers, data : int
        Parameters (and their flat slices), gradients, optimizer state (and its step's
        temporaries), activations, gathered units and messages' buffers, the batch.
    phase : str
        When the peak happens (``"backward"``, ``"forward"`` or ``"optimizer step"``).
    stage : int
        The pipeline stage of the busiest rank.
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    data: int
    phase: str
    stage: int = 0

    @property
    def total(self) -> int:
        """Local. Bytes at the peak."""
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.data

    def kinds(self) -> dict[str, int]:
        """Local. ``kind -> bytes``."""
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers, "data": self.data}  # fmt: skip


@dataclass(frozen=True)
class TimeBreakdown:
    """Local. Predicted seconds of one step on the slowest rank, by component (exposed time: what overlaps is
    counted once, in ``compute``).

    Attributes
    ----------
    compute : float
        Forward, backward (with recomputation) and the host's kernel launches.
    comm : dict
        ``role -> seconds`` of messages not hidden behind computation (``"spatial"``, ``"tensor"``,
        ``"data"``, ``"pipeline"``).
    bubble : float
        Pipeline idle time of the slowest rank.
    optimizer : float
        The optimizer step.
    flops : float
        Flops of the busiest rank per step.
    """

    compute: float
    comm: dict[str, float] = field(default_factory=dict)
    bubble: float = 0.0
    optimizer: float = 0.0
    flops: float = 0.0

    @property
    def total(self) -> float:
        """Local. The step time."""
        return self.compute + sum(self.comm.values()) + self.bubble + self.optimizer

    def parts(self) -> dict[str, float]:
        """Local. ``component -> seconds`` (communication per role)."""
        out = {"compute": self.compute}
        out.update({f"{role} comm": t for role, t in self.comm.items()})
        out.update({"bubble": self.bubble, "optimizer": self.optimizer})
        return out


@dataclass(frozen=True)
class Prediction:
    """Local. A candidate's predicted memory and time, and whether it fits.

    Attributes
    ----------
    candidate : Candidate
    memory : MemoryBreakdown
    time : TimeBreakdown
    fits : bool
        Peak memory within the budget.
    reason : str
        Why it does not fit (empty when it does).
    cuts : tuple of int
        A pipeline plan's stage cuts over the model's children, the stages its prediction assumes
        (:func:`hpctp.perf.timing.chain_cuts`, balanced by flops): give them to
        ``hpctp.nn.PipelineParallel(cuts=...)``, whose default balances parameter counts instead. Empty for plans
        without a pipeline.
    """

    candidate: Candidate
    memory: MemoryBreakdown
    time: TimeBreakdown
    fits: bool = True
    reason: str = ""
    cuts: tuple[int, ...] = ()

    @property
    def bottleneck(self) -> str:
        """Local. The largest component of the step time (``"compute"``, ``"tensor comm"``, ``"bubble"`` ...)."""
        parts = self.time.parts()
        return max(parts, key=lambda k: parts[k])
