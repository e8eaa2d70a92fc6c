"""The surrogate's training on data x pipeline x spatial (x tensor) grids, with each ZeRO stage: the loss curve of
one plan equals every other plan's (float64), a run resumes on another grid shape and stage, and the
config's parallelism keys are validated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import hpctp
from apps.common.config import load_config
from apps.simulate.run import save_snapshots, simulate
from apps.surrogate.parallel import TrainingSetup
from apps.surrogate.train import train
from hpctp.cli.log import get_logger
from hpctp.comm.io_calls import bcast_bytes
from hpctp.testing import assert_allclose

TINY = Path(__file__).resolve().parent.parent / "apps" / "configs" / "tiny.toml"
WORLD = MPI.COMM_WORLD


def _plans(size: int) -> list[tuple[int, int]]:
    """(data groups, zero stage) pairs for this rank count: every stage with all ranks on data, a
    data x spatial mix where the count allows."""
    out = [(1, 0)]
    if size > 1:
        out += [(size, 0), (size, 1), (size, 2), (size, 3)]
    out += [(d, 3) for d in (2, 3) if size % d == 0 and 1 < size // d]
    return out


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:  # type: ignore[type-arg]
    cfg = load_config(
        TINY, ["simulation.size=[12, 10]", "surrogate.model=fno", "train.epochs=2", "train.spectral_weight=0.5"]
    )
    cfg["train"]["batch_size"] = 3  # 4 training pairs: batches of 3 and 1, uneven and empty shares
    mine = str(tmp_path_factory.mktemp("plans")).encode() if WORLD.Get_rank() == 0 else None
    root = Path(bcast_bytes(WORLD, mine).decode())
    with hpctp.ProcessGrid((0, 0), comm=WORLD) as grid:
        log = get_logger("test", grid)
        save_snapshots(simulate(cfg["simulation"], grid, log, progress=False), str(root / "sim.h5"), cfg["simulation"])
    return cfg, root


def _train(cfg: dict, root: Path, name: str, data: int, zero: int, resume: bool = False) -> list[float]:  # type: ignore[type-arg]
    run = {**cfg, "train": {**cfg["train"], "data": data, "zero": zero}}
    with hpctp.ProcessGrid((0, 0), comm=WORLD) as grid:
        return train(run, str(root / "sim.h5"), str(root / name), grid, get_logger("test", grid), resume=resume)


@pytest.mark.mpi
def test_every_plan_gives_the_same_loss_curve(snapshots) -> None:  # type: ignore[no-untyped-def]
    cfg, root = snapshots
    curves = {plan: _train(cfg, root, f"run-{plan[0]}-{plan[1]}", *plan) for plan in _plans(WORLD.Get_size())}
    ref = curves[(1, 0)]
    with hpctp.ProcessGrid((WORLD.Get_size(),), comm=WORLD) as grid:
        assert len(ref) >= 4 and ref[-1] < ref[0]
        for plan, curve in curves.items():
            assert_allclose(grid, np.array(curve), np.array(ref), rtol=1e-10, what=f"data x zero = {plan}")


@pytest.mark.mpi
def test_resume_on_another_plan(snapshots) -> None:  # type: ignore[no-untyped-def]
    cfg, root = snapshots
    size = WORLD.Get_size()
    whole = _train(cfg, root, "whole", 1, 0)
    one = {**cfg, "train": {**cfg["train"], "epochs": 1}}
    first = _train(one, root, "split", size, 3 if size > 1 else 0)  # saved with sharded parameters
    rest = _train(cfg, root, "split", 1, 1, resume=True)  # restored on all-spatial ranks with stage 1
    with hpctp.ProcessGrid((size,), comm=WORLD) as grid:
        assert_allclose(grid, np.array(first + rest), np.array(whole), rtol=1e-10, what="resumed curve")


def test_setup_rejects_bad_keys() -> None:
    cfg = load_config(TINY)
    for key, value, match in (
        ("data", 0, "positive"),
        ("zero", 4, "zero"),
        ("precision", "fp8", "precision"),
        ("tensor", 2, "vit"),
        ("checkpoint_activations", "yes", "true or false"),
        ("pipeline", 0, "positive"),
        ("schedule", "2f2b", "schedule"),
        ("microbatches", 0, "positive"),
        ("cuts", [0, "2", 5], "list of ints"),
        ("cuts", [0, 2, 5], "set train.pipeline > 1"),
    ):
        bad = {**cfg, "train": {**cfg["train"], key: value}}
        with pytest.raises(ValueError, match=match):
            TrainingSetup(bad)
    with pytest.raises(ValueError, match="float32"):
        TrainingSetup({**cfg, "train": {**cfg["train"], "precision": "bf16"}})  # tiny trains in float64
    fno = {**cfg, "surrogate": {**cfg["surrogate"], "model": "fno"}}
    with pytest.raises(ValueError, match="the 'fno' model is not one"):
        TrainingSetup({**fno, "train": {**cfg["train"], "pipeline": 2}})
    with pytest.raises(ValueError, match="spectral_weight needs train.pipeline = 1"):
        TrainingSetup({**cfg, "train": {**cfg["train"], "pipeline": 2, "spectral_weight": 0.5}})


def _run(cfg: dict, root: Path, name: str, **train_keys: object) -> list[float]:  # type: ignore[type-arg]
    run = {**cfg, "train": {**cfg["train"], **train_keys}}
    with hpctp.ProcessGrid((0, 0), comm=WORLD) as grid:
        return train(run, str(root / "sim.h5"), str(root / name), grid, get_logger("test", grid))


@pytest.mark.mpi
def test_vit_heads_on_a_tensor_axis_and_activation_checkpointing(snapshots) -> None:  # type: ignore[no-untyped-def]
    """The ViT trained with its heads split over a tensor axis (and data groups where the ranks allow),
    then with activation checkpointing: the curve of all-spatial training."""
    cfg, root = snapshots
    vit = {**cfg, "surrogate": {**cfg["surrogate"], "model": "vit", "patch": 2, "embed": 8, "heads": 2}}
    vit["train"] = {**cfg["train"], "spectral_weight": 0.0}
    size = WORLD.Get_size()
    ref = _run(vit, root, "vit-ref")
    runs = {"checkpointing, zero 3": _run(vit, root, "vit-ckpt", checkpoint_activations=True, zero=3, data=size)}
    if size % 2 == 0:
        runs["tensor 2"] = _run(vit, root, "vit-t2", tensor=2)
        runs["tensor 2, data, zero 2"] = _run(vit, root, "vit-t2d", tensor=2, data=size // 2, zero=2)
    with hpctp.ProcessGrid((size,), comm=WORLD) as grid:
        for what, curve in runs.items():
            assert_allclose(grid, np.array(curve), np.array(ref), rtol=1e-10, what=what)


@pytest.mark.mpi
def test_bf16_training_follows_float32(snapshots) -> None:  # type: ignore[no-untyped-def]
    cfg, root = snapshots
    f32 = {**cfg, "surrogate": {**cfg["surrogate"], "dtype": "float32"}, "train": {**cfg["train"], "epochs": 4}}
    size = WORLD.Get_size()
    ref = _run(f32, root, "f32", data=size)
    bf16 = _run(f32, root, "bf16", data=size, precision="bf16")
    with hpctp.ProcessGrid((size,), comm=WORLD) as grid:
        assert_allclose(grid, np.array(bf16), np.array(ref), rtol=1e-2, what="bf16 loss curve vs float32")
    if size % 2 == 0:  # through a pipeline's stages (autocast over forward and backward of every micro-batch)
        unet = {**f32, "surrogate": {**f32["surrogate"], "model": "unet"}}
        unet["train"] = {**f32["train"], "spectral_weight": 0.0, "batch_size": 2}
        ref = _run(unet, root, "unet-f32")
        bf16 = _run(unet, root, "unet-bf16", precision="bf16", pipeline=2, schedule="zero_bubble")
        with hpctp.ProcessGrid((size,), comm=WORLD) as grid:
            assert_allclose(grid, np.array(bf16), np.array(ref), rtol=2e-2, what="bf16 pipeline loss curve")


def _pipelines(size: int) -> list[tuple[str, dict[str, object]]]:
    """(model, train keys) of the pipelines this rank count allows: U-Net and ViT cut into 2 or 3 stages, with data
    groups and ZeRO per stage, a tensor axis (ViT), every schedule, stages cut where ``train.cuts`` says."""
    out: list[tuple[str, dict[str, object]]] = []
    if size % 2 == 0:
        out += [
            ("unet", {"pipeline": 2, "schedule": "1f1b"}),
            ("unet", {"pipeline": 2, "schedule": "interleaved", "checkpoint_activations": True}),
            ("vit", {"pipeline": 2, "schedule": "zero_bubble", "data": size // 2, "zero": 2 if size > 2 else 0}),
        ]
    if size % 4 == 0:
        out += [("vit", {"pipeline": 2, "schedule": "1f1b", "tensor": 2, "data": size // 4, "zero": 1})]
    if size % 3 == 0:
        out += [
            ("unet", {"pipeline": 3, "schedule": "gpipe"}),
            ("vit", {"pipeline": 3, "schedule": "zero_bubble", "cuts": [0, 1, 3, 5]}),
        ]
    return out


@pytest.mark.mpi(min_size=2)
def test_pipeline_stages_give_the_loss_curve_of_one_model(snapshots) -> None:  # type: ignore[no-untyped-def]
    """train.pipeline cuts the U-Net and the ViT (chains whose activations carry the input and the skips) into
    stages built on meta: the loss curve of all-spatial training to 1e-10, every schedule, with data groups, ZeRO
    per stage, a tensor axis, activation checkpointing; a pipeline's checkpoint resumes without a pipeline."""
    cfg, root = snapshots
    base = {**cfg["train"], "spectral_weight": 0.0, "batch_size": 2, "microbatches": 2}
    vit = {"model": "vit", "patch": 2, "embed": 8, "heads": 2}
    size = WORLD.Get_size()
    runs = _pipelines(size)
    refs: dict[str, list[float]] = {}
    curves = []
    for k, (model, keys) in enumerate(runs):
        run = {**cfg, "surrogate": {**cfg["surrogate"], "model": model, **(vit if model == "vit" else {})}}
        run["train"] = base
        if model not in refs:
            refs[model] = _run(run, root, f"pipe-ref-{model}")
        curves.append((model, keys, _run(run, root, f"pipe-{k}", **keys)))
    with hpctp.ProcessGrid((size,), comm=WORLD) as grid:
        for model, keys, curve in curves:
            assert_allclose(grid, np.array(curve), np.array(refs[model]), rtol=1e-10, what=f"{model} {keys}")
    if size % 2 == 0:  # resumed without the pipeline, on all-spatial ranks
        unet = {**cfg, "surrogate": {**cfg["surrogate"], "model": "unet"}}
        first = _run({**unet, "train": {**base, "epochs": 1}}, root, "pipe-resume", pipeline=2, schedule="1f1b")
        with hpctp.ProcessGrid((0, 0), comm=WORLD) as g:
            rest = train({**unet, "train": base}, str(root / "sim.h5"), str(root / "pipe-resume"), g,
                         get_logger("test", g), resume=True)  # fmt: skip
        with hpctp.ProcessGrid((size,), comm=WORLD) as grid:
            assert_allclose(grid, np.array(first + rest), np.array(refs["unet"]), rtol=1e-10, what="resumed curve")
