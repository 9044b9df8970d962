"""The search's progress display on stderr (rich; plain lines when not a terminal)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.live import Live
from rich.text import Text

from mirage_cli.console import console, verbosity
from mirage_cli.search.driver import Progress


def _line(p: Progress, start: float) -> Text:
    best = "-" if p.best_us is None else f"{p.best_us:.2f} us"
    return Text(f"search [{p.phase}] units {p.units_done}/{p.units_total}  "
                f"states {p.stats.explored}  pruned {p.stats.pruned}  "
                f"z3 {p.z3_queries}  designs {p.designs}  verified {p.verified}"
                f" (rejected {p.rejected})  best {best}  {time.time() - start:.1f}s  "
                + " ".join(f"{k} {v}s" for k, v in p.seconds.items()))


@contextmanager
def progress_display() -> Iterator[Callable[[Progress], None]]:
    """A callback that redraws the status line; a live line on a terminal, one final
    line otherwise (and nothing with -q)."""
    start = time.time()
    last: list[Progress] = []
    if console.is_terminal and verbosity() >= 0:
        with Live(Text("search: starting"), console=console, refresh_per_second=8,
                  transient=False) as live:
            def update(p: Progress) -> None:
                live.update(_line(p, start))
            yield update
        return

    def remember(p: Progress) -> None:
        last[:] = [p]

    yield remember
    if last and verbosity() >= 0:
        console.print(_line(last[0], start), markup=False)
