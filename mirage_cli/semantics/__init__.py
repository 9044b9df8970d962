"""Operator meanings below the registry: values, field and CUDA semantics, terms."""
