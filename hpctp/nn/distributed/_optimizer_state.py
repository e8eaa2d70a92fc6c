"""The optimizer state of :class:`hpctp.nn.ShardedDataParallel`'s flat slices, cut per parameter and back.

Stages 1-3 step one flat slice per bucket, so an elementwise optimizer (Adam, SGD...) holds one
state tensor per slice. :meth:`ShardedDataParallel.gathered` shows it per parameter, as torch
keeps it for a plain model (gathering the slices), and :func:`slice_state` cuts per-parameter
state back into a slice.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from ... import comm as C
from ._bucket import Bucket

__all__ = ["state_kinds", "gather_flat", "copy_value", "slice_state", "optimizer_like"]


def state_kinds(state: dict[str, Any], bucket: Bucket) -> list[tuple[str, str]]:
    """Each optimizer state entry of a slice: ``elementwise`` (one value per element), ``tensor`` (0-d) or ``number``.

    Raises
    ------
    ValueError
        On other state.
    """
    out = []
    for k in sorted(state):
        v = state[k]
        if isinstance(v, torch.Tensor) and tuple(v.shape) == (bucket.hi - bucket.lo,):
            out.append((k, "elementwise"))
        elif isinstance(v, torch.Tensor) and v.ndim == 0:
            out.append((k, "tensor"))
        elif isinstance(v, (bool, int, float)):
            out.append((k, "number"))
        else:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(
                f"ShardedDataParallel: optimizer state {k!r} of a slice of {bucket.hi - bucket.lo} elements is {shape}; "
                "only per-element state and scalars can be cut per parameter (use an elementwise optimizer)"
            )
    return out


def gather_flat(bucket: Bucket, part: torch.Tensor) -> torch.Tensor:
    """Collective over the data axes. Every rank's slice of a per-element state: the whole flat tensor."""
    whole = torch.empty(bucket.numel, dtype=part.dtype, device=part.device)
    C.iallgatherv(bucket.data_comm, part.detach().contiguous(), whole, bucket.counts).wait()
    return whole


def copy_value(v: Any) -> Any:
    """Local. A tensor detached and cloned; anything else as it is."""
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def slice_state(bucket: Bucket, states: list[dict[str, Any]]) -> dict[str, Any]:
    """Local. The state of the bucket's slice from its parameters' states (the reverse of the gather).

    Raises
    ------
    ValueError
        If the parameters' states have different keys or scalars.
    """
    keys = sorted(states[0]) if states else []
    if any(sorted(s) != keys for s in states):
        raise ValueError(
            f"ShardedDataParallel: the parameters {bucket.names} have different optimizer state keys; "
            "they share one flat slice and must be stepped together"
        )
    out: dict[str, Any] = {}
    for k in keys:
        values = [s[k] for s in states]
        if _is_elementwise(k, values, bucket.params):
            whole = torch.cat([v.detach().reshape(-1) for v in values])
            out[k] = whole[bucket.lo : bucket.hi].clone()
        else:
            first = values[0]
            if any(not _same(first, v) for v in values[1:]):
                raise ValueError(f"ShardedDataParallel: optimizer state {k!r} differs between {bucket.names}")
            out[k] = copy_value(first)
    return out


def _is_elementwise(key: str, values: list[Any], params: list[torch.nn.Parameter]) -> bool:
    if not all(isinstance(v, torch.Tensor) and v.shape == p.shape for v, p in zip(values, params)):
        return False
    return any(p.ndim > 0 for p in params) or key != "step"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bool(a.shape == b.shape and torch.equal(a.cpu(), b.cpu()))
    return bool(a == b)


def optimizer_like(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], state: dict[torch.nn.Parameter, dict[str, Any]]
) -> torch.optim.Optimizer:
    """Local. An optimizer of ``optimizer``'s class and hyperparameters over ``params`` holding ``state``
    (made without its constructor, as ``copy`` does, so any optimizer class works)."""
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    view = type(optimizer).__new__(type(optimizer))
    view.__setstate__(
        {
            "defaults": dict(optimizer.defaults),
            "state": defaultdict(dict, state),
            "param_groups": [{**group, "params": params}],
        }
    )
    return view
