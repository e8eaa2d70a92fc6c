"""Batches of a :class:`~hpctp.io.FieldDataset` with seeded shuffling and background prefetch."""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import comm as C
from .._util.ints import is_int
from ..tensor.core import DistTensor
from .dataset import FieldDataset

if TYPE_CHECKING:  # (hpctp.nn imports torch; the loader does not need it)
    from ..nn.distributed.plan import ParallelPlan

__all__ = ["FieldLoader"]

Batch = tuple[DistTensor, DistTensor | None]


class FieldLoader:
    """Collective over grid. Iterate ``(inputs, targets)`` batches of a FieldDataset.

    Every rank draws the same permutation (``numpy.random.default_rng([seed, epoch])``),
    so ranks always hold blocks of the same samples without communicating. While the
    caller computes on batch ``j``, a background thread reads batch ``j + 1`` (up to
    ``prefetch`` batches ahead) into fresh arrays, so file IO overlaps compute (h5py
    serialises its own calls; the reading thread makes no MPI calls). Read errors are
    agreed on at every batch, so a failing rank never leaves the others waiting.

    Parameters
    ----------
    dataset : FieldDataset
    batch_size : int
    shuffle : bool
        Shuffle sample order each epoch (within a batch, samples are in file order).
    seed : int
        Base seed; must be the same on every rank.
    drop_last : bool
        Drop a final batch smaller than ``batch_size``.
    prefetch : int
        Batches read ahead by the background thread (0: read in the calling thread).
    plan : ParallelPlan, optional
        Data parallelism: the dataset lives on ``plan.model_grid`` and each data group reads
        only its share of every global batch (:meth:`ParallelPlan.sample_range`: balanced,
        in the batch's order), so the global batches are the same on any grid shape. A batch
        smaller than the number of groups leaves some groups an empty share (batch size 0),
        which hpctp's layers and global losses handle.
        Arguments and read errors are then agreed on over ``plan.grid``.

    Raises
    ------
    ValueError
        If an argument is invalid or differs between ranks, or, without ``plan``, if the dataset's split leaves an
        axis of its grid undivided (its ranks would read the same samples: pass ``plan=``). Raised on every rank.
    TypeError
        If ``dataset`` is not a FieldDataset (raised where it is not: there is no grid).

    Notes
    -----
    Every rank must consume the same batches: a rank that stops iterating early leaves
    the others in the next batch's error agreement. Iterating again starts the next
    epoch; :meth:`set_epoch` chooses one.
    """

    def __init__(
        self,
        dataset: FieldDataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        prefetch: int = 1,
        plan: ParallelPlan | None = None,
    ) -> None:
        if not isinstance(dataset, FieldDataset):  # (no grid to agree on: raised where it is wrong)
            raise TypeError(f"FieldLoader needs a FieldDataset, got {type(dataset).__name__}")
        if plan is not None and not all(hasattr(plan, a) for a in ("model_grid", "sample_range", "data_size")):
            raise TypeError(f"plan must be a ParallelPlan or None, got {type(plan).__name__}")
        self.dataset = dataset
        self.plan = plan
        self.grid = dataset.grid if plan is None else plan.grid
        error: Exception | None = None
        values = [0, 0, 0, 0, 0, -1]
        try:
            for name, v, lo in (("batch_size", batch_size, 1), ("seed", seed, 0), ("prefetch", prefetch, 0)):
                if not is_int(v) or v < lo:
                    raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
            if plan is not None:
                _check_plan(plan, dataset)
            else:
                _check_replicas(dataset)
            samples = zlib.crc32(np.asarray(dataset.samples, dtype=np.int64, order="C").tobytes())
            values = [int(batch_size), int(seed), int(bool(shuffle)), int(bool(drop_last)), len(dataset), samples]
        except ValueError as e:
            error = e
        C.raise_if_any(self.grid.comm, error)
        table = C.allgather_ints(self.grid.comm, values)
        if (table != table[0]).any():
            raise ValueError(
                "FieldLoader arguments (batch_size, seed, shuffle, drop_last, dataset length, samples checksum) "
                f"differ between ranks: {table.tolist()}; pass the same values (and samples) on every rank"
            )
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.prefetch = int(prefetch)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Local. The epoch (shuffling seed offset) of the next iteration."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        n, b = len(self.dataset), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def batches(self, epoch: int) -> list[np.ndarray]:
        """Local. Sample positions of every global batch of ``epoch`` (identical on every rank and
        grid shape; with a plan, each data group reads its :meth:`share` of them)."""
        n = len(self.dataset)
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        out = [order[i : i + self.batch_size] for i in range(0, n, self.batch_size)]
        if self.drop_last and out and out[-1].size < self.batch_size:
            out.pop()
        return out

    def share(self, positions: np.ndarray) -> np.ndarray:
        """Local. The positions of a global batch that this rank's data group reads (all of them
        without a plan)."""
        if self.plan is None:
            return positions
        start, stop = self.plan.sample_range(len(positions))
        return positions[start:stop]

    def _read(self, positions: np.ndarray) -> tuple[Batch | None, Exception | None]:
        try:
            return self.dataset.read_batch(positions), None
        except Exception as e:  # noqa: BLE001 - reported collectively by the consumer
            return None, e

    def __iter__(self) -> Iterator[Batch]:
        """Collective over grid. Yield the batches of the current epoch, then advance the epoch.

        Raises
        ------
        OSError
            If any rank fails to read a batch (raised on every rank).
        """
        todo = deque(self.batches(self.epoch))
        self.epoch += 1
        if self.prefetch == 0:
            while todo:
                yield self._agree(self._read(self.share(todo.popleft())))
            return
        # the current GPU is per thread: the reader makes its blocks on the caller's device
        device = C.current_device()
        with ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="hpctp-io-prefetch", initializer=C.use_device, initargs=(device,)
        ) as pool:
            ahead: deque[Future[tuple[Batch | None, Exception | None]]] = deque()
            while todo and len(ahead) < self.prefetch:
                ahead.append(_submit(pool, self._read, self.share(todo.popleft())))
            while ahead:
                current = ahead.popleft()
                if todo:
                    ahead.append(_submit(pool, self._read, self.share(todo.popleft())))
                yield self._agree(_outcome(current))

    def _agree(self, result: tuple[Batch | None, Exception | None]) -> Batch:
        batch, error = result
        C.raise_if_any(self.grid.comm, error)
        return batch  # type: ignore[return-value]


def _check_plan(plan: ParallelPlan, dataset: FieldDataset) -> None:
    """Local. The dataset must live on the plan's model grid."""
    if dataset.grid.dims != plan.model_grid.dims or not dataset.grid.same_ranks(plan.model_grid):
        raise ValueError(
            f"FieldLoader: the dataset's grid (dims {dataset.grid.dims}) is not the plan's model grid "
            f"(dims {plan.model_grid.dims}); open the dataset on plan.model_grid"
        )


def _check_replicas(dataset: FieldDataset) -> None:
    """Local. Without a plan, every rank of a grid axis that the dataset's split does not use would read the same
    samples of every batch: data parallelism without its plan."""
    lay = dataset.layout
    idle = [a for a in lay.replicated_axes if lay.grid_dims[a] > 1]
    if idle:
        raise ValueError(
            f"FieldLoader: the dataset's split {lay.split[1:]} leaves grid axes {idle} of its grid (dims "
            f"{lay.grid_dims}) undivided, so the ranks along them would read the same samples of every batch; for "
            "data parallelism pass plan=ParallelPlan(grid, data=...) and open the dataset on plan.model_grid (each data "
            "group then reads its share of every batch), or open it on a grid without those axes"
        )


def _outcome(future: Future[tuple[Batch | None, Exception | None]]) -> tuple[Batch | None, Exception | None]:
    """The prefetched read's result; a failure of the reader thread itself (e.g. selecting the
    GPU in its initializer) becomes this rank's error, agreed on like a read error."""
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001
        return None, e


def _submit(
    pool: ThreadPoolExecutor, read: Any, positions: np.ndarray
) -> Future[tuple[Batch | None, Exception | None]]:
    """``pool.submit``, with a pool broken by a failed thread start giving a failed Future, so the
    error is agreed on with the other ranks instead of raising here only."""
    try:
        return pool.submit(read, positions)
    except Exception as e:  # noqa: BLE001
        failed: Future[tuple[Batch | None, Exception | None]] = Future()
        failed.set_exception(e)
        return failed
