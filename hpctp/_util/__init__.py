"""Utilities under every layer: integer checks, dtype names, and the array backends (numpy, torch,
cupy) as seen from a block. No MPI, no DistTensor."""
