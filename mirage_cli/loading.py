"""Reading a µGraph from any file the tools accept, chosen by its name and content.

- ``*.mir``: the program language (parameters overridable with ``-D``);
- ``*.ugraph.json``: our canonical format (one graph, or a candidate list);
- any other ``*.json``: a Mirage checkpoint (a JSON array of candidates), imported.

``index`` picks one candidate of a list (default: the first).
"""

from __future__ import annotations

import json
from pathlib import Path

from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph


def read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MirageError("no such file", file=path) from None
    except IsADirectoryError:
        raise MirageError("is a directory, expected a file", file=path) from None
    except UnicodeDecodeError:
        raise MirageError("not a UTF-8 text file", file=path) from None


def load_graphs(path: str, defines: dict[str, int] | None = None) -> list[Graph]:
    """Every µGraph the file holds (a program or single graph gives one)."""
    text = read_text(path)
    if path.endswith(".mir"):
        from mirage_cli.parser import parse_text

        return [parse_text(text, path, defines or {})]
    if defines:
        raise MirageError("-D overrides apply to .mir programs only", file=path)
    if _is_mirage_checkpoint(text):
        from mirage_cli.importers.mirage import import_checkpoint

        return import_checkpoint(text, path)
    from mirage_cli.serialize import loads_candidates

    return [g for g, _ in loads_candidates(text, path)]


def load_graph(path: str, defines: dict[str, int] | None = None,
               index: int | None = None) -> Graph:
    """One µGraph from ``path``: candidate ``index`` of a list (default 0)."""
    graphs = load_graphs(path, defines)
    i = 0 if index is None else index
    if not 0 <= i < len(graphs):
        raise MirageError(f"--index {i} is out of range: the file holds {len(graphs)} "
                          f"candidate(s)", file=path)
    return graphs[i]


def _is_mirage_checkpoint(text: str) -> bool:
    head = text.lstrip()[:1]
    if head != "[":
        return False
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(doc, list)
