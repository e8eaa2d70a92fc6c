"""Integer arguments: one rule for what counts as an int (Python or numpy integer, never a bool)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # narrows both branches for mypy; nothing imported at run time
    from typing_extensions import TypeIs

__all__ = ["is_int", "as_int", "positive_ints"]


def is_int(value: object) -> TypeIs[int | np.integer]:
    """Local. True for a Python ``int`` or a numpy integer scalar; ``bool`` is not an int here.

    Parameters
    ----------
    value : object
        Anything.

    Returns
    -------
    bool
        Whether ``value`` may be used as an integer argument (sizes, axes, ranks, seeds).
    """
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_int(value: object, name: str, minimum: int | None = None) -> int:
    """Local. ``value`` as a Python ``int``, refusing floats, strings and bools instead of truncating.

    Parameters
    ----------
    value : object
        The argument to check.
    name : str
        The argument's name, used in the error message.
    minimum : int, optional
        Smallest allowed value.

    Returns
    -------
    int
        ``int(value)``.

    Raises
    ------
    TypeError
        If ``value`` is not an int (see :func:`is_int`).
    ValueError
        If ``value < minimum``.
    """
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    out = int(value)
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def positive_ints(**values: object) -> tuple[int, ...]:
    """Local. Each keyword's value as a Python ``int``, checking that it is an int of at least 1 (layer sizes).

    Parameters
    ----------
    **values : object
        Argument name -> value, checked in order.

    Returns
    -------
    tuple of int
        The values, in the order given.

    Raises
    ------
    ValueError
        Naming the first argument that is not an int >= 1.
    """
    for name, v in values.items():
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    return tuple(int(v) for v in values.values())  # type: ignore[call-overload]
