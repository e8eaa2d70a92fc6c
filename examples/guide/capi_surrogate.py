"""What libhpctp_c does for a C or Fortran code, driven from Python: init, load a trained surrogate, infer in place.

    mpiexec -n 4 python examples/guide/capi_surrogate.py [OUTDIR]     (writes OUTDIR/checkpoint.h5)

``hpctp_init``, ``hpctp_load``, ``hpctp_infer`` and ``hpctp_finalize`` of ``capi/hpctp.h`` call
``hpctp.cli.cbridge.init/load/infer/finalize``; here the same functions run on the blocks of a
"simulation" that cuts its field its own (uneven) way, as ``apps/c_example/main.c`` does.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from guide_model import Surrogate, simulate  # examples/guide/guide_model.py (its factory: guide_model:factory)
from mpi4py import MPI

import hpctp
import hpctp.nn
from hpctp.cli import cbridge

out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/guide")
world = MPI.COMM_WORLD
SIZE = 64

# --- 1. train a surrogate for a few steps and save it (as the data page does, shorter)
grid = hpctp.ProcessGrid([0, 0])
states = simulate(grid, 9, SIZE).to("torch")
model = Surrogate(grid)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(8):
    loss = hpctp.nn.global_mse_loss(model(states[:-1]).local, states[1:].local, grid)
    opt.zero_grad()
    loss.backward()
    hpctp.nn.sync_gradients(model, grid)
    opt.step()
if grid.rank == 0:
    out.mkdir(parents=True, exist_ok=True)
hpctp.io.save_checkpoint(out / "checkpoint.h5", model, opt, 8, grid)
grid.free()


# --- 2. the simulation's side: its own 2-D decomposition, blocks of triangular sizes (not hpctp's balanced ones)
def cut(n: int, p: int, c: int) -> int:
    return n * c * (c + 1) // (p * (p + 1))  # as cut() in apps/c_example/main.c


solo = hpctp.ProcessGrid([1, 1], comm=MPI.COMM_SELF)  # this rank alone: the whole field
whole = simulate(solo, 1, SIZE).local[0].astype(np.float64)  # [1, H, W]
dims = MPI.Compute_dims(world.Get_size(), 2)
coords = (world.Get_rank() // dims[1], world.Get_rank() % dims[1])  # row-major, as hpctp's grid
lo = [cut(SIZE, dims[d], coords[d]) for d in range(2)]
hi = [cut(SIZE, dims[d], coords[d] + 1) for d in range(2)]
field = np.ascontiguousarray(whole[:, lo[0] : hi[0], lo[1] : hi[1]])  # the simulation's own memory

# --- 3. what hpctp_init / hpctp_load / hpctp_infer / hpctp_finalize do
cbridge.init(world, [0, 0])  # hpctp_init(MPI_COMM_WORLD, dims = {0, 0}, 2)
g_dims, g_coords = cbridge.grid_info()  # hpctp_grid(...): the same row-major coordinates
cbridge.load("guide_model:factory", str(out / "checkpoint.h5"))  # hpctp_load("guide_model:factory", path)
cbridge.infer(field, [0, lo[0], lo[1]], [1, SIZE, SIZE], split=[None, 0, 1])  # hpctp_infer(..., split = {-1, 0, 1})
cbridge.finalize()  # hpctp_finalize()

# --- 4. check: the surrogate in one process on the whole field
ref = Surrogate(solo)
hpctp.io.load_checkpoint(out / "checkpoint.h5", ref, None, solo, strict=False)
with torch.no_grad():
    want = ref(hpctp.from_local(torch.from_numpy(whole)[None].float(), solo, (None, None, 0, 1)))
want = want.local[0].double().numpy()[:, lo[0] : hi[0], lo[1] : hi[1]]
shapes = hpctp.comm.allgather_ints(world, list(field.shape[1:]))  # every rank's block shape
error = np.array([np.abs(field - want).max() / np.abs(want).max() if field.size else 0.0])
hpctp.comm.allreduce(world, error, "max")
if world.Get_rank() == 0:
    blocks = [tuple(s) for s in shapes.tolist()]
    print(f"hpctp grid {g_dims}; the simulation's blocks (rows x columns) by rank: {blocks}")
    print(f"the blocks, overwritten in place, vs the surrogate in one process: max rel. error {error[0]:.1e} (float32)")
solo.free()
