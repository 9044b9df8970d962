"""Comment-preserving formatting of `.mir` files (what `mirage fmt` prints for them).

The µGraph holds no comments, so :func:`format_source` prints the canonical form
(:func:`mirage_cli.printer.print_lines`) and puts each comment of the source back
next to the statement it was written with: a comment on its own line goes before the
first printed statement that comes from a later source line (at that statement's
indentation); a comment at the end of a line stays at the end of that statement,
after two spaces. Comments after the last statement of a kernel or program stay
before its closing brace; comments after the program stay at the end. A run of blank
lines between statements becomes one blank line (none after '{' or before '}').
"""

from __future__ import annotations

from dataclasses import dataclass

from mirage_cli.diagnostics import source_lines
from mirage_cli.parser import DEFAULT_FORLOOP, DEFAULT_THREADS, parse_syntax
from mirage_cli.printer import Anchor, print_lines
from mirage_cli.syntax import (
    AttrArg,
    CustomStmt,
    OutputStmt,
    Program,
    Stmt,
    TupleExpr,
    expr_text,
)


@dataclass(frozen=True)
class Comment:
    line: int
    text: str  # from '#' to the end of the line, trailing spaces removed
    trailing: bool  # follows code on its line


def scan_comments(text: str) -> list[Comment]:
    """Every comment of ``text`` (a '#' outside string literals), and each run of
    blank lines as one comment with empty text."""
    out = []
    previous_blank = True
    for n, line in enumerate(source_lines(text), start=1):  # numbered as the lexer does
        blank = not line.strip()
        if blank and not previous_blank:
            out.append(Comment(n, "", False))
        previous_blank = blank
        col = _comment_column(line)
        if col is not None:
            out.append(Comment(n, line[col:].rstrip(), bool(line[:col].strip())))
    return out


def _comment_column(line: str) -> int | None:
    in_string = escaped = False
    for i, ch in enumerate(line):
        if in_string:
            escaped = ch == "\\" and not escaped
            if ch == '"' and not escaped:
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "#":
            return i
    return None


def _anchor_lines(prog: Program) -> dict[object, int]:
    """Source lines of the printed lines that the graph has no span for."""
    lines: dict[object, int] = {"program": prog.name.span.line, "end": prog.close.line}
    outputs = [s for s in prog.stmts if isinstance(s, OutputStmt)]
    if outputs:
        lines["output"] = outputs[0].keyword.line
    for s in _customs(prog.stmts):
        lines[("close", s.span.line)] = s.close.line
    return lines


def _customs(stmts: tuple[Stmt, ...]) -> list[CustomStmt]:
    return [s for s in stmts if isinstance(s, CustomStmt)]


def _headers(prog: Program) -> dict[int, str]:
    """Each custom header as written (canonical spelling), by source line: the graph
    holds grid, threads and forloop as numbers, the source may say ``2 * batch``."""
    out = {}
    for s in _customs(prog.stmts):
        values = {a.key.text: a.value for a in s.args if isinstance(a, AttrArg)}
        grid = values["grid"]
        items = [expr_text(e) for e in (grid.items if isinstance(grid, TupleExpr)
                                         else (grid,))]
        items += ["1"] * (3 - len(items))
        threads = expr_text(values["threads"]) if "threads" in values else str(DEFAULT_THREADS)
        forloop = expr_text(values["forloop"]) if "forloop" in values else str(DEFAULT_FORLOOP)
        out[s.span.line] = (f"custom(grid=({', '.join(items)}), threads={threads}, "
                            f"forloop={forloop})")
    return out


def format_source(text: str, file: str) -> str:
    """The canonical text of the program ``text``, with its comments (and the
    parameter expressions of its custom headers)."""
    prog, g = parse_syntax(text, file)
    anchors = _anchor_lines(prog)
    pending = scan_comments(text)  # in line order; pending[i:] are not placed yet
    i = 0
    out: list[str] = []
    after_open = True  # just after '{' (or at the top of the file): no blank line
    for line, anchor in print_lines(g, _headers(prog)):
        src = _resolve(anchor, anchors)
        closes = line.strip() == "}"
        if src is not None:
            indent = line[:len(line) - len(line.lstrip())] + ("  " if closes else "")
            while i < len(pending) and pending[i].line < src:
                c = pending[i]
                i += 1
                if c.text:
                    out.append(indent + c.text)
                elif not after_open and out and out[-1]:
                    out.append("")
                after_open = False
            # One comment per line at most: a trailing one on this line is next.
            if i < len(pending) and pending[i].line == src and pending[i].trailing:
                line = f"{line}  {pending[i].text}"
                i += 1
        if closes and out and not out[-1]:
            out.pop()  # no blank line before a closing brace
        out.append(line)
        after_open = line.split("#", 1)[0].rstrip().endswith("{")
    for c in pending[i:]:
        if c.text or (out and out[-1]):
            out.append(c.text)
    while out and not out[-1]:
        out.pop()
    return "".join(s + "\n" for s in out)


def _resolve(anchor: Anchor, anchors: dict[object, int]) -> int | None:
    if isinstance(anchor, int) or anchor is None:
        return anchor
    return anchors.get(anchor)
