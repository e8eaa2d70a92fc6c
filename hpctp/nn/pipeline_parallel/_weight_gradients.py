"""Weight gradients of common autograd nodes in closed form, for the ``W`` pass of a split backward.

[Note: closed-form weight gradients] A zero-bubble ``W`` must compute, for each boundary node (see
[Note: split backward]), the gradients of the node's inputs that lead to parameters and not those on the
input path, which ``B`` already computed. Autograd can only be asked for that one node at a time (one
``torch.autograd.backward`` call per node, each walking the retained graph from there down to the stage's
input: a stage of 4 transformer blocks made ``W`` 17-20% dearer than the part of a whole backward it
replaces). For the nodes that carry nearly every weight of a network (``addmm``/``mm``: linear layers; ``add``
and ``mul``: biases and scales; layer norm; convolution) the gradient of one input is a formula of the node's
saved tensors and its incoming gradient. :func:`weight_side_gradients` evaluates it; the caller feeds all of
them into the parameter-side edges in one backward call, whose graph is only the short chains from those edges
to the parameters (a transpose, a dtype cast, the accumulation with its hooks). Any other node, or a saved
tensor that is not there, returns ``None`` and the caller asks autograd for that node.

The formulas are autograd's own (``tools/autograd/derivatives.yaml``) for real dtypes; a gradient is summed to
the shape its edge expects (a broadcast bias) and cast to its dtype, as the engine does between nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["weight_side_gradients"]

Node = Any
Rule = Callable[[Node, torch.Tensor, list[int]], "list[torch.Tensor | None]"]


def _saved(node: Node, name: str) -> Any:
    """A saved value of the node, or None where autograd did not keep it (or it was freed)."""
    try:
        return getattr(node, "_saved_" + name)
    except (AttributeError, RuntimeError):
        return None


def _column_major(node: Node, name: str) -> bool:
    """Whether the saved matrix input ``name`` was a transposed (column-major) view, as ``w.t()`` in a linear."""
    sizes, strides = _saved(node, name + "_sym_sizes"), _saved(node, name + "_sym_strides")
    return sizes is not None and strides is not None and strides[0] == 1 and strides[1] == sizes[0]


def _matmul_input(node: Node, g: torch.Tensor, k: int, names: tuple[str, str]) -> torch.Tensor | None:
    """The gradient of input ``k`` (0 or 1) of ``a @ b`` (saved as ``names``), laid out as that input was."""
    a, b = names
    if k == 0:
        other = _saved(node, b)
        if other is None:
            return None
        return (other @ g.mT).mT if _column_major(node, a) else g @ other.mT
    other = _saved(node, a)
    if other is None:
        return None
    return (g.mT @ other).mT if _column_major(node, b) else other.mT @ g


def _addmm(node: Node, g: torch.Tensor, ks: list[int]) -> list[torch.Tensor | None]:
    """``beta * self + alpha * mat1 @ mat2``: inputs (self, mat1, mat2)."""
    alpha, beta = _saved(node, "alpha"), _saved(node, "beta")
    out: list[torch.Tensor | None] = []
    for k in ks:
        if k == 0:
            out.append(g if beta == 1 else g * beta)
            continue
        d = _matmul_input(node, g, k - 1, ("mat1", "mat2"))
        out.append(d if d is None or alpha == 1 else d * alpha)
    return out


def _mm(node: Node, g: torch.Tensor, ks: list[int]) -> list[torch.Tensor | None]:
    """``self @ mat2``: inputs (self, mat2)."""
    return [_matmul_input(node, g, k, ("self", "mat2")) for k in ks]


def _add(node: Node, g: torch.Tensor, ks: list[int]) -> list[torch.Tensor | None]:
    """``self + alpha * other``: inputs (self, other)."""
    alpha = _saved(node, "alpha")
    return [g if k == 0 or alpha == 1 else g * alpha for k in ks]


def _mul(node: Node, g: torch.Tensor, ks: list[int]) -> list[torch.Tensor | None]:
    """``self * other`` (tensors): inputs (self, other)."""
    out: list[torch.Tensor | None] = []
    for k in ks:
        other = _saved(node, "other" if k == 0 else "self")
        out.append(None if other is None else g * other)
    return out


def _layer_norm(node: Node, g: torch.Tensor, ks: list[int]) -> list[torch.Tensor | None]:
    """``native_layer_norm(input, shape, weight, bias)``: inputs (input, weight, bias)."""
    x, mean, rstd = _saved(node, "input"), _saved(node, "result1"), _saved(node, "result2")
    if 0 in ks or x is None or mean is None or rstd is None:
        return [None] * len(ks)
    found = torch.ops.aten.native_layer_norm_backward(
        g, x, list(_saved(node, "normalized_shape")), mean, rstd, _saved(node, "weight"), _saved(node, "bias"),
        [False, 1 in ks, 2 in ks],
    )  # fmt: skip
    return [found[k] for k in ks]


def _convolution(node: Node, g: torch.Tensor, ks: list[int]) -> list[torch.Tensor | None]:
    """``convolution(input, weight, bias, ...)``: inputs (input, weight, bias)."""
    x, w = _saved(node, "input"), _saved(node, "weight")
    if 0 in ks or x is None or w is None:
        return [None] * len(ks)
    found = torch.ops.aten.convolution_backward(
        g, x, w, _saved(node, "bias_sym_sizes_opt"), _saved(node, "stride"), _saved(node, "padding"),
        _saved(node, "dilation"), _saved(node, "transposed"), _saved(node, "output_padding"), _saved(node, "groups"),
        [False, 1 in ks, 2 in ks],
    )  # fmt: skip
    return [found[k] for k in ks]


_RULES: dict[str, Rule] = {
    "AddmmBackward0": _addmm,
    "MmBackward0": _mm,
    "AddBackward0": _add,
    "MulBackward0": _mul,
    "NativeLayerNormBackward0": _layer_norm,
    "ConvolutionBackward0": _convolution,
}


def weight_side_gradients(
    node: Node, grads: tuple[torch.Tensor | None, ...], ks: list[int]
) -> list[torch.Tensor] | None:
    """Local. The gradients ``node`` sends along its edges ``ks``, from its saved tensors; None where unknown.

    Parameters
    ----------
    node : torch.autograd.graph.Node
        A node of a graph kept for backward (``retain_graph``).
    grads : tuple of (torch.Tensor or None)
        The gradients arriving at ``node`` (its outputs' gradients), as its pre-hook saw them.
    ks : list of int
        Which of ``node.next_functions``.

    Returns
    -------
    list of torch.Tensor or None
        The gradients, each in the shape and dtype its edge expects; None for a node kind without a rule here, a
        node with several outputs, a complex gradient or a saved tensor that is gone (ask autograd instead).
    """
    rule = _RULES.get(type(node).__name__)
    if rule is None or len(grads) != 1 or grads[0] is None or grads[0].is_complex():
        return None
    with torch.no_grad():
        found = rule(node, grads[0], ks)
        out: list[torch.Tensor] = []
        for k, d in zip(ks, found):
            if d is None:
                return None
            child, nr = node.next_functions[k]
            try:
                meta = child._input_metadata[nr]
            except (AttributeError, IndexError):  # (a torch without the node's metadata: autograd answers)
                return None
            if tuple(d.shape) != tuple(meta.shape):
                d = d.sum_to_size(meta.shape)
            out.append(d if d.dtype == meta.dtype else d.to(meta.dtype))
    return out
