"""A machine as the planner and the runtime's automatic choices see it: per-rank compute rates and the cost of each
kind of message on each link.

A :class:`MachineProfile` holds, per element type (``float32``, ``bfloat16``, ...), the rates of the
block computations (GEMM, convolution, FFT and attention flop/s), the memory bandwidth that bounds
elementwise work and the host time per kernel; and, per link level (``intra``: ranks of one node;
``inter``: ranks on different nodes), a latency ``alpha`` (seconds) and an inverse bandwidth ``beta``
(seconds per byte) for each kind of message. A collective of ``n`` bytes over ``q`` ranks then costs
(:func:`collective_time`; ``L = ceil(log2 q)``)::

    allreduce       2 L alpha + 2 (q - 1) / q * n * beta     (n: the vector each rank holds)
    allgather       L alpha   + (q - 1) / q * n * beta       (n: the gathered whole)
    reduce_scatter  L alpha   + (q - 1) / q * n * beta       (n: the input each rank holds)
    alltoall        (q - 1) alpha + (q - 1) / q * n * beta   (n: what each rank holds before the move)
    p2p             alpha + n * beta                         (one message of n bytes)

The ranks of a job are placed row-major over the grid and ``ranks_per_node`` consecutive ranks share a
node, so a grid axis is ``intra`` when its ranks all sit on one node (:meth:`MachineProfile.level`).

Machine files are TOML (:func:`load_machine`, :meth:`MachineProfile.to_toml`); keys are checked, so a
misspelt key is an error naming the keys allowed. :func:`hpctp.perf.calibrate` writes one measured on this
machine; ``hpctp/machine/published/*.toml`` hold profiles of public systems built from published figures
(``source = "published"``), listed by :func:`published_machines`.

Pure data and arithmetic (numpy, no MPI, no torch): :mod:`hpctp.linalg` and :mod:`hpctp.nn` price their automatic
choices with it (:mod:`hpctp.machine.default`), :mod:`hpctp.perf` plans with it.
"""

from __future__ import annotations

import math
import numbers
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from .model import Machine

__all__ = [
    "COMPUTE_KEYS",
    "MACHINES_DIR",
    "OPTIONAL_COMPUTE_KEYS",
    "KINDS",
    "LEVELS",
    "SOURCES",
    "ComputeRates",
    "Link",
    "MachineProfile",
    "collective_time",
    "load_machine",
    "profile_from_dict",
    "published_machines",
]

KINDS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "p2p")
"""The kinds of message a profile prices (:func:`collective_time`)."""
LEVELS = ("intra", "inter")
"""Link levels: ranks of one node, ranks of different nodes."""
SOURCES = ("published", "calibrated", "builtin")
"""Where a profile's figures come from: published figures of a public system, measured by :func:`hpctp.perf.calibrate`,
or hpctp's own defaults (:data:`hpctp.machine.CPU_MACHINE`)."""
COMPUTE_KEYS = ("gemm", "gemm_half", "conv", "fft", "attention", "softmax", "bandwidth", "kernel")
"""Per element type: flop/s of GEMMs and the GEMM dimension at which they run at half that rate, flop/s of convolutions,
FFTs and attention, attention scores/s of the softmax; bytes/s of elementwise work; seconds of host time per kernel.
``softmax`` may be left out of a file (older profiles): the softmax is then not priced apart from the flops."""
OPTIONAL_COMPUTE_KEYS = ("softmax",)
"""The keys of :data:`COMPUTE_KEYS` a machine file may leave out."""

MACHINES_DIR = Path(__file__).resolve().parent / "published"
"""The folder of the published machine files (package data of the wheel)."""
_MACHINE_KEYS = (
    "name", "source", "reference", "ranks_per_node", "cores_per_node", "memory_bytes", "asynchronous", "overlap", "date",
    "note",
)  # fmt: skip


@dataclass(frozen=True)
class Link:
    """Local. One kind of message on one link level: ``alpha`` seconds per message, ``beta`` seconds per byte."""

    alpha: float
    beta: float


@dataclass(frozen=True)
class ComputeRates:
    """Local. One rank's computation rates for one element type.

    Attributes
    ----------
    gemm : float
        Flop/s of large matrix products.
    gemm_half : float
        The smallest GEMM dimension at which a product runs at half of ``gemm``: a product of ``f`` flops whose
        smallest dimension is ``d`` takes ``f (1 + gemm_half / d) / gemm`` seconds.
    conv, fft, attention : float
        Flop/s of convolutions, FFTs (``2.5 n log2 n`` flops per transform of ``n`` points) and attention kernels
        (their products: ``4 d`` flops per query-key pair of head dim ``d`` in forward, ``10 d`` in backward).
    bandwidth : float
        Bytes/s (read + written) of elementwise work.
    kernel : float
        Seconds of host time per kernel launched (per torch operator).
    softmax : float
        Scores/s of an attention kernel's softmax, apart from its flops: one exponential and rescale per query-key
        pair in forward, two in backward (it recomputes them, then forms their gradient). At small head dims it
        bounds the kernel (a CPU's exponentials; a GPU's special-function units, FlashAttention-3's bottleneck).
        Infinite: not priced apart (profiles without the key).
    """

    gemm: float
    gemm_half: float
    conv: float
    fft: float
    attention: float
    bandwidth: float
    kernel: float
    softmax: float = math.inf

    def rate(self, category: str) -> float:
        """Local. Flop/s of ``category`` (``"gemm"``, ``"conv"``, ``"fft"``, ``"attention"``), or scores/s of
        ``"softmax"``."""
        return float(getattr(self, category))


def collective_time(kind: str, nbytes: float, q: int, link: Link) -> float:
    """Local. Seconds of one message of ``kind`` over ``q`` ranks (0 for ``q == 1`` or nothing to send).

    Parameters
    ----------
    kind : {"allreduce", "allgather", "reduce_scatter", "alltoall", "p2p"}
    nbytes : float
        As the module docstring says per kind.
    q : int
        Ranks taking part (for ``"p2p"``: any ``q >= 2``).
    link : Link

    Returns
    -------
    float

    Raises
    ------
    ValueError
        On an unknown ``kind``.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown message kind {kind!r}: use one of {', '.join(KINDS)}")
    if q <= 1 or nbytes <= 0:
        return 0.0
    steps = math.ceil(math.log2(q))
    share = (q - 1) / q * nbytes * link.beta
    if kind == "allreduce":
        return 2 * steps * link.alpha + 2 * share
    if kind in ("allgather", "reduce_scatter"):
        return steps * link.alpha + share
    if kind == "alltoall":
        return (q - 1) * link.alpha + share
    return link.alpha + nbytes * link.beta


@dataclass(frozen=True)
class MachineProfile:
    """Local. Compute rates per element type and message costs per link level (see the module docstring).

    Attributes
    ----------
    name : str
    source : {"published", "calibrated", "builtin"}
        ``"published"``: built from vendors' and papers' figures (``reference`` says which);
        ``"calibrated"``: measured by :func:`hpctp.perf.calibrate`; ``"builtin"``: hpctp's own defaults.
    ranks_per_node : int
        Consecutive ranks sharing a node (and its ``intra`` links).
    cores_per_node : int
        CPU cores the ranks of a node run on, where they are fewer than the ranks (ranks then share cores); 0 (the
        default): a core or a device per rank. :func:`hpctp.perf.calibrate` records the cores its ranks may run on.
        Ranks that share cores and run out of work early lend them to the others (:meth:`sharing`).
    memory_bytes : int
        Memory of one rank's device (0: unknown).
    asynchronous : bool
        Kernels run asynchronously to the host (GPUs): the host's own time per step overlaps them.
    overlap : float
        The share of a non-blocking message's time that computation posted after it hides, in [0, 1]:
        1 where messages progress on their own (NCCL's streams, RDMA, an MPI progress thread), 0
        where they progress only inside MPI calls (MPICH without a progress thread: the message
        completes in its wait, after the computation). Default 1; :func:`hpctp.perf.calibrate`
        measures it.
    compute : dict
        ``{dtype name: ComputeRates}``.
    network : dict
        ``{level: {kind: Link}}`` for the levels present.
    reference, date, note : str
    calibration : dict
        Calibrated profiles: the figures measured along each grid axis (``{"axis0": {kind: Link}}``),
        kept for inspection.
    """

    name: str
    source: str
    ranks_per_node: int
    memory_bytes: int
    compute: Mapping[str, ComputeRates]
    network: Mapping[str, Mapping[str, Link]]
    asynchronous: bool = False
    overlap: float = 1.0
    reference: str = ""
    date: str = ""
    note: str = ""
    calibration: Mapping[str, Mapping[str, Link]] = field(default_factory=dict)
    cores_per_node: int = 0

    def sharing(self, ranks: int) -> float:
        """Local. Ranks per core on a node of a job of ``ranks`` ranks: 1 where each rank has a core or a device
        (``cores_per_node`` 0 or at least the node's ranks); above 1 where ranks share cores. The calibrated rates of
        such a node are rates of ranks that all compute at once: a rank computing alone runs up to this much faster."""
        node = min(ranks, self.ranks_per_node)
        if self.cores_per_node <= 0 or node <= self.cores_per_node:
            return 1.0
        return node / self.cores_per_node

    def rates(self, dtype: str) -> ComputeRates:
        """Local. The compute rates of element type ``dtype`` (e.g. ``"float32"``).

        Raises
        ------
        ValueError
            If the profile has no ``[compute.<dtype>]`` table.
        """
        if dtype not in self.compute:
            raise ValueError(
                f"machine {self.name!r} has no compute rates for {dtype} (it has {', '.join(sorted(self.compute))}); "
                f"add a [compute.{dtype}] table to its file or run `hpctp perf calibrate --dtype {dtype}`"
            )
        return self.compute[dtype]

    def link(self, level: str, kind: str) -> Link:
        """Local. The cost of ``kind`` messages on ``level`` links.

        Raises
        ------
        ValueError
            If the profile has no such table.
        """
        table = self.network.get(level)
        if table is None:
            raise ValueError(
                f"machine {self.name!r} has no [network.{level}] figures (its ranks_per_node is {self.ranks_per_node}): "
                f"use at most {self.ranks_per_node} ranks, or a machine file with [network.{level}]"
            )
        if kind not in table:
            raise ValueError(f"machine {self.name!r} has no [network.{level}.{kind}] figures; add them to its file")
        return table[kind]

    def level(self, dims: tuple[int, ...], axes: tuple[int, ...]) -> str:
        """Local. ``"intra"`` when the ranks that differ only along ``axes`` of a row-major grid of ``dims``
        always share a node (``ranks_per_node`` consecutive ranks), else ``"inter"``."""
        return _level(tuple(int(d) for d in dims), tuple(sorted(set(axes))), self.ranks_per_node)

    def message_time(self, kind: str, nbytes: float, q: int, level: str) -> float:
        """Local. :func:`collective_time` on this machine's ``level`` links."""
        if q <= 1 or nbytes <= 0:
            return 0.0
        return collective_time(kind, nbytes, q, self.link(level, kind))

    def cost_machine(self, level: str, dtype: str) -> Machine:
        """Local. The alpha-beta-gamma :class:`~hpctp.machine.Machine` of ``level`` point-to-point links and
        ``dtype`` GEMMs: what the SUMMA and attention cost models (:func:`hpctp.perf.predict_matmul`,
        :func:`hpctp.perf.predict_attention`) price with, in the planner and in the runtime's automatic choices
        (:func:`hpctp.machine.runtime_cost_machine`). Its ``gemm_half`` is the rates' (the same model: a GEMM
        whose smallest dimension, a SUMMA panel's width, is ``d`` runs at ``d / (d + gemm_half)`` of the peak)."""
        p2p = self.link(level, "p2p")
        rates = self.rates(dtype)
        return Machine(alpha=p2p.alpha, beta=p2p.beta, gamma=1.0 / rates.gemm, gemm_half=rates.gemm_half)

    # ------------------------------------------------------------------ files
    def to_toml(self) -> str:
        """Local. The profile as a machine file (what :func:`load_machine` reads)."""
        lines = [
            f"# hpctp machine file ({self.source} figures): rates per rank, message costs per link level.",
            "# Read with hpctp.machine.load_machine; the keys are described in hpctp.machine.profile.",
            "[machine]",
            f"name = {_quote(self.name)}",
            f"source = {_quote(self.source)}",
            f"ranks_per_node = {self.ranks_per_node}",
            *([f"cores_per_node = {self.cores_per_node}"] if self.cores_per_node else []),
            f"memory_bytes = {self.memory_bytes}",
            f"asynchronous = {'true' if self.asynchronous else 'false'}",
            f"overlap = {_num(self.overlap)}",
        ]
        for key in ("reference", "date", "note"):
            value = getattr(self, key)
            if value:
                lines.append(f"{key} = {_quote(value)}")
        for dtype, r in self.compute.items():
            lines += ["", f"[compute.{dtype}]"]
            lines += [f"{k} = {_num(getattr(r, k))}" for k in COMPUTE_KEYS if math.isfinite(getattr(r, k))]
        for section, tables in (("network", self.network), ("calibration", self.calibration)):
            for level, kinds in tables.items():
                lines += ["", f"[{section}.{level}]"]
                lines += [
                    f"{kind} = {{ alpha = {_num(link.alpha)}, beta = {_num(link.beta)} }}"
                    for kind, link in kinds.items()
                ]
        return "\n".join(lines) + "\n"

    def save(self, path: str | Path) -> Path:
        """Local. Write :meth:`to_toml` to ``path``; returns the path."""
        p = Path(path)
        p.write_text(self.to_toml())
        return p


@lru_cache(maxsize=4096)
def _level(dims: tuple[int, ...], axes: tuple[int, ...], rpn: int) -> str:
    if not axes or all(dims[a] == 1 for a in axes):
        return "intra"
    if math.prod(dims) <= rpn:
        return "intra"
    ranks = np.arange(math.prod(dims)).reshape(dims)
    base = ranks[tuple(slice(0, 1) if a in axes else slice(None) for a in range(len(dims)))]
    return "intra" if bool(np.all(ranks // rpn == base // rpn)) else "inter"


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _num(v: float) -> str:
    return repr(float(v))


def _positive(where: str, key: str, value: Any, *, zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{where}: {key} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not zero):
        raise ValueError(f"{where}: {key} must be {'>= 0' if zero else '> 0'}, got {value!r}")
    return float(value)


def _table(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a table, got {value!r}")
    return value


def _unknown(where: str, keys: Any, allowed: tuple[str, ...]) -> None:
    bad = sorted(set(keys) - set(allowed))
    if bad:
        raise ValueError(f"{where}: unknown key(s) {', '.join(bad)}; the keys allowed there are {', '.join(allowed)}")


def _links(where: str, value: Any) -> dict[str, Link]:
    table = _table(where, value)
    _unknown(where, table, KINDS)
    out = {}
    for kind, entry in table.items():
        e = _table(f"{where}.{kind}", entry)
        _unknown(f"{where}.{kind}", e, ("alpha", "beta"))
        missing = [k for k in ("alpha", "beta") if k not in e]
        if missing:
            raise ValueError(f"{where}.{kind}: missing {', '.join(missing)} (seconds per message, seconds per byte)")
        out[kind] = Link(_positive(f"{where}.{kind}", "alpha", e["alpha"], zero=True),
                         _positive(f"{where}.{kind}", "beta", e["beta"], zero=True))  # fmt: skip
    return out


def profile_from_dict(data: Mapping[str, Any], where: str = "machine file") -> MachineProfile:
    """Local. A :class:`MachineProfile` from a parsed machine file, every key checked.

    Raises
    ------
    ValueError
        Naming the file, the key and what is allowed there.
    """
    _unknown(where, data, ("machine", "compute", "network", "calibration"))
    head = _table(f"{where} [machine]", data.get("machine", {}))
    _unknown(f"{where} [machine]", head, _MACHINE_KEYS)
    for key in ("name", "ranks_per_node"):
        if key not in head:
            raise ValueError(f"{where} [machine]: missing key {key!r}")
    source = head.get("source", "published")
    if source not in SOURCES:
        raise ValueError(f"{where} [machine]: source must be one of {', '.join(SOURCES)}, got {source!r}")
    rpn = head["ranks_per_node"]
    if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1:
        raise ValueError(f"{where} [machine]: ranks_per_node must be a positive int, got {rpn!r}")
    cores = head.get("cores_per_node", 0)
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 0:
        raise ValueError(
            f"{where} [machine]: cores_per_node must be an int >= 0 (0: a core or a device per rank), got {cores!r}"
        )
    memory = head.get("memory_bytes", 0)
    if isinstance(memory, bool) or not isinstance(memory, int) or memory < 0:
        raise ValueError(f"{where} [machine]: memory_bytes must be an int >= 0, got {memory!r}")
    compute: dict[str, ComputeRates] = {}
    for dtype, entry in _table(f"{where} [compute]", data.get("compute", {})).items():
        w = f"{where} [compute.{dtype}]"
        e = _table(w, entry)
        _unknown(w, e, COMPUTE_KEYS)
        missing = [k for k in COMPUTE_KEYS if k not in e and k not in OPTIONAL_COMPUTE_KEYS]
        if missing:
            raise ValueError(f"{w}: missing {', '.join(missing)}")
        compute[dtype] = ComputeRates(
            **{k: _positive(w, k, e[k], zero=k in ("kernel", "gemm_half")) for k in COMPUTE_KEYS if k in e}
        )
    if not compute:
        raise ValueError(f"{where}: no [compute.<dtype>] table (e.g. [compute.float32] with {', '.join(COMPUTE_KEYS)})")
    network = _table(f"{where} [network]", data.get("network", {}))
    _unknown(f"{where} [network]", network, LEVELS)
    if "intra" not in network:
        raise ValueError(f"{where}: no [network.intra] table (message costs between ranks of one node)")
    links = {level: _links(f"{where} [network.{level}]", v) for level, v in network.items()}
    missing_kinds = [f"{lv}.{k}" for lv, t in links.items() for k in KINDS if k not in t]
    if missing_kinds:
        raise ValueError(
            f"{where}: missing message costs {', '.join(missing_kinds)} (each level needs {', '.join(KINDS)})"
        )
    asynchronous = head.get("asynchronous", False)
    if not isinstance(asynchronous, bool):
        raise ValueError(f"{where} [machine]: asynchronous must be true or false, got {asynchronous!r}")
    overlap = head.get("overlap", 1.0)
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not 0.0 <= overlap <= 1.0:
        raise ValueError(f"{where} [machine]: overlap must be a number in [0, 1], got {overlap!r}")
    calib = _table(f"{where} [calibration]", data.get("calibration", {}))
    return MachineProfile(
        name=str(head["name"]), source=source, ranks_per_node=rpn, memory_bytes=memory, compute=compute,
        network=links, asynchronous=asynchronous, overlap=float(overlap), reference=str(head.get("reference", "")), date=str(head.get("date", "")),
        note=str(head.get("note", "")),
        calibration={k: _links(f"{where} [calibration.{k}]", v) for k, v in calib.items()}, cores_per_node=cores,
    )  # fmt: skip


def load_machine(path: str | Path) -> MachineProfile:
    """Local. Read a machine file; a bare name (e.g. ``"h100-ndr"``) reads the published profile of that name.

    Parameters
    ----------
    path : str or pathlib.Path
        A TOML file, or the name of a file of :func:`published_machines`.

    Returns
    -------
    MachineProfile

    Raises
    ------
    FileNotFoundError
        If neither exists (naming the published profiles).
    ValueError
        On invalid TOML or an unknown, missing or invalid key (naming it and what is allowed).
    """
    p = Path(path)
    if not p.is_file():
        named = MACHINES_DIR / f"{path}.toml"
        if named.is_file():
            p = named
        else:
            raise FileNotFoundError(
                f"machine file {path} not found; give a TOML file (hpctp perf calibrate writes one) or one of the "
                f"published profiles: {', '.join(published_machines())}"
            )
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"machine file {p}: {e}") from None
    return profile_from_dict(data, f"machine file {p}")


def published_machines() -> tuple[str, ...]:
    """Local. Names of the profiles built from published figures (``hpctp/machine/published/*.toml``)."""
    return tuple(sorted(f.stem for f in MACHINES_DIR.glob("*.toml")))
