"""One machine model: the runtime's automatic choices price on the planner's machine.

Attention's ``schedule="auto"`` and SUMMA's ``panel="auto"`` price with :func:`hpctp.machine.runtime_cost_machine`
of :func:`hpctp.machine.default_machine` (``HPCTP_MACHINE``, :func:`hpctp.machine.use_machine`, or the device's
default); under a machine file whose links are slow they choose what :func:`hpctp.perf.predict_attention` /
:func:`hpctp.perf.recommend_panel` priced with that profile's :meth:`~hpctp.perf.MachineProfile.cost_machine`
choose, which differs from what :class:`hpctp.perf.Machine`'s default figures choose. The 1-rank tests run on
virtual grids (the choice needs only layouts); the ``mpi`` ones on the real grid.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hpctp
import hpctp.machine as M
from hpctp.comm.env import environment_error
from hpctp.layout import Layout
from hpctp.linalg.cost import Machine, choose_schedule, predict_attention, recommend_panel
from hpctp.nn.transformer import context_parallel as cp
from hpctp.testing import assert_all, assert_equal

MATMUL = importlib.import_module("hpctp.linalg.matmul")  # (hpctp.linalg.matmul is also the function's name)
F32 = torch.float32
#: (shape [batch, heads, tokens, head_dim], causal): attention calls whose "auto" schedule may depend on the machine
ATTENTION_CASES = [((1, 4, 64, 16), True), ((1, 8, 128, 16), True), ((1, 4, 256, 32), False), ((1, 4, 64, 16), False)]
#: (m, k, n) of a SUMMA product on a 2 x 2 grid whose best panel depends on the machine
MATMUL_SHAPE = (64, 4096, 64)


def slow_links(base: M.MachineProfile) -> M.MachineProfile:
    """``base`` with every link 10 us and 1 GB/s: a machine whose messages cost far more than its GEMMs."""
    links = {kind: M.Link(1e-5, 1e-9) for kind in M.KINDS}
    return dataclasses.replace(base, name=f"{base.name}, slow links", network={lv: dict(links) for lv in M.LEVELS})


@pytest.fixture
def machine_file(tmp_path: Path) -> Path:
    """A machine file written from the published h100-ndr profile, its links made slow."""
    return slow_links(M.load_machine("h100-ndr")).save(tmp_path / "slow.toml")


@pytest.fixture(autouse=True)
def no_machine_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(M.ENVIRONMENT, raising=False)


def attention_inputs(grid: hpctp.ProcessGrid, shape: tuple[int, ...]) -> list[hpctp.DistTensor]:
    """q, k, v of ``shape``, float32 on the CPU, the tokens split over grid axis 0 (no gradient: the forward's
    choice)."""
    lay = Layout(shape, grid.dims, (None, None, 0, None))
    gen = torch.Generator().manual_seed(0)
    return [hpctp.DistTensor(torch.randn(lay.local_shape(grid.coords), dtype=F32, generator=gen), grid, lay)
            for _ in range(3)]  # fmt: skip


def planner_schedule(lay: Layout, causal: bool, machine: Machine) -> str:
    """The schedule :func:`hpctp.perf.predict_attention` + :func:`~hpctp.perf.choose_schedule` pick on ``machine``."""
    return choose_schedule(predict_attention(lay, lay, lay, 4, causal=causal, backward=False, machine=machine))


def profile_machine(profile: M.MachineProfile, dims: tuple[int, ...], axes: tuple[int, ...]) -> Machine:
    """What the planner prices with: the profile's cost machine of the level of ``axes``, float32 GEMMs."""
    return profile.cost_machine(profile.level(dims, axes), "float32")


# ------------------------------------------------------------------------------------------------ the room
def test_the_machine_room_is_what_linalg_and_perf_export(machine_file: Path) -> None:
    import hpctp.perf
    import hpctp.perf.machine as pm

    assert hpctp.linalg.cost.Machine is M.Machine is hpctp.perf.Machine is pm.Machine
    for name in pm.__all__:
        assert getattr(pm, name) is getattr(M, name), name
    assert hpctp.perf.published_machines() == M.published_machines() == ("a100-hdr", "h100-ndr")
    assert M.MACHINES_DIR == Path(M.__file__).parent / "published"
    assert all((M.MACHINES_DIR / f"{n}.toml").is_file() for n in M.published_machines())
    assert M.resolve_machine("cpu") is M.CPU_MACHINE
    assert M.resolve_machine(str(machine_file)) == M.load_machine(machine_file)
    # the CPU default prices as Machine()'s figures did, and round-trips through its file
    assert M.CPU_MACHINE.cost_machine("intra", "float32") == Machine() == M.CPU_MACHINE.cost_machine("inter", "float64")
    assert M.profile_from_dict(__import__("tomllib").loads(M.CPU_MACHINE.to_toml())) == M.CPU_MACHINE


def test_default_machine_follows_the_setting_and_use_machine(machine_file: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    device = M.default_machine()
    assert device is M.default_machine()
    assert device.name == (M.load_machine(M.DEFAULT_GPU).name if torch.cuda.is_available() else M.CPU_MACHINE.name)
    monkeypatch.setenv(M.ENVIRONMENT, str(machine_file))
    from_file = M.default_machine()
    assert from_file == M.load_machine(machine_file) and from_file is M.default_machine()  # read once
    with M.use_machine("a100-hdr") as a100:
        assert M.default_machine() is a100 and a100.name == M.load_machine("a100-hdr").name
        with M.use_machine(M.CPU_MACHINE):
            assert M.default_machine() is M.CPU_MACHINE
        assert M.default_machine() is a100
    assert M.default_machine() is from_file
    monkeypatch.setenv(M.ENVIRONMENT, "cpu")
    assert M.default_machine() is M.CPU_MACHINE
    with pytest.raises(TypeError, match="MachineProfile, a machine file or a machine's name"):
        with M.use_machine(3):  # type: ignore[arg-type]
            pass


def test_runtime_cost_machine_is_the_profiles_cost_machine() -> None:
    h100 = M.load_machine("h100-ndr")  # 8 ranks per node
    assert M.runtime_cost_machine((2, 4), (0, 1), torch.bfloat16, h100) == h100.cost_machine("intra", "bfloat16")
    assert M.runtime_cost_machine((4, 4), (0,), np.dtype("float32"), h100) == h100.cost_machine("inter", "float32")
    assert M.runtime_cost_machine((4, 4), (1,), "float32", h100) == h100.cost_machine("intra", "float32")
    # element types the profile has no rates for: the half-width sibling's, else float32's
    assert M.runtime_cost_machine((2,), (0,), torch.float16, h100) == h100.cost_machine("intra", "bfloat16")
    assert M.runtime_cost_machine((2,), (0,), np.dtype(">f8"), h100) == h100.cost_machine("intra", "float32")
    # a profile measured within one node prices every level on its node's links
    one_node = dataclasses.replace(h100, network={"intra": h100.network["intra"]})
    assert M.runtime_cost_machine((16,), (0,), "float32", one_node) == h100.cost_machine("intra", "float32")
    with M.use_machine(h100):
        assert M.runtime_cost_machine((16,), (0,), "float32") == h100.cost_machine("inter", "float32")


# ------------------------------------------------------------------------------------------- attention "auto"
@pytest.mark.parametrize("ranks", [2, 4])
def test_auto_schedule_is_the_planners_choice_on_the_machine_file(ranks: int, machine_file: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """On a virtual grid: under the machine file (HPCTP_MACHINE, or use_machine of its path or profile) "auto" picks
    what the planner's pricing of that profile picks, for each case; and for one case at least that is not what
    Machine()'s default figures pick (and pick again once the setting is gone)."""
    grid = hpctp.ProcessGrid.virtual((ranks,), rank=ranks - 1)
    profile = M.load_machine(machine_file)
    priced = profile_machine(profile, grid.dims, (0,))
    differs = []
    for shape, causal in ATTENTION_CASES:
        ins = attention_inputs(grid, shape)
        lay = ins[0].layout
        old, new = planner_schedule(lay, causal, Machine()), planner_schedule(lay, causal, priced)
        with M.use_machine(M.CPU_MACHINE):
            assert cp.attention_schedule(*ins, causal=causal) == old, (shape, causal)
        monkeypatch.setenv(M.ENVIRONMENT, str(machine_file))
        assert cp.attention_schedule(*ins, causal=causal) == new, (shape, causal)
        monkeypatch.setenv(M.ENVIRONMENT, "cpu")
        assert cp.attention_schedule(*ins, causal=causal) == old, (shape, causal)
        for machine in (machine_file, profile):
            with M.use_machine(machine):
                assert cp.attention_schedule(*ins, causal=causal) == new, (shape, causal, machine)
        assert cp.attention_schedule(*ins, causal=causal) == old, (shape, causal)
        monkeypatch.delenv(M.ENVIRONMENT)
        differs += [(shape, causal, old, new)] if old != new else []
    assert differs, f"every case picks Machine()'s schedule on {ranks} ranks"
    grid.free()


# ------------------------------------------------------------------------------------------------ SUMMA "auto"
@pytest.fixture
def panels(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The panel width of every SUMMA plan hpctp.matmul runs."""
    seen: list[int] = []
    run = MATMUL.run_plan

    def spy(plan: Any, *args: Any) -> Any:
        seen.append(plan.panel)
        return run(plan, *args)

    monkeypatch.setattr(MATMUL, "run_plan", spy)
    return seen


def summa_inputs(grid: hpctp.ProcessGrid) -> tuple[hpctp.DistTensor, hpctp.DistTensor]:
    """A and B of :data:`MATMUL_SHAPE`, float32 on the CPU, split ``(0, 1)``."""
    m, k, n = MATMUL_SHAPE
    la, lb = Layout((m, k), grid.dims, (0, 1)), Layout((k, n), grid.dims, (0, 1))
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn((m, k), generator=gen, dtype=F32), torch.randn((k, n), generator=gen, dtype=F32)
    return (hpctp.DistTensor(a[la.local_slices(grid.coords)].clone(), grid, la),
            hpctp.DistTensor(b[lb.local_slices(grid.coords)].clone(), grid, lb))  # fmt: skip


def test_auto_panel_is_the_planners_choice_on_the_machine_file(machine_file: Path, panels: list[int],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    grid = hpctp.ProcessGrid.virtual((2, 2), rank=3)  # (CPU blocks: the virtual grid moves no data, the GEMMs run)
    a, b = summa_inputs(grid)
    profile = M.load_machine(machine_file)
    old = recommend_panel(*MATMUL_SHAPE, (2, 2), Machine(), itemsize=4)
    new = recommend_panel(*MATMUL_SHAPE, (2, 2), profile_machine(profile, (2, 2), (0, 1)), itemsize=4)
    assert old != new, (old, new)
    with M.use_machine("cpu"):
        hpctp.matmul(a, b, panel="auto")
    monkeypatch.setenv(M.ENVIRONMENT, str(machine_file))
    hpctp.matmul(a, b, panel="auto")
    monkeypatch.delenv(M.ENVIRONMENT)
    with M.use_machine(profile):
        hpctp.matmul(a, b, panel="auto")
    hpctp.matmul(a, b)  # the default panel is not priced
    assert panels == [old, new, new, 256]
    for bad in ("fast", "AUTO"):
        with pytest.raises(ValueError, match="panel must be a positive int, None or 'auto'"):
            hpctp.matmul(a, b, panel=bad)  # type: ignore[arg-type]
    grid.free()


# ------------------------------------------------------------------------------------------ a bad setting
def test_a_bad_machine_setting_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(M.ENVIRONMENT, "h100")
    fix = r"set it to the path of a machine file .*hpctp perf calibrate.* or to one of a100-hdr, cpu, h100-ndr"
    with pytest.raises(
        ValueError, match=rf"HPCTP_MACHINE='h100' is neither a machine file nor a machine's name; {fix}"
    ):
        M.default_machine()
    assert isinstance(environment_error(), ValueError) and "HPCTP_MACHINE='h100'" in str(environment_error())
    with pytest.raises(ValueError, match="HPCTP_MACHINE='h100'"):
        hpctp.ProcessGrid([0])  # checked when a grid is built (on every rank)
    bad = tmp_path / "typo.toml"
    bad.write_text(M.load_machine("a100-hdr").to_toml().replace("bandwidth =", "bandwith ="))
    monkeypatch.setenv(M.ENVIRONMENT, str(bad))
    with pytest.raises(
        ValueError, match=r"is not a valid machine file \(.*unknown key\(s\) bandwith.*\); fix the file"
    ):
        M.default_machine()
    monkeypatch.setenv(M.ENVIRONMENT, "  ")
    assert M.machine_setting() is None and environment_error() is None


# ---------------------------------------------------------------------------------------------- real grids
@pytest.mark.mpi
def test_auto_choices_on_the_machine_file_on_every_rank(grid1d: hpctp.ProcessGrid, world: Any, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The real grid, ``HPCTP_MACHINE`` a machine file on every rank: attention's "auto" is the planner's schedule
    for that profile on every rank, and runs it (the same output as that schedule named); a case exists where it is
    not Machine()'s choice at 2 and 4 ranks."""
    path = slow_links(M.load_machine("h100-ndr")).save(tmp_path / "slow.toml")
    monkeypatch.setenv(M.ENVIRONMENT, str(path))
    grid = hpctp.ProcessGrid(grid1d.dims)  # built (and the setting checked) with the machine file set
    priced = profile_machine(M.load_machine(path), grid.dims, (0,))
    differs = False
    for shape, causal in ATTENTION_CASES[:2]:
        ins = attention_inputs(grid, shape)
        lay = ins[0].layout
        new = planner_schedule(lay, causal, priced)
        chosen = cp.attention_schedule(*ins, causal=causal)
        assert_equal(grid, chosen, new, f"{shape} causal={causal}")
        every = hpctp.comm.allgather_ints(grid.comm, [("ring", "all_to_all").index(chosen)])
        assert_all(grid, bool((every == every[0]).all()), "one choice on every rank")
        out = cp.attention(*ins, causal=causal, schedule="auto")
        named = cp.attention(*ins, causal=causal, schedule=new)
        assert_all(grid, bool(torch.equal(out.local, named.local)), "auto runs the chosen schedule")
        differs |= new != planner_schedule(lay, causal, Machine())
    assert_all(grid, differs or grid.size == 1, f"no case differs from Machine()'s on {grid.dims}")
    grid.free()


@pytest.mark.mpi
def test_auto_panel_on_the_machine_file_on_every_rank(grid2d: hpctp.ProcessGrid, panels: list[int]) -> None:
    """The real grid, inside use_machine of the slow machine: ``panel="auto"`` runs the planner's panel for that
    profile on every rank, and the product is right."""
    profile = slow_links(M.load_machine("h100-ndr"))
    a, b = summa_inputs(grid2d)
    with M.use_machine(profile):
        c = hpctp.matmul(a, b, panel="auto")
    dims = (grid2d.dims[0], grid2d.dims[1])
    expected = recommend_panel(*MATMUL_SHAPE, dims, profile_machine(profile, dims, (0, 1)), itemsize=4)
    assert_equal(grid2d, panels, [expected], "the planner's panel")
    whole = a.gather(None) @ b.gather(None)
    assert_all(grid2d, bool(np.allclose(c.gather(None), whole, rtol=1e-4, atol=1e-3)), "the product")
