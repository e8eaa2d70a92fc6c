"""Training on data x spatial x tensor grids: the roles of the grid axes, sharded data parallelism, replicas.

``plan`` (:class:`ParallelPlan`: which axes carry data, spatial and tensor parallelism), ``sharded``
(:class:`ShardedDataParallel`, ZeRO 1-3/FSDP; its flat buckets ``_bucket``, stage-3 units ``_units`` and
per-slice optimizer state ``_optimizer_state``), ``replicas`` (gradient sums and replica checks), ``recompute``
(activation checkpointing through layers that communicate), ``state_dict`` (one-process state dicts in and out).
"""

# plan.py
from .plan import ParallelPlan

# recompute.py
from .recompute import Checkpointed, checkpoint, checkpoint_forward

# replicas.py
from .replicas import broadcast_parameters, check_replicas, sync_gradients

# sharded.py
from .sharded import ShardedDataParallel

# state_dict.py
from .state_dict import global_state_dict, load_global_state_dict

__all__ = [
    # plan.py
    "ParallelPlan",
    # recompute.py
    "Checkpointed", "checkpoint", "checkpoint_forward",
    # replicas.py
    "broadcast_parameters", "check_replicas", "sync_gradients",
    # sharded.py
    "ShardedDataParallel",
    # state_dict.py
    "global_state_dict", "load_global_state_dict",
]  # fmt: skip
