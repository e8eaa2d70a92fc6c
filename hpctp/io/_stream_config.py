"""The settings and the accounting of a :class:`hpctp.io.Stream` (plain data)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._util.ints import is_int
from .replay import EVICTIONS

__all__ = ["DEFAULT_BUFFER_BYTES", "DEFAULT_DEPTH", "StreamConfig", "StreamStats"]

DEFAULT_BUFFER_BYTES = 256 * 2**20
"""Default replay capacity (bytes of the global field's pairs): more keeps older pairs to draw from
(less reuse, less forgetting) at the cost of each trainer rank's memory (this over the spatial parts)."""

DEFAULT_DEPTH = 2
"""Default snapshots between the groups (sent but not yet in the buffer): more absorbs a slow training
step without thinning, at the cost of one packed snapshot block per rank on both sides."""


@dataclass(frozen=True)
class StreamConfig:
    """Local. The settings of a :class:`hpctp.io.Stream` (the same on every rank).

    Parameters
    ----------
    horizon : int
        Pairs ``(x_n, x_{n + horizon})`` of the snapshots put; 0: each ``put(x, target=y)`` is a pair.
    buffer_bytes : int
        Replay capacity: bytes of the pairs (input + target) of the global field held at once.
    eviction : {"reservoir", "window"}
        Which pairs stay when the buffer is full (:class:`hpctp.io.ReplayPlan`).
    batch_size : int
        Pairs a training step draws (:meth:`hpctp.io.Stream.draw`).
    holdout_every : int
        Keep pair ``n`` aside for evaluation when ``n % holdout_every == holdout_every - 1`` (0: none).
    holdout_bytes : int
        Bytes of the held-out store (reservoir of the held-out pairs); > 0 with ``holdout_every``.
    seed : int
        Seed of the eviction and the draws.
    max_wait : float
        Seconds a :meth:`hpctp.io.Stream.put` may wait for the trainer before the snapshot is thinned
        (``inf``: never thinned).
    depth : int
        Snapshots between the groups at most (sent, not yet taken into the trainer's buffer); >= 2
        with ``horizon > 0``.

    Raises
    ------
    ValueError
        From :meth:`check`.
    """

    horizon: int = 1
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    eviction: str = "reservoir"
    batch_size: int = 4
    holdout_every: int = 0
    holdout_bytes: int = 0
    seed: int = 0
    max_wait: float = 1.0
    depth: int = DEFAULT_DEPTH

    def check(self) -> None:
        """Local. Raise ValueError naming the first bad setting."""
        for name, low in (("horizon", 0), ("buffer_bytes", 1), ("batch_size", 1), ("holdout_every", 0)):
            v = getattr(self, name)
            if not is_int(v) or int(v) < low:
                raise ValueError(f"StreamConfig.{name} must be an int >= {low}, got {v!r}")
        for name in ("holdout_bytes", "seed"):
            v = getattr(self, name)
            if not is_int(v) or int(v) < 0:
                raise ValueError(f"StreamConfig.{name} must be an int >= 0, got {v!r}")
        low = 2 if self.horizon else 1  # (a pair's input and its target are in flight together)
        if not is_int(self.depth) or int(self.depth) < low:
            raise ValueError(
                f"StreamConfig.depth must be an int >= {low} with horizon={self.horizon} (a pair's input and target "
                f"travel together), got {self.depth!r}"
            )
        if self.eviction not in EVICTIONS:
            raise ValueError(f"StreamConfig.eviction={self.eviction!r} must be one of {EVICTIONS}")
        if not (isinstance(self.max_wait, (int, float)) and self.max_wait >= 0 and not math.isnan(self.max_wait)):
            raise ValueError(f"StreamConfig.max_wait must be seconds >= 0 (inf: never thin), got {self.max_wait!r}")
        if self.holdout_every and not self.holdout_bytes:
            raise ValueError(
                f"StreamConfig.holdout_every={self.holdout_every} keeps pairs aside, but holdout_bytes=0 leaves "
                "no room for them; give holdout_bytes (bytes of the held-out pairs kept)"
            )


@dataclass
class StreamStats:
    """Local. The accounting of a stream, as this rank knows it (the trainer's ranks know all of it
    from the headers; the simulation's ranks know ``produced``, ``sent``, ``dropped`` and ``waited``).

    Attributes
    ----------
    produced : int
        Snapshots the simulation put.
    sent : int
        Snapshots sent to the trainer (the others were thinned).
    dropped : int
        Snapshots thinned because the trainer was behind.
    received : int
        Snapshots taken into the trainer's memory.
    pairs : int
        Training pairs formed (each went to the buffer or was not kept by the reservoir).
    held_out : int
        Pairs kept aside for evaluation.
    stored : int
        Pairs in the buffer now.
    evicted : int
        Pairs replaced in, or never kept by, the buffer.
    draws : int
        Pairs drawn by training steps (with repeats).
    used : int
        Distinct pairs drawn at least once.
    waited : float
        Seconds the simulation waited for the trainer (its first rank).
    bytes_sent : int
        Bytes this rank sent of snapshots.
    """

    produced: int = 0
    sent: int = 0
    dropped: int = 0
    received: int = 0
    pairs: int = 0
    held_out: int = 0
    stored: int = 0
    evicted: int = 0
    draws: int = 0
    used: int = 0
    waited: float = 0.0
    bytes_sent: int = 0

    @property
    def reuse(self) -> float:
        """Draws per distinct pair drawn (how often a pair was trained on); 0 before any draw."""
        return self.draws / self.used if self.used else 0.0

    def line(self) -> str:
        """Local. The accounting in one line (for the log)."""
        return (
            f"{self.produced} snapshots produced, {self.dropped} dropped (thinned), {self.received} received; "
            f"{self.pairs} training pairs ({self.evicted} evicted, {self.stored} in the buffer), {self.held_out} "
            f"held out; {self.used} used, {self.draws} draws: reuse factor {self.reuse:.2f}"
        )
