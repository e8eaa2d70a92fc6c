"""HDF5 data and a checkpoint on 4 ranks: save_hdf5, FieldDataset + FieldLoader, ZeRO-3 training, save_checkpoint.

    mpiexec -n 4 python examples/guide/data_save.py [OUTDIR]     (writes OUTDIR/data.h5, checkpoint.h5, losses.npy)

Then ``mpiexec -n 2 python examples/guide/data_restore.py OUTDIR`` restores the checkpoint on 2 ranks.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from guide_model import Surrogate, simulate  # examples/guide/guide_model.py, beside this script

import hpctp
import hpctp.nn

out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/guide")
grid = hpctp.ProcessGrid([0, 0])  # 2 x 2 on 4 ranks
say = print if grid.rank == 0 else (lambda *a, **k: None)
SNAPSHOTS, SIZE, BATCH, EPOCHS, SAVE_AFTER = 25, 64, 4, 4, 2

# --- a dataset: one global HDF5 dataset [T, C, H, W], each rank writing its own hyperslab
states = simulate(grid, SNAPSHOTS, SIZE)  # [25, 1, 64, 64], split (None, None, 0, 1)
if grid.rank == 0:
    out.mkdir(parents=True, exist_ok=True)
hpctp.io.save_hdf5(states, out / "data.h5", "u", mode="w", attrs={"steps_between": 4})
say(f"wrote data.h5:/u {states.shape} {states.dtype} (h5py with MPI-IO: {hpctp.io.mpio_available()})")

# --- training pairs (u[t], u[t + 1]) on a data x spatial grid: grid axis 0 data, grid axis 1 splits the rows
plan = hpctp.nn.ParallelPlan(grid, data=(0,))
# the dataset and the model live on plan.model_grid, which keeps only the spatial axis and numbers it anew:
# grid axis 1 is model-grid axis 0, so the splits from here on name axis 0 for the rows
rows = plan.spatial[0]  # 0: the model grid's number of grid axis 1
data = hpctp.io.FieldDataset(out / "data.h5", "u", plan.model_grid, (None, rows, None), targets=1, like="torch")
loader = hpctp.io.FieldLoader(data, BATCH, shuffle=True, seed=0, drop_last=True, plan=plan)  # reads ahead
say(f"{len(data)} pairs, {len(loader)} batches of {BATCH} per epoch; each data group reads its share of a batch")

model = Surrogate(plan.model_grid, split=(rows, None))  # rows over model-grid axis 0, columns whole
sdp = hpctp.nn.ShardedDataParallel(model, plan, stage=3)  # parameters, gradients, Adam state: half per rank
opt = torch.optim.Adam(sdp.parameters(), lr=1e-2)
losses, step = [], 0
for epoch in range(EPOCHS):
    for x, y in loader:
        loss = hpctp.nn.global_mse_loss(sdp(x).local, y.local, plan.grid, plan.loss_axes)
        loss.backward()
        sdp.step(opt)
        sdp.zero_grad()
        losses.append(loss.item())
        step += 1
    say(f"epoch {epoch}: mean loss {np.mean(losses[-len(loader) :]):.3e}")
    if epoch + 1 == SAVE_AFTER:  # every rank writes the blocks it owns, as whole global tensors
        hpctp.io.save_checkpoint(out / "checkpoint.h5", sdp, opt, step, plan.grid)
        say(f"saved checkpoint.h5 at step {step} (grid {grid.dims}, ZeRO stage 3)")
data.close()
if grid.rank == 0:
    np.save(out / "losses.npy", np.array(losses))  # for the restore's comparison
grid.free()
