"""Reading a µGraph from any file the tools accept, chosen by its name and content.

- ``*.mir``: the program language (parameters overridable with ``-D``);
- ``*.ugraph.json``: our canonical format (one graph, or a candidate list);
- any other ``*.json``: a Mirage checkpoint (a JSON array of candidates), imported.

``index`` picks one candidate of a list (default: the first). The path ``-`` is the
standard input (named ``<stdin>`` in diagnostics); its kind is told by its first
character: ``{`` a `.ugraph.json` document, ``[`` a Mirage checkpoint, anything
else a `.mir` program. A UTF-8 byte order mark at the start of a file is accepted
(and dropped).
"""

from __future__ import annotations

from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.sourcefile import STDIN, STDIN_NAME, display_name, read_text

__all__ = ["STDIN", "STDIN_NAME", "display_name", "graphs_from_text", "is_program",
           "load_graph", "load_graphs", "read_text"]


def is_program(path: str, text: str) -> bool:
    """Is this file a `.mir` program (by its name, or for stdin by its content)?"""
    if path == STDIN:
        return text.lstrip()[:1] not in ("{", "[")
    return path.endswith(".mir")


def load_graphs(path: str, defines: dict[str, int] | None = None,
                strict_defines: bool = True) -> list[Graph]:
    """Every µGraph the file holds (a program or single graph gives one).

    With ``strict_defines`` False, a ``-D`` name the program does not declare is
    skipped instead of rejected (``verify A B`` checks the names over both files)."""
    return graphs_from_text(read_text(path), path, defines, strict_defines)


def graphs_from_text(text: str, path: str, defines: dict[str, int] | None = None,
                     strict_defines: bool = True) -> list[Graph]:
    """:func:`load_graphs` of text already read from ``path``."""
    name = display_name(path)
    if is_program(path, text):
        from mirage_cli.parser import parse_text

        return [parse_text(text, name, defines or {}, strict_defines)]
    if defines:
        raise MirageError("-D overrides apply to .mir programs only", file=name)
    if _is_mirage_checkpoint(text):
        from mirage_cli.importers.mirage import import_checkpoint

        return import_checkpoint(text, name)
    from mirage_cli.serialize import loads_candidates

    return [g for g, _ in loads_candidates(text, name)]


def load_graph(path: str, defines: dict[str, int] | None = None,
               index: int | None = None) -> Graph:
    """One µGraph from ``path``: candidate ``index`` of a list (default 0)."""
    graphs = load_graphs(path, defines)
    return pick(graphs, path, index)


def pick(graphs: list[Graph], path: str, index: int | None) -> Graph:
    """Candidate ``index`` (default 0) of the graphs of ``path``."""
    i = 0 if index is None else index
    if not 0 <= i < len(graphs):
        raise MirageError(f"--index {i} is out of range: the file holds {len(graphs)} "
                          f"candidate(s)", file=display_name(path))
    return graphs[i]


def _is_mirage_checkpoint(text: str) -> bool:
    # Told by the first character alone: parsing the whole document here would read it
    # twice (and a malformed checkpoint is reported by the importer, with its place).
    return text.lstrip()[:1] == "["
