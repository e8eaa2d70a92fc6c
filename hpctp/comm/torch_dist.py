"""torch.distributed beside hpctp: a process group and a ``DeviceMesh`` over a grid's ranks.

So that hpctp layers sit beside FSDP2/DTensor modules, :func:`process_group` gives the grid's
processes as a ``torch.distributed`` group (gloo on CPU, NCCL on GPUs) and :func:`device_mesh` the
``DeviceMesh`` of the grid's shape whose coordinates are the grid's. This module imports torch, so
``hpctp.comm`` does not import it (``import hpctp.comm.torch_dist``).

Where ``torch.distributed`` is not initialised yet, :func:`process_group` initialises it over
exactly the grid's processes (default-group rank = grid rank; processes outside the grid are not
part of it): grid rank 0 opens a ``TCPStore`` on a free port of its host (``socket.gethostname()``,
or the address in ``HPCTP_TORCH_STORE_ADDR``), MPI broadcasts host and port, the others connect.
Where it is initialised already (by ``torchrun``, or by an earlier grid), the grid must hold every
process of the default group: ``torch.distributed.new_group`` is collective over the whole default
group, which processes outside the grid cannot join from here.

Groups and meshes are cached per grid, so a second call costs nothing.
"""

from __future__ import annotations

import inspect
import os
import socket
import weakref
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..layout import grid_rank
from .agree import agree_arguments
from .collectives import allgather_ints, bcast, bcast_ints, raise_if_any
from .device import current_device
from .grid import ProcessGrid, check_grid

__all__ = ["process_group", "device_mesh", "torch_ranks"]

STORE_ADDR = "HPCTP_TORCH_STORE_ADDR"

# per grid: ("ranks",) -> default-group ranks; ("group", backend) -> group; ("axes", backend) -> the
# groups along each grid axis through this rank; ("mesh", device_type, backend) -> DeviceMesh
_CACHE: weakref.WeakKeyDictionary[ProcessGrid, dict[tuple[str, ...], Any]] = weakref.WeakKeyDictionary()


def _cache(grid: ProcessGrid) -> dict[tuple[str, ...], Any]:
    """Local. The grid's cache; emptied when torch.distributed was torn down since it was filled."""
    if not dist.is_initialized():
        _CACHE.pop(grid, None)
    return _CACHE.setdefault(grid, {})


def _default_backend() -> str:
    """Local. ``"nccl"`` where hpctp's blocks live on a CUDA device, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() and current_device() is not None else "gloo"


def _resolve(backend: str | None) -> str:
    """Local. ``backend``, else the default group's, else :func:`_default_backend`."""
    if backend is not None and (not isinstance(backend, str) or not backend):
        raise TypeError(f"backend must be a torch.distributed backend name such as 'gloo' or 'nccl', got {backend!r}")
    return backend or (str(dist.get_backend()) if dist.is_initialized() else _default_backend())


def torch_ranks(grid: ProcessGrid) -> tuple[int, ...]:
    """Collective over grid. The ``torch.distributed`` default-group rank of each grid rank, in
    grid-rank order (one ``Allgather`` the first time, cached).

    Parameters
    ----------
    grid : ProcessGrid

    Returns
    -------
    tuple of int
        ``ranks[g]`` is the default-group rank of grid rank ``g``.

    Raises
    ------
    ValueError
        On every rank, if ``torch.distributed`` is not initialised on some rank of the grid
        (:func:`process_group` initialises it).
    """
    cache = _cache(check_grid(grid))
    if ("ranks",) in cache:
        return cache[("ranks",)]  # type: ignore[no-any-return]
    on = dist.is_initialized()
    table = allgather_ints(grid.comm, [dist.get_rank() if on else -1])[:, 0].tolist()
    missing = [r for r, t in enumerate(table) if t < 0]
    if missing:
        raise ValueError(
            f"torch.distributed is not initialised on grid rank(s) {missing}: call "
            "hpctp.comm.torch_dist.process_group(grid) (or device_mesh(grid)) on every rank of the grid first"
        )
    cache[("ranks",)] = tuple(int(t) for t in table)
    return cache[("ranks",)]  # type: ignore[no-any-return]


def _init_default_group(grid: ProcessGrid, backend: str) -> None:
    """Collective over grid. ``init_process_group`` over exactly the grid's processes (rank = grid
    rank), on a ``TCPStore`` opened by grid rank 0 whose host and port MPI broadcasts."""
    error: Exception | None = None
    host, port, store = "", 0, None
    if grid.rank == 0:
        host = os.environ.get(STORE_ADDR, "").strip() or socket.gethostname()
        try:  # port 0: the OS picks a free one; the others connect after the broadcast
            store = dist.TCPStore(host, 0, world_size=grid.size, is_master=True, wait_for_workers=False)
            port = int(store.port)
        except (RuntimeError, OSError, ValueError) as e:
            error = RuntimeError(
                f"grid rank 0 could not open a torch.distributed TCPStore on {host!r} ({e}); set "
                f"{STORE_ADDR} to an address of this node that every rank reaches"
            )
    raise_if_any(grid.comm, error)
    name = np.frombuffer(host.encode(), dtype=np.uint8) if grid.rank == 0 else None
    head = bcast_ints(grid.comm, None if name is None else [port, name.size], 2)
    buf = np.zeros(int(head[1]), dtype=np.uint8)
    if name is not None:
        buf[:] = name
    bcast(grid.comm, buf)
    host, port = buf.tobytes().decode(), int(head[0])
    if grid.rank != 0:
        try:
            store = dist.TCPStore(host, port, world_size=grid.size, is_master=False)
        except (RuntimeError, OSError, ValueError) as e:
            error = RuntimeError(
                f"grid rank {grid.rank} could not reach rank 0's torch.distributed TCPStore at {host}:{port} "
                f"({e}); set {STORE_ADDR} to an address of rank 0's node that every rank reaches"
            )
    raise_if_any(grid.comm, error)
    dist.init_process_group(backend, store=store, rank=grid.rank, world_size=grid.size)


def _new_group(ranks: list[int], backend: str) -> Any:
    """Collective over the default group. ``new_group`` whose group ranks follow ``ranks``' order."""
    if ranks == sorted(ranks):
        return dist.new_group(ranks, backend=backend)
    if "sort_ranks" not in inspect.signature(dist.new_group).parameters:
        raise ValueError(
            f"the grid orders default-group ranks {ranks} differently from torch.distributed, and this torch's "
            f"new_group (torch {torch.__version__}) sorts them: build the grid on a communicator whose ranks follow "
            "torch's (e.g. MPI.COMM_WORLD when torch.distributed spans it in the same order), or use a newer torch"
        )
    return dist.new_group(ranks, backend=backend, sort_ranks=False)


def process_group(grid: ProcessGrid, backend: str | None = None) -> Any:
    """Collective over grid. A ``torch.distributed`` process group of the grid's processes whose
    group ranks are the grid ranks.

    If ``torch.distributed`` is not initialised, this initialises its default group over exactly
    the grid's processes (see the module's notes: a ``TCPStore`` on grid rank 0, host and port
    broadcast by MPI), and returns it. Otherwise the grid must hold every process of the default
    group; its default group is returned where the ranks coincide and the backend is the
    default's, else a ``torch.distributed.new_group`` in grid-rank order (collective over the
    default group, which is the grid). Cached per grid and backend.

    Parameters
    ----------
    grid : ProcessGrid
    backend : str, optional
        ``"gloo"``, ``"nccl"``... Default: the default group's backend where ``torch.distributed``
        is initialised, else ``"nccl"`` where hpctp's blocks live on a CUDA device
        (:func:`hpctp.comm.current_device`), ``"gloo"`` otherwise.

    Returns
    -------
    torch.distributed.ProcessGroup

    Raises
    ------
    TypeError
        If ``grid`` is not a ProcessGrid or ``backend`` not a string.
    ValueError
        On every rank: if ranks pass different backends, ``torch.distributed`` is initialised on
        some ranks of the grid only, or its default group holds processes outside the grid.
    RuntimeError
        On every rank, if the ``TCPStore`` cannot be opened or reached (set ``HPCTP_TORCH_STORE_ADDR``).
    """
    grid = check_grid(grid)
    resolved = _resolve(backend)
    cache = _cache(grid)
    if ("group", resolved) in cache:
        return cache[("group", resolved)]
    agree_arguments(grid.comm, "process_group", None, backend=resolved)
    on = dist.is_initialized()
    table = allgather_ints(grid.comm, [dist.get_rank() if on else -1, dist.get_world_size() if on else 0])
    if (table[:, 0] < 0).all():
        _init_default_group(grid, resolved)
        group = dist.group.WORLD
        cache[("ranks",)] = tuple(range(grid.size))
    else:
        off = [r for r in range(grid.size) if table[r, 0] < 0]
        if off:
            raise ValueError(
                f"torch.distributed is initialised on some ranks of the grid but not on grid rank(s) {off}; "
                "initialise it on all of them, or on none (process_group then does)"
            )
        ranks = table[:, 0].tolist()
        world = int(table[0, 1])
        if sorted(ranks) != list(range(world)):
            raise ValueError(
                f"torch.distributed's default group has {world} processes but the grid holds default-group ranks "
                f"{sorted(ranks)}: torch.distributed.new_group is collective over the whole default group, so the "
                "grid must hold all of its processes; build the grid over them (e.g. on MPI.COMM_WORLD), or let "
                "process_group(grid) initialise torch.distributed over exactly the grid's processes"
            )
        if ranks == list(range(world)) and resolved == str(dist.get_backend()):
            group = dist.group.WORLD
        else:
            group = _new_group(ranks, resolved)
        cache[("ranks",)] = tuple(int(r) for r in ranks)
    cache[("group", resolved)] = group
    return group


def _axis_groups(grid: ProcessGrid, backend: str) -> list[Any]:
    """Collective over grid (= the default group). Per grid axis, the group of the ranks that
    differ from this one only along it (in coordinate order); every line of every axis is
    created on every rank, in the same order, as ``new_group`` requires."""
    cache = _cache(grid)
    key = ("axes", backend)
    if key in cache:
        return cache[key]  # type: ignore[no-any-return]
    whole = process_group(grid, backend)
    ranks = torch_ranks(grid)
    out = []
    for axis in range(grid.ndim):
        mine = None
        for rest in np.ndindex(*[n for a, n in enumerate(grid.dims) if a != axis]):
            line = []
            for c in range(grid.dims[axis]):
                coords = list(rest)
                coords.insert(axis, c)
                line.append(ranks[grid_rank(coords, grid.dims)])
            group = whole if line == list(ranks) else _new_group(line, backend)
            if ranks[grid.rank] in line:
                mine = group
        out.append(mine)
    cache[key] = out
    return out


def device_mesh(grid: ProcessGrid, device_type: str | None = None, backend: str | None = None) -> DeviceMesh:
    """Collective over grid. A ``DeviceMesh`` of shape ``grid.dims`` whose coordinates are the
    grid's: the process at mesh coordinates ``c`` is grid rank ``grid.rank_of(c)``.

    Built on :func:`process_group` (which initialises ``torch.distributed`` if needed) and one
    group per grid axis, so DTensors on it reduce along the grid's axes. Cached per grid, device
    type and backend.

    Parameters
    ----------
    grid : ProcessGrid
    device_type : str, optional
        ``"cpu"`` or ``"cuda"`` (no index); default ``"cuda"`` where hpctp's blocks live on a
        CUDA device, else ``"cpu"``.
    backend : str, optional
        The groups' backend; default ``"nccl"`` for ``"cuda"``, else ``"gloo"``.

    Returns
    -------
    torch.distributed.device_mesh.DeviceMesh
        Its dims are named ``"grid0"``, ``"grid1"``...

    Raises
    ------
    TypeError
        If ``grid`` is not a ProcessGrid or ``backend`` not a string.
    ValueError
        On every rank, if ``device_type`` is not a device type name or the arguments differ
        between ranks, or as :func:`process_group`.
    """
    grid = check_grid(grid)
    if device_type is None:
        device_type = "cuda" if _default_backend() == "nccl" else "cpu"
    backend = _resolve(backend or ("nccl" if device_type == "cuda" else "gloo"))
    key = ("mesh", str(device_type), backend)
    cache = _cache(grid)
    if key in cache:
        return cache[key]  # type: ignore[no-any-return]
    error: Exception | None = None
    if not isinstance(device_type, str) or not device_type.isidentifier():
        error = ValueError(f"device_type must be a device type such as 'cpu' or 'cuda' (no index), got {device_type!r}")
    agree_arguments(grid.comm, "device_mesh", error, device_type=device_type, backend=backend)
    groups = _axis_groups(grid, backend)
    mesh = torch.tensor(torch_ranks(grid), dtype=torch.int).reshape(grid.dims)
    names = tuple(f"grid{a}" for a in range(grid.ndim))
    cache[key] = DeviceMesh.from_group(groups, device_type, mesh=mesh, mesh_dim_names=names)
    return cache[key]  # type: ignore[no-any-return]
