"""Test-session set-up shared by every test module.

Under pytest-xdist every core already runs a worker, so each worker's numpy keeps to
one BLAS thread: OpenBLAS's own threads (one per core by default) then only contend
with the other workers. Beside another busy process, the float64 reference runs of
Mirage's checkpoints took 20.1 s with two BLAS threads against 14.6 s with one.
Set here, before any test module imports numpy; an explicit setting is kept.
"""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
