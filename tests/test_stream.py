"""hpctp.io.Stream: a simulation's blocks into a trainer's replay buffer, co-located and between two
groups of ranks (the job split in two), with thinning counted and bad input refused everywhere."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import hpctp
from hpctp.io import ReplayPlan, Stream, StreamConfig
from hpctp.testing import assert_all, assert_equal

SHAPE = (2, 10, 7)


def _field(n: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    """Snapshot n: every element tells its snapshot and global index."""
    return n * 1000.0 + np.arange(np.prod(shape), dtype=np.float64).reshape(shape)


def _cuts(n: int, parts: int) -> tuple[int, ...]:
    """The simulation's own uneven cuts (triangular weights), not hpctp's balanced ones."""
    return tuple(n * c * (c + 1) // (parts * (parts + 1)) for c in range(parts + 1))


def _sim_layout(grid: hpctp.ProcessGrid, shape: tuple[int, ...] = SHAPE) -> hpctp.Layout:
    return hpctp.Layout(
        shape, grid.dims, (None, 0, 1), (None, _cuts(shape[1], grid.dims[0]), _cuts(shape[2], grid.dims[1]))
    )


def _groups(world: MPI.Intracomm) -> tuple[bool, MPI.Intracomm]:
    """The first half of the ranks simulate (at least one), the others train."""
    is_sim = world.Get_rank() < max(1, world.Get_size() // 2)
    return is_sim, hpctp.comm.split_comm(world, 0 if is_sim else 1)


def _check_buffer(stream: Stream, world: MPI.Intracomm, grid: hpctp.ProcessGrid, horizon: int) -> None:
    """Every stored and held-out pair holds this rank's blocks of the right snapshots."""
    sl = stream.layout.local_slices(grid.coords)
    ok = True
    x, y = stream.batch(np.arange(stream.replay.capacity))
    items, sources = stream.contents()
    for k in np.flatnonzero(items >= 0):
        n = int(sources[k])
        ok &= np.array_equal(x[k], _field(n)[sl]) and np.array_equal(y[k], _field(n + horizon)[sl] + (horizon == 0))
    hx, hy, idx = stream.held_out_pairs()
    for x_, y_, n in zip(hx, hy, idx):
        ok &= np.array_equal(x_, _field(n)[sl]) and np.array_equal(y_, _field(n + horizon)[sl] + (horizon == 0))
    assert_all(grid, ok, "buffer contents")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("horizon", [1, 0])
def test_separate_groups_deliver_every_pair(world: MPI.Intracomm, horizon: int) -> None:
    is_sim, group = _groups(world)
    cfg = StreamConfig(horizon=horizon, buffer_bytes=10**6, eviction="window", holdout_every=6, holdout_bytes=10**5,
                       max_wait=float("inf"), batch_size=3)  # fmt: skip
    n_snap = 9
    if is_sim:
        grid = hpctp.ProcessGrid([0, 0], comm=group)
        lay = _sim_layout(grid)
        stream = Stream(world, SHAPE, "float64", cfg, sim_grid=grid, sim_layout=lay)
        sl = lay.local_slices(grid.coords)
        for n in range(n_snap):
            if horizon:
                assert stream.put(np.ascontiguousarray(_field(n)[sl]))
            else:  # explicit pairs: the target of snapshot n is snapshot n plus one
                assert stream.put(_field(n)[sl].copy(), target=_field(n)[sl] + 1.0)
        stream.close()
        assert_equal(grid, [stream.stats.produced, stream.stats.sent, stream.stats.dropped], [n_snap, n_snap, 0])
    else:
        # two data-parallel copies of the trainer where the ranks allow: each holds the whole buffer
        n = group.Get_size()
        grid = hpctp.ProcessGrid([2, n // 2] if n % 2 == 0 else [1, n], comm=group)
        stream = Stream(world, SHAPE, "float64", cfg, train_grid=grid, train_split=(None, None, 1))
        stream.ingest(until=4)  # snapshots 0..3 only
        assert_equal(grid, [stream.produced, stream.stats.received], [4, 4])
        stream.close()  # takes in the rest until the end
        s = stream.stats
        pairs = n_snap - horizon
        assert_equal(grid, [s.produced, s.received, s.dropped, s.pairs, s.held_out], [n_snap, n_snap, 0, pairs - 1, 1])
        _check_buffer(stream, world, grid, horizon)
        assert_equal(grid, stream.held_out_pairs()[2], [5])
        # the draws are the pure plan's
        slots = stream.draw(0)
        assert_equal(grid, slots, ReplayPlan(stream.replay.capacity, "window", 0).draw(0, pairs - 1, 3))
    grid.free()
    hpctp.comm.free_comm(group)


@pytest.mark.mpi
def test_colocated_moves_no_data(world: MPI.Intracomm) -> None:
    grid = hpctp.ProcessGrid([0, 0], comm=world)
    train = hpctp.ProcessGrid([1, *grid.dims], comm=world)  # a training grid: one data group
    lay = _sim_layout(grid)
    cfg = StreamConfig(horizon=2, buffer_bytes=3 * 2 * 140 * 8, eviction="reservoir", seed=7, max_wait=0.0)
    stream = Stream(
        world, SHAPE, "float64", cfg, sim_grid=grid, sim_layout=lay, train_grid=train, train_split=(None, 1, 2)
    )
    assert stream.colocated and stream.layout.dim_cuts == lay.dim_cuts  # the simulation's own blocks
    sl = lay.local_slices(grid.coords)
    with hpctp.comm.CommCounter() as c:
        for n in range(8):
            assert stream.put(hpctp.DistTensor(np.ascontiguousarray(_field(n)[sl]), grid, lay))
            stream.ingest(None)
    calls = set(c.total.calls)  # the small all-reduce that agrees on each put; no data message
    assert_all(grid, calls <= {"Iallreduce"}, f"calls {calls}")
    assert_equal(grid, [stream.pairs, stream.replay.capacity, stream.stats.evicted], [6, 3, 3])
    assert_equal(grid, stream.contents()[0], ReplayPlan(3, "reservoir", 7).contents(6))
    _check_buffer(stream, world, train, 2)
    stream.close()
    train.free()
    grid.free()


@pytest.mark.mpi(min_size=2)
def test_thinning_is_counted(world: MPI.Intracomm) -> None:
    """The trainer takes nothing in until the simulation has put 5 snapshots: with room for 2 and no
    waiting, the first pair goes (snapshots 0 and 1) and the other three are thinned, on both sides of
    the count; thinning keeps whole pairs."""
    is_sim, group = _groups(world)
    cfg = StreamConfig(horizon=1, buffer_bytes=10**6, max_wait=0.0, depth=2)
    if is_sim:
        grid = hpctp.ProcessGrid([0, 0], comm=group)
        lay = hpctp.Layout(SHAPE, grid.dims, (None, 0, 1))
        stream = Stream(world, SHAPE, "float64", cfg, sim_grid=grid, sim_layout=lay)
        sent = [stream.put(np.ascontiguousarray(_field(n)[lay.local_slices(grid.coords)])) for n in range(5)]
        hpctp.comm.barrier(world)
        stream.close()
        assert_equal(grid, sent, [True, True, False, False, False])
    else:
        grid = hpctp.ProcessGrid([0], comm=group)
        stream = Stream(world, SHAPE, "float64", cfg, train_grid=grid)
        hpctp.comm.barrier(world)
        stream.close()
    s = stream.stats
    assert_equal(grid, [s.produced, s.sent, s.dropped], [5, 2, 3])
    if not is_sim:
        assert_equal(grid, [s.received, s.pairs], [2, 1])
    grid.free()
    hpctp.comm.free_comm(group)


@pytest.mark.mpi(min_size=2)
def test_bad_input_is_refused_on_every_rank_before_any_message(world: MPI.Intracomm) -> None:
    is_sim, group = _groups(world)
    grid = hpctp.ProcessGrid([0, 0] if is_sim else [0], comm=group)
    sim = {"sim_grid": grid, "sim_layout": hpctp.Layout(SHAPE, grid.dims, (None, 0, 1))} if is_sim else {}
    train = {} if is_sim else {"train_grid": grid}
    cfg = StreamConfig(max_wait=float("inf"))
    # the trainer expects another shape, then another dtype: refused on every rank of both groups
    with pytest.raises(ValueError, match=r"puts snapshots of shape \(2, 10, 7\).*expects shape \(3, 10, 7\)"):
        Stream(world, SHAPE if is_sim else (3, 10, 7), "float64", cfg, **sim, **train)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype float32, .*dtype float64"):
        Stream(world, SHAPE, "float32" if is_sim else "float64", cfg, **sim, **train)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="different config"):  # settings that differ between ranks
        Stream(world, SHAPE, "float64", StreamConfig(depth=2 + world.Get_rank() % 2), **sim, **train)  # type: ignore[arg-type]
    stream = Stream(world, SHAPE, "float64", cfg, **sim, **train)  # type: ignore[arg-type]
    if is_sim:
        lay = sim["sim_layout"]
        good = np.ascontiguousarray(_field(0)[lay.local_slices(grid.coords)])  # type: ignore[union-attr]
        bad = good[:, :-1] if grid.rank == grid.size - 1 else good  # one rank's block is wrong
        with pytest.raises(ValueError, match="passed a block of shape"):
            stream.put(bad)
        with pytest.raises(TypeError, match="dtype float32"):
            stream.put(good.astype(np.float32))
        with pytest.raises(ValueError, match="pass no target"):
            stream.put(good, target=good)
        assert_equal(grid, [stream.stats.sent, stream.stats.produced, stream.stats.bytes_sent], [0, 0, 0])
        with pytest.raises(RuntimeError, match="only trainer ranks"):
            stream.ingest()
    else:
        with pytest.raises(RuntimeError, match="only simulation ranks"):
            stream.put(np.zeros(3))
    stream.close()
    if not is_sim:
        assert_equal(grid, [stream.stats.produced, stream.stats.received, stream.pairs], [0, 0, 0])
    grid.free()
    hpctp.comm.free_comm(group)
