"""The applications against single-process references: the simulation against a numpy
implementation, distributed training against plain torch on the gathered fields."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.layouts import make_layout

import hpctp
from apps.common.config import load_config
from apps.simulate.grayscott import GrayScott, initial_state
from apps.simulate.run import save_snapshots, simulate
from apps.surrogate.data import open_pairs
from apps.surrogate.fronts import gradient_error
from apps.surrogate.models import build_model
from apps.surrogate.spectrum import band_errors, high_band_loss, high_band_mask
from apps.surrogate.train import fit_delta_scale, make_optimizer, train_step
from hpctp.cli.log import get_logger
from hpctp.io import FieldLoader
from hpctp.nn import check_replicas
from hpctp.testing import assert_all, assert_allclose

TINY = Path(__file__).resolve().parent.parent / "apps" / "configs" / "tiny.toml"


def _numpy_grayscott(state: np.ndarray, m: GrayScott, steps: int) -> np.ndarray:
    x = state.copy()
    for _ in range(steps):
        u, v = x[0], x[1]
        lap = np.roll(x, 1, 1) + np.roll(x, -1, 1) + np.roll(x, 1, 2) + np.roll(x, -1, 2) - 4 * x
        uvv = u * v * v
        x = np.stack(
            [
                u + m.dt * (m.du * lap[0] - uvv + m.feed * (1 - u)),
                v + m.dt * (m.dv * lap[1] + uvv - (m.feed + m.kill) * v),
            ]
        )
    return x


@pytest.mark.mpi
def test_simulation_matches_single_process_numpy(grid2d: hpctp.ProcessGrid) -> None:
    m = GrayScott()
    state = initial_state((13, 10), grid2d, seed=4, seeds=3)
    start = state.gather(None)
    m.step(state, 25)
    assert_allclose(grid2d, state.gather(None), _numpy_grayscott(start, m, 25), rtol=1e-12, atol=1e-14)
    with hpctp.ProcessGrid([1] * 2, comm=grid2d.comm.Split(grid2d.rank, 0)) as solo:
        ref0 = initial_state((13, 10), solo, seed=4, seeds=3).local
    assert_allclose(grid2d, start, ref0, rtol=0, what="initial state independent of the grid")


@pytest.mark.mpi
@pytest.mark.parametrize("model", ["unet", "fno", "vit"])
def test_training_matches_single_process_torch(
    grid2d: hpctp.ProcessGrid, tmp_path_factory: pytest.TempPathFactory, model: str
) -> None:
    weight = 0.5 if model == "fno" else 0.0  # the FNO run also trains on the high-wavenumber term
    cfg = load_config(TINY, ["simulation.size=[12, 10]", f"surrogate.model={model}", f"train.spectral_weight={weight}"])
    if model == "vit":  # 6 x 5 tokens of 2 x 2 patches (cut inside a patch on 2x2, 1x4, 3 ranks); ring attention
        cfg["surrogate"].update(patch=2, embed=8, depth=2, heads=2, mlp_ratio=2.0, attention="global", schedule="ring")
    cfg["simulation"]["grid"] = list(grid2d.dims)
    tmp = np.zeros(256, dtype=np.uint8)  # one directory for all ranks, chosen by rank 0
    if grid2d.rank == 0:
        raw = str(tmp_path_factory.mktemp("train")).encode()
        tmp[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    grid2d.comm.Bcast(tmp, root=0)
    path = str(Path(tmp.tobytes().rstrip(b"\0").decode()) / "sim.h5")
    log = get_logger("test", grid2d)
    save_snapshots(simulate(cfg["simulation"], grid2d, log, progress=False), path, cfg["simulation"])

    model = build_model(cfg["surrogate"], 2, grid2d)
    ref = build_model(cfg["surrogate"], 2, None)  # plain torch layers, same initial weights
    opt, ref_opt = make_optimizer(model, cfg), make_optimizer(ref, cfg)
    pairs = open_pairs(path, grid2d, cfg, "train")
    scale = fit_delta_scale(model, pairs, grid2d)
    ref.delta_scale.fill_(scale)
    loader = FieldLoader(pairs, 2, shuffle=True, seed=0)
    losses, ref_losses = [], []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for x, y in loader:
            losses.append(train_step(model, opt, x, y, grid2d, cfg["train"]["spectral_weight"]))
            gx, gy = x.gather(None), y.gather(None)
            ref_opt.zero_grad()
            pred = ref(gx.to(torch.float64))
            loss = torch.nn.functional.mse_loss(pred, gy.to(torch.float64))
            if weight:
                loss = loss + weight * _high_band_ref(pred, gy.to(torch.float64))
            loss.backward()
            ref_opt.step()
            ref_losses.append(float(loss.detach()))
    pairs.close()
    assert len(losses) >= 4 and losses[-1] < losses[0], f"loss does not decrease: {losses}"
    assert_allclose(grid2d, losses, ref_losses, rtol=1e-8, what="loss curve vs single-process torch")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_allclose(grid2d, p.detach(), q.detach(), rtol=1e-8, atol=1e-12, what=f"parameter {name}")
    assert math.isfinite(losses[-1])
    drift = check_replicas(model, grid2d)
    assert_all(grid2d, drift == {}, f"replicated parameters differ bitwise after training: {drift}")


def _high_band_ref(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean square of the high-band-filtered error, filtered by inverse FFT (no Parseval weights)."""
    h, w = pred.shape[2:]
    mask, _ = high_band_mask((h, w), slice(None), slice(None))
    spec = torch.fft.rfftn(pred - target, dim=(2, 3)) * torch.as_tensor(mask, dtype=pred.dtype)
    return torch.fft.irfftn(spec, s=(h, w), dim=(2, 3)).square().mean()


@pytest.mark.mpi
def test_high_band_loss_and_gradient(grid2d: hpctp.ProcessGrid) -> None:
    """The distributed loss term (hpctp.fft autograd on uneven blocks) equals the filtered-error
    reference on the gathered fields, and so does its gradient."""
    shape = (2, 3, 12, 10)
    gen = torch.Generator().manual_seed(6)
    truth = torch.randn(*shape, dtype=torch.float64, generator=gen)
    pred = truth + 0.1 * torch.randn(*shape, dtype=torch.float64, generator=gen)
    lay = make_layout(grid2d, shape, (None, None, 0, 1), skew=True)
    sl = lay.local_slices(grid2d.coords)
    block = pred[sl].clone().requires_grad_(True)
    got = high_band_loss(block, truth[sl], grid2d, lay)
    got.backward()
    leaf = pred.clone().requires_grad_(True)
    want = _high_band_ref(leaf, truth)
    want.backward()
    assert_allclose(grid2d, got.detach(), want.detach(), rtol=1e-12, what="high-band loss")
    assert_allclose(grid2d, block.grad, leaf.grad[sl], rtol=1e-10, atol=1e-15, what="its gradient")
    one = high_band_loss(pred, truth)  # the single-process path
    assert_allclose(grid2d, one, want.detach(), rtol=1e-12, what="single-process path")


@pytest.mark.mpi
def test_band_errors_match_numpy_on_the_gathered_fields(grid2d: hpctp.ProcessGrid) -> None:
    """The distributed wavenumber-band errors (hpctp.fft) equal the norms of the band-filtered
    error (numpy on the whole field) over the truth's norm, and add up to the relative L2 error."""
    shape = (2, 2, 12, 10)
    gen = np.random.default_rng(5)
    truth = gen.standard_normal(shape)
    pred = truth + 0.1 * gen.standard_normal(shape)
    lay = hpctp.Layout(shape, grid2d.dims, (None, None, 0, 1))
    sl = lay.local_slices(grid2d.coords)

    def dist(a: np.ndarray) -> hpctp.DistTensor:
        return hpctp.DistTensor(torch.from_numpy(np.ascontiguousarray(a[sl])), grid2d, lay)

    low, high = band_errors(dist(pred), dist(truth))
    mask, _ = high_band_mask((12, 10), slice(None), slice(None))
    want = []
    for band in (~mask, mask):  # the band-filtered error field, by inverse FFT
        keep = np.zeros((12, 6))
        keep[band] = 1.0
        filtered = np.fft.irfft2(np.fft.rfft2(pred - truth) * keep, s=(12, 10))
        want.append(np.linalg.norm(filtered) / np.linalg.norm(truth))
    assert_allclose(grid2d, np.array([low, high]), np.array(want), rtol=1e-12, what="band errors")
    total = np.linalg.norm(pred - truth) / np.linalg.norm(truth)
    assert_allclose(grid2d, np.hypot(low, high), total, rtol=1e-12, what="bands add up to the L2 error")


@pytest.mark.mpi
def test_gradient_error_matches_numpy_on_the_gathered_fields(grid2d: hpctp.ProcessGrid) -> None:
    """The distributed gradient error (np.roll on DistTensors) equals numpy's on the whole fields."""
    shape = (2, 2, 11, 9)
    gen = np.random.default_rng(7)
    truth = gen.standard_normal(shape)
    pred = truth + 0.1 * gen.standard_normal(shape)
    lay = hpctp.Layout(shape, grid2d.dims, (None, None, 0, 1 if grid2d.ndim > 1 else None))
    sl = lay.local_slices(grid2d.coords)

    def dist(a: np.ndarray) -> hpctp.DistTensor:
        return hpctp.DistTensor(torch.from_numpy(np.ascontiguousarray(a[sl])), grid2d, lay)

    def grad(a: np.ndarray) -> list[np.ndarray]:
        return [(np.roll(a, -1, d) - np.roll(a, 1, d)) / 2 for d in (2, 3)]

    num = sum((g**2).sum() for g in grad(pred - truth))
    den = sum((g**2).sum() for g in grad(truth))
    assert_allclose(
        grid2d, gradient_error(dist(pred), dist(truth)), np.sqrt(num / den), rtol=1e-12, what="gradient error"
    )


@pytest.mark.mpi
@pytest.mark.parametrize("model", ["cnn", "unet", "fno", "vit", "vit-neighborhood", "vit-tensor"])
def test_surrogates_built_on_meta_materialize_to_their_construction(grid2d: hpctp.ProcessGrid, model: str) -> None:
    """Every surrogate (the ViT also with its heads split over a tensor axis) built on the meta device allocates
    nothing and materializes, layer by layer, to the values of the model built for real, bitwise."""
    kind, _, variant = model.partition("-")
    cfg = load_config(TINY, [f"surrogate.model={kind}"])["surrogate"]
    if kind == "vit":
        cfg.update(patch=2, embed=8, depth=2, heads=4, mlp_ratio=2.0)
        cfg["attention"] = "neighborhood" if variant == "neighborhood" else "global"
        cfg["kernel_size"] = 3
    axis = min(range(2), key=lambda a: grid2d.dims[a]) if variant == "tensor" else None  # (<= 4 heads' ranks)
    real = build_model(cfg, 2, grid2d, tensor_axis=axis)
    with torch.device("meta"):
        meta = build_model(cfg, 2, grid2d, tensor_axis=axis)
    assert_all(grid2d, all(t.is_meta for t in meta.state_dict().values()), "allocated on meta")
    hpctp.nn.materialize(meta, seed=0)
    for name, value in real.state_dict().items():
        assert_all(grid2d, torch.equal(meta.state_dict()[name], value), f"{model}: {name}")
