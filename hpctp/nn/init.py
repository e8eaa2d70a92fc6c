"""Initial values of hpctp's layers: independent of the grid, reproducible, and deferrable (the meta device).

Two sources of initial values, both independent of the grid and of the number of ranks:

* **counter-based blocks** (:func:`init_block`): a sharded weight is the block at a rank's coordinates
  of a global ``U(-bound, bound)`` tensor whose every element is a pure function of ``(seed, global
  index)`` (:func:`hpctp.random.block_uniform`). Tensor-parallel linears and attention use it; a
  composite layer gives each sub-layer its own stream (:func:`derive_seed`).
* **torch's generator** for replicated parameters (:func:`init_replicated`): the layer's torch
  construction runs under ``torch.manual_seed(seed)`` in a forked RNG, so the values equal those of
  the torch layer built right after ``torch.manual_seed(seed)``; without a seed rank 0's values are
  broadcast.

[Note: deferred initialisation] A layer constructed on the ``meta`` device (``device="meta"``, or
inside ``with torch.device("meta"):``) allocates nothing and draws nothing: its parameters have
shapes, dtypes and ``hpctp_layout`` but no storage, and no message is sent (an unseeded replicated
layer skips its broadcast). Every hpctp layer with parameters has a ``reset_parameters()`` that gives
its *own* parameters (and those of sub-modules its construction adjusted, e.g. a zeroed bias) exactly
the values of its construction: seeded layers replay their draws under their seed
(:class:`SeededReset`), counter-based ones recompute their blocks. :func:`hpctp.nn.materialize`
and :class:`hpctp.nn.ShardedDataParallel` call these resets module by module (children before their
parent, as construction runs), so a model built on ``meta`` gets the values one process gets by
building it for real, without ever existing whole on a rank.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from .. import comm as C
from .._util.ints import is_int
from ..comm import ProcessGrid
from ..layout import Layout
from ..tensor.random import block_uniform

__all__ = [
    "BlockReset",
    "SeededReset",
    "bias_seed",
    "derive_seed",
    "generator_state",
    "init_block",
    "init_replicated",
    "is_meta",
    "seeded",
]

_BIAS_STREAM = 0x5DEECE66D


def is_meta(device: Any = None) -> bool:
    """Local. Whether a layer built with ``device`` (None: torch's default device) lives on ``meta``."""
    if device is None:
        return torch.get_default_device().type == "meta"
    return torch.device(device).type == "meta"


def _target(device: Any) -> torch.device:
    return torch.get_default_device() if device is None else torch.device(device)


def init_block(
    layout: Layout, coords: tuple[int, ...], seed: int, bound: float, dtype: torch.dtype, device: Any
) -> torch.Tensor:
    """Local. The block at ``coords`` of a global ``U(-bound, bound)`` tensor, independent of the grid.

    Parameters
    ----------
    layout : Layout
        Layout of the global tensor.
    coords : tuple of int
        Grid coordinates of the block.
    seed : int
        Seed of :func:`hpctp.random.block_uniform`.
    bound : float
    dtype : torch.dtype
    device : torch.device or str or None
        None: torch's default device (e.g. ``meta`` inside ``with torch.device("meta")``: then an
        empty meta tensor, nothing drawn).

    Returns
    -------
    torch.Tensor
        Contiguous block of shape ``layout.local_shape(coords)``.
    """
    target = _target(device)
    if target.type == "meta":
        return torch.empty(layout.local_shape(coords), dtype=dtype, device=target)
    vals = block_uniform(layout.global_shape, layout.local_ranges(coords), seed, -bound, bound)
    return torch.from_numpy(np.asarray(vals, order="C")).to(dtype=dtype, device=target)


def bias_seed(seed: int) -> int:
    """Local. The stream of a linear layer's bias, next to its weight's ``seed``."""
    return (int(seed) * 6364136223846793005 + _BIAS_STREAM) % 2**63


def derive_seed(seed: int, stream: int) -> int:
    """Local. A seed for a sub-layer (``stream`` 1, 2, ...) of a layer seeded with ``seed``.

    Deterministic and grid-independent, so composite layers (attention, MLP, blocks) draw
    each weight from its own stream and their gathered parameters do not depend on the grid.
    """
    return (int(seed) * 2862933555777941757 + 3037000493 * (int(stream) + 1)) % 2**63


UNSEEDED_FIX = (
    "the model is on the meta device and no seed= was given, so its values come from torch's generator, which "
    "torch seeds differently in every process: pass seed= (e.g. seed=0), or call torch.manual_seed(...) with the "
    "same seed on every rank before building the model"
)
"""What to do when the ranks' generators differ (the message of a wrapper that materializes a meta model)."""


def generator_state(meta: bool, seed: int | None) -> int:
    """Local. A digest of torch's CPU generator where a meta model is materialized from it (``meta`` and no
    ``seed``), else 0: the argument that the ranks agree on (with :data:`UNSEEDED_FIX` as its fix)."""
    return zlib.crc32(torch.get_rng_state().numpy().tobytes()) if meta and seed is None else 0


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Local. Run the block on torch's CPU generator seeded with ``seed`` in a fork (the caller's
    generator untouched); ``None``: on the caller's generator as it is."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        yield


def init_replicated(module: torch.nn.Module, init: Callable[[], None], grid: ProcessGrid, seed: int | None) -> None:
    """Collective over grid. Run ``init`` so every rank gets identical parameters.

    (No communication when ``seed`` is given, or on the meta device.)

    With ``seed`` the global torch RNG is forked and seeded, so the values equal those of
    the torch layer built right after ``torch.manual_seed(seed)``, on any grid. Without a
    seed, rank 0's values are broadcast over the grid. The seed is remembered for the module's
    ``reset_parameters()`` (:class:`SeededReset`).

    Raises
    ------
    ValueError
        If ``seed`` is not a non-negative int or None.
    """
    if seed is not None and (not is_int(seed) or seed < 0):
        raise ValueError(f"seed must be a non-negative int or None, got {seed!r}")
    with seeded(seed):
        init()
    setattr(module, "hpctp_seed", None if seed is None else int(seed))  # noqa: B010 (a torch Module)
    setattr(module, "_hpctp_built", True)  # noqa: B010
    params = list(module.parameters())
    if seed is None and not any(p.is_meta for p in params):
        with torch.no_grad():
            for p in params:
                C.bcast(grid.comm, p.data, 0)


class SeededReset:
    """Local. Mixin of layers whose replicated parameters come from torch's generator (:func:`init_replicated`).

    ``reset_parameters()`` replays the draws of construction (:meth:`_draw_parameters`, in
    construction's order) under the layer's seed, so a layer built on ``meta`` and reset gets
    the values of one built for real; unseeded, it draws from the caller's generator (as
    torch's layers do: every rank must then hold the same generator state). Called by a torch
    base class's ``__init__`` during construction, it only draws (the seed is already set up).
    """

    hpctp_seed: int | None = None
    _hpctp_built = False

    def _draw_parameters(self) -> None:
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Local. Give the parameters their values of construction (see the class docstring)."""
        if not self._hpctp_built:
            self._draw_parameters()
            return
        with torch.no_grad(), seeded(self.hpctp_seed):
            self._draw_parameters()


class BlockReset:
    """Local. Mixin of layers whose parameters are counter-based blocks (:func:`init_block`).

    The layer records each such parameter with :meth:`_record_block`; ``reset_parameters()``
    recomputes the blocks (no generator involved: the same values on any rank count), then
    runs :meth:`_after_reset` (e.g. zeroed biases).
    """

    _hpctp_blocks: tuple[tuple[str, Layout, tuple[int, ...], int, float], ...] = ()

    def _record_block(self, name: str, layout: Layout, coords: tuple[int, ...], seed: int, bound: float) -> None:
        self._hpctp_blocks = self._hpctp_blocks + ((name, layout, tuple(coords), int(seed), float(bound)),)

    def _after_reset(self) -> None:
        """Local. What construction did after drawing the blocks."""

    def reset_parameters(self) -> None:
        """Local. Give the parameters their values of construction (the counter-based blocks)."""
        with torch.no_grad():
            for name, layout, coords, seed, bound in self._hpctp_blocks:
                p = getattr(self, name)
                p.copy_(init_block(layout, coords, seed, bound, p.dtype, p.device))
            self._after_reset()
