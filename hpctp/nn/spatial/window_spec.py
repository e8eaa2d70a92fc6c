"""The arguments of a strided window op (convolution, transposed convolution, pooling), checked once.

A :class:`WindowSpec` holds what a window op takes besides its tensors: stride, padding,
dilation, padding mode and groups, a pooling kernel and the pooling options, normalised to
tuples and validated when it is built (by a layer in ``__init__``, by the functional API on
each call; on every rank, before any message). The window engine (:mod:`hpctp.nn.spatial._window`)
reads it; :meth:`WindowSpec.windows` resolves it against the global input (and a
convolution's kernel, which is its weight's) into one :class:`DimWindow` per spatial dim,
with the checks that need the input's size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..._util.ints import is_int

__all__ = ["DimWindow", "WindowSpec", "ntuple"]

# padding_mode (torch's names) -> boundary condition of the halo fetch
_BOUNDARY = {"zeros": "zero", "circular": "periodic", "reflect": "reflect", "replicate": "replicate"}


def ntuple(v: object, nd: int, name: str, minimum: int = 1) -> tuple[int, ...]:
    """Local. An int or a length-``nd`` sequence of ints as a tuple (validated).

    Raises
    ------
    ValueError
        Naming ``name`` and ``v``: not an int or ``nd`` ints, or an entry below ``minimum``.
    """
    items = (v,) * nd if is_int(v) else tuple(v)  # type: ignore[arg-type]
    if len(items) != nd or not all(is_int(i) for i in items):
        raise ValueError(f"{name}={v!r} must be an int or {nd} ints")
    if any(i < minimum for i in items):
        raise ValueError(f"{name}={v!r} must be >= {minimum}")
    return tuple(int(i) for i in items)


class DimWindow(NamedTuple):
    """Local. One spatial dim of a window op on the global field."""

    extent: int  # input cells one window spans: dilation * (kernel - 1) + 1
    stride: int
    pad_lo: int
    pad_hi: int
    size: int  # global output length


@dataclass(frozen=True)
class WindowSpec:
    """Local. The non-tensor arguments of a window op, normalised (build it with a classmethod).

    ``kind`` is ``"conv"``, ``"conv_transpose"``, ``"max"`` or ``"avg"``; ``padding`` one int
    per spatial dim per side, unless ``same`` (a convolution with ``padding="same"``: the
    padding follows from the kernel); ``kernel`` is the pooling window (``()`` for
    convolutions, whose kernel is their weight's).
    """

    kind: str
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    same: bool = False
    kernel: tuple[int, ...] = ()
    groups: int = 1
    padding_mode: str = "zeros"
    output_padding: tuple[int, ...] = ()
    ceil_mode: bool = False
    count_include_pad: bool = True
    divisor_override: int | None = None

    @property
    def nd(self) -> int:
        """Local. The number of spatial dims."""
        return len(self.stride)

    @property
    def boundary(self) -> str:
        """Local. The halo fetch's boundary condition outside the global field (from ``padding_mode``)."""
        return _BOUNDARY[self.padding_mode]

    @classmethod
    def conv(
        cls, nd: int, stride: object, padding: object, dilation: object, groups: object, padding_mode: str
    ) -> WindowSpec:
        """Local. The spec of ``convNd`` (arguments as ``torch.nn.functional.conv2d``'s).

        Raises
        ------
        ValueError
            On an unknown ``padding_mode``, ``groups`` below 1, a bad stride, dilation or
            padding, or ``padding="same"`` with a stride.
        """
        if padding_mode not in _BOUNDARY:
            raise ValueError(f"padding_mode must be one of {sorted(_BOUNDARY)}, got {padding_mode!r}")
        g = _groups(groups)
        s, dil = ntuple(stride, nd, "stride"), ntuple(dilation, nd, "dilation")
        same = isinstance(padding, str) and padding == "same"
        if isinstance(padding, str) and padding not in ("same", "valid"):
            raise ValueError(f"padding must be 'same', 'valid', an int or ints, got {padding!r}")
        if same and any(v != 1 for v in s):
            raise ValueError("padding='same' is not supported for strided convolutions")
        pad = (0,) * nd if isinstance(padding, str) else ntuple(padding, nd, "padding", 0)
        return cls("conv", s, pad, dil, same=same, groups=g, padding_mode=padding_mode)

    @classmethod
    def conv_transpose(
        cls, nd: int, stride: object, padding: object, output_padding: object, groups: object, dilation: object
    ) -> WindowSpec:
        """Local. The spec of ``conv_transposeNd`` (arguments as torch's, in its order).

        Raises
        ------
        ValueError
            On ``groups`` below 1, a bad stride, padding or dilation, or an ``output_padding``
            not smaller than the stride or the dilation.
        """
        g = _groups(groups)
        s, dil = ntuple(stride, nd, "stride"), ntuple(dilation, nd, "dilation")
        p, opad = ntuple(padding, nd, "padding", 0), ntuple(output_padding, nd, "output_padding", 0)
        if any(o >= max(a, b) for o, a, b in zip(opad, s, dil)):
            raise ValueError(f"output_padding={opad} must be smaller than stride {s} or dilation {dil}")
        return cls("conv_transpose", s, p, dil, groups=g, output_padding=opad)

    @classmethod
    def max_pool(
        cls, nd: int, kernel_size: object, stride: object, padding: object, dilation: object, ceil_mode: bool
    ) -> WindowSpec:
        """Local. The spec of ``max_poolNd`` (``stride`` None or empty: the kernel size, as torch).

        Raises
        ------
        ValueError
            On a bad kernel size, stride, padding or dilation, or padding above half the kernel.
        """
        k, s, p = _pool_geometry(nd, kernel_size, stride, padding)
        return cls("max", s, p, ntuple(dilation, nd, "dilation"), kernel=k, ceil_mode=bool(ceil_mode))

    @classmethod
    def avg_pool(
        cls,
        nd: int,
        kernel_size: object,
        stride: object,
        padding: object,
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: object,
    ) -> WindowSpec:
        """Local. The spec of ``avg_poolNd`` (2-D and 3-D; ``stride`` None or empty: the kernel size).

        Raises
        ------
        ValueError
            On a bad kernel size, stride or padding, padding above half the kernel, a
            ``divisor_override`` that is not a non-zero int, or ``nd`` other than 2 and 3.
        """
        k, s, p = _pool_geometry(nd, kernel_size, stride, padding)
        if nd == 1:
            raise ValueError("avg pooling is provided for 2-D and 3-D fields")
        if divisor_override is not None and (not is_int(divisor_override) or divisor_override == 0):
            raise ValueError(f"divisor_override must be a non-zero int or None, got {divisor_override!r}")
        div = None if divisor_override is None else int(divisor_override)
        return cls(
            "avg", s, p, (1,) * nd, kernel=k, ceil_mode=bool(ceil_mode),
            count_include_pad=bool(count_include_pad), divisor_override=div,
        )  # fmt: skip

    def windows(self, sizes: Sequence[int], kernel: Sequence[int] = ()) -> tuple[DimWindow, ...]:
        """Local. One :class:`DimWindow` per spatial dim of a global input of spatial ``sizes``.

        Parameters
        ----------
        sizes : sequence of int
            The global input's spatial sizes.
        kernel : sequence of int
            A convolution's kernel (its weight's spatial dims); pooling uses its own.

        Returns
        -------
        tuple of DimWindow

        Raises
        ------
        ValueError
            On an input smaller than a window, padding beyond torch's limits for the padding
            mode, or (max pooling) a window that covers only padding.
        """
        if self.kind == "conv":
            return tuple(self._conv_window(d, n, k) for d, (n, k) in enumerate(zip(sizes, kernel)))
        if self.kind in ("max", "avg"):
            return tuple(self._pool_window(d, n) for d, n in enumerate(sizes))
        raise TypeError(f"windows() is for convolutions and pooling, not {self.kind!r} (see transposed_sizes)")

    def transposed_sizes(self, sizes: Sequence[int], kernel: Sequence[int]) -> tuple[int, ...]:
        """Local. The global spatial output sizes of the transposed convolution of an input of ``sizes``.

        Raises
        ------
        ValueError
            If an output size is below 1.
        """
        out = []
        for d, (n, k) in enumerate(zip(sizes, kernel)):
            s, p, dil = self.stride[d], self.padding[d], self.dilation[d]
            m = (n - 1) * s - 2 * p + dil * (k - 1) + self.output_padding[d] + 1
            if m < 1:
                raise ValueError(f"spatial dim {d}: the transposed convolution output size {m} is < 1")
            out.append(m)
        return tuple(out)

    def _conv_window(self, d: int, n: int, k: int) -> DimWindow:
        if self.same:  # as torch: the extra cell of an odd span on the high side
            span = self.dilation[d] * (k - 1)
            lo, hi = span // 2, span - span // 2
        else:
            lo = hi = self.padding[d]
        _check_padding_mode(self.padding_mode, (lo, hi), n, d)
        ext = self.dilation[d] * (k - 1) + 1
        m = n + lo + hi - ext
        if m < 0:
            raise ValueError(f"spatial dim {d}: input size {n} (padded) is smaller than the kernel extent {ext}")
        return DimWindow(ext, self.stride[d], lo, hi, m // self.stride[d] + 1)

    def _pool_window(self, d: int, n: int) -> DimWindow:
        k, s, p, dil = self.kernel[d], self.stride[d], self.padding[d], self.dilation[d]
        ext = dil * (k - 1) + 1
        if self.kind == "avg" and self.nd == 3 and n < k:  # torch's avg_pool3d rule (padding not counted)
            raise ValueError(f"spatial dim {d}: input size {n} is smaller than kernel_size {k} (as torch's avg_pool3d)")
        num = n + 2 * p - ext + (s - 1 if self.ceil_mode else 0)
        if num < 0:
            raise ValueError(f"spatial dim {d}: input size {n} is too small for pooling with kernel extent {ext}")
        out = num // s + 1
        if self.ceil_mode and (out - 1) * s >= n + p:
            out -= 1
        if self.kind == "max" and (empty := _padding_only_window(n, k, s, p, dil, out)) is not None:
            raise ValueError(
                f"spatial dim {d}: max-pooling window {empty} covers only padding (input size {n}, kernel_size "
                f"{k}, stride {s}, padding {p}, dilation {dil}); torch gives -inf there and its "
                f"backward writes out of bounds. Use less padding or dilation"
            )
        return DimWindow(ext, s, p, p, out)


def _groups(groups: object) -> int:
    if not is_int(groups) or groups < 1:
        raise ValueError(f"groups must be an int >= 1, got {groups!r}")
    return int(groups)


def _pool_geometry(
    nd: int, kernel_size: object, stride: object, padding: object
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Kernel, stride (default: the kernel) and padding of a pooling op, validated as torch does."""
    k = ntuple(kernel_size, nd, "kernel_size")
    default = stride is None or (not is_int(stride) and len(stride) == 0)  # type: ignore[arg-type]
    s = k if default else ntuple(stride, nd, "stride")
    p = ntuple(padding, nd, "padding", 0)
    if any(2 * pp > kk for pp, kk in zip(p, k)):  # as torch: half the kernel size, dilation or not
        raise ValueError(f"pad should be at most half of the kernel size, got padding={p}, kernel_size={k}")
    return k, s, p


def _check_padding_mode(mode: str, pad: tuple[int, int], n: int, d: int) -> None:
    """torch's limits for padded convolutions: a reflection needs padding < size, a wrap padding <= size.

    (:func:`~hpctp.nn.functional.halo_pad` goes beyond them, as ``numpy.pad``; the layers agree with torch.)
    """
    p = max(pad)
    if (mode == "reflect" and 0 < p and p >= n) or (mode == "circular" and p > n):
        need = "smaller than" if mode == "reflect" else "at most"
        raise ValueError(
            f"padding_mode={mode!r}: padding {pad} of spatial dim {d} must be {need} its size {n} (as in torch); "
            f"use less padding or padding_mode='zeros'/'replicate'"
        )


@functools.lru_cache(maxsize=256)
def _padding_only_window(n: int, k: int, s: int, p: int, dil: int, out: int) -> int | None:
    """Index of the first of ``out`` pooling windows without an input cell (None if all have one)."""
    pos = (np.arange(out) * s - p)[:, None] + np.arange(k) * dil
    empty = np.flatnonzero(~((pos >= 0) & (pos < n)).any(axis=1))
    return int(empty[0]) if empty.size else None
