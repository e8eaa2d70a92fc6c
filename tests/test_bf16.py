"""bfloat16 mixed precision through hpctp's layers: float32 parameters and optimizer state, compute under
``torch.autocast``, reductions and statistics in float32, halos and gathered activations in bfloat16."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import hpctp
from hpctp.comm import CommCounter
from hpctp.nn import (
    BatchNorm2d,
    Conv2d,
    GroupNorm,
    SpectralConv2d,
    TransformerBlock,
    global_mse_loss,
    sync_gradients,
)
from hpctp.nn.functional import attention
from hpctp.testing import assert_all, assert_allclose, assert_equal

BF16 = torch.bfloat16
N, CIN, C, H, W = 2, 2, 8, 8, 6  # the field [N, C, H, W]: H split over the ranks (4 ranks: 2 rows each)
SPLIT = (0, None)
STEPS, LR = 20, 3e-3
# bfloat16 keeps 8 bits of mantissa: one rounding is at most 2**-9 ~ 2e-3 relative. The loss is a mean over
# the field of squared errors whose terms carry a few such roundings each (conv, norm, attention, MLP), and
# Adam's steps move the parameters by ~LR whatever the gradient's rounding, so after 20 steps the bf16 loss
# stays within 1e-2 of float32's. The distributed and one-process bf16 runs round the same values but sum
# partial results in another order (halo strips, token blocks, spectrum shares), so they also differ by
# roundings: the same 1e-2 bound (measured: about 1e-3 at 2 and 4 ranks).
RTOL_BF16 = 1e-2


def _field(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class _Net(torch.nn.Module):
    """conv (halo) -> group norm -> spectral conv (+ residual) -> batch norm -> a sequence-parallel transformer
    block over the field's pixels as tokens (H split over the ranks: each rank's tokens are consecutive) -> conv."""

    def __init__(self, grid: hpctp.ProcessGrid) -> None:
        super().__init__()
        kw = {"grid": grid, "split": SPLIT}
        self.conv1 = Conv2d(CIN, C, 3, padding=1, seed=1, **kw)
        self.norm1 = GroupNorm(2, C, **kw)
        self.spectral = SpectralConv2d(C, C, (2, 3), seed=2, **kw)
        self.norm2 = BatchNorm2d(C, **kw)
        self.block = TransformerBlock(C, 2, 2.0, grid, axis=0, sequence_parallel=True, seed=3)
        self.conv2 = Conv2d(C, 1, 3, padding=1, seed=4, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.norm1(self.conv1(x)))
        h = self.norm2(h + self.spectral(h))
        n, c, rows, w = h.shape
        t = self.block(h.permute(0, 2, 3, 1).reshape(n, rows * w, c))
        return self.conv2(t.reshape(n, rows, w, c).permute(0, 3, 1, 2))


def _train(grid: hpctp.ProcessGrid, bf16: bool) -> tuple[list[float], _Net, torch.optim.Adam]:
    """Collective over grid. 20 Adam steps from the seeded initial parameters; the loss of each step."""
    rows = hpctp.Layout((N, CIN, H, W), grid.dims, (None, None, *SPLIT)).local_slices(grid.coords)
    x, target = _field((N, CIN, H, W), 1)[rows], _field((N, 1, H, W), 2)[rows]
    net = _Net(grid)
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=BF16, enabled=bf16):
            loss = global_mse_loss(net(x), target, grid)
        loss.backward()
        sync_gradients(net, grid)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, net, opt


@pytest.mark.mpi
def test_bf16_training_follows_float32(grid1d):  # type: ignore[no-untyped-def]
    """Every step's bf16 loss is within 1e-2 of float32's; the distributed bf16 run matches the one-process
    one (same initial parameters on any grid); parameters, gradients and Adam's moments stay float32."""
    f32, _, _ = _train(grid1d, bf16=False)
    b16, net, opt = _train(grid1d, bf16=True)
    single = hpctp.ProcessGrid((1,), comm=MPI.COMM_SELF)
    try:
        one, _, _ = _train(single, bf16=True)
    finally:
        single.free()
    assert_allclose(grid1d, b16, f32, rtol=RTOL_BF16, what="bf16 loss vs float32 loss, per step")
    assert_allclose(grid1d, b16, one, rtol=RTOL_BF16, what="distributed bf16 loss vs one-process bf16 loss")
    assert_all(grid1d, f32[-1] < 0.9 * f32[0], f"float32 training does not learn: {f32[0]} -> {f32[-1]}")
    kinds = {str(p.dtype) for p in net.parameters()} | {str(p.grad.dtype) for p in net.parameters()}
    kinds |= {str(t.dtype) for s in opt.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")}
    assert_equal(grid1d, sorted(kinds), ["torch.float32"], "dtypes of parameters, gradients and Adam's moments")
    assert_equal(grid1d, len(opt.state), len(list(net.parameters())), "Adam state per parameter")


def _conv_messages(grid: hpctp.ProcessGrid, bf16: bool) -> tuple[int, int, dict[str, int], torch.dtype]:
    conv = Conv2d(C, C, 3, padding=1, seed=5, grid=grid, split=SPLIT)
    layout = hpctp.Layout((N, C, H, W), grid.dims, (None, None, *SPLIT))
    x = hpctp.DistTensor(_field((N, C, H, W), 3)[layout.local_slices(grid.coords)].requires_grad_(), grid, layout)
    with CommCounter() as fwd:
        with torch.autocast("cpu", dtype=BF16, enabled=bf16):
            y = conv(x)
    with CommCounter() as bwd:
        y.local.float().sum().backward()
    return fwd.bytes_sent, bwd.bytes_sent, fwd.calls | {f"backward {k}": v for k, v in bwd.calls.items()}, y.dtype


@pytest.mark.mpi
def test_conv_halo_bytes_halved_under_autocast(grid1d):  # type: ignore[no-untyped-def]
    """A float32 field into a Conv2d under autocast: cast once before its halo travels, so the halo (and its
    adjoint in backward) are half the bytes of float32's, in the same messages."""
    f_fwd, f_bwd, f_calls, f_dtype = _conv_messages(grid1d, bf16=False)
    b_fwd, b_bwd, b_calls, b_dtype = _conv_messages(grid1d, bf16=True)
    assert_equal(grid1d, [str(f_dtype), str(b_dtype)], ["torch.float32", "torch.bfloat16"], "output dtypes")
    assert_equal(grid1d, [2 * b_fwd, 2 * b_bwd], [f_fwd, f_bwd], "bf16 halo bytes x 2 == float32 halo bytes")
    assert_equal(grid1d, sorted(b_calls.items()), sorted(f_calls.items()), "the same calls")
    has_neighbour = grid1d.size > 1
    assert_all(grid1d, (f_fwd > 0 and f_bwd > 0) == has_neighbour, f"halo bytes {f_fwd}, {f_bwd}")


@pytest.mark.mpi
def test_ring_attention_statistics_in_float32(grid1d):  # type: ignore[no-untyped-def]
    """Ring attention under autocast casts q, k, v to bf16 before they travel (K/V messages half of float32's)
    and merges the blocks with float32 statistics: the output is SDPA of the bf16-rounded inputs up to the
    output's own bf16 rounding (measured: 3.4e-3 absolute on values up to 1.5)."""
    shape = (1, 2, 12, 4)
    layout = hpctp.Layout(shape, grid1d.dims, (None, None, 0, None))
    Q, K, V = (_field(shape, s) for s in (4, 5, 6))

    def run(bf16: bool) -> tuple[torch.Tensor, int]:
        q, k, v = (hpctp.DistTensor(t[layout.local_slices(grid1d.coords)], grid1d, layout) for t in (Q, K, V))
        with CommCounter() as c, torch.autocast("cpu", dtype=BF16, enabled=bf16):
            y = attention(q, k, v, causal=True, schedule="ring")
        return y.local, c.bytes_sent

    y32, bytes32 = run(False)
    y16, bytes16 = run(True)
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.to(BF16).double() for t in (Q, K, V)), is_causal=True)[
        layout.local_slices(grid1d.coords)
    ]
    assert_equal(grid1d, str(y16.dtype), "torch.bfloat16", "output dtype under autocast")
    assert_equal(grid1d, 2 * bytes16, bytes32, "bf16 K/V bytes x 2 == float32's")
    # exact softmax of the rounded inputs, then one rounding to bf16 (2**-9) plus bf16 P @ V in the kernel
    assert_allclose(grid1d, y16.double(), ref, rtol=1e-2, atol=1e-2, what="bf16 ring attention")
    assert_allclose(grid1d, y32.double(), torch.nn.functional.scaled_dot_product_attention(
        Q.double(), K.double(), V.double(), is_causal=True)[layout.local_slices(grid1d.coords)],
        rtol=1e-5, atol=1e-6, what="float32 ring attention")  # fmt: skip
