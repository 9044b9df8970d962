"""Importers: µGraphs written by other tools, turned into our IR (checked by the builder)."""
