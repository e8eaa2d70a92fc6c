"""Distributed torch.nn layers whose tensors are partitioned over a ProcessGrid.

Layers take and return this rank's block (a ``torch.Tensor``) or a :class:`hpctp.DistTensor`,
and compute what the torch layer computes on the gathered tensor. Replicated parameters
get partial gradients on each rank: call :func:`sync_gradients` before the optimizer step.
"""

import importlib
import sys

from ..ops.autograd import AllReduceSum, allreduce_sum
from . import distributed, functional, pipeline_parallel, spatial, spectral, transformer
from .distributed import (
    Checkpointed,
    ParallelPlan,
    ShardedDataParallel,
    broadcast_parameters,
    check_replicas,
    checkpoint,
    checkpoint_forward,
    global_state_dict,
    load_global_state_dict,
    sync_gradients,
)
from .loss import global_l1_loss, global_mean, global_mse_loss, global_sum, relative_l2_error
from .meta import materialize
from .pipeline_parallel import PipelineParallel
from .spatial import (
    AvgPool2d,
    AvgPool3d,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    GroupNorm,
    MaxPool2d,
    MaxPool3d,
    Upsample,
)
from .spectral import SpectralConv1d, SpectralConv2d, SpectralConv3d
from .transformer import (
    ColumnParallelLinear,
    LayerNorm,
    Linear,
    Linear2D,
    MultiheadAttention,
    NeighborhoodAttention2d,
    NeighborhoodAttention3d,
    ParallelMLP,
    PatchEmbed2d,
    PatchEmbed3d,
    RMSNorm,
    RowParallelLinear,
    TransformerBlock,
    Unpatch2d,
    Unpatch3d,
    attention_schedule,
    context_parallel,
    patch_aligned_layout,
    patched_layout,
    sequence_parallel,
    unpatched_layout,
)

# Where the modules of the flat hpctp.nn of before the rooms live now: ``import hpctp.nn.linear`` and
# ``from hpctp.nn.sharded import ...`` keep working (the same module objects; new code imports the new paths).
MOVED = {
    "_dft": "spectral._dft", "_fetch": "spatial._fetch", "_inputs": "spatial._inputs",
    "_sharded_bucket": "distributed._bucket", "_sharded_state": "distributed._optimizer_state",
    "_sharded_units": "distributed._units", "_window": "spatial._window", "attention": "transformer.attention",
    "context_parallel": "transformer.context_parallel", "conv": "spatial.conv", "fourier": "spectral.fourier", "layer_norm": "transformer.layer_norm",
    "linear": "transformer.linear", "mlp": "transformer.mlp", "neighborhood": "transformer.neighborhood",
    "norm": "spatial.norm", "parallel": "distributed.replicas", "patch": "transformer.patch",
    "plan": "distributed.plan", "pool": "spatial.pool", "recompute": "distributed.recompute",
    "sequence_parallel": "transformer.sequence_parallel", "sharded": "distributed.sharded", "state_dict": "distributed.state_dict", "upsample": "spatial.upsample",
    "window_spec": "spatial.window_spec",
}  # fmt: skip
for _old, _new in MOVED.items():
    sys.modules[f"{__name__}.{_old}"] = importlib.import_module(f"{__name__}.{_new}")

__all__ = [
    "AllReduceSum",
    "AvgPool2d",
    "AvgPool3d",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Checkpointed",
    "ColumnParallelLinear",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "GroupNorm",
    "LayerNorm",
    "Linear",
    "Linear2D",
    "MaxPool2d",
    "MaxPool3d",
    "MultiheadAttention",
    "NeighborhoodAttention2d",
    "NeighborhoodAttention3d",
    "ParallelMLP",
    "ParallelPlan",
    "PipelineParallel",
    "PatchEmbed2d",
    "PatchEmbed3d",
    "RMSNorm",
    "RowParallelLinear",
    "ShardedDataParallel",
    "SpectralConv1d",
    "SpectralConv2d",
    "SpectralConv3d",
    "TransformerBlock",
    "Unpatch2d",
    "Unpatch3d",
    "Upsample",
    "allreduce_sum",
    "attention_schedule",
    "broadcast_parameters",
    "check_replicas",
    "checkpoint",
    "checkpoint_forward",
    "context_parallel",
    "distributed",
    "functional",
    "global_l1_loss",
    "global_mean",
    "global_mse_loss",
    "global_state_dict",
    "global_sum",
    "load_global_state_dict",
    "materialize",
    "patch_aligned_layout",
    "patched_layout",
    "relative_l2_error",
    "pipeline_parallel",
    "sequence_parallel",
    "spatial",
    "spectral",
    "sync_gradients",
    "transformer",
    "unpatched_layout",
]
