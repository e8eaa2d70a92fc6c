"""A transformer split over heads and tokens: MultiheadAttention, TransformerBlock, sequence parallelism, ring attention.

    mpiexec -n 4 python examples/guide/transformer.py [OUTDIR]     (figure: OUTDIR/traffic.png)

On a 2 x 2 grid, grid axis 0 splits the heads (tensor parallelism) and grid axis 1 the batch or the
tokens. Every layer is checked against torch's own in one process (float64): output and input gradient.
"""

import sys
from pathlib import Path

import torch

import hpctp
import hpctp.nn
from hpctp import CommCounter

out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/guide")
grid = hpctp.ProcessGrid([0, 0])
say = print if grid.rank == 0 else (lambda *a, **k: None)
HEADS_AXIS, OTHER = 0, 1
B, T, E, H = 4, 16, 32, 4  # batch, tokens, embedding, heads
F64 = torch.float64
say(f"grid {grid.dims}: heads over grid axis {HEADS_AXIS}, batch or tokens over grid axis {OTHER}")


def scatter(X: torch.Tensor, split: tuple) -> hpctp.DistTensor:
    """Collective. ``X`` (the same on every rank) as a DistTensor cut by ``split``, its blocks requiring grad."""
    x = hpctp.distribute(X, grid, split)
    return x.with_local(x.local.requires_grad_())


def gathered(t: hpctp.DistTensor, grad: bool = False) -> torch.Tensor | None:
    """Collective. ``t`` (or its blocks' gradients) on rank 0."""
    return t.with_local(t.local.grad if grad else t.local.detach()).gather(root=0)


def torch_layer(block: hpctp.nn.TransformerBlock) -> torch.nn.TransformerEncoderLayer:
    """Collective. torch's layer with ``block``'s weights (global_state_dict: torch's names)."""
    ref = torch.nn.TransformerEncoderLayer(
        E, H, 2 * E, dropout=0.0, activation="gelu", batch_first=True, norm_first=True, dtype=F64
    )
    ref.load_state_dict(hpctp.nn.global_state_dict(block))
    return ref


def check(name: str, layer: torch.nn.Module, X: torch.Tensor, split: tuple, reference) -> dict:  # noqa: ANN001
    """Collective. Forward + backward of ``layer`` on ``X`` cut by ``split``, against ``reference`` (one process)."""
    x = scatter(X, split)
    layer(x).local.sum().backward()  # the first call agrees on the layout once; the next ones send only data
    x = scatter(X, split)
    with CommCounter() as fwd:
        y = layer(x)
    with CommCounter() as bwd:
        y.local.sum().backward()
    yg, gg = gathered(y), gathered(x, grad=True)
    if grid.rank == 0:
        xr = X.clone().requires_grad_()
        yr = reference(xr)
        yr.sum().backward()
        rel = lambda got, want: float((got - want).abs().max() / want.abs().max())  # noqa: E731
        err = max(rel(yg, yr.detach()), rel(gg, xr.grad))
        print(f"\n{name}\n  input block on rank 0: {tuple(x.local.shape)} of {tuple(X.shape)}")
        print(f"  forward  messages: {fwd.calls}")
        print(f"  backward messages: {bwd.calls}")
        print(f"  max rel. error of output and input gradient vs torch: {err:.1e}")
    whole = X.numel() * X.element_size()
    return {"sent": (fwd.bytes_sent + bwd.bytes_sent) / whole, "held": x.local.numel() / X.numel()}


results = {}
X = torch.randn(B, T, E, generator=torch.Generator().manual_seed(0), dtype=F64)

# --- 1. MultiheadAttention: whole heads per rank of axis 0; the batch over axis 1 (data parallel)
mha = hpctp.nn.MultiheadAttention(E, H, grid, axis=HEADS_AXIS, seed=1, dtype=F64)
ref_mha = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=F64)
ref_mha.load_state_dict(hpctp.nn.global_state_dict(mha))
say(f"MultiheadAttention: rank 0 holds in_proj_weight {tuple(mha.in_proj_weight.shape)} of (3, {E}, {E})")
results["attention, heads split"] = check(
    "MultiheadAttention, heads over axis 0, batch over axis 1",
    lambda x: mha(x, x, x)[0], X, (OTHER, None, None), lambda x: ref_mha(x, x, x, need_weights=False)[0],
)  # fmt: skip

# --- 2. TransformerBlock: the same split; then with sequence parallelism (tokens over the heads' axis too)
block = hpctp.nn.TransformerBlock(E, H, 2.0, grid, axis=HEADS_AXIS, seed=2, dtype=F64)
results["block"] = check("TransformerBlock", block, X, (OTHER, None, None), torch_layer(block))
sp = hpctp.nn.TransformerBlock(E, H, 2.0, grid, axis=HEADS_AXIS, sequence_parallel=True, seed=2, dtype=F64)
results["block, sequence parallel"] = check(
    "TransformerBlock, sequence parallel: tokens over axis 0 between the regions",
    sp, X, (OTHER, HEADS_AXIS, None), torch_layer(sp),
)  # fmt: skip

# --- 3. ring attention inside the block: a field of 8 x 8 patch tokens, its rows over axis 1
F = torch.randn(2, 8, 8, E, generator=torch.Generator().manual_seed(3), dtype=F64)
ring = hpctp.nn.TransformerBlock(E, H, 2.0, grid, axis=HEADS_AXIS, attention="ring", seed=4, dtype=F64)
ref_ring = torch_layer(ring)
results["ring over token rows"] = check(
    "TransformerBlock, attention='ring': 8 x 8 tokens, rows over axis 1, every token attends to all 64",
    ring, F, (None, OTHER, None, None), lambda f: ref_ring(f.flatten(1, 2)).reshape(f.shape),
)  # fmt: skip
ring_sp = hpctp.nn.TransformerBlock(
    E, H, 2.0, grid, axis=HEADS_AXIS, attention="ring", sequence_parallel=True, seed=4, dtype=F64
)
results["ring + sequence parallel"] = check(
    "the same with sequence parallelism: rows over axis 1, columns over axis 0",
    ring_sp, F, (None, OTHER, HEADS_AXIS, None), lambda f: ref_ring(f.flatten(1, 2)).reshape(f.shape),
)  # fmt: skip

# --- 4. the attention function itself: tokens of a 16 x 16 field split over both grid axes
field = (None, None, 0, 1, None)  # [batch, heads, rows, columns, head_dim]: rows over axis 0, columns over axis 1
q, k, v = [hpctp.random.normal((1, H, 16, 16, 8), grid, field, seed=s).to("torch") for s in (5, 6, 7)]
chosen = hpctp.nn.attention_schedule(q, k, v)  # hpctp.perf's cost model picks ring or all-to-all
o = {s: hpctp.nn.functional.attention(q, k, v, schedule=s) for s in ("ring", "all_to_all")}
og, qg, kg, vg = [t.gather(root=0) for t in (o["ring"], q, k, v)]
oa = o["all_to_all"].gather(root=0)
if grid.rank == 0:
    want = torch.nn.functional.scaled_dot_product_attention(qg.flatten(2, 3), kg.flatten(2, 3), vg.flatten(2, 3))
    want = want.reshape(og.shape)
    print(f"\nhpctp.nn.functional.attention, 256 tokens over both axes: auto schedule picks {chosen!r}")
    for name, got in (("ring", og), ("all_to_all", oa)):
        error = float((got - want).abs().max() / want.abs().max())
        print(f"  {name:10s} max rel. error vs scaled_dot_product_attention: {error:.1e}")

    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    axes[0].barh(names, [results[n]["held"] for n in names], color="tab:green")
    axes[0].set_xlabel("activations held by rank 0 / the whole input")
    axes[1].barh(names, [results[n]["sent"] for n in names], color="tab:blue")
    axes[1].set_xlabel("bytes sent by rank 0 (forward + backward) / the input's")
    axes[1].set_yticks([])
    for ax in axes:
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "traffic.png", dpi=100)
grid.free()
