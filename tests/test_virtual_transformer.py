"""The transformer layers and SUMMA products on a virtual grid send what they send on the real one (issue 54).

Each test builds a layer and its input on the real grid (float64, CPU) and on the grid's virtual twin playing this
rank (``meta`` tensors), runs forward, a local loss, backward and the gradient sync where the real step needs it,
and compares every communicator's calls, bytes and messages (:func:`helpers.virtual.same_messages`). Where the grid
divides the layer's axis the step must move bytes on that axis's communicator. Where a layer picks its
schedule (``"auto"``), the schedule is pinned in one test and left to the layer in another, whose choice must be the
same on both grids.

Plain token blocks under sequence parallelism are even here: their cuts come from the other ranks (an all-gather),
which on the virtual grid gives every peer the played rank's count, so an uneven split would be counted as if each
peer held as many tokens as the rank played. DistTensor inputs carry their cuts and are uneven; so may a patch
embedding's plain field blocks be, as no message depends on the layout it infers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.virtual import same_messages

import hpctp
from hpctp import DistTensor, Layout
from hpctp.layout import block_cuts
from hpctp.linalg import matmul, matmul_25d
from hpctp.nn import sync_gradients
from hpctp.nn.transformer import (
    ColumnParallelLinear,
    LayerNorm,
    Linear2D,
    MultiheadAttention,
    NeighborhoodAttention2d,
    NeighborhoodAttention3d,
    ParallelMLP,
    PatchEmbed2d,
    PatchEmbed3d,
    RMSNorm,
    RowParallelLinear,
    TransformerBlock,
    Unpatch2d,
    Unpatch3d,
    attention,
    attention_schedule,
    patch_aligned_layout,
)
from hpctp.testing import assert_all

pytestmark = pytest.mark.mpi

Counts = dict[str, tuple[int, int, int, tuple[tuple[str, int], ...]]]
Run = Callable[[], Any]
B, T, E, HEADS = 2, 8, 8, 4


def _x(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, grad: bool = True) -> torch.Tensor:
    """Local. A standard-normal tensor (empty on ``meta``) that requires grad (when ``grad``)."""
    return torch.randn(shape, dtype=dtype, device=device).requires_grad_(grad)


def _dist(
    layout: Layout, grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype, grad: bool = True
) -> DistTensor:
    """Local. This rank's block of a random tensor of ``layout`` as a DistTensor (that requires grad)."""
    return DistTensor(_x(layout.local_shape(grid.coords), device, dtype, grad), grid, layout)


def _local(y: Any) -> torch.Tensor:
    """Local. The torch block of a layer's output (a DistTensor's, the first of a tuple, or the tensor)."""
    y = y[0] if isinstance(y, tuple) else y
    return y.local if isinstance(y, DistTensor) else y


def _train(module: torch.nn.Module, grid: hpctp.ProcessGrid, forward: Run) -> Run:
    """Local. The counted step: ``forward()``, the sum of this rank's output block, backward and
    :func:`hpctp.nn.sync_gradients` of ``module`` over the whole grid."""

    def run() -> None:
        _local(forward()).sum().backward()
        sync_gradients(module, grid)

    return run


def _moved(counts: Counts, name: str) -> int:
    """Local. Bytes this rank sent and received on the communicator ``name`` (0 if unused)."""
    return counts[name][0] + counts[name][1] if name in counts else 0


def _moved_on(grid: hpctp.ProcessGrid, counts: Counts, axes: tuple[int, ...], whole: bool, what: str) -> None:
    """Collective over grid. Where grid axis ``a`` of ``axes`` divides, the step moved bytes on its communicator
    (``hpctp.grid.axis{a}``; sent or received: a broadcast's root only sends), and with ``whole`` on the grid's
    own where the grid has several ranks."""
    names = [f"hpctp.grid.axis{a}" for a in axes if grid.dims[a] > 1]
    if whole and grid.size > 1:
        names.append("hpctp.grid")
    idle = [n for n in names if _moved(counts, n) == 0]
    assert_all(grid, not idle, f"{what} on {grid.dims}: no bytes moved on {idle}: {counts}")


def _check(
    grid: hpctp.ProcessGrid, step: Callable[..., Run], what: str, axes: tuple[int, ...] = (), whole: bool = False
) -> Counts:
    """Collective over grid. :func:`same_messages` of ``step``, and bytes moved on ``axes`` and the grid's
    communicator (see :func:`_moved_on`)."""
    counts = same_messages(grid, step, what)
    _moved_on(grid, counts, axes, whole, what)
    return counts


AXIS = 1
"""The grid axis of the layers' features or heads: with the grid shapes 1 x P, 2 x 2 and P x 1 it holds P, 2 and 1
ranks (the other axis the data-parallel replicas)."""


# ---------------------------------------------------------------------------------------------- linears
@pytest.mark.parametrize("gather", [False, True])
def test_column_parallel_linear(grid2d: hpctp.ProcessGrid, gather: bool) -> None:
    """Output features over grid axis 1; the input gradient all-reduced (and the output all-gathered)."""

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        layer = ColumnParallelLinear(6, 7, grid, axis=AXIS, gather_output=gather, seed=1, dtype=dtype, device=device)
        x = _x((5, 6), device, dtype)
        return _train(layer, grid, lambda: layer(x))

    _check(grid2d, step, f"ColumnParallelLinear gather={gather}", (AXIS,))


@pytest.mark.parametrize("parallel_input", [True, False])
def test_row_parallel_linear(grid2d: hpctp.ProcessGrid, parallel_input: bool) -> None:
    """Input features (7: uneven over 2 and 4) over grid axis 1; the partial outputs all-reduced."""

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        layer = RowParallelLinear(
            7, 6, grid, axis=AXIS, input_is_parallel=parallel_input, seed=2, dtype=dtype, device=device
        )
        x = _x((5, layer.weight.shape[1] if parallel_input else 7), device, dtype)
        return _train(layer, grid, lambda: layer(x))

    _check(grid2d, step, f"RowParallelLinear parallel_input={parallel_input}", (AXIS,))


def test_linear2d(grid2d: hpctp.ProcessGrid) -> None:
    """SUMMA forward and backward, the batch (6 rows) over grid axis 0, the features over axis 1."""

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        layer = Linear2D(7, 6, grid, panel=2, seed=3, dtype=dtype, device=device)
        x = _x(Layout((6, 7), grid.dims, (0, 1)).local_shape(grid.coords), device, dtype)
        return _train(layer, grid, lambda: layer(x))

    _check(grid2d, step, "Linear2D", (0, 1))


def _matmul_step(
    product: Callable[..., DistTensor], shape: tuple[int, int, int], split: tuple[int | None, ...]
) -> Callable[[hpctp.ProcessGrid, torch.device, torch.dtype], Run]:
    """Local. A step of ``product`` (:func:`hpctp.linalg.matmul` or ``matmul_25d``) of ``op(A) [m, k]`` by
    ``op(B) [k, n]``, both split ``split``, for every pair of transposes (not differentiable: no backward)."""
    m, k, n = shape

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        def operand(rows: int, cols: int) -> DistTensor:
            return _dist(Layout((rows, cols), grid.dims, split), grid, device, dtype, grad=False)

        pairs = {(ta, tb): (operand(*((k, m) if ta else (m, k))), operand(*((n, k) if tb else (k, n))))
                 for ta, tb in itertools.product((False, True), repeat=2)}  # fmt: skip

        def run() -> None:
            for (ta, tb), (a, b) in pairs.items():
                product(a, b, transpose_a=ta, transpose_b=tb)

        return run

    return step


@pytest.mark.parametrize("split", [(0, 1), (0, None)])
def test_summa_matmul(grid2d: hpctp.ProcessGrid, split: tuple[int | None, ...]) -> None:
    """hpctp.linalg.matmul of 7 x 5 by 5 x 9 (uneven) for every transpose: SUMMA's panels (the operands moved to
    split (0, 1) first when given split (0, None))."""
    _check(grid2d, _matmul_step(matmul, (7, 5, 9), split), f"matmul split={split}", (0, 1))


def test_matmul_25d(grid3d: hpctp.ProcessGrid) -> None:
    """2.5D SUMMA of 7 x 5 by 5 x 9 on a 3-D grid: the layers' panels and the all-reduce over grid axis 2."""
    _check(grid3d, _matmul_step(matmul_25d, (7, 5, 9), (0, 1)), "matmul_25d", (0, 1, 2))


# ---------------------------------------------------------------------------------------------- MLP and norms
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_parallel_mlp(grid2d: hpctp.ProcessGrid, sequence_parallel: bool) -> None:
    """Hidden features over grid axis 1; with sequence parallelism the (even) token blocks gathered and scattered."""

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        mlp = ParallelMLP(
            E, 12, grid, axis=AXIS, sequence_parallel=sequence_parallel, seed=4, dtype=dtype, device=device
        )
        x = _x((B, T // grid.dims[AXIS] if sequence_parallel else T, E), device, dtype)
        return _train(mlp, grid, lambda: mlp(x))

    _check(grid2d, step, f"ParallelMLP sp={sequence_parallel}", (AXIS,))


@pytest.mark.parametrize("norm", [LayerNorm, RMSNorm])
def test_split_norm(grid2d: hpctp.ProcessGrid, norm: type) -> None:
    """The hidden dim (10: uneven over 4) split over grid axis 1: the row statistics all-reduced."""

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        layer = norm(10, grid, axis=AXIS, dtype=dtype, device=device)
        cuts, c = block_cuts(10, grid.dims[AXIS]), grid.coords[AXIS]
        x = _x((3, 5, cuts[c + 1] - cuts[c]), device, dtype)
        return _train(layer, grid, lambda: layer(x))

    _check(grid2d, step, norm.__name__, (AXIS,))


# ---------------------------------------------------------------------------------------------- heads
def test_multihead_attention_by_heads(grid2d: hpctp.ProcessGrid) -> None:
    """Heads over grid axis 1 on whole (replicated) tokens, causal: one all-reduce forward and one backward."""

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        layer = MultiheadAttention(E, HEADS, grid, axis=AXIS, seed=5, dtype=dtype, device=device)
        x = _x((B, T, E), device, dtype)
        return _train(layer, grid, lambda: layer(x, x, x, is_causal=True))

    _check(grid2d, step, "MultiheadAttention", (AXIS,))


def test_multihead_attention_sequence_parallel(grid2d: hpctp.ProcessGrid) -> None:
    """Heads over grid axis 1, cross-attention on DistTensors whose tokens are split over it in uneven cuts (taken
    from the layouts: 7 queries, 5 keys), the 3 samples over the other axis."""
    split = (0, AXIS, None)

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        layer = MultiheadAttention(
            E, HEADS, grid, axis=AXIS, sequence_parallel=True, seed=6, dtype=dtype, device=device
        )
        q = _dist(Layout((3, 7, E), grid.dims, split), grid, device, dtype)
        k = _dist(Layout((3, 5, E), grid.dims, split), grid, device, dtype)
        return _train(layer, grid, lambda: layer(q, k, k))

    _check(grid2d, step, "MultiheadAttention sp", (AXIS,))


# ---------------------------------------------------------------------------------------------- context parallel
def _qkv_step(
    q: Layout, kv: Layout, causal: bool, schedule: str, seen: dict[str, str]
) -> Callable[[hpctp.ProcessGrid, torch.device, torch.dtype], Run]:
    """Local. A step of :func:`attention` of queries laid out as ``q`` over keys and values as ``kv`` (their grid
    shape the step's grid's); ``seen[device type]`` records the schedule ``"auto"`` resolves to there
    (:func:`attention_schedule`)."""

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        dq = _dist(q, grid, device, dtype)
        dk, dv = _dist(kv, grid, device, dtype), _dist(kv, grid, device, dtype)
        seen[device.type] = attention_schedule(dq, dk, dv, causal=causal)
        return lambda: attention(dq, dk, dv, causal=causal, schedule=schedule).local.sum().backward()

    return step


def _same_schedule(grid: hpctp.ProcessGrid, seen: dict[str, str], what: str) -> None:
    """Collective over grid. ``"auto"`` chose one schedule, the same on the real grid and on its virtual twin."""
    got = [seen.get("cpu"), seen.get("meta")]
    ok = got[0] in ("ring", "all_to_all") and got[0] == got[1]
    assert_all(grid, ok, f"{what} on {grid.dims}: auto's schedule (real, virtual) = {got}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", ["ring", "all_to_all", "auto"])
def test_context_parallel_field(grid2d: hpctp.ProcessGrid, schedule: str, causal: bool) -> None:
    """A 7 x 6 patch field (uneven over 2, 3 and 4 rows) split over both grid axes: the ring, all-to-all and auto."""
    seen: dict[str, str] = {}
    lay = Layout((B, 2, 7, 6, 4), grid2d.dims, (None, None, 0, 1, None))
    what = f"attention {schedule} causal={causal}"
    _check(grid2d, _qkv_step(lay, lay, causal, schedule, seen), what, whole=True)
    _same_schedule(grid2d, seen, what)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", ["ring", "all_to_all", "auto"])
def test_context_parallel_sequence(grid1d: hpctp.ProcessGrid, schedule: str, causal: bool) -> None:
    """Cross-attention of 11 queries over 3 keys (uneven; an empty key block on 4 ranks) on a 1-D grid."""
    seen: dict[str, str] = {}
    q = Layout((B, 2, 11, 4), grid1d.dims, (None, None, 0, None))
    kv = Layout((B, 2, 3, 4), grid1d.dims, (None, None, 0, None))
    what = f"attention {schedule} causal={causal} sequence"
    _check(grid1d, _qkv_step(q, kv, causal, schedule, seen), what, whole=True)
    _same_schedule(grid1d, seen, what)


@pytest.mark.parametrize("schedule", ["ring", "all_to_all"])
def test_context_parallel_batch_and_tokens(grid2d: hpctp.ProcessGrid, schedule: str) -> None:
    """One sample over grid axis 0 (the rows past the first hold none: their empty messages skipped), 11 causal
    tokens over axis 1, keys and values of another head dim (6)."""
    seen: dict[str, str] = {}
    q = Layout((1, 2, 11, 4), grid2d.dims, (0, None, 1, None))
    kv = Layout((1, 2, 11, 6), grid2d.dims, (0, None, 1, None))

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        dq, dk, dv = _dist(q, grid, device, dtype), _dist(q, grid, device, dtype), _dist(kv, grid, device, dtype)
        seen[device.type] = attention_schedule(dq, dk, dv, causal=True)
        return lambda: attention(dq, dk, dv, causal=True, schedule=schedule).local.sum().backward()

    what = f"attention {schedule} batch and tokens"
    counts = same_messages(grid2d, step, what)
    _moved_on(grid2d, counts, (), grid2d.coords[0] == 0 and grid2d.dims[1] > 1, what)
    _same_schedule(grid2d, seen, what)


def test_context_parallel_auto_takes_either_schedule(grid1d: hpctp.ProcessGrid) -> None:
    """``"auto"`` on a short sequence (11 tokens: the ring) and a long causal one (256 tokens of 8 heads: the
    all-to-all, by the cost model) picks the same schedule on both grids and sends the same; on several ranks the
    two cases take the two schedules, so both of auto's paths are compared."""
    chosen = []
    for tokens, heads, causal in ((11, 2, False), (256, 8, True)):
        seen: dict[str, str] = {}
        lay = Layout((B, heads, tokens, 4), grid1d.dims, (None, None, 0, None))
        what = f"attention auto tokens={tokens} causal={causal}"
        _check(grid1d, _qkv_step(lay, lay, causal, "auto", seen), what, whole=True)
        _same_schedule(grid1d, seen, what)
        chosen.append(seen["cpu"])
    if grid1d.size > 1:
        assert_all(grid1d, chosen == ["ring", "all_to_all"], f"auto chose {chosen}: pick shapes that take each")


# ---------------------------------------------------------------------------------------------- fields
@pytest.mark.parametrize("periodic", [False, True])
def test_neighborhood_attention2d(grid2d: hpctp.ProcessGrid, periodic: bool) -> None:
    """A 3 x 3 window on an 8 x 7 field split over both axes: the halo fetch and its adjoint, the gradient sync."""

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        layer = NeighborhoodAttention2d(E, 2, 3, grid, periodic=periodic, seed=7, dtype=dtype, device=device)
        x = _dist(Layout((1, E, 8, 7), grid.dims, (None, None, 0, 1)), grid, device, dtype)
        return _train(layer, grid, lambda: layer(x))

    _check(grid2d, step, f"NeighborhoodAttention2d periodic={periodic}", whole=True)


@pytest.mark.parametrize("plain", [False, True])
def test_patch_embed_and_unpatch2d(grid2d: hpctp.ProcessGrid, plain: bool) -> None:
    """An 8 x 16 field in 2 x 2 patches and back, split over both axes on patch boundaries: no message but the
    gradient sync (and, for plain blocks, the small all-gather that infers the layout)."""

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        embed = PatchEmbed2d(3, E, 2, grid, seed=8, dtype=dtype, device=device)
        unpatch = Unpatch2d(E, 3, 2, grid, seed=9, dtype=dtype, device=device)
        model = torch.nn.Sequential(embed, unpatch)
        x = _dist(patch_aligned_layout(Layout((2, 3, 8, 16), grid.dims, (None, None, 0, 1)), 2), grid, device, dtype)
        return _train(model, grid, lambda: model(x.local if plain else x))

    _check(grid2d, step, f"PatchEmbed2d + Unpatch2d plain={plain}", whole=True)


def test_neighborhood_attention_and_patches3d(grid3d: hpctp.ProcessGrid) -> None:
    """An 8 x 8 x 8 field in 2 x 2 x 2 patches, a 3 x 3 x 3 window (periodic in depth) on the 4 x 4 x 4 tokens, and
    back, split over the three axes: the halo fetch and its adjoint, the gradient sync."""

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        model = torch.nn.Sequential(
            PatchEmbed3d(2, E, 2, grid, seed=13, **kw),
            NeighborhoodAttention3d(E, 2, 3, grid, periodic=(True, False, False), seed=14, **kw),
            Unpatch3d(E, 2, 2, grid, seed=15, **kw),
        )
        x = _dist(
            patch_aligned_layout(Layout((1, 2, 8, 8, 8), grid.dims, (None, None, 0, 1, 2)), 2), grid, device, dtype
        )
        return _train(model, grid, lambda: model(x))

    _check(grid3d, step, "PatchEmbed3d + NeighborhoodAttention3d + Unpatch3d", whole=True)


# ---------------------------------------------------------------------------------------------- blocks
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_transformer_block_sequence_parallel(grid2d: hpctp.ProcessGrid, norm: str) -> None:
    """Heads over grid axis 1, the 7 tokens over it (uneven, from the layout), the batch over the other axis;
    causal; LayerNorm or RMSNorm."""

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        block = TransformerBlock(
            E, HEADS, 1.5, grid, axis=AXIS, sequence_parallel=True, norm=norm, seed=10, dtype=dtype, device=device
        )
        x = _dist(Layout((3, 7, E), grid.dims, (0, AXIS, None)), grid, device, dtype)
        return _train(block, grid, lambda: block(x, is_causal=True))

    _check(grid2d, step, f"TransformerBlock sp norm={norm}", (AXIS,))


def test_transformer_block_sequence_parallel_plain(grid1d: hpctp.ProcessGrid) -> None:
    """Sequence parallelism on plain token blocks (even: their cuts are agreed by an all-gather, see the module
    docstring)."""

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        block = TransformerBlock(E, HEADS, 2.0, grid, sequence_parallel=True, seed=11, dtype=dtype, device=device)
        x = _x((B, T // grid.size, E), device, dtype)
        return _train(block, grid, lambda: block(x))

    _check(grid1d, step, "TransformerBlock sp plain", (0,))


@pytest.mark.parametrize(
    "schedule, sequence_parallel", [("ring", False), ("ring", True), ("all_to_all", True), ("auto", False)]
)
def test_transformer_block_context_parallel(grid2d: hpctp.ProcessGrid, schedule: str, sequence_parallel: bool) -> None:
    """Heads over grid axis 0, a 4 x 5 patch field's rows over axis 1 (and its columns over axis 0 with sequence
    parallelism): the ring or all-to-all over the token axis, the regions over the heads' (the grid shapes
    1 x P and P x 1 give each of them all the ranks)."""
    split = (None, 1, 0 if sequence_parallel else None, None)

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Run:
        block = TransformerBlock(
            E, HEADS, 1.5, grid, attention=schedule, sequence_parallel=sequence_parallel, seed=12, dtype=dtype,
            device=device,
        )  # fmt: skip
        x = _dist(Layout((2, 4, 5, E), grid.dims, split), grid, device, dtype)
        return _train(block, grid, lambda: block(x))

    what = f"TransformerBlock {schedule} sp={sequence_parallel}"
    _check(grid2d, step, what, (0,), grid2d.dims[1] > 1)
