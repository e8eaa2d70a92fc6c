"""Transformer block split over heads vs PyTorch DTensor, and ring attention vs one process, in one MPI run.

Usage::

    mpiexec -n 2 python benchmarks/attention.py                  # blocks 64x64 ... 1024x256, 64x64 patches
    mpiexec -n 2 python benchmarks/attention.py --blocks 64x64 256x128 --patches 32 --rounds 3

Every rank runs one torch thread; the single-process references run with as many threads as
there are ranks (``--threads``) while the ranks sleep. Each part prints a markdown table (rank
0): medians over ``--rounds`` interleaved rounds (one warm-up call each first; every sample is
timed by its slowest rank), the spread (min-max) beside them; a ratio is the ratio of the
medians, with the min-max of the per-round ratios. A sample of part (a) is the mean of
``--calls`` consecutive calls (a block of a millisecond timed alone measures mostly the switch
from the previous case: caches, and the ranks' wake-up after the single-process reference).

(a) Forward+backward (loss ``sum(y * g)``, the input's gradient included) of one pre-norm
    transformer block on ``[batch, tokens, embed]`` float32 (heads of ``--head-dim``, MLP
    ``--mlp-ratio`` x embed, GELU), with the same weights (the hpctp block's gathered state) in:

    1. hpctp: :class:`hpctp.nn.TransformerBlock` (heads and hidden features split over the
       ranks; one all-reduce forward and one backward per region, attention and MLP);
    2. no communication: the same shards and code with the collectives left out (the norms,
       ``self_attn.attend``, ``mlp.inner``, biases and residuals as the block runs them), the
       floor of the block's time on these ranks;
    3. PyTorch DTensor: ``parallelize_module`` of the block written in torch (q, k, v and
       ``linear1`` ``ColwiseParallel``, the out-projection and ``linear2`` ``RowwiseParallel``)
       on a gloo process group over the same ranks;
    4. torch, one process: ``torch.nn.TransformerEncoderLayer(norm_first=True)`` on rank 0.

    The outputs and input gradients of 1 and 3 are checked against 4 (same inputs, 1 thread).
    With ``--trace N``, case 1 also runs with the flight recorder on (``hpctp.debug.trace(N)``, as
    ``HPCTP_TRACE=N``: every MPI call entered with its label and call site) in the same
    interleaved rounds, and the table of its cost follows: traced / untraced.

(b) Exact attention of a 2-D field of ``--patches`` x ``--patches`` tokens (batch 1,
    ``--ring-heads`` heads of ``--ring-head-dim``, float32), forward and forward+backward:
    hpctp's ring (``hpctp.nn.functional.attention(q, k, v, schedule="ring")``, tokens split over
    the ranks' 2-D grid) vs ``scaled_dot_product_attention`` of the flattened tokens in one
    process, with the kernel torch picks (on CPU its flash kernel: O(tokens) memory) and, unless
    ``--no-math``, with the math backend (the whole score matrix). Each reference is a child
    process of rank 0 driven over a pipe, so its rounds interleave with the ranks'.

    Memory: each process's peak resident set size (``getrusage`` maxrss) over its RSS once its
    inputs were built, i.e. what forward+backward allocates (outputs, saved tensors, gradients,
    message buffers, score tiles) as the OS sees it. Before that baseline every process runs its
    forward+backward once on a field of 4 x 4 patches per process, so the code pages the kernels
    touch the first time (several MB of libtorch, the same in every process) and one-time set-up
    are not counted as the problem's memory. Part (b) runs first, so nothing earlier
    raised the ranks' peaks; each child does nothing else. glibc's malloc may keep freed large
    blocks in its heap (its mmap threshold grows with the blocks freed), which raises a peak
    over the live bytes: ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment fixes the
    threshold, and the header prints its value.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _layers import peak_mb, rss_mb
from _timing import single_process
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.nn.attention import SDPBackend, sdpa_kernel

import hpctp
from hpctp.cli.runner import run_main
from hpctp.nn import TransformerBlock
from hpctp.nn.distributed.state_dict import global_state_dict
from hpctp.nn.functional import attention
from hpctp.tensor.random import block_normal

_MPI_ENV = ("PMI", "HYDRA", "MPI", "OMPI", "PMIX", "I_MPI")
Times = dict[str, list[float]]


# ---------------------------------------------------------------------------------------------- timing
def _rounds(cases: dict[str, Callable[[], float]], rounds: int, comm: Any) -> Times:
    """Collective over comm. ``rounds`` interleaved rounds of every case after one warm-up call each.

    A case returns this rank's seconds (0 on ranks that sleep through a single-process case);
    each call is recorded as its slowest rank's.
    """
    for fn in cases.values():
        fn()
    out: Times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            comm.Barrier()
            sec = np.array([fn()])
            hpctp.comm.allreduce(comm, sec, "max")
            out[name].append(float(sec[0]))
    return out


def _clock(fn: Callable[[], object], calls: int = 1) -> Callable[[], float]:
    """Local. A case: the mean seconds of ``calls`` consecutive calls of ``fn`` on this rank."""

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls

    return run


def _cell(t: list[float]) -> str:
    return f"{statistics.median(t) * 1e3:.2f} ms ({min(t) * 1e3:.2f}-{max(t) * 1e3:.2f})"


def _ratio(a: list[float], b: list[float]) -> str:
    per_round = [x / y for x, y in zip(a, b)]
    return f"{statistics.median(a) / statistics.median(b):.2f} ({min(per_round):.2f}-{max(per_round):.2f})"


def _rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach() - want.detach()).abs().max() / want.detach().abs().max())


def _grad(t: torch.Tensor) -> torch.Tensor:
    if t.grad is None:
        raise RuntimeError("backward left no gradient to check")
    return t.grad


def _max_over(comm: Any, values: list[float]) -> list[float]:
    arr = np.array(values, dtype=np.float64)
    hpctp.comm.allreduce(comm, arr, "max")
    return [float(v) for v in arr]


# ---------------------------------------------------------------------------------------------- (b) ring
def _normal(shape: tuple[int, ...], ranges: Sequence[tuple[int, int]], seed: int, grad: bool) -> torch.Tensor:
    """Local. The box ``ranges`` of a global normal tensor (float32, grid-independent values)."""
    t = torch.from_numpy(block_normal(shape, ranges, seed)).to(torch.float32)
    return t.requires_grad_(grad)


def _ring_shape(args: argparse.Namespace) -> tuple[int, ...]:
    return (1, args.ring_heads, args.patches, args.patches, args.ring_head_dim)


def _warm_up(
    run: Callable[[tuple[torch.Tensor, ...]], torch.Tensor], args: argparse.Namespace, dims: tuple[int, ...]
) -> None:
    """Local. One forward+backward of ``run`` on a field of 4 x 4 patches per process (``dims``: the grid), so that
    the code pages of the kernels and one-time set-up (thread pools, message paths) are resident before the memory
    baseline: the peak over the baseline then counts what the problem allocates, in every process alike."""
    shape = (1, args.ring_heads, 4 * dims[0], 4 * dims[1], args.ring_head_dim)
    ranges = [(0, n) for n in shape]
    tensors = tuple(_normal(shape, ranges, seed, True) for seed in (1, 2, 3))
    run(tensors).sum().backward()


def _reference(args: argparse.Namespace) -> None:
    """The single-process SDPA reference (a child of rank 0, no MPI): answers commands on stdin, one JSON line each.

    ``forward`` / ``backward``: one timed forward (no grad) / forward+backward, and the kernel
    torch ran (its autograd node); ``peak``: the peak RSS and the RSS once the inputs were built, MB.
    """
    torch.set_num_threads(args.threads)
    with sdpa_kernel(SDPBackend.MATH) if args.backend == "math" else contextlib.nullcontext():
        _warm_up(
            lambda t: F.scaled_dot_product_attention(t[0].flatten(2, 3), t[1].flatten(2, 3), t[2].flatten(2, 3)),
            args,
            (1, 1),
        )
    shape = _ring_shape(args)
    whole = [(0, n) for n in shape]
    q, k, v = (_normal(shape, whole, seed, True).flatten(2, 3) for seed in (1, 2, 3))
    g = _normal(shape, whole, 4, False).flatten(2, 3)
    base = rss_mb()
    print(json.dumps({"base_mb": base}), flush=True)
    while line := sys.stdin.readline():
        cmd = line.strip()
        if cmd == "peak":
            print(json.dumps({"peak_mb": peak_mb(), "base_mb": base}), flush=True)
            continue
        q.grad = k.grad = v.grad = None
        with sdpa_kernel(SDPBackend.MATH) if args.backend == "math" else contextlib.nullcontext():
            t0 = time.perf_counter()
            if cmd == "forward":
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v)
                kernel = ""
            else:
                y = F.scaled_dot_product_attention(q, k, v)
                (y * g).sum().backward()
                kernel = type(y.grad_fn).__name__
                del y
            sec = time.perf_counter() - t0
        print(json.dumps({"sec": sec, "kernel": kernel}), flush=True)


class _Child:
    """Local (rank 0). A reference process of part (b) (SDPA ``backend``: "default" or "math"), ``threads`` threads."""

    def __init__(self, args: argparse.Namespace, threads: int, backend: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_MPI_ENV)}
        env["OMP_NUM_THREADS"] = str(threads)
        argv = ["--reference", "--threads", str(threads), "--patches", str(args.patches), "--backend", backend]
        argv += ["--ring-heads", str(args.ring_heads), "--ring-head-dim", str(args.ring_head_dim)]
        cmd = [sys.executable, os.path.abspath(__file__), *argv]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._read()
        self.kernel = ""

    def _read(self) -> dict[str, Any]:
        out: IO[str] | None = self.proc.stdout
        line = out.readline() if out is not None else ""
        if not line:
            raise RuntimeError(f"the reference process ended (exit status {self.proc.wait()}); see its stderr")
        return dict(json.loads(line))

    def ask(self, cmd: str) -> dict[str, Any]:
        if self.proc.stdin is None:
            raise RuntimeError("the reference process has no stdin")
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        out = self._read()
        self.kernel = out.get("kernel") or self.kernel
        return out

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _ring_part(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    """Collective over the world. Part (b): times, peak memory, check."""
    grid = hpctp.ProcessGrid(tuple(args.grid) if args.grid else (0, 0))
    shape = _ring_shape(args)
    layout = hpctp.Layout(shape, grid.dims, (None, None, 0, 1, None))
    ranges = layout.local_ranges(grid.coords)

    def small_ring(t: tuple[torch.Tensor, ...]) -> torch.Tensor:
        small = hpctp.Layout(t[0].shape, grid.dims, (None, None, 0, 1, None))
        box = small.local_slices(grid.coords)
        dist = (hpctp.DistTensor(x.detach()[box].requires_grad_(), grid, small) for x in t)
        return attention(*dist, schedule="ring").local

    _warm_up(small_ring, args, grid.dims)
    q, k, v = (_normal(shape, ranges, seed, True) for seed in (1, 2, 3))
    g = _normal(shape, ranges, 4, False)
    base = rss_mb()
    Q, K, V = (hpctp.DistTensor(t, grid, layout) for t in (q, k, v))

    def forward() -> None:
        with torch.no_grad():
            attention(Q, K, V, schedule="ring")

    def backward() -> torch.Tensor:
        q.grad = k.grad = v.grad = None
        y = attention(Q, K, V, schedule="ring").local
        (y * g).sum().backward()
        return y

    backends = ["default"] + ([] if args.no_math else ["math"])
    started = single_process(grid, lambda: ({b: _Child(args, threads, b) for b in backends}, 0.0))
    children = {} if started is None else started[0]

    def one_process(backend: str, cmd: str) -> Callable[[], float]:
        def run() -> float:
            out = single_process(grid, lambda: (children[backend].ask(cmd)["sec"], 0.0))
            return 0.0 if out is None else float(out[0])

        return run

    cases = {}
    for key in ("forward", "backward"):
        cases[f"ring {key}"] = _clock(forward if key == "forward" else backward)
        cases |= {f"{b} {key}": one_process(b, key) for b in backends}
    times = _rounds(cases, args.rounds, grid.comm)
    mine = np.array([base, peak_mb()])
    table = np.empty((grid.size, 2))
    grid.comm.Allgather(mine, table)
    asked = single_process(grid, lambda: ({b: c.ask("peak") | {"kernel": c.kernel} for b, c in children.items()}, 0.0))
    # the forward's floor, after the memory was read (it holds all K/V): torch's flash kernel on this rank's
    # queries against all the keys, both ranks at once, no ring, no merge
    whole = [(0, n) for n in shape]
    kf, vf = (_normal(shape, whole, seed, False).flatten(2, 3) for seed in (2, 3))
    qf = q.detach().flatten(2, 3)

    def floor() -> None:
        with torch.no_grad():
            F.scaled_dot_product_attention(qf, kf, vf)

    floor_cases = {"floor forward": _clock(floor), "default forward": one_process("default", "forward")}
    times |= {f"{k} (floor rounds)": v for k, v in _rounds(floor_cases, args.rounds, grid.comm).items()}
    for child in children.values():
        child.close()
    # check against SDPA of the gathered tensors on every rank (1 thread, untimed)
    y = backward().detach()
    qa, ka, va = (_normal(shape, whole, seed, True) for seed in (1, 2, 3))
    ya = F.scaled_dot_product_attention(qa.flatten(2, 3), ka.flatten(2, 3), va.flatten(2, 3)).unflatten(2, shape[2:4])
    (ya * _normal(shape, whole, 4, False)).sum().backward()
    box = layout.local_slices(grid.coords)
    diffs = [_rel_diff(y, ya[box])]
    diffs += [_rel_diff(_grad(t), _grad(a)[box]) for t, a in ((q, qa), (k, ka), (v, va))]
    out = {"times": times, "memory": table, "ref_memory": None if asked is None else asked[0]}
    out |= {"diffs": _max_over(grid.comm, diffs), "dims": grid.dims, "backends": backends}
    grid.free()
    return out


# ---------------------------------------------------------------------------------------------- (a) block
class _TorchBlock(torch.nn.Module):
    """The pre-norm block in plain torch with q, k, v as separate linears, for ``parallelize_module``.

    The heads a rank holds follow from the width of its q shard (``ColwiseParallel`` cuts whole
    heads when the ranks divide the heads).
    """

    def __init__(self, embed: int, head_dim: int, hidden: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.norm1, self.norm2 = torch.nn.LayerNorm(embed), torch.nn.LayerNorm(embed)
        self.q, self.k, self.v, self.out = (torch.nn.Linear(embed, embed) for _ in range(4))
        self.linear1, self.linear2 = torch.nn.Linear(embed, hidden), torch.nn.Linear(hidden, embed)

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """``torch.nn.TransformerEncoderLayer``'s state (q, k, v stacked in ``in_proj``)."""
        e = self.q.weight.shape[0]
        named = {"out": "self_attn.out_proj", "norm1": "norm1", "norm2": "norm2"}
        named |= {"linear1": "linear1", "linear2": "linear2"}
        with torch.no_grad():
            for i, lin in enumerate((self.q, self.k, self.v)):
                lin.weight.copy_(state["self_attn.in_proj_weight"][i * e : (i + 1) * e])
                lin.bias.copy_(state["self_attn.in_proj_bias"][i * e : (i + 1) * e])
            for ours, theirs in named.items():
                mod = getattr(self, ours)
                mod.weight.copy_(state[f"{theirs}.weight"])
                mod.bias.copy_(state[f"{theirs}.bias"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = (lin(h).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for lin in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        x = x + self.out(o)
        return x + self.linear2(F.gelu(self.linear1(self.norm2(x))))


def _skip(comm: Any, x: Any, op: str = "sum") -> Any:
    return x


def _barrier(comm: Any, x: Any, op: str = "sum") -> Any:
    comm.Barrier()
    return x


#: Stand-ins for the block's all-reduces (``hpctp.comm.allreduce``, which its region borders call), to split
#: the block's time over no communication into the Python of the borders and checks (a no-op), the ranks
#: waiting for each other at the four synchronisation points (a barrier), and MPI's all-reduce (the rest).
_STAND_INS = {"no-op all-reduces": _skip, "barriers": _barrier}


def _with_allreduce(stand_in: Callable[..., Any], fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        real = hpctp.comm.allreduce
        hpctp.comm.allreduce = stand_in  # type: ignore[assignment]
        try:
            return fn()
        finally:
            hpctp.comm.allreduce = real  # type: ignore[assignment]

    return run


def _traced(entries: int, case: Callable[[], float]) -> Callable[[], float]:
    """Local. ``case`` with the flight recorder on (``entries`` in its ring), off again after."""

    def run() -> float:
        hpctp.debug.trace(entries)
        try:
            return case()
        finally:
            hpctp.debug.trace(0)

    return run


def _no_communication(block: TransformerBlock, x: torch.Tensor) -> torch.Tensor:
    """Local. The block's arithmetic on this rank's shards, its four collectives left out (not the block's result)."""
    attn, mlp = block.self_attn, block.mlp
    h = block.norm1(x)
    a = attn.attend(h, h, h)
    x = x + (a + attn.out_proj.bias if attn.out_proj.bias is not None else a)
    m = mlp.inner(block.norm2(x))
    return x + (m + mlp.linear2.bias if mlp.linear2.bias is not None else m)


def _dtensor_mesh(world: Any) -> Any:
    """Collective over world. A gloo process group over the same ranks (port agreed by rank 0) and its device mesh."""
    port = np.zeros(1, dtype=np.int64)
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    world.Bcast(port, root=0)
    url = f"tcp://127.0.0.1:{int(port[0])}"
    dist.init_process_group("gloo", init_method=url, rank=world.Get_rank(), world_size=world.Get_size())
    return init_device_mesh("cpu", (world.Get_size(),))


def _block_case(
    args: argparse.Namespace, grid: hpctp.ProcessGrid, mesh: Any, embed: int, tokens: int, threads: int
) -> dict[str, Any]:
    """Collective over grid. Part (a) for one size: times and checks."""
    heads, hidden = embed // args.head_dim, int(args.mlp_ratio * embed)
    block = TransformerBlock(embed, heads, args.mlp_ratio, grid, seed=7)
    state = global_state_dict(block)
    one = torch.nn.TransformerEncoderLayer(
        embed, heads, hidden, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
    )
    one.load_state_dict(state)
    tp = _TorchBlock(embed, args.head_dim, hidden)
    tp.load(state)
    plan: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in ("q", "k", "v", "linear1")}
    plan |= {name: RowwiseParallel() for name in ("out", "linear2")}
    sharded = parallelize_module(tp, mesh, plan)
    gen = torch.Generator().manual_seed(embed * 1000 + tokens)
    x = torch.randn(args.batch, tokens, embed, generator=gen).requires_grad_()
    g = torch.randn(args.batch, tokens, embed, generator=gen)

    def step(module: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            module.zero_grad(set_to_none=True)
            x.grad = None
            y = fn(x)
            (y * g).sum().backward()
            return y

        return run

    hp = step(block, block)
    local = step(block, lambda t: _no_communication(block, t))
    dt = step(sharded, sharded)
    ref = step(one, one)

    def one_process() -> float:
        def run() -> tuple[None, float]:
            torch.set_num_threads(threads)
            sec = _clock(ref, args.calls)()
            torch.set_num_threads(1)
            return None, sec

        out = single_process(grid, run)
        return 0.0 if out is None else out[1]

    n = args.calls
    cases = {"hpctp": _clock(hp, n), "no comm": _clock(local, n), "dtensor": _clock(dt, n), "torch": one_process}
    for name, stand_in in _STAND_INS.items():  # where the gap to "no comm" goes (results not checked: wrong sums)
        cases[name] = _clock(_with_allreduce(stand_in, hp), n)
    if args.trace:  # the flight recorder's cost, interleaved with the untraced block
        cases["traced"] = _traced(args.trace, _clock(hp, n))
    times = _rounds(cases, args.rounds, grid.comm)
    # checks (1 thread): outputs and input gradients against the single-process layer
    y_ref = ref().detach()
    gx_ref = _grad(x).clone()
    diffs = []
    for run in (hp, dt):
        y = run()
        diffs += [_rel_diff(y, y_ref), _rel_diff(_grad(x), gx_ref)]
    return {"embed": embed, "tokens": tokens, "heads": heads, "times": times, "diffs": _max_over(grid.comm, diffs)}


# ---------------------------------------------------------------------------------------------- report
def _print_blocks(rows: list[dict[str, Any]], args: argparse.Namespace, size: int, threads: int) -> None:
    print(
        f"(a) transformer block, forward+backward, batch {args.batch}, head dim {args.head_dim}, MLP "
        f"{args.mlp_ratio:g} x embed, GELU, float32; medians of {args.rounds} interleaved rounds (min-max) of "
        f"the mean of {args.calls} calls"
    )
    print(
        f"| embed | tokens | heads | hpctp heads split, {size} x 1 | no communication, {size} x 1 | "
        f"DTensor (gloo), {size} x 1 | torch, 1 x {threads} | hpctp / no comm | hpctp / DTensor | hpctp / torch |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        t = r["times"]
        print(
            f"| {r['embed']} | {r['tokens']} | {r['heads']} | {_cell(t['hpctp'])} | {_cell(t['no comm'])} | "
            f"{_cell(t['dtensor'])} | {_cell(t['torch'])} | {_ratio(t['hpctp'], t['no comm'])} | "
            f"{_ratio(t['hpctp'], t['dtensor'])} | {_ratio(t['hpctp'], t['torch'])} |"
        )
    print()
    print(
        "where the gap to no communication goes (the block's all-reduces replaced; "
        "results not checked): time / no communication"
    )
    print(
        "| embed | tokens | all-reduces as no-ops (Python only) | as barriers (+ waiting) | MPI all-reduces (hpctp) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        t = r["times"]
        cells = " | ".join(_ratio(t[k], t["no comm"]) for k in (*_STAND_INS, "hpctp"))
        print(f"| {r['embed']} | {r['tokens']} | {cells} |")
    if args.trace:
        print()
        print(f"flight recorder on (HPCTP_TRACE={args.trace}: every MPI call entered, labelled, its call site found)")
        print("| embed | tokens | hpctp | hpctp traced | traced / untraced |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            t = r["times"]
            print(
                f"| {r['embed']} | {r['tokens']} | {_cell(t['hpctp'])} | {_cell(t['traced'])} | "
                f"{_ratio(t['traced'], t['hpctp'])} |"
            )
    for r in rows:
        d = r["diffs"]
        print(
            f"block check embed {r['embed']} tokens {r['tokens']}: max rel diff vs torch: hpctp output {d[0]:.1e} "
            f"input grad {d[1]:.1e}; DTensor output {d[2]:.1e} input grad {d[3]:.1e}"
        )


def _print_ring(ring: dict[str, Any], args: argparse.Namespace, size: int, threads: int) -> None:
    t, mem, refs, backends = ring["times"], ring["memory"], ring["ref_memory"], ring["backends"]
    n = args.patches
    dims = "x".join(str(d) for d in ring["dims"])
    kernel = refs["default"]["kernel"].removeprefix("ScaledDotProduct").removesuffix("Backward0")
    names = {"default": f"SDPA ({kernel or 'torch default'})", "math": "SDPA, math backend"}
    print(
        f"(b) attention over a {n}x{n} patch field ({n * n} tokens), batch 1, {args.ring_heads} heads x "
        f"{args.ring_head_dim}, float32; ring on a {dims} grid ({size} x 1 thread) vs SDPA in one process "
        f"(1 x {threads}); medians of {args.rounds} interleaved rounds (min-max)"
    )
    head = "".join(f" {names[b]}, 1 x {threads} | ring / {'SDPA' if b == 'default' else b} |" for b in backends)
    print(f"| pass | hpctp ring, {size} x 1 |{head}")
    print("| --- | ---: |" + " ---: | ---: |" * len(backends))
    for name, key in (("forward", "forward"), ("forward+backward", "backward")):
        a = t[f"ring {key}"]
        cells = "".join(f" {_cell(t[f'{b} {key}'])} | {_ratio(a, t[f'{b} {key}'])} |" for b in backends)
        print(f"| {name} | {_cell(a)} |{cells}")
    fl, ref = t["floor forward (floor rounds)"], t["default forward (floor rounds)"]
    print(
        f"forward's floor (the flash kernel on each rank's queries against all keys, no ring; {args.rounds} more "
        f"interleaved rounds): {_cell(fl)} vs SDPA {_cell(ref)}, ratio {_ratio(fl, ref)}"
    )
    print()
    print("| process | RSS with inputs [MB] | peak RSS [MB] | peak - inputs [MB] |")
    print("| --- | ---: | ---: | ---: |")
    for r in range(mem.shape[0]):
        print(f"| rank {r} | {mem[r, 0]:.1f} | {mem[r, 1]:.1f} | {mem[r, 1] - mem[r, 0]:.1f} |")
    inc = float((mem[:, 1] - mem[:, 0]).max())
    for b in backends:
        ref = refs[b]
        one = ref["peak_mb"] - ref["base_mb"]
        print(f"| one process, {names[b]} | {ref['base_mb']:.1f} | {ref['peak_mb']:.1f} | {one:.1f} |")
    for b in backends:
        ref = refs[b]
        print(
            f"ring memory per rank / one process ({b}): peak - inputs {inc / (ref['peak_mb'] - ref['base_mb']):.2f}, "
            f"peak RSS {float(mem[:, 1].max()) / ref['peak_mb']:.2f}"
        )
    d = ring["diffs"]
    print(
        f"ring check: max rel diff vs SDPA (max over ranks): output {d[0]:.1e}, grad q {d[1]:.1e}, k {d[2]:.1e}, v {d[3]:.1e}"
    )


# ---------------------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--blocks", nargs="+", default=["64x64", "256x128", "1024x256"], metavar="EMBEDxTOKENS",
                   help="transformer block sizes (default 64x64 256x128 1024x256)")  # fmt: skip
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=32, help="block heads = embed / head dim (default 32)")
    p.add_argument("--mlp-ratio", type=float, default=4.0)
    p.add_argument("--patches", type=int, default=64, help="edge of the patch field of part (b) (default 64)")
    p.add_argument("--ring-heads", type=int, default=4)
    p.add_argument("--ring-head-dim", type=int, default=32)
    p.add_argument("--grid", type=int, nargs=2, default=None, help="grid of part (b) (default: MPI's 2-D choice)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--calls", type=int, default=10, help="part (a): consecutive calls per timed sample (their mean; default 10)"
    )
    p.add_argument("--threads", type=int, default=0, help="threads of the single-process runs (default: #ranks)")
    p.add_argument("--trace", type=int, default=0, metavar="N",
                   help="part (a): also time the block with the flight recorder on (N ring entries), interleaved")  # fmt: skip
    p.add_argument("--no-math", action="store_true", help="skip the reference on SDPA's math backend")
    p.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="default", help=argparse.SUPPRESS)
    return p


def _sizes(args: argparse.Namespace, size: int) -> list[tuple[int, int]]:
    """Local. The block sizes, checked (every rank sees the same arguments, so all raise alike)."""
    out = []
    for spec in args.blocks:
        try:
            embed, tokens = (int(v) for v in spec.lower().split("x"))
        except ValueError:
            raise ValueError(f"--blocks takes EMBEDxTOKENS, e.g. 64x64, got {spec!r}") from None
        heads = embed // args.head_dim
        if embed % args.head_dim or heads % size or int(args.mlp_ratio * embed) % size or tokens < 1:
            raise ValueError(
                f"block {spec}: embed must be a multiple of --head-dim {args.head_dim} with the heads ({heads}) "
                f"and the MLP's hidden features divisible by the {size} ranks (DTensor cuts evenly), tokens >= 1"
            )
        out.append((embed, tokens))
    if args.calls < 1:
        raise ValueError(f"--calls must be >= 1, got {args.calls}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if args.trace < 0:
        raise ValueError(f"--trace must be >= 0 (ring entries; 0: off), got {args.trace}")
    return out


def main() -> int:
    args = _parser().parse_args()
    if args.reference:
        _reference(args)
        return 0
    torch.set_num_threads(1)
    world = hpctp.ProcessGrid([0])
    size = world.size
    threads = args.threads or size
    sizes = _sizes(args, size)
    ring = _ring_part(args, threads)  # first: its peak memory is the first since the imports
    mesh = _dtensor_mesh(world.comm)
    rows = [_block_case(args, world, mesh, e, t, threads) for e, t in sizes]
    if world.rank == 0:
        malloc = os.environ.get("MALLOC_MMAP_THRESHOLD_", "unset")
        print(
            f"hpctp {hpctp.__version__}, torch {torch.__version__}, {size} ranks x 1 torch thread; "
            f"MALLOC_MMAP_THRESHOLD_={malloc}"
        )
        print()
        _print_blocks(rows, args, size, threads)
        print()
        _print_ring(ring, args, size, threads)
        print(
            f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (other processes skew times)"
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main)
