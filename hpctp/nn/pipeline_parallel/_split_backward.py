"""Backward in two passes for zero-bubble schedules: the input gradient now (``B``), the weight gradients later (``W``).

This is the split of any autograd graph. A stage whose linear layers call :func:`hpctp.nn.functional.linear`
(hpctp's own do) splits without it: those layers' weight-gradient products simply wait (see [Note: deferred
weight gradients] in :mod:`hpctp.nn._deferred_weights`, what the runtime uses whenever a stage's forward
recorded one), and the walk below costs about a fifth more than a whole backward.

[Note: split backward] ``torch.autograd.grad(outputs, inputs=[stage input])`` computes only what the input's
gradient needs: an operation on the path from the outputs to the stage's input computes its input gradients
and skips its weights' (autograd computes the outputs of a node that some requested input needs). Those
operations are the *boundary* nodes: on the input path, with a child off it that leads to parameters (for a
linear layer, its ``addmm``). ``B`` captures the gradient flowing into each boundary node (a pre-hook) while
it computes the input gradient, with the graph kept. ``W`` then computes, for each boundary node, the
gradients it sends towards the parameters: in closed form from its saved tensors for the common kinds
(matmuls, adds, products, layer norm, convolution: [Note: closed-form weight gradients]), handed to autograd
at the edges towards the parameters; for any other kind, by a backward from the node with its captured
gradient (a :class:`torch.autograd.graph.GradientEdge`) restricted to the parameters reached from it
without re-entering the input path. No gradient is computed twice, and every parameter's gradient is
accumulated in its ``.grad`` by autograd (hooks run: ShardedDataParallel's messages start). A stage whose
input needs no gradient (the first) computes everything in ``W``. A stage that recomputes activations
(activation checkpointing replays its forward at the first unpack of each backward pass, once) is not split:
its ``B`` computes the weights' gradients too and its ``W`` is empty.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from ._weight_gradients import weight_side_gradients

__all__ = ["backward_input"]

GROUP_BYTES = 1 << 22
"""``W`` hands its closed-form gradients to autograd in groups of about this many bytes: one accumulation call per
group, not per node (fewer calls, and at most this much more memory held than one node's gradients)."""

Node = Any


def _node(t: torch.Tensor) -> Node:
    """The autograd node a tensor's gradient flows into (a leaf's AccumulateGrad)."""
    if t.grad_fn is not None:
        return t.grad_fn
    view: Any = t.view_as(t).grad_fn
    return view.next_functions[0][0]


def _graph(outputs: Sequence[torch.Tensor]) -> tuple[list[Node], dict[Node, list[Node]]]:
    """Every node reachable from ``outputs``, and each node's children."""
    order: list[Node] = []
    children: dict[Node, list[Node]] = {}
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        n = stack.pop()
        if n in children:
            continue
        kids = [f for f, _ in n.next_functions if f is not None]
        children[n] = kids
        order.append(n)
        stack.extend(kids)
    return order, children


def _reaching(order: list[Node], children: dict[Node, list[Node]], targets: set[Node]) -> set[Node]:
    """The nodes from which some node of ``targets`` is reachable (themselves included): a walk up the edges."""
    parents: dict[Node, list[Node]] = {}
    for n in order:
        for c in children[n]:
            parents.setdefault(c, []).append(n)
    found = set(targets)
    stack = list(targets)
    while stack:
        for p in parents.get(stack.pop(), ()):
            if p not in found:
                found.add(p)
                stack.append(p)
    return found


def backward_input(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], Callable[[], None]]:  # fmt: skip
    """Local. The gradients of ``inputs`` now, and a function computing the weight gradients later.

    Parameters
    ----------
    outputs, grads : sequences of torch.Tensor
        The stage's outputs and the gradients arriving for them (None: a scalar loss's 1).
    inputs : sequence of torch.Tensor
        The stage's inputs (those without ``requires_grad`` get None).
    params : sequence of torch.Tensor
        The stage's trainable parameters.

    Returns
    -------
    list of (torch.Tensor or None)
        The inputs' gradients.
    callable
        ``W``: accumulates every parameter's gradient into its ``.grad`` (once; frees the graph's use).
    """
    wanted = [t for t in inputs if t.requires_grad]
    if not wanted:  # (the first stage: B has nothing to compute, W is one whole backward; no walk of the graph)
        return [None] * len(inputs), functools.partial(_whole_backward, outputs, grads, params)
    order, children = _graph(outputs)
    on_input = _reaching(order, children, {_node(t) for t in wanted})
    by_node = {_node(p): p for p in params if p.requires_grad}
    to_params = _reaching(order, children, set(by_node))
    boundary = [n for n in order if n in on_input and any(c not in on_input and c in to_params for c in children[n])]
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    hooks = [n.register_prehook(lambda g, n=n: captured.__setitem__(n, g)) for n in boundary]
    try:
        found = (
            list(torch.autograd.grad(outputs, wanted, grads, retain_graph=True, allow_unused=True)) if wanted else []
        )
    finally:
        for h in hooks:
            h.remove()
    per_input = iter(found)
    dinputs = [next(per_input) if t.requires_grad else None for t in inputs]

    def owned(n: Node) -> list[torch.Tensor]:
        """The parameters reached from ``n`` without entering the input path again."""
        out, seen, stack = [], set(), [c for c in children[n] if c not in on_input]
        while stack:
            c = stack.pop()
            if c in seen:
                continue
            seen.add(c)
            if c in by_node:
                out.append(by_node[c])
            stack.extend(k for k in children.get(c, []) if k not in on_input)
        return out

    def weights() -> None:
        edges: list[GradientEdge] = []
        values: list[torch.Tensor] = []
        pending = 0
        for n in boundary:
            g = captured.pop(n, None)
            if g is None:
                continue
            side = [
                k for k, (c, _) in enumerate(n.next_functions) if c is not None and c not in on_input and c in to_params
            ]
            found = weight_side_gradients(n, g, side)
            if found is not None:  # (see [Note: closed-form weight gradients])
                edges += [GradientEdge(*n.next_functions[k]) for k in side]
                values += found
                pending += sum(v.nbytes for v in found)
                if pending >= GROUP_BYTES:
                    torch.autograd.backward(edges, values, retain_graph=True)  # type: ignore[arg-type]
                    edges, values, pending = [], [], 0
                continue
            mine = owned(n)
            known = [(GradientEdge(n, k), x) for k, x in enumerate(g) if x is not None]
            if known and mine:
                torch.autograd.backward([e for e, _ in known], [x for _, x in known], inputs=mine, retain_graph=True)
        if edges:
            torch.autograd.backward(edges, values, retain_graph=True)  # type: ignore[arg-type]

    return dinputs, weights


def _whole_backward(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor]
) -> None:
    """The weight gradients of a stage whose input needs none: one backward from its outputs to its parameters."""
    roots = [(o, g) for o, g in zip(outputs, grads) if o.grad_fn is not None]
    mine = [p for p in params if p.requires_grad]
    if roots and mine:
        torch.autograd.backward([o for o, _ in roots], [g for _, g in roots], inputs=mine)  # type: ignore[misc]
