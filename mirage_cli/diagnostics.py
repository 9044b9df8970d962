"""Source spans and the one diagnostic type every stage raises on bad input.

A :class:`MirageError` prints as ``file:line:col: error: message``, followed by the
source line and a caret under the offending column (DESIGN.md §6). The command line
turns it into exit code 2; nothing else in the program formats errors.

Lines and columns are counted as editors count them: a line ends at ``\n`` only (form
feed, NEL, U+2028 and U+2029 do not start a line, as in the lexer), and a column is a
code point (1-based). Everything a diagnostic echoes from a file goes through
:func:`visible`: control, format and separator characters are shown as escapes
(``\x1b``, ``\u2028``), so a hostile file cannot drive the user's terminal.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A position in a source file (1-based line and column)."""

    file: str
    line: int
    col: int
    end_col: int | None = None


class MirageError(Exception):
    """Bad input: a located (or file-level) diagnostic. Exit code 2."""

    def __init__(self, message: str, span: Span | None = None, *,
                 file: str | None = None, source: str | None = None,
                 notes: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.span = span
        self.file = file if file is not None else (span.file if span else None)
        self.source = source
        self.notes = notes

    def with_source(self, source: str) -> MirageError:
        """Attach the source text so the caret line can be printed."""
        if self.source is None:
            self.source = source
        return self

    def render(self) -> str:
        """The full diagnostic text, without colour."""
        message = visible(self.message, keep="\n\t")
        if self.span is not None:
            head = (f"{visible(self.span.file)}:{self.span.line}:{self.span.col}: error: "
                    f"{message}")
        elif self.file is not None:
            head = f"{visible(self.file)}: error: {message}"
        else:
            head = f"error: {message}"
        lines = [head]
        excerpt = self._excerpt()
        if excerpt:
            lines.extend(excerpt)
        lines.extend(f"note: {visible(n, keep=chr(10))}" for n in self.notes)
        return "\n".join(lines)

    def _excerpt(self) -> list[str]:
        if self.span is None or self.source is None:
            return []
        src_lines = source_lines(self.source)
        if not 1 <= self.span.line <= len(src_lines):
            return []
        raw = src_lines[self.span.line - 1]
        col = min(max(self.span.col, 1), len(raw) + 1)
        # The caret sits under the escaped text, so measure the escaped prefix.
        before, at = visible(raw[:col - 1]), visible(raw[col - 1:])
        width = 1
        if self.span.end_col is not None and self.span.end_col > col:
            width = len(visible(raw[col - 1:self.span.end_col - 1])) or 1
        # A very long line (a minified file) is cut to a window around the caret.
        if len(before) > _EXCERPT_CONTEXT:
            before = "..." + before[-(_EXCERPT_CONTEXT - 3):]
        if len(at) > _EXCERPT_CONTEXT:
            at = at[:_EXCERPT_CONTEXT - 3] + "..."
        width = max(1, min(width, len(at)))
        return [f"  {before}{at}", "  " + " " * len(before) + "^" + "~" * (width - 1)]

    def __str__(self) -> str:
        return self.render()


_EXCERPT_CONTEXT = 100  # characters of a source line shown before and after the caret


def source_lines(text: str) -> list[str]:
    """The lines of ``text`` as the lexer and editors number them (split at ``\n``
    only; a ``\r`` before it belongs to the line break)."""
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    if len(lines) > 1 and not lines[-1]:
        lines.pop()  # the text ends with a line break, not with an empty line
    return lines


def visible(text: str, keep: str = "") -> str:
    """``text`` with every control (Cc), format (Cf), line/paragraph separator (Zl, Zp)
    and unassigned or private character escaped, so it prints as inert text on any
    terminal. A tab prints as one space (it is one column wide in spans); the
    characters in ``keep`` (a message's own line breaks) are left alone."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch in keep:
            out.append(ch)
        elif ch == "\t":
            out.append(" ")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
            out.append(ascii(ch)[1:-1])
        else:
            out.append(ch)
    return "".join(out)


def did_you_mean(name: str, candidates: list[str] | tuple[str, ...]) -> str:
    """A ' (did you mean 'x'?)' suffix for the closest candidate, or ''."""
    import difflib

    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
