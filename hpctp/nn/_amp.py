"""Mixed precision: what the layers do under :func:`torch.autocast`.

Under autocast a layer computes in the autocast dtype (bfloat16, float16) while its parameters
stay float32, as torch's own layers do. The partitioned layers cast their input once, *before*
any message (so halos and gathered activations travel in the low precision, half the bytes of
float32), and let torch's autocast cast the parameters inside the local ops. Reductions stay
in float32: the comm layer sums bfloat16 in float32 (:func:`hpctp.comm.allreduce`), the norms
keep their statistics in float32 and the Fourier layers and the ring attention's softmax
statistics run in float32 with autocast switched off.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["autocast_dtype", "autocast_input", "autocast_off"]


def _autocast_state(device: str) -> tuple[bool, torch.dtype | None]:
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4: one API for every device type
        try:
            if not torch.is_autocast_enabled(device):
                return False, None
            return True, torch.get_autocast_dtype(device)
        except RuntimeError:  # a device type without autocast
            return False, None
    if device == "cpu":  # pragma: no cover (torch < 2.4)
        return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    if device == "cuda":  # pragma: no cover
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return False, None  # pragma: no cover


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Local. The dtype autocast computes ``x``'s ops in, or None when autocast leaves ``x`` alone.

    None unless autocast is enabled for ``x``'s device type and ``x`` is a floating tensor
    autocast casts (float32, float16, bfloat16: not float64, as torch).

    Parameters
    ----------
    x : torch.Tensor

    Returns
    -------
    torch.dtype or None
    """
    if not x.is_floating_point() or x.dtype == torch.float64:
        return None
    enabled, dtype = _autocast_state(x.device.type)
    return dtype if enabled else None


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """Local. ``x`` in the autocast dtype when autocast is on for it (differentiable), else ``x`` itself.

    Parameters
    ----------
    x : torch.Tensor

    Returns
    -------
    torch.Tensor
    """
    dtype = autocast_dtype(x)
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


def autocast_off(x: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """Local. A context in which autocast is disabled for ``x``'s device type (a no-op context when it is off).

    Parameters
    ----------
    x : torch.Tensor

    Returns
    -------
    context manager
    """
    if _autocast_state(x.device.type)[0]:
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()
