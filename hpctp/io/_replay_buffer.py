"""One trainer rank's share of a :class:`hpctp.io.Stream`'s training pairs: the replay buffer, the
held-out store and the window of the last snapshots that lag pairs are formed from. Where each pair
goes and what a step draws are the pure decisions of :class:`hpctp.io.ReplayPlan`; this holds the
blocks. Local: no communication."""

from __future__ import annotations

import numpy as np

from ._stream_config import StreamConfig, StreamStats
from .replay import ReplayPlan, held_out

__all__ = ["ReplayBuffer"]


class ReplayBuffer:
    """Local. The blocks (this rank's part of each global pair) of ``capacity`` training pairs and of
    ``hold`` held-out pairs.

    Parameters
    ----------
    config : StreamConfig
        ``horizon`` (lag pairs), ``eviction``, ``seed``, ``holdout_every``, ``batch_size``.
    capacity, hold : int
        Pairs in the buffer (>= 1) and in the held-out store (>= 0).
    block : tuple of int
        This rank's block of one snapshot.
    dtype : str
    stats : StreamStats
        The stream's accounting (``pairs``, ``held_out``, ``stored``, ``evicted``, ``draws``, ``used``).
    """

    def __init__(
        self, config: StreamConfig, capacity: int, hold: int, block: tuple[int, ...], dtype: str, stats: StreamStats
    ) -> None:
        self.config, self.stats = config, stats
        self.plan = ReplayPlan(capacity, config.eviction, config.seed)
        self.holdout = ReplayPlan(max(hold, 1), "reservoir", (config.seed + 1) % 2**63)
        self._x = np.empty((capacity, *block), dtype=dtype)  # (pages are touched when filled)
        self._y = np.empty_like(self._x)
        self._items = np.full(capacity, -1, dtype=np.int64)  # pair number per slot (-1: empty)
        self._sources = np.full(capacity, -1, dtype=np.int64)  # snapshot number of each pair's input
        self._hx = np.empty((hold, *block), dtype=dtype)
        self._hy = np.empty_like(self._hx)
        self._hitems = np.full(hold, -1, dtype=np.int64)
        self._window: dict[int, np.ndarray] = {}  # the last `horizon` snapshots, for lag pairs
        self._used = np.zeros(0, dtype=bool)

    def insert(self, index: int, x: np.ndarray, y: np.ndarray | None) -> None:
        """Local. Snapshot ``index`` (with ``horizon = 0``: the pair ``(x, y)`` numbered ``index``),
        taken in order: the pair it completes goes to the held-out store or the buffer.

        Raises
        ------
        ValueError
            With ``horizon = 0`` and no target.
        """
        h = self.config.horizon
        if h > 0:
            self._window[index] = x
            first = self._window.pop(index - h, None)
            for old in [k for k in self._window if k <= index - h]:
                del self._window[old]
            if first is None:
                return
            index, x, y = index - h, first, x
        if y is None:
            raise ValueError(f"pair {index}: horizon=0 needs the target of every pair")
        if held_out(index, self.config.holdout_every):
            slot = self.holdout.slot(self.stats.held_out)
            self.stats.held_out += 1
            if slot is not None:
                self._hx[slot], self._hy[slot], self._hitems[slot] = x, y, index
            return
        slot = self.plan.slot(self.stats.pairs)
        self.stats.pairs += 1
        if slot is None:
            self.stats.evicted += 1
            return
        if self._items[slot] >= 0:
            self.stats.evicted += 1
        else:
            self.stats.stored += 1
        self._x[slot], self._y[slot] = x, y
        self._items[slot], self._sources[slot] = self.stats.pairs - 1, index

    def draw(self, step: int) -> np.ndarray:
        """Local. The slots training step ``step`` reads (:meth:`hpctp.io.ReplayPlan.draw`); counts them.

        Raises
        ------
        ValueError
            If no training pair has arrived.
        """
        slots = self.plan.draw(step, self.stats.pairs, self.config.batch_size)
        items = self._items[slots]
        if self._used.size < self.stats.pairs:
            self._used = np.concatenate([self._used, np.zeros(self.stats.pairs - self._used.size, dtype=bool)])
        self.stats.used += int((~self._used[items]).sum())
        self._used[items] = True
        self.stats.draws += int(slots.size)
        return slots

    def batch(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Local. The blocks of the pairs in ``slots``: inputs and targets (copies)."""
        return self._x[slots], self._y[slots]

    def contents(self) -> tuple[np.ndarray, np.ndarray]:
        """Local. Per slot: the pair's number and the snapshot number of its input (-1: empty)."""
        return self._items.copy(), self._sources.copy()

    def held_out_pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Local. The held-out pairs kept: inputs, targets and the snapshot number of each input, in
        snapshot order."""
        order = np.argsort(np.where(self._hitems >= 0, self._hitems, np.iinfo(np.int64).max))
        order = order[self._hitems[order] >= 0]
        return self._hx[order], self._hy[order], self._hitems[order]

    def square_sums(self) -> tuple[float, float]:
        """Local. Sum of ``(target - input) ** 2`` over this rank's blocks of the pairs in the buffer, and
        the number of elements."""
        filled = self._items >= 0
        d = (self._y[filled].astype(np.float64) - self._x[filled].astype(np.float64)).reshape(-1)
        return float(d @ d), float(d.size)
