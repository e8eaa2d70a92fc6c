"""Array functions on DistTensors, grouped by kind: shape (broadcast, join, pad), calculus
(diff, gradient, trapezoid), statistics and nan-reductions, scans, search, histogram, quantiles.

Each module registers the functions DistTensor's methods and numpy's/torch's protocols reach
through :mod:`hpctp.tensor.registry`."""
