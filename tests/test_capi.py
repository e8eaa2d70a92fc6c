"""The C/Fortran entry point: libhpctp_c built with CMake, driven from C, Fortran and Python.

* Build tests (1-rank pass): configure + build with CMake (-Wall -Wextra -Werror), run the C
  example, the C error-path check and (when gfortran exists) the Fortran check under
  ``mpiexec``, and compare their numbers with numpy on the whole field.
* ``hpctp.cli.cbridge`` tests (every pass, ``-m mpi``): the Python side on 1..4 ranks, including
  errors seen by one rank only, which must come back on every rank.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import hpctp
from hpctp.cli import cbridge as capi
from hpctp.testing import assert_all, assert_allclose

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
NX, NY = 37, 23  # apps/c_example/main.c


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
    env.pop("HPCTP_PYTHON", None)  # the library must find the venv's python by itself
    return env


def _c_compiler() -> str | None:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


# ---------------------------------------------------------------------------------- CMake build
@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed (needed to build libhpctp_c)")
    if _c_compiler() is None:
        pytest.skip("no C compiler (cc/gcc/clang) found (needed to build libhpctp_c)")
    bdir = tmp_path_factory.mktemp("capi_build")
    t0 = time.perf_counter()
    cfg = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(bdir), f"-DPython3_EXECUTABLE={sys.executable}",
         "-DHPCTP_WERROR=ON", "-DCMAKE_BUILD_TYPE=RelWithDebInfo"],
        capture_output=True, text=True, timeout=300, env=_env(),
    )  # fmt: skip
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    bld = subprocess.run(
        ["cmake", "--build", str(bdir), "-j", "2"], capture_output=True, text=True, timeout=300, env=_env()
    )
    assert bld.returncode == 0, bld.stdout + bld.stderr  # -Werror: also -Wall -Wextra clean
    assert "warning" not in (bld.stdout + bld.stderr).lower(), bld.stdout + bld.stderr
    print(f"libhpctp_c configured and built in {time.perf_counter() - t0:.1f} s")
    return bdir


def _mpirun(n: int, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MPIEXEC, "-n", str(n), *args], capture_output=True, text=True, timeout=timeout, env=_env(), cwd=cwd
    )


def _field() -> np.ndarray:
    i, j = np.meshgrid(np.arange(NX), np.arange(NY), indexing="ij")
    return np.sin(0.1 * i) * np.cos(0.07 * j) + 0.001 * (i * j) - 0.5


def test_c_example_matches_numpy(build: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.npy"
    np.save(ckpt, np.array([3.0, -0.5]), allow_pickle=False)
    out = tmp_path / "out"
    out.mkdir()
    exe = build / "apps" / "c_example" / "c_example"
    proc = _mpirun(4, str(exe), str(out), "hpctp.cli.cbridge:demo_model", str(ckpt), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    f = _field()
    want = 3.0 * f - 0.5 * f.mean()
    got = np.full((NX, NY), np.nan)
    got32 = np.full((NX, NY), np.nan, dtype=np.float32)
    seen = np.zeros((NX, NY), dtype=int)
    blocks = []
    for r in range(4):
        raw = (out / f"rank{r}.bin").read_bytes()
        o0, o1, n0, n1, gx, gy = (int(v) for v in np.frombuffer(raw[:48], dtype=np.int64))
        assert (gx, gy) == (NX, NY)
        n = n0 * n1
        assert len(raw) == 48 + 12 * n
        sl = (slice(o0, o0 + n0), slice(o1, o1 + n1))
        got[sl] = np.frombuffer(raw[48 : 48 + 8 * n], dtype=np.float64).reshape(n0, n1)
        got32[sl] = np.frombuffer(raw[48 + 8 * n :], dtype=np.float32).reshape(n0, n1)
        seen[sl] += 1
        blocks.append((o0, o1, n0, n1))
    assert (seen == 1).all()  # the blocks tile the field exactly once
    # the example's own uneven decomposition on a 2x2 grid (triangular cuts), not hpctp's balanced one
    assert blocks == [(0, 0, 12, 7), (0, 7, 12, 16), (12, 0, 25, 7), (12, 7, 25, 16)]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got32, want, rtol=1e-5, atol=2e-6)
    m = re.search(r"checksum (\S+)", proc.stdout)
    assert m is not None, proc.stdout
    assert float(m.group(1)) == pytest.approx(want.sum(), rel=1e-12, abs=1e-10)


CX, CY = 40, 24  # apps/c_example/main.c: the multi-channel state (C_EXAMPLE_CHANNELS)


def _state(channels: int) -> np.ndarray:
    """The [C, CX, CY] state that c_example fills with C_EXAMPLE_CHANNELS=C."""
    c, i, j = np.meshgrid(np.arange(channels), np.arange(CX), np.arange(CY), indexing="ij")
    s = 0.5 + 0.5 * np.sin(0.2 * i + 0.7 * c) * np.cos(0.15 * j - 0.3 * c)
    return np.where(c == 0, 1.0 - 0.5 * s, 0.3 * s)


def test_c_example_runs_trained_surrogate(build: Path, tmp_path: Path) -> None:
    """Issue 6 end to end: train the tiny surrogate, run it from C on the simulation's own uneven
    blocks of a [2, H, W] state (mpiexec -n 4), compare with the Python model on the whole field."""
    t0 = time.perf_counter()
    run = tmp_path / "run"
    train = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-m", "apps.pipeline", "--config", "apps/configs/tiny.toml",
         "--set", f'simulation.out="{tmp_path / "sim.h5"}"', "--set", f'train.out="{run}"'],
        capture_output=True, text=True, timeout=180, env=_env(), cwd=ROOT,
    )  # fmt: skip
    assert train.returncode == 0, train.stdout + train.stderr
    ckpt = run / "checkpoint.h5"
    t1 = time.perf_counter()
    out = tmp_path / "out"
    out.mkdir()
    # the embedded interpreter does not put the working directory on sys.path: PYTHONPATH does
    env = {
        **_env(),
        "C_EXAMPLE_CHANNELS": "2",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    exe = build / "apps" / "c_example" / "c_example"
    proc = subprocess.run(
        [MPIEXEC, "-n", "4", str(exe), str(out), "apps.surrogate.inference:factory", str(ckpt)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    t2 = time.perf_counter()
    got = np.full((2, CX, CY), np.nan)
    got32 = np.full((2, CX, CY), np.nan, dtype=np.float32)
    blocks = []
    for r in range(4):
        raw = (out / f"rank{r}.bin").read_bytes()
        o0, o1, n0, n1, gx, gy = (int(v) for v in np.frombuffer(raw[:48], dtype=np.int64))
        assert (gx, gy) == (CX, CY)
        n = 2 * n0 * n1
        assert len(raw) == 48 + 12 * n
        sl = (slice(None), slice(o0, o0 + n0), slice(o1, o1 + n1))
        got[sl] = np.frombuffer(raw[48 : 48 + 8 * n], dtype=np.float64).reshape(2, n0, n1)
        got32[sl] = np.frombuffer(raw[48 + 8 * n :], dtype=np.float32).reshape(2, n0, n1)
        blocks.append((o0, o1, n0, n1))
    assert blocks == [(0, 0, 13, 8), (0, 8, 13, 16), (13, 0, 27, 8), (13, 8, 27, 16)]  # uneven, odd sizes

    if str(ROOT) not in sys.path:  # pytest run from elsewhere
        sys.path.insert(0, str(ROOT))
    from apps.surrogate.inference import Surrogate

    x = _state(2)
    grid = hpctp.ProcessGrid([1, 1], comm=MPI.COMM_SELF)
    try:
        y = Surrogate(grid, str(ckpt))(hpctp.distribute(x, grid, (None, 0, 1)))
        want = np.asarray(y.local, dtype=np.float64)
    finally:
        grid.free()
    assert want.shape == (2, CX, CY) and np.isfinite(want).all()
    assert np.abs(want - x).max() > 1e-6  # the trained model does change the state
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * scale)
    np.testing.assert_allclose(got32, want, rtol=1e-5, atol=1e-5 * scale)
    m = re.search(r"field 2x40x24, checksum (\S+)", proc.stdout)
    assert m is not None, proc.stdout
    assert float(m.group(1)) == pytest.approx(want.sum(), rel=1e-12)
    print(f"surrogate: trained in {t1 - t0:.1f} s, C example (4 ranks) in {t2 - t1:.1f} s")


def _grayscott_c_online() -> tuple[np.ndarray, int]:
    """apps/c_example/online.c's simulation in numpy: the final [2, 24, 20] state and the snapshot count."""
    h, w, steps, warmup, every = 24, 20, 300, 60, 20
    u, v = np.ones((h, w)), np.zeros((h, w))
    i, j = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    for ci, cj in [(h // 4, w // 3), (h // 2 + 2, 3 * w // 4), (3 * h // 4 + 1, w // 5)]:
        near = (np.minimum(abs(i - ci), h - abs(i - ci)) <= 2) & (np.minimum(abs(j - cj), w - abs(j - cj)) <= 2)
        u[near], v[near] = 0.5, 0.25
    lap = lambda a: np.roll(a, 1, 0) + np.roll(a, -1, 0) + np.roll(a, 1, 1) + np.roll(a, -1, 1) - 4.0 * a  # noqa: E731
    for _ in range(steps):
        uvv = u * v * v
        u, v = u + (0.16 * lap(u) + (0.035 * (1.0 - u) - uvv)), v + (0.08 * lap(v) + (uvv - 0.1 * v))
    return np.stack([u, v]), (steps - warmup) // every + 1


def test_c_example_trains_online_and_predicts(build: Path, tmp_path: Path) -> None:
    """Issue 36: Gray-Scott in C on its own uneven blocks (mpiexec -n 4) feeds the FNO through
    hpctp_stream_init/hpctp_put (co-located, no file), hpctp_stream_finalize writes the checkpoint,
    and hpctp_infer runs it on the C state: equal to the Python model on the whole field."""
    run = tmp_path / "run"
    cfg = (ROOT / "apps" / "c_example" / "online.toml").read_text()
    config = tmp_path / "online.toml"
    config.write_text(cfg.replace('out = "out/c_online/run"', f'out = "{run}"'))
    out = tmp_path / "out"
    out.mkdir()
    env = {**_env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    exe = build / "apps" / "c_example" / "c_online"
    proc = subprocess.run(
        [MPIEXEC, "-n", "4", str(exe), str(config), str(out), str(run / "checkpoint.h5")],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "c_online: 4 ranks, grid 2x2, field 2x24x20, snapshots 13" in proc.stdout, proc.stdout
    # the trainer saw every snapshot, trained its budget (4 epochs x 5 batches of the 9 training pairs)
    assert "13 snapshots produced, 0 dropped (thinned), 13 received; 9 training pairs" in proc.stderr, proc.stderr
    assert len((run / "history.csv").read_text().split()) == 20 and (run / "config.json").is_file()
    assert not list(tmp_path.glob("**/*sim*.h5"))  # no snapshot file
    state, want_snapshots = _grayscott_c_online()
    assert want_snapshots == 13
    got_state = np.full((2, 24, 20), np.nan)
    got = np.full((2, 24, 20), np.nan)
    blocks = []
    for r in range(4):
        raw = (out / f"rank{r}.bin").read_bytes()
        o0, o1, n0, n1, gx, gy = (int(v) for v in np.frombuffer(raw[:48], dtype=np.int64))
        n = 2 * n0 * n1
        assert (gx, gy) == (24, 20) and len(raw) == 48 + 16 * n
        sl = (slice(None), slice(o0, o0 + n0), slice(o1, o1 + n1))
        got_state[sl] = np.frombuffer(raw[48 : 48 + 8 * n]).reshape(2, n0, n1)
        got[sl] = np.frombuffer(raw[48 + 8 * n :]).reshape(2, n0, n1)
        blocks.append((o0, o1, n0, n1))
    assert blocks == [(0, 0, 8, 6), (0, 6, 8, 14), (8, 0, 16, 6), (8, 6, 16, 14)]  # uneven: the C code's own
    np.testing.assert_allclose(got_state, state, rtol=1e-12, atol=1e-14)  # the C simulation is Gray-Scott
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from apps.surrogate.inference import Surrogate

    grid = hpctp.ProcessGrid([1, 1], comm=MPI.COMM_SELF)
    try:
        want = np.asarray(
            Surrogate(grid, str(run / "checkpoint.h5"))(hpctp.distribute(got_state, grid, (None, 0, 1))).local
        )
    finally:
        grid.free()
    assert np.isfinite(want).all() and np.abs(want - got_state).max() > 1e-6  # trained: not persistence
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


# step -> (return code, text in every rank's message); see capi/tests/check_errors.c (3 ranks)
_EXPECTED = {
    "infer_before_init": (2, "not initialised"),
    "init_bad_dims": (1, "grid dims (4, 1) hold 4 ranks but the communicator has 3"),
    "init_bad_ndim": (3, "ndim=0 must be in 1..32"),
    "init": (0, ""),
    "init_twice": (2, "already initialised"),
    "grid": (0, ""),
    "infer_no_model": (1, "no model loaded"),
    "load_no_module": (1, "No module named 'hpctp_no_such_module'"),
    "load_bad_spec": (1, "model='hpctp.cli.cbridge' must be 'package.module:factory'"),
    "load_no_attr": (1, "has no attribute 'no_such_factory'"),
    "load_missing_checkpoint": (1, "No such file or directory: '/nonexistent/ckpt.npy'"),
    "load": (0, ""),
    "infer_bad_offsets": (
        1,
        "rank 2 (grid coords (2,)): global_offsets=(34,) but the block sizes place this block at (33,)",
    ),
    "infer_null_shape": (1, "local_shape is NULL"),
    "infer_bad_global_shape": (1, "global_shape=(51,)"),
    "infer_bad_split": (1, "split[0]=3 is not a grid axis"),
    "infer_bad_ndim": (1, "ndim=0 must be in 1..32"),
    "infer": (0, ""),
    "finalize": (0, ""),
    "finalize_again": (0, ""),
    "init_after_finalize": (2, "cannot be initialised again"),
    "load_after_finalize": (2, "not initialised"),
}
# errors seen by one rank only: the others report that rank
_SEEN_BY = {"init_bad_ndim": 2, "load_bad_spec": 0, "infer_bad_offsets": 2, "infer_null_shape": 0, "infer_bad_ndim": 0}


def test_c_error_paths_agree_on_every_rank(build: Path, tmp_path: Path) -> None:
    proc = _mpirun(3, str(build / "hpctp_c_errors"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps: dict[tuple[str, int], tuple[int, str]] = {}
    for m in re.finditer(r"^step=(\S+) rank=(\d+) rc=(-?\d+) msg=(.*)$", proc.stdout, re.M):
        steps[(m.group(1), int(m.group(2)))] = (int(m.group(3)), m.group(4))
    for name, (rc, text) in _EXPECTED.items():
        for r in range(3):
            assert (name, r) in steps, f"step {name} missing on rank {r}:\n{proc.stdout}\n{proc.stderr}"
            got_rc, msg = steps[(name, r)]
            assert got_rc == rc, (name, r, got_rc, msg)
            assert text in msg, (name, r, msg)
            if name in _SEEN_BY:
                assert ("(reported by rank" in msg) == (r != _SEEN_BY[name]), (name, r, msg)
    assert len(steps) == 3 * len(_EXPECTED)
    grids = re.findall(r"^grid rank=(\d+) ndim=(\d+) dims=(\d+) coords=(\d+)$", proc.stdout, re.M)
    assert sorted((int(r), int(nd), int(d), int(c)) for r, nd, d, c in grids) == [(r, 1, 3, r) for r in range(3)]
    values = re.findall(r"^value rank=(\d+) maxerr=(\S+) n=(\d+)$", proc.stdout, re.M)
    assert sorted(int(r) for r, _, _ in values) == [0, 1, 2]
    assert sum(int(n) for _, _, n in values) == 50
    assert max(float(e) for _, e, _ in values) <= 1e-12


def test_fortran_module(build: Path, tmp_path: Path) -> None:
    exe = build / "hpctp_f_check"
    if not exe.exists():
        pytest.skip("no Fortran compiler: the optional Fortran module was not built")
    proc = _mpirun(4, str(exe), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = re.findall(
        r"^fortran coords=(\d+),(\d+) init=(\d+) maxerr=\s*(\S+) maxerrf=\s*(\S+) bad=(\d+) before=(\d+) "
        r"before_msg=(.*) bad_msg=(.*)$",
        proc.stdout,
        re.M,
    )
    assert sorted((int(a), int(b)) for a, b, *_ in lines) == [(0, 0), (0, 1), (1, 0), (1, 1)], proc.stdout
    for _, _, init, err, errf, bad, before, before_msg, bad_msg in lines:
        assert int(init) == 0
        assert 0 <= float(err) <= 1e-12  # the Fortran-order field went through hpctp unchanged in meaning
        assert 0 <= float(errf) <= 2e-6
        assert int(before) == 2 and "not initialised" in before_msg
        assert int(bad) == 1 and "do not tile" in bad_msg
    streams = re.findall(
        r"^fortran stream put=(\d+) init=(\d+) final=(\d+) put_msg=(.*) init_msg=(.*)$", proc.stdout, re.M
    )
    assert len(streams) == 4, proc.stdout
    for put, init, final, put_msg, init_msg in streams:  # the online-training bindings reach Python
        assert (int(put), int(init), int(final)) == (1, 1, 0), (put, init, final)
        assert "no stream: call hpctp_stream_init" in put_msg and "No such file" in init_msg, (put_msg, init_msg)


@pytest.mark.skipif(not sysconfig.get_config_var("Py_ENABLE_SHARED"), reason="needs a shared libpython")
def test_c_api_inside_a_running_python(build: Path) -> None:
    """The library called through ctypes from this (already running) Python: no second interpreter."""
    lib = ctypes.CDLL(str(build / "libhpctp_c.so"))
    lib.hpctp_last_error.restype = ctypes.c_char_p
    i64p = ctypes.POINTER(ctypes.c_int64)
    lib.hpctp_init_f.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.hpctp_load.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.hpctp_infer.argtypes = [ctypes.POINTER(ctypes.c_double), ctypes.c_int, i64p, i64p, i64p, ctypes.c_void_p]
    assert lib.hpctp_init_f(MPI.COMM_WORLD.py2f(), None, 2) == 0, lib.hpctp_last_error()
    try:
        assert lib.hpctp_load(b"hpctp.cli.cbridge:no_such_factory", None) == 1
        assert b"no attribute 'no_such_factory'" in lib.hpctp_last_error()
        assert lib.hpctp_load(b"hpctp.cli.cbridge:demo_model", None) == 0, lib.hpctp_last_error()
        x = np.arange(12.0).reshape(3, 4)
        shape = (ctypes.c_int64 * 2)(3, 4)
        zero = (ctypes.c_int64 * 2)(0, 0)
        ptr = x.ctypes.data_as(ctypes.POINTER(ctypes.c_double))
        assert lib.hpctp_infer(ptr, 2, shape, zero, shape, None) == 0, lib.hpctp_last_error()
        np.testing.assert_allclose(x, 2 * np.arange(12.0).reshape(3, 4) + 5.5, rtol=1e-15)
        bad = (ctypes.c_int64 * 2)(0, 1)
        assert lib.hpctp_infer(ptr, 2, shape, bad, shape, None) == 1
        assert b"global_offsets=(0, 1)" in lib.hpctp_last_error()
    finally:
        assert lib.hpctp_finalize() == 0, lib.hpctp_last_error()
    assert capi._state is None  # the Python side was released; this interpreter keeps running


# ---------------------------------------------------------------------------------- hpctp.cli.cbridge
@pytest.fixture
def session(grid2d: hpctp.ProcessGrid, world: MPI.Intracomm):  # type: ignore[no-untyped-def]
    """hpctp.cli.cbridge initialised on the world with the dims of ``grid2d``; finalised afterwards."""
    grid = capi.init(world.py2f(), grid2d.dims)  # the Fortran handle, as the C layer passes it
    yield grid
    capi.finalize()


def _cut(n: int, p: int, c: int) -> int:
    return n * c * (c + 1) // (p * (p + 1))


def _my_block(grid: hpctp.ProcessGrid, shape: tuple[int, ...], split: tuple[int | None, ...]):  # type: ignore[no-untyped-def]
    """This rank's (offsets, slices) in an uneven decomposition of its own (triangular cuts)."""
    offs, sls = [], []
    for n, s in zip(shape, split, strict=True):
        if s is None:
            lo, hi = 0, n
        else:
            p, c = grid.dims[s], grid.coords[s]
            lo, hi = _cut(n, p, c), _cut(n, p, c + 1)
        offs.append(lo)
        sls.append(slice(lo, hi))
    return tuple(offs), tuple(sls)


def _global(shape: tuple[int, ...]) -> np.ndarray:
    return np.cos(0.3 * np.arange(int(np.prod(shape)))).reshape(shape) + 0.25


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    ("shape", "split"), [((13, 9), (0, 1)), ((13, 9), (1, 0)), ((11, 6, 4), (0, None, 1)), ((10, 7), (None, 1))]
)
def test_infer_in_place_matches_numpy(session, shape, split, dtype) -> None:  # type: ignore[no-untyped-def]
    grid = session
    capi.load("hpctp.cli.cbridge:demo_model")
    full = _global(shape)
    offs, sls = _my_block(grid, shape, split)
    block = np.array(full[sls], dtype=dtype)  # a copy: full stays the input
    addr = block.ctypes.data
    capi.infer(block, offs, shape, [-1 if s is None else s for s in split])
    assert block.ctypes.data == addr  # same memory, written in place
    want = (2 * full + full.mean())[sls]
    tol = 1e-12 if dtype == "float64" else 2e-6
    assert_allclose(grid, block, want, rtol=tol, atol=tol)


@pytest.mark.mpi
def test_default_split_and_checkpoint(session) -> None:  # type: ignore[no-untyped-def]
    grid = session
    with tempfile.TemporaryDirectory() as d:  # not tmp_path: ranks would race on pytest's cleanup
        ckpt = Path(d) / "ckpt.npy"  # each rank writes its own; rank 0 reads its own
        np.save(ckpt, np.array([-1.5, 4.0]), allow_pickle=False)
        capi.load("hpctp.cli.cbridge:demo_model", str(ckpt))
    shape = (9, 5, 3)  # split=None: dims 0, 1 over grid axes 0, 1; dim 2 whole
    full = _global(shape)
    offs, sls = _my_block(grid, shape, (0, 1, None))
    block = full[sls].copy()
    capi.infer(block, offs, shape)
    assert_allclose(grid, block, (-1.5 * full + 4.0 * full.mean())[sls], rtol=1e-12, atol=1e-12)
    assert capi.grid_info() == (grid.dims, grid.coords)


@pytest.mark.mpi
def test_errors_seen_by_one_rank_raise_everywhere(session, world: MPI.Intracomm) -> None:  # type: ignore[no-untyped-def]
    grid = session
    last = world.Get_size() - 1
    shape = (8, 6)
    full = _global(shape)
    offs, sls = _my_block(grid, shape, (0, 1))
    block = full[sls].copy()
    with pytest.raises(RuntimeError, match="no model loaded"):
        capi.infer(block, offs, shape, (0, 1))
    with pytest.raises(RuntimeError, match="No module named 'hpctp_nope'"):
        capi.load("hpctp_nope:factory")
    with pytest.raises(FileNotFoundError, match="No such file"):  # only rank 0 reads it
        capi.load("hpctp.cli.cbridge:demo_model", "/nonexistent/ckpt.npy")
    capi.load("hpctp.cli.cbridge:demo_model")
    wrong = (offs[0] + (1 if world.Get_rank() == last else 0), offs[1])
    with pytest.raises(ValueError, match=rf"rank {last} .*global_offsets="):
        capi.infer(block, wrong, shape, (0, 1))
    with pytest.raises(TypeError, match="float64 or float32"):
        capi.infer(block.astype(np.int64) if world.Get_rank() == 0 else block, offs, shape, (0, 1))
    frozen = block.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="C-contiguous and writeable"):
        capi.infer(frozen if world.Get_rank() == last else block, offs, shape, (0, 1))
    with pytest.raises(TypeError, match=r"global_offsets\[0\] must be an int, got float"):  # not truncated
        capi.infer(block, (offs[0] + 0.5, offs[1]) if world.Get_rank() == last else offs, shape, (0, 1))
    with pytest.raises(TypeError, match="split.* must be an int"):
        capi.infer(block, offs, shape, (0, 1.0))
    if world.Get_size() > 1:
        with pytest.raises(ValueError, match="differ between ranks"):
            capi.infer(block, offs, shape, (0, 1) if world.Get_rank() != last else (0, -1))
    assert_allclose(grid, block, full[sls], rtol=0, atol=0)  # failed calls left the data alone
    capi.infer(block, offs, shape, (0, 1))
    assert_allclose(grid, block, (2 * full + full.mean())[sls], rtol=1e-12, atol=1e-12)


class _Fails:
    """A model raising on rank 0 only, before any communication."""

    def __call__(self, x: hpctp.DistTensor) -> hpctp.DistTensor:
        if x.grid.rank == 0:
            raise ValueError("model failed on rank 0")
        return x


def fails_on_rank0(grid: hpctp.ProcessGrid, checkpoint: str | None) -> _Fails:
    return _Fails()


def changes_layout(grid: hpctp.ProcessGrid, checkpoint: str | None):  # type: ignore[no-untyped-def]
    return lambda x: x.sum(axis=1)


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("factory", "exc", "text"),
    [("fails_on_rank0", ValueError, "model failed on rank 0"), ("changes_layout", ValueError, "changed the layout")],
)
def test_model_errors_raise_everywhere(session, factory, exc, text) -> None:  # type: ignore[no-untyped-def]
    grid = session
    capi.load(f"{__name__}:{factory}")
    shape = (7, 5)
    full = _global(shape)
    offs, sls = _my_block(grid, shape, (0, 1))
    block = full[sls].copy()
    with pytest.raises(exc, match=text):
        capi.infer(block, offs, shape, (0, 1))
    assert_allclose(grid, block, full[sls], rtol=0, atol=0)


class _Keeps:
    """A model that keeps its input: after hpctp_infer returns, a view of freed memory."""

    def __call__(self, x: hpctp.DistTensor) -> hpctp.DistTensor:
        self.last = x
        return x * 2.0


def keeps_input(grid: hpctp.ProcessGrid, checkpoint: str | None) -> _Keeps:
    return _Keeps()


def _c_call(grid: hpctp.ProcessGrid, factory: str) -> tuple[memoryview, int, bytearray, np.ndarray]:
    """Arguments as the C layer passes them: a memoryview of the caller's memory."""
    capi.load(f"{__name__}:{factory}")
    shape = (7, 5)
    offs, sls = _my_block(grid, shape, (0, 1))
    local = _global(shape)[sls].copy()
    memory = bytearray(local.tobytes())
    return memoryview(memory), offs, memory, local  # type: ignore[return-value]


@pytest.mark.mpi
@pytest.mark.parametrize("factory", ["fails_on_rank0", "changes_layout"])
def test_failed_model_leaves_no_view_of_the_caller_memory(session, factory) -> None:  # type: ignore[no-untyped-def]
    """After a model error no frame of the traceback may keep a numpy view of the caller's memory
    until the next garbage collection (the frames refer to the exception: a cycle)."""
    grid = session
    view, offs, memory, local = _c_call(grid, factory)
    refs = sys.getrefcount(view)
    gc.disable()  # the views must go without the collector's help
    try:
        with pytest.raises(ValueError):
            capi._infer_c(view, "float64", local.shape, offs, (7, 5), (0, 1), None)
        left = sys.getrefcount(view) - refs
    finally:
        gc.enable()
    assert_all(grid, left == 0, f"{left} reference(s) to the caller's memory outlived the failed call")
    assert_allclose(grid, np.frombuffer(memory).reshape(local.shape), local, rtol=0, atol=0)


@pytest.mark.mpi
def test_model_that_keeps_its_input_raises_everywhere(session) -> None:  # type: ignore[no-untyped-def]
    """numpy views hold no buffer export, so the C layer's release cannot catch a model that keeps
    its input; the reference count does, and every rank raises (the output is written)."""
    grid = session
    view, offs, memory, local = _c_call(grid, "keeps_input")
    with pytest.raises(RuntimeError, match=r"kept a view of its input block after hpctp_infer"):
        capi._infer_c(view, "float64", local.shape, offs, (7, 5), (0, 1), None)
    assert_allclose(grid, np.frombuffer(memory).reshape(local.shape), 2 * local, rtol=0, atol=0)
    view, offs, memory, local = _c_call(grid, "doubles")
    capi._infer_c(view, "float64", local.shape, offs, (7, 5), (0, 1), None)  # a model that keeps nothing
    assert_allclose(grid, np.frombuffer(memory).reshape(local.shape), 2 * local, rtol=0, atol=0)


def doubles(grid: hpctp.ProcessGrid, checkpoint: str | None):  # type: ignore[no-untyped-def]
    return lambda x: x * 2.0


class _Records:
    """A trainer that keeps a copy of every snapshot (the contract: copy what you keep)."""

    def __init__(self, keep_views: bool) -> None:
        self.keep_views, self.seen, self.finalized = keep_views, [], 0

    def put(self, x: hpctp.DistTensor) -> None:
        self.seen.append(x.local if self.keep_views else np.array(x.local))

    def finalize(self) -> None:
        self.finalized += 1


_TRAINERS: list[_Records] = []


def records(grid: hpctp.ProcessGrid, cfg: dict) -> _Records:  # type: ignore[type-arg]
    _TRAINERS.append(_Records(bool(cfg.get("keep_views", False))))
    return _TRAINERS[-1]


@pytest.mark.mpi
def test_stream_puts_and_errors_raise_everywhere(session, world: MPI.Intracomm) -> None:  # type: ignore[no-untyped-def]
    grid = session
    last = world.Get_size() - 1
    shape = (2, 8, 6)
    full = _global(shape)
    offs, sls = _my_block(grid, shape, (None, 0, 1))
    block = full[sls].copy()
    with pytest.raises(RuntimeError, match="no stream: call hpctp_stream_init"):
        capi.put(block, offs, shape, (-1, 0, 1))
    with tempfile.TemporaryDirectory() as d:  # (each rank its own: the same contents)
        with pytest.raises(FileNotFoundError):
            capi.stream_init(f"{d}/missing.toml")
        (Path(d) / "none.toml").write_text("[online]\n")
        with pytest.raises(ValueError, match="no top-level trainer"):
            capi.stream_init(f"{d}/none.toml")
        (Path(d) / "t.toml").write_text(f'trainer = "{__name__}:records"\n')
        capi.stream_init(f"{d}/t.toml")
    trainer = _TRAINERS[-1]
    capi.put(block, offs, shape, (-1, 0, 1))
    block *= 2.0  # the caller changes its field: the trainer kept its own copy
    capi.put(block, offs, shape, (-1, 0, 1))
    wrong = block[:, :, :-1].copy() if world.Get_rank() == last else block
    with pytest.raises(ValueError, match="the first hpctp_put passed"):
        capi.put(wrong, offs, shape, (-1, 0, 1))
    assert_allclose(grid, np.stack(trainer.seen), np.stack([full[sls], 2 * full[sls]]), rtol=0, atol=0)
    capi.stream_finalize()
    capi.stream_finalize()  # (no stream: a no-op)
    assert_all(grid, trainer.finalized == 1, "finalized once")
    with tempfile.TemporaryDirectory() as d:  # a trainer that keeps views of the caller's memory
        (Path(d) / "k.toml").write_text(f'trainer = "{__name__}:records"\nkeep_views = true\n')
        capi.stream_init(f"{d}/k.toml")
    memory = bytearray(block.tobytes())
    with pytest.raises(RuntimeError, match="kept a view of its input block after hpctp_infer or hpctp_put"):
        capi._put_c(memoryview(memory), "float64", block.shape, offs, shape, (-1, 0, 1), None)
    _TRAINERS[-1].seen.clear()
    # hpctp_finalize (the session fixture) finishes the stream left open


@pytest.mark.mpi
def test_init_and_finalize_states(world: MPI.Intracomm) -> None:
    with pytest.raises(RuntimeError, match="not initialised"):
        capi.grid_info()
    with pytest.raises(ValueError, match="hold"):
        capi.init(world, (world.Get_size() + 1, 1))
    with pytest.raises(ValueError, match=r"dims\[1\]=1.0 must be a non-negative int"):
        capi.init(world, (world.Get_size(), 1.0))
    if world.Get_size() > 1:  # bad dims on the last rank only: every rank raises, none waits in Dup
        with pytest.raises(ValueError, match="hold|reported by rank"):
            capi.init(world, (world.Get_size() + 1, 1) if world.Get_rank() == world.Get_size() - 1 else 2)
    grid = capi.init(world, 2)
    try:
        assert_all(grid, grid.comm != world and grid.size == world.Get_size(), "the grid works on a duplicate")
        with pytest.raises(RuntimeError, match="called twice"):
            capi.init(world, 2)
    finally:
        capi.finalize()
    capi.finalize()  # a no-op
    assert capi._state is None
