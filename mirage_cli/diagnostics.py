"""Source spans and the one diagnostic type every stage raises on bad input.

A :class:`MirageError` prints as ``file:line:col: error: message``, followed by the
source line and a caret under the offending column (DESIGN.md §6). The command line
turns it into exit code 2; nothing else in the program formats errors.
"""

from __future__ import annotations

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
        if self.span is not None:
            head = f"{self.span.file}:{self.span.line}:{self.span.col}: error: {self.message}"
        elif self.file is not None:
            head = f"{self.file}: error: {self.message}"
        else:
            head = f"error: {self.message}"
        lines = [head]
        excerpt = self._excerpt()
        if excerpt:
            lines.extend(excerpt)
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _excerpt(self) -> list[str]:
        if self.span is None or self.source is None:
            return []
        src_lines = self.source.splitlines()
        if not 1 <= self.span.line <= len(src_lines):
            return []
        text = src_lines[self.span.line - 1].rstrip("\n").expandtabs(1)
        width = 1
        if self.span.end_col is not None and self.span.end_col > self.span.col:
            width = self.span.end_col - self.span.col
        return [f"  {text}", "  " + " " * (self.span.col - 1) + "^" + "~" * (width - 1)]

    def __str__(self) -> str:
        return self.render()


def did_you_mean(name: str, candidates: list[str] | tuple[str, ...]) -> str:
    """A ' (did you mean 'x'?)' suffix for the closest candidate, or ''."""
    import difflib

    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
