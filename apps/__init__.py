"""Applications built on hpctp: a distributed simulation that makes training data, and
distributed convolutional surrogates that learn it. Run from the repository root:
``mpiexec -n 4 python -m apps.simulate``, ``python -m apps.surrogate train``."""
