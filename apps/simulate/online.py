"""``python -m apps.simulate --config C --train-online``: simulate with ``[simulation]`` and train the
surrogate of ``[surrogate]``/``[train]`` at the same time, with no file in between.

``online.placement = "colocated"``: every rank steps the simulation and, as its snapshots allow,
training steps on the same blocks (the simulation's decomposition is the model's spatial split).
``"separate"``: the last ``online.trainer_ranks`` ranks train (0: half), the others simulate; each
snapshot moves to the trainer's layout in one redistribution across the groups, and the simulation
never waits more than ``online.max_wait`` for the trainer (snapshots are thinned instead, and
counted). The checkpoint goes to ``train.out``; no snapshot file is written; the trainer's first rank
prints the held-out error against persistence at the end.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Generator
from contextlib import closing
from typing import Any

import hpctp
from hpctp.cli.log import get_logger
from hpctp.io import Stream

from ..surrogate.online import OnlineTrainer, online_settings, snapshot_shape, stream_config
from ..surrogate.parallel import training_setup
from .grayscott import GrayScott, initial_state
from .navier_stokes import NavierStokes2D

__all__ = ["run_online", "snapshots"]


def snapshots(sim: dict[str, Any], grid: hpctp.ProcessGrid) -> Generator[hpctp.DistTensor, None, None]:
    """Collective over grid. The snapshots of a ``[simulation]`` section, one at a time, as
    :func:`apps.simulate.run.simulate` stores them (``[C, H, W]`` split ``(None, 0, 1)``). Each is the
    live state (Gray-Scott) or a fresh field (Navier-Stokes): use it before asking for the next."""
    if sim.get("pde", "grayscott") == "navier_stokes":
        every, warmup, count = float(sim["snapshot_every"]), float(sim["warmup"]), int(sim["snapshots"])
        with NavierStokes2D.from_config(sim, grid) as ns:
            ns_state = ns.initial_state(int(sim["seed"]))
            ns.step_to(ns_state, warmup)
            yield ns.vorticity(ns_state)
            for i in range(1, count):
                ns.step_to(ns_state, warmup + i * every)
                yield ns.vorticity(ns_state)
        return
    model = GrayScott.from_config(sim)
    state = initial_state(tuple(sim["size"]), grid, sim["seed"], sim["seeds"])
    every, warmup, steps = int(sim["snapshot_every"]), int(sim["warmup"]), int(sim["steps"])
    if every < 1 or warmup < 0 or steps < warmup + every:
        raise ValueError(f"need snapshot_every >= 1, warmup >= 0 and steps >= warmup + snapshot_every, got {sim}")
    model.step(state, warmup)
    yield state
    for _ in range(1, (steps - warmup) // every + 1):
        model.step(state, every)
        yield state


def _trainer_config(cfg: dict[str, Any], sim_dims: tuple[int, ...] | None) -> dict[str, Any]:
    """The config the trainer's grid is built from: co-located with one data group and no tensor axis,
    the simulation's own grid (its blocks are the model's); else MPI's choice on the trainer's ranks."""
    tcfg = copy.deepcopy(cfg)
    plain = int(cfg["train"].get("data", 1)) == 1 and int(cfg["train"].get("tensor", 1)) == 1
    tcfg["simulation"]["grid"] = list(sim_dims) if sim_dims is not None and plain else [0, 0]
    return tcfg


def run_online(cfg: dict[str, Any], world: Any, verbose: bool = False) -> dict[str, Any]:
    """Collective over ``world`` (an mpi4py intracommunicator). Simulate and train at once.

    Returns
    -------
    dict
        On trainer ranks: :meth:`apps.surrogate.online.OnlineTrainer.finish`'s result; on every
        simulation rank also ``simulated`` (snapshots put), ``sim_seconds`` (the simulation loop,
        training steps included when co-located), ``sim_cpu`` (its CPU seconds on this rank), ``waited`` (seconds the simulation's first rank
        waited for the trainer), ``dropped`` (snapshots thinned) and ``bytes_sent`` (this rank's bytes
        of snapshots sent to trainer ranks); ``role``.

    Raises
    ------
    ValueError
        On every rank: bad ``[online]`` keys, a separate placement without ranks for both groups, or
        snapshots the trainer does not expect.
    """
    on = online_settings(cfg)
    size, rank = world.Get_size(), world.Get_rank()
    separate = on["placement"] == "separate"
    trainers = int(on["trainer_ranks"]) or size // 2
    if separate and not 1 <= trainers < size:
        raise ValueError(
            f"online.placement = 'separate' on {size} ranks needs 1 <= online.trainer_ranks < {size} "
            f"(got {on['trainer_ranks']}: {trainers} trainer ranks); run on more ranks or co-located"
        )
    is_train = not separate or rank >= size - trainers
    is_sim = not separate or not is_train
    group = hpctp.comm.split_comm(world, int(is_train and separate)) if separate else world
    sim = cfg["simulation"]
    shape = snapshot_shape(sim)
    sim_grid = hpctp.ProcessGrid(sim["grid"], comm=group) if is_sim else None
    log = get_logger("apps.simulate.online", group, verbose)
    plan = setup = None
    if is_train:
        probe = hpctp.ProcessGrid([group.Get_size()], comm=group)
        setup, plan = training_setup(_trainer_config(cfg, sim_grid.dims if sim_grid else None), probe)
        probe.free()
    stream = Stream(
        world, shape, "float64", stream_config(cfg),
        sim_grid=sim_grid, sim_layout=hpctp.Layout(shape, sim_grid.dims, (None, 0, 1)) if sim_grid else None,
        train_grid=plan.grid if plan else None, train_split=(None, *plan.spatial_axes) if plan else None,
    )  # fmt: skip
    if rank == 0:
        log.info(
            "online training, %s: %s; snapshots %s moved %s",
            "separate groups" if separate else "co-located",
            f"{size - trainers} simulation + {trainers} trainer ranks" if separate else f"{size} ranks",
            shape, "without a message" if stream.colocated else "in one redistribution each",
        )  # fmt: skip
    trainer = OnlineTrainer(cfg, stream, plan, setup, get_logger("apps.surrogate.online", plan.grid, verbose), cfg["train"]["out"]) if plan and setup else None  # fmt: skip
    result: dict[str, Any] = {"role": "both" if is_sim and is_train else "simulation" if is_sim else "trainer"}
    if sim_grid is not None:
        stop = int(on["stop_after"])
        t0, c0 = time.perf_counter(), time.process_time()
        count = 0
        with closing(snapshots(sim, sim_grid)) as states:
            for snap in states:
                stream.put(snap)
                count += 1
                if trainer is not None:
                    trainer.run_due()
                if stop and count >= stop:
                    break
        stream.end()
        result.update(
            simulated=count, sim_seconds=time.perf_counter() - t0, sim_cpu=time.process_time() - c0,
            waited=stream.stats.waited,
            dropped=stream.stats.dropped, bytes_sent=stream.stats.bytes_sent,
        )  # fmt: skip
        log.info(
            "simulated %d snapshots in %.2f s (%s); %d thinned, waited %.2f s for the trainer",
            count, result["sim_seconds"], "training steps included" if trainer else "alone on its ranks",
            stream.stats.dropped, stream.stats.waited,
        )  # fmt: skip
    if trainer is not None:
        result.update(trainer.finish())
        if trainer.plan.grid.rank == 0:
            print(
                f"held-out relative L2 error: {result['surrogate']:.4f} (persistence baseline "
                f"{result['persistence']:.4f}, {result['held_out']} states kept aside); {result['steps']} steps, "
                f"checkpoint {trainer.ckpt}",
                flush=True,
            )
        trainer.plan.free()
        trainer.plan.grid.free()
    else:
        stream.close()
    if sim_grid is not None:
        sim_grid.free()
    if separate:
        hpctp.comm.free_comm(group)
    return result
