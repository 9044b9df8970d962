"""Equivalence verification of µGraphs: finite-field random testing with a stated
bound and a float64 cross-check. The public API is in :mod:`mirage_cli.verifier.api`.
This package's ``__init__`` imports nothing, so that ``ops.py`` can import
:mod:`mirage_cli.semantics.fieldsem` without a cycle."""
