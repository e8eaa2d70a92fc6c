"""Training a model bigger than one device: ParallelPlan, ShardedDataParallel (ZeRO 1-3), activation checkpointing, bf16.

    mpiexec -n 4 python examples/guide/training.py [OUTDIR]     (figure: OUTDIR/memory.png)

A 2 x 2 grid: grid axis 0 carries data parallelism (each row of ranks trains on its half of the
global batch), grid axis 1 spatial parallelism (each field's rows split over the two ranks of a row). The model
and its inputs live on ``plan.model_grid``, which keeps the spatial axis alone and numbers it anew: grid axis 1 is
model-grid axis 0, the axis that the splits below name (``split=(0, None)``, ``FIELD``).
The same model, data and Adam steps run at every ZeRO stage, with activation checkpointing and under
bf16 autocast, and once in one process (rank 0 alone) for reference. Rank 0 prints.
"""

import contextlib
import sys
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import hpctp
import hpctp.nn
from hpctp.nn import Conv2d, SpectralConv2d

out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/guide")
BATCH, CHANNELS, SIZE, STEPS = 8, 2, 32, 3
DEVICE_MIB = 8.0  # a pretend device: state + activations must fit in it
FIELD = (None, None, 0, None)  # [N, C, H, W]: H over the model grid's axis 0, W whole


# ------------------------------------------------------------------------------------------ the model
class Block(torch.nn.Module):
    """A Fourier layer and a 3x3 convolution (halo exchange), added, GELU, residual."""

    def __init__(self, width: int, modes: int, grid: hpctp.ProcessGrid, seed: int) -> None:
        super().__init__()
        self.spectral = SpectralConv2d(width, width, modes, grid=grid, split=(0, None), seed=seed)
        self.conv = Conv2d(width, width, 3, padding=1, grid=grid, split=(0, None), seed=seed + 1)

    def forward(self, h: hpctp.DistTensor) -> hpctp.DistTensor:
        return h + torch.nn.functional.gelu(self.spectral(h) + self.conv(h))


class WideFNO(torch.nn.Module):
    def __init__(self, grid: hpctp.ProcessGrid, width: int = 32, depth: int = 3, modes: int = 8) -> None:
        super().__init__()
        self.lift = Conv2d(CHANNELS, width, 1, grid=grid, split=(0, None), seed=0)
        self.blocks = torch.nn.ModuleList(Block(width, modes, grid, seed=10 * (i + 1)) for i in range(depth))
        self.head = Conv2d(width, CHANNELS, 1, grid=grid, split=(0, None), seed=1)

    def forward(self, x: hpctp.DistTensor) -> hpctp.DistTensor:
        h = self.lift(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model(model_grid: hpctp.ProcessGrid, checkpointing: bool = False, meta: bool = False) -> torch.nn.Module:
    """Collective over model_grid. The model, built on the grid of its spatial (and tensor) axes.

    Seeded layers: the same weights on any grid, so every run below starts from the same model. With ``meta``
    nothing is allocated: the parameters have shapes but no storage until ShardedDataParallel materializes
    this rank's slices, one block at a time, so the whole model never exists on any rank.
    """
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = WideFNO(model_grid)
    if checkpointing:  # keep only each block's input in forward; backward recomputes the rest
        for block in model.blocks:
            hpctp.nn.checkpoint_forward(block)
    return model


# ------------------------------------------------------------------------------------------ measuring
def state_bytes(tensors: list[torch.Tensor]) -> int:
    """Local. Bytes of the distinct storages behind ``tensors`` (a freed, size-0 storage counts 0)."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def training_state(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> int:
    """Local. Parameters, gradients and optimizer state held by this rank."""
    tensors = [t for p in params for t in (p, p.grad) if t is not None]
    tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return state_bytes(tensors)


class SavedActivations:
    """Local. Counts the bytes autograd saves for backward (parameters left out) while active."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        params = {p.untyped_storage().data_ptr() for p in self.params}  # (stage 3 gathers them into new memory)
        if t.untyped_storage().data_ptr() not in params:
            self.bytes += t.numel() * t.element_size()
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def batch(model_grid: hpctp.ProcessGrid, start: int, stop: int) -> tuple[hpctp.DistTensor, torch.Tensor]:
    """Collective over model_grid. Samples ``start:stop`` of the global batch (inputs; targets: shifted by
    one cell), cut over the model grid."""
    x = torch.randn(BATCH, CHANNELS, SIZE, SIZE, generator=torch.Generator().manual_seed(7))
    xd = hpctp.distribute(x[start:stop].contiguous(), model_grid, FIELD)
    yd = hpctp.distribute(torch.roll(x, 1, dims=-1)[start:stop].contiguous(), model_grid, FIELD)
    return xd, yd.local


def train(plan: hpctp.nn.ParallelPlan, stage: int | None, checkpointing: bool = False, bf16: bool = False) -> dict:
    """Collective over plan.grid. STEPS Adam steps; losses, the state kept per rank between steps and the
    activations saved in forward (the maxima over ranks). ``stage=None``: no ShardedDataParallel."""
    meta = stage == 3  # stage 3 never needs the whole model: build it on meta, materialize the slices
    model = build_model(plan.model_grid, checkpointing, meta=meta)
    trained = model if stage is None else hpctp.nn.ShardedDataParallel(model, plan, stage=stage, seed=0)
    params = list(dict.fromkeys([*model.parameters(), *trained.parameters()]))
    opt = torch.optim.Adam(trained.parameters(), lr=1e-3)
    x, y = batch(plan.model_grid, *plan.sample_range(BATCH))
    losses, kept, saved = [], 0, SavedActivations(params)
    for _ in range(STEPS):
        saved.bytes = 0
        with hpctp.CommCounter() as sent:
            with saved.hooks(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                pred = trained(x)
                loss = hpctp.nn.global_mse_loss(pred.local.float(), y, plan.grid, plan.loss_axes)
            loss.backward()
            if stage is None:
                plan.sync_gradients(model)  # plain training: sum the gradients over data and spatial axes
                opt.step()
            else:
                trained.step(opt)  # finish the gradient messages, step the slices, gather (stages 1-2)
        kept = training_state(params, opt)  # before zero_grad: the gradients count
        trained.zero_grad()
        losses.append(loss.item())
    worst = np.array([kept, saved.bytes, sent.bytes_sent], dtype=np.float64)
    hpctp.comm.allreduce(plan.grid.comm, worst, "max")
    return {"losses": losses, "state": worst[0], "activations": worst[1], "sent": worst[2]}


# ------------------------------------------------------------------------------------------ the runs
grid = hpctp.ProcessGrid([0, 2] if MPI.COMM_WORLD.Get_size() % 2 == 0 else [0, 1])
plan = hpctp.nn.ParallelPlan(grid, data=(0,))  # axis 0: data; the rest (axis 1): spatial
if grid.rank == 0:
    print(f"grid {grid.dims}: {plan.data_size} data groups, model grid {plan.model_grid.dims} (spatial)")
    start, stop = plan.sample_range(BATCH)
    print(f"rank 0 trains on samples {start}:{stop} of {BATCH}, rows {plan.model_grid.coords[0]} of each field's split")
    solo = hpctp.nn.ParallelPlan(hpctp.ProcessGrid([1], comm=MPI.COMM_SELF))  # one process, the whole batch
    one = train(solo, stage=None)
    n_params = sum(p.numel() for p in build_model(solo.model_grid).parameters())
    print(f"\nthe model: {n_params} parameters; one process keeps {one['state'] / 2**20:.2f} MiB of training state")
    print("(parameters, gradients, Adam's two moments) and saves {:.2f} MiB of activations per step".format(
        one["activations"] / 2**20))  # fmt: skip
runs = {f"stage {s}": train(plan, stage=s) for s in (0, 1, 2, 3)}
runs["stage 3 + checkpointing"] = train(plan, stage=3, checkpointing=True)
runs["stage 3 + bf16 autocast"] = train(plan, stage=3, bf16=True)

if grid.rank == 0:

    def fits(r: dict) -> str:
        total = (r["state"] + r["activations"]) / 2**20
        return f"{total:5.2f} MiB {'fits' if total <= DEVICE_MIB else 'too big'}"

    print(f"\nper rank (the largest over ranks) against one process; MiB sent per step; a device of {DEVICE_MIB} MiB")
    print(f"{'configuration':24s} {'state':>6s} {'activations':>12s} {'MiB sent':>9s}  {'device':18s} final loss")
    for name, r in runs.items():
        print(f"{name:24s} {r['state'] / one['state']:6.3f} {r['activations'] / one['activations']:12.3f} "
              f"{r['sent'] / 2**20:9.2f}  {fits(r):18s} {r['losses'][-1]:.6f}")  # fmt: skip
    print(f"{'one process':24s} {1:6.3f} {1:12.3f} {0:9.2f}  {fits(one):18s} {one['losses'][-1]:.6f}")
    for name, r in runs.items():
        if name in ("stage 0", "stage 1", "stage 2", "stage 3", "stage 3 + checkpointing"):
            diff = max(abs(a - b) / b for a, b in zip(r["losses"], one["losses"]))
            print(f"{name}: losses vs one process, max rel. difference {diff:.1e}")
    bf = max(abs(a - b) / b for a, b in zip(runs["stage 3 + bf16 autocast"]["losses"], one["losses"]))
    print(f"bf16 autocast: losses vs one process (float32), max rel. difference {bf:.1e}")

    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    names = ["one process", *runs]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, key, color in ((axes[0], "state", "tab:blue"), (axes[1], "activations", "tab:orange")):
        values = [1.0] + [runs[n][key] / one[key] for n in runs]
        ax.barh(names, values, color=["tab:gray"] + [color] * len(runs))
        for i, v in enumerate(values):
            ax.text(v + 0.01, i, f"{v:.2f}", va="center", fontsize=8)
        ax.set_xlim(0, 1.2)
    axes[0].set_xlabel("training state kept per rank / one process")
    axes[1].set_xlabel("activations saved per rank / one process")
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=100)
grid.free()
