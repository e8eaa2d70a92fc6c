"""Cost model of the two attention schedules (ring, all-to-all): bytes, flops and time; the choice.

Pure functions of the layouts (no MPI), so every rank predicts the same and picks the same
schedule. The model is the alpha-beta-gamma one of :class:`hpctp.linalg.cost.Machine`: a
message of ``b`` bytes costs ``alpha + beta * b`` seconds, a flop ``gamma``. Figures are those of
the busiest rank, forward plus (with ``backward``) backward.

* **ring** (:func:`hpctp.nn.context_parallel.attention`, ``schedule="ring"``): over a token
  sub-grid of ``P`` ranks holding ``n_m`` keys each (``T = sum n_m``), a rank sends every block
  but its successor's in the forward pass, ``(T - n_succ) * bh * (D + Dv) * itemsize`` bytes in
  ``P - 1`` messages (``bh``: its batch x heads), and in the backward pass the blocks again plus
  every block's ``dK/dV`` once (``P`` more messages). The transfers overlap the block
  attention, so the time is ``max(comm, compute)``. With contiguous blocks the last rank of a
  causal ring sees every key, so causality saves the busiest rank nothing.
* **all-to-all** (``schedule="all_to_all"``, Ulysses): q, k, v move from token-split to
  batch/heads-split (:func:`hpctp.layout.ring.all_to_all_split`), each rank attends over whole
  token sets, the output moves back (and the gradients, in backward); a move over ``P`` ranks
  sends about ``(P - 1) / P`` of a block in ``P - 1`` messages. No overlap: the time is
  ``comm + compute``; causality halves the compute; fewer heads than ranks leave ranks idle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..layout import Layout
from ..layout.ring import all_to_all_split, token_dims
from ..linalg.cost import Machine

__all__ = ["SCHEDULES", "AttentionCost", "choose_schedule", "predict_attention"]

SCHEDULES = ("ring", "all_to_all")
"""The attention schedules that :func:`predict_attention` prices."""


@dataclass(frozen=True)
class AttentionCost:
    """Local. Predicted cost of one attention call on its busiest rank.

    Attributes
    ----------
    schedule : {"ring", "all_to_all"}
    supported : bool
        False where the schedule cannot run these layouts (``reason`` says why).
    reason : str
    bytes_sent : int
        Bytes the busiest rank sends (what :class:`hpctp.CommCounter` reports for the ring).
    messages : int
        Messages the busiest rank sends.
    flops : float
        Flops of the busiest rank.
    comm_time, compute_time, time : float
        Seconds: communication, computation, and the predicted wall time.
    """

    schedule: str
    supported: bool
    reason: str
    bytes_sent: int
    messages: int
    flops: float
    comm_time: float
    compute_time: float
    time: float


def _max_extent(layout: Layout, d: int) -> int:
    return max(layout.block_sizes(d))


def _flops_per_pair(d: int, dv: int, backward: bool) -> int:
    """Flops per (query, key) pair: QK^T and PV forward; backward adds QK^T again, dV, dP, dQ and dK."""
    forward = 2 * (d + dv)
    return forward + (2 * (3 * d + 2 * dv) if backward else 0)


def _ring_cost(
    q: Layout, k: Layout, v: Layout, itemsize: int, acc_itemsize: int, backward: bool, m: Machine
) -> AttentionCost:
    # blocks are products of per-dim blocks: the largest/smallest block is the product of the extremes
    dims = token_dims(q.ndim)
    p = math.prod(k.parts(t) for t in dims)
    total = math.prod(k.global_shape[t] for t in dims)
    smallest = math.prod(min(k.block_sizes(t)) for t in dims)
    nonempty = math.prod(sum(1 for n in k.block_sizes(t) if n) for t in dims)
    q_tokens = math.prod(_max_extent(q, t) for t in dims)
    bh = _max_extent(q, 0) * _max_extent(q, 1)
    d, dv = q.global_shape[-1], v.global_shape[-1]
    per_token = bh * (d + dv)
    sent, messages = 0, 0
    if p > 1:
        sent = (total - smallest) * per_token * itemsize
        messages = nonempty - (1 if smallest else 0)
        if backward:  # the blocks again, then every block's dK/dV once
            sent += (total - smallest) * per_token * itemsize + total * per_token * acc_itemsize
            messages += messages + nonempty
    flops = float(bh * q_tokens * total * _flops_per_pair(d, dv, backward))
    comm = m.alpha * messages + m.beta * sent
    compute = m.gamma * flops
    return AttentionCost("ring", True, "", int(sent), messages, flops, comm, compute, max(comm, compute))


def _all_to_all_cost(
    q: Layout, k: Layout, v: Layout, itemsize: int, causal: bool, backward: bool, m: Machine
) -> AttentionCost:
    split, reason = all_to_all_split(q)
    if split is None:
        return AttentionCost("all_to_all", False, reason, 0, 0, 0.0, 0.0, 0.0, math.inf)
    dims = token_dims(q.ndim)
    grid = q.grid_dims
    moved = [g for g in set(split[:2]) - set(q.split[:2]) if g is not None]
    p = math.prod(grid[g] for g in moved)
    d, dv = q.global_shape[-1], v.global_shape[-1]

    def block(layout: Layout) -> int:
        return math.prod(_max_extent(layout, t) for t in range(layout.ndim))

    out_elems = block(q) // d * dv if d else 0
    elems = block(q) + block(k) + block(v) + out_elems
    sent = 0
    messages = 0
    if p > 1:
        sent = int(elems * itemsize * (p - 1) / p)
        messages = 4 * (p - 1)
        if backward:
            sent *= 2
            messages *= 2
    target = Layout(q.global_shape, grid, split)
    bh = _max_extent(target, 0) * _max_extent(target, 1)
    lq = math.prod(q.global_shape[t] for t in dims)
    lk = math.prod(k.global_shape[t] for t in dims)
    flops = float(bh * lq * lk * _flops_per_pair(d, dv, backward)) * (0.5 if causal else 1.0)
    comm = m.alpha * messages + m.beta * sent
    compute = m.gamma * flops
    return AttentionCost("all_to_all", True, "", sent, messages, flops, comm, compute, comm + compute)


def predict_attention(
    q: Layout,
    k: Layout,
    v: Layout,
    itemsize: int,
    *,
    causal: bool = False,
    backward: bool = True,
    acc_itemsize: int | None = None,
    machine: Machine | None = None,
) -> dict[str, AttentionCost]:
    """Local. Predicted cost of both attention schedules for these layouts.

    Parameters
    ----------
    q, k, v : Layout
        Layouts of the queries, keys and values ``[batch, heads, *tokens, head_dim]``.
    itemsize : int
        Bytes per element of q/k/v.
    causal : bool, optional
    backward : bool, optional
        Include the backward pass (default True).
    acc_itemsize : int, optional
        Bytes per element of the ring's travelling ``dK/dV`` (float32 for half inputs;
        default ``itemsize``).
    machine : Machine, optional
        Machine parameters (default :class:`hpctp.linalg.cost.Machine()`).

    Returns
    -------
    dict
        ``{"ring": AttentionCost, "all_to_all": AttentionCost}``.
    """
    m = Machine() if machine is None else machine
    acc = itemsize if acc_itemsize is None else acc_itemsize
    return {
        "ring": _ring_cost(q, k, v, itemsize, acc, backward, m),
        "all_to_all": _all_to_all_cost(q, k, v, itemsize, causal, backward, m),
    }


def choose_schedule(costs: dict[str, AttentionCost]) -> str:
    """Local. The supported schedule of least predicted time (``"all_to_all"`` on a tie: torch's own kernel).

    Parameters
    ----------
    costs : dict
        From :func:`predict_attention`.

    Returns
    -------
    str
    """
    ring, a2a = costs["ring"], costs["all_to_all"]
    if a2a.supported and a2a.time <= ring.time:
        return "all_to_all"
    return "ring"
