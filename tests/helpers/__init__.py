"""Helpers shared by the test files (imported as ``helpers.<module>``; no test imports another test file).

* ``helpers.layouts``: layouts of a grid (balanced or skewed blocks) and a hypothesis strategy of layouts.
* ``helpers.tensors``: a small DistTensor with known values, its splits, gathering, gradient checks.
* ``helpers.layers``: a partitioned layer against torch on the gathered field (values and gradients).
* ``helpers.linear``: the single-process torch reference of a tensor-parallel linear layer.
* ``helpers.transformer``: the single-process torch references of the transformer layers (attention, MLP, block).
* ``helpers.agreement``: counting a layer's argument agreements (``hpctp.comm.agree_arguments`` calls).
"""
