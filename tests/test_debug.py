"""The flight recorder, the mismatch check and the watchdog (hpctp.debug, hpctp.comm.trace).

The analysis (hang diagnosis, wait states, Perfetto trace) is tested on synthetic dumps without
MPI; the recorder, its labels, the check and the watchdog thread on the ranks of the run. The
jobs that fail on purpose are in tests/test_debug_faults.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpctp
import hpctp.debug as D
from hpctp.comm import callsite
from hpctp.comm import trace as T
from hpctp.comm.env import check_setting, environment_error, trace_setting, watchdog_setting
from hpctp.debug.dumps import parse_dump, read_dump
from hpctp.debug.timeline import clock_offsets, matches
from hpctp.debug.types import Call, GroupInfo, MatchState, ProcessState, RankDump, Where
from hpctp.debug.watcher import write_dump
from hpctp.testing import assert_all, assert_equal

G3 = GroupInfo("hpctp.grid[0-2]", "hpctp.grid", (0, 1, 2))
G2 = GroupInfo("hpctp.grid[0-1]", "hpctp.grid", (0, 1))


# ---------------------------------------------------------------------------------------------- synthetic dumps
def _call(rank: int, cid: int, seq: int, start: float, end: float, op: str = "Allreduce", **kw: object) -> Call:
    fields: dict[str, object] = dict(
        rank=rank, id=cid, group=G3.key, p2p=False, op=op, seq=seq, pair=-1, nbytes=64, dtype="float64", peer=-1,
        tag=-1, root=-1, detail="", label="Conv2d.forward halo", site=f"/job/train.py:{40 + seq}", block=-1,
        start=start, wait=0.0, end=end, state="completed" if end else "started",
    )  # fmt: skip
    fields.update(kw)
    return Call(**fields)  # type: ignore[arg-type]


def _dump(rank: int, calls: list[Call], groups: tuple[GroupInfo, ...] = (G3,), **kw: object) -> RankDump:
    fields: dict[str, object] = dict(
        rank=rank, world_size=len(groups[0].ranks), host="node0", pid=100 + rank, time=100.0, clock_sync=0.0,
        ring=2000, recorded=len(calls), groups=groups, calls=tuple(calls), blocked=(), blocked_since=0.0,
        last_end=max((c.end for c in calls), default=0.0), state=ProcessState.RUNNING, stack=(), site="",
        exception="", answers="r", job="job-x",
    )  # fmt: skip
    fields.update(kw)
    return RankDump(**fields)  # type: ignore[arg-type]


def _steps(rank: int, n: int, t0: float = 1.0, group: GroupInfo = G3) -> list[Call]:
    return [_call(rank, i, i, t0 + i, t0 + i + 0.1, group=group.key) for i in range(n)]


def test_diagnose_names_the_missing_rank_and_where_it_is() -> None:
    """Ranks 0 and 2 wait in collective #3; rank 1 made only #0-#2 and sits outside hpctp (a sleep)."""
    waiting = {r: _steps(r, 3) + [_call(r, 3, 3, 4.0, 0.0)] for r in (0, 2)}
    dumps = {r: _dump(r, cs, blocked=(3,), blocked_since=4.0) for r, cs in waiting.items()}
    dumps[1] = _dump(1, _steps(1, 3), last_end=3.1, site="/job/train.py:99")
    report = D.diagnose(dumps, reason="rank 0 waited")
    (d,) = report.divergences
    assert (d.group, d.seq, d.state, d.missing, d.odd) == (G3, 3, MatchState.MISSING, (1,), ())
    assert report.culprits == (1,)
    pos = {p.rank: p for p in report.positions}
    assert pos[0].where is Where.IN_CALL and pos[0].seconds == pytest.approx(96.0) and pos[0].calls[0].seq == 3
    assert pos[1].where is Where.OUTSIDE and pos[1].seconds == pytest.approx(96.9) and pos[1].last is not None
    text = D.format_report(report)
    assert "collective #3: Allreduce: missing ranks" in text and "missing ranks: {1}" in text
    assert "rank 1: outside hpctp since 96.9 s, at /job/train.py:99" in text
    assert json.loads(json.dumps(D.report_json(report)))["divergences"][0]["missing"] == [1]


@pytest.mark.parametrize(
    "change, state",
    [
        ({"op": "Bcast", "root": 0}, MatchState.OP_MISMATCH),
        ({"nbytes": 32}, MatchState.SIZE_MISMATCH),
        ({"dtype": "float32"}, MatchState.DTYPE_MISMATCH),
    ],  # fmt: skip
)
def test_diagnose_names_the_odd_rank_of_a_mismatch(change: dict[str, object], state: MatchState) -> None:
    """Rank 2's collective #2 differs from ranks 0 and 1's: the minority is the odd rank."""
    dumps = {}
    for r in range(3):
        last = _call(r, 2, 2, 3.0, 0.0, **(change if r == 2 else {}))
        dumps[r] = _dump(r, _steps(r, 2) + [last], blocked=(2,), blocked_since=3.0)
    report = D.diagnose(dumps)
    (d,) = report.divergences
    assert (d.seq, d.state, d.odd, d.missing) == (2, state, (2,), ())
    assert report.culprits == (2,)


def test_diagnose_hints_at_the_skipped_call() -> None:
    """Rank 1 skipped one call of a loop (line 40): its final call (line 50) lined up with the others' last
    loop call, and the others then wait alone in their final call."""
    g = G2.key
    r0 = [_call(0, i, i, 1.0 + i, 1.1 + i, site="/job/t.py:40", group=g) for i in range(3)]
    r0 += [_call(0, 3, 3, 5.0, 0.0, site="/job/t.py:50", group=g)]
    r1 = [_call(1, i, i, 1.0 + i, 1.1 + i, site="/job/t.py:40", group=g) for i in range(2)]
    r1 += [_call(1, 2, 2, 3.0, 3.1, site="/job/t.py:50", group=g)]
    dumps = {0: _dump(0, r0, (G2,), blocked=(3,), blocked_since=5.0), 1: _dump(1, r1, (G2,), state=ProcessState.EXITED)}
    (d,) = D.diagnose(dumps).divergences
    assert (d.seq, d.state, d.missing, d.sites_differ_at) == (3, MatchState.MISSING, (1,), 2)
    assert {c.site for c in d.sites} == {"/job/t.py:40", "/job/t.py:50"}
    assert "a rank may have skipped or added a call" in D.format_report(D.diagnose(dumps))


def test_diagnose_messages_missing_sender_and_size() -> None:
    """Rank 0 waits for message #4 from rank 1, which posted only #0-#3; rank 2 received 32 B of rank 1's 64 B."""
    recv = _call(0, 0, 4, 5.0, 0.0, op="Irecv", p2p=True, peer=1, tag=7, pair=4, wait=5.1)
    sends = [_call(1, i, i, 1.0 + i, 1.1 + i, op="Isend", p2p=True, peer=0, tag=7, pair=i) for i in range(4)]
    sends.append(_call(1, 4, 4, 6.0, 6.1, op="Isend", p2p=True, peer=2, tag=7, pair=0))
    short = _call(2, 0, 0, 6.0, 0.0, op="Irecv", p2p=True, peer=1, tag=7, pair=0, nbytes=32, wait=6.1)
    dumps = {0: _dump(0, [recv], blocked=(0,), blocked_since=5.1), 1: _dump(1, sends), 2: _dump(2, [short])}
    found = {(d.state, d.seq): d for d in D.diagnose(dumps).divergences}
    assert found[(MatchState.MISSING, 4)].missing == (1,)
    assert found[(MatchState.SIZE_MISMATCH, 0)].odd == (1,)  # the sender's size differs from what was expected
    assert "message #4 of rank 1 to rank 0, tag 7: missing ranks" in D.format_report(D.diagnose(dumps))


def test_diagnose_truncated_rings_no_dump_and_all_inside() -> None:
    """Calls older than some ring holds are not compared; an absent dump is named; all inside: the last arrival."""
    long = _steps(0, 10, group=G2)
    short = _steps(1, 10, group=G2)[7:]
    assert D.diagnose({0: _dump(0, long, (G2,)), 1: _dump(1, short, (G2,))}).divergences == ()
    inside = {r: _dump(r, _steps(r, 2) + [_call(r, 2, 2, 3.0 + r, 0.0)], blocked=(2,), blocked_since=3.0 + r)
              for r in range(3)}  # fmt: skip
    report = D.diagnose(inside)
    assert report.divergences[0].state is MatchState.INCOMPLETE and report.culprits == (2,)
    del inside[1]
    report = D.diagnose(inside, ranks=[0, 1, 2])
    assert 1 in report.culprits and report.positions[1].where is Where.NO_DUMP
    assert report.divergences[0].no_dump == (1,)


# ---------------------------------------------------------------------------------------------- wait states
def _late_run(late: float, calls: int = 5) -> dict[int, RankDump]:
    """3 ranks, ``calls`` blocking collectives; rank 2 arrives ``late`` after the others every time."""
    dumps = {}
    for r in range(3):
        cs = []
        for i in range(calls):
            t = 10.0 + i
            arrive = t + (late if r == 2 else 0.0)
            cs.append(_call(r, i, i, arrive, t + late + 0.001, block=150 if r == 2 else 100))
        dumps[r] = _dump(r, cs)
    return dumps


def test_summarize_names_the_late_rank_and_its_waits() -> None:
    s = D.summarize(_late_run(0.038))
    (st,) = s.stragglers
    assert (st.rank, st.label, st.late, st.matched) == (2, "Conv2d.forward halo", 5, 5)
    assert st.mean_late == pytest.approx(0.038)
    assert st.waited == pytest.approx(2 * 5 * 0.038)  # ranks 0 and 1 wait 38 ms at each of the 5 calls
    assert st.block_ratio == pytest.approx(1.5) and st.compute_ratio == pytest.approx(1.0, rel=0.05)
    waits = {t.rank: t.waiting for t in s.ranks}
    assert waits[0] == pytest.approx(0.19) and waits[2] == pytest.approx(0.0)
    text = D.format_summary(s)
    assert "rank 2 arrives 38.0 ms late at every Conv2d.forward halo" in text and "1.50x" in text
    assert s.matched == 5 and s.unmatched == 0
    assert D.summarize(_late_run(0.0002)).stragglers == ()  # below STRAGGLER_SECONDS: noise


def test_summarize_late_sender_of_messages() -> None:
    """Rank 1 posts its send 20 ms after rank 0 posted the receive and started waiting on it."""
    dumps = {0: [], 1: []}
    for i in range(4):
        t = 1.0 + i
        dumps[0].append(_call(0, i, i, t, t + 0.021, op="Irecv", p2p=True, peer=1, tag=3, pair=i, wait=t + 0.001,
                              group=G2.key, label="halo"))  # fmt: skip
        dumps[1].append(_call(1, i, i, t + 0.02, t + 0.0201, op="Isend", p2p=True, peer=0, tag=3, pair=i,
                              group=G2.key, label="halo"))  # fmt: skip
    s = D.summarize({r: _dump(r, cs, (G2,)) for r, cs in dumps.items()})
    (st,) = s.stragglers
    assert (st.rank, st.late) == (1, 4) and st.mean_late == pytest.approx(0.02)
    assert st.waited == pytest.approx(4 * 0.019)


def test_clock_offsets_shift_other_hosts_only() -> None:
    dumps = {r: _dump(r, [], host="a" if r < 2 else "b", clock_sync=50.0 + (0.3 if r >= 2 else 0.001 * r))
             for r in range(4)}  # fmt: skip
    assert clock_offsets(dumps) == {0: 0.0, 1: 0.0, 2: pytest.approx(0.3), 3: pytest.approx(0.3)}


def test_perfetto_trace_tracks_and_flows(tmp_path: Path) -> None:
    dumps = _late_run(0.01, calls=3)
    trace = D.perfetto_trace(dumps)
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len([e for e in slices if e["cat"] == "mpi"]) == 9  # 3 ranks x 3 calls
    assert len([e for e in slices if e["cat"] == "wait"]) == 6  # ranks 0 and 1 wait for rank 2 at each call
    assert sum(e["ph"] == "s" for e in events) == sum(e["ph"] == "f" for e in events) == 6
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {f"rank {r} (node0)" for r in range(3)}
    assert len(list(matches(dumps))) == 3
    json.dumps(trace)
    D.plot_timeline(trace, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000


# ---------------------------------------------------------------------------------------------- settings
def test_environment_settings_are_parsed_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HPCTP_TRACE", "HPCTP_WATCHDOG", "HPCTP_CHECK"):
        monkeypatch.delenv(name, raising=False)
    assert (trace_setting(), watchdog_setting(), check_setting(), environment_error()) == (None, None, False, None)
    monkeypatch.setenv("HPCTP_TRACE", "2000")
    monkeypatch.setenv("HPCTP_WATCHDOG", "2.5")
    monkeypatch.setenv("HPCTP_CHECK", "yes")
    assert (trace_setting(), watchdog_setting(), check_setting()) == (2000, 2.5, True)
    assert T.settings() == T.Settings(2000, 2.5, True, None)
    for name, bad in (
        ("HPCTP_TRACE", "-1"),
        ("HPCTP_WATCHDOG", "5min"),
        ("HPCTP_WATCHDOG", "inf"),
        ("HPCTP_CHECK", "2"),
    ):
        monkeypatch.setenv(name, bad)
        err = environment_error()
        assert isinstance(err, ValueError) and f"{name}={bad!r}" in str(err)
        assert T.settings() == T.Settings()  # a bad value turns nothing on (the grid raises)
        monkeypatch.setenv(name, {"HPCTP_TRACE": "0", "HPCTP_WATCHDOG": "0", "HPCTP_CHECK": "0"}[name])
    assert T.settings() == T.Settings(0, 0.0, False, None)


def test_label_is_free_when_off_and_lazy_when_on() -> None:
    was = T.on
    T.stop()
    assert T.label("x {}", 1) is T.label("y")  # the shared no-op
    T.start(10)
    try:
        lab = T.label("redistribute {}->{}", (0, None), (None, 0), block=np.zeros((2, 3)))
        assert isinstance(lab, callsite.Label) and lab._rendered is None
        with lab:
            assert callsite.where(1)[0] == "redistribute (0, None)->(None, 0)"
            assert callsite.where(1)[2] == 6
        assert callsite.where(1)[1].endswith(f"test_debug.py:{_line()}")
        assert callsite.where(1)[0] == ""  # nothing known outside the label
    finally:
        if not was:
            T.stop()


class _Bucket:
    trace_label = "ShardedDataParallel bucket 3"  # the hook of objects that know what their calls are

    def post(self) -> tuple[str, str, int]:
        return callsite.where(1)


class _Net(torch.nn.Module):
    def forward(self) -> tuple[str, str, int]:
        return callsite.where(1)


def test_labels_from_the_stack() -> None:
    """A module's method names the layer (its class, not the class defining the method); an object's
    ``trace_label`` names the operation; the site is the first frame outside hpctp and torch."""
    T.start(10)
    try:
        post = _Bucket.post.__code__.co_firstlineno + 1
        assert _Bucket().post()[:2] == ("ShardedDataParallel bucket 3", f"{__file__}:{post}")
        layer, site, _ = _Net()()
        assert (layer, site) == ("_Net.forward", f"{__file__}:{_Net.forward.__code__.co_firstlineno + 1}")
    finally:
        T.stop()


def _line() -> int:
    import sys

    return sys._getframe(1).f_lineno


def test_dump_round_trip(tmp_path: Path) -> None:
    """A rank's dump (recorder snapshot, its state and stack) reads back as the typed RankDump."""
    T.start(4)
    try:
        for i in range(6):  # the ring keeps the last 4
            e = T.begin(MPI.COMM_SELF, "Allreduce", 8 * i, np.zeros(i), compare_size=True)
            T.end(e)
        path = write_dump(tmp_path, answers="q", job="job-1")
    finally:
        T.stop()
    d = read_dump(path)
    assert d == parse_dump(json.loads(path.read_text()))
    assert (d.ring, d.recorded, len(d.calls), d.answers, d.state) == (4, 6, 4, "q", ProcessState.RUNNING)
    assert [c.nbytes for c in d.calls] == [16, 24, 32, 40] and all(c.completed for c in d.calls)
    assert "test_debug.py:" in d.calls[0].site and d.calls[0].dtype == "float64"
    assert d.stack and d.stack[-1].function == "test_dump_round_trip"
    bad = json.loads(path.read_text())
    bad["version"] = "2.0"
    with pytest.raises(ValueError, match="dump format 2.0"):
        parse_dump(bad)


# ---------------------------------------------------------------------------------------------- on the ranks
@pytest.fixture
def recording():  # type: ignore[no-untyped-def]
    T.start(500)
    yield
    T.stop()


@pytest.mark.mpi(min_size=2)
def test_entries_line_up_and_name_the_layer(grid2d: hpctp.ProcessGrid, recording: None) -> None:
    """Every rank numbers the grid's collectives alike; a conv's halo messages are labelled with the layer,
    a redistribution with its layouts, and each entry with this file's line."""
    from hpctp.nn.conv import Conv2d

    first = len(T.entries())
    conv = Conv2d(2, 2, 3, padding=1, grid=grid2d, seed=1, dtype=torch.float64)
    x = hpctp.distribute(np.arange(2 * 2 * 6 * 6, dtype=np.float64).reshape(2, 2, 6, 6), grid2d, (None, None, 0, 1))
    x = hpctp.DistTensor(torch.from_numpy(x.local.copy()), grid2d, x.layout)
    with torch.no_grad():
        conv(x)
    x.redistribute((0, None, None, None))
    line = _line() - 1
    new = T.entries()[first:]
    halo = [e for e in new if e.p2p]
    assert_all(grid2d, bool(halo), "the conv exchanged a halo")
    assert_all(grid2d, all(e.label == "Conv2d.forward halo" and e.state == "completed" for e in halo), "halo labels")
    assert_all(grid2d, all(e.block == x.local.numel() for e in halo), "halo block sizes")
    move = [e for e in new if e.op == "Alltoallv"][-1]
    assert_all(grid2d, move.label == "redistribute (None, None, 0, 1)->(0, None, None, None)", move.label)
    assert_all(grid2d, move.site.endswith(f"test_debug.py:{line}"), move.site)
    seqs = [e.seq for e in new if not e.p2p and e.group.name == "hpctp.grid"]
    table = hpctp.comm.allgather_ints(grid2d.comm, [len(seqs), seqs[-1]])
    assert_all(grid2d, bool((table == table[0]).all()), f"sequence numbers differ between ranks: {table.tolist()}")


@pytest.mark.mpi(min_size=2)
def test_check_raises_on_every_rank_before_data_moves(grid1d: hpctp.ProcessGrid) -> None:
    """With the check armed, a rank that passes half the elements makes every rank raise, buffers untouched."""
    D.check(grid1d)
    try:
        n = 2 if grid1d.rank == grid1d.size - 1 else 4
        x = np.full(n, float(grid1d.rank))
        with pytest.raises(D.CollectiveMismatch, match=r"different size; nothing was sent") as err:
            hpctp.comm.allreduce(grid1d.comm, x)
        assert_all(grid1d, (x == grid1d.rank).all(), "the buffer is untouched")
        assert f"rank {grid1d.size - 1}: Allreduce 16 B float64" in str(err.value)
        y = np.ones(3)
        hpctp.comm.allreduce(grid1d.comm, y)  # matching calls pass
        assert_equal(grid1d, y, np.full(3, float(grid1d.size)))
    finally:
        D.check(grid1d, on=False)
    assert not T._check


@pytest.mark.mpi(min_size=2)
def test_grid_refuses_bad_or_differing_debug_settings(world: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCTP_WATCHDOG", "5min")
    with pytest.raises(ValueError, match="HPCTP_WATCHDOG='5min' is not a number of seconds"):
        hpctp.ProcessGrid([0], comm=world)
    monkeypatch.delenv("HPCTP_WATCHDOG")
    if world.Get_rank() == 0:
        monkeypatch.setenv("HPCTP_CHECK", "1")
    with pytest.raises(ValueError, match="ranks passed different environment"):
        hpctp.ProcessGrid([0], comm=world)


@pytest.mark.mpi(min_size=2)
def test_watchdog_thread_runs_while_the_main_thread_waits_in_mpi(
    grid1d: hpctp.ProcessGrid, tmp_path: Path, recording: None
) -> None:
    """Rank 0 waits in an all-reduce for 0.8 s (rank 1 sleeps first): its watchdog keeps polling meanwhile (every 0.25 s)
    and sees the wait; it does not fire (60 s)."""
    wd = D.watchdog(grid1d, 60.0, directory=tmp_path)  # (rank 0's path is used)
    try:
        polls = wd.polls
        if grid1d.rank == 1:
            time.sleep(0.8)
        hpctp.comm.allreduce(grid1d.comm, np.ones(1))
        waited = wd.polls - polls
        if grid1d.rank == 0:
            assert_all(grid1d, waited >= 2 and wd.longest_wait >= 0.5, f"{waited} polls, saw {wd.longest_wait:.2f} s")
        else:
            assert_all(grid1d, True, "")
        assert_all(grid1d, D.job_directory() is not None and D.job_directory() == wd.directory, "job directory")
    finally:
        wd.stop()
    path = D.dump()
    assert_all(grid1d, read_dump(path).rank == world_rank(), "dump written")


def world_rank() -> int:
    return MPI.COMM_WORLD.Get_rank()
