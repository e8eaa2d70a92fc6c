"""What plain and sharded checkpoints share: the format marker, the checks of a file against a model, reads.

See :mod:`hpctp.io.checkpoint` for the file layout.
"""

from __future__ import annotations

import os
import zlib
from typing import TYPE_CHECKING

import h5py
import numpy as np

from .. import comm as C
from .._util.ints import is_int
from ..comm import ProcessGrid
from ._ckpt_state import Entry
from ._files import IOKeyError, native_dtype
from .hdf5 import read_block

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMAT",
    "VERSION",
    "as_tensor",
    "check_entries",
    "check_format",
    "check_same_everywhere",
    "class_name",
    "layout_text",
    "read_slab",
]

FORMAT = "hpctp-checkpoint"
VERSION = 1


def check_step(step: object) -> None:
    """Local. A save's step: an int >= 0.

    Raises
    ------
    ValueError
        Otherwise.
    """
    if not is_int(step) or step < 0:  # type: ignore[operator]
        raise ValueError(f"step must be an int >= 0, got {step!r}")


def agree_save(
    grid: ProcessGrid, error: Exception | None, fname: str, step: int, method: str, optimizer: object
) -> None:
    """Collective over grid. Every rank's ``save_checkpoint`` arguments agree, and no rank failed checking them."""
    C.agree_arguments(grid.comm, "save_checkpoint", error, path=os.path.abspath(fname), step=step, method=method,
                      optimizer=optimizer is not None)  # fmt: skip


def agree_load(
    grid: ProcessGrid, error: Exception | None, fname: str, method: str, strict: bool, optimizer: object
) -> None:
    """Collective over grid. Every rank's ``load_checkpoint`` arguments agree, and no rank failed checking them."""
    C.agree_arguments(grid.comm, "load_checkpoint", error, path=os.path.abspath(fname), method=method, strict=strict,
                      optimizer=optimizer is not None)  # fmt: skip


def layout_text(e: Entry) -> str:
    """A sharded entry's layout (split, grid and cuts); every rank must describe the same tiling."""
    if e.layout is None:
        return "replicated"
    return f"{e.layout.split}|{e.layout.grid_dims}|{e.layout.dim_cuts}"


def check_same_everywhere(grid: ProcessGrid, entries: list[Entry], groups: str) -> None:
    text = ";".join(f"{e.key}:{e.global_shape}:{e.dtype}:{layout_text(e)}" for e in entries)
    sig = [len(entries), zlib.crc32(text.encode()), zlib.crc32(groups.encode())]
    table = C.allgather_ints(grid.comm, sig)
    if (table != table[0]).any():
        raise ValueError(
            "save_checkpoint: the model/optimizer state differs between ranks (names, global shapes, dtypes, "
            "layouts or hyperparameters); every rank must hold the same model with its own blocks"
        )


def check_format(f: h5py.File, path: str) -> int:
    if f.attrs.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not an hpctp checkpoint (no format={FORMAT!r} attribute); was it written by save_checkpoint?"
        )
    version = int(f.attrs.get("version", -1))
    if version > VERSION:
        raise ValueError(f"{path} is a version {version} checkpoint; this hpctp reads up to version {VERSION}")
    return int(f.attrs["step"])


def check_entries(f: h5py.File, path: str, entries: list[Entry], group: str, strict: bool) -> None:
    present: set[str] = set()
    if group in f:
        f[group].visititems(lambda n, o: present.add(f"{group}/{n}") if isinstance(o, h5py.Dataset) else None)
    wanted = {e.key for e in entries}
    missing = sorted(wanted - present)
    unexpected = sorted(present - wanted) if strict else []
    if missing or unexpected:
        raise IOKeyError(
            f"{path} does not match the {group}: missing keys {missing}, unexpected keys {unexpected}; "
            f"build the same model as when saving" + ("" if not unexpected else " (or pass strict=False)")
        )
    bad = []
    for e in entries:
        ds = f[e.key]
        stored = ds.attrs.get("torch_dtype", "")
        if tuple(ds.shape) != e.global_shape or stored != e.dtype:
            bad.append(f"{e.key}: file {tuple(ds.shape)} {stored}, model {e.global_shape} {e.dtype}")
    if bad:
        raise ValueError(f"{path}: global shape/dtype mismatch: " + "; ".join(bad))


def read_slab(ds: h5py.Dataset, sel: tuple[slice, ...], path: str) -> np.ndarray:
    buf = np.empty(tuple(s.stop - s.start for s in sel), dtype=native_dtype(ds))
    read_block(ds, buf, sel, path)
    return buf


def as_tensor(buf: np.ndarray, dtype: str) -> torch.Tensor:
    import torch

    t = torch.from_numpy(buf)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def class_name(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def check_saved_optimizer(f: h5py.File, path: str, optimizer: torch.optim.Optimizer) -> None:
    """Local. The file holds optimizer state, saved from the same optimizer type.

    Raises
    ------
    KeyError
        If it holds none.
    ValueError
        If another optimizer type saved it.
    """
    if "optimizer" not in f:
        raise IOKeyError(f"{path} holds no optimizer state; pass optimizer=None to load the model only")
    saved_class = f["optimizer"].attrs.get("class", None)
    if saved_class is not None and str(saved_class) != class_name(optimizer):
        raise ValueError(
            f"{path}: optimizer state was saved from {saved_class}, but the optimizer is {class_name(optimizer)}; "
            f"build the same optimizer type, or pass optimizer=None to load the model only"
        )
