"""Performance models and the planner: what a training step costs in time and memory on a grid, and the best plan.

* :func:`plan` (:mod:`hpctp.perf.plan`): the grid, the roles of its axes, the ZeRO stage, recomputation and
  the pipeline schedule that train a model fastest within a memory budget, predicted without trial runs;
* :func:`trace` (:mod:`hpctp.perf.workload`): what one step of a model holds and computes, from a forward and
  backward on the meta device;
* :class:`MachineProfile` (:mod:`hpctp.perf.machine`): compute rates and message costs, read from machine
  files (:func:`load_machine`; published profiles: :func:`published_machines`) or measured by
  :func:`calibrate`;
* what each layer sends on a plan's grid, read off the layer's own code run on a virtual grid
  (:mod:`hpctp.perf.dryrun`), and the alpha-beta-gamma models of SUMMA and
  of the attention schedules (:mod:`hpctp.linalg.cost`, re-exported here), which the planner prices with.
"""

from ..linalg.cost import (
    SCHEDULES,
    AttentionCost,
    Machine,
    MatmulCost,
    bcast_time,
    choose_schedule,
    matmul_flops,
    matmul_traffic,
    predict_attention,
    predict_matmul,
    recommend_grid,
    recommend_panel,
    reduce_time,
    stationary_c_words,
)
from .calibration import calibrate
from .layers import Message, Site
from .machine import ComputeRates, Link, MachineProfile, collective_time, load_machine, published_machines
from .model import Candidate, MemoryBreakdown, Prediction, TimeBreakdown
from .planner import PlanError, PlanReport, parse_bytes, plan
from .workload import Sample, Workload, trace

__all__ = [
    # linalg.cost: SUMMA and attention schedules
    "SCHEDULES",
    "AttentionCost",
    "Machine",
    "MatmulCost",
    "bcast_time",
    "choose_schedule",
    "matmul_flops",
    "matmul_traffic",
    "predict_attention",
    "predict_matmul",
    "recommend_grid",
    "recommend_panel",
    "reduce_time",
    "stationary_c_words",
    # machine.py
    "ComputeRates",
    "Link",
    "MachineProfile",
    "collective_time",
    "load_machine",
    "published_machines",
    # calibrate.py
    "calibrate",
    # trace.py
    "Sample",
    "Workload",
    "trace",
    # layers.py
    "Message",
    "Site",
    # model.py
    "Candidate",
    "MemoryBreakdown",
    "Prediction",
    "TimeBreakdown",
    # plan.py
    "PlanError",
    "PlanReport",
    "parse_bytes",
    "plan",
]
