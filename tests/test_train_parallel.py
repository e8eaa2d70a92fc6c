"""The surrogate's training on data x spatial (x tensor) grids, with each ZeRO stage: the loss curve of
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
    ):
        bad = {**cfg, "train": {**cfg["train"], key: value}}
        with pytest.raises(ValueError, match=match):
            TrainingSetup(bad)
    with pytest.raises(ValueError, match="float32"):
        TrainingSetup({**cfg, "train": {**cfg["train"], "precision": "bf16"}})  # tiny trains in float64


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
