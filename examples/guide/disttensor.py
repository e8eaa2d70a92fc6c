"""A first look: DistTensor, layouts, redistribute, numpy on blocks, SUMMA and the FFT.

    mpiexec -n 4 python examples/guide/disttensor.py [OUTDIR]     (figures: OUTDIR/layouts.png, spectrum.png)

Every result is checked against numpy on the gathered arrays; rank 0 prints.
"""

import sys
from pathlib import Path

import numpy as np

import hpctp
from hpctp import CommCounter

out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/guide")
grid = hpctp.ProcessGrid([0, 0])  # a 2-D grid of all ranks (2 x 2 on 4), on a Dup() of COMM_WORLD
say = print if grid.rank == 0 else (lambda *a, **k: None)
say(f"grid {grid.dims}, this rank at {grid.coords}")

# --- a tensor and its layout
# A global 10 x 7 array (rank 0 holds it here) scattered in blocks: dim 0 over grid axis 0, dim 1 over axis 1.
a = np.arange(70.0).reshape(10, 7) if grid.rank == 0 else None
x = hpctp.distribute(a, grid, split=(0, 1))
say(x.layout)  # pure block math, no MPI: every rank can ask about every other rank's block
for r in range(grid.size):
    (r0, r1), (c0, c1) = x.layout.local_ranges(grid.coords_of(r))
    say(f"  rank {r} at {grid.coords_of(r)} holds rows {r0}:{r1}, columns {c0}:{c1}")


def owners(t: hpctp.DistTensor) -> np.ndarray | None:
    """Collective. Which rank holds each element of ``t`` (gathered on rank 0)."""
    return t.with_local(np.full(t.local.shape, float(t.grid.rank))).gather(root=0)


maps = {"split=(0, 1)": owners(x)}

# --- redistribute: the same tensor, another cut
with CommCounter() as moved:
    y = x.redistribute((None, 0))  # rows whole, columns over grid axis 0 (replicated along axis 1)
maps["split=(None, 0): axis 1 holds copies"] = owners(y)
rows = hpctp.ProcessGrid([0])  # the same ranks as a 1-D grid
z = x.redistribute((0, None), grid=rows)  # onto another grid of the same ranks: row slabs
maps["split=(0, None), 1-D grid"] = owners(z)
say(f"redistribute to (None, 0): {moved.calls}, {moved.bytes_sent} bytes sent by rank 0")

# --- numpy on DistTensors: global semantics, blockwise work
u = hpctp.fromfunction(lambda i, j: np.sin(i / 9) * np.cos(j / 7), (96, 80), grid, (0, 1))  # own block, no message
lap = np.roll(u, 1, 0) + np.roll(u, -1, 0) + np.roll(u, 1, 1) + np.roll(u, -1, 1) - 4 * u  # periodic stencil
inner = np.tanh(u[1:-1, 1:-1])  # a view per rank, no message
u[0, :] = 1.0  # global indexing: each rank writes the part of row 0 it holds
stats = (float(u.mean()), float(np.std(u)), float(np.median(u)))  # collective reductions, numpy's values
ug, lg, ig = u.gather(0), lap.gather(0), inner.gather(0)

# --- SUMMA matmul and the FFT
p = hpctp.random.normal((400, 300), grid, (0, 1), seed=1)  # the same values on any grid (counter-based)
q = hpctp.random.normal((300, 200), grid, (0, 1), seed=2)
with CommCounter() as summa:
    pq = p @ q
waves = lambda i, j: np.sin(2 * np.pi * 3 * i / 64) + 0.3 * np.cos(2 * np.pi * 11 * j / 64)  # noqa: E731
f = hpctp.fromfunction(waves, (64, 64), grid, (0, 1))
with CommCounter() as fft:
    fh = hpctp.fft.rfftn(f)  # numpy.fft.rfftn of the global field, in f's layout
back = hpctp.fft.irfftn(fh, n=64)
spectrum = hpctp.fft.radial_spectrum(f)  # E(k) summed over shells of |k|: the same array on every rank
pg, qg, pqg, fg, fhg, bg = [t.gather(0) for t in (p, q, pq, f, fh, back)]

if grid.rank == 0:
    ref = np.fromfunction(lambda i, j: np.sin(i / 9) * np.cos(j / 7), (96, 80))
    lap1 = np.roll(ref, 1, 0) + np.roll(ref, -1, 0) + np.roll(ref, 1, 1) + np.roll(ref, -1, 1) - 4 * ref
    print(f"np.roll stencil equal to numpy's:        {np.array_equal(lg, lap1)}")
    print(f"np.tanh(u[1:-1, 1:-1]) equal to numpy's: {np.array_equal(ig, np.tanh(ref[1:-1, 1:-1]))}")
    ref[0, :] = 1.0
    want = (ref.mean(), ref.std(), np.median(ref))
    print(f"u[0, :] = 1 equal to numpy's:            {np.array_equal(ug, ref)}")
    print(f"mean, std, median: {stats[0]:.12f} {stats[1]:.12f} {stats[2]:.12f}")
    print(f"numpy:             {want[0]:.12f} {want[1]:.12f} {want[2]:.12f}")
    rel = lambda got, want: float(np.abs(got - want).max() / np.abs(want).max())  # noqa: E731
    print(f"p @ q (SUMMA): {summa.calls}, max rel. error vs numpy {rel(pqg, pg @ qg):.1e}")
    print(f"rfftn: {fft.calls}, max rel. error vs numpy {rel(fhg, np.fft.rfftn(fg)):.1e}")
    print(f"irfftn(rfftn(f)) max error {np.abs(bg - fg).max():.1e}")
    print(f"radial spectrum: the two strongest shells are |k| = {sorted(np.argsort(spectrum)[-2:].tolist())}")

    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(9, 3.2))
    for ax, (title, m) in zip(axes, maps.items()):
        ax.imshow(m, cmap="tab10", vmin=0, vmax=9)
        for (i, j), r in np.ndenumerate(m):
            ax.text(j, i, int(r), ha="center", va="center", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("which rank holds each element of a 10 x 7 tensor", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "layouts.png", dpi=110)
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.semilogy(np.arange(spectrum.size), np.maximum(spectrum, 1e-20), "o-", ms=3)
    ax.set_xlabel("|k|")
    ax.set_ylabel("E(k)")
    ax.set_title("hpctp.fft.radial_spectrum of f", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "spectrum.png", dpi=110)
rows.free()
grid.free()
