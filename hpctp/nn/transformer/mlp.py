"""The tensor-parallel MLP of a transformer: column-parallel, activation, row-parallel (Megatron).

``linear1`` (:class:`~hpctp.nn.ColumnParallelLinear`, ``embed -> hidden``) splits the hidden
features over grid ``axis``; the activation is elementwise on each rank's hidden block;
``linear2`` (:class:`~hpctp.nn.RowParallelLinear`, ``hidden -> embed``) multiplies that block
by its columns, and one all-reduce over the axis sums the partial outputs (one all-reduce
of the input gradient backward). With sequence parallelism the input and output are
token blocks: an all-gather enters, a reduce-scatter leaves (see
:mod:`hpctp.nn.transformer.sequence_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._util.ints import is_int
from ...comm import ProcessGrid, check_grid
from .._amp import autocast_dtype, autocast_input
from ..init import derive_seed
from .agreement import ArgumentAgreement
from .linear import ColumnParallelLinear, RowParallelLinear
from .sequence_parallel import enter_parallel_region, leave_parallel_region
from .sequence_parallel import token_cuts as agree_token_cuts

__all__ = ["ParallelMLP", "ACTIVATIONS", "activation_function"]

F = torch.nn.functional

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "tanh": torch.tanh,
}


def activation_function(
    activation: str | Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Local. The elementwise function named ``activation`` (a key of :data:`ACTIVATIONS`), or the callable itself.

    Raises
    ------
    ValueError
        On an unknown name.
    """
    if callable(activation):
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be a callable or one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation]


class ParallelMLP(torch.nn.Module):
    """Local. ``linear2(activation(linear1(x)))`` with the hidden features split over ``axis``.

    Gathered, the parameters are those of ``torch.nn.Linear(embed_dim, hidden)`` (``linear1``)
    and ``torch.nn.Linear(hidden, embed_dim)`` (``linear2``), initialised as torch's
    distributions with grid-independent values for a ``seed``. Every gradient is complete
    along ``axis`` after backward (``hpctp_grad_reduced``), except ``linear2.bias`` with
    sequence parallelism (partial over token blocks; :func:`hpctp.nn.sync_gradients` sums it).

    Parameters
    ----------
    embed_dim : int
    hidden : int
        Hidden features (any count: balanced cuts over the axis, a rank may hold none).
    grid : ProcessGrid
    axis : int
        Grid axis splitting the hidden features.
    activation : str or callable
        ``"gelu"`` (exact, torch's default), ``"gelu_tanh"``, ``"relu"``, ``"silu"``, ``"tanh"``,
        or an elementwise function.
    bias : bool
    sequence_parallel : bool
        Input and output are ``[batch, tokens_local, embed]`` token blocks (dim 1) of the
        ranks of ``axis``.
    seed : int
    dtype : torch.dtype
    device : torch.device or str, optional

    Raises
    ------
    TypeError
        If ``grid`` is not a ProcessGrid.
    ValueError
        On non-positive sizes, a bad ``axis`` or an unknown ``activation``.
    """

    def __init__(
        self, embed_dim: int, hidden: int, grid: ProcessGrid, *, axis: int = 0,
        activation: str | Callable[[torch.Tensor], torch.Tensor] = "gelu", bias: bool = True,
        sequence_parallel: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.grid = check_grid(grid)
        if not is_int(hidden) or hidden < 1:
            raise ValueError(f"hidden must be a positive int, got {hidden!r}")
        self.act = activation_function(activation)
        self.activation = activation if isinstance(activation, str) else getattr(activation, "__name__", "callable")
        kw: dict[str, Any] = {"axis": axis, "bias": bias, "dtype": dtype, "device": device}
        self.linear1 = ColumnParallelLinear(embed_dim, hidden, grid, seed=derive_seed(seed, 1), **kw)
        self.linear2 = RowParallelLinear(hidden, embed_dim, grid, seed=derive_seed(seed, 2), **kw)
        self.axis, self.embed_dim, self.hidden = self.linear1.axis, int(embed_dim), int(hidden)
        self.sequence_parallel = bool(sequence_parallel)
        if self.sequence_parallel and self.linear2.bias is not None:
            self.linear2.bias.hpctp_grad_reduced = ()  # type: ignore[attr-defined]
        self._agreed = ArgumentAgreement()

    def _check(self, x: object) -> tuple[Exception | None, tuple[Any, ...]]:
        w = self.linear1.weight
        if not isinstance(x, torch.Tensor):
            return TypeError(f"ParallelMLP: input must be a torch.Tensor, got {type(x).__name__}"), ("invalid",)
        if self.sequence_parallel and x.ndim != 3:
            return ValueError(
                f"ParallelMLP: with sequence_parallel the input is [batch, tokens_local, {self.embed_dim}], "
                f"got shape {tuple(x.shape)}"
            ), ("invalid",)
        if x.ndim < 1 or x.shape[-1] != self.embed_dim:
            return ValueError(f"ParallelMLP: input's last dim must be {self.embed_dim}, got shape {tuple(x.shape)}"), (
                "invalid",
            )
        if (x.dtype != w.dtype and autocast_dtype(x) is None) or x.device != w.device:  # (autocast casts)
            return TypeError(f"ParallelMLP: input is {x.dtype} on {x.device}, the weights {w.dtype} on {w.device}"), (
                "invalid",
            )
        shape = (x.shape[0], x.shape[2]) if self.sequence_parallel else tuple(x.shape)
        return None, (shape, str(x.dtype), x.device.type)

    def agree(self, x: Any) -> tuple[int, ...] | None:
        """Collective over the ranks of ``axis``. Validate the input on every rank of the axis.

        Returns
        -------
        tuple of int or None
            The token cuts with sequence parallelism (one small ``Allgather`` per call), else
            None (the verdict cached per input shape).

        Raises
        ------
        TypeError, ValueError
            On an invalid input, on every rank of the axis.
        """
        comm = self.grid.sub(self.axis)
        error, signature = self._check(x)
        if not self.sequence_parallel:
            self._agreed.check(comm, "ParallelMLP", signature, error)
            return None
        return agree_token_cuts(comm, (0,) if error else (x.shape[1],), "ParallelMLP", signature, error)[0]

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        """Local. The partial output of this rank's hidden block on the whole input (no ``linear2`` bias)."""
        return self.linear2.partial_forward(self.act(self.linear1.local_forward(x)))

    def forward(self, x: torch.Tensor, *, token_cuts: Sequence[int] | None = None) -> torch.Tensor:
        """Collective over the ranks of ``axis``. ``[..., E] -> [..., E]``.

        Parameters
        ----------
        x : torch.Tensor
            The same on every rank of ``axis``, or with sequence parallelism this rank's
            token block ``[batch, tokens_local, E]``.
        token_cuts : sequence of int, optional
            With sequence parallelism, the token cuts over ``axis`` when the caller already
            agreed on them; skips the exchange.

        Returns
        -------
        torch.Tensor
            Replicated along ``axis`` (or this rank's token block).

        Raises
        ------
        TypeError, ValueError
            On an invalid input, on every rank of ``axis``.
        """
        cuts = tuple(token_cuts) if token_cuts is not None and self.sequence_parallel else self.agree(x)
        return self.forward_agreed(x, cuts)

    def forward_agreed(self, x: torch.Tensor, cuts: tuple[int, ...] | None) -> torch.Tensor:
        """Collective over the ranks of ``axis``. :meth:`forward` on an input :meth:`agree` accepted and
        returned ``cuts`` for (the token cuts, or None), without validating it again.

        Parameters
        ----------
        x : torch.Tensor
            As for :meth:`forward`.
        cuts : tuple of int or None
            What :meth:`agree` returned for ``x`` (with sequence parallelism: the token cuts over
            ``axis``, e.g. of flattened token blocks).

        Returns
        -------
        torch.Tensor
            As :meth:`forward`.
        """
        comm = self.grid.sub(self.axis)
        x = autocast_input(x)  # (autocast: the gathered tokens travel in its dtype)
        y = leave_parallel_region(self.inner(enter_parallel_region(x, comm, cuts)), comm, cuts)
        return y + self.linear2.bias.to(y.dtype) if self.linear2.bias is not None else y

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, sequence_parallel={self.sequence_parallel}"
