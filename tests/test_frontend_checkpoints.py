"""Every µGraph imported from Mirage's published checkpoints prints as .mir and parses
back to the identical graph (skipped where the importer or the checkpoints are absent)."""

from __future__ import annotations

from pathlib import Path

import pytest
from shared_data import MUGRAPHS

from mirage_cli import serialize
from mirage_cli.parser import parse_text
from mirage_cli.printer import print_graph

CKPTS = MUGRAPHS
FILES = sorted(CKPTS.glob("*.json")) if CKPTS.is_dir() else []


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_checkpoint_candidates_round_trip(path: Path) -> None:
    pytest.importorskip("mirage_cli.importers.mirage")
    from mirage_cli.loading import load_graphs

    graphs = load_graphs(str(path))
    assert graphs
    for i, g in enumerate(graphs):
        text = print_graph(g)
        back = parse_text(text, f"{path.name}[{i}].mir")
        assert back == g
        assert serialize.dumps(back) == serialize.dumps(g)
        assert print_graph(back) == text
