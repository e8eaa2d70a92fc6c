"""Array backends of local blocks (numpy, torch CPU/CUDA, cupy): small, local helpers.

Everything here is local (no communication). Blocks keep their backend and device
through every operation; conversions happen only when asked for.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

__all__ = [
    "Array",
    "BACKENDS",
    "backend_name",
    "is_torch",
    "is_cupy",
    "shape_only",
    "is_device",
    "check_array",
    "broadcasts_to",
    "as_contiguous",
    "empty_like_backend",
    "empty_host_torch",
    "empty_host_bytes",
    "from_numpy",
    "to_numpy",
    "convert",
    "byte_view",
    "numpy_dtype",
    "dtype_kind",
    "native_order",
    "resolve_dtype",
    "copy_into",
    "from_bytes",
    "pack",
    "empty_bytes",
    "astype",
]

Array = Any  # numpy.ndarray | torch.Tensor | cupy.ndarray

# Backend names the factories, the HDF5 readers and DistTensor.to accept ("cuda": torch on the
# current GPU). The order is part of distribute's header: append, never reorder.
BACKENDS = ("numpy", "torch", "cuda", "cupy")


def is_torch(x: object) -> bool:
    """Local. True for a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def shape_only(x: object) -> bool:
    """Local. True for a torch tensor that holds no values: on ``meta``, or a fake tensor (``FakeTensorMode``), as
    in a dry run on a virtual grid or :func:`hpctp.perf.trace`; code that reads values takes its shape-only path."""
    if not is_torch(x):
        return False
    if x.device.type == "meta":  # type: ignore[attr-defined]
        return True
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and isinstance(x, fake.FakeTensor)


def is_cupy(x: object) -> bool:
    """Local. True for a cupy array (without importing cupy)."""
    cp = sys.modules.get("cupy")
    return cp is not None and isinstance(x, cp.ndarray)


def is_device(x: object) -> bool:
    """Local. True when the block lives in GPU memory."""
    return is_cupy(x) or (is_torch(x) and x.device.type != "cpu")  # type: ignore[attr-defined]


def backend_name(x: object) -> str:
    """Local. ``"numpy"``, ``"torch"`` or ``"cupy"``.

    Raises
    ------
    TypeError
        If ``x`` is not an array of a supported backend.
    """
    if isinstance(x, np.ndarray):
        return "numpy"
    if is_torch(x):
        return "torch"
    if is_cupy(x):
        return "cupy"
    raise TypeError(f"local blocks must be numpy.ndarray, torch.Tensor or cupy.ndarray, got {type(x).__name__}")


def array_module(x: object) -> Any:
    """Local. ``numpy`` or ``cupy``: the array module of a non-torch block (torch blocks use torch).

    Raises
    ------
    TypeError
        If ``x`` is not a numpy or cupy array.
    """
    if isinstance(x, np.ndarray):
        return np
    if is_cupy(x):
        return sys.modules["cupy"]
    raise TypeError(f"array_module takes a numpy or cupy block, got {type(x).__name__}")


def check_array(x: object, what: str = "array") -> Array:
    """Local. Return ``x`` if it is a supported array, else raise a TypeError naming ``what``."""
    try:
        backend_name(x)
    except TypeError as e:
        raise TypeError(f"{what}: {e}") from None
    return x


def broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Local. Whether an array of ``shape`` broadcasts to ``target`` (numpy's rule)."""
    return len(shape) <= len(target) and all(int(s) in (1, int(t)) for s, t in zip(shape[::-1], target[::-1]))


def numpy_dtype(dtype: object) -> np.dtype:
    """Local. The numpy dtype matching a numpy/torch/cupy dtype (bfloat16 maps to a 2-byte void)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        if dtype == torch.bfloat16:
            return np.dtype("V2")
        return torch.empty((), dtype=dtype).numpy().dtype
    return np.dtype(cast(Any, dtype))


def dtype_kind(x: Array) -> str:
    """Local. numpy's kind letter of a block's dtype: ``"b"``, ``"i"``, ``"u"``, ``"f"`` or ``"c"``.

    torch dtypes are classified by torch itself, so bfloat16 (a void type to numpy) is ``"f"``.
    """
    if is_torch(x):
        dt = x.dtype
        if dt.is_complex:
            return "c"
        if dt.is_floating_point:
            return "f"
        if dt == sys.modules["torch"].bool:
            return "b"
        return "i" if dt.is_signed else "u"
    return np.dtype(x.dtype).kind


def native_order(x: Array) -> Array:
    """Local. ``x``, or a copy in native byte order for a numpy block such as ``'>f8'`` read
    from a file (MPI buffers, BLAS and torch need native order)."""
    if isinstance(x, np.ndarray) and not x.dtype.isnative:
        return x.astype(x.dtype.newbyteorder("="))
    return x


def resolve_dtype(dtype: object, backend: str) -> Any:
    """Local. ``dtype`` as the given backend spells it (e.g. ``"float32"`` -> ``torch.float32``)."""
    if backend == "torch":
        import torch

        if isinstance(dtype, torch.dtype):
            return dtype
        npd = np.dtype(cast(Any, dtype))
        return torch.from_numpy(np.empty(0, dtype=npd)).dtype
    if backend == "cupy":
        return np.dtype(cast(Any, dtype)) if not is_torch_dtype(dtype) else numpy_dtype(dtype)
    return numpy_dtype(dtype)


def is_torch_dtype(dtype: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(dtype, torch.dtype)


def _device_of(like: object) -> Any:
    if is_torch(like):
        return like.device  # type: ignore[attr-defined]
    return None


def empty_like_backend(shape: tuple[int, ...], dtype: object, like: object) -> Array:
    """Local. An uninitialised array of ``shape``/``dtype`` on the backend and device of ``like``.

    ``like`` is an array, or one of the strings ``"numpy"``, ``"torch"``, ``"cupy"``,
    ``"cuda"`` (torch on the current CUDA device).
    """
    if isinstance(like, str):
        if like == "numpy":
            return np.empty(shape, dtype=resolve_dtype(dtype, "numpy"))
        if like in ("torch", "cuda"):
            import torch

            dev = "cuda" if like == "cuda" else "cpu"
            return torch.empty(shape, dtype=resolve_dtype(dtype, "torch"), device=dev)
        if like == "cupy":
            import cupy as cp

            return cp.empty(shape, dtype=resolve_dtype(dtype, "cupy"))
        raise ValueError(f"like={like!r} must be 'numpy', 'torch', 'cuda', 'cupy' or an array")
    name = backend_name(like)
    if name == "numpy":
        return np.empty(shape, dtype=resolve_dtype(dtype, "numpy"))
    if name == "torch":
        import torch

        tdtype = resolve_dtype(dtype, "torch")
        device = _device_of(like)
        if device is not None and device.type == "cpu":
            return empty_host_torch(shape, tdtype)
        return torch.empty(shape, dtype=tdtype, device=device)
    import cupy as cp

    with like.device:  # type: ignore[attr-defined]
        return cp.empty(shape, dtype=resolve_dtype(dtype, "cupy"))


HOST_NUMPY_MIN_BYTES = 1 << 20
"""CPU torch buffers of at least this size are numpy memory (:func:`empty_host_torch`)."""


def empty_host_torch(shape: tuple[int, ...], dtype: Any) -> Any:
    """Local. An uninitialised CPU torch tensor; large ones in numpy-allocated memory, wrapped without a copy.

    numpy asks the kernel for transparent huge pages for large arrays and torch (by default)
    does not, so the first write into a fresh 128 MiB torch buffer takes four times as long:
    one page fault per 4 KiB instead of per 2 MiB. Tensors of at least
    :data:`HOST_NUMPY_MIN_BYTES` whose dtype numpy has (bfloat16 through int16) are therefore
    allocated by numpy; they are ordinary tensors (autograd, views, in-place ops) except that
    their storage cannot be resized.

    Parameters
    ----------
    shape : tuple of int
    dtype : torch.dtype

    Returns
    -------
    torch.Tensor
    """
    import torch

    size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if size >= HOST_NUMPY_MIN_BYTES:
        stand_in = torch.int16 if dtype == torch.bfloat16 else dtype
        try:
            npd = torch.empty(0, dtype=stand_in).numpy().dtype
        except (TypeError, RuntimeError):  # no numpy dtype (complex32, float8, ...), or a fake tensor (the planner's
            return torch.empty(shape, dtype=dtype)  # trace under FakeTensorMode): torch's own, of its mode
        return torch.from_numpy(np.empty(shape, dtype=npd)).view(dtype)
    return torch.empty(shape, dtype=dtype)


def empty_host_bytes(n: int, backend: str) -> Array:
    """Local. A flat uninitialised ``uint8`` host buffer of ``n`` bytes: numpy, or torch on numpy memory.

    Parameters
    ----------
    n : int
    backend : {"numpy", "torch"}

    Returns
    -------
    array
    """
    flat = np.empty(n, dtype=np.uint8)
    if backend == "torch":
        import torch

        return torch.from_numpy(flat)
    return flat


def from_numpy(a: np.ndarray, like: object) -> Array:
    """Local. Copy/wrap a numpy array onto the backend and device of ``like`` (array or name)."""
    target = like if isinstance(like, str) else backend_name(like)
    if target == "numpy":
        return a
    if target in ("torch", "cuda"):
        import torch

        t = torch.from_numpy(np.asarray(a, order="C"))  # (ascontiguousarray makes 0-d 1-d)
        dev = "cuda" if target == "cuda" else _device_of(like)
        return t.to(dev) if dev is not None and str(dev) != "cpu" else t
    if target == "cupy":
        import cupy as cp

        return cp.asarray(a)
    raise ValueError(f"unknown backend {like!r}")


def to_numpy(x: Array) -> np.ndarray:
    """Local. A numpy array with the block's values (a view for numpy and CPU torch)."""
    name = backend_name(x)
    if name == "numpy":
        return x
    if name == "torch":
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return t.resolve_conj().numpy() if t.is_complex() else t.numpy()
    return x.get()


def convert(x: Array, backend: str) -> Array:
    """Local. The block on another backend: ``"numpy"``, ``"torch"``, ``"cuda"`` or ``"cupy"``."""
    if backend == backend_name(x) and not (backend == "torch" and is_device(x)):
        return x
    if backend == "numpy":
        return to_numpy(x)
    if backend == "cuda" and is_torch(x):
        return x.cuda()
    if backend == "torch" and is_cupy(x):
        import torch

        return torch.from_dlpack(x)
    if backend == "cupy" and is_torch(x) and is_device(x):
        import cupy as cp

        return cp.from_dlpack(x)
    if backend == "torch" and is_torch(x):
        return x.cpu()
    if backend not in ("torch", "cuda", "cupy"):
        raise ValueError(f"backend must be 'numpy', 'torch', 'cuda' or 'cupy', got {backend!r}")
    return from_numpy(to_numpy(x), backend)


def as_contiguous(x: Array) -> Array:
    """Local. ``x`` itself if C-contiguous, else a C-contiguous copy (numpy scalars become 0-d arrays)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x, order="C")  # not ascontiguousarray: it turns 0-d arrays into shape (1,)
    if is_torch(x):
        return x.contiguous()
    return x if x.flags.c_contiguous else x.copy(order="C")


def byte_view(x: Array) -> Array:
    """Local. Flat ``uint8`` view of a C-contiguous block (same memory, same backend)."""
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError("byte_view needs a C-contiguous array")
        return x.reshape(-1).view(np.uint8)
    if is_torch(x):
        import torch

        if not x.is_contiguous():
            raise ValueError("byte_view needs a contiguous tensor")
        flat = x.detach().reshape(-1)
        if flat.numel() <= 1 or flat.stride(0) != 1:  # size-0/1 dims leave any stride on a contiguous tensor
            flat = flat.as_strided((flat.numel(),), (1,))
        return flat.view(torch.uint8)
    if not x.flags.c_contiguous:
        raise ValueError("byte_view needs a C-contiguous array")
    import cupy as cp

    return x.reshape(-1).view(cp.uint8)


def copy_into(dst: Array, src: Array) -> None:
    """Local. ``dst[...] = src`` for blocks of the same backend (autograd-free for torch).

    ``dst`` must be a view (index 0-d arrays as ``x[(*slices, ...)]`` so numpy keeps a view)."""
    if is_torch(dst):
        import torch

        if _numpy_copyable(dst, src):  # (numpy's copy loops beat torch's single-threaded copy_ on the host)
            np.copyto(dst.detach().numpy(), src.detach().numpy())
            return
        with torch.no_grad():
            dst.copy_(src)
    else:
        dst[...] = src


def _numpy_copyable(dst: Any, src: Any) -> bool:
    """Both plain CPU torch tensors (subclasses such as fake tensors have no numpy view) of one dtype numpy has,
    neither conjugated nor negated lazily."""
    import torch

    return (
        is_torch(src)
        and type(dst) is torch.Tensor
        and type(src) is torch.Tensor
        and dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and str(dst.dtype) in _NUMPY_COPY_DTYPES
        and not (src.is_conj() or src.is_neg() or dst.is_conj() or dst.is_neg())
    )


_NUMPY_COPY_DTYPES = frozenset(
    f"torch.{name}"
    for name in (
        "float64",
        "float32",
        "float16",
        "complex128",
        "complex64",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
)


def flip(x: Array, dims: Sequence[int]) -> Array:
    """Local. ``x`` reversed along ``dims`` (a view for numpy and cupy, a copy for torch)."""
    if not dims:
        return x
    if is_torch(x):
        import torch

        return torch.flip(x, tuple(dims))
    return x[tuple(slice(None, None, -1) if d in dims else slice(None) for d in range(x.ndim))]


def from_bytes(flat: Array, dtype: object, shape: tuple[int, ...]) -> Array:
    """Local. View a flat ``uint8`` buffer (any backend) as an array of ``dtype`` and ``shape``."""
    if is_torch(flat):
        import torch

        if dtype == torch.bfloat16:
            return flat.view(torch.int16).view(torch.bfloat16).reshape(shape)
        return flat.view(dtype).reshape(shape)
    return flat.view(dtype).reshape(shape)


def pack(blocks: list[Array], like: Array) -> Array:
    """Local. Concatenate the bytes of ``blocks`` into one flat ``uint8`` buffer on ``like``'s backend."""
    views = [byte_view(as_contiguous(b)) for b in blocks]
    if isinstance(like, np.ndarray):
        return np.concatenate(views) if views else np.empty(0, dtype=np.uint8)
    if is_torch(like):
        import torch

        if views:
            return torch.cat(views)
        return torch.empty(0, dtype=torch.uint8, device=like.device)
    import cupy as cp

    return cp.concatenate(views) if views else cp.empty(0, dtype=cp.uint8)


def empty_bytes(n: int, like: Array) -> Array:
    """Local. A flat ``uint8`` buffer of ``n`` bytes on ``like``'s backend and device."""
    return empty_like_backend((n,), "uint8", like)


def astype(x: Array, dtype: object) -> Array:
    """Local. ``x`` converted to ``dtype`` (given in any backend's spelling), same backend and device."""
    name = backend_name(x)
    if name == "torch":
        return x.to(resolve_dtype(dtype, "torch"))
    return x.astype(resolve_dtype(dtype, name), copy=False)
