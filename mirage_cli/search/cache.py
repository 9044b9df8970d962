"""The search result cache: a rerun with the same program and options is instant.

Entries are candidate files (``.ugraph.json`` text) named by the SHA-256 of the
program's canonical JSON, the result-changing options and the tool version, under
``$MIRAGE_CACHE_DIR`` (default ``~/.cache/mirage-cli``). Only complete searches are
stored (a search cut short by its budget is not reproducible). Writes are atomic;
an unreadable cache is ignored, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from mirage_cli import __version__, serialize
from mirage_cli.ir import Graph
from mirage_cli.util import write_atomic


def cache_dir() -> Path:
    env = os.environ.get("MIRAGE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "mirage-cli"


# Bumped when the search's answers change meaning within one tool version (2: softmax
# is searched in its max-subtracted form and candidates pass the numerical check, so
# older entries may hold the overflowing form).
SEARCH_REVISION = 2


def key(program: Graph, options: dict[str, Any], kind: str = "search") -> str:
    doc = {"kind": kind, "program": serialize.graph_to_json(program), "options": options,
           "version": __version__, "revision": SEARCH_REVISION}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def get(k: str) -> str | None:
    try:
        return (cache_dir() / f"{k}.ugraph.json").read_text(encoding="utf-8")
    except OSError:
        return None


def put(k: str, text: str) -> None:
    try:
        write_atomic(cache_dir() / f"{k}.ugraph.json", text)
    except OSError:
        pass
