"""Exact attention over tokens split on a 1-, 2- or 3-D process grid: a ring schedule and an all-to-all one.

``attention(q, k, v)`` takes DistTensors ``[batch, heads, *tokens, head_dim]`` whose token dims
(a sequence, or the patch grid of a 2-D/3-D field) are cut over any grid axes, evenly or not,
and returns this rank's block of ``torch.nn.functional.scaled_dot_product_attention`` of the
flattened tokens (row-major, ``x.flatten(2, -2)``), in the queries' layout.

**Ring** (:mod:`hpctp.layout.ring` plans it): the ranks that share every non-token coordinate
(the token sub-grid: all ranks that split the tokens, over one axis or several) pass K/V
blocks around one ring, row-major over the sub-grid. A block travels in pieces (at most
:data:`RING_PIECES`, :data:`RING_PIECES_BACKWARD` in backward, each of at least :data:`KEY_TILE_MIN` keys), and the ring
runs piece by piece:
piece 0 of every step's block, then piece 1, and so on, so a piece reaches the successor one unit after
this rank used it. Per piece a rank waits for it (its own keys at step 0), sends it on (unless the successor
owns it), posts the receive of the next piece, attends its queries to the piece and merges the result into
the running output, testing the messages between kernel calls so they progress; the piece's buffer is
reused once its send has completed. On CPU, with one head dim for q, k and v, each piece goes to torch's
CPU flash kernels (``_scaled_dot_product_flash_attention_for_cpu``, no score matrix held): the pieces'
outputs merge by their log-sum-exp, and backward calls the flash backward per piece with the global output
and log-sum-exp (which gives that piece's exact dQ/dK/dV share). Else (CUDA, or v's head dim differing)
the piece is attended in key tiles of at most :data:`SCORE_TILE_ELEMENTS` scores (at least
:data:`KEY_TILE_MIN` keys), merged with the running maximum and sum of exponentials. Accumulation
is in float32 for half inputs, else in the input's dtype. Every K/V element is sent once per
pass by each rank but the one before its owner (one message per piece); a rank holds its own block
and three K/V pieces in flight (backward: also a few travelling dK/dV pieces and its own block's dK/dV),
not whole blocks, and one score tile or flash piece: memory O(tokens / P). Messages of empty blocks
(uneven cuts) are skipped on both sides. Causal attention (query ``i`` sees key ``j <= i`` in the
flattened order) skips pieces that are wholly hidden (still forwarding them) and masks partly visible ones
(flash: each query sees a prefix of the piece's keys, so the piece splits into unmasked parts, causal
squares on diagonal runs and small float masks of at most :data:`MASK_ELEMENTS` pairs). The backward pass
recomputes each piece's probabilities from the saved log-sum-exp; the K/V pieces travel the ring again,
and each piece's ``dK/dV`` travels one unit behind it, each rank adding its share, until it reaches its
owner. With contiguous blocks a causal ring is unbalanced (the last rank sees every key); the
all-to-all schedule is not.

**All-to-all** (Ulysses): one redistribution moves q, k, v from token-split to batch/heads-split
(:func:`hpctp.layout.ring.all_to_all_split`), every rank runs torch's SDPA on whole token sets,
and one redistribution moves the output back (autograd moves the gradients the other way).
Possible while the grid axes splitting tokens (of more than one rank) do not outnumber the
undivided batch/heads dims.

``schedule="auto"`` picks the one :mod:`hpctp.perf` (:mod:`hpctp.linalg.cost`) predicts faster on the machine the
runtime prices with (:func:`hpctp.machine.runtime_cost_machine` of the grid axes that split the tokens:
``HPCTP_MACHINE``, the device's default, or the planner's machine inside :func:`hpctp.machine.use_machine`) and logs
the choice on rank 0 (logger ``hpctp.nn.transformer.attention``, once per set of arguments and machine);
:func:`attention_schedule` returns it. Arguments are validated on every rank and agreed once per
distinct set of layouts, dtype and flags (the verdict is cached per grid), so repeated calls
add no message beyond the attention's own.
"""

from __future__ import annotations

import logging
import math
import numbers
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

from ... import comm as C
from ..._util.backend import backend_name, from_bytes
from ...comm import ProcessGrid, tags
from ...comm import pool as P
from ...layout import Layout
from ...layout.ring import RingPlan, all_to_all_split, flat_token_indices, ring_plan, token_dims
from ...linalg.cost import AttentionCost, choose_schedule, predict_attention
from ...machine import MachineProfile, default_machine, runtime_cost_machine
from ...ops.move import move_block
from ...tensor.core import DistTensor
from .._amp import autocast_input, autocast_off

__all__ = [
    "CAUSAL_RUN_MIN",
    "FLASH_BLOCKS",
    "KEY_TILE_MIN",
    "MASK_ELEMENTS",
    "RING_GRAD_TAG",
    "RING_PIECES",
    "RING_PIECES_BACKWARD",
    "RING_TAG",
    "SCORE_TILE_ELEMENTS",
    "attention",
    "attention_schedule",
]

RING_TAG = tags.RING
"""MPI tag of the K/V blocks travelling the ring (on the grid's communicator)."""
RING_GRAD_TAG = tags.RING_GRAD
"""MPI tag of the ``dK/dV`` blocks travelling the ring in the backward pass."""
SCORE_TILE_ELEMENTS = 1 << 22
"""Scores (``batch x heads x queries x keys``) one ring step holds at once; keys are tiled to stay below it."""
KEY_TILE_MIN = 64
"""Fewest keys of a tile (a rank with many queries holds ``batch x heads x queries x KEY_TILE_MIN`` scores)."""
FLASH_BLOCKS = True
"""Attend each K/V block with torch's CPU flash kernels where they apply (CPU blocks, one head dim for q, k and
v, no empty block); else (and with False) in key tiles."""
MASK_ELEMENTS = 1 << 16
"""Most (query, key) pairs of one float mask (the flash path's pieces of partly visible blocks off a diagonal)."""
RING_PIECES = 2
"""Most pieces a K/V block travels the ring in (each of at least :data:`KEY_TILE_MIN` keys), forward: a rank
holds its own block and a few pieces in flight, not whole blocks. Each piece is one more kernel call and one more
merge of the running output: 2 cost 2 % of the forward's time over 1, 4 cost 6 % (64 x 64 patches, 2 ranks)."""
RING_PIECES_BACKWARD = 8
"""As :data:`RING_PIECES`, backward: it holds dK/dV pieces too (its peak is the pass's peak), and its longer
kernels hide the cost of more calls."""
CAUSAL_RUN_MIN = 16
"""Fewest queries of a diagonal run (each sees one key more than the one before) attended with the flash
kernel's own causal mask; shorter runs take a float mask."""

_KV_SLOTS = 3  # K/V piece buffers of a ring pass (the piece in use, the next arriving, the last sent)
RING_GRAD_SLOTS = 3
"""dK/dV piece buffers a backward ring pass holds, as its ranks keep step (:class:`_GradRing`: the one arriving,
the one in use, the one sent; more when a rank runs ahead): what the planner counts."""
_SCHEDULE_CHOICES = ("ring", "all_to_all", "auto")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LOG = logging.getLogger("hpctp.nn.attention")


@dataclass(frozen=True)
class _Call:
    """What the agreed arguments resolve to: the schedule, scale, output layout and predicted costs."""

    schedule: str
    scale: float
    out_layout: Layout
    head_split: tuple[int | None, ...] | None
    costs: dict[str, AttentionCost]


# per grid: agreed argument sets -> (the machine the call was priced on, the call)
_agreed: weakref.WeakKeyDictionary[ProcessGrid, dict[tuple[Any, ...], tuple[MachineProfile, _Call]]] = (
    weakref.WeakKeyDictionary()
)
_MAX_AGREED = 256  # argument sets remembered per grid (the oldest forgotten first: agreed again if seen again)


# ---------------------------------------------------------------------------------------------- arguments
def _grid_of(q: object, k: object, v: object) -> ProcessGrid:
    for x in (q, k, v):
        if isinstance(x, DistTensor):
            return x.grid
    raise TypeError(
        f"attention needs hpctp.DistTensor q, k, v (got {type(q).__name__}, {type(k).__name__}, "
        f"{type(v).__name__}); wrap blocks with hpctp.from_local(block, grid, split)"
    )


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(q: Any, k: Any, v: Any, causal: object, scale: object, schedule: object) -> None:
    """Local. Raise TypeError/ValueError naming the problem and the fix."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, DistTensor):
            raise TypeError(f"attention: {name} must be a hpctp.DistTensor, got {type(x).__name__}")
        if backend_name(x.local) != "torch":
            raise TypeError(f"attention: {name} has {backend_name(x.local)} blocks; convert it with {name}.to('torch')")
        if x.dtype not in _FLOATS:
            raise TypeError(f"attention: {name} has dtype {x.dtype}; use float16, bfloat16, float32 or float64")
        if x.ndim < 4:
            raise ValueError(
                f"attention: {name} has shape {x.global_shape}; give [batch, heads, *tokens, head_dim] "
                f"with 1, 2 or 3 token dims"
            )
    if not (q.grid is k.grid and k.grid is v.grid):
        raise ValueError("attention: q, k and v must be on one ProcessGrid object; redistribute them onto q.grid")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"attention: q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; cast them to one dtype")
    if not (q.local.device == k.local.device == v.local.device):
        raise ValueError(
            f"attention: q, k, v are on devices {q.local.device}, {k.local.device}, {v.local.device}; move them to one"
        )
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(f"attention: q, k, v have {q.ndim}, {k.ndim}, {v.ndim} dims; give them the same token dims")
    if q.global_shape[-1] != k.global_shape[-1]:
        raise ValueError(
            f"attention: q's head dim {q.global_shape[-1]} differs from k's {k.global_shape[-1]}; they must match"
        )
    if k.global_shape[:-1] != v.global_shape[:-1] or k.layout.dim_cuts[:-1] != v.layout.dim_cuts[:-1]:
        raise ValueError(
            f"attention: k {k.layout} and v {v.layout} must have the same shape (but the head dim) and cuts; "
            f"redistribute v to k's layout"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"attention: causal must be a bool, got {causal!r}")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(float(scale))
    ):
        raise ValueError(f"attention: scale must be None or a finite real number, got {scale!r}")
    if schedule not in _SCHEDULE_CHOICES:
        raise ValueError(f"attention: schedule must be one of {_SCHEDULE_CHOICES}, got {schedule!r}")
    ring_plan(q.layout, k.layout, q.grid.rank, causal)  # raises on unsupported layouts
    if schedule == "all_to_all":
        split, reason = all_to_all_split(q.layout)
        if split is None:
            raise ValueError(f"attention: schedule='all_to_all' cannot run here: {reason}; use schedule='ring'")


def _out_layout(q: Layout, dv: int) -> Layout:
    cuts = q.cuts[:-1] + (None,) if q.cuts else ()
    return Layout(q.global_shape[:-1] + (dv,), q.grid_dims, q.split, cuts)


def _grads(q: Any, k: Any, v: Any) -> tuple[bool, ...]:
    on = torch.is_grad_enabled()
    return tuple(bool(on and x.local.requires_grad) for x in (q, k, v))


def _token_axes(*layouts: Layout) -> tuple[int, ...]:
    """The grid axes that split the token dims: the axes the ring and the all-to-all move blocks along."""
    return tuple(sorted({g for x in layouts for t in token_dims(x.ndim) if (g := x.split[t]) is not None}))


def _resolve(
    q: DistTensor, k: DistTensor, v: DistTensor, causal: bool, scale: float | None, schedule: str,
    machine: MachineProfile,
) -> _Call:  # fmt: skip
    grads = _grads(q, k, v)
    itemsize = q.local.element_size()
    acc = torch.empty((), dtype=_acc_dtype(q.dtype)).element_size()
    priced = runtime_cost_machine(q.layout.grid_dims, _token_axes(q.layout, k.layout), q.dtype, machine)
    costs = predict_attention(
        q.layout, k.layout, v.layout, itemsize, causal=causal, backward=any(grads), acc_itemsize=acc, machine=priced
    )
    chosen = choose_schedule(costs) if schedule == "auto" else schedule
    split, _ = all_to_all_split(q.layout)
    return _Call(
        schedule=chosen,
        scale=1.0 / math.sqrt(q.global_shape[-1]) if scale is None else float(scale),
        out_layout=_out_layout(q.layout, v.global_shape[-1]),
        head_split=split,
        costs=costs,
    )


def _prepare(q: Any, k: Any, v: Any, causal: Any, scale: Any, schedule: Any) -> tuple[ProcessGrid, _Call]:
    """Collective over grid on the first call with these arguments, else Local: validate, agree, resolve (priced
    again, without a message, when the machine the runtime prices with has changed since)."""
    grid = _grid_of(q, k, v)
    error: Exception | None = None
    key: tuple[Any, ...] | None = None
    machine: MachineProfile | None = None
    try:
        _check(q, k, v, causal, scale, schedule)
        machine = default_machine()  # (a bad HPCTP_MACHINE is an error of the arguments' agreement)
        key = (
            q.layout, k.layout, v.layout, q.dtype, q.local.device.type, causal,
            None if scale is None else float(scale), schedule, _grads(q, k, v),
        )  # fmt: skip
    except (TypeError, ValueError) as e:
        error = e
    table = _agreed.setdefault(grid, {})
    if key is not None and key in table:
        priced_on, call = table[key]
        if priced_on is not machine:  # (machine: set before key)
            call = _resolved(grid, q, k, v, causal, scale, schedule, cast(MachineProfile, machine))
            table[key] = (cast(MachineProfile, machine), call)
        return grid, call
    shown = (None,) * 9 if key is None else key
    C.agree_arguments(
        grid.comm, "attention", error,
        layouts=shown[:3], dtype=str(shown[3]), device=shown[4], causal=shown[5], scale=shown[6],
        schedule=shown[7], requires_grad=shown[8],
    )  # fmt: skip
    machine = cast(MachineProfile, machine)  # (agree_arguments raised on an error: key and machine are set)
    call = _resolved(grid, q, k, v, causal, scale, schedule, machine)
    if len(table) >= _MAX_AGREED:
        del table[next(iter(table))]
    table[key] = (machine, call)  # type: ignore[index]
    return grid, call


def _resolved(
    grid: ProcessGrid, q: DistTensor, k: DistTensor, v: DistTensor, causal: bool, scale: float | None, schedule: str,
    machine: MachineProfile,
) -> _Call:  # fmt: skip
    """Local. :func:`_resolve`, the choice of ``schedule="auto"`` logged on rank 0."""
    call = _resolve(q, k, v, causal, scale, schedule, machine)
    if grid.rank == 0 and schedule == "auto":
        ring, a2a = call.costs["ring"], call.costs["all_to_all"]
        other = f"{a2a.time:.3g} s" if a2a.supported else f"unsupported: {a2a.reason}"
        _LOG.info(
            "attention %s x %s: %s schedule (predicted ring %.3g s, all_to_all %s, on %s)",
            q.global_shape, k.global_shape, call.schedule, ring.time, other, machine.name,
        )  # fmt: skip
    return call


# ---------------------------------------------------------------------------------------------- block math
def _key_tile(bh: int, queries: int) -> int:
    return max(KEY_TILE_MIN, SCORE_TILE_ELEMENTS // max(1, bh * queries))


def _mask(q_index: torch.Tensor | None, k_index: torch.Tensor | None, c0: int, c1: int) -> torch.Tensor | None:
    """Visible (query, key) pairs of a key tile, or None when all are visible."""
    if q_index is None or k_index is None:
        return None
    return k_index[None, c0:c1] <= q_index[:, None]


def _score_tiles(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
    q_index: torch.Tensor | None, k_index: torch.Tensor | None,
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Key tiles of one K/V block: ``(c0, c1, k tile, v tile, scaled scores)`` in ``q``'s dtype, the keys
    a query may not see (causal ``q_index``/``k_index``) at ``-inf``; at most :data:`SCORE_TILE_ELEMENTS` scores."""
    acc = q.dtype
    n = k.shape[2]
    tile = _key_tile(q.shape[0] * q.shape[1], q.shape[2])
    for c0 in range(0, n, tile):
        c1 = min(n, c0 + tile)
        kc, vc = k[:, :, c0:c1].to(acc), v[:, :, c0:c1].to(acc)
        s = torch.matmul(q, kc.transpose(-1, -2)).mul_(scale)
        mask = _mask(q_index, k_index, c0, c1)
        if mask is not None:
            s.masked_fill_(~mask, -math.inf)
        yield c0, c1, kc, vc, s


def _forward_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float, q_index: torch.Tensor | None, k_index: torch.Tensor | None, poke: Callable[[], None] | None = None,
) -> None:  # fmt: skip
    """Merge the attention of ``q`` to one K/V block into the running ``(max, sum, numerator)``;
    ``poke`` is called after each key tile (to let messages progress). On ``meta`` (a dry run on a virtual grid:
    shapes only) the merge is in place, so there is nothing to do."""
    if q.device.type == "meta":
        return
    m, denom, o = state
    for _, _, _, vc, s in _score_tiles(q, k, v, scale, q_index, k_index):
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_use = m_new.masked_fill(m_new == -math.inf, 0.0)  # rows that saw no key yet stay at zero weight
        p = s.sub_(m_use[..., None]).exp_()
        corr = torch.exp(m - m_use)
        denom.mul_(corr).add_(p.sum(dim=-1))
        o.mul_(corr[..., None]).add_(torch.matmul(p, vc))
        m.copy_(m_new)
        if poke is not None:
            poke()


def _backward_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
    dq: torch.Tensor, dk: torch.Tensor | None, dv: torch.Tensor | None, scale: float,
    q_index: torch.Tensor | None, k_index: torch.Tensor | None, poke: Callable[[], None] | None = None,
) -> None:  # fmt: skip
    """Add one K/V block's share to ``dq`` and its gradients to ``dk``/``dv`` (None: not wanted);
    ``poke`` is called after each key tile; nothing to do on ``meta`` (in place, as :func:`_forward_block`)."""
    if q.device.type == "meta":
        return
    for c0, c1, kc, vc, s in _score_tiles(q, k, v, scale, q_index, k_index):
        p = s.sub_(lse[..., None]).exp_()
        if dv is not None:
            dv[:, :, c0:c1].add_(torch.matmul(p.transpose(-1, -2), dout))
        ds = torch.matmul(dout, vc.transpose(-1, -2)).sub_(delta[..., None]).mul_(p).mul_(scale)
        dq.add_(torch.matmul(ds, kc))
        if dk is not None:
            dk[:, :, c0:c1].add_(torch.matmul(ds.transpose(-1, -2), q))
        if poke is not None:
            poke()


# ---------------------------------------------------------------------------------------------- flash blocks
@dataclass(frozen=True, eq=False)
class _Piece:
    """Queries ``[r0, r1)`` of a block attend its keys ``[k0, k1)``: all of them, causally (query ``r0 + i`` sees
    keys up to ``k0 + i``), or as ``limit`` says (query ``r0 + i`` sees the keys below ``k0 + limit[i]``)."""

    r0: int
    r1: int
    k0: int
    k1: int
    causal: bool = False
    limit: np.ndarray | None = None


def _flash_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Local. Whether torch's CPU flash kernels can attend these blocks (they need one head dim, no empty dim)."""
    return (
        FLASH_BLOCKS
        and q.device.type == "cpu"
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and q.numel() > 0
        and k.shape[0] * k.shape[1] * k.shape[-1] > 0
    )


def _masked_pieces(seen: np.ndarray, a: int, b: int) -> list[_Piece]:
    """Queries ``[a, b)`` (each seeing ``seen[i] >= 1`` keys, nondecreasing) in pieces of at most
    :data:`MASK_ELEMENTS` masked pairs: an unmasked piece of the keys all of them see, and a masked one."""
    out = []
    while a < b:
        lo = int(seen[a]) - 1  # keys [0, lo) are seen by every query of the piece
        widths = seen[a : min(b, a + max(1, MASK_ELEMENTS))] - lo
        area = np.arange(1, len(widths) + 1) * widths  # (queries, keys) of a piece ending at each query
        r1 = a + max(1, int(np.searchsorted(area, MASK_ELEMENTS, side="right")))
        if lo:
            out.append(_Piece(a, r1, 0, lo))
        out.append(_Piece(a, r1, lo, int(seen[r1 - 1]), limit=seen[a:r1] - lo))
        a = r1
    return out


def _staircase(seen: np.ndarray, n: int) -> list[_Piece]:
    """Pieces of a partly visible block of ``n`` keys whose query ``i`` sees its first ``seen[i]`` keys.

    Queries that see no key are left out, those that see all take one unmasked piece; a diagonal run
    (each query sees one key more than the one before) of at least :data:`CAUSAL_RUN_MIN` queries takes an
    unmasked piece and a causal square; the rest take float masks (:func:`_masked_pieces`)."""
    lq = len(seen)
    start = int(np.searchsorted(seen, 0, side="right"))
    stop = int(np.searchsorted(seen, n, side="left"))
    pieces = [_Piece(stop, lq, 0, n)] if stop < lq else []
    breaks = np.flatnonzero(np.diff(seen[start:stop]) != 1) + start + 1
    bounds = [start, *breaks.tolist(), stop]
    masked_from = start
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b - a < CAUSAL_RUN_MIN:
            continue
        pieces += _masked_pieces(seen, masked_from, a)
        lo = int(seen[a]) - 1
        if lo:
            pieces.append(_Piece(a, b, 0, lo))
        pieces.append(_Piece(a, b, lo, lo + b - a, causal=True))
        masked_from = b
    return pieces + _masked_pieces(seen, masked_from, stop)


@dataclass(frozen=True)
class _Unit:
    """Piece ``j`` of the block a rank holds at ring step ``s``: the block's keys ``[k0, k1)``."""

    s: int
    j: int
    k0: int
    k1: int


def _piece_bounds(tokens: int, most: int) -> list[tuple[int, int]]:
    """The pieces a block of ``tokens`` keys travels in: at most ``most``, each of at least
    :data:`KEY_TILE_MIN` keys (one when fewer), as even as can be; none for an empty block."""
    if tokens <= 0:
        return []
    n = max(1, min(most, tokens // max(1, KEY_TILE_MIN)))
    edges = [tokens * i // n for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _units(plan: RingPlan, most: int) -> list[_Unit]:
    """Local. The order in which a rank attends the pieces: piece ``j`` of every step's block, then piece
    ``j + 1`` (a piece reaches the successor one unit after this rank used it, so none waits for long)."""
    bounds = [_piece_bounds(step.tokens, most) for step in plan.steps]
    most = max((len(b) for b in bounds), default=0)
    return [_Unit(s, j, *bounds[s][j]) for j in range(most) for s in range(plan.size) if j < len(bounds[s])]


def _flash_pieces(plan: RingPlan, units: list[_Unit]) -> list[list[_Piece]]:
    """Local. The flash pieces of each unit's keys (none for a hidden or empty one)."""
    lq = plan.q_tokens
    q_index: np.ndarray | None = None
    seen: dict[int, np.ndarray] = {}  # per partly visible step: how many of its block's keys each query sees
    out: list[list[_Piece]] = []
    for u in units:
        step, n = plan.steps[u.s], u.k1 - u.k0
        if step.visibility == "none" or not n or not lq:
            out.append([])
        elif step.visibility == "all":
            out.append([_Piece(0, lq, 0, n)])
        else:
            if u.s not in seen:
                if q_index is None:
                    q_index = flat_token_indices(plan.q_ranges, plan.q_shape)
                k_index = flat_token_indices(step.ranges, plan.kv_shape)  # increasing, as q_index
                seen[u.s] = np.searchsorted(k_index, q_index, side="right")
            out.append(_staircase(np.clip(seen[u.s] - u.k0, 0, n), n))
    return out


def _piece_mask(piece: _Piece, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The additive float mask (0 or -inf, ``[queries, keys]``) of a masked piece, else None."""
    if piece.limit is None:
        return None
    limit = torch.from_numpy(piece.limit).to(device)
    hidden = torch.arange(piece.k1 - piece.k0, device=device)[None, :] >= limit[:, None]
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, -math.inf)


def _flash_forward_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], scale: float,
    pieces: list[_Piece], poke: Callable[[], None] | None = None,
) -> None:  # fmt: skip
    """Merge the attention of ``q`` to one K/V block (torch's CPU flash kernel per piece) into the running
    ``(lse, out)`` (out normalised): ``out = sum_b exp(lse_b - lse) out_b``; ``poke`` after each piece."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    lse, o = state
    for p in pieces:
        rows, keys = slice(p.r0, p.r1), slice(p.k0, p.k1)
        mask = _piece_mask(p, q.dtype, q.device)
        o_p, lse_p = kernel(q[:, :, rows], k[:, :, keys], v[:, :, keys], 0.0, p.causal, attn_mask=mask, scale=scale)
        del mask
        lse_run, o_run = lse[:, :, rows], o[:, :, rows]
        new = torch.logaddexp(lse_run, lse_p)  # every query of a piece sees a key: finite
        o_run.mul_(lse_run.sub_(new).exp_()[..., None]).addcmul_(o_p, lse_p.sub_(new).exp_()[..., None])
        lse_run.copy_(new)
        del o_p, lse_p, new
        if poke is not None:
            poke()


def _flash_backward_block(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dq: torch.Tensor | None, scale: float, pieces: list[_Piece], poke: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Add one K/V block's share to ``dq`` (torch's CPU flash backward per piece, with the global ``out`` and
    ``lse``; None: no share yet, the first becomes it) and return ``(dq, dK, dV)`` of the block; ``poke``
    after each piece."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    acc = _acc_dtype(q.dtype)
    whole = len(pieces) == 1 and pieces[0].k0 == 0 and pieces[0].k1 == k.shape[2]
    dk = dv = None
    if not whole:
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for p in pieces:
        rows, keys = slice(p.r0, p.r1), slice(p.k0, p.k1)
        mask = _piece_mask(p, q.dtype, q.device)
        dq_p, dk_p, dv_p = kernel(
            dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[:, :, rows],
            0.0, p.causal, attn_mask=mask, scale=scale,
        )  # fmt: skip
        del mask
        if dq is None and p.r0 == 0 and p.r1 == q.shape[2] and dq_p.dtype == acc:
            dq = dq_p
        else:
            if dq is None:
                dq = torch.zeros(q.shape, dtype=acc, device=q.device)
            dq[:, :, rows].add_(dq_p)
        del dq_p
        if dk is None or dv is None:
            dk, dv = dk_p, dv_p
        else:
            dk[:, :, keys].add_(dk_p)
            dv[:, :, keys].add_(dv_p)
        del dk_p, dv_p
        if poke is not None:
            poke()
    if dq is None or dk is None or dv is None:  # (no piece: not called)
        raise ValueError("attention: a flash block without pieces")
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------- the ring
class _Buffers:
    """Flat pooled message buffers of one dtype (released together)."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype, like: torch.Tensor) -> None:
        item = torch.empty((), dtype=dtype).element_size()
        self.raw = [P.acquire(numel * item, like) for _ in range(count)]
        self.flat = [from_bytes(r[: numel * item], dtype, (numel,)) for r in self.raw]

    def release(self) -> None:
        for r in self.raw:
            P.release(r)
        self.raw.clear()


def _kv_views(flat: torch.Tensor, b: int, h: int, n: int, d: int, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A piece's K ``[b, h, n, d]`` and V ``[b, h, n, dv]`` packed one after the other in ``flat``."""
    nk, nv = b * h * n * d, b * h * n * dv
    return flat[:nk].view(b, h, n, d), flat[nk : nk + nv].view(b, h, n, dv)


def _indices(plan: RingPlan, device: torch.device) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """Flattened token indices of the queries and of each step's keys, for partly visible blocks only."""
    if not any(step.visibility == "partial" for step in plan.steps):
        return None, [None] * plan.size
    q_index = torch.from_numpy(flat_token_indices(plan.q_ranges, plan.q_shape)).to(device)
    keys = [
        torch.from_numpy(flat_token_indices(step.ranges, plan.kv_shape)).to(device)
        if step.visibility == "partial"
        else None
        for step in plan.steps
    ]
    return q_index, keys


def _poke(pending: Callable[[], list[C.Pending]]) -> Callable[[], None]:
    """Test the pending messages (MPI libraries without a progress thread move data only inside MPI calls)."""

    def poke() -> None:
        for p in pending():
            p.test()

    return poke


class _KVRing:
    """Local state of a collective ring pass: the K/V pieces travelling it, in a few pooled piece buffers.

    Unit ``i`` (:func:`_units`: piece ``j`` of step ``s``'s block): :meth:`take` waits for the piece
    (the rank's own keys at step 0, packed to be sent), sends it on unless the successor owns it,
    posts the receive of the next unit that receives (one ahead) and returns it; :meth:`done` hands its
    buffer back. A buffer is reused once its send has completed (waited for: the oldest send's piece precedes
    the current one, and the successor posts its receive before it reaches the current piece's place in the
    order of :func:`_units`, so no rank waits on one that waits on it): :data:`_KV_SLOTS` pieces held.
    """

    def __init__(self, grid: ProcessGrid, plan: RingPlan, k: torch.Tensor, v: torch.Tensor, units: list[_Unit]) -> None:
        b, h, _, d = k.shape
        self.grid, self.plan, self.k, self.v, self.units = grid, plan, k, v, units
        self.shape = (b, h, d, v.shape[-1])
        self.per_token = b * h * (d + v.shape[-1])
        self.numel = max((u.k1 - u.k0 for u in units), default=0) * self.per_token
        self.travel = plan.size > 1 and self.numel > 0
        self.buffers = _Buffers(_KV_SLOTS if self.travel else 0, self.numel, k.dtype, k)
        self.free = list(self.buffers.flat)
        self.sends: list[tuple[C.Pending, torch.Tensor]] = []  # sent, the buffers not yet reusable
        self.current: tuple[C.Pending, torch.Tensor] | None = None  # the send of the piece in use
        self.used: torch.Tensor | None = None  # the piece in use, not sent on
        self.recvs: dict[int, tuple[C.Pending, torch.Tensor]] = {}
        self.receiving = [i for i, u in enumerate(units) if u.s > 0] if self.travel else []
        self.posted = 0  # receives posted (of self.receiving, in order)

    def count(self, u: _Unit) -> int:
        """Elements of a piece (its dK/dV has as many)."""
        return (u.k1 - u.k0) * self.per_token

    def views(self, flat: torch.Tensor, u: _Unit) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, d, dv = self.shape
        return _kv_views(flat, b, h, u.k1 - u.k0, d, dv)

    def pending(self) -> list[C.Pending]:
        out = [p for p, _ in self.sends] + [p for p, _ in self.recvs.values()]
        return out + ([self.current[0]] if self.current is not None else [])

    def _slot(self) -> torch.Tensor:
        if self.free:
            return self.free.pop()
        p, flat = self.sends.pop(0)  # the oldest send (never the piece in use)
        p.wait()
        return flat

    def _post_one(self) -> None:
        if self.posted < len(self.receiving):
            i = self.receiving[self.posted]
            self.posted += 1
            flat = self._slot()
            u = self.units[i]
            self.recvs[i] = (C.irecv(self.grid.comm, flat[: self.count(u)], self.plan.recv_from, RING_TAG), flat)

    def take(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        u = self.units[i]
        comm, to = self.grid.comm, self.plan.send_to
        if u.s == 0:
            kk, vv = self.k[:, :, u.k0 : u.k1], self.v[:, :, u.k0 : u.k1]
            if self.travel:
                flat = self._slot()
                if flat.device.type != "meta":  # (meta: shapes only, nothing to pack)
                    pk, pv = self.views(flat, u)
                    pk.copy_(kk)
                    pv.copy_(vv)
                self.current = (C.isend(comm, flat[: self.count(u)], to, RING_TAG), flat)
        elif not self.travel:  # nothing to carry (this ring holds no batch or head): empty pieces, no message
            b, h, d, dv = self.shape
            kk, vv = self.k.new_empty((b, h, u.k1 - u.k0, d)), self.v.new_empty((b, h, u.k1 - u.k0, dv))
        else:
            if i not in self.recvs:
                self._post_one()
            p, flat = self.recvs.pop(i)
            p.wait()
            kk, vv = self.views(flat, u)
            if u.s < self.plan.size - 1:
                self.current = (C.isend(comm, flat[: self.count(u)], to, RING_TAG), flat)
            else:
                self.used = flat
        if not self.recvs:  # one receive ahead
            self._post_one()
        return kk, vv

    def done(self) -> None:
        if self.current is not None:
            self.sends.append(self.current)
            self.current = None
        if self.used is not None:
            self.free.append(self.used)
            self.used = None

    def finish(self) -> None:
        self.done()
        C.waitall([p for p, _ in self.sends])
        self.free += [flat for _, flat in self.sends]
        self.sends.clear()

    def release(self) -> None:
        self.buffers.release()


class _GradRing:
    """Local state of the dK/dV pieces travelling the ring behind the K/V pieces (backward).

    Unit ``i`` (piece ``j`` of step ``s``'s block): the dK/dV accumulated so far arrives from the
    predecessor (who added its share at its unit of that piece), this rank adds its share and sends it on;
    at step 0 its share starts the total. After the last step of piece ``j`` the total of the rank's own
    piece ``j`` comes home (its receive posted once the rank is past piece ``j``). Receives are posted in the
    order the predecessor sends. A piece buffer (a plain tensor) is reused once its send has completed, never
    waited for (a send completes when the successor reaches the piece, which may follow this rank's next
    units: with uneven blocks the ranks' units do not pair up one to one); a new one is made when none is
    free (about :data:`RING_GRAD_SLOTS` in all, as the ranks keep step).
    """

    def __init__(self, kv: _KVRing, acc: torch.dtype) -> None:
        self.kv, self.acc = kv, acc
        self.comm, self.plan, self.units = kv.grid.comm, kv.plan, kv.units
        k, v = kv.k, kv.v
        self.dk = torch.empty(k.shape, dtype=acc, device=k.device)  # the own block's, filled as pieces come home
        self.dv = torch.empty(v.shape, dtype=acc, device=v.device)
        own = {u.j: u for u in self.units if u.s == 0}
        self.seq: list[tuple[int, _Unit]] = []  # (unit index, or -1 for a piece coming home; the piece)
        for i, u in enumerate(self.units):
            if u.s > 0:
                self.seq.append((i, u))
            if (i + 1 == len(self.units) or self.units[i + 1].j != u.j) and u.j in own:
                self.seq.append((-1, own[u.j]))
        self.posted = 0
        self.slots: list[torch.Tensor] = []
        self.free: list[torch.Tensor] = []
        self.sends: list[tuple[C.Pending, torch.Tensor]] = []
        self.recvs: dict[int, tuple[C.Pending, torch.Tensor]] = {}
        self.homes: list[tuple[C.Pending, torch.Tensor, _Unit, int]] = []

    def pending(self) -> list[C.Pending]:
        return [p for p, _ in self.sends] + [p for p, _ in self.recvs.values()] + [h[0] for h in self.homes]

    def _slot(self) -> torch.Tensor:
        """A free buffer: one whose send has completed, else a new one (never a wait: a send completes when the
        successor reaches the piece, which may be after this rank's next units)."""
        if self.free:
            return self.free.pop()
        for n, (p, flat) in enumerate(self.sends):
            if p.test():
                del self.sends[n]
                return flat
        self.slots.append(torch.empty(self.kv.numel, dtype=self.acc, device=self.kv.k.device))
        return self.slots[-1]

    def post(self, i: int) -> None:
        """Post the receives up to unit ``i``'s (pieces coming home: once ``i`` is past their piece index)."""
        j = self.units[i].j if i < len(self.units) else math.inf
        while self.posted < len(self.seq):
            at, u = self.seq[self.posted]
            if at > i or (at < 0 and u.j >= j):
                break
            self.posted += 1
            flat = self._slot()
            p = C.irecv(self.comm, flat[: self.kv.count(u)], self.plan.recv_from, RING_GRAD_TAG)
            if at < 0:
                self.homes.append((p, flat, u, i))
            else:
                self.recvs[at] = (p, flat)

    def send(self, i: int, share: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Add this rank's ``share`` (None: none) of unit ``i``'s piece to its total and send it on."""
        u = self.units[i]
        if u.s == 0:
            flat = self._slot()
            if flat.device.type == "meta":  # (meta: shapes only, nothing to pack)
                pass
            elif share is None:
                flat[: self.kv.count(u)].zero_()
            else:
                tk, tv = self.kv.views(flat, u)
                tk.copy_(share[0])
                tv.copy_(share[1])
        else:
            self.post(i)
            p, flat = self.recvs.pop(i)
            p.wait()
            if share is not None and flat.device.type != "meta":  # (meta: shapes only, nothing to add)
                tk, tv = self.kv.views(flat, u)
                tk.add_(share[0])
                tv.add_(share[1])
        self.sends.append((C.isend(self.comm, flat[: self.kv.count(u)], self.plan.send_to, RING_GRAD_TAG), flat))

    def reap(self, i: int | None) -> None:
        """Wait for the pieces coming home posted before unit ``i`` (None: all) and keep them."""
        keep = []
        for p, flat, u, at in self.homes:
            if i is not None and at >= i:
                keep.append((p, flat, u, at))
                continue
            p.wait()
            hk, hv = self.kv.views(flat, u)
            self.dk[:, :, u.k0 : u.k1].copy_(hk)
            self.dv[:, :, u.k0 : u.k1].copy_(hv)
            self.free.append(flat)
        self.homes = keep

    def finish(self) -> None:
        self.post(len(self.units))
        self.reap(None)
        C.waitall([p for p, _ in self.sends])
        self.sends.clear()
        self.slots.clear()
        self.free.clear()


def _unit_index(k_index: list[torch.Tensor | None], u: _Unit) -> torch.Tensor | None:
    index = k_index[u.s]
    return None if index is None else index[u.k0 : u.k1]


class _FlashKernel:
    """Local. The block computation of the ring with the flash kernel: each unit's pieces (:func:`_flash_pieces`),
    their masks built in; the kernel keeps ``(lse, o)`` and ``dq`` itself."""

    def __init__(self, plan: RingPlan, units: list[_Unit]) -> None:
        self.pieces = _flash_pieces(plan, units)
        self.dq: torch.Tensor | None = None  # backward: the first block's share becomes it

    # forward
    def start_forward(self, q: torch.Tensor, lse: torch.Tensor, o: torch.Tensor) -> None:
        self.q, self.stats = q, (lse, o)

    def forward_unit(
        self, i: int, u: _Unit, kk: torch.Tensor, vv: torch.Tensor, scale: float, poke: Callable[[], None]
    ) -> None:
        if self.pieces[i]:
            _flash_forward_block(self.q, kk, vv, self.stats, scale, self.pieces[i], poke)

    def end_forward(self, o: torch.Tensor, lse: torch.Tensor) -> None:
        """(the kernel's running statistics are final)"""

    # backward
    def start_backward(
        self, dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, acc: torch.dtype
    ) -> None:
        self.dout, self.q, self.out, self.lse = dout, q, out, lse

    def backward_unit(
        self, i: int, u: _Unit, kk: torch.Tensor, vv: torch.Tensor, scale: float, poke: Callable[[], None]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.pieces[i]:
            return None
        self.dq, dk, dv = _flash_backward_block(
            self.dout, self.q, kk, vv, self.out, self.lse, self.dq, scale, self.pieces[i], poke
        )
        return dk, dv


class _TileKernel:
    """Local. The block computation of the ring in key tiles (:func:`_forward_block`, :func:`_backward_block`): masks
    from the token indices, a running maximum and sum of exponentials in forward, ``dq`` in scratch tiles."""

    def __init__(self, plan: RingPlan) -> None:
        self.plan = plan

    # forward
    def start_forward(self, q: torch.Tensor, lse: torch.Tensor, o: torch.Tensor) -> None:
        acc = lse.dtype
        self.qa = q.to(acc)
        self.denom = torch.zeros(lse.shape, dtype=acc, device=q.device)  # the sum of exponentials
        self.stats = (lse, self.denom, o)  # (lse: the running maximum until end_forward)
        self.q_index, self.k_index = _indices(self.plan, q.device)

    def forward_unit(
        self, i: int, u: _Unit, kk: torch.Tensor, vv: torch.Tensor, scale: float, poke: Callable[[], None]
    ) -> None:
        if self.plan.steps[u.s].visibility != "none":
            _forward_block(self.qa, kk, vv, self.stats, scale, self.q_index, _unit_index(self.k_index, u), poke)

    def end_forward(self, o: torch.Tensor, lse: torch.Tensor) -> None:
        o.div_(self.denom[..., None])
        lse.add_(torch.log(self.denom))

    # backward
    def start_backward(
        self, dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, acc: torch.dtype
    ) -> None:
        self.dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        self.qa, self.doa, self.lse = q.to(acc), dout.to(acc), lse
        self.delta = (self.doa * out.to(acc)).sum(dim=-1)
        self.q_index, self.k_index = _indices(self.plan, q.device)

    def backward_unit(
        self, i: int, u: _Unit, kk: torch.Tensor, vv: torch.Tensor, scale: float, poke: Callable[[], None]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.plan.steps[u.s].visibility == "none":
            return None
        acc = self.qa.dtype
        make = torch.empty if kk.device.type == "meta" else torch.zeros  # (meta: nothing to accumulate into)
        dk = make(kk.shape, dtype=acc, device=kk.device)
        dv = make(vv.shape, dtype=acc, device=vv.device)
        _backward_block(
            self.qa, kk, vv, self.doa, self.lse, self.delta, self.dq, dk, dv, scale, self.q_index,
            _unit_index(self.k_index, u), poke,
        )  # fmt: skip
        return dk, dv


_Kernel = _FlashKernel | _TileKernel


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: ProcessGrid, plan: RingPlan, scale: float,
    units: list[_Unit], kernel: _Kernel,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Collective over the ring. ``(out, lse)`` of this rank's queries (accumulation dtype): each unit's K/V piece
    arrives (:class:`_KVRing`) and ``kernel`` adds its blocks."""
    b, h, lq, _ = q.shape
    acc = _acc_dtype(q.dtype)
    o = torch.zeros((b, h, lq, v.shape[-1]), dtype=acc, device=q.device)
    lse = torch.full((b, h, lq), -math.inf, dtype=acc, device=q.device)
    kernel.start_forward(q, lse, o)
    ring = _KVRing(grid, plan, k, v, units)
    poke = _poke(ring.pending)
    try:
        for i, u in enumerate(units):
            kk, vv = ring.take(i)
            kernel.forward_unit(i, u, kk, vv, scale, poke)
            del kk, vv
            ring.done()
        ring.finish()
    finally:
        ring.release()
    kernel.end_forward(o, lse)
    return o, lse


def _zeros_if_none(x: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(like.shape, dtype=dtype, device=like.device) if x is None else x


def _ring_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    grid: ProcessGrid, plan: RingPlan, scale: float, want_kv: bool, units: list[_Unit], kernel: _Kernel,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Collective over the ring. ``(dq, dk, dv)`` (accumulation dtype; ``dk``/``dv`` None unless ``want_kv``).

    The K/V pieces travel as in the forward pass. Each piece's dK/dV follows one unit behind it
    (:class:`_GradRing`): a rank computes its share of the piece it holds (``kernel``), then waits for the
    dK/dV accumulated so far (sent by its predecessor after that rank's share), adds, and sends it on; after
    the last step of a piece index every block's piece has reached its owner.
    """
    acc = _acc_dtype(q.dtype)
    kernel.start_backward(dout, q, out, lse, acc)
    ring = _KVRing(grid, plan, k, v, units)
    travel = want_kv and ring.travel
    grads = _GradRing(ring, acc) if travel else None
    own_k = own_v = None
    if want_kv and not travel:
        own_k = torch.zeros(k.shape, dtype=acc, device=k.device)
        own_v = torch.zeros(v.shape, dtype=acc, device=v.device)
    poke = _poke(ring.pending if grads is None else (lambda: ring.pending() + grads.pending()))
    try:
        for i, u in enumerate(units):
            kk, vv = ring.take(i)
            if grads is not None:
                grads.post(i)
            share = kernel.backward_unit(i, u, kk, vv, scale, poke)
            del kk, vv
            ring.done()
            if grads is not None:
                grads.send(i, share)
                grads.reap(i)
            elif own_k is not None and own_v is not None and share is not None and u.s == 0:
                own_k[:, :, u.k0 : u.k1].add_(share[0])
                own_v[:, :, u.k0 : u.k1].add_(share[1])
            del share
        ring.finish()
        if grads is not None:
            grads.finish()
            return _zeros_if_none(kernel.dq, q, acc), grads.dk, grads.dv
        return _zeros_if_none(kernel.dq, q, acc), own_k, own_v
    finally:
        ring.release()


class _RingAttention(torch.autograd.Function):
    """Collective over the ring. Autograd node of the ring schedule on flattened-token blocks ``[b, h, L, d]``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: ProcessGrid, plan: RingPlan, scale: float
    ) -> torch.Tensor:
        units = _units(plan, RING_PIECES)
        flash = _flash_applies(q, k, v)
        kernel: _Kernel = _FlashKernel(plan, units) if flash else _TileKernel(plan)
        with autocast_off(q):  # (autocast: the inputs are cast already; the statistics stay in float32)
            out, lse = _ring_forward(q.detach(), k.detach(), v.detach(), grid, plan, scale, units, kernel)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.grid, ctx.plan, ctx.scale, ctx.flash = grid, plan, scale, flash
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        want_kv = bool(ctx.needs_input_grad[1] or ctx.needs_input_grad[2])
        units = _units(ctx.plan, RING_PIECES_BACKWARD)
        kernel: _Kernel = _FlashKernel(ctx.plan, units) if ctx.flash else _TileKernel(ctx.plan)
        with autocast_off(q):
            dq, dk, dv = _ring_backward(
                dout.contiguous(), q.detach(), k.detach(), v.detach(), out, lse, ctx.grid, ctx.plan, ctx.scale,
                want_kv, units, kernel,
            )  # fmt: skip
        return (
            dq.to(q.dtype),
            None if dk is None else dk.to(k.dtype),
            None if dv is None else dv.to(v.dtype),
            None,
            None,
            None,
        )


def _flatten_tokens(x: torch.Tensor) -> torch.Tensor:
    """``[b, h, *tokens, d]`` -> contiguous ``[b, h, prod(tokens), d]``."""
    shape = x.shape
    return x.reshape(shape[0], shape[1], math.prod(shape[2:-1]), shape[-1]).contiguous()


def _unflatten(y: torch.Tensor, like: torch.Size, last: int) -> torch.Tensor:
    return y.reshape(*like[:-1], last)


def _ring(q: DistTensor, k: DistTensor, v: DistTensor, causal: bool, call: _Call) -> DistTensor:
    plan = ring_plan(q.layout, k.layout, q.grid.rank, causal)
    y = _RingAttention.apply(
        _flatten_tokens(q.local), _flatten_tokens(k.local), _flatten_tokens(v.local), q.grid, plan, call.scale
    )
    return DistTensor(_unflatten(y, q.local.shape, v.global_shape[-1]), q.grid, call.out_layout)


# ---------------------------------------------------------------------------------------------- all-to-all
def _move(block: torch.Tensor, grid: ProcessGrid, src: Layout, dst: Layout) -> torch.Tensor:
    if src == dst:
        return block
    grad = torch.is_grad_enabled() and block.requires_grad
    return move_block(block, grid, src, dst, grad)  # type: ignore[return-value]


def _all_to_all(q: DistTensor, k: DistTensor, v: DistTensor, causal: bool, call: _Call) -> DistTensor:
    grid, split = q.grid, call.head_split
    if split is None:  # (ruled out by _check)
        raise ValueError("attention: the all-to-all schedule cannot run these layouts; use schedule='ring'")
    heads = [Layout(x.global_shape, grid.dims, split) for x in (q, k, v)]
    qh, kh, vh = (_move(x.local, grid, x.layout, to) for x, to in zip((q, k, v), heads))
    y = F.scaled_dot_product_attention(
        _flatten_tokens(qh), _flatten_tokens(kh), _flatten_tokens(vh), is_causal=causal, scale=call.scale
    )
    y = _unflatten(y, qh.shape, v.global_shape[-1])
    by_heads = Layout(call.out_layout.global_shape, grid.dims, split)
    return DistTensor(_move(y, grid, by_heads, call.out_layout), grid, call.out_layout)


# ---------------------------------------------------------------------------------------------- public
def attention(
    q: DistTensor,
    k: DistTensor,
    v: DistTensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    schedule: str = "auto",
) -> DistTensor:
    """Collective over grid. Exact attention of tokens split over the grid (differentiable).

    Equals ``torch.nn.functional.scaled_dot_product_attention`` of the gathered tensors with
    their token dims flattened row-major, in the queries' layout.

    Parameters
    ----------
    q : DistTensor
        Queries ``[batch, heads, *tokens, head_dim]`` (torch blocks, 1 or more token dims), the
        token dims cut over any grid axes, evenly or not; batch and heads may be cut over other
        axes; the head dim must be whole.
    k, v : DistTensor
        Keys and values on q's grid with q's split and batch/heads cuts; their token shape and
        cuts may differ from q's (cross-attention), v's head dim from k's.
    causal : bool, optional
        Query ``i`` attends keys ``j <= i`` of the flattened order (SDPA's ``is_causal``).
    scale : float, optional
        Factor of the scores (default ``1 / sqrt(head_dim)``).
    schedule : {"auto", "ring", "all_to_all"}, optional
        ``"auto"`` picks by the cost model of :mod:`hpctp.perf` (:mod:`hpctp.linalg.cost`) (see
        :func:`attention_schedule`); the others force one.

    Returns
    -------
    DistTensor
        ``[batch, heads, *q_tokens, v_head_dim]`` in q's layout.

    Raises
    ------
    TypeError
        If q, k, v are not DistTensors of torch blocks of one floating dtype, or ``causal``
        is not a bool.
    ValueError
        If their shapes, grids, splits or cuts do not fit together, the head dim is split,
        the keys hold no token, ``scale``/``schedule`` is invalid, ``schedule="all_to_all"``
        cannot run these layouts, or ranks passed different arguments (on every rank).
    """
    q, k, v = (_autocast(x) for x in (q, k, v))
    _, call = _prepare(q, k, v, causal, scale, schedule)
    if call.schedule == "all_to_all":
        return _all_to_all(q, k, v, causal, call)
    return _ring(q, k, v, causal, call)


def _autocast(x: Any) -> Any:
    """A DistTensor's torch block in autocast's dtype when autocast is on (as SDPA's inputs), before it travels."""
    if not isinstance(x, DistTensor) or not isinstance(x.local, torch.Tensor):
        return x
    block = autocast_input(x.local)
    return x if block is x.local else x.with_local(block)


def attention_schedule(
    q: DistTensor, k: DistTensor, v: DistTensor, *, causal: bool = False, scale: float | None = None
) -> str:
    """Collective over grid on a first call, else Local. The schedule ``attention(..., schedule="auto")`` runs.

    ``"ring"`` or ``"all_to_all"``: the cheaper by :func:`hpctp.perf.predict_attention` (forward, plus
    backward when a tensor requires grad), the same on every rank.

    Parameters
    ----------
    q, k, v : DistTensor
        As for :func:`attention`.
    causal : bool, optional
    scale : float, optional

    Returns
    -------
    str

    Raises
    ------
    TypeError, ValueError
        As :func:`attention`.
    """
    return _prepare(q, k, v, causal, scale, "auto")[1].schedule
