"""Peak memory as a user sees it: this process's resident set at its peak (the kernel's high-water mark), and the
GPU allocator's peak.

Accounting (summing tensor sizes) misses what a process really holds: temporaries inside a step,
buffers the allocator keeps after they are freed, pages of libraries. :class:`PeakMemory` measures
instead: the kernel's own high-water mark of the resident set (``VmHWM``, reset on entry through
``/proc/self/clear_refs``), which no peak escapes. Only where the kernel does not let a process reset it
does a thread sample the resident set size (``/proc/self/statm``) every ``interval`` seconds: a thread
that wakes at 1-2 kHz takes the GIL whenever the main thread waits in MPI, and on ranks that share
cores it cost the steps it measured up to 1.6x. On a
GPU, ``torch.cuda.max_memory_allocated`` (reset on entry) is the figure. With ``tensors=True`` it
also counts allocation statistics independent of the C allocator: the peak of live CPU tensor bytes
from torch.profiler's memory events (what the allocator was asked for, without what it keeps
after frees; the CPU's ``max_memory_allocated``). No MPI; Linux's ``/proc`` (elsewhere only the
CUDA and tensor figures).
"""

from __future__ import annotations

import ctypes.util
import os
import re
import sys
import threading
import time
from typing import Any

__all__ = ["PeakMemory", "map_large_blocks", "resident_bytes", "trim_heap"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def jemalloc_library() -> str | None:
    """Local. The path of jemalloc's shared library if it is installed (Debian: ``libjemalloc2``), for ``LD_PRELOAD``
    of a child process whose resident set should follow what it allocates (glibc keeps freed heap chunks)."""
    for candidate in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"):
        if os.path.exists(candidate):
            return candidate
    found = ctypes.util.find_library("jemalloc")
    return found if found and os.path.isabs(found) else None


def _glibc() -> Any:
    """glibc's library where it is the process's ``malloc`` (not under jemalloc or tcmalloc), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        process = ctypes.CDLL(None)
    except OSError:
        return None
    if ctypes.cast(process.malloc, ctypes.c_void_p).value != ctypes.cast(libc.malloc, ctypes.c_void_p).value:
        return None
    return libc


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def map_large_blocks(threshold: int) -> bool:
    """Local. Make glibc's ``malloc`` map blocks of ``threshold`` bytes or more on their own and unmap them when freed.

    glibc raises its mapping threshold each time a mapped block is freed (up to 32 MiB), after which
    blocks of that size come from its heaps, and freed ones stay resident there among long-lived
    small ones. A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, as ``MALLOC_MMAP_THRESHOLD_`` in
    the environment) returns them at once, at the cost of page faults when they are touched again.
    Process-wide. Nothing is changed (False) when the process's ``malloc`` is not glibc's (jemalloc
    or tcmalloc through ``LD_PRELOAD``), when ``MALLOC_MMAP_THRESHOLD_`` is set (the user's choice),
    or off Linux; True when the threshold was set.
    """
    libc = _glibc()
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold))) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * int(threshold))
    )


def trim_heap() -> bool:
    """Local. Return the free memory of glibc's heaps to the system (``malloc_trim(0)``): before a baseline of the
    resident set is taken, so that memory freed earlier but still resident is not reused unseen by what is
    measured after it. False where ``malloc`` is not glibc's."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def resident_bytes() -> int:
    """Local. This process's resident set size now (bytes; 0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def _high_water() -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"VmHWM:\s+(\d+) kB", f.read())
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


def _reset_high_water() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_open: list[PeakMemory] = []
"""The blocks open in this process, outermost first: a block's entry folds the kernel's mark into these before it
resets it."""


class PeakMemory:
    """Local. Context manager measuring this process's peak memory inside its block.

    Parameters
    ----------
    interval : float
        Seconds between two samples of the resident set (default 0.5 ms), where a thread samples it: only where
        the kernel's high-water mark cannot be reset.
    baseline : int, optional
        Bytes to subtract (e.g. the runtime's own, measured after a warm-up with a tiny model);
        default: the resident set on entry.
    tensors : bool
        Also record torch.profiler's memory events (slows the block down; for measurements).

    Attributes
    ----------
    baseline : int
    sampled : int
        The largest resident set sampled (bytes): on entry and exit, by the thread where one samples, and the
        kernel's mark where a nested block reset it.
    kernel : int or None
        The kernel's high-water mark over the block (bytes), where it can be reset (a nested block's entry resets
        it again: the mark before that counts in ``sampled``).
    peak : int
        ``max(sampled, kernel)`` minus ``baseline``: what the block added at its peak.
    cuda : int
        ``torch.cuda.max_memory_allocated()`` over the block (0 without CUDA).
    tensors : int
        With ``tensors=True``: the peak of live CPU tensor bytes allocated inside the block, above
        those alive on entry (0 otherwise).
    samples : int
        Samples the thread took (the sampling rate is ``samples / seconds``; 0 where the kernel's mark serves).
    seconds : float

    Examples
    --------
    >>> import torch
    >>> with PeakMemory(tensors=True) as m:
    ...     x = torch.ones(2**22, dtype=torch.float64)  # 32 MiB
    ...     del x
    >>> m.tensors / 2**20  # m.peak: the resident set's rise (allocator and page cache included)
    32.0
    """

    def __init__(self, interval: float = 5e-4, baseline: int | None = None, *, tensors: bool = False) -> None:
        self.interval = float(interval)
        self._fixed = baseline
        self._track = bool(tensors)
        self._profile: Any = None
        self.baseline = self.sampled = self.peak = self.cuda = self.samples = self.tensors = 0
        self.kernel: int | None = None
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hwm = False

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.sampled = max(self.sampled, resident_bytes())
            self.samples += 1
            time.sleep(self.interval)

    def __enter__(self) -> PeakMemory:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        now = resident_bytes()
        self.baseline = now if self._fixed is None else int(self._fixed)
        self.sampled, self.samples = now, 0
        mark = _high_water()  # (the enclosing blocks' peak so far, which the reset erases)
        for outer in _open:
            outer.sampled = max(outer.sampled, mark or 0)
        self._hwm = _reset_high_water()
        self._stop.clear()
        self._t0 = time.perf_counter()
        self._thread = None
        if not self._hwm:
            self._thread = threading.Thread(target=self._sample, name="hpctp-peak-memory", daemon=True)
            self._thread.start()
        _open.append(self)
        if self._track:
            from torch.profiler import ProfilerActivity, profile

            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self.tensors = _live_peak(self._profile)
            self._profile = None
        if self in _open:
            _open.remove(self)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.seconds = time.perf_counter() - self._t0
        self.sampled = max(self.sampled, resident_bytes())
        self.kernel = _high_water() if self._hwm else None
        self.peak = max(self.sampled, self.kernel or 0) - self.baseline
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            self.cuda = int(torch.cuda.max_memory_allocated())


def _live_peak(prof: Any) -> int:
    """The peak, over the profile, of CPU tensor bytes allocated minus freed (its ``[memory]`` events in time order)."""
    events = [
        e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type().name == "CPU"
    ]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak
