"""The checkpoint of data_save.py (4 ranks, ZeRO stage 3) restored on 2 ranks, unsharded, training on.

    mpiexec -n 2 python examples/guide/data_restore.py OUTDIR     (after data_save.py OUTDIR; figure: OUTDIR/restart.png)

The losses after the restart equal those the 4-rank run had after its save.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from guide_model import Surrogate

import hpctp
import hpctp.nn

out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/guide")
grid = hpctp.ProcessGrid([0])  # 2 ranks, a 1-D grid: each holds half of every field's rows
say = print if grid.rank == 0 else (lambda *a, **k: None)
BATCH, EPOCHS = 4, 4

# --- any slab of the stored data, on any grid: each rank reads only its hyperslab
u10 = hpctp.io.load_hdf5(out / "data.h5", "u", grid, (None, 0, None), index=10, like="torch")  # [1, H, W]
say(f"load_hdf5(index=10): {u10.shape}, rank 0 read rows {u10.layout.local_ranges(grid.coords)[1]}")

# --- the model and optimizer, built as for a fresh start, then the checkpoint's state poured in
model = Surrogate(grid, split=(0, None))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
step = hpctp.io.load_checkpoint(out / "checkpoint.h5", model, opt, grid)
data = hpctp.io.FieldDataset(out / "data.h5", "u", grid, (None, 0, None), targets=1, like="torch")
loader = hpctp.io.FieldLoader(data, BATCH, shuffle=True, seed=0, drop_last=True)
loader.set_epoch(step // len(loader))  # the same global batches as the 4-rank run from here on
say(f"restored step {step} on grid {grid.dims}: resuming at epoch {loader.epoch}")

losses = []
for _ in range(loader.epoch, EPOCHS):
    for x, y in loader:
        loss = hpctp.nn.global_mse_loss(model(x).local, y.local, grid)
        opt.zero_grad()
        loss.backward()
        hpctp.nn.sync_gradients(model, grid)
        opt.step()
        losses.append(loss.item())
with torch.no_grad():
    pred = model(u10[None])[0]
truth = hpctp.io.load_hdf5(out / "data.h5", "u", grid, (None, 0, None), index=11, like="torch")
err = hpctp.nn.relative_l2_error(pred.local, truth.local, grid).item()
still = hpctp.nn.relative_l2_error(u10.local, truth.local, grid).item()  # "nothing moves" as the prediction
pg, tg, ug = [t.gather(root=0) for t in (pred, truth, u10)]

if grid.rank == 0:
    before = np.load(out / "losses.npy", allow_pickle=False)
    diff = np.abs(np.array(losses) - before[step:]) / before[step:]
    print(f"losses after the restart vs the 4-rank run: {len(losses)} steps, max rel. difference {diff.max():.1e}")
    print(f"snapshot 10 -> 11: relative L2 error {err:.3f} (snapshot 10 itself as the prediction: {still:.3f})")

    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(12, 3), gridspec_kw={"width_ratios": [1, 1, 1, 1.6]})
    lim = float(tg.abs().max())
    for ax, (title, f) in zip(axes, [("snapshot 10", ug), ("snapshot 11", tg), ("surrogate(snapshot 10)", pg)]):
        ax.imshow(f[0].numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim)
        ax.axhline(f.shape[1] / 2 - 0.5, color="k", lw=0.5, ls=":")  # the two ranks' halves
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[3].semilogy(before, "k-", lw=3, alpha=0.3, label="4 ranks, ZeRO 3")
    axes[3].semilogy(range(step, step + len(losses)), losses, "o", ms=3, label="restarted on 2 ranks")
    axes[3].axvline(step - 0.5, color="gray", ls=":")
    axes[3].set_xlabel("step")
    axes[3].set_ylabel("loss")
    axes[3].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "restart.png", dpi=100)
data.close()
grid.free()
