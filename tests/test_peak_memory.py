"""hpctp.PeakMemory: the resident set's peak from the kernel's high-water mark, without a thread where the kernel
resets the mark; nested blocks; the sampling thread where it does not."""

from __future__ import annotations

import time

import numpy as np
import pytest

import hpctp
from hpctp._util import memory

MIB = 2**20


def _spike(nbytes: int, hold: float = 0.0) -> None:
    """Touch ``nbytes`` of fresh pages, keep them ``hold`` seconds, free them (numpy maps a block this large on its
    own, so the pages leave the resident set when it is freed)."""
    a = np.ones(nbytes // 8)
    time.sleep(hold)
    del a


def _kernel_mark_resets() -> bool:
    return memory._reset_high_water() and memory._high_water() is not None


@pytest.mark.skipif(not _kernel_mark_resets(), reason="the kernel's high-water mark cannot be reset here (not Linux)")
def test_a_freed_spike_counts_at_its_peak_without_a_sampling_thread() -> None:
    """128 MiB touched and freed at once: no sample could see it, the kernel's mark does; no thread ran (a thread
    that wakes every 0.5 ms and takes the GIL whenever the main thread waits in MPI cost oversubscribed ranks'
    steps up to 1.6x)."""
    with hpctp.PeakMemory() as m:
        _spike(128 * MIB)
    assert m.samples == 0 and m.kernel is not None
    assert 127 * MIB <= m.peak < 160 * MIB, m.peak / MIB


@pytest.mark.skipif(not _kernel_mark_resets(), reason="the kernel's high-water mark cannot be reset here (not Linux)")
def test_a_nested_block_keeps_the_outer_blocks_peak() -> None:
    """An inner block resets the kernel's mark on entry: the outer block keeps what the mark held before (its own
    spike), and the inner block sees only its own."""
    with hpctp.PeakMemory() as outer:
        _spike(192 * MIB)
        with hpctp.PeakMemory() as inner:
            _spike(64 * MIB)
        _spike(32 * MIB)
    assert 63 * MIB <= inner.peak < 96 * MIB, inner.peak / MIB
    assert 191 * MIB <= outer.peak < 224 * MIB, outer.peak / MIB


@pytest.mark.skipif(memory.resident_bytes() == 0, reason="no resident set to sample here (not Linux)")
def test_without_the_kernels_mark_a_thread_samples_the_resident_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the mark cannot be reset (``/proc/self/clear_refs`` not writable), a thread samples the resident set:
    a spike held for 100 ms is seen."""
    monkeypatch.setattr(memory, "_reset_high_water", lambda: False)
    with hpctp.PeakMemory(interval=1e-3) as m:
        _spike(96 * MIB, hold=0.1)
    assert m.kernel is None and m.samples > 10
    assert 95 * MIB <= m.peak < 128 * MIB, m.peak / MIB
