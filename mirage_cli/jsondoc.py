"""JSON documents read from files: bounded parsing, and the place of a value by path.

:func:`load` is ``json.loads`` behind one linear, non-recursive scan that rejects, each
with a located :class:`~mirage_cli.diagnostics.MirageError`, what would otherwise
escape as an internal error: arrays and objects nested deeper than
:data:`MAX_DEPTH` (the decoder recurses), numbers longer than :data:`MAX_DIGITS`
digits (Python refuses to convert them), and the non-JSON constants ``NaN`` and
``Infinity``. Malformed JSON is reported where the decoder stopped.

:func:`locate` finds where the value at a path (keys and indices, e.g.
``("graph", "ops", 0, "block", "grid", 1)``) starts in the text, so a loader can put
``file:line:col`` on an error found after parsing. Paths print as
``graph.ops[0].block.grid[1]`` (:func:`path_text`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from mirage_cli.diagnostics import MirageError, Span

MAX_DEPTH = 64  # nesting of arrays and objects (a µGraph file needs about 8)
MAX_DIGITS = 40  # digits in one number (an int64 has 19)

Path = tuple[str | int, ...]

# One token of interest outside strings; strings are matched whole so that brackets
# and digits inside them are skipped.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]|-?(?:NaN|Infinity)|-?[0-9][0-9.eE+-]*',
                    re.DOTALL)
_VALUE = re.compile(r'"(?:[^"\\]|\\.)*"|-?[0-9][0-9.eE+-]*|true|false|null|NaN|-?Infinity',
                    re.DOTALL)
_SPACE = re.compile(r"[ \t\r\n]*")


def span_at(text: str, offset: int, file: str) -> Span:
    """The line and column of character ``offset`` (lines end at ``\\n``)."""
    line = text.count("\n", 0, offset) + 1
    col = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return Span(file, line, col)


def load(text: str, file: str) -> Any:
    """The document in ``text``, or a located error (see the module docstring)."""
    _prescan(text, file)
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique)
    except _DuplicateKey as e:
        raise MirageError(f"malformed JSON: the key {e.key!a} appears twice in one "
                          f"object", file=file) from None
    except json.JSONDecodeError as e:
        raise MirageError(f"malformed JSON: {e.msg}", Span(file, e.lineno, e.colno),
                          source=text) from None
    except (ValueError, RecursionError) as e:  # left for safety: the prescan sees these
        raise MirageError(f"unreadable JSON: {e}", file=file) from None


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are distinct (json keeps the last of a repeated key, so a
    second ``"name"`` would silently win)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _prescan(text: str, file: str) -> None:
    depth = 0
    for m in _TOKEN.finditer(text):
        tok = m.group()
        if tok in ("[", "{"):
            depth += 1
            if depth > MAX_DEPTH:
                raise MirageError(f"JSON nests more than {MAX_DEPTH} levels deep",
                                  span_at(text, m.start(), file), source=text)
        elif tok in ("]", "}"):
            depth -= 1
        elif tok[0] == '"':
            continue
        elif "NaN" in tok or "Infinity" in tok:
            raise MirageError(f"{tok} is not a JSON value (numbers must be finite)",
                              span_at(text, m.start(), file), source=text)
        elif len(tok) > MAX_DIGITS:
            raise MirageError(f"a number of {len(tok)} characters (at most {MAX_DIGITS})",
                              span_at(text, m.start(), file), source=text)


def path_text(path: Sequence[str | int]) -> str:
    """``graph.ops[0].name`` for ``("graph", "ops", 0, "name")``."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or "(document)"


class _Frame:
    """One open array or object during :func:`locate`'s scan."""

    __slots__ = ("expect_key", "is_object", "key")

    def __init__(self, is_object: bool) -> None:
        self.is_object = is_object
        self.key: str | int = 0
        self.expect_key = is_object


def locate(text: str, path: Sequence[str | int]) -> int | None:
    """The offset where the value at ``path`` starts in the (valid JSON) ``text``, or
    None. One pass with an explicit stack: no recursion, whatever the nesting."""
    target = tuple(path)
    stack: list[_Frame] = []
    i, n = _SPACE.match(text, 0).end(), len(text)  # type: ignore[union-attr]
    while i < n:
        c = text[i]
        if c in ",:":
            top = stack[-1] if stack else None
            if top is not None and c == ",":
                if top.is_object:
                    top.expect_key = True
                else:
                    top.key = int(top.key) + 1
            i = _SPACE.match(text, i + 1).end()  # type: ignore[union-attr]
            continue
        if c in "]}":
            stack.pop()
            i = _SPACE.match(text, i + 1).end()  # type: ignore[union-attr]
            continue
        if stack and stack[-1].expect_key:
            m = _VALUE.match(text, i)
            if m is None:
                return None
            stack[-1].key = json.loads(m.group())
            stack[-1].expect_key = False
            i = _SPACE.match(text, m.end()).end()  # type: ignore[union-attr]
            continue
        if tuple(f.key for f in stack) == target:
            return i
        if c in "[{":
            stack.append(_Frame(c == "{"))
            i = _SPACE.match(text, i + 1).end()  # type: ignore[union-attr]
            continue
        m = _VALUE.match(text, i)
        if m is None:
            return None
        i = _SPACE.match(text, m.end()).end()  # type: ignore[union-attr]
    return None


def error_at(text: str, file: str, path: Sequence[str | int], message: str) -> MirageError:
    """``file:line:col: error: <path>: message`` at the value ``path`` (or, where the
    value is missing, at the nearest enclosing one that exists)."""
    p = tuple(path)
    while True:
        offset = locate(text, p)
        if offset is not None or not p:
            break
        p = p[:-1]
    where = span_at(text, offset, file) if offset is not None else None
    return MirageError(f"{path_text(path)}: {message}", where, file=file, source=text)
