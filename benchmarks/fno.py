"""Distributed Fourier layer (FNO) stack vs single-process torch.fft: time, peak memory, bytes moved.

Usage::

    mpiexec -n 2 python benchmarks/fno.py                  # 1x16x1024x1024 float32 field, 16 modes
    mpiexec -n 2 python benchmarks/fno.py --size 256       # shrink

In one run: every rank runs forward+backward of ``layers`` x SpectralConv2d (GELU between
the layers) on its block of the field (1 torch thread per rank): truncated DFT matrices on
the block, a reduce-scatter of the kept spectrum into each rank's run of modes, the mix of that
run, an all-gather of the mixed runs, the inverse onto the block; then ``sync_gradients`` (which
has nothing to send: backward completes the Fourier weights' gradients with an all-gather of
their runs). Then rank 0 starts the single-process
reference, :func:`hpctp.nn.functional.spectral_conv_fft` (torch.fft) with the same weights,
in a *separate process* (``--threads`` torch threads, default = number of ranks) while the
other ranks sleep, so each process's peak RSS (``getrusage`` maxrss) is its own. The input
is an analytic function of the global index, so both compute the same loss (printed as a
sanity check). One extra, untimed iteration counts the bytes each rank sends
(:class:`hpctp.CommCounter`) in forward, backward and the gradient sync, next to the size
of the field: only the truncated spectrum travels, never the field.
"""

from __future__ import annotations

import argparse

import _layers as L
import torch


class _FFTLayer(torch.nn.Module):
    """The reference layer: ``spectral_conv_fft`` with SpectralConv2d's weight and initialisation."""

    def __init__(self, c: int, modes: int, seed: int, dtype: torch.dtype) -> None:
        from hpctp.nn.spectral import spectral_weight

        super().__init__()
        torch.manual_seed(seed)  # then the weight of SpectralConv2d(seed=seed)
        self.weight = torch.nn.Parameter(spectral_weight(c, c, (modes, modes), dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from hpctp.nn.functional import spectral_conv_fft

        return spectral_conv_fft(x, self.weight)


def reference(args: argparse.Namespace) -> None:
    """Single process (a singleton MPI, unused: the script starts through hpctp.cli.runner); one JSON line."""
    import hpctp.nn.functional  # noqa: F401  (imported before the baseline RSS, as in the ranks)

    def make(c: int, seed: int, dtype: torch.dtype) -> torch.nn.Module:
        return _FFTLayer(c, args.modes, seed, dtype)

    L.reference(args, make, torch.nn.GELU)


def _bytes(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def distributed(args: argparse.Namespace) -> None:
    import hpctp
    from hpctp.nn import SpectralConv2d, sync_gradients

    grid, x, base = L.setup_ranks(args)
    dtype = x.dtype

    def make(c: int, seed: int) -> torch.nn.Module:
        return SpectralConv2d(c, c, args.modes, grid=grid, split=(0, 1), seed=seed, dtype=dtype)

    model = L.stack(make, args.layers, args.channels, torch.nn.GELU)

    def sync() -> None:  # nothing to send: backward completed the Fourier weights' gradients
        sync_gradients(model, grid)

    grid.comm.Barrier()
    sec, cpu, loss = L.run(model, x, args.reps, sync)
    # one more, untimed iteration: the bytes this rank sends in each phase
    model.zero_grad(set_to_none=True)
    with hpctp.CommCounter() as c_fwd:
        y = model(x)
    out = y.square().sum()
    with hpctp.CommCounter() as c_bwd:
        out.backward()
    with hpctp.CommCounter() as c_sync:
        sync()
    del x, y, out
    table = L.gather_stats(
        grid, [sec, loss, L.peak_mb(), base, cpu, c_fwd.bytes_sent, c_bwd.bytes_sent, c_sync.bytes_sent]
    )
    threads = args.threads or grid.size
    argv = ["--size", str(args.size), "--channels", str(args.channels), "--modes", str(args.modes)]
    argv += ["--layers", str(args.layers), "--reps", str(args.reps), "--dtype", args.dtype]
    ref = L.reference_run(grid, __file__, threads, argv)
    if ref is None:  # not rank 0
        return
    c, m, s = args.channels, args.modes, args.size
    item = torch.empty((), dtype=dtype).element_size()
    size = c * s * s * item  # one activation, the whole field
    spectrum = c * 2 * m * m * 2 * item  # the kept spectrum of one layer (complex)
    weights = args.layers * c * c * 2 * m * m * 2 * item
    print(
        f"field 1x{c}x{s}x{s} {args.dtype}; {args.layers} x SpectralConv2d({c},{c},modes={m}), GELU between; "
        f"loss = sum(y^2); forward+backward, mean of {args.reps} after 1 warm-up"
    )
    L.report(
        table,
        ref,
        f"hpctp : {grid.size} ranks, grid {grid.dims}, 1 torch thread each (truncated DFT + the spectrum's modes split)",
        f"torch : 1 process, {threads} threads (separate process, spectral_conv_fft = torch.fft)",
    )
    fwd, bwd, syn = table[:, 5].max(), table[:, 6].max(), table[:, 7].max()
    print(
        f"bytes sent per rank (max)       : forward {_bytes(fwd)}, backward {_bytes(bwd)}, gradient sync {_bytes(syn)}"
    )
    print(
        f"  vs the field                  : forward / field = {fwd / size:.2e}  (field {_bytes(size)}; kept spectrum "
        f"{_bytes(spectrum)} x {args.layers} layers = {_bytes(spectrum * args.layers)}; weights {_bytes(weights)})"
    )
    if args.json:
        import plots

        layer = f"SpectralConv2d({c},{c}, modes={m})"
        results = L.results(
            args, table, ref, benchmark="fno", title="Fourier layers", reference="torch",
            caption=f"{args.layers} × {layer}, GELU between, forward+backward, 1×{c}×{s}×{s} {args.dtype}",
            measures=f"Forward+backward of {args.layers} × {layer} with GELU between on a 1×{c}×{s}×{s} "
            f"{args.dtype} field (mean of {args.reps} iterations after a warm-up), each process's peak resident set "
            f"and the bytes each rank sends, hpctp on {grid.size} ranks against `spectral_conv_fft` (torch.fft) with "
            f"the same weights in one separate process with {threads} threads, in the same run.",
        )  # fmt: skip
        sent = f"{_bytes(fwd)} forward + {_bytes(bwd)} backward + {_bytes(syn)} gradient sync"
        sent += f" (the field is {_bytes(size)})"
        rows = results["tables"][0]["rows"]
        results["tables"][0]["columns"].append("bytes sent per rank and iteration")
        for row, cell in zip(rows, [sent, "", ""]):
            row.append(cell)
        mib = [float(f"{b / 2**20:.3g}") or None for b in (fwd, bwd, size)]  # none sent: no bar on the log axis
        results["plots"].append(
            {"file": "fno_bytes.png", "kind": "barh", "title": "Bytes sent per rank and iteration, against the field",
             "xlabel": "MiB (log scale)", "ylabel": "", "x": ["forward", "backward", "the field (one activation)"],
             "series": {"MiB": mib}, "logy": True}
        )  # fmt: skip
        print(f"results written to {plots.dump(results, args.json)}")


if __name__ == "__main__":
    p = L.parser(__doc__, size=1024, layers=2, reps=3)
    p.add_argument("--modes", type=int, default=16, help="modes kept per axis (default 16)")
    L.start(p, reference, distributed)
