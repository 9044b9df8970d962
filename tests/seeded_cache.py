"""A search cache as a first `mirage opt` leaves it, made once per test process.

Many shape-reuse tests start the same way: `mirage opt` of one program at one batch
into an empty cache, whose output they do not read, then the step they test. The
cache that first run writes is the same every time (the search is deterministic and
its files name no path), so the first test to need it runs it, and later ones start
from a copy of what it wrote. Tests that read the first run's own output still run it.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable, Hashable
from pathlib import Path

_MADE: dict[Hashable, Path] = {}


def start_from(key: Hashable, cache: Path, first_run: Callable[[], object]) -> None:
    """Leave ``cache`` as ``first_run()`` leaves an empty one (``key`` names that run:
    the program, its sizes and options). ``cache`` must not exist yet."""
    made = _MADE.get(key)
    if made is not None:
        shutil.copytree(made, cache)
        return
    first_run()
    # A fresh folder of this process (xdist workers each keep their own copies).
    keep = Path(tempfile.mkdtemp(prefix="mirage-seeded-")) / "cache"
    atexit.register(shutil.rmtree, keep.parent, True)
    shutil.copytree(cache, keep)
    _MADE[key] = keep
