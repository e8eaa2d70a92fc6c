"""Counting argument agreements: which calls a layer agrees on, and how often (cached verdicts)."""

from __future__ import annotations

from typing import Any

import pytest

import hpctp


def count_agreements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Local. Record the ``what`` of every ``hpctp.comm.agree_arguments`` call from now on (the list
    returned grows as calls happen); the real agreement still runs."""
    calls: list[str] = []
    real = hpctp.comm.agree_arguments

    def counting(*args: Any, **kwargs: Any) -> None:
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(hpctp.comm, "agree_arguments", counting)
    return calls
