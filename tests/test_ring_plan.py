"""Ring plans of attention over split tokens (hpctp.layout.ring) and the schedules' cost model: pure, no MPI."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hpctp.layout import Layout, grid_coords
from hpctp.layout.ring import all_to_all_split, flat_token_indices, ring_plan, token_axes, token_dims
from hpctp.linalg.cost import choose_schedule, predict_attention


def _layout(tokens, grid, token_split, batch_split=None, heads_split=None, head_dim=4, cuts=(), batch=2, heads=3):
    shape = (batch, heads, *tokens, head_dim)
    return Layout(shape, grid, (batch_split, heads_split, *token_split, None), cuts)


def _tokens_of(plan, step):
    return flat_token_indices(step.ranges, plan.kv_shape)


def test_token_dims_and_axes():
    assert token_dims(4) == (2,)
    assert token_dims(6) == (2, 3, 4)
    with pytest.raises(ValueError, match="at least one token dim"):
        token_dims(3)
    assert token_axes(_layout((5, 7), (2, 3), (1, None), batch_split=0)) == (1,)
    assert token_axes(_layout((3, 4, 5), (1, 2, 3), (2, 0, 1))) == (0, 1, 2)


def test_flat_token_indices_are_numpys_row_major_order():
    shape = (3, 4, 5)
    box = ((1, 3), (0, 4), (2, 5))
    want = np.arange(60).reshape(shape)[1:3, 0:4, 2:5].ravel()
    np.testing.assert_array_equal(flat_token_indices(box, shape), want)
    assert flat_token_indices(((2, 2), (0, 4), (0, 5)), shape).size == 0


def test_ring_over_a_2x2_token_split_visits_every_block_once():
    q = _layout((5, 7), (2, 2), (0, 1))
    total = 35
    for rank in range(4):
        plan = ring_plan(q, q, rank)
        assert plan.ring == (0, 1, 2, 3)
        assert plan.position == rank
        assert plan.send_to == (rank + 1) % 4 and plan.recv_from == (rank - 1) % 4
        assert [s.owner for s in plan.steps] == [(rank - s) % 4 for s in range(4)]
        assert plan.steps[0].ranges == tuple(q.local_ranges(grid_coords(rank, (2, 2)))[2:4])
        seen = np.sort(np.concatenate([_tokens_of(plan, s) for s in plan.steps]))
        np.testing.assert_array_equal(seen, np.arange(total))  # every key once, none twice
        succ = ring_plan(q, q, plan.send_to).steps[0].tokens
        assert plan.sent_tokens == total - succ
        assert plan.recv_tokens == total - plan.steps[0].tokens
        assert all(s.visibility == "all" for s in plan.steps)
        assert plan.q_tokens == math.prod(hi - lo for lo, hi in plan.q_ranges)


def test_each_step_receives_what_the_predecessor_held_one_step_earlier():
    q = _layout((3, 4, 5), (1, 2, 3), (2, 0, 1), cuts=(None, None, (0, 0, 1, 3), None, (0, 4, 5), None))
    plans = [ring_plan(q, q, r) for r in range(6)]
    for plan in plans:
        pred = plans[plan.recv_from]
        assert pred.send_to == plan.rank
        for s in range(1, plan.size):
            assert plan.steps[s].owner == pred.steps[s - 1].owner
            assert plan.steps[s].ranges == pred.steps[s - 1].ranges


def test_ring_is_the_token_sub_grid_only():
    # batch over grid axis 0, tokens over axis 1: rings are the rows of the grid
    q = _layout((11,), (2, 3), (1,), batch_split=0)
    assert ring_plan(q, q, 4).ring == (3, 4, 5)
    assert ring_plan(q, q, 1).ring == (0, 1, 2)
    # a replicated grid axis: each replica group has its own ring
    r = _layout((11,), (2, 2), (1,))
    assert ring_plan(r, r, 2).ring == (2, 3)
    # no token split: a ring of one rank
    one = _layout((5, 7), (2, 1), (None, None), batch_split=0)
    plan = ring_plan(one, one, 1)
    assert plan.ring == (1,) and plan.size == 1 and plan.sent_tokens == 0 and plan.recv_tokens == 0


@pytest.mark.parametrize(
    "tokens,grid,split", [((11,), (4,), (0,)), ((5, 7), (2, 3), (0, 1)), ((3, 4, 5), (1, 2, 3), (0, 1, 2))]
)
def test_causal_visibility_matches_the_flattened_indices(tokens, grid, split):
    q = _layout(tokens, grid, split)
    for rank in range(math.prod(grid)):
        plan = ring_plan(q, q, rank, causal=True)
        qi = flat_token_indices(plan.q_ranges, plan.q_shape)
        for step in plan.steps:
            ki = _tokens_of(plan, step)
            visible = ki[None, :] <= qi[:, None]
            if visible.size == 0 or not visible.any():
                assert step.visibility == "none"
            elif visible.all():
                assert step.visibility == "all"
            else:
                assert step.visibility == "partial"
        assert plan.steps[0].visibility in ("partial", "none")  # own block: the diagonal


def test_cross_attention_keys_with_other_token_cuts():
    q = _layout((5, 7), (2, 2), (0, 1))
    k = _layout((4, 6), (2, 2), (0, 1), cuts=(None, None, (0, 1, 4), (0, 6, 6), None))
    plan = ring_plan(q, k, 3, causal=True)
    assert plan.kv_shape == (4, 6) and plan.q_shape == (5, 7)
    assert sorted(s.tokens for s in plan.steps) == sorted([1 * 6, 1 * 0, 3 * 6, 3 * 0])
    assert [s.visibility for s in plan.steps if s.tokens == 0] == ["none", "none"]


def test_empty_blocks_are_skipped_but_still_in_the_ring():
    q = _layout((3,), (4,), (0,))  # 3 tokens over 4 ranks: the last block is empty
    plan = ring_plan(q, q, 3)
    assert plan.q_tokens == 0 and all(s.visibility == "none" for s in plan.steps)
    assert plan.size == 4 and plan.sent_tokens == 3 - 1 and plan.recv_tokens == 3


def test_plans_are_cached():
    q = _layout((5, 7), (2, 2), (0, 1))
    assert ring_plan(q, q, 1, True) is ring_plan(q, q, 1, True)


@pytest.mark.parametrize(
    "q,k,match",
    [
        (_layout((5,), (2,), (0,)), _layout((5,), (2,), (None,), batch_split=0), "split alike"),
        (
            Layout((2, 3, 5, 4), (2,), (None, None, None, 0)),
            Layout((2, 3, 5, 4), (2,), (None, None, None, 0)),
            "head dim",
        ),
        (_layout((5,), (2,), (0,)), _layout((5,), (2,), (0,), batch=3), "batch dim"),
        (_layout((5,), (2,), (0,)), _layout((0,), (2,), (0,)), "no token"),
        (_layout((5,), (2,), (0,)), _layout((5, 1), (2,), (0, None)), "same number of dims"),
        (Layout((2, 3, 4), (2,), (None, None, 0)), Layout((2, 3, 4), (2,), (None, None, 0)), "at least one token dim"),
    ],
)
def test_ring_plan_refuses_layouts_that_do_not_fit(q, k, match):
    with pytest.raises(ValueError, match=match):
        ring_plan(q, k, 0)


def test_ring_plan_refuses_a_rank_off_the_grid():
    q = _layout((5,), (2,), (0,))
    with pytest.raises(ValueError, match="rank 2"):
        ring_plan(q, q, 2)


def test_all_to_all_split_moves_token_axes_to_batch_and_heads():
    assert all_to_all_split(_layout((11,), (4,), (0,)))[0] == (None, 0, None, None)
    # heads already split: the token axis goes to batch
    assert all_to_all_split(_layout((11,), (2, 3), (1,), heads_split=0))[0] == (1, 0, None, None)
    # two token axes: batch and heads, the pairing that leaves the fewest batch x heads per rank
    two = all_to_all_split(_layout((5, 7), (2, 3), (0, 1), batch=2, heads=3))[0]
    assert two == (0, 1, None, None, None)
    # a single-rank token axis stays where it is
    assert all_to_all_split(_layout((3, 4, 5), (1, 2, 3), (0, 1, 2)))[0] in (
        (1, 2, 0, None, None, None),
        (2, 1, 0, None, None, None),
    )
    split, reason = all_to_all_split(_layout((3, 4, 5), (2, 2, 2), (0, 1, 2)))
    assert split is None and "3 grid axes" in reason
    split, reason = all_to_all_split(_layout((11,), (2, 3), (1,), batch_split=0, heads_split=None))
    assert split == (0, 1, None, None)


@pytest.mark.parametrize(
    "tokens,grid,split", [((11,), (3,), (0,)), ((5, 7), (2, 2), (0, 1)), ((3, 4, 5), (2, 1, 3), (0, 1, 2))]
)
def test_ring_cost_bytes_are_the_plans_busiest_rank(tokens, grid, split):
    q = _layout(tokens, grid, split, head_dim=4)
    v = _layout(tokens, grid, split, head_dim=6)
    per_token = 2 * 3 * (4 + 6) * 8
    plans = [ring_plan(q, q, r) for r in range(math.prod(grid))]
    fwd = max(p.sent_tokens for p in plans) * per_token
    cost = predict_attention(q, q, v, 8, backward=False)["ring"]
    assert cost.bytes_sent == fwd
    total = math.prod(tokens)
    both = max(p.sent_tokens * 2 + total for p in plans) * per_token
    assert predict_attention(q, q, v, 8, backward=True)["ring"].bytes_sent == both


def test_cost_model_choice():
    q = _layout((5, 7), (2, 2, 2), (0, 1), heads_split=2)  # batch and heads: only batch is free
    costs = predict_attention(q, q, q, 8)
    assert not costs["all_to_all"].supported and costs["all_to_all"].time == math.inf
    assert choose_schedule(costs) == "ring"
    # long sequences, compute-bound: the causal all-to-all halves the busiest rank's work
    long = _layout((4096,), (4,), (0,), batch=1, heads=16, head_dim=64)
    causal = predict_attention(long, long, long, 4, causal=True)
    assert causal["all_to_all"].flops == pytest.approx(causal["ring"].flops / 2)
    assert choose_schedule(causal) == "all_to_all"
    full = predict_attention(long, long, long, 4, causal=False)
    assert choose_schedule(full) == "ring"  # the ring hides its transfers behind the compute
    # fewer heads than ranks leave all-to-all ranks idle
    few = _layout((4096,), (8,), (0,), batch=1, heads=2, head_dim=64)
    assert choose_schedule(predict_attention(few, few, few, 4, causal=True)) == "ring"
    # no token split: nothing moves, torch's own kernel
    local = _layout((64,), (1,), (None,))
    assert choose_schedule(predict_attention(local, local, local, 8)) == "all_to_all"


def test_every_split_of_a_small_grid_plans():
    for grid in [(1,), (2,), (3,), (2, 2), (1, 2, 3), (3, 2)]:
        for split in itertools.permutations(list(range(len(grid))) + [None] * (3 - len(grid)), 3):
            q = _layout((3, 4, 5), grid, split)
            total = 60
            for r in range(math.prod(grid)):
                plan = ring_plan(q, q, r)
                got = np.sort(np.concatenate([_tokens_of(plan, s) for s in plan.steps]))
                np.testing.assert_array_equal(got, np.arange(total))
