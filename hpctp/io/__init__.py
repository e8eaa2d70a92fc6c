"""HDF5 pipelines: distributed load/save, training-sample datasets and grid-independent checkpoints.

Each rank reads and writes only its own hyperslab. With an MPI-enabled h5py the MPI-IO
driver is used by ``load_hdf5``, ``save_hdf5`` and the checkpoints (compressed datasets are
still written in turns); otherwise every rank opens the file itself and writes take turns.
``FieldDataset`` always reads through per-rank handles (no MPI calls in its prefetch thread). Saves
are atomic (temporary file + rename): a failed or interrupted save never damages an
existing file.
"""

from ._files import mpio_available
from .checkpoint import load_checkpoint, save_checkpoint
from .counter import IOCounter
from .dataset import FieldDataset
from .hdf5 import load_hdf5, save_hdf5
from .loader import FieldLoader

__all__ = [
    "FieldDataset",
    "FieldLoader",
    "IOCounter",
    "load_checkpoint",
    "load_hdf5",
    "mpio_available",
    "save_checkpoint",
    "save_hdf5",
]
