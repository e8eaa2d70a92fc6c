"""HDF5 pipelines: distributed load/save, training-sample datasets and grid-independent checkpoints.

Each rank reads and writes only its own hyperslab. With an MPI-enabled h5py the MPI-IO
driver is used by ``load_hdf5``, ``save_hdf5`` and the checkpoints (compressed datasets are
still written in turns); otherwise every rank opens the file itself and writes take turns.
``FieldDataset`` always reads through per-rank handles (no MPI calls in its prefetch thread). Saves
are atomic (temporary file + rename): a failed or interrupted save never damages an
existing file.

Online training reads no file: :class:`Stream` carries a running simulation's blocks into a trainer's
replay buffer (co-located, or from a group of simulation ranks to a group of trainer ranks), with
the pure, seeded decisions of :class:`ReplayPlan` and :class:`TrainingSchedule`.
"""

from ._files import mpio_available
from .checkpoint import load_checkpoint, save_checkpoint
from .counter import IOCounter
from .dataset import FieldDataset
from .hdf5 import load_hdf5, save_hdf5
from .loader import FieldLoader
from .replay import ReplayPlan, TrainingSchedule
from .stream import Stream, StreamConfig, StreamStats

__all__ = [
    "FieldDataset",
    "FieldLoader",
    "IOCounter",
    "ReplayPlan",
    "Stream",
    "StreamConfig",
    "StreamStats",
    "TrainingSchedule",
    "load_checkpoint",
    "load_hdf5",
    "mpio_available",
    "save_checkpoint",
    "save_hdf5",
]
