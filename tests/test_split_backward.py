"""Zero-bubble's split backward on one process: B (input gradient) then W (weight gradients) equals one backward.

The closed-form weight gradients (``_weight_gradients``) are checked node by node against autograd's own, and
the whole split against ``torch.autograd.backward`` for every node kind they cover, a kind they do not (autograd
answers for it), shared weights, a stage without an input gradient and bf16 autocast.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.autograd.graph import GradientEdge

from hpctp.nn.pipeline_parallel._split_backward import backward_input
from hpctp.nn.pipeline_parallel._weight_gradients import weight_side_gradients

F64 = torch.float64


def _param(*shape: int, seed: int) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=F64))


class _Net(torch.nn.Module):
    """x -> fn(x, params): a stage of one or a few operations on its parameters."""

    def __init__(self, fn: Callable[..., torch.Tensor], *params: torch.nn.Parameter) -> None:
        super().__init__()
        self.fn = fn
        self.ps = torch.nn.ParameterList(params)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, *self.ps)


def _ln(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b)


def _conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.conv2d(x.reshape(2, 4, 3, 2), w, b, padding=1).reshape(2, -1)[:, :6]


def _conv_groups(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.conv2d(x.reshape(2, 4, 3, 2), w, stride=(2, 1), groups=2).reshape(2, -1)[:, :6]


# (name, kind of the node that carries the weights' gradients, net, input shape)
CASES: list[tuple[str, str | None, Callable[[], _Net], tuple[int, ...]]] = [
    (
        "linear",
        "AddmmBackward0",
        lambda: _Net(torch.nn.functional.linear, _param(5, 6, seed=1), _param(5, seed=2)),
        (4, 6),
    ),
    (
        "linear-3d",
        "AddmmBackward0",
        lambda: _Net(torch.nn.functional.linear, _param(5, 6, seed=1), _param(5, seed=2)),
        (2, 3, 6),
    ),
    ("linear-no-bias", "MmBackward0", lambda: _Net(torch.nn.functional.linear, _param(5, 6, seed=1)), (2, 3, 6)),
    ("x@w", "MmBackward0", lambda: _Net(lambda x, w: x @ w, _param(6, 5, seed=3)), (4, 6)),
    ("w@x", "MmBackward0", lambda: _Net(lambda x, w: (w @ x.t()).t(), _param(5, 6, seed=3)), (4, 6)),
    (
        "addmm-scaled",
        "AddmmBackward0",
        lambda: _Net(
            lambda x, w, b: torch.addmm(b, x, w, beta=0.5, alpha=3.0), _param(6, 5, seed=4), _param(5, seed=5)
        ),
        (4, 6),
    ),  # fmt: skip
    ("bias", "AddBackward0", lambda: _Net(lambda x, b: torch.add(x, b, alpha=2.0), _param(6, seed=6)), (4, 6)),
    ("scale", "MulBackward0", lambda: _Net(lambda x, s: x * s, _param(1, 6, seed=7)), (4, 6)),
    ("layer-norm", "NativeLayerNormBackward0", lambda: _Net(_ln, _param(6, seed=8), _param(6, seed=9)), (2, 3, 6)),
    ("conv", "ConvolutionBackward0", lambda: _Net(_conv, _param(3, 4, 3, 3, seed=10), _param(3, seed=11)), (2, 24)),
    ("conv-groups", "ConvolutionBackward0", lambda: _Net(_conv_groups, _param(4, 2, 1, 2, seed=12)), (2, 24)),
    ("prelu (autograd answers)", None, lambda: _Net(torch.nn.functional.prelu, _param(1, seed=13)), (4, 6)),
]


def _chain(net: _Net, d: int) -> torch.nn.Module:
    """The operation between two nonlinear layers with weights: input gradient, weight paths on both sides."""
    return torch.nn.Sequential(
        torch.nn.Linear(d, d, dtype=F64), torch.nn.Tanh(), net, torch.nn.Tanh(), torch.nn.LazyLinear(3, dtype=F64)
    )


def _whole_and_split(
    model: torch.nn.Module, x: torch.Tensor, g_seed: int = 0, autocast: torch.dtype | None = None
) -> tuple[list, list]:
    """Gradients (input's, then every parameter's) of one backward and of B followed by W (the forward under CPU
    autocast to ``autocast``, if given)."""
    out = []
    for split in (False, True):
        model.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            y = model(xi)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(g_seed), dtype=y.dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        if split:
            (dx,), weights = backward_input([y], [g], [xi], params)
            before = [p.grad for p in params]
            weights()
            assert all(b is None for b in before), "B must leave the weights' gradients to W"
        else:
            torch.autograd.backward([y], [g])
            dx = xi.grad
        out.append([dx, *[p.grad for p in params]])
    return out[0], out[1]


@pytest.mark.parametrize("name,kind,make,shape", CASES, ids=[c[0] for c in CASES])
def test_split_backward_equals_one_backward(name: str, kind: str | None, make: Callable[[], _Net], shape) -> None:
    torch.manual_seed(0)
    net = make()
    model = _chain(net, shape[-1]) if len(shape) == 2 else net
    x = torch.randn(*shape, dtype=F64)
    model(x)  # (materializes the lazy layer)
    whole, split = _whole_and_split(model, x)
    assert len(whole) == len(split) and all(w is not None for w in whole)
    for a, b in zip(whole, split):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)


def _reaches(node: object, x: torch.Tensor) -> bool:
    """Whether ``x``'s gradient accumulates below ``node``."""
    if getattr(node, "variable", None) is x:
        return True
    return any(c is not None and _reaches(c, x) for c, _ in node.next_functions)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name,kind,make,shape", [c for c in CASES if c[1]], ids=[c[0] for c in CASES if c[1]])
def test_closed_form_equals_autograd_at_each_edge(name: str, kind: str, make: Callable[[], _Net], shape) -> None:
    """The node's gradient towards each parameter edge, from its saved tensors, is autograd's (to 1e-12)."""
    net = make()
    x = torch.randn(*shape, dtype=F64, requires_grad=True)
    y = net(x)
    node = y.grad_fn
    while type(node).__name__ != kind:  # (a reshape or slice after the operation)
        node = node.next_functions[0][0]
    g = torch.randn(node._input_metadata[0].shape, dtype=F64)
    ks = [k for k, (c, _) in enumerate(node.next_functions) if c is not None and not _reaches(c, x)]
    found = weight_side_gradients(node, (g,), ks)
    assert found is not None, f"no closed form for {kind}"
    for k, d in zip(ks, found):
        (expected,) = torch.autograd.grad([GradientEdge(node, 0)], [GradientEdge(*node.next_functions[k])], [g],
                                          retain_graph=True)  # fmt: skip
        assert d.shape == expected.shape and d.dtype == expected.dtype
        torch.testing.assert_close(d, expected, rtol=1e-12, atol=1e-14)


def test_a_weight_used_twice_and_a_stage_without_input_gradient() -> None:
    lin = torch.nn.Linear(6, 6, dtype=F64)
    model = torch.nn.Sequential(lin, torch.nn.Tanh(), lin, torch.nn.LayerNorm(6, dtype=F64))
    x = torch.randn(4, 6, dtype=F64)
    whole, split = _whole_and_split(model, x)
    for a, b in zip(whole, split):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)
    # the first stage: its input needs no gradient, so B computes nothing and W everything
    model.zero_grad(set_to_none=True)
    y = model(x)
    torch.autograd.backward([y], [torch.ones_like(y)])
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    y = model(x)
    dx, weights = backward_input([y], [torch.ones_like(y)], [x], list(model.parameters()))
    assert dx == [None] and all(p.grad is None for p in model.parameters())
    weights()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-14)


def test_bf16_autocast_matches_one_backward() -> None:
    """The weights' bf16 copies (autocast's casts) sit between the matmul and the parameter: the gradient crosses
    them with their dtype."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8), torch.nn.LayerNorm(8))
    whole, split = _whole_and_split(model, torch.randn(4, 8), autocast=torch.bfloat16)
    for a, b in zip(whole, split):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2)
