"""Distributed FFTs (hpctp.fft) vs numpy.fft / torch.fft on the gathered tensor; pencil plans."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.layouts import make_layout, skewed_cuts

import hpctp
from hpctp import fft as F
from hpctp.comm import CommCounter
from hpctp.fft import FFTStep, fft_plan, normalize_fft_axes, step_layout
from hpctp.layout import Layout, grid_coords, redistribution_plan
from hpctp.testing import assert_all, assert_allclose

RTOL = 1e-12


# ----------------------------------------------------------------- plans (no MPI)
def test_pencil_plan_of_a_3d_field_on_a_2d_grid() -> None:
    """The classic pencil FFT: the whole dim first, then each divided dim swaps with a done one."""
    steps = fft_plan((0, 1, None), (8, 8, 8), (2, 2), (0, 1, 2))
    assert steps == (FFTStep(2, (0, 1, None)), FFTStep(0, (None, 1, 0)), FFTStep(1, (1, None, 0)))


def test_plan_parks_grid_axes_on_the_largest_untransformed_dim() -> None:
    steps = fft_plan((None, None, 0, 1), (2, 16, 9, 8), (2, 2), (2, 3))
    assert steps[0] == FFTStep(2, (None, 0, None, 1))  # channels (16) rather than batch (2)
    assert steps[1] == FFTStep(3, (None, 0, 1, None))  # then onto the transformed dim 2


def test_plan_order_constraints_and_size_one_axes() -> None:
    assert fft_plan((0, None), (6, 5), (2,), (0, 1), first=1)[0] == FFTStep(1, (0, None))  # rfftn: half axis first
    steps = fft_plan((None, 0), (6, 5), (2,), (0, 1), last=1)  # irfftn: the half axis last
    assert [s.axis for s in steps] == [0, 1] and steps[-1].split == (0, None)
    assert fft_plan((0, 1, 2), (4, 5, 3), (1, 1, 1), (0, 1, 2)) == tuple(FFTStep(a, (0, 1, 2)) for a in (0, 1, 2))
    # a size-1 grid axis is dropped from the dim that takes a real one
    assert fft_plan((0, 1), (4, 5), (2, 1), (0,)) == (FFTStep(0, (None, 0)),)


def test_plan_merges_grid_axes_when_every_dim_is_divided() -> None:
    """A 2-D field on a 2x2 grid runs in slabs over all 4 ranks; a 3-D field on 2x2x2 in
    pencils on a 4x2 grid; an unused size-1 axis between two is merged through. The dim
    holding the inner axis is transformed first, the other one taking the merged axis."""
    assert fft_plan((0, 1), (8, 8), (2, 2), (0, 1)) == (
        FFTStep(1, (0, None), (4,)),
        FFTStep(0, (None, 0), (4,)),
    )
    assert fft_plan((0, 1, 2), (8, 8, 8), (2, 2, 2), (0, 1, 2)) == (
        FFTStep(1, (0, None, 1), (4, 2)),
        FFTStep(0, (None, 0, 1), (4, 2)),
        FFTStep(2, (1, 0, None), (4, 2)),
    )
    assert fft_plan((0, 2), (8, 8), (2, 1, 3), (1,)) == (FFTStep(1, (0, None), (6,)),)
    assert fft_plan((0, 2), (8, 8), (2, 1, 3), (0, 1))[0] == FFTStep(1, (0, None), (6,))
    assert fft_plan((2, 0), (8, 8), (3, 1, 2), (0, 1), first=0)[0] == FFTStep(0, (None, 0), (6,))  # rfftn
    # a replicated axis that is not next to the divided one stays a replica axis
    assert fft_plan((0, 1), (8, 8), (2, 2, 3), (0,)) == (FFTStep(0, (None, 0), (4, 3)),)


@pytest.mark.parametrize(
    "split, shape, dims",
    [
        ((0, 1), (8, 9), (2, 3)),
        ((1, 0), (7, 8), (3, 2)),
        ((0, 1, 2), (6, 8, 4), (2, 2, 2)),
        ((0, 2), (9, 8), (3, 1, 2)),
    ],
)
def test_merged_moves_stay_within_grid_lines(split: tuple, shape: tuple, dims: tuple) -> None:
    """Every move of an every-dim-divided plan (the first one from the caller's grid, then
    between the steps) only exchanges data among ranks that differ in one grid axis."""
    steps = fft_plan(split, shape, dims, tuple(range(len(shape))))
    skewed = tuple(None if g is None else skewed_cuts(n, dims[g]) for n, g in zip(shape, split))
    for start in (Layout(shape, dims, split), Layout(shape, dims, split, skewed)):
        states = [start]
        for s in steps:  # as hpctp.fft runs them: each step's layout from the one before
            states.append(step_layout(states[-1], shape, s.split, s.grid_dims or dims))
        _check_lines(states)


def _check_lines(states: list) -> None:
    for src, dst in zip(states, states[1:]):
        assert dst.global_shape == src.global_shape
        axes = src.grid_dims
        for r in range(src.nranks):
            me = grid_coords(r, axes)
            for p in redistribution_plan(src, dst, r).sends:
                them = grid_coords(p.peer, axes)
                differ = [g for g in range(len(axes)) if me[g] != them[g]]
                assert len(differ) <= 1, f"{src} -> {dst}: rank {r} {me} sends to {p.peer} {them}"


def test_plan_refuses_a_divided_1d_tensor() -> None:
    with pytest.raises(ValueError, match=r"cannot transform dim 0 .* give the tensor another dim"):
        fft_plan((0,), (8,), (2,), (0,))
    assert fft_plan((0,), (8,), (1,), (0,)) == (FFTStep(0, (0,)),)  # one rank: whole


def test_normalize_fft_axes() -> None:
    assert normalize_fft_axes(None, 3) == (0, 1, 2)
    assert normalize_fft_axes(-1, 3) == (2,)
    assert normalize_fft_axes((2, np.int64(0)), 3) == (2, 0)
    with pytest.raises(ValueError, match="axis 0 is repeated"):
        normalize_fft_axes((0, -3), 3)
    with pytest.raises(ValueError, match="out of range"):
        normalize_fft_axes(3, 3)
    with pytest.raises(TypeError, match="axis entries must be ints"):
        normalize_fft_axes((0.0,), 3)
    with pytest.raises(ValueError, match="axes is empty"):
        normalize_fft_axes((), 3)


# ----------------------------------------------------------------- distributed vs numpy
# (shape, split, axes, norm): pencils, batch/channel dims, subsets, negative axes, norms
CASES = [
    ((6, 5, 7), (0, 1, None), None, None),
    ((2, 3, 9, 8), (None, None, 0, 1), (2, 3), "ortho"),
    ((7, 6, 4), (1, None, 0), (0, -1), "forward"),
    ((5, 9), (0, None), None, "backward"),
    ((3, 4, 5), (None, 0, 1), (1,), None),
    ((6, 7), (0, 1), None, None),  # divided along every dim: slabs over the merged grid
    ((5, 8), (1, 0), (1, 0), "ortho"),
]


def _block(grid: hpctp.ProcessGrid, a: np.ndarray, split: tuple, skew: bool) -> hpctp.DistTensor:
    lay = make_layout(grid, a.shape, split, skew)
    return hpctp.DistTensor(np.ascontiguousarray(a[lay.local_slices(grid.coords)]), grid, lay)


def _check_family(grid: hpctp.ProcessGrid, case: tuple, skew: bool) -> None:
    """fftn/ifftn and rfftn/irfftn of ``case`` equal numpy's on the gathered tensor and keep the layout."""
    shape, split, axes, norm = case
    a = np.random.default_rng(1).standard_normal(shape)
    x = _block(grid, a, split, skew)
    ax = normalize_fft_axes(axes, len(shape))
    last = ax[-1]
    for name, got, want in (
        ("fftn", F.fftn(x, axes, norm), np.fft.fftn(a, axes=ax, norm=norm)),
        ("rfftn", F.rfftn(x, axes, norm), np.fft.rfftn(a, axes=ax, norm=norm)),
    ):
        assert_all(grid, got.split == split, f"{name}: split {got.split}, expected the input's {split}")
        if name == "fftn":
            assert_all(grid, got.layout.cuts == x.layout.cuts, f"fftn cuts {got.layout.cuts} != {x.layout.cuts}")
        assert_allclose(grid, got.gather(None), want, rtol=RTOL, atol=1e-12, what=name)
        if name == "fftn":
            back = F.ifftn(got, axes, norm)
            assert_allclose(grid, back.gather(None), np.fft.ifftn(want, axes=ax, norm=norm), rtol=RTOL, atol=1e-12)
        else:
            back = F.irfftn(got, shape[last], axes, norm)
            assert_allclose(
                grid, back.gather(None), np.fft.irfftn(want, s=[shape[d] for d in ax], axes=ax, norm=norm),
                rtol=RTOL, atol=1e-12, what="irfftn",
            )  # fmt: skip
        assert_allclose(grid, back.gather(None).real, a, rtol=1e-10, atol=1e-12, what=f"{name} round trip")


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[0])) + f"-{c[2]}-{c[3]}")
@pytest.mark.parametrize("skew", [False, True], ids=["balanced", "skewed"])
def test_fftn_family_matches_numpy(grid2d: hpctp.ProcessGrid, case: tuple, skew: bool) -> None:
    _check_family(grid2d, case, skew)


# tensors divided along every dim by a 3-D grid (merged grid axes), and with replica axes
CASES_3D = [
    ((5, 6, 7), (0, 1, 2), None, None),
    ((6, 5, 4), (2, 0, 1), (0, 2), "ortho"),
    ((7, 6), (0, 2), None, None),
    ((6, 9), (2, 0), (1,), "forward"),
    ((4, 5), (1, None), None, None),
]


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES_3D, ids=lambda c: "x".join(map(str, c[0])) + f"-{c[1]}-{c[2]}")
@pytest.mark.parametrize("skew", [False, True], ids=["balanced", "skewed"])
def test_fftn_on_3d_grids(grid3d: hpctp.ProcessGrid, case: tuple, skew: bool) -> None:
    _check_family(grid3d, case, skew)


@pytest.mark.mpi
def test_torch_blocks_and_output_layouts(grid2d: hpctp.ProcessGrid) -> None:
    """torch blocks use torch.fft (complex128 out); out_split="any" skips the last move."""
    a = torch.randn(6, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, 1, None))
    x = x.to("torch")
    want = torch.fft.fftn(a)
    for out in ("same", "any", (None, 0, 1)):
        y = F.fftn(x, out_split=out)
        ok = isinstance(y.local, torch.Tensor) and y.local.dtype == torch.complex128
        assert_all(grid2d, ok, f"torch block of complex128, got {type(y.local).__name__}")
        assert_allclose(grid2d, y.gather(None), want, rtol=RTOL, atol=1e-12, what=f"out_split={out}")
        if out == (None, 0, 1):
            assert_all(grid2d, y.split == (None, 0, 1), f"split {y.split}")
    f = torch.randn(1, 2, 9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    fx = hpctp.distribute(f if grid2d.rank == 0 else None, grid2d, (None, None, 0, 1)).to("torch")
    got = F.rfftn(fx, axes=(2, 3))  # a moved grid axis may leave a rank no channel: an empty torch block
    assert_allclose(grid2d, got.gather(None), torch.fft.rfftn(f, dim=(2, 3)), rtol=RTOL, atol=1e-12, what="empty")
    r = F.irfftn(F.rfftn(x.astype(torch.float32)), n=7)
    assert_all(grid2d, r.local.dtype == torch.float32, f"float32 round trip gives {r.local.dtype}")
    assert_allclose(grid2d, r.gather(None), a.float(), rtol=1e-5, atol=1e-5, what="float32 round trip")


def _grad_check(grid: hpctp.ProcessGrid, shape: tuple, split: tuple, axes: tuple | None, out: object) -> None:
    """Gradients through every transform equal torch.fft's on the gathered tensor."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(*shape, dtype=torch.float64, generator=gen)
    lay = make_layout(grid, shape, split, skew=True)
    ax = normalize_fft_axes(axes, len(shape))
    n_last = shape[ax[-1]]
    cases = (
        ("fftn", lambda t: F.fftn(t, axes, out_split=out), lambda t: torch.fft.fftn(t, dim=ax)),
        ("rfftn", lambda t: F.rfftn(t, axes, out_split=out), lambda t: torch.fft.rfftn(t, dim=ax)),
        (
            "irfftn(rfftn)",
            lambda t: F.irfftn(F.rfftn(t, axes, "ortho"), n_last, axes, "ortho", out_split=out),
            lambda t: torch.fft.irfftn(
                torch.fft.rfftn(t, dim=ax, norm="ortho"), s=[shape[d] for d in ax], dim=ax, norm="ortho"
            ),
        ),  # fmt: skip
        (
            "ifftn(fftn * w)",
            lambda t: F.ifftn(F.fftn(t, axes) * 0.5j, axes, "forward", out_split=out),
            lambda t: torch.fft.ifftn(torch.fft.fftn(t, dim=ax) * 0.5j, dim=ax, norm="forward"),
        ),
    )
    for name, dist, ref in cases:
        leaf = a.clone().requires_grad_(True)
        want_y = ref(leaf)
        w = torch.randn(*want_y.shape, dtype=torch.complex128, generator=gen)
        (want_y * w.conj()).real.sum().backward()
        block = a[lay.local_slices(grid.coords)].clone().requires_grad_(True)
        y = dist(hpctp.DistTensor(block, grid, lay))
        ok = y.local.requires_grad
        assert_all(grid, ok, f"{name}: the result is not in the autograd graph")
        (y.local * w[y.local_slices].conj()).real.sum().backward()
        assert_allclose(grid, y.gather(None).detach(), want_y.detach(), rtol=RTOL, atol=1e-12, what=f"{name} value")
        got = hpctp.DistTensor(block.grad, grid, lay).gather(None)
        assert_allclose(grid, got, leaf.grad, rtol=RTOL, atol=1e-12, what=f"{name} gradient, {shape} split {split}")


@pytest.mark.mpi
@pytest.mark.parametrize("out", ["same", "any"])
def test_gradients_match_torch_fft(grid2d: hpctp.ProcessGrid, out: str) -> None:
    _grad_check(grid2d, (6, 5, 7), (0, 1, None), None, out)  # pencils
    _grad_check(grid2d, (2, 9, 8), (None, 0, 1), (1, 2), out)  # channels take the grid axes; empty blocks
    _grad_check(grid2d, (7, 6), (1, 0), None, out)  # divided along every dim: merged grid


@pytest.mark.mpi
def test_gradients_need_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    """A block that requires grad on some ranks only is refused on every rank (a backward
    there would wait forever); under no_grad nothing is recorded."""
    a = torch.randn(4, 6, dtype=torch.float64)
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, None))
    if grid2d.size > 1:
        x.local.requires_grad_(grid2d.rank == 0)
        with pytest.raises(ValueError, match="ranks passed different requires_grad"):
            F.fftn(x)
    x.local.requires_grad_(True)
    with torch.no_grad():
        y = F.fftn(x)
    assert_all(grid2d, not y.local.requires_grad, "no graph under torch.no_grad")


@pytest.mark.mpi
def test_messages_are_one_alltoallv_per_move(grid2d: hpctp.ProcessGrid) -> None:
    """One argument agreement, then one Alltoallv per layout change of the plan (none else)."""
    dims = grid2d.dims

    def moves(states: list) -> int:
        eff = [(g, tuple(a if a is not None and g[a] > 1 else None for a in s)) for g, s in states]
        return sum(p != q for p, q in zip(eff, eff[1:]))

    for shape, split in (((6, 5, 7), (0, 1, None)), ((6, 7), (0, 1))):
        a = np.random.default_rng(3).standard_normal(shape)
        x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, split)
        steps = fft_plan(x.split, x.global_shape, dims, tuple(range(len(shape))))
        states = [(dims, x.split)] + [(s.grid_dims or dims, s.split) for s in steps]
        merged = steps[-1].grid_dims is not None
        for out, extra in (("any", [(dims, x.split)] if merged else []), ("same", [(dims, x.split)])):
            with CommCounter() as c:
                F.fftn(x, out_split=out)
            want = moves(states + extra)
            got = c.calls.get("Alltoallv", 0)
            assert_all(grid2d, got == want, f"{shape} out_split={out}: {got} Alltoallv, expected {want} ({c.calls})")
            others = {k: v for k, v in c.calls.items() if k != "Alltoallv"}
            ok = set(others) <= {"Allgather"} and others.get("Allgather", 0) <= 1  # (none on 1 rank)
            assert_all(grid2d, ok, f"{shape}: one argument agreement only, got {others}")
        if dims == (2, 2):  # pencils move twice; slabs on the merged grid (the tensor returns) three times
            n = moves(states) if len(shape) == 3 else moves(states + [(dims, x.split)])
            assert_all(grid2d, n == (2 if len(shape) == 3 else 3), f"{shape} on 2x2: {n} moves")


@pytest.mark.mpi
def test_bad_arguments_raise_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    a = np.zeros((4, 6))
    x = hpctp.distribute(a if grid2d.rank == 0 else None, grid2d, (0, None))
    with pytest.raises(ValueError, match="norm must be"):
        F.fftn(x, norm="unitary")
    with pytest.raises(ValueError, match="out of range"):
        F.fftn(x, axes=(2,))
    with pytest.raises(TypeError, match="transforms real data"):
        F.rfftn(F.fftn(x))
    with pytest.raises(ValueError, match="must be an int >= 1"):
        F.irfftn(F.rfftn(x), n=0)
    if grid2d.size > 1:
        with pytest.raises(ValueError, match="ranks passed different axes"):
            F.fftn(x, axes=(grid2d.rank % 2,))
    with pytest.raises(TypeError, match="needs a hpctp.DistTensor"):
        F.fftn(a)  # type: ignore[arg-type]
    vec = hpctp.distribute(a[0] if grid2d.rank == 0 else None, grid2d, (1,))
    if grid2d.dims[1] > 1:
        with pytest.raises(ValueError, match="give the tensor another dim"):
            F.fftn(vec)
    else:  # a size-1 grid axis divides nothing
        assert_allclose(grid2d, F.fftn(vec).gather(None), np.fft.fft(a[0]), rtol=RTOL, atol=1e-12)
    empty = hpctp.distribute(np.zeros((0, 3)) if grid2d.rank == 0 else None, grid2d, (0, None))
    with pytest.raises(ValueError, match="cannot transform an empty dim"):
        F.fftn(empty)


# ----------------------------------------------------------------- shell-binned spectra
def _spectrum_ref(a: np.ndarray, axes: tuple | None) -> np.ndarray:
    """The shell spectrum from the full complex FFT of the gathered field (no half-spectrum
    weights), wavenumbers from numpy.fft.fftfreq."""
    ax = normalize_fft_axes(axes, a.ndim)
    power = np.abs(np.fft.fftn(a, axes=ax)) ** 2 / math.prod(a.shape[d] for d in ax) ** 2
    k2 = sum(
        (np.fft.fftfreq(a.shape[d], 1 / a.shape[d]) ** 2).reshape([-1 if e == d else 1 for e in range(a.ndim)])
        for d in ax
    )
    shells = np.rint(np.sqrt(np.broadcast_to(k2, a.shape))).astype(int)
    n_shells = int(round(math.sqrt(sum((a.shape[d] // 2) ** 2 for d in ax)))) + 1
    other = [d for d in range(a.ndim) if d not in ax]
    p = np.moveaxis(power, ax, range(len(other), a.ndim)).reshape(-1, math.prod(a.shape[d] for d in ax))
    s = np.moveaxis(shells, ax, range(len(other), a.ndim)).reshape(p.shape)
    out = np.stack([np.bincount(si, weights=pi, minlength=n_shells) for si, pi in zip(s, p)])
    return out.reshape(tuple(a.shape[d] for d in other) + (n_shells,))


SPECTRA = [
    ((6, 5, 7), (0, 1, None), None),
    ((2, 3, 9, 8), (None, None, 0, 1), (2, 3)),
    ((7, 6), (0, 1), None),  # divided along every dim
    ((4, 8, 5), (None, 0, 1), (-1, 1)),
]


@pytest.mark.mpi
@pytest.mark.parametrize("case", SPECTRA, ids=lambda c: "x".join(map(str, c[0])))
def test_radial_spectrum_matches_the_full_fft(grid2d: hpctp.ProcessGrid, case: tuple) -> None:
    shape, split, axes = case
    a = np.random.default_rng(7).standard_normal(shape)
    ax = normalize_fft_axes(axes, len(shape))
    want = _spectrum_ref(a, axes)
    mean_square = (a**2).mean(axis=ax)
    for name, x in (
        ("numpy", _block(grid2d, a, split, skew=True)),
        ("torch", _block(grid2d, a, split, skew=False).to("torch")),
        ("complex", _block(grid2d, a + 0.5j * a[::-1], split, skew=True)),
    ):
        got = F.radial_spectrum(x, axes)
        ref = want if name != "complex" else _spectrum_ref(a + 0.5j * a[::-1], axes)
        assert_allclose(grid2d, got, ref, rtol=RTOL, atol=1e-14, what=f"{name} spectrum of {shape} split {split}")
        if name == "numpy":  # Parseval: the shells add up to the mean square over the transformed axes
            assert_allclose(grid2d, got.sum(-1), mean_square, rtol=1e-12, what="Parseval")


@pytest.mark.mpi
def test_radial_spectrum_dtypes_and_3d_grids(grid3d: hpctp.ProcessGrid) -> None:
    a = np.random.default_rng(8).standard_normal((5, 6, 4))
    x = _block(grid3d, a, (0, 1, 2), skew=True)
    assert_allclose(grid3d, F.radial_spectrum(x), _spectrum_ref(a, None), rtol=RTOL, atol=1e-14, what="3-D grid")
    f32 = F.radial_spectrum(x.to("torch").astype(torch.float32))
    assert_allclose(grid3d, f32, _spectrum_ref(a.astype(np.float32), None), rtol=1e-5, atol=1e-7, what="float32")
    ints = (a * 10).astype(np.int64)
    got = F.radial_spectrum(_block(grid3d, ints, (2, None, 0), skew=False))
    assert_allclose(grid3d, got, _spectrum_ref(ints.astype(float), None), rtol=RTOL, atol=1e-12, what="int64")
    with pytest.raises(ValueError, match="out of range"):
        F.radial_spectrum(x, axes=(3,))


def test_wavenumbers_and_weights() -> None:
    assert F.wavenumbers(6).tolist() == [0, 1, 2, 3, 2, 1]
    assert F.wavenumbers(5).tolist() == [0, 1, 2, 2, 1]
    assert F.wavenumbers(6, half=True).tolist() == [0, 1, 2, 3]
    assert F.hermitian_weights(6).tolist() == [1, 2, 2, 1]
    assert F.hermitian_weights(5).tolist() == [1, 2, 2]


# ----------------------------------------------------------------- frequencies: spectral solvers
@pytest.mark.mpi
@pytest.mark.parametrize("out", ["same", "any"])
def test_poisson_solve_and_derivative_on_the_distributed_spectrum(grid2d: hpctp.ProcessGrid, out: str) -> None:
    """-lap(phi) = f on a periodic 2-D box (f of zero mean) and d/dx: with the frequencies of
    each rank's own block, no message beyond the FFTs', equal to numpy on the gathered field."""
    h, w, length = 12, 9, 2 * np.pi
    f = np.random.default_rng(9).standard_normal((h, w))
    f -= f.mean()
    ky = 2 * np.pi * np.fft.fftfreq(h, length / h)[:, None]
    kx = 2 * np.pi * np.fft.rfftfreq(w, length / w)[None, :]
    k2 = ky**2 + kx**2
    k2[0, 0] = 1.0
    want_phi = np.fft.irfftn(np.fft.rfftn(f) / k2, s=(h, w), axes=(0, 1))
    want_dx = np.fft.irfftn(1j * kx * np.fft.rfftn(f), s=(h, w), axes=(0, 1))
    for split, backend in (((0, 1), "numpy"), ((1, None), "torch")):  # every dim divided; one dim
        x = hpctp.distribute(f if grid2d.rank == 0 else None, grid2d, split).to(backend)
        spec = F.rfftn(x, out_split=out)
        fy, fx = (2 * np.pi * g for g in F.frequencies(spec, d=(length / h, length / w), n=w))  # angular
        kk = fy**2 + fx**2
        kk[kk == 0] = 1.0
        phi = F.irfftn(hpctp.DistTensor(spec.local / kk, spec.grid, spec.layout), n=w, out_split=split)
        dx = F.irfftn(hpctp.DistTensor(1j * fx * spec.local, spec.grid, spec.layout), n=w, out_split=split)
        assert_allclose(grid2d, phi.gather(None), want_phi, rtol=1e-12, atol=1e-13, what=f"Poisson {split}")
        assert_allclose(grid2d, dx.gather(None), want_dx, rtol=1e-12, atol=1e-13, what=f"d/dx {split}")
    full = F.fftn(x)
    got = F.frequencies(full, axes=(1, 0), d=0.5)
    ok = got[0].shape == (1, full.local.shape[1]) and got[1].shape == (full.local.shape[0], 1)
    sl = full.local_slices
    ok = ok and np.allclose(np.asarray(got[0]).ravel(), np.fft.fftfreq(w, 0.5)[sl[1]])
    assert_all(grid2d, ok, "full-spectrum frequencies of the block, in axes order, broadcast shapes")
    with pytest.raises(ValueError, match=r"n=7 does not fit axis 1 of length 5: .* \(n = 8 or 9\)"):
        F.frequencies(spec, n=7)
    with pytest.raises(ValueError, match="one spacing per axis"):
        F.frequencies(spec, d=(1.0, 2.0, 3.0), n=w)
    with pytest.raises(TypeError, match="needs a hpctp.DistTensor"):
        F.frequencies(f)  # type: ignore[arg-type]
