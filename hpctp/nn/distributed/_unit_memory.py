"""Memory reused by stage 3's gathered units, and a step's gradient slices in one block (:class:`hpctp.nn.ShardedDataParallel`).

Stage 3 gives a unit's flat parameter buffer memory just before its forward and backward and takes
it back after, so a step needs that memory 2 x units times. Freeing and allocating it each time is
what FSDP2 does on a GPU, where torch's caching allocator keeps the blocks; on the CPU every
``resize_`` goes to the C allocator, and glibc's keeps the freed chunks of a step resident among
the other tensors' (its resident peak read 0.55-0.64 of one process where 0.32 was live).

:class:`UnitMemory` keeps those blocks instead: a freed unit's memory goes to a free list by size
and the next unit of that size takes it, so a step allocates one block, not 2 x units. The
flat buffer's storage object is never replaced, only its memory: the block is swapped into it and
out again (``UntypedStorage._swap_data_ptr_``, as resizing does), so the parameters, which are
views of it, and whatever autograd saved of them stay valid. At most :attr:`UnitMemory.keep` free
blocks are kept per size (one), so what is kept between steps is one unit's memory, and a backward,
which prefetches a unit only once the one before is done, holds no idle block beside the unit it
computes; a forward, which holds a unit and its prefetched neighbour, allocates the second block
once per step (``tests/test_unit_memory.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["GradientSlices", "UnitMemory"]

_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class UnitMemory:
    """Local. Free memory blocks for stage 3's flat parameter buffers, by device and size.

    Parameters
    ----------
    keep : int
        Free blocks kept per size; more are freed.

    Attributes
    ----------
    allocations : int
        Blocks allocated so far.
    """

    def __init__(self, keep: int = 1) -> None:
        self.keep = keep
        self._free: dict[tuple[str, int], list[torch.UntypedStorage]] = defaultdict(list)
        self.allocations = 0

    def attach(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Local. Give ``storage`` (of no memory) ``nbytes`` of memory: a kept block, or a new one. Devices other
        than the CPU, and torch builds without the swap, resize it (their allocators keep the blocks)."""
        if storage.device.type != "cpu" or not _SWAP:
            storage.resize_(nbytes)
            return
        free = self._free[(str(storage.device), nbytes)]
        if free:
            block = free.pop()
        else:
            block = torch.empty(nbytes, dtype=torch.uint8, device=storage.device).untyped_storage()
            self.allocations += 1
        storage._swap_data_ptr_(block)  # type: ignore[attr-defined]  # (block now holds what storage held: nothing)

    def detach(self, storage: torch.UntypedStorage) -> None:
        """Local. Take ``storage``'s memory back (it is left with none); kept for the next unit of its size."""
        nbytes = storage.nbytes()
        if storage.device.type != "cpu" or not _SWAP or nbytes == 0:
            storage.resize_(0)
            return
        block = torch.empty(0, dtype=torch.uint8, device=storage.device).untyped_storage()
        storage._swap_data_ptr_(block)  # type: ignore[attr-defined]
        free = self._free[(str(storage.device), nbytes)]
        if len(free) < self.keep:
            free.append(block)

    def clear(self) -> None:
        """Local. Free every kept block."""
        self._free.clear()

    @property
    def kept_bytes(self) -> int:
        """Local. Bytes held in free blocks."""
        return sum(b.nbytes() for blocks in self._free.values() for b in blocks)


class GradientSlices:
    """Local. A step's gradient slices of every stage 2-3 bucket: views of one block per device and dtype.

    Each bucket's reduce-scatter lands in its slice (the gradient the optimizer reads). Allocated
    one by one, those slices (1/D of each unit's gradient) live from their unit's backward to
    ``zero_grad`` among the short-lived blocks of the step and pin glibc's heap where they fall;
    as one block, taken at the step's first message and released with the last view of it, they
    are one allocation (mapped on its own above ``malloc``'s threshold).

    Parameters
    ----------
    buckets : sequence of Bucket
        The owner's buckets; those of stages 2-3 get a place.
    """

    def __init__(self, buckets: Sequence[Any]) -> None:
        self._place: dict[int, tuple[tuple[torch.device, torch.dtype], int, int]] = {}
        sizes: dict[tuple[torch.device, torch.dtype], int] = defaultdict(int)
        for b in buckets:
            if b.stage >= 2:
                key = (b.device, b.dtype)
                self._place[id(b)] = (key, sizes[key], b.hi - b.lo)
                sizes[key] += b.hi - b.lo
        self._sizes = dict(sizes)
        self._blocks: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def slice_of(self, bucket: Any) -> torch.Tensor:
        """Local. ``bucket``'s slice of this step's block (the block is allocated by the step's first call)."""
        key, start, size = self._place[id(bucket)]
        block = self._blocks.get(key)
        if block is None:
            block = self._blocks[key] = torch.empty(self._sizes[key], dtype=key[1], device=key[0])
        return block[start : start + size]

    def next_step(self) -> None:
        """Local. The next step's slices come from a new block (this one lives on in the slices handed out)."""
        self._blocks.clear()
