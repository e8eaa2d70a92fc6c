"""Deferred weight gradients (zero-bubble's W for hpctp's linear layers) on one process: B then W equals one backward.

B is autograd's backward of a forward recorded by :class:`DeferredWeightGradients`: it computes the input's,
the biases' and the norms' gradients and leaves every linear weight's to W (:meth:`~DeferredWeightGradients.run`).
Checked on transformer blocks (fused and separate q/k/v projections, the tensor-parallel linears), under bf16
autocast, with a post-accumulate hook, an unused output and an input modified in place.
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import hpctp
from hpctp.nn import MultiheadAttention, TransformerBlock
from hpctp.nn._deferred_weights import DeferredWeightGradients
from hpctp.nn.functional import linear

F64 = torch.float64


class _Stage(torch.nn.Module):
    """Two transformer blocks, then attention with separate query, key and value (views of one weight)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        grid = hpctp.ProcessGrid((1,), comm=MPI.COMM_SELF)
        self.blocks = torch.nn.Sequential(*[TransformerBlock(8, 2, 2.0, grid, seed=k, dtype=dtype) for k in (1, 2)])
        self.cross = MultiheadAttention(8, 2, grid, seed=3, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(x)
        return self.cross(h, x, torch.tanh(h))[0]


class _Plain(torch.nn.Module):
    """Two calls of :func:`hpctp.nn.functional.linear` on parameters of the module's own (a user's layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.b1 = torch.nn.Parameter(torch.randn(6, 8)), torch.nn.Parameter(torch.randn(6))
        self.w2 = torch.nn.Parameter(torch.randn(8, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(torch.tanh(linear(x, self.w1, self.b1)), self.w2)


def _whole_and_split(model: torch.nn.Module, x: torch.Tensor, autocast: bool = False) -> tuple[list, list, int]:
    """The input's and every parameter's gradient from one backward, and from B then W; how many linear calls
    waited for W."""
    out: list[list] = []
    waited = 0
    for split in (False, True):
        model.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_(True)
        deferred = DeferredWeightGradients()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if split:
                with deferred.recording():
                    y = model(xi)
            else:
                y = model(xi)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(0), dtype=y.dtype)
        torch.autograd.backward([y], [g])
        if split:
            waited = len(deferred)
            deferred.run()
            assert len(deferred) == 0
        out.append([xi.grad, *[p.grad for p in model.parameters()]])
    return out[0], out[1], waited


def test_b_then_w_equals_one_backward() -> None:
    torch.manual_seed(0)
    model = _Stage(F64)
    whole, split, waited = _whole_and_split(model, torch.randn(2, 5, 8, dtype=F64))
    assert waited == 2 * 4 + 4  # (per block qkv, out, fc1, fc2; the cross attention's q, k, v and out)
    assert all(w is not None for w in whole)
    for a, b in zip(whole, split):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)


def test_b_leaves_the_linear_weights_to_w_and_their_hooks_run_there() -> None:
    model = _Stage(F64)
    weights = {id(p) for n, p in model.named_parameters() if n.endswith("weight") and p.dim() >= 2}
    fired: list[int] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
    x = torch.randn(2, 5, 8, dtype=F64, requires_grad=True)
    deferred = DeferredWeightGradients()
    with deferred.recording():
        y = model(x)
    y.sum().backward()
    after_b = set(fired)
    assert x.grad is not None and after_b and not after_b & weights, "B: the input, biases and norms, no weight"
    deferred.run()
    assert set(fired) - after_b == weights, "W: every linear weight, each through autograd's accumulation"


@pytest.mark.parametrize("stage", ["blocks", "plain"])
def test_bf16_autocast_matches_one_backward(stage: str) -> None:
    """hpctp's layers cast their input before the linear; a plain call leaves it float32 (W casts it as autocast)."""
    torch.manual_seed(1)
    model = _Stage(torch.float32) if stage == "blocks" else _Plain()
    whole, split, waited = _whole_and_split(model, torch.randn(2, 5, 8), autocast=True)
    assert waited == (12 if stage == "blocks" else 2)
    for a, b in zip(whole, split):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2)


def test_outside_recording_and_without_gradients_it_is_torch_linear() -> None:
    w = torch.randn(3, 4, dtype=F64, requires_grad=True)
    x = torch.randn(2, 4, dtype=F64)
    deferred = DeferredWeightGradients()
    y = linear(x, w)
    assert type(y.grad_fn).__name__ == "MmBackward0" and len(deferred) == 0
    with deferred.recording():  # (no gradient reaches y without a deferred weight: backward computes it)
        y = linear(x, w)
        with torch.no_grad():
            linear(x.requires_grad_(True), w)
    assert len(deferred) == 0
    y.sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(2, 3, dtype=F64).t() @ x, rtol=1e-12, atol=0)
    w.grad = None
    with deferred.recording():  # (a computed weight: B computes its gradient, its graph may be freed by then)
        y = linear(x, w * 2.0) + linear(x, w.t().t())
    assert len(deferred) == 1  # (the view waits)
    y.sum().backward()
    deferred.run()
    torch.testing.assert_close(w.grad, 3.0 * torch.ones(2, 3, dtype=F64).t() @ x, rtol=1e-12, atol=0)


def test_an_unused_output_gives_no_gradient_and_an_input_modified_in_place_is_refused() -> None:
    w = torch.randn(3, 4, dtype=F64, requires_grad=True)
    v = torch.randn(3, 4, dtype=F64, requires_grad=True)
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    deferred = DeferredWeightGradients()
    with deferred.recording():
        y = linear(x, w)
        linear(x, v)  # (its output never reaches the loss: no gradient, as in one backward)
    y.sum().backward()
    deferred.run()
    assert v.grad is None and w.grad is not None
    h = x.detach().clone().requires_grad_(True)
    with deferred.recording():
        y = linear(h * 1.0, w)
        z = h * 1.0
        y2 = linear(z, w)
    (y.sum() + y2.sum()).backward()
    z.add_(1.0)  # (what W reads changed after the forward)
    with pytest.raises(RuntimeError, match="modified in place .* clone it"):
        deferred.run()


def test_w_adds_into_grad_in_place_where_autograd_would_only_accumulate(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: weight gradients accumulated in place]: a parameter and row blocks of one (a fused projection) get
    their gradient added into ``.grad`` by the product itself (no autograd call), equal to autograd's accumulation,
    with their post-accumulate hooks run once per call; a weight with a tensor hook goes through autograd (its hook
    sees each call's own product)."""
    from hpctp.nn import _deferred_weights as dw

    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 4, dtype=F64, generator=g, requires_grad=True)
    fused = torch.randn(6, 4, dtype=F64, generator=g, requires_grad=True)
    hooked = torch.randn(3, 4, dtype=F64, generator=g, requires_grad=True)
    xs = [torch.randn(2, 5, 4, dtype=F64, generator=g) for _ in range(3)]
    seen: list[torch.Tensor] = []
    hooked.register_hook(lambda d: seen.append(d.clone()))
    fired: list[int] = []
    for p in (w, fused, hooked):
        p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
    calls: list[int] = []
    backward = torch.autograd.backward

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        backward(*args, **kwargs)  # type: ignore[arg-type]

    def micro_batches(in_place: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(dw, "IN_PLACE", in_place)
        for p in (w, fused, hooked):
            p.grad = None
        seen.clear()
        fired.clear()
        for x in xs:
            x = x.clone().requires_grad_(True)  # (a linear whose input needs no gradient computes dW in backward)
            deferred = DeferredWeightGradients()
            with deferred.recording():
                y = linear(x, w) * linear(x, fused[3:]) + linear(x, fused[:3]) * linear(x, hooked)
            assert len(deferred) == 4
            y.square().sum().backward()
            calls.clear()
            with monkeypatch.context() as m:
                m.setattr(torch.autograd, "backward", counted)
                deferred.run()
            assert len(calls) == (1 if in_place else 4)  # (in place: only the hooked weight through autograd)
        return [w.grad.clone(), fused.grad.clone(), hooked.grad.clone()]

    through_autograd = micro_batches(False)
    assert len(seen) == 3 and fired.count(id(w)) == 3 and fired.count(id(fused)) == 6
    in_place = micro_batches(True)
    for a, b in zip(through_autograd, in_place):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)
    assert fired.count(id(w)) == 3 and fired.count(id(fused)) == 6 and fired.count(id(hooked)) == 3
    assert len(seen) == 3  # (the hooked weight's each product, through autograd)
    torch.testing.assert_close(sum(seen), hooked.grad, rtol=1e-12, atol=1e-14)
