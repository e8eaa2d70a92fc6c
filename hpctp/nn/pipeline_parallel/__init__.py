"""Pipeline parallelism: the model cut into stages by layers, micro-batches flowing through them.

The planning half is pure (no torch, no MPI; import-linter's ``pipeline-planning`` contract keeps it
so), one concept per module: the IR of actions (``_actions.py``), the schedules and their builders
(``schedules.py``), the lowering pass that adds the messages (``_lowering.py``), the validator
(``_validate.py``), the dry-run simulator (``_simulate.py``) and the stage balancer (``_balance.py``).
A schedule is computed once by :func:`pipeline_schedule`, the same on every rank, and validated; the
runtime (:class:`PipelineParallel`, ``runtime.py``: messages in ``_messages.py``, the zero-bubble split of
backward: the linear layers' weight products deferred (``hpctp/nn/_deferred_weights.py``), any other graph walked in
``_split_backward.py``) executes :meth:`Schedule.actions` of its rank in order.
"""

from ._actions import Action, ActionKind, format_table
from ._balance import balanced_cuts
from ._lowering import add_messages, strip_messages
from ._simulate import Span, Timeline, simulate
from ._validate import validate
from .runtime import RECEIVE_AHEAD, PipelineParallel
from .schedules import SCHEDULES, Schedule, pipeline_schedule

__all__ = [
    # _actions.py
    "Action",
    "ActionKind",
    "format_table",
    # schedules.py
    "SCHEDULES",
    "Schedule",
    "pipeline_schedule",
    # _lowering.py
    "add_messages",
    "strip_messages",
    # _validate.py
    "validate",
    # _simulate.py
    "Span",
    "Timeline",
    "simulate",
    # _balance.py
    "balanced_cuts",
    # runtime.py
    "PipelineParallel",
    "RECEIVE_AHEAD",
]
