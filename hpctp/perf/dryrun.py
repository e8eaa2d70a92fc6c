"""The messages of a model's layers on a grid, read off the real code run on a virtual grid.

:func:`layer_messages` builds the model on ``meta`` on a virtual grid (:meth:`hpctp.ProcessGrid.virtual`) of a
plan's model-grid shape, playing one rank, and runs a forward and a backward of that rank's block of a micro-batch.
Nothing is computed or allocated, and every call of :mod:`hpctp.comm` is kept (:class:`hpctp.comm.CallLog`)
and attributed to the innermost module running it (forward: module hooks; backward: the autograd node's module,
as :func:`hpctp.perf.trace` attributes operators). What a layer sends is then what its code sends, whatever the
layer: halo exchanges of convolutions, transposed convolutions and pooling, the moments of a batch norm, a Fourier
layer's spectrum, a ring of keys and values, a tensor-parallel all-reduce, a layer written by the user from hpctp's
operations. The planner prices each :class:`~hpctp.perf.layers.Message` with one :class:`MachineProfile`.

A layer's point-to-point calls of one pass are one exchange (one :class:`Message`: its bytes, its messages, its
largest message), posted before the layer computes on what it holds (halo exchanges, rings), so they may overlap
its computation; collectives are one message each.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from ..comm import Call, CallLog, ProcessGrid
from ..layout import Layout, grid_coords, grid_rank
from ..nn import ParallelPlan
from ..tensor.core import DistTensor
from .layers import Message
from .workload import Builder, Sample, _Owners, _tensors

__all__ = ["KIND_OF", "affine_in_batch", "dry_run", "layer_messages", "message_of"]

KIND_OF = {
    "Allreduce": "allreduce", "Iallreduce": "allreduce", "Reduce": "allreduce", "Ireduce": "allreduce",
    "Bcast": "allreduce", "Ibcast": "allreduce", "Allgatherv": "allgather", "Iallgatherv": "allgather",
    "Allgather": "allgather", "Gatherv": "allgather", "Scatterv": "allgather", "Ireduce_scatter": "reduce_scatter",
    "Alltoallv": "alltoall", "Isend": "p2p", "Irecv": "p2p", "Send": "p2p", "Recv": "p2p",
}  # fmt: skip
"""How the machine prices each operation (:func:`hpctp.perf.collective_time`; a broadcast or a reduction to one
rank as an all-reduce: a scatter then a gather of its vector)."""


def _axes(name: str, ndim: int) -> tuple[int, ...]:
    """The model-grid axes of a communicator of the model grid, from its name (:class:`hpctp.ProcessGrid`)."""
    if name.startswith("hpctp.grid.axis"):
        return (int(name.removeprefix("hpctp.grid.axis")),)
    if name.startswith("hpctp.grid.axes"):
        return tuple(int(c) for c in name.removeprefix("hpctp.grid.axes"))
    return tuple(range(ndim))


def message_of(call: Call, phase: str, ndim: int, tensor_axis: int | None) -> Message | None:
    """Local. The :class:`Message` of one collective ``call`` on a model grid of ``ndim`` axes (None for a
    point-to-point call: :func:`layer_messages` joins those per pass): ``nbytes`` as
    :func:`hpctp.perf.collective_time` takes it; the role ``"tensor"`` on the tensor axis alone."""
    kind = KIND_OF.get(call.op, "allreduce")
    if kind == "p2p":
        return None
    q = max(call.size, 2)
    if kind == "allreduce":  # (the vector: what each contributes, what a root sends to each or gets from each)
        if call.op in ("Bcast", "Ibcast"):
            n = call.sent // (q - 1) if call.sent else call.recv
        elif call.op in ("Reduce", "Ireduce"):
            n = call.recv // (q - 1) if call.recv else call.sent
        else:
            n = call.sent
    elif kind == "allgather":  # (the gathered whole: every piece, this rank's included)
        n = call.recv + call.sent // (q - 1)
    elif kind == "reduce_scatter":  # (the input each rank holds)
        n = call.sent + call.recv // (q - 1)
    else:  # alltoall: what each rank holds before the move (its own share stays)
        n = call.sent * q // (q - 1)
    axes = _axes(call.comm, ndim)
    role = "tensor" if tensor_axis is not None and axes == (tensor_axis,) else "spatial"
    return Message(phase, call.op, kind, axes, n, call.sent, call.recv, call.messages, False, role)


def _exchange(calls: list[Call], phase: str, dims: tuple[int, ...], coords: tuple[int, ...]) -> Message:
    """The point-to-point calls of one pass of a layer as one exchange."""
    sent = recv = count = big = 0
    axes: set[int] = set()
    seen: set[tuple[str, int]] = set()
    whole = math.prod(dims)
    isend = False
    for c in calls:
        sent += c.sent
        recv += c.recv
        count += c.messages
        big = max(big, c.sent, c.recv)
        isend = isend or c.op == "Isend"
        if c.peer >= 0 and (c.comm, c.peer) not in seen:  # (the axes a peer differs along: once per peer)
            seen.add((c.comm, c.peer))
            if c.size == whole:
                axes.update(a for a, (x, y) in enumerate(zip(grid_coords(c.peer, dims), coords)) if x != y)
            else:
                axes.update(_axes(c.comm, len(dims)))
    return Message(phase, "Isend" if isend else calls[0].op, "p2p", tuple(sorted(axes)), big, sent, recv, count,
                   True, "spatial")  # fmt: skip


def layer_messages(
    builder: Builder, sample: Sample, spatial: Sequence[int], tensor: int, tensor_capable: bool, batch: int,
    coords: Sequence[int],
) -> dict[str, list[Message]]:  # fmt: skip
    """Local. Each module's messages (by its name in the model; :data:`~hpctp.perf.workload.OUTSIDE`: the loss's)
    in one forward and backward of ``batch`` samples on the rank at ``coords`` of the model grid
    ``(*spatial, tensor)`` (``(*spatial,)`` for a model without a tensor axis), from a dry run on a virtual grid.

    Parameters
    ----------
    builder : callable
        The model builder (:data:`hpctp.perf.workload.Builder`).
    sample : Sample
        The field and dtype (its batch is replaced by ``batch``).
    spatial : sequence of int
        Ranks per field dim.
    tensor : int
        Ranks of the tensor axis (used where ``tensor_capable``).
    tensor_capable : bool
        Whether the builder takes a tensor axis (:attr:`hpctp.perf.Workload.tensor_capable`).
    batch : int
        Samples of the micro-batch (at least 1).
    coords : sequence of int
        The rank's coordinates on the model grid.

    Returns
    -------
    dict
        ``name -> [Message]`` in the order of the calls (``axes``: model-grid axes).
    """
    return dry_run(builder, sample, spatial, tensor, tensor_capable, coords, (max(int(batch), 1),))[0]


def dry_run(
    builder: Builder, sample: Sample, spatial: Sequence[int], tensor: int, tensor_capable: bool,
    coords: Sequence[int], batches: Sequence[int],
) -> list[dict[str, list[Message]]]:  # fmt: skip
    """Local. :func:`layer_messages` at each of ``batches`` (each at least 1), the model built once."""
    nsp = len(spatial)
    model_dims = (*spatial, tensor) if tensor_capable else tuple(spatial)
    dims = (1, *model_dims)
    grid = ProcessGrid.virtual(dims, rank=grid_rank((0, *coords[: len(model_dims)]), dims))
    plan = ParallelPlan(grid, data=(0,), spatial=tuple(range(1, 1 + nsp)),
                        tensor=(1 + nsp,) if tensor_capable else ())  # fmt: skip
    collecting = gc.isenabled()
    gc.disable()  # (a dry run makes many small objects and frees them all at its end: 1.5-3x faster without cycles)
    try:
        with torch.device("meta"):
            model = builder(plan)
        runs = [_run(model, plan, sample, b) for b in batches]
    except Exception as e:  # (the user's model: say what the planner ran and what usually fixes it)
        raise ValueError(
            f"the model's step on a virtual grid of {tuple(model_dims)} ranks (spatial {tuple(spatial)}, playing "
            f"coordinates {tuple(coords[: len(model_dims)])}) failed: {type(e).__name__}: {e}. The planner runs "
            "forward and backward on meta tensors: a tensor made inside forward must take the input's device "
            "(device=x.device), and code that reads values (.item(), float(t)) finds none there"
        ) from e
    finally:
        if collecting:
            gc.enable()
        plan.free()
        grid.free()
    mg = tuple(model_dims)
    here = tuple(coords[: len(mg)])
    found = []
    for calls in runs:
        out: dict[str, list[Message]] = defaultdict(list)
        for owner, phase, group in calls:
            p2p = [c for c in group if KIND_OF.get(c.op) == "p2p"]
            for c in group:
                m = message_of(c, phase, len(mg), nsp if tensor_capable else None)
                if m is not None:
                    out[owner].append(m)
            if p2p:
                out[owner].append(_exchange(p2p, phase, mg, here))
        found.append(dict(out))
    return found


def affine_in_batch(
    one: dict[str, list[Message]], two: dict[str, list[Message]], batch: int
) -> dict[str, list[Message]] | None:  # fmt: skip
    """Local. The messages at ``batch`` samples from those at 1 and 2 samples, each message's bytes affine in the
    batch (a halo, an activation's all-reduce: proportional; a weight's: constant); None where the two runs do not
    send the same messages (other counts, operations or axes: run at ``batch`` itself)."""
    if one.keys() != two.keys():
        return None
    out: dict[str, list[Message]] = {}
    for owner, first in one.items():
        second = two[owner]
        if len(first) != len(second):
            return None
        row = []
        for a, b in zip(first, second):
            if (a.phase, a.op, a.kind, a.axes, a.count, a.overlap, a.role) != (
                b.phase, b.op, b.kind, b.axes, b.count, b.overlap, b.role
            ):  # fmt: skip
                return None
            k = batch - 1
            row.append(dataclasses.replace(a, nbytes=a.nbytes + (b.nbytes - a.nbytes) * k,
                                           sent=a.sent + (b.sent - a.sent) * k, recv=a.recv + (b.recv - a.recv) * k))  # fmt: skip
        out[owner] = row
    return out


def _run(model: torch.nn.Module, plan: ParallelPlan, sample: Sample, batch: int) -> list[tuple[str, str, list[Call]]]:
    """One forward, a local loss and backward on meta; the calls grouped by (owner, pass), in order."""
    names = {id(m): n or type(model).__name__ for n, m in model.named_modules()}
    owners = _Owners()

    def pre(module: torch.nn.Module, args: Any) -> None:
        name = names.get(id(module))
        if name is not None:
            owners.stack.append(name)

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        name = names.get(id(module))
        if name is None:
            return
        if owners.stack and owners.stack[-1] == name:
            owners.stack.pop()
        if torch._C._current_graph_task_id() != -1:
            return
        # every autograd node the module made, from its outputs back to its inputs' (its halo exchanges' and
        # collectives' Functions among them), is the module's unless a module inside it made it
        stop = {id(t.grad_fn) for t in _tensors(args) if t.grad_fn is not None}
        todo = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        seen: set[int] = set()
        while todo:
            node = todo.pop()
            if id(node) in seen or id(node) in stop:
                continue
            seen.add(id(node))
            if id(node) not in owners.nodes:
                owners.nodes[id(node)] = name
                owners.keep.append(node)
            todo.extend(n for n, _ in node.next_functions if n is not None)

    grid = plan.model_grid
    shape = (batch, sample.shape[1], *sample.field)
    layout = Layout(shape, grid.dims, (None, None, *plan.spatial))
    groups: list[tuple[str, str, list[Call]]] = []
    log = _AttributedLog(owners, groups)
    handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
               torch.nn.modules.module.register_module_forward_hook(post)]  # fmt: skip
    try:
        block = torch.empty(layout.local_shape(grid.coords), dtype=sample.torch_dtype, device="meta")
        with log:  # (not under torch.device("meta"): its mode would intercept every operator, 2-3x slower)
            out = model(DistTensor(block, grid, layout))
            pred = out.local if isinstance(out, DistTensor) else out
            pred.float().sum().backward()
    finally:
        for h in handles:
            h.remove()
    return groups


class _AttributedLog(CallLog):
    """A :class:`CallLog` that files each call under the module running it and the pass (consecutive calls of one
    owner and pass form one group)."""

    def __init__(self, owners: _Owners, groups: list[tuple[str, str, list[Call]]]) -> None:
        super().__init__()
        self.owners = owners
        self.groups = groups

    def _add(self, comm: Any, comm_name: str, op: str, sent: int, recv: int, messages: int, peer: int) -> None:
        call = Call(op, comm_name, comm.Get_size(), sent, recv, messages, peer, ())  # (members: not priced here)
        phase = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"
        owner = self.owners.current()
        groups = self.groups
        if not groups or groups[-1][0] != owner or groups[-1][1] != phase:
            groups.append((owner, phase, []))
        groups[-1][2].append(call)
