"""Where the tests find Mirage's published µGraphs: `shared/mirage-mugraphs` beside the
checkout (as in CI) or inside it (as on the GPU machine), or the folder named by
``MIRAGE_MUGRAPHS``. Tests that need them skip when none exists."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _find() -> Path:
    candidates = [Path(os.environ["MIRAGE_MUGRAPHS"])] if "MIRAGE_MUGRAPHS" in os.environ else []
    candidates += [ROOT.parent / "shared" / "mirage-mugraphs", ROOT / "shared" / "mirage-mugraphs"]
    for c in candidates:
        if c.is_dir():
            return c
    return candidates[0]


MUGRAPHS = _find()
