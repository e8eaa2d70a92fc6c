"""Measure this machine: message costs along each grid axis and the compute rates of a rank, as a machine profile.

:func:`calibrate` times, along every axis of the grid that holds more than one rank, an all-reduce, an
all-gather, a reduce-scatter, an all-to-all and a point-to-point exchange with the next rank, each at a
small and a large size (:data:`SIZES`), the slowest rank's time of :data:`REPEATS` calls after one
warm-up (:func:`hpctp.comm.slowest_seconds`); a least-squares fit of the formulas of
:func:`hpctp.perf.collective_time` over all axes gives each kind's ``alpha`` and ``beta`` (and each axis's
own fit is kept in the profile's ``calibration`` tables). Every rank then runs the block computations at
once (as they run in training, sharing the node): a GEMM, a 3x3 convolution, an FFT, attention at two head dims
(its products' flop/s and its softmax's scores/s), an elementwise product and a tiny operator for the host's time
per kernel; each rate is the slowest rank's. Last, the
share of a non-blocking all-gather that computation hides (:attr:`MachineProfile.overlap`): it posts one, computes
GEMMs for about twice its time, then waits.
The ranks of the grid are taken as one node (``ranks_per_node`` = the grid's size); on the CPU the cores they may
run on (the union of their affinities) are its ``cores_per_node``. About ten seconds.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable
from datetime import date
from typing import Any

import numpy as np
import torch

from .. import comm as C
from ..comm import ProcessGrid, check_grid
from .host import small_operators_seconds
from .machine import COMPUTE_KEYS, KINDS, ComputeRates, Link, MachineProfile
from .workload import fft_flops

__all__ = ["calibrate", "host_op_seconds", "SIZES", "REPEATS", "HOST_OPS", "ELEMENTWISE_NUMEL", "ATTENTION_HEAD_DIMS"]

SIZES = (256, 1 << 21)
"""Bytes per rank of the small and large messages (latency and bandwidth): larger sizes fit the bandwidth of big
gradient buckets better and take longer."""
REPEATS = 5
"""Timed calls per measurement (the mean of the slowest rank's): more is steadier and slower."""
OVERLAP_ROUNDS = 8
"""Rounds of the overlap's three measures, the fastest of each kept (:func:`_overlap`)."""


def _coefficients(kind: str, nbytes: float, q: int) -> tuple[float, float]:
    """The (alpha, beta) multipliers of :func:`hpctp.perf.collective_time`."""
    steps = math.ceil(math.log2(q))
    share = (q - 1) / q * nbytes
    if kind == "allreduce":
        return 2.0 * steps, 2.0 * share
    if kind in ("allgather", "reduce_scatter"):
        return float(steps), share
    if kind == "alltoall":
        return float(q - 1), share
    return 1.0, float(nbytes)


def _timed(comm: Any, fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: buffers, plans, the MPI library's own setup
    return sum(C.slowest_seconds(comm, fn) for _ in range(repeats)) / repeats


def _fastest_interleaved(comm: Any, fns: tuple[Callable[[], object], ...], rounds: int) -> list[float]:
    """The slowest rank's seconds of each of ``fns``, the fastest of ``rounds`` rounds that call each once in turn,
    after one warm-up round. Measures compared with one another are taken side by side: a stall (another process on
    the cores) then slows all of one round's, and the fastest round of each is a quiet one. Timed apart, a stall over
    one measure's calls read as overlap 0.95 and 1.0 in CI runs, where messages do not progress behind
    computation."""
    for fn in fns:
        fn()
    best = [math.inf] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], C.slowest_seconds(comm, fn))
    return best


def _measure(comm: Any, kind: str, nbytes: int, repeats: int, device: torch.device, dtype: torch.dtype) -> float:
    """Seconds of one ``kind`` message of ``nbytes`` per rank over ``comm``; the size the formula takes."""
    q, rank = comm.Get_size(), comm.Get_rank()
    item = torch.empty((), dtype=dtype).element_size()
    n = max(q, nbytes // item)
    n -= n % q
    buf = torch.ones(n, dtype=dtype, device=device)
    if kind == "allreduce":
        return _timed(comm, lambda: C.allreduce(comm, buf, "sum"), repeats)
    if kind == "allgather":
        whole = torch.empty(n * q, dtype=dtype, device=device)
        return _timed(comm, lambda: C.iallgatherv(comm, buf, whole, [n] * q).wait(), repeats)
    if kind == "reduce_scatter":
        out = torch.empty(n // q, dtype=dtype, device=device)
        return _timed(comm, lambda: C.ireduce_scatter(comm, buf, out, [n // q] * q).wait(), repeats)
    if kind == "alltoall":
        out = torch.empty_like(buf)
        return _timed(comm, lambda: C.alltoallv(comm, buf, [n // q] * q, out, [n // q] * q), repeats)
    recv = torch.empty_like(buf)

    def exchange() -> None:
        C.waitall([C.irecv(comm, recv, (rank - 1) % q, 0x4A7F), C.isend(comm, buf, (rank + 1) % q, 0x4A7F)])

    return _timed(comm, exchange, repeats)


def _size_of(kind: str, nbytes: int, q: int, item: int) -> float:
    """The size the formula takes for the buffers :func:`_measure` used."""
    n = max(q, nbytes // item)
    n -= n % q
    return float(n * q * item if kind == "allgather" else n * item)


def _fit(rows: list[tuple[float, float, float]]) -> Link:
    """Least squares (alpha, beta) >= 0 from (alpha coefficient, beta coefficient, seconds)."""
    a = np.array([[r[0], r[1]] for r in rows])
    t = np.array([r[2] for r in rows])
    sol, *_ = np.linalg.lstsq(a, t, rcond=None)
    alpha, beta = float(sol[0]), float(sol[1])
    if beta <= 0:  # bandwidth lost in noise: all latency
        beta = float(max(t.max() - a[:, 0].min() * 0, 0.0) / max(a[:, 1].max(), 1.0)) * 1e-3
    if alpha <= 0:
        alpha = float(np.min(t / np.maximum(a[:, 0], 1.0))) * 0.5
    return Link(max(alpha, 1e-9), max(beta, 1e-15))


def _rate(comm: Any, fn: Callable[[], object], work: float, repeats: int) -> float:
    """Work per second of ``fn`` run on every rank at once, on the slowest rank."""
    return work / max(_timed(comm, fn, repeats), 1e-12)


ELEMENTWISE_NUMEL = 1 << 20
"""Elements of the product that measures the memory bandwidth on a CPU: an activation's size (4 MiB in float32).
Elementwise operators allocate their output; at 16 MiB and more an allocator that returns large blocks to the
system (jemalloc) gives fresh pages every call, and the measure would be of page faults (4-6 GB/s here, against
17-25 GB/s at the model's sizes)."""
ELEMENTWISE_NUMEL_DEVICE = 1 << 26
"""The same on an accelerator, large enough that the launch is negligible."""


HOST_OPS = 2000
"""Small operators timed per measurement of the host's time per kernel: long enough (milliseconds) that ranks sharing
cores contend during it."""


def host_op_seconds(comm: Any, device: torch.device, dtype: torch.dtype, repeats: int = REPEATS) -> float:
    """Collective over ``comm`` (local for ``comm=None``). Seconds per small operator on the host
    (:func:`hpctp.perf.host.small_operators_seconds`), all ranks at once (the slowest rank's), or in this process
    alone: the machine's seconds per kernel, the unit of a traced model's host work."""

    def many() -> None:
        small_operators_seconds(HOST_OPS, device, dtype)

    many()
    if comm is None:
        return min(small_operators_seconds(HOST_OPS, device, dtype) for _ in range(repeats)) / HOST_OPS
    return sum(C.slowest_seconds(comm, many) for _ in range(repeats)) / repeats / HOST_OPS


ATTENTION_HEAD_DIMS = (8, 64)
"""Head dims at which attention is timed (same queries and keys): the difference gives the flop/s of its products,
the rest its softmax's scores/s (:class:`hpctp.perf.ComputeRates`)."""


def _attention(
    comm: Any, run: Callable[[Callable[[], object]], Callable[[], None]], device: torch.device, dtype: torch.dtype,
    repeats: int,
) -> tuple[float, float]:  # fmt: skip
    """Flop/s of attention's products and scores/s of its softmax, from forward passes at two head dims: seconds per
    score ``t(d) = s + 4 d / rate``."""
    b, h, n = 2, 4, 1024
    scores = float(b * h * n * n)
    per_score = []
    for d in ATTENTION_HEAD_DIMS:
        q = torch.randn(b, h, n, d, dtype=dtype, device=device)

        def attend(q: torch.Tensor = q) -> object:
            return torch.nn.functional.scaled_dot_product_attention(q, q, q)

        per_score.append(1.0 / _rate(comm, run(attend), scores, repeats))
    (d0, d1), (t0, t1) = ATTENTION_HEAD_DIMS, per_score
    inverse = (t1 - t0) / (4.0 * (d1 - d0))  # seconds per flop
    if inverse <= 0:  # (noise hid the products' share: all of it flops, at the larger head dim)
        return 4.0 * d1 / t1, math.inf
    s = t0 - 4.0 * d0 * inverse
    return 1.0 / inverse, (1.0 / s if s > 0 else math.inf)


def _compute(comm: Any, device: torch.device, dtype: torch.dtype, repeats: int) -> ComputeRates:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(fn: Callable[[], object]) -> Callable[[], None]:
        def go() -> None:
            fn()
            sync()

        return go

    n = 512  # a square GEMM, and a thin one (tall by 96, times 96 by 12: a truncated DFT's shape)
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    gemm = _rate(comm, run(lambda: a @ b), 2.0 * n**3, repeats)
    m, k, cols = 8192, 96, 12
    tall, thin = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, cols, dtype=dtype, device=device)
    small = _rate(comm, run(lambda: tall @ thin), 2.0 * m * k * cols, repeats)  # = gemm / (1 + half / cols)
    half = max(0.0, (gemm / small - 1.0) * cols)
    x = torch.randn(4, 32, 64, 64, dtype=dtype, device=device)
    w = torch.randn(32, 32, 3, 3, dtype=dtype, device=device)
    conv = _rate(comm, run(lambda: torch.nn.functional.conv2d(x, w, padding=1)), 2.0 * 4 * 32 * 32 * 9 * 64 * 64,
                 repeats)  # fmt: skip
    f = torch.randn(8, 32, 128, 128, dtype=torch.float32 if dtype == torch.bfloat16 else dtype, device=device)
    fft = _rate(comm, run(lambda: torch.fft.rfft2(f)), fft_flops(f.numel(), 128 * 128), repeats)
    attn, softmax = _attention(comm, run, device, dtype, repeats)
    n = ELEMENTWISE_NUMEL if device.type == "cpu" else ELEMENTWISE_NUMEL_DEVICE
    u, v = torch.rand(n, dtype=dtype, device=device), torch.rand(n, dtype=dtype, device=device)
    bandwidth = _rate(comm, run(lambda: u * v), 3.0 * n * u.element_size(), repeats)  # (reads two, writes one)
    kernel = host_op_seconds(comm, device, dtype, repeats)
    return ComputeRates(gemm, half, conv, fft, attn, bandwidth, kernel, softmax)


def _overlap(comm: Any, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """The share of a non-blocking all-gather's time that computation posted after it hides (see
    :attr:`MachineProfile.overlap`): ``(T_compute + T_message - T_both) / T_message`` within [0, 1], each the slowest
    rank's fastest of at least ``repeats`` rounds (:func:`_fastest_interleaved`), the computation GEMMs of about
    twice the message's time."""
    q = comm.Get_size()
    if q < 2:
        return 1.0
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    item = torch.empty((), dtype=dtype).element_size()
    n = SIZES[1] // item
    mine, whole = torch.ones(n, dtype=dtype, device=device), torch.empty(n * q, dtype=dtype, device=device)

    def message() -> None:
        C.iallgatherv(comm, mine, whole, [n] * q).wait()

    a = torch.randn(256, 256, dtype=dtype, device=device)
    t_message, t_gemm = _fastest_interleaved(comm, (message, lambda: (a @ a, sync())), max(repeats, 3))
    count = max(1, math.ceil(2.0 * t_message / max(t_gemm, 1e-9)))

    def compute() -> None:
        for _ in range(count):
            a @ a
        sync()

    def both() -> None:
        pending = C.iallgatherv(comm, mine, whole, [n] * q)
        compute()
        pending.wait()

    t_compute, t_message, t_both = _fastest_interleaved(comm, (compute, message, both), max(repeats, OVERLAP_ROUNDS))
    return min(1.0, max(0.0, (t_compute + t_message - t_both) / max(t_message, 1e-12)))


def calibrate(
    grid: ProcessGrid, *, dtype: str = "float32", device: str | None = None, repeats: int = REPEATS,
    name: str | None = None,
) -> MachineProfile:  # fmt: skip
    """Collective over grid. Measure message costs along ``grid``'s axes and a rank's compute rates.

    Parameters
    ----------
    grid : ProcessGrid
        Every axis holding more than one rank is measured (a one-rank grid measures compute only, and
        copies nothing into ``network``: the profile then has no message costs but latency-free zeros).
    dtype : str
        The element type of the compute rates (``"float32"``, ``"float64"``, ``"bfloat16"``).
    device : str, optional
        ``"cpu"`` or ``"cuda"`` (default: this rank's GPU if one was selected, else the CPU).
    repeats : int
        Timed calls per measurement.
    name : str, optional
        The profile's name (default: the host's name and the rank count).

    Returns
    -------
    MachineProfile
        The same on every rank (``source = "calibrated"``); write it with :meth:`MachineProfile.save`.

    Raises
    ------
    ValueError
        On an unknown dtype or a bad ``repeats`` (on every rank, before any message).
    """
    check_grid(grid)
    error: Exception | None = None
    tdtype = torch.float32
    try:
        if dtype not in ("float32", "float64", "bfloat16", "float16"):
            raise ValueError(f"calibrate: dtype must be float32, float64, bfloat16 or float16, got {dtype!r}")
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"calibrate: repeats must be a positive int, got {repeats!r}")
        tdtype = getattr(torch, dtype)
    except ValueError as e:
        error = e
    C.raise_if_any(grid.comm, error)
    gpu = C.current_device()
    dev = (
        torch.device(device)
        if device is not None
        else (torch.device("cuda", gpu) if gpu is not None else torch.device("cpu"))
    )
    item = torch.empty((), dtype=tdtype).element_size()
    rows: dict[str, list[tuple[float, float, float]]] = {k: [] for k in KINDS}
    per_axis: dict[str, dict[str, Link]] = {}
    t0 = time.perf_counter()
    for axis in range(grid.ndim):
        q = grid.dims[axis]
        if q < 2:
            continue
        comm = grid.sub(axis)
        mine: dict[str, list[tuple[float, float, float]]] = {}
        for kind in KINDS:
            for nbytes in SIZES:
                seconds = _measure(comm, kind, nbytes, repeats, dev, tdtype)
                a, b = _coefficients(kind, _size_of(kind, nbytes, q, item), q)
                rows[kind].append((a, b, seconds))
                mine.setdefault(kind, []).append((a, b, seconds))
        per_axis[f"axis{axis}"] = {k: _fit(v) for k, v in mine.items()}
    network = {"intra": {k: _fit(v) if v else Link(0.0, 0.0) for k, v in rows.items()}}
    rates = _compute(grid.comm, dev, tdtype, repeats)
    overlap = _overlap(grid.comm, dev, tdtype, repeats)
    memory = _memory_bytes(dev, grid.size)
    cores = _cores(grid.comm) if dev.type == "cpu" else 0
    text = name or f"{platform.node()}: {grid.size} ranks on {dev.type} (calibrated)"
    return MachineProfile(
        name=text, source="calibrated", ranks_per_node=grid.size, memory_bytes=memory, compute={dtype: rates},
        network=network, asynchronous=dev.type == "cuda", overlap=overlap, date=date.today().isoformat(),
        note=f"hpctp.perf.calibrate on a {'x'.join(map(str, grid.dims))} grid, {repeats} repeats, "
        f"{time.perf_counter() - t0:.1f} s; keys: {', '.join(COMPUTE_KEYS)}",
        calibration=per_axis, cores_per_node=cores,
    )  # fmt: skip


def _cores(comm: Any) -> int:
    """Collective over ``comm``. The CPU cores its ranks may run on (the union of their affinities; the ranks are
    taken as one node, as for ``ranks_per_node``)."""
    try:
        mine = sorted(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity outside Linux: every core)
        mine = list(range(os.cpu_count() or 1))
    length = int(C.allgather_ints(comm, [max(mine, default=0) + 1]).max())  # (one mask length on every rank)
    mask = np.zeros(length, dtype=np.int64)
    mask[mine] = 1
    return int(C.allgather_ints(comm, mask.tolist()).max(axis=0).sum())


def _memory_bytes(device: torch.device, ranks: int) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 // max(ranks, 1)
    except OSError:
        pass
    return 0
