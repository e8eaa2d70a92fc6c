"""Distributed torch.nn layers whose tensors are partitioned over a ProcessGrid.

Layers take and return this rank's block (a ``torch.Tensor``) or a :class:`hpctp.DistTensor`,
and compute what the torch layer computes on the gathered tensor. Replicated parameters
get partial gradients on each rank: call :func:`sync_gradients` before the optimizer step.
"""

from ..ops.autograd import AllReduceSum, allreduce_sum
from . import context_parallel, functional, sequence_parallel
from .attention import MultiheadAttention
from .context_parallel import attention_schedule
from .conv import Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from .layer_norm import LayerNorm, RMSNorm
from .linear import ColumnParallelLinear, Linear, Linear2D, RowParallelLinear
from .loss import global_l1_loss, global_mean, global_mse_loss, global_sum, relative_l2_error
from .materialize import materialize
from .mlp import ParallelMLP
from .neighborhood import NeighborhoodAttention2d, NeighborhoodAttention3d
from .norm import BatchNorm1d, BatchNorm2d, BatchNorm3d, GroupNorm
from .parallel import broadcast_parameters, check_replicas, sync_gradients
from .patch import (
    PatchEmbed2d,
    PatchEmbed3d,
    Unpatch2d,
    Unpatch3d,
    patch_aligned_layout,
    patched_layout,
    unpatched_layout,
)
from .plan import ParallelPlan
from .pool import AvgPool2d, AvgPool3d, MaxPool2d, MaxPool3d
from .recompute import Checkpointed, checkpoint, checkpoint_forward
from .sharded import ShardedDataParallel
from .spectral import SpectralConv1d, SpectralConv2d, SpectralConv3d
from .state_dict import global_state_dict, load_global_state_dict
from .transformer import TransformerBlock
from .upsample import Upsample

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
    "sequence_parallel",
    "sync_gradients",
    "unpatched_layout",
]
