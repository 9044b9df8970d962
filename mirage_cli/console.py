"""The stderr console (rich), honouring NO_COLOR and non-TTY output."""

from __future__ import annotations

import os

from rich.console import Console

console = Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")), highlight=False)
_verbosity = 0


def set_verbosity(level: int) -> None:
    """-1 quiet, 0 normal, 1+ verbose."""
    global _verbosity
    _verbosity = level
    console.quiet = level < 0


def verbosity() -> int:
    return _verbosity


def info(msg: str) -> None:
    """A progress or status line on stderr (hidden by -q)."""
    console.print(msg, markup=False, soft_wrap=True)  # long paths stay on one line


def debug(msg: str) -> None:
    if _verbosity > 0:
        console.print(msg, style="dim", markup=False)


def warn(msg: str) -> None:
    """A warning on stderr (hidden by -q, like progress)."""
    console.print(f"warning: {msg}", style="yellow", markup=False)
