"""Every MPI tag hpctp's point-to-point messages use, in one table, so that no two streams can clash.

A tag names a stream of messages between two ranks on one communicator; MPI matches messages of one
tag in the order they were sent, so a stream needs no sequence numbers, only its own tag. The
flight recorder (:mod:`hpctp.comm.trace`) names a message by its tag (:data:`NAMES`).
"""

from __future__ import annotations

__all__ = [
    "HALO",
    "HALO_ADJOINT",
    "NAMES",
    "PIPELINE_ACTIVATION",
    "PIPELINE_GRADIENT",
    "PIPELINE_META",
    "RING",
    "RING_GRAD",
    "STREAM_ACK",
    "STREAM_CREDIT",
    "STREAM_DATA",
    "STREAM_HEADER",
    "TURN",
]

HALO = 0x4A10
"""Halo fetches (:mod:`hpctp.halo.run`)."""
HALO_ADJOINT = 0x4A11
"""Their adjoint: ghost gradients sent back to the owners."""
RING = 0x4A20
"""Ring attention's key/value pieces (:mod:`hpctp.nn.transformer.context_parallel`)."""
RING_GRAD = 0x4A21
"""Ring attention's dK/dV pieces coming home in backward."""
TURN = 0x4844
"""The token of serialised HDF5 writes (:mod:`hpctp.comm.io_calls`)."""
PIPELINE_ACTIVATION = 0x5046
"""Activations from a pipeline stage to the next (:mod:`hpctp.nn.pipeline_parallel`)."""
PIPELINE_GRADIENT = 0x5047
"""Their gradients, back to the previous stage."""
PIPELINE_META = 0x5048
"""The shapes and layouts of a stage boundary's activations, agreed once per input signature."""
STREAM_DATA = 0x5354
"""Online training: a snapshot's pieces from simulation ranks to trainer ranks (:mod:`hpctp.io.stream`)."""
STREAM_HEADER = 0x5355
"""Its header (number, produced and dropped counts), from the simulation's first rank to the trainer's."""
STREAM_CREDIT = 0x5356
"""A credit back: the trainer took a snapshot into its buffer (the simulation may send another)."""
STREAM_ACK = 0x5357
"""The trainer's answer to the end of the stream: the number of credits it sent."""

NAMES = {
    HALO: "halo", HALO_ADJOINT: "halo adjoint", RING: "ring", RING_GRAD: "ring gradient", TURN: "IO turn",
    PIPELINE_ACTIVATION: "pipeline activation", PIPELINE_GRADIENT: "pipeline gradient", PIPELINE_META: "pipeline meta",
    STREAM_DATA: "stream data", STREAM_HEADER: "stream header", STREAM_CREDIT: "stream credit",
    STREAM_ACK: "stream end ack",
}  # fmt: skip
