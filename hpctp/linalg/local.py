"""Local GEMM and buffer helpers over numpy / torch (CPU, CUDA) / cupy blocks.

Local: no communication. Blocks keep their backend and device; nothing here calls a
numpy-only function on a block that could live on a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._util.backend import Array, array_module, copy_into, dtype_kind, empty_like_backend, is_device, is_torch

__all__ = ["gemm", "gemm_dtype_error", "is_contiguous", "Workspace", "zeros_like_backend"]

_TORCH_GEMM_DTYPES = ("float32", "float64", "complex64", "complex128")


def gemm_dtype_error(x: Array) -> TypeError | None:
    """Local. Why blocks of ``x``'s dtype cannot be multiplied and summed over MPI (None if they can).

    Booleans have no MPI sum; torch has no matrix product of bool, uint16/32/64, nor of
    integers on a GPU. Decided from the dtype alone, so ranks with one dtype agree.
    """
    kind = dtype_kind(x)
    if kind == "b":
        return TypeError("matmul of boolean blocks is not supported (MPI has no SUM of bool); use .astype('int64')")
    if is_torch(x):
        name = str(x.dtype).removeprefix("torch.")
        if name in ("uint16", "uint32", "uint64") or (kind in "iu" and is_device(x)):
            where = "on a GPU" if is_device(x) else "on the CPU"
            return TypeError(f"torch has no matrix product of {name} {where}; use .astype() to a float dtype")
    return None


def is_contiguous(x: Array) -> bool:
    """Local. True if ``x`` is C-contiguous (what MPI buffers need)."""
    if is_torch(x):
        return bool(x.is_contiguous())
    return bool(x.flags.c_contiguous)


def zeros_like_backend(shape: tuple[int, ...], dtype: object, like: Array) -> Array:
    """Local. A zero-filled block of ``shape``/``dtype`` on ``like``'s backend and device."""
    out = empty_like_backend(shape, dtype, like)
    if is_torch(out):
        out.zero_()
    else:
        out.fill(0)
    return out


def _as_torch(x: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(x)


def _torch_can_wrap(*xs: np.ndarray) -> bool:
    """torch.from_numpy wraps these without a copy or a warning."""
    return all(
        x.dtype.name in _TORCH_GEMM_DTYPES and x.dtype.isnative and x.flags.writeable and min(x.strides, default=0) >= 0
        for x in xs
    )


def gemm(out: Array, a: Array, b: Array, accumulate: bool) -> None:
    """Local. ``out = a @ b`` (``accumulate=False``) or ``out += a @ b``, in place, one BLAS call.

    ``a`` and ``b`` may be transposed views; ``out`` must be contiguous. numpy blocks of
    float/complex dtypes go through torch's BLAS on zero-copy views (a true GEMM with
    ``beta = 1``, no temporary), so their thread count is ``torch.set_num_threads``.

    Parameters
    ----------
    out : array
        ``(p, q)`` result block, same backend as ``a`` and ``b``.
    a, b : array
        ``(p, r)`` and ``(r, q)`` blocks.
    accumulate : bool
        Add to ``out`` instead of overwriting it.
    """
    if is_torch(out):
        import torch

        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
        return
    if isinstance(out, np.ndarray) and _torch_can_wrap(out, a, b):
        if out.size == 0:
            return
        o = _as_torch(out)
        if accumulate:
            o.addmm_(_as_torch(a), _as_torch(b))
        else:
            import torch

            torch.mm(_as_torch(a), _as_torch(b), out=o)
        return
    xp = array_module(out)
    if accumulate:
        out += xp.matmul(a, b)
    else:
        xp.matmul(a, b, out=out)


class Workspace:
    """Local. A few reusable flat buffers (one per slot) handed out as contiguous 2-D views.

    Parameters
    ----------
    slots : int
        Number of buffers (2 for double buffering).
    elements : int
        Capacity of each buffer in elements.
    dtype : dtype
    like : array
        Backend and device of the buffers.
    """

    def __init__(self, slots: int, elements: int, dtype: object, like: Array) -> None:
        self._flat = [empty_like_backend((max(elements, 1),), dtype, like) for _ in range(slots)]

    def view(self, slot: int, shape: tuple[int, int]) -> Array:
        """Local. A contiguous ``shape`` view of buffer ``slot``."""
        n = shape[0] * shape[1]
        return self._flat[slot][:n].reshape(shape)

    def staged(self, slot: int, src: Array) -> Array:
        """Local. ``src`` itself if contiguous, else a contiguous copy in buffer ``slot``."""
        if is_contiguous(src):
            return src
        buf = self.view(slot, tuple(src.shape))  # type: ignore[arg-type]
        copy_into(buf, src)
        return buf
