"""Block-level distributed operations: functions of (local block, grid, layout).

They return local blocks (and layouts), never :class:`~hpctp.DistTensor` objects, so
the tensor class can build on them without import cycles.
"""
