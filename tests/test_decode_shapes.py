"""tools/decode_shapes.py: the example programs at decode shapes they do not use, each a
valid program at the sizes it is named after."""

from __future__ import annotations

import sys
from pathlib import Path

from mirage_cli.loading import load_graph

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import decode_shapes


def test_each_shape_is_a_program_at_its_sizes(tmp_path: Path) -> None:
    assert decode_shapes.main([str(tmp_path)]) == 0
    files = sorted(tmp_path.glob("*.mir"))
    assert len(files) == len(decode_shapes.SHAPES) == len({p.stem for p in files})
    for example, sizes in decode_shapes.SHAPES:
        name, _ = decode_shapes.program_text(example, sizes)
        g = load_graph(str(tmp_path / f"{name}.mir"))
        assert g.name == name
        shapes = {d for t in g.tensor_types().values() for d in t.shape}
        assert {sizes["hidden"], sizes.get("n", sizes["hidden"])} <= shapes
