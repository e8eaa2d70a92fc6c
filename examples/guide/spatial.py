"""A field split over the ranks: a halo exchange, then an FNO that learns the heat equation's solution operator.

    mpiexec -n 4 python examples/guide/spatial.py [OUTDIR]     (figures: OUTDIR/fields.png, loss.png)

No rank ever holds the whole field: each holds its block, the convolutions exchange halos with the
neighbours, the Fourier layer sums one small spectrum over the grid. Rank 0 prints.
"""

import sys
from pathlib import Path

import numpy as np
import torch

import hpctp
import hpctp.nn
from hpctp import CommCounter

out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/guide")
grid = hpctp.ProcessGrid([0, 0])
say = print if grid.rank == 0 else (lambda *a, **k: None)
N, H, W = 16, 64, 64  # samples, field size
FIELD = (None, None, 0, 1)  # [N, C, H, W]: H over grid axis 0, W over grid axis 1

# --- 1. a halo exchange by hand: one explicit heat step on a numpy field, periodic
u = hpctp.fromfunction(lambda i, j: np.sin(2 * np.pi * i / H) * np.cos(4 * np.pi * j / W), (H, W), grid, (0, 1))
halo = hpctp.HaloExchange(u, 1, boundary="periodic")  # planned once: who sends which rows and columns to whom
with CommCounter() as sent:
    pending = halo.begin(u.local)  # messages in flight; work that needs no halo could run here
    p = halo.end(pending)  # this rank's block with one ghost cell on each side
step = p[1:-1, 1:-1] + 0.1 * (p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * p[1:-1, 1:-1])
rolled = u + 0.1 * (np.roll(u, 1, 0) + np.roll(u, -1, 0) + np.roll(u, 1, 1) + np.roll(u, -1, 1) - 4 * u)
same = np.array_equal(step, rolled.local)
say(f"halo exchange: block {u.local.shape} padded to {p.shape}; {sent.messages} messages, {sent.bytes_sent} bytes")
say(f"  the heat step on padded blocks equals the np.roll version on rank 0: {same}")


# --- 2. data: random smooth fields and their state after diffusing for a time T, solved with hpctp.fft
def smooth_fields(n: int, seed: int) -> hpctp.DistTensor:
    """Collective. ``n`` random fields [n, 1, H, W] with a k^-3 spectrum, as float32 torch blocks."""
    noise = hpctp.random.normal((n, 1, H, W), grid, FIELD, seed=seed)
    spec = hpctp.fft.rfftn(noise, axes=(2, 3))
    ky, kx = hpctp.fft.frequencies(spec, axes=(2, 3), n=W)  # this rank's wavenumbers: no message
    k2 = (ky * H) ** 2 + (kx * W) ** 2
    field = hpctp.fft.irfftn(spec.with_local(spec.local / (1.0 + k2) ** 1.5), n=W, axes=(2, 3))
    return (field * 8.0).astype("float32").to("torch")


def diffuse(f: hpctp.DistTensor, t: float) -> hpctp.DistTensor:
    """Collective. The periodic heat equation's solution after time ``t`` (exact, in Fourier space)."""
    spec = hpctp.fft.rfftn(f.to("numpy").astype("float64"), axes=(2, 3))
    ky, kx = hpctp.fft.frequencies(spec, axes=(2, 3), n=W)
    decay = np.exp(-t * ((ky * H) ** 2 + (kx * W) ** 2))  # integer wavenumbers: ky * H, kx * W
    return hpctp.fft.irfftn(spec.with_local(spec.local * decay), n=W, axes=(2, 3)).astype("float32").to("torch")


x_train = smooth_fields(N, seed=1)
y_train = diffuse(x_train, t=0.05)
x_test = smooth_fields(1, seed=2)
y_test = diffuse(x_test, t=0.05)
block, whole = x_train.local.numel() * 4, x_train.size * 4
say(f"training fields {x_train.shape}: {whole} bytes in all, {block} bytes on rank 0 ({block / whole:.2f})")


# --- 3. an FNO built from hpctp's layers: drop-ins for torch's, with a grid
class FNO(torch.nn.Module):
    def __init__(self, grid: hpctp.ProcessGrid, width: int = 12, modes: int = 8) -> None:
        super().__init__()
        self.lift = hpctp.nn.Conv2d(1, width, 3, padding=1, padding_mode="circular", grid=grid, seed=0)  # halo
        self.spectral = hpctp.nn.SpectralConv2d(width, width, modes, grid=grid, seed=1)  # modes split over ranks
        self.mix = hpctp.nn.Conv2d(width, width, 1, grid=grid, seed=2)  # 1x1: no message
        self.head = hpctp.nn.Conv2d(width, 1, 1, grid=grid, seed=3)

    def forward(self, u: hpctp.DistTensor) -> hpctp.DistTensor:
        h = torch.nn.functional.gelu(self.lift(u))  # torch's pointwise functions act on the blocks
        h = torch.nn.functional.gelu(self.spectral(h) + self.mix(h))
        return self.head(h) + u  # learn the change


model = FNO(grid)
with torch.no_grad():
    lifted = model.lift(x_train)
    for name, layer, h in (("Conv2d 3x3", model.lift, x_train), ("SpectralConv2d", model.spectral, lifted)):
        with CommCounter() as c:
            layer(h)
        say(f"{name} forward: {c.calls}, {c.bytes_sent} bytes sent by rank 0 (its input block: {h.local.numel() * 4})")

opt = torch.optim.Adam(model.parameters(), lr=1e-2)
losses = []
for step in range(50):
    loss = hpctp.nn.global_mse_loss(model(x_train).local, y_train.local, grid)  # the loss of the whole batch
    opt.zero_grad()
    loss.backward()  # halos and spectra travel back
    hpctp.nn.sync_gradients(model, grid)  # the single-process gradient on every rank
    opt.step()
    losses.append(loss.item())
    if step % 10 == 0 or step == 49:
        say(f"step {step:2d}  loss {losses[-1]:.3e}")
with torch.no_grad():
    pred = model(x_test)
    err = float(hpctp.nn.relative_l2_error(pred.local, y_test.local, grid))
    keep = float(hpctp.nn.relative_l2_error(x_test.local, y_test.local, grid))
say(f"held-out field: relative L2 error {err:.3f} (the input itself as the prediction: {keep:.3f})")

# --- 4. the same model in one process (torch's own layers, the same weights) on the gathered field
xg, yg, pg = [t.gather(root=0) for t in (x_test, y_test, pred)]
if grid.rank == 0:
    ref = torch.nn.ModuleDict(
        {
            "lift": torch.nn.Conv2d(1, 12, 3, padding=1, padding_mode="circular"),
            "mix": torch.nn.Conv2d(12, 12, 1),
            "head": torch.nn.Conv2d(12, 1, 1),
        }
    )
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("spectral")})
    with torch.no_grad():
        h = torch.nn.functional.gelu(ref["lift"](xg))
        h = torch.nn.functional.gelu(hpctp.nn.functional.spectral_conv_fft(h, model.spectral.weight) + ref["mix"](h))
        want = ref["head"](h) + xg
    print(f"prediction vs torch in one process: max rel. error {float((pg - want).abs().max() / want.abs().max()):.1e}")

    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 4, figsize=(11, 3))
    lim = float(xg.abs().max())
    panels = [("input", xg), ("target (exact)", yg), ("FNO", pg), ("FNO - target, x10", 10 * (pg - yg))]
    for ax, (title, f) in zip(axes, panels):
        im = ax.imshow(f[0, 0].numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim)
        ax.set_title(title, fontsize=9)
        ax.axhline(H / 2 - 0.5, color="k", lw=0.5, ls=":")  # the block boundaries of a 2 x 2 grid
        ax.axvline(W / 2 - 0.5, color="k", lw=0.5, ls=":")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(im, ax=axes, shrink=0.8)
    fig.savefig(out / "fields.png", dpi=100, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.semilogy(losses)
    ax.set_xlabel("Adam step")
    ax.set_ylabel("global MSE loss")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
grid.free()
