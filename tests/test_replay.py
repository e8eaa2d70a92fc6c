"""The pure decisions of online training (hpctp.io.replay) and the plan of a move between two groups of
ranks (hpctp.layout.group_transfer_plan): no MPI, one process."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from apps.surrogate.data import split_indices
from hpctp.io import ReplayPlan, TrainingSchedule
from hpctp.io.replay import held_out, pairs_before, snapshots_for_pairs
from hpctp.layout import Layout, grid_coords, group_transfer_plan


# ---------------------------------------------------------------------------------- eviction
def test_window_keeps_the_last_pairs() -> None:
    plan = ReplayPlan(5, "window", seed=3)
    assert plan.slots(0, 12).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert sorted(plan.contents(12).tolist()) == [7, 8, 9, 10, 11]
    assert plan.contents(3).tolist() == [0, 1, 2, -1, -1]
    assert plan.filled(3) == 3 and plan.filled(40) == 5


def test_reservoir_decisions_need_no_state() -> None:
    plan = ReplayPlan(7, "reservoir", seed=11)
    whole = plan.slots(0, 300)
    pieces = np.concatenate([plan.slots(a, b) for a, b in [(0, 5), (5, 6), (6, 100), (100, 300)]])
    assert np.array_equal(whole, pieces)
    assert [plan.slot(k) for k in range(300)] == [None if s < 0 else int(s) for s in whole]
    assert whole[:7].tolist() == list(range(7))  # the first `capacity` pairs fill the slots
    assert ((whole >= -1) & (whole < 7)).all()
    assert not np.array_equal(whole, ReplayPlan(7, "reservoir", seed=12).slots(0, 300))  # the seed matters
    # replaying the decisions by hand gives the contents
    held = [-1] * 7
    for k, s in enumerate(whole):
        if s >= 0:
            held[s] = k
    assert plan.contents(300).tolist() == held


def test_reservoir_keeps_a_uniform_sample() -> None:
    """Algorithm R: after n pairs each one is in the buffer with probability capacity / n."""
    cap, n, runs = 10, 60, 400
    kept = np.zeros(n)
    for seed in range(runs):
        c = ReplayPlan(cap, "reservoir", seed=seed).contents(n)
        kept[c[c >= 0]] += 1
    freq = kept / runs
    assert abs(freq.mean() - cap / n) < 1e-12  # exactly `cap` kept each run
    # early, middle and late thirds equally likely (binomial sd of a third's mean ~ 0.006)
    thirds = [freq[i : i + n // 3].mean() for i in range(0, n, n // 3)]
    assert max(thirds) - min(thirds) < 0.04, thirds


def test_draws_are_seeded_distinct_and_sorted() -> None:
    plan = ReplayPlan(8, "reservoir", seed=5)
    a = plan.draw(3, pairs=20, batch_size=4)
    assert np.array_equal(a, plan.draw(3, pairs=20, batch_size=4))
    assert a.tolist() == sorted(set(a.tolist())) and len(a) == 4 and a.max() < 8
    assert plan.draw(0, pairs=2, batch_size=4).tolist() == [0, 1]  # fewer pairs than a batch: all of them
    steps = {tuple(plan.draw(s, pairs=20, batch_size=4)) for s in range(20)}
    assert len(steps) > 10  # the steps draw different batches
    with pytest.raises(ValueError, match="empty"):
        plan.draw(0, pairs=0, batch_size=4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": 3, "eviction": "fifo"}, "eviction"),
        ({"capacity": 3, "seed": -1}, "seed"),
    ],
)
def test_bad_replay_plans(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReplayPlan(**kwargs)


# ---------------------------------------------------------------------------------- pairs and schedule
@pytest.mark.parametrize("n, horizon, holdout", [(121, 2, 0.2), (100, 1, 0.2), (7, 1, 0.34), (30, 3, 0.5)])
def test_held_out_pairs_are_offline_trainings(n: int, horizon: int, holdout: float) -> None:
    train, held = split_indices(n, horizon, holdout)
    every = max(2, round(1 / holdout))
    assert [i for i in range(n - horizon) if held_out(i, every)] == held
    assert pairs_before(n, horizon, every) == len(train)
    for p in range(n + 1):
        assert pairs_before(p, horizon, every) == sum(1 for i in range(max(0, p - horizon)) if not held_out(i, every))
    for want in range(len(train) + 1):
        p = snapshots_for_pairs(want, horizon, every)
        assert pairs_before(p, horizon, every) >= want and (p == 0 or pairs_before(p - 1, horizon, every) < want)
    assert not held_out(4, 0) and pairs_before(5, 0, 0) == 5


@pytest.mark.parametrize("ramp, tail", [(1.0, 0.0), (2.0, 0.0), (1.0, 0.25), (1.5, 0.5)])
@pytest.mark.parametrize("steps, snapshots, start", [(480, 121, 7), (7, 30, 4), (4, 7, 3), (10, 10, 0), (3, 5, 9)])
def test_schedule_spreads_the_steps_over_the_snapshots(
    steps: int, snapshots: int, start: int, ramp: float, tail: float
) -> None:
    s = TrainingSchedule(steps, snapshots, start, ramp, tail)
    need = [s.need(i) for i in range(steps)]
    assert need == sorted(need) and need[-1] == snapshots and all(n >= min(start, snapshots) for n in need)
    for produced in range(snapshots + 3):  # allowed(p) counts the steps whose snapshots are there
        assert s.allowed(produced) == sum(1 for n in need if n <= produced)
    assert sum(1 for n in need if n == snapshots) >= round(tail * steps)  # the tail runs after the last one
    # after a share q of the snapshots, about q ** ramp of the steps spread over them
    q = (snapshots // 2) / snapshots
    assert abs(s.allowed(snapshots // 2) - s.during * q**ramp) <= 1 + s.during / snapshots + start * steps / snapshots


def test_bad_schedules() -> None:
    for kwargs, match in [({"ramp": 0.5}, "ramp"), ({"tail": 1.0}, "tail"), ({"start": -1}, "start")]:
        with pytest.raises(ValueError, match=match):
            TrainingSchedule(10, 5, **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- moves between groups
def _tile(layout: Layout, ranks: list[int]) -> dict[int, tuple[tuple[int, int], ...]]:
    return {ranks[g]: layout.local_ranges(grid_coords(g, layout.grid_dims)) for g in range(layout.nranks)}


CASES = [
    # source layout, its common ranks, destination layout, its common ranks
    (Layout((2, 10, 7), (2, 2), (None, 0, 1), (None, (0, 3, 10), (0, 5, 7))), [0, 1, 2, 3],
     Layout((2, 10, 7), (2,), (None, None, 0)), [4, 5]),  # 2x2 uneven -> 2 trainers (separate groups)
    (Layout((1, 9, 8), (3, 1), (None, 0, 1)), [0, 1, 2],
     Layout((1, 9, 8), (2, 1, 2), (None, 1, 2)), [3, 4, 5, 6]),  # trainer with 2 data copies
    (Layout((2, 8, 8), (2, 2), (None, 0, 1)), [3, 2, 1, 0],
     Layout((2, 8, 8), (1, 2, 2), (None, 1, 2)), [3, 2, 1, 0]),  # co-located: every box stays
    (Layout((2, 8, 6), (2, 1), (None, 0, None)), [0, 1],
     Layout((2, 8, 6), (1, 3), (None, None, 1)), [1, 2, 0]),  # overlapping groups, other cuts
    (Layout((3, 8), (2, 2), (None, 0)), [0, 1, 2, 3],
     Layout((3, 8), (2,), (None, 0)), [4, 5]),  # a replicated source: one replica sends
]  # fmt: skip


@pytest.mark.parametrize("src, src_ranks, dst, dst_ranks", CASES)
def test_group_plan_delivers_every_element_once(src: Layout, src_ranks: list, dst: Layout, dst_ranks: list) -> None:
    nranks = max(src_ranks + dst_ranks) + 1
    plans = {r: group_transfer_plan(src, src_ranks, dst, dst_ranks, r) for r in range(nranks)}
    src_boxes, dst_boxes = _tile(src, src_ranks), _tile(dst, dst_ranks)
    shape = src.global_shape
    glob = np.arange(np.prod(shape), dtype=np.int64).reshape(shape)
    for r, box in dst_boxes.items():
        got = np.full(tuple(hi - lo for lo, hi in box), -1, dtype=np.int64)
        p = plans[r]
        for piece in p.recvs:  # every receive matches the sender's send of that box
            sender = plans[piece.peer]
            sends = [s for s in sender.sends if s.peer == r]
            assert piece.box in [s.box for s in sends]
            s = next(s for s in sends if s.box == piece.box)
            mine = src_boxes[piece.peer]
            block = glob[tuple(slice(lo, hi) for lo, hi in mine)]
            assert (got[piece.slices] == -1).all()
            got[piece.slices] = block[s.slices]
        for s_sl, d_sl in p.local:
            block = glob[tuple(slice(lo, hi) for lo, hi in src_boxes[r])]
            assert (got[d_sl] == -1).all()
            got[d_sl] = block[s_sl]
        assert np.array_equal(got, glob[tuple(slice(lo, hi) for lo, hi in box)]), r
    # every send is received (no message without a receiver); a rank never sends to itself
    for r, p in plans.items():
        for s in p.sends:
            assert s.peer != r and any(q.peer == r and q.box == s.box for q in plans[s.peer].recvs)
    # the replicated source sends from its coordinate-0 replica only
    if src.replicated_axes:
        senders = {r for r, p in plans.items() if p.sends}
        assert senders <= {src_ranks[g] for g in range(src.nranks) if grid_coords(g, src.grid_dims)[1] == 0}


def test_colocated_plan_moves_nothing() -> None:
    src, ranks, dst, _ = CASES[2]
    for r in range(4):
        p = group_transfer_plan(src, ranks, dst, ranks, r)
        assert not p.sends and not p.recvs and len(p.local) == 1 and p.send_elements == p.recv_elements == 0


def test_group_plan_refuses_other_tensors_and_rank_lists() -> None:
    a = Layout((2, 8, 8), (2, 1), (None, 0, 1))
    with pytest.raises(ValueError, match="shape"):
        group_transfer_plan(a, [0, 1], Layout((2, 8, 9), (2,), (None, 0, None)), [2, 3], 0)
    with pytest.raises(ValueError, match="names 3 ranks"):
        group_transfer_plan(a, [0, 1, 2], a, [3, 4], 0)
    with pytest.raises(ValueError, match="distinct"):
        group_transfer_plan(a, [0, 0], a, [3, 4], 0)
    assert group_transfer_plan(a, [0, 1], a, [2, 3], 7) == group_transfer_plan(a, (0, 1), a, (2, 3), 7)
    assert list(itertools.chain(group_transfer_plan(a, [0, 1], a, [2, 3], 7).sends)) == []
