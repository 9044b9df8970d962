"""tools/warm_cache.py: which `mirage opt` runs fill the search cache, in what order
(the layers, the longest searches, first), and that an unknown group is refused."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("warm_cache", ROOT / "tools" / "warm_cache.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_layers_first_then_examples_then_models_at_their_own_sizes() -> None:
    tool = _tool()
    order = tool.runs(list(tool.GROUPS), [8, 1])
    stems = [(p.stem, b) for p, b in order]
    layers = sorted(p.stem for p in (ROOT / "examples").glob("*_layer.mir"))
    assert layers and stems[:2 * len(layers)] == [(s, b) for b in (8, 1) for s in layers]
    models = sorted(p.stem for p in (ROOT / "examples" / "models").glob("*.mir"))
    assert stems[-len(models):] == [(s, None) for s in models]
    middle = stems[2 * len(layers):-len(models)]
    assert ("gqa", 8) in middle and ("gqa", 1) in middle
    assert not any(s.endswith("_layer") for s, _ in middle)
    assert [p.stem for p, _ in tool.runs(["models"], [8])] == models


def test_an_unknown_group_is_refused() -> None:
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "warm_cache.py"), "layer"],
                       check=False, capture_output=True, text=True)
    assert p.returncode == 2 and "unknown group(s) layer" in p.stderr
