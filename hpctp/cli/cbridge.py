"""The Python side of the C/Fortran API (``libhpctp_c``, header ``capi/hpctp.h``).

A simulation code written in C, C++ or Fortran links ``libhpctp_c``, which embeds Python
and calls the functions here:

=========================  ======================================================
C                          Python
=========================  ======================================================
``hpctp_init``             :func:`init` (builds the :class:`~hpctp.ProcessGrid`)
``hpctp_load``             :func:`load` (``"package.module:factory"`` + checkpoint)
``hpctp_infer[_f]``        :func:`infer` on the caller's memory, in place
``hpctp_grid``             :func:`grid_info`
``hpctp_stream_init``      :func:`stream_init` (online training: a trainer from a TOML file)
``hpctp_put[_f]``          :func:`put`: the next snapshot's blocks to the trainer (copied)
``hpctp_stream_finalize``  :func:`stream_finalize` (the trainer finishes: its checkpoint)
``hpctp_finalize``         :func:`finalize`
=========================  ======================================================

They work from Python as well (that is how the multi-rank tests drive them). The state (one
grid, one model) belongs to the process: :func:`init` creates it, :func:`finalize` frees it.

Model contract (what ``hpctp_load`` expects): ``factory(grid, checkpoint)`` is called on
every rank of the grid, with ``checkpoint`` a path or ``None``, and returns an object with
``__call__(x: DistTensor) -> DistTensor`` whose result has the input's layout. The factory and the
model are collective: they must raise on every rank, or on none (use
:func:`hpctp.comm.raise_if_any`), because a rank that raises while the others communicate
leaves them waiting. The model must not keep references to its input after the call: the
input is the simulation's own memory.

Trainer contract (what ``hpctp_stream_init`` expects): the TOML file names ``trainer =
"package.module:factory"`` at its top level; ``factory(grid, config)`` (``config``: the whole file as a
dict) is called on every rank and returns a :class:`Trainer`: ``put(x: DistTensor)`` takes each snapshot
(collective; it must copy what it keeps), ``finalize()`` ends the stream and finishes the training. The
apps' online trainer is ``apps.surrogate.online:capi_trainer`` (co-located: the simulation's ranks train
between its steps, on its own blocks).

Every error that only some ranks can see (a bad pointer, wrong offsets, a missing file, an
exception in the model) is agreed on collectively, so every rank returns the same error and
none is left waiting.
"""

from __future__ import annotations

import importlib
import math
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from .. import comm as C
from .._util.backend import to_numpy
from .._util.ints import as_int, is_int
from ..comm import ProcessGrid
from ..tensor.core import DistTensor
from ..tensor.creation import from_local

__all__ = [
    "DemoModel",
    "Model",
    "Trainer",
    "demo_model",
    "finalize",
    "grid_info",
    "infer",
    "init",
    "load",
    "put",
    "stream_finalize",
    "stream_init",
]

_MAX_NDIM = 32
_DTYPES = ("float64", "float32")


class Model(Protocol):
    """Local. What ``hpctp_load``'s factory returns: a callable mapping a DistTensor to one of the same layout."""

    def __call__(self, x: DistTensor) -> DistTensor: ...


class Trainer(Protocol):
    """Local. What ``hpctp_stream_init``'s factory returns: takes snapshots, then finishes."""

    def put(self, x: DistTensor) -> object: ...

    def finalize(self) -> object: ...


@dataclass
class _State:
    grid: ProcessGrid
    model: Model | None = None
    model_name: str = ""
    trainer: Trainer | None = None
    put_layout: Any = None  # the layout of the first put's blocks: later puts are checked against it


_state: _State | None = None


def _require_state() -> _State:
    if _state is None:
        raise RuntimeError("hpctp is not initialised on this process: call hpctp_init (hpctp.capi.init) first")
    return _state


def init(comm: MPI.Intracomm | int, dims: int | Sequence[int] = 2) -> ProcessGrid:
    """Collective over grid. Build the process grid (on the ranks of ``comm``) used by :func:`infer`.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm or int
        The simulation's communicator, or its Fortran handle (``MPI_Comm_c2f`` in C): it
        is duplicated, never freed, and MPI stays owned by the caller.
    dims : int or sequence of int
        Grid shape; entries of 0 (or a plain int ``n``: an ``n``-D grid) are chosen by MPI.
        Grid ranks equal the ranks in ``comm`` and their coordinates are row-major; the
        blocks passed to :func:`infer` must follow this order (see :func:`grid_info`).

    Returns
    -------
    ProcessGrid

    Raises
    ------
    RuntimeError
        If already initialised (call :func:`finalize` first).
    TypeError
        If ``comm`` is not an intracommunicator.
    ValueError
        If ``dims`` does not fit the communicator size. Every error is raised on every rank.
    """
    global _state
    if _state is not None:
        raise RuntimeError("hpctp_init was called twice; call hpctp_finalize first")
    c: object = comm
    if is_int(comm):
        c = MPI.Intracomm.f2py(int(comm))
    if not isinstance(c, MPI.Intracomm) or c == MPI.COMM_NULL:
        raise TypeError(f"comm must be a valid intracommunicator, got {comm!r}")
    if c.Is_inter():
        raise TypeError("comm is an intercommunicator; hpctp needs an intracommunicator")
    grid = ProcessGrid(dims, c)  # validated collectively: bad dims on one rank raise on every rank
    _state = _State(grid)
    return grid


def grid_info() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local. The grid's dims and this rank's coordinates (row-major in the grid rank).

    Returns
    -------
    tuple
        ``(dims, coords)``.

    Raises
    ------
    RuntimeError
        If :func:`init` has not been called.
    """
    grid = _require_state().grid
    return grid.dims, grid.coords


def load(model: str, checkpoint: str | None = None) -> None:
    """Collective over grid. Make the model that :func:`infer` applies.

    Parameters
    ----------
    model : str
        ``"package.module:factory"``; ``factory(grid, checkpoint)`` returns a :class:`Model`.
        The built-in ``"hpctp.capi:demo_model"`` is a deterministic test model.
    checkpoint : str or None
        Path handed to the factory (``None`` or ``""``: none).

    Raises
    ------
    RuntimeError
        If :func:`init` has not been called (local).
    ValueError
        If ``model`` is not of the form ``"module:factory"``.
    Exception
        Whatever the import or the factory raised on the lowest failing rank, raised on
        every rank (as its type when it is a ValueError, TypeError, ... else RuntimeError).
    """
    state = _require_state()
    grid = state.grid
    state.model = None  # a failing load leaves no model behind
    error: Exception | None = None
    factory = _import_factory(grid, model, "model")
    obj: Any = None
    try:
        obj = factory(grid, checkpoint or None)
        if not callable(obj):
            raise TypeError(f"model factory {model!r} returned a {type(obj).__name__}, which is not callable")
    except Exception as e:
        error = e
    C.raise_if_any(grid.comm, error)
    state.model = obj
    state.model_name = str(model)


def _import_factory(grid: ProcessGrid, spec: object, what: str) -> Any:
    """Collective over grid. The callable ``"package.module:factory"`` names; an import problem on
    any rank is raised on every rank (as its type when it is a ValueError or TypeError, else
    RuntimeError)."""
    error: Exception | None = None
    factory: Any = None
    try:
        mod_name, sep, attr = str(spec).partition(":")
        if not sep or not mod_name or not attr:
            raise ValueError(f"{what}={spec!r} must be 'package.module:factory'")
        factory = importlib.import_module(mod_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
        if not callable(factory):
            raise TypeError(f"{what}={spec!r}: {attr} is a {type(factory).__name__}, not a callable")
    except Exception as e:  # any import problem, on any rank, becomes a collective error
        error = e if isinstance(e, (ValueError, TypeError)) else RuntimeError(f"{type(e).__name__}: {e}")
    C.raise_if_any(grid.comm, error)
    return factory


def infer(
    block: np.ndarray,
    global_offsets: Sequence[int],
    global_shape: Sequence[int],
    split: Sequence[int | None] | None = None,
) -> None:
    """Collective over grid. Apply the loaded model to the blocks held by the ranks, in place.

    Parameters
    ----------
    block : numpy.ndarray
        This rank's block of the global field: writeable, C-contiguous, float32 or float64.
        It is wrapped without copying and overwritten with the model's output.
    global_offsets : sequence of int
        Global index of the block's first element per dimension. Must equal the offsets
        implied by the block sizes in grid order (checked).
    global_shape : sequence of int
        Shape of the global field (same on every rank).
    split : sequence of (int or None), optional
        Grid axis dividing each dimension (``None`` or ``-1``: not divided). Default:
        dimension ``d`` over grid axis ``d`` for ``d < grid.ndim``, the rest not divided.

    Raises
    ------
    RuntimeError
        If :func:`init` has not been called (local), or no model is loaded.
    ValueError, TypeError
        On inconsistent arguments, on any rank; raised on every rank, with ``block`` unchanged.
    Exception
        What the model raised (on every rank; the block is unchanged unless the model wrote
        to its input).
    """
    _infer(block, global_offsets, global_shape, split, None)


def _infer_c(
    buffer: memoryview | None,
    dtype: str,
    local_shape: Sequence[int],
    global_offsets: Sequence[int],
    global_shape: Sequence[int],
    split: Sequence[int] | None,
    error: str | None,
) -> None:
    """Collective over grid. The entry point of ``hpctp_infer``: wrap the caller's memory, then
    :func:`infer`.

    ``error`` is a problem the C layer found on this rank (e.g. a NULL pointer); it is
    agreed on collectively like every other error. No view of ``buffer`` may outlive the call:
    the caller frees or reuses its memory afterwards. numpy's views share the memoryview's
    buffer without an export of it (the C layer's ``release`` cannot see them), but every view
    of the wrapped array keeps that array alive: a weak reference to it tells whether the model
    kept a view of its input, and then every rank raises.
    """
    _block_c(_infer, buffer, dtype, local_shape, global_offsets, global_shape, split, error)


def _put_c(
    buffer: memoryview | None,
    dtype: str,
    local_shape: Sequence[int],
    global_offsets: Sequence[int],
    global_shape: Sequence[int],
    split: Sequence[int] | None,
    error: str | None,
) -> None:
    """Collective over grid. The entry point of ``hpctp_put``: wrap the caller's (read-only) memory,
    then :func:`put`; as :func:`_infer_c`, no view of it may outlive the call."""
    _block_c(_put, buffer, dtype, local_shape, global_offsets, global_shape, split, error)


def _block_c(
    call: Any,
    buffer: memoryview | None,
    dtype: str,
    local_shape: Sequence[int],
    global_offsets: Sequence[int],
    global_shape: Sequence[int],
    split: Sequence[int] | None,
    error: str | None,
) -> None:
    wrapped: weakref.ref[np.ndarray] | None = None
    block: np.ndarray | None = None
    err: Exception | None = ValueError(error) if error else None
    if err is None:
        try:
            if dtype not in _DTYPES:
                raise TypeError(f"unsupported dtype {dtype!r}")
            shape = tuple(_ints(local_shape, "local_shape"))
            if buffer is None:
                raise ValueError("no data buffer")
            block = np.frombuffer(buffer, dtype=dtype)  # zero-copy (writeable for hpctp_infer)
            wrapped = weakref.ref(block)  # every view of the caller's memory keeps this array alive
            if block.size != math.prod(shape):
                raise ValueError(f"buffer holds {block.size} elements but local_shape={shape}")
            block = block.reshape(shape)
        except (TypeError, ValueError) as e:
            err = e
    try:
        call(block, global_offsets, global_shape, split, err)
        block = None
        kept = wrapped is not None and wrapped() is not None
        C.raise_if_any(_require_state().grid.comm, _kept_view_error() if kept else None)
    except BaseException as e:
        _clear_frames(e)  # the traceback's frames hold views of the caller's memory (in a cycle via e)
        raise
    finally:
        block = err = None  # no view of the caller's memory, no cycle through this frame, once back in C


def _kept_view_error() -> RuntimeError:
    state = _require_state()
    return RuntimeError(
        f"rank {state.grid.rank}: model {state.model_name!r} kept a view of its input block after hpctp_infer "
        f"or hpctp_put (the call's work was done); the caller may free or reuse that memory, so the model or "
        f"trainer must copy what it keeps (np.array(x.local) or tensor.clone())"
    )


def _clear_frames(error: BaseException) -> None:
    """Local. Drop the local variables of the finished frames in ``error``'s tracebacks (and in
    those of the exceptions it chains to), keeping file and line information. A frame that
    caught an exception refers to it, and so to its own traceback: without this the views of
    the caller's memory in those frames would live until the next garbage collection, and the
    C layer could not release its memoryview before handing control back."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        stack += [e.__cause__, e.__context__]


def _ints(values: Sequence[object], what: str) -> list[int]:
    """Local. ``values`` as Python ints; floats, bools and strings are refused, not truncated."""
    return [as_int(v, f"{what}[{i}]") for i, v in enumerate(values)]


def _normalize_split_arg(split: Sequence[int | None] | None, ndim: int, grid_ndim: int) -> list[int | None]:
    if split is None:
        return [d if d < grid_ndim else None for d in range(ndim)]
    sp: list[int | None] = []
    for d, s in enumerate(split):
        if s is not None and not is_int(s):
            raise TypeError(f"split[{d}]={s!r} must be an int (a grid axis, or -1: not divided)")
        if s is None or int(s) == -1:
            sp.append(None)
        elif not 0 <= int(s) < grid_ndim:
            raise ValueError(f"split[{d}]={s!r} is not a grid axis (0..{grid_ndim - 1}) or -1 (not divided)")
        else:
            sp.append(int(s))
    if len(sp) != ndim:
        raise ValueError(f"split has {len(sp)} entries but the data has {ndim} dims")
    return sp


def _wrap(
    block: np.ndarray | None,
    global_offsets: Sequence[int],
    global_shape: Sequence[int],
    split: Sequence[int | None] | None,
    error: Exception | None,
    writeable: bool = True,
) -> DistTensor:
    """Collective over grid. Check the caller's block and arguments (agreed on every rank), then wrap
    the block as a DistTensor without copying."""
    state = _require_state()
    grid = state.grid
    # 1. this rank's own checks, agreed on collectively
    info = [-1] * (1 + 2 * _MAX_NDIM)
    if error is None:
        try:
            if not isinstance(block, np.ndarray):
                raise TypeError(f"block must be a numpy array, got {type(block).__name__}")
            if block.dtype not in (np.float64, np.float32):
                raise TypeError(f"block dtype must be float64 or float32, got {block.dtype}")
            if not block.flags.c_contiguous or (writeable and not block.flags.writeable):
                raise ValueError(
                    "block must be C-contiguous"
                    + (" and writeable (the result is written into it)" if writeable else "")
                )
            ndim = block.ndim
            if not 1 <= ndim <= _MAX_NDIM:
                raise ValueError(f"ndim={ndim} must be in 1..{_MAX_NDIM}")
            offs = _ints(global_offsets, "global_offsets")
            gshape = _ints(global_shape, "global_shape")
            if len(offs) != ndim or len(gshape) != ndim:
                raise ValueError(
                    f"global_offsets ({len(offs)} entries) and global_shape ({len(gshape)}) need one entry "
                    f"per dim of the {ndim}-D block"
                )
            sp = _normalize_split_arg(split, ndim, grid.ndim)
            info = [ndim] + gshape + [0] * (_MAX_NDIM - ndim) + [-1 if s is None else s for s in sp]
            info += [-2] * (_MAX_NDIM - ndim)
        except (TypeError, ValueError, RuntimeError) as e:
            error = e
    C.raise_if_any(grid.comm, error)
    # 2. the same ndim, global shape and split everywhere (the same table on every rank)
    table = C.allgather_ints(grid.comm, info)
    bad = [r for r in range(grid.size) if not np.array_equal(table[r], table[0])]
    if bad:
        raise ValueError(
            f"ndim, global_shape or split differ between ranks 0 and {bad[0]}: "
            f"{_describe(table[0])} vs {_describe(table[bad[0]])}"
        )
    if block is None:  # unreachable: step 1 failed on this rank otherwise
        raise RuntimeError("internal error: no block after a successful check")
    # 3. wrap the blocks (collective; checks that they tile global_shape)
    x = from_local(block, grid, sp, gshape)
    if tuple(offs) != x.local_offsets:
        error = ValueError(
            f"rank {grid.rank} (grid coords {grid.coords}): global_offsets={tuple(offs)} but the block sizes "
            f"place this block at {x.local_offsets}; ranks must hold the blocks in grid order (grid rank = "
            f"rank in the communicator, row-major coordinates, see hpctp_grid)"
        )
    C.raise_if_any(grid.comm, error)
    return x


def _infer(
    block: np.ndarray | None,
    global_offsets: Sequence[int],
    global_shape: Sequence[int],
    split: Sequence[int | None] | None,
    error: Exception | None,
) -> None:
    state = _require_state()
    grid = state.grid
    if error is None and state.model is None:
        error = RuntimeError("no model loaded: call hpctp_load (hpctp.capi.load) first")
    x = _wrap(block, global_offsets, global_shape, split, error)
    if block is None:  # unreachable: _wrap raised on every rank otherwise
        raise RuntimeError("internal error: no block after a successful check")
    # 4. the model, its errors agreed on
    out: np.ndarray | None = None
    try:
        y = state.model(x)  # type: ignore[misc]
        if not isinstance(y, DistTensor):
            raise TypeError(f"model {state.model_name!r} returned {type(y).__name__}, expected a DistTensor")
        if y.layout != x.layout:
            raise ValueError(f"model {state.model_name!r} changed the layout: {x.layout} -> {y.layout}")
        out = to_numpy(y.local)
        if not np.can_cast(out.dtype, block.dtype, casting="same_kind"):
            raise TypeError(f"model output dtype {out.dtype} cannot be written into {block.dtype} data")
    except Exception as e:
        error = e
    C.raise_if_any(grid.comm, error)
    # 5. write back (cannot fail after the checks above)
    if out is not None and out is not block:
        np.copyto(block, out, casting="same_kind")


def _describe(row: np.ndarray) -> str:
    ndim = int(row[0])
    if ndim < 0:
        return "(invalid)"
    shape = tuple(int(n) for n in row[1 : 1 + ndim])
    sp = tuple(None if s == -1 else int(s) for s in row[1 + _MAX_NDIM : 1 + _MAX_NDIM + ndim])
    return f"global_shape={shape}, split={sp}"


def stream_init(config: str) -> None:
    """Collective over grid. Start online training: the trainer named in the TOML file ``config``.

    Parameters
    ----------
    config : str
        Path of a TOML file with a top-level ``trainer = "package.module:factory"``; the factory
        gets the grid and the whole file as a dict (see :class:`Trainer`), e.g.
        ``apps.surrogate.online:capi_trainer`` with the apps' ``[simulation]`` (what the caller's
        simulation produces), ``[surrogate]``, ``[train]`` and ``[online]`` sections.

    Raises
    ------
    RuntimeError
        If :func:`init` has not been called (local), or a stream is already open.
    FileNotFoundError, ValueError
        If the file is missing, not TOML, or names no trainer (on every rank).
    Exception
        What the import or the factory raised (on every rank).
    """
    import tomllib

    state = _require_state()
    grid = state.grid
    error: Exception | None = None
    cfg: dict[str, Any] = {}
    try:
        if state.trainer is not None:
            raise RuntimeError("a stream is open: call hpctp_stream_finalize before hpctp_stream_init")
        with open(str(config), "rb") as f:
            cfg = tomllib.load(f)
        if not isinstance(cfg.get("trainer"), str):
            raise ValueError(
                f'{config}: no top-level trainer = "package.module:factory" (e.g. apps.surrogate.online:capi_trainer)'
            )
    except (OSError, ValueError, RuntimeError, TypeError) as e:  # (tomllib's errors are ValueErrors)
        error = e
    C.raise_if_any(grid.comm, error)
    factory = _import_factory(grid, cfg["trainer"], "trainer")
    trainer: Any = None
    try:
        trainer = factory(grid, cfg)
        if not (callable(getattr(trainer, "put", None)) and callable(getattr(trainer, "finalize", None))):
            raise TypeError(
                f"trainer factory {cfg['trainer']!r} returned a {type(trainer).__name__} without put and finalize"
            )
    except Exception as e:
        error = e
    C.raise_if_any(grid.comm, error)
    state.trainer = trainer
    state.put_layout = None


def put(
    block: np.ndarray,
    global_offsets: Sequence[int],
    global_shape: Sequence[int],
    split: Sequence[int | None] | None = None,
) -> None:
    """Collective over grid. Hand the next snapshot to the trainer: the blocks held by the ranks
    (copied by the trainer; the caller may change them afterwards).

    The first call checks the arguments on every rank (as :func:`infer`) and remembers the layout;
    later calls must pass blocks of the same shapes and offsets (checked locally, agreed in one
    all-reduce).

    Parameters
    ----------
    block : numpy.ndarray
        This rank's block (float32 or float64, C-contiguous; read only).
    global_offsets, global_shape, split
        As for :func:`infer`.

    Raises
    ------
    RuntimeError
        If no stream is open (:func:`stream_init`).
    ValueError, TypeError
        On inconsistent arguments, or a block unlike the first one's, on any rank: raised on every rank.
    Exception
        What the trainer raised (on every rank).
    """
    _put(block, global_offsets, global_shape, split, None)


def _put(
    block: np.ndarray | None,
    global_offsets: Sequence[int],
    global_shape: Sequence[int],
    split: Sequence[int | None] | None,
    error: Exception | None,
) -> None:
    state = _require_state()
    grid = state.grid
    if error is None and state.trainer is None:
        error = RuntimeError("no stream: call hpctp_stream_init first")
    key: tuple[Any, ...] = ()
    if error is None:
        try:
            key = (getattr(block, "shape", None), getattr(block, "dtype", None), tuple(_ints(global_offsets, "global_offsets")),
                   tuple(_ints(global_shape, "global_shape")), None if split is None else tuple(split))  # fmt: skip
        except (TypeError, ValueError) as e:
            error = e
    if state.put_layout is None:  # the first snapshot: every check, agreed on; its layout kept
        x = _wrap(block, global_offsets, global_shape, split, error, writeable=False)
        state.put_layout = (key, x.layout)
    else:
        if error is None and key != state.put_layout[0]:
            error = ValueError(
                f"hpctp_put: rank {grid.rank} passed a block of shape {key[0]}, dtype {key[1]}, offsets {key[2]}, "
                f"global shape {key[3]}, split {key[4]}; the first hpctp_put passed {state.put_layout[0][:5]}: a "
                "stream carries snapshots of one field"
            )
        C.raise_if_any(grid.comm, error)
        x = DistTensor(block, grid, state.put_layout[1])
    try:
        state.trainer.put(x)  # type: ignore[union-attr]
    except Exception as e:
        error = e
    C.raise_if_any(grid.comm, error)


def stream_finalize() -> None:
    """Collective over grid. End the stream: the trainer runs the steps its snapshots allow, writes
    its checkpoint and closes (a no-op when no stream is open).

    Raises
    ------
    Exception
        What the trainer raised (on every rank); the stream is closed anyway.
    """
    state = _require_state()
    trainer, state.trainer, state.put_layout = state.trainer, None, None
    if trainer is None:
        return
    error: Exception | None = None
    try:
        trainer.finalize()
    except Exception as e:
        error = e
    C.raise_if_any(state.grid.comm, error)


def finalize() -> None:
    """Collective over grid. Finish an open stream (:func:`stream_finalize`), drop the model and free
    the grid (a no-op when not initialised)."""
    global _state
    if _state is not None and _state.trainer is not None:
        stream_finalize()
    state, _state = _state, None
    if state is not None:
        state.model = None
        state.grid.free()


class DemoModel:
    """Local. The built-in test model: ``y = scale * x + shift * mean(x)`` over the global field.

    Deterministic and collective (the global mean needs every rank's data), so a C test can
    check the result against numpy on the whole field.

    Parameters
    ----------
    scale, shift : float
    """

    def __init__(self, scale: float = 2.0, shift: float = 1.0) -> None:
        self.scale = float(scale)
        self.shift = float(shift)

    def __call__(self, x: DistTensor) -> DistTensor:
        """Collective over grid. Apply the model.

        Parameters
        ----------
        x : DistTensor

        Returns
        -------
        DistTensor
            Same layout and dtype as ``x``.
        """
        return x * self.scale + x.mean() * self.shift


def demo_model(grid: ProcessGrid, checkpoint: str | None = None) -> DemoModel:
    """Collective over grid. Factory of :class:`DemoModel` (``hpctp_load("hpctp.capi:demo_model", ...)``).

    Parameters
    ----------
    grid : ProcessGrid
    checkpoint : str or None
        Optional ``.npy`` file holding ``[scale, shift]`` (float64), read on rank 0 without
        pickle and broadcast; default ``scale=2, shift=1``.

    Returns
    -------
    DemoModel

    Raises
    ------
    OSError, ValueError
        If the checkpoint cannot be read or does not hold two numbers (on every rank).
    """
    params = np.array([2.0, 1.0])
    error: Exception | None = None
    if checkpoint and grid.rank == 0:
        try:
            raw = np.asarray(np.load(checkpoint, allow_pickle=False), dtype=np.float64).reshape(-1)
            if raw.shape != (2,):
                raise ValueError(f"{checkpoint}: expected 2 values [scale, shift], found {raw.size}")
            params[:] = raw
        except (OSError, ValueError, TypeError) as e:
            error = e
    if checkpoint:
        C.raise_if_any(grid.comm, error)
        C.bcast(grid.comm, params, root=0)
    return DemoModel(float(params[0]), float(params[1]))
