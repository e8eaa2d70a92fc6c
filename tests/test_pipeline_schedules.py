"""Pipeline schedules as action lists (hpctp.nn.pipeline_parallel): the IR, the builders, lowering,
the validator, the simulator and the stage balancer. Pure planning, no MPI: runs on 1 rank only."""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from fractions import Fraction

import numpy as np
import pytest

from hpctp.nn.pipeline_parallel import (
    SCHEDULES,
    Action,
    ActionKind,
    Schedule,
    add_messages,
    balanced_cuts,
    format_table,
    pipeline_schedule,
    simulate,
    strip_messages,
    validate,
)

K = ActionKind
GRID = [
    (name, p, m, v)
    for name in SCHEDULES
    for p in range(1, 6)
    for m in range(1, 13)
    for v in (range(1, 4) if name == "interleaved" else (1,))
]


def _lists(*ranks: str) -> list[list[Action]]:
    return [[Action.parse(a) for a in text.split()] for text in ranks]


# --- actions ---------------------------------------------------------------------------------------


def test_action_string_form_round_trips():
    for kind in ActionKind:
        for stage, mb in ((0, 0), (3, 12), (11, 7)):
            a = Action(stage, kind, mb)
            assert Action.parse(str(a)) == a
            assert eval(repr(a), {"Action": Action, "ActionKind": ActionKind}) == a
    assert str(Action(2, K.F, 0)) == "2F0" and str(Action(1, K.SEND_B, 3)) == "1SEND_B3"
    assert Action.parse(" 10RECV_F11 ") == Action(10, K.RECV_F, 11)
    for bad in ("F0", "2F", "2X0", "2 F 0", "-1F0", "2SEND0"):
        with pytest.raises(ValueError, match="<stage><kind><microbatch>"):
            Action.parse(bad)
    assert [k.is_compute for k in ActionKind] == [True, True, True, False, False, False, False]
    assert K.SEND_B.carries is K.B and K.RECV_F.carries is K.F and K.W.carries is K.W


def test_format_table_marks_cells_and_pads_short_lists():
    text = format_table(_lists("0F0 0B0", "1F0"), marks=[(1, 1)])
    assert text.splitlines() == ["step  rank 0  rank 1", "   0  0F0     1F0", "   1  0B0     ><"]


# --- the builders over a grid: valid lists, closed forms -----------------------------------------------


def _channels(schedule: Schedule) -> tuple[dict, dict]:
    """Independently of the validator: per (kind, source, dest), the data items sent and received in order."""
    sent, received = defaultdict(list), defaultdict(list)
    for rank in range(schedule.p):
        for a in schedule.actions(rank):
            if a.kind is K.SEND_F:
                sent[(K.F, rank, schedule.rank_of(a.stage + 1))].append((a.stage, a.microbatch))
            elif a.kind is K.SEND_B:
                sent[(K.B, rank, schedule.rank_of(a.stage - 1))].append((a.stage, a.microbatch))
            elif a.kind is K.RECV_F:
                received[(K.F, schedule.rank_of(a.stage - 1), rank)].append((a.stage - 1, a.microbatch))
            elif a.kind is K.RECV_B:
                received[(K.B, schedule.rank_of(a.stage + 1), rank)].append((a.stage + 1, a.microbatch))
    return dict(sent), dict(received)


def test_every_schedule_on_the_grid_is_valid_and_runs():
    for name, p, m, v in GRID:
        s = pipeline_schedule(name, p, m, v)  # validated on construction
        assert (s.name, s.p, s.m, s.v, s.n_stages) == (name, p, m, v, p * v)
        assert s.split_backward == (name == "zero_bubble")
        kinds = (K.F, K.B, K.W) if s.split_backward else (K.F, K.B)
        for rank in range(p):
            compute = s.compute(rank)
            assert strip_messages([s.actions(rank)])[0] == compute
            position = {a: k for k, a in enumerate(compute)}
            assert len(position) == len(compute) == len(kinds) * v * m
            for stage in s.stages_of(rank):
                for i in range(m):
                    steps = [position[Action(stage, kind, i)] for kind in kinds]
                    assert steps == sorted(steps), (name, p, m, v, stage, i)
        sent, received = _channels(s)
        assert sent == received, (name, p, m, v)  # same items, same order, on every channel
        assert (not sent) == (p == 1)
        validate(s.action_lists, s.stage_ranks, m, lowered=True)
        assert s.simulate(latency=0.25).step >= s.simulate().step  # progresses with latency too


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name):
    for p in range(1, 6):
        for m in range(1, 13):
            t = pipeline_schedule(name, p, m).simulate()
            assert t.step == 2 * (m + p - 1)
            assert [t.busy(r) for r in range(p)] == [2 * m] * p
            assert Fraction(int(sum(t.idle(r) for r in range(p))), int(p * t.step)) == Fraction(p - 1, m + p - 1)
            assert t.bubble_fraction == (p - 1) / (m + p - 1)
            peaks = [t.peak_in_flight(r) for r in range(p)]
            assert peaks == ([m] * p if name == "gpipe" else [min(p - r, m) for r in range(p)])


def test_interleaved_step_and_memory():
    for p in range(1, 6):
        for m in range(1, 13):
            for v in range(1, 4):
                t = pipeline_schedule("interleaved", p, m, v).simulate()
                assert [t.busy(r) for r in range(p)] == [2 * v * m] * p
                if m >= p:
                    assert t.step == 2 * (v * m + p - 1), (p, m, v)
                    assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-14)
                else:  # one micro-batch's way through all v p stages and back bounds the step
                    assert t.step == 2 * (v * p + m - 1), (p, m, v)
                first_group = m // max(m // p, 1) + (m % max(m // p, 1) > 0)
                assert t.peak_in_flight(0) == min(v * m, p + (v - 1) * first_group)
                if m % p == 0:
                    assert t.peak_in_flight(0) == min(v * m, v * p)
    for p, m in ((1, 5), (3, 7)):  # v = 1 is 1F1B
        assert pipeline_schedule("interleaved", p, m).compute_lists == pipeline_schedule("1f1b", p, m).compute_lists


def test_zero_bubble_beats_1f1b_at_equal_work_and_memory():
    for p in range(1, 6):
        for m in range(1, 13):
            zb = pipeline_schedule("zero_bubble", p, m).simulate()
            base = pipeline_schedule("1f1b", p, m).simulate({"B": 2})  # 1F1B's B is ZB's B + W
            assert [zb.busy(r) for r in range(p)] == [base.busy(r) for r in range(p)] == [3 * m] * p
            assert zb.step == 2 * m + p - 1 + max(m, p), (p, m)
            assert base.step == 3 * (m + p - 1)
            if p > 1:
                assert sum(zb.idle(r) for r in range(p)) < sum(base.idle(r) for r in range(p))
            if m >= p:
                assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), rel=1e-14)
            zb_peaks = [zb.peak_in_flight(r) for r in range(p)]
            assert zb_peaks == [min(p, m)] * p  # activations held until W
            assert max(zb_peaks) == zb_peaks[0] == base.peak_in_flight(0) == max(base.peaks)


def test_schedule_table_shows_bubbles_as_blanks():
    s = pipeline_schedule("gpipe", 2, 2)
    assert s.table().splitlines() == [
        "time  rank 0  rank 1",
        "   0  0F0",
        "   1  0F1     1F0",
        "   2          1F1",
        "   3          1B0",
        "   4  0B0     1B1",
        "   5  0B1",
    ]
    assert str(s).startswith("gpipe schedule: p=2 ranks, m=2 micro-batches, v=1 stages per rank\ntime")
    slow = simulate(s.action_lists, {"F": [1, 2]}).table().splitlines()  # stage 1's forward takes 2
    assert slow[1:5] == ["   0  0F0", "   1  0F1     1F0", "   2          |", "   3          1F1"]


def test_schedule_accessors_and_cache():
    s = pipeline_schedule("interleaved", 3, 6, 2)
    assert s.stage_ranks == (0, 1, 2, 0, 1, 2)
    assert [s.rank_of(st) for st in range(6)] == [0, 1, 2, 0, 1, 2]
    assert s.stages_of(1) == (1, 4)
    assert pipeline_schedule("interleaved", 3, 6, 2) is s
    assert repr(s) == "Schedule(name='interleaved', p=3, m=6, v=2)"
    for bad in (-1, 3, 1.0):
        with pytest.raises(ValueError, match="rank must be an int in 0 .. 2"):
            s.actions(bad)
    with pytest.raises(ValueError, match="stage must be an int in 0 .. 5"):
        s.rank_of(6)
    for name, p, m, v in GRID[::7]:
        sched = pipeline_schedule(name, p, m, v)
        for stage in range(sched.n_stages):
            done = sched.gradients_done(stage)
            assert done.stage == stage and done.kind is (K.W if name == "zero_bubble" else K.B)
            compute = sched.compute(sched.rank_of(stage))
            assert all(a.stage != stage or a.kind is K.F for a in compute[compute.index(done) + 1 :])
    one_rank = pipeline_schedule("interleaved", 1, 4, 3)
    assert one_rank.actions(0) == one_rank.compute(0)  # neighbouring stages on one rank: no messages


def test_bad_arguments_name_the_values_and_the_fix():
    with pytest.raises(
        ValueError, match="unknown pipeline schedule 'pipedream'.*gpipe, 1f1b, interleaved, zero_bubble"
    ):
        pipeline_schedule("pipedream", 2, 4)
    for p, m, v, what in ((0, 4, 1, "p"), (2, 0, 1, "m"), (2, 4, 0, "v")):
        with pytest.raises(ValueError, match=f"{what} .* must be >= 1, got 0: use {what} >= 1"):
            pipeline_schedule("interleaved", p, m, v)
    with pytest.raises(TypeError, match="m .* must be an int, got float 4.0"):
        pipeline_schedule("1f1b", 2, 4.0)  # type: ignore[arg-type]
    for name in ("gpipe", "1f1b", "zero_bubble"):
        with pytest.raises(
            ValueError, match=f"'{name}' schedule holds one stage per rank, got v=2: use v=1, or name='interleaved'"
        ):
            pipeline_schedule(name, 2, 4, 2)


# --- lowering ------------------------------------------------------------------------------------------


def test_lowering_receives_in_the_senders_order():
    compute = _lists("0F0 0F1 0B1 0B0", "1F1 1F0 1B1 1B0")
    lowered = add_messages(compute, (0, 1))
    assert [str(a) for a in lowered[0]] == "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0B1 0RECV_B0 0B0".split()
    # rank 1 uses micro-batch 1 first, but rank 0 sends 0 first: both receives go before 1F1
    assert [str(a) for a in lowered[1]] == "1RECV_F0 1RECV_F1 1F1 1F0 1B1 1SEND_B1 1B0 1SEND_B0".split()
    validate(lowered, (0, 1), 2, lowered=True)
    assert strip_messages(lowered) == tuple(tuple(c) for c in compute)
    with pytest.raises(ValueError, match="already has message 0SEND_F0"):
        add_messages(lowered, (0, 1))
    with pytest.raises(ValueError, match="stage 1 is not on rank 0"):
        add_messages(_lists("1F0", "0F0"), (0, 1))


# --- the validator -------------------------------------------------------------------------------------


def test_validator_catches_a_backward_before_its_forward():
    lists = [list(c) for c in pipeline_schedule("1f1b", 2, 3).compute_lists]
    lists[1][0], lists[1][1] = lists[1][1], lists[1][0]  # 1B0 1F0 ...
    with pytest.raises(ValueError, match=r"rank 1 step 0: 1B0 comes before 1F0 \(step 1\)") as err:
        validate(lists, (0, 1), 3, lowered=False)
    assert ">1B0<" in str(err.value) and ">1F0<" in str(err.value) and "rank 0  rank 1" in str(err.value)
    with pytest.raises(ValueError, match="comes before"):
        Schedule("custom", 2, 3, 1, lists)


def test_validator_catches_missing_duplicate_and_misplaced_actions():
    s = pipeline_schedule("zero_bubble", 2, 2)
    lowered = [list(a) for a in s.action_lists]
    missing = [lowered[0], [a for a in lowered[1] if a != Action(1, K.RECV_F, 1)]]
    with pytest.raises(ValueError, match=r"rank 1 has no 1RECV_F1 before 1F1 \(step \d+\)") as err:
        validate(missing, s.stage_ranks, 2, lowered=True)
    assert "rank 1" in str(err.value).splitlines()[1] and "><" not in str(err.value)
    no_w = [[a for a in c if a != Action(0, K.W, 1)] for c in s.compute_lists]
    with pytest.raises(ValueError, match="rank 0 has no 0W1 .*every B needs its W"):
        validate(no_w, s.stage_ranks, 2, lowered=False)
    twice = [list(s.compute_lists[0]) + [Action(0, K.F, 0)], list(s.compute_lists[1])]
    with pytest.raises(ValueError, match="0F0 appears 2 times"):
        validate(twice, s.stage_ranks, 2, lowered=False)
    with pytest.raises(ValueError, match="stage 1, which rank 1 holds"):
        validate([[Action(1, K.F, 0)], []], (0, 1), 1, lowered=False)
    with pytest.raises(ValueError, match="micro-batch 5, but the micro-batches are 0 .. 1"):
        validate([[Action(0, K.F, 5)], []], (0, 1), 2, lowered=False)
    with pytest.raises(ValueError, match="message 0SEND_F0 in a compute-only list"):
        validate(s.action_lists, s.stage_ranks, 2, lowered=False)
    with pytest.raises(ValueError, match=r"no list for rank\(s\) \[1\]"):
        validate({0: s.compute_lists[0]}, s.stage_ranks, 2, lowered=False)
    with pytest.raises(ValueError, match="1 lists for stages placed on ranks"):
        validate(s.compute_lists[:1], s.stage_ranks, 2, lowered=False)
    later = [list(lowered[0]), list(lowered[1])]
    later[0].remove(Action(0, K.SEND_F, 1))
    later[0].insert(later[0].index(Action(0, K.RECV_B, 0)) + 1, Action(0, K.SEND_F, 1))
    validate(later, s.stage_ranks, 2, lowered=True)  # a later send is valid (if slower)
    later[0].remove(Action(0, K.SEND_F, 1))
    later[0].append(Action(0, K.SEND_F, 1))  # too late: rank 0 needs 1B1 first, which needs it
    with pytest.raises(ValueError, match="not progressing"):
        validate(later, s.stage_ranks, 2, lowered=True)
    early = [list(lowered[0]), list(lowered[1])]
    early[0].remove(Action(0, K.SEND_F, 0))
    early[0].insert(0, Action(0, K.SEND_F, 0))
    with pytest.raises(ValueError, match=r"rank 0 step 0: 0SEND_F0 must come after 0F0 \(step 1\)"):
        validate(early, s.stage_ranks, 2, lowered=True)


def test_validator_catches_receives_in_another_order_than_sends():
    lists = _lists(
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F1 1RECV_F0 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
    )
    with pytest.raises(
        ValueError, match="F messages from rank 0 to rank 1 are received in another order than sent"
    ) as err:
        validate(lists, (0, 1), 2, lowered=True)
    table = str(err.value).splitlines()[1:]
    assert table[0] == "step  rank 0      rank 1"
    assert table[1].split() == ["0", "0F0", ">1RECV_F1<"] and table[2].split() == ["1", ">0SEND_F0<", "1RECV_F0"]


def test_simulator_and_validator_raise_on_a_deadlock():
    lowered = _lists("0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0")
    for run in (lambda: simulate(lowered), lambda: validate(lowered, (0, 1), 1, lowered=True)):
        with pytest.raises(
            ValueError, match=r"not progressing: .*rank 0 at 0RECV_B0 \(step 0\); rank 1 at 1RECV_F0 \(step 0\)"
        ) as err:
            run()
        assert ">0RECV_B0<" in str(err.value) and ">1RECV_F0<" in str(err.value)
    crossed = _lists("0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0")
    with pytest.raises(ValueError, match="not progressing"):
        simulate(crossed)
    with pytest.raises(ValueError, match="not progressing"):
        Schedule("crossed", 2, 2, 1, crossed)


# --- the simulator -------------------------------------------------------------------------------------


def test_simulator_costs_per_kind_per_stage_and_latency():
    gpipe = pipeline_schedule("gpipe", 2, 3)
    per_stage = {"F": [1, 3], "B": [1, 3]}
    by_call = gpipe.simulate(lambda a: (1, 3)[a.stage] if a.kind.is_compute else 0)
    for t in (gpipe.simulate(per_stage), by_call):
        assert t.step == 6 * 3 + 2  # the slow stage runs back to back; stage 0 adds one F and one B
        assert (t.busy(0), t.busy(1)) == (6, 18)
        assert t.start(1, Action(1, K.B, 0)) == 1 + 3 * 3
    for p in (1, 2, 4):
        for latency in (0.5, 2.0):
            t = pipeline_schedule("gpipe", p, 5).simulate(latency=latency)
            assert t.step == pytest.approx(2 * 5 + 2 * (p - 1) * (1 + latency), rel=1e-14)
    t = pipeline_schedule("1f1b", 2, 2).simulate({K.SEND_F: 0.5})
    assert t.start(1, Action(1, K.F, 0)) == 1.5
    for bad, match in (({"F": -1}, "cost of 0F0 must be a finite number >= 0"), ({"F": [1]}, "give one per stage")):
        with pytest.raises(ValueError, match=match):
            gpipe.simulate(bad)
    with pytest.raises(ValueError, match="latency must be a finite number >= 0"):
        gpipe.simulate(latency=-1)
    with pytest.raises(TypeError, match="costs must be None, a mapping"):
        gpipe.simulate(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stage 0 computes on ranks 0 and 1"):
        simulate(_lists("0F0", "0B0"))


# --- the stage balancer --------------------------------------------------------------------------------


def _brute_force(costs, parts, min_per_part, secondary):
    n = len(costs)
    best = None
    for inner in itertools.combinations(range(1, n), parts - 1):
        cuts = (0, *inner, n)
        sizes = [b - a for a, b in zip(cuts, cuts[1:])]
        if min(sizes) < min_per_part:
            continue
        top = max(sum(costs[a:b]) for a, b in zip(cuts, cuts[1:]))
        extra = max(sum(secondary[a:b]) for a, b in zip(cuts, cuts[1:])) if secondary else 0
        key = (top, extra, sizes[0] + sizes[-1] if parts > 1 else 0, sizes[0], cuts)
        best = key if best is None or key < best else best
    return best[-1]


def test_balanced_cuts_is_optimal_against_brute_force():
    rng = random.Random(33)
    for _ in range(400):
        n = rng.randint(1, 9)
        min_per_part = rng.choice((1, 1, 2))
        if n < min_per_part:
            continue
        parts = rng.randint(1, n // min_per_part)
        costs = [rng.randint(0, 6) for _ in range(n)]
        secondary = [rng.randint(0, 6) for _ in range(n)] if rng.random() < 0.5 else None
        got = balanced_cuts(costs, parts, min_per_part, secondary)
        assert got == _brute_force(costs, parts, min_per_part, secondary), (costs, parts, min_per_part, secondary)
    assert balanced_cuts([1.0] * 8, 3) == (0, 2, 5, 8)  # 2, 3, 3: fewer modules on the first and last stages
    assert balanced_cuts([1, 0, 0, 1], 2) == (0, 1, 4)  # every cut costs 1: the smallest first stage
    assert balanced_cuts([1, 0, 0, 1], 2, secondary=[0, 5, 5, 0]) == (0, 2, 4)  # then balance the secondary cost


def test_balanced_cuts_refuses_empty_stages():
    with pytest.raises(
        ValueError, match="cannot cut 3 modules into 4 parts .* a stage would be empty; use at most 3 parts"
    ):
        balanced_cuts([1, 2, 3], 4)
    with pytest.raises(ValueError, match="into 2 parts of at least 2 module.*use at most 1 parts"):
        balanced_cuts([1, 2, 3], 2, min_per_part=2)
    with pytest.raises(ValueError, match=r"costs\[1\] must be a finite number >= 0"):
        balanced_cuts([1, -2, 3], 2)
    with pytest.raises(ValueError, match="secondary has 2 values for 3 modules"):
        balanced_cuts([1, 2, 3], 2, secondary=[1, 2])
    with pytest.raises(TypeError, match="parts must be an int"):
        balanced_cuts([1, 2, 3], 2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("shape", "dims", "split", "dims2", "split2"),
    [
        ((7, 5, 4), (2, 3), (0, 1, None), (2, 3), (1, 0, None)),  # rows x columns -> columns x rows
        ((7, 5, 4), (2, 3), (0, 1, None), (6,), (None, 0, None)),  # onto another shape of the 6 ranks
        ((9, 4), (3,), (0, None), (3,), (None, 0)),
        ((6, 6), (2, 2), (0, 1), (4,), (0, None)),
        ((5, 3), (2, 2), (0, None), (2, 2), (0, None)),  # no change, replicated over the second axis
        ((5, 3), (2, 2), (0, 1), (2, 2), (0, 1)),  # no change: every piece to its counterpart
    ],
)
def test_stage_boundary_transfers_pair_every_piece_in_order(shape, dims, split, dims2, split2) -> None:  # type: ignore[no-untyped-def]
    """A layout change fused into a stage boundary (hpctp.layout.group_transfer_plan between the two stages' model
    ranks, interleaved in the grid's numbering): for every pair of ranks, the boxes one sends are the boxes the other
    receives, in the same order (messages of one tag match in order); every element of each new block arrives exactly
    once (a replicated block sent by one replica to every replica), the gradient's pieces go back the same way, and an
    unchanged layout split over every axis goes to the counterpart only."""
    from hpctp.layout import Layout, grid_coords, group_transfer_plan

    src, dst = Layout(shape, dims, split), Layout(shape, dims2, split2)
    n = src.nranks
    before, after = tuple(range(0, 2 * n, 2)), tuple(range(1, 2 * n, 2))  # (stages along the fastest grid axis)
    for a, ra, b, rb in ((src, before, dst, after), (dst, after, src, before)):
        plans = {r: group_transfer_plan(a, ra, b, rb, r) for r in range(2 * n)}
        for r in ra:
            for q in rb:
                sent = [p.box for p in plans[r].sends if p.peer == q]
                got = [p.box for p in plans[q].recvs if p.peer == r]
                assert sent == got, (r, q)
        for g, q in enumerate(rb):
            count = np.zeros(b.local_shape(grid_coords(g, b.grid_dims)), dtype=int)
            for p in plans[q].recvs:
                count[p.slices] += 1
            assert (count == 1).all(), q
        if (dims, split) == (dims2, split2) and not src.replicated_axes:
            assert all(p.peer == rb[ra.index(r)] for r in ra for p in plans[r].sends)
