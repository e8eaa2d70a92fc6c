"""hpctp.pad / np.pad and hpctp.broadcast_to / np.broadcast_to against numpy on the gathered
tensor (values, layouts) and torch (gradients)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.checks import Checks
from helpers.tensors import SHAPE, check_gradient, global_array, make_tensor, splits_for

import hpctp
from hpctp.tensor.functions.pad import pad_runs
from hpctp.testing import assert_all, assert_equal

COPYING = ["edge", "wrap", "reflect", "symmetric"]
WIDTHS = [1, (0, 2), ((3, 0), (0, 0), (1, 2)), ((9, 1), (6, 7), (0, 13))]  # also wider than the dim


# ---------------------------------------------------------------------------- pure
@pytest.mark.parametrize("mode", COPYING)
def test_runs_spell_out_numpys_rows(mode: str) -> None:
    """The runs list exactly the rows numpy.pad copies, in few pieces: three at most when the pads
    fit in the dim (slices and one repeated row)."""
    for n in (1, 2, 3, 7):
        for before, after in ((0, 0), (1, 0), (0, 2), (2, 3), (n, n), (3 * n + 1, 2 * n)):
            if mode == "reflect" and n == 1 and before + after > 0:
                continue  # numpy: reflecting a single row repeats it (edge); covered below
            runs = pad_runs(n, before, after, mode)
            rows = [first + step * k for first, step, count in runs for k in range(count)]
            want = np.pad(np.arange(n), (before, after), mode=mode).tolist()  # type: ignore[call-overload]
            assert rows == want, (mode, n, before, after, runs)
            if max(before, after) < n:
                assert len(runs) <= 3, (mode, n, before, after, runs)
    assert pad_runs(1, 2, 1, "reflect") == [(0, 0, 4)]


# ---------------------------------------------------------------------------- values
@pytest.mark.mpi
@pytest.mark.parametrize("skew", [False, True])
def test_pad_equals_numpy(grid2d: hpctp.ProcessGrid, skew: bool) -> None:
    with Checks(grid2d) as check:
        a = global_array(SHAPE)
        for split in splits_for(grid2d):
            x = make_tensor(grid2d, split, skew)
            for width in WIDTHS:
                for mode in ["constant", *COPYING]:
                    y = np.pad(x, width, mode=mode)  # numpy's protocol
                    what = f"np.pad({width}, {mode}) split={split} skew={skew}"
                    check.true(isinstance(y, hpctp.DistTensor) and y.split == x.split, f"{what}: split kept")
                    check.equal(y.gather(None), np.pad(a, width, mode=mode), what)
            values = ((1.5, -2.0), (7.0, 8.0), (np.nan, -np.inf))  # numpy: later dims win the corners
            y = hpctp.pad(x, ((2, 1), (1, 3), (1, 1)), constant_values=values)
            check.equal(y.gather(None), np.pad(a, ((2, 1), (1, 3), (1, 1)), constant_values=values), "values")
            y = hpctp.pad(x, 2, mode="empty")
            check.true(y.shape == (11, 9, 10), "empty mode: the shape")


@pytest.mark.mpi
def test_pad_keeps_dtype_and_backend(grid2d: hpctp.ProcessGrid) -> None:
    a = global_array(SHAPE)
    for backend in ("numpy", "torch"):
        for dtype, want in (("int32", a.astype(np.int32)), ("bool", a.astype(bool)), ("complex128", a * (1 - 2j))):
            x = make_tensor(grid2d, (0, 1, None), True, backend)
            x = x * (1 - 2j) if dtype == "complex128" else x.astype(dtype)
            for mode, kw in (("constant", {"constant_values": 1.7}), ("symmetric", {}), ("wrap", {})):
                y = hpctp.pad(x, ((1, 2), (2, 0), (0, 1)), mode=mode, **kw)  # type: ignore[arg-type]
                ok = type(y.local) is type(x.local) and y.local.dtype == x.local.dtype
                assert_all(grid2d, ok, f"{backend} {dtype} {mode}: blocks of the input's kind")
                ref = np.pad(want, ((1, 2), (2, 0), (0, 1)), mode=mode, **kw)  # type: ignore[call-overload]
                assert_equal(grid2d, np.asarray(y.to("numpy").gather(None)), ref, f"{backend} {dtype} {mode}")


def _torch_pad(t: torch.Tensor, width: tuple[tuple[int, int], ...], mode: str) -> torch.Tensor:
    """A differentiable torch reference: constant pads with torch.nn.functional.pad, the copying
    modes as index_select of the rows numpy.pad picks from arange (dim by dim, as numpy)."""
    if mode == "constant":
        flat = [w for pair in reversed(width) for w in pair]
        return torch.nn.functional.pad(t, flat, value=2.5)
    for d, (before, after) in enumerate(width):
        rows = np.pad(np.arange(t.shape[d]), (before, after), mode=mode)  # type: ignore[call-overload]
        t = t.index_select(d, torch.from_numpy(rows))
    return t


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["constant", *COPYING])
def test_pad_gradient(grid2d: hpctp.ProcessGrid, mode: str) -> None:
    width = ((2, 9), (1, 0), (0, 2))
    kw = {"constant_values": 2.5} if mode == "constant" else {}
    for skew in (False, True):
        check_gradient(
            grid2d,
            lambda x: hpctp.pad(x, width, mode=mode, **kw),  # type: ignore[arg-type]
            lambda t: _torch_pad(t, width, mode),
            skew,
            f"pad {mode}",
        )


# ---------------------------------------------------------------------------- broadcast_to
@pytest.mark.mpi
def test_broadcast_to_equals_numpy(grid2d: hpctp.ProcessGrid) -> None:
    a = global_array(SHAPE)
    for skew in (False, True):
        for split in splits_for(grid2d):
            x = make_tensor(grid2d, split, skew)
            for key, shape in (
                ((slice(2, 3),), (4, 5, 6)),  # a divided size-1 dim is replicated first
                ((slice(None), slice(1, 2), slice(0, 1)), (2, 7, 3, 4)),
                ((), (1, 7, 5, 6)),
            ):
                y = np.broadcast_to(x[key], shape)
                what = f"broadcast_to {key} -> {shape} split={split} skew={skew}"
                lead = len(shape) - 3
                assert_all(grid2d, y.split == (None,) * lead + x.split, f"{what}: split kept")
                assert_equal(grid2d, y.gather(None), np.broadcast_to(a[key], shape), what)


@pytest.mark.mpi
def test_broadcast_to_gradient(grid2d: hpctp.ProcessGrid) -> None:
    for skew in (False, True):
        check_gradient(
            grid2d,
            lambda x: hpctp.broadcast_to(x[1:2, :, 4:5], (3, 4, 5, 2)),
            lambda t: t[1:2, :, 4:5].expand(3, 4, 5, 2),
            skew,
            "broadcast_to",
        )


# ---------------------------------------------------------------------------- errors
@pytest.mark.mpi
def test_bad_arguments_raise_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    x = make_tensor(grid2d, (0, 1, None), False)
    cases = [
        (lambda: hpctp.pad(x, 1, mode="mean"), ValueError, "not supported"),
        (lambda: hpctp.pad(x, -1), ValueError, "negative"),
        (lambda: hpctp.pad(x, 1.5), TypeError, "ints"),
        (lambda: hpctp.pad(x, ((1, 2), (3, 4))), ValueError, "broadcast"),
        (lambda: hpctp.pad(x, 1, mode="reflect", reflect_type="odd"), ValueError, "odd"),
        (lambda: hpctp.pad(x[:, :0], 1, mode="edge"), ValueError, "empty axis"),
        (lambda: hpctp.pad(x, 1, constant_values="a"), TypeError, "numbers"),
        (lambda: np.pad(x, 1, mode="edge", constant_values=3), ValueError, "unsupported keyword"),
        (lambda: hpctp.broadcast_to(x, (2, 7, 1, 6)), ValueError, "cannot be broadcast"),
        (lambda: hpctp.broadcast_to(x, (5, 6)), ValueError, "cannot be broadcast"),
        (lambda: hpctp.broadcast_to(x, (7, 5, -6)), ValueError, "non-negative"),
        (lambda: hpctp.broadcast_to(np.ones(3), (3,)), TypeError, "DistTensor"),
    ]
    for call, kind, words in cases:
        with pytest.raises(kind, match=words):
            call()
    width = 1 + grid2d.rank % 2  # ranks passing different widths: refused, not a mismatched move
    if grid2d.size > 1:
        with pytest.raises(ValueError, match="pad_width"):
            hpctp.pad(x, width)


@pytest.mark.mpi
def test_torch_functional_pad(grid2d: hpctp.ProcessGrid) -> None:
    """F.pad on a DistTensor: pairs for the last dims first, torch's mode names, differentiable."""
    ref = torch.from_numpy(global_array(SHAPE)[None])  # (torch's reflect/replicate/circular take a batch dim)
    for mode, value in (("constant", 1.25), ("reflect", None), ("replicate", None), ("circular", None)):
        x = make_tensor(grid2d, (0, 1, None), True, "torch")
        x.local.requires_grad_(True)
        y = torch.nn.functional.pad(x, (2, 1, 0, 3), mode=mode, value=value)
        want = torch.nn.functional.pad(ref, (2, 1, 0, 3), mode=mode, value=value)[0]
        assert_equal(grid2d, y.gather(None).detach(), want, f"F.pad {mode}")
        (y.local * 1.5).sum().backward()
        r = ref.clone().requires_grad_(True)
        (torch.nn.functional.pad(r, (2, 1, 0, 3), mode=mode, value=value) * 1.5).sum().backward()
        assert_equal(grid2d, x.local.grad, r.grad[0][x.local_slices], f"F.pad {mode} gradient")
