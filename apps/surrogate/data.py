"""Training and held-out snapshot pairs ``(x_t, x_{t+horizon})`` read per rank from HDF5."""

from __future__ import annotations

from typing import Any

import hpctp
from hpctp.io import FieldDataset

__all__ = ["split_indices", "open_pairs"]

FIELDS = "fields"
SPLIT = (None, 0, 1)  # [C, H, W]: channels whole, H over grid axis 0, W over grid axis 1


def split_indices(n_snapshots: int, horizon: int, holdout: float) -> tuple[list[int], list[int]]:
    """Local. Input indices for training and for evaluation.

    Every ``round(1 / holdout)``-th pair is held out (interleaved in time), so both sets
    sample the same regime of the slowly evolving pattern.

    Raises
    ------
    ValueError
        If ``holdout`` is not in (0, 0.5] or there are too few snapshots for both sets.
    """
    if not 0 < holdout <= 0.5:
        raise ValueError(f"train.holdout must be in (0, 0.5], got {holdout}")
    pairs = n_snapshots - horizon
    k = max(2, round(1 / holdout))
    held = list(range(k - 1, pairs, k))
    train = [i for i in range(pairs) if i % k != k - 1]
    if not held or not train:
        raise ValueError(
            f"{n_snapshots} snapshots with horizon {horizon} and holdout {holdout} leave no training or "
            f"evaluation pairs; simulate more snapshots"
        )
    return train, held


def open_pairs(path: str, grid: hpctp.ProcessGrid, cfg: dict[str, Any], which: str) -> FieldDataset:
    """Collective over grid. The ``"train"`` or ``"eval"`` pairs of the snapshot file ``path``."""
    horizon = int(cfg["surrogate"]["horizon"])
    with FieldDataset(path, FIELDS, grid, SPLIT, targets=None) as probe:
        n = len(probe)
    train, held = split_indices(n, horizon, float(cfg["train"]["holdout"]))
    return FieldDataset(
        path, FIELDS, grid, SPLIT, samples=train if which == "train" else held, targets=horizon, like="torch"
    )
