"""Entry points from outside a Python program: the ``hpctp`` command (``info``, ``demo``), the job
runner that turns an exception on one rank into an abort of the whole job, rank-aware logging for
programs, and the bridge that ``libhpctp_c`` (C/C++/Fortran) calls into."""
