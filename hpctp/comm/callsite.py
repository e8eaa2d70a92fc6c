"""Where an MPI call of hpctp comes from: the hpctp operation that issued it and the user's line.

The flight recorder (:mod:`hpctp.comm.trace`) labels each entry in the library's words, derived
from the Python stack when the call is recorded (only while tracing is on):

* the *layer*: the innermost frame whose ``self`` is a ``torch.nn.Module`` gives the module's
  class and the method (``Conv2d.forward``, also when the method is a mixin's); in backward,
  where autograd leaves no module frame, the innermost ``forward``/``backward`` of an autograd
  Function (first argument ``ctx``) gives its qualified name;
* the *operation*: the innermost :func:`label` in force (a caller that knows more: the layouts
  of a redistribution), else the ``trace_label`` attribute of an object whose method is on the
  stack (a bucket of gradients: ``"ShardedDataParallel bucket 3"``, which then stands alone when it
  starts with the layer's class), else the innermost hpctp
  frame outside :mod:`hpctp.comm` (``halo`` for :mod:`hpctp.halo`, ``redistribute`` for
  ``redistribute_block``, else that function's qualified name);
* the *call site*: ``file:line`` of the first frame outside hpctp and outside the libraries
  hpctp runs on (torch's module and autograd machinery, numpy, mpi4py, the standard library),
  i.e. the line of the user's program.

Cost: the walk stops at the user's frame (about ten frames from a layer); each code object is
classified once (a dict lookup after that), and sites are cached per ``(code, line)``, so a
recorded call costs about a microsecond. Nothing here runs while tracing is off, except
:func:`label`, which then returns a shared no-op context manager.
"""

from __future__ import annotations

import contextlib
import math
import sys
from types import CodeType, FrameType
from typing import Any

__all__ = ["Label", "is_user", "label", "user_site", "where"]

_LIBRARIES = frozenset(
    {
        "torch", "numpy", "mpi4py", "cupy", "h5py", "contextlib", "functools", "threading", "runpy",
        "importlib", "asyncio", "concurrent", "weakref", "abc", "typing",
    }
)  # fmt: skip
"""Top-level packages whose frames are neither the hpctp operation nor the user's call site."""

_ROOM_TEXT = {"hpctp.halo": "halo"}
"""Modules whose operation has one name, whichever of their functions is innermost."""

_NULL = contextlib.nullcontext()

# per code object: (kind, text, layer, label_owner); layer: 0 none, 1 a module's method, 2 an autograd Function's
_USER, _ROOM, _SKIP = 0, 1, 2
_MODULE, _FUNCTION = 1, 2
_codes: dict[CodeType, tuple[int, str, int, bool]] = {}
_sites: dict[tuple[CodeType, int], str] = {}
_labels: list[Label] = []

# set by hpctp.comm.trace while tracing is on (label() returns _NULL otherwise)
_enabled = False


class Label:
    """Local. An explicit label in force (see :func:`label`); formats its text only when a call is recorded."""

    __slots__ = ("_text", "_args", "_block", "_rendered")

    def __init__(self, text: str, args: tuple[Any, ...], block: Any) -> None:
        self._text = text
        self._args = args
        self._block = block
        self._rendered: str | None = None

    @property
    def text(self) -> str:
        """The label, formatted with its arguments (``str.format``) the first time it is read."""
        if self._rendered is None:
            self._rendered = self._text.format(*self._args) if self._args else self._text
        return self._rendered

    @property
    def block(self) -> int:
        """Elements of the block the operation works on (-1: not given)."""
        b = self._block
        if b is None:
            return -1
        if isinstance(b, int):
            return b
        return int(math.prod(tuple(b.shape)))

    def __enter__(self) -> Label:
        _labels.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _labels.pop()


def label(text: str, *args: Any, block: Any = None) -> contextlib.AbstractContextManager[Any]:
    """Local. Name the MPI calls made inside a ``with`` block, for the flight recorder.

    Use it where hpctp knows more than the stack tells: ``with label("redistribute {}->{}", src.split,
    dst.split):``. While tracing is off it returns a shared no-op context manager (a call and a
    branch); the text is formatted only when a call is recorded under it.

    Parameters
    ----------
    text : str
        The operation (``str.format`` template of ``args``).
    *args
        Formatted into ``text`` when the label is first needed.
    block : array or int, optional
        The local block the operation works on (or its element count): ``hpctp trace summarize``
        compares it across ranks to explain an imbalance.

    Returns
    -------
    context manager
    """
    if not _enabled:
        return _NULL
    return Label(text, args, block)


def _module_of(frame: FrameType) -> str:
    name = frame.f_globals.get("__name__", "")
    return name if isinstance(name, str) else ""


def _room_text(module: str, code: CodeType) -> str:
    for prefix, text in _ROOM_TEXT.items():
        if module == prefix or module.startswith(prefix + "."):
            return text
    name = code.co_qualname.lstrip("_")
    return name.removesuffix("_block")


def _classify(frame: FrameType) -> tuple[int, str, int, bool]:
    """The kind of ``frame``'s code (user, hpctp room, skipped) and its layer/owner flags, cached per code."""
    code = frame.f_code
    module = _module_of(frame)
    top = module.split(".", 1)[0]
    if module == "hpctp.comm" or module.startswith("hpctp.comm."):
        info = (_SKIP, "", 0, False)
    elif top in _LIBRARIES or (top.startswith("_") and top != "__main__"):
        info = (_SKIP, "", 0, False)
    else:
        kind = _ROOM if top == "hpctp" else _USER
        text = _room_text(module, code) if kind == _ROOM else ""
        layer = 0
        owner = False
        first = code.co_varnames[0] if code.co_argcount and code.co_varnames else ""
        if first == "self":
            try:
                obj = frame.f_locals.get("self")
            except Exception:  # noqa: BLE001 - a frame we cannot read is no layer
                obj = None
            torch = sys.modules.get("torch")
            layer = _MODULE if torch is not None and isinstance(obj, torch.nn.Module) else 0
            owner = obj is not None and isinstance(getattr(obj, "trace_label", None), str)
        elif first == "ctx" and code.co_name in ("forward", "backward"):
            layer = _FUNCTION  # an autograd Function: the layer's name in backward
        info = (kind, text, layer, owner)
    _codes[code] = info
    return info


def where(depth: int = 2) -> tuple[str, str, int]:
    """Local. ``(label, call site, block elements)`` of the MPI call being recorded.

    Parameters
    ----------
    depth : int
        Frames to skip above this function's caller's caller (the recorder's own frames).

    Returns
    -------
    tuple of (str, str, int)
        The label (``"Conv2d.forward halo"``; ``""`` when nothing is known), the user's
        ``"file:line"`` (``""`` when no frame is outside hpctp), the block elements (-1: unknown).
    """
    frame: FrameType | None = sys._getframe(depth)
    layer = function = operation = owner = ""
    site = ""
    while frame is not None:
        code = frame.f_code
        info = _codes.get(code) or _classify(frame)
        kind = info[0]
        if kind != _SKIP:
            if info[2] == _MODULE and not layer:
                layer = f"{type(frame.f_locals.get('self')).__name__}.{code.co_name}"
            elif info[2] == _FUNCTION and not function:
                function = code.co_qualname
            if info[3] and not owner:
                owner = str(getattr(frame.f_locals.get("self"), "trace_label", ""))
            if kind == _ROOM:
                if not operation:
                    operation = info[1]
            else:
                line = frame.f_lineno or 0
                site = _sites.get((code, line)) or _site(code, line)
                break
        frame = frame.f_back
    layer = layer or function  # (a module's name where there is one; an autograd Function's in backward)
    block = -1
    if _labels:
        explicit = _labels[-1]
        operation = explicit.text
        block = explicit.block
    elif owner:
        operation = owner
    if layer and operation and not operation.startswith(layer.split(".")[0]):  # ("ShardedDataParallel bucket 3")
        return f"{layer} {operation}", site, block
    return layer or operation, site, block


def _site(code: CodeType, line: int) -> str:
    text = f"{code.co_filename}:{line}"
    _sites[(code, line)] = text
    return text


def is_user(frame: FrameType) -> bool:
    """Local. Whether ``frame`` is the user's code (outside hpctp and the libraries it runs on)."""
    info = _codes.get(frame.f_code) or _classify(frame)
    return info[0] == _USER


def user_site(frame: FrameType | None) -> str:
    """Local. ``"file:line"`` of the innermost user frame at or above ``frame`` ("" if none)."""
    while frame is not None:
        if is_user(frame):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return ""
