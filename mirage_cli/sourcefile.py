"""Reading the text of a source file, or of the standard input (the path ``-``).

Below both the parser and :mod:`mirage_cli.loading` (which chooses a reader by the
file's kind), so that neither needs the other to read a file.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mirage_cli.diagnostics import MirageError

STDIN = "-"
STDIN_NAME = "<stdin>"
_BOM = "\ufeff"


def display_name(path: str) -> str:
    """How diagnostics name ``path``."""
    return STDIN_NAME if path == STDIN else path


def read_text(path: str) -> str:
    """The text of ``path`` (``-``: standard input), without a leading BOM."""
    try:
        if path == STDIN:
            data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else \
                sys.stdin.read().encode("utf-8")
            text = data.decode("utf-8")
        else:
            text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MirageError("no such file", file=path) from None
    except IsADirectoryError:
        raise MirageError("is a directory, expected a file", file=path) from None
    except UnicodeDecodeError:
        raise MirageError("not a UTF-8 text file", file=display_name(path)) from None
    except OSError as e:
        raise MirageError(f"cannot read: {e.strerror or e}", file=display_name(path)) from None
    return text.removeprefix(_BOM)


def attach_source(e: MirageError) -> MirageError:
    """Give a located diagnostic raised after parsing (by a later stage, which holds
    the span but not the text) its source excerpt, read back from the file named in
    the span; standard input cannot be read twice and keeps the one-line form."""
    if e.span is None or e.source is not None or e.span.file in (STDIN, STDIN_NAME):
        return e
    try:
        return e.with_source(read_text(e.span.file))
    except MirageError:
        return e
