"""Automatic shape reuse through the search cache (``mirage opt -D batch=16`` after a
search at batch 8): the cache's family entry (:func:`.cache.get_family`: the same
program at other sizes, same options) gives known designs, which
:func:`mirage_cli.search.driver.reuse` re-instantiates and re-tunes at the new sizes
beside the designs enumerated there, ranks, and certifies only the candidates the
caller needs (a search certifies ``--top``)."""

from __future__ import annotations

from typing import Any

from mirage_cli import serialize
from mirage_cli.console import info
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.search.cache import get_family, has, key, peek, put


def reused(program: Graph, options: Any, on_progress: Any = None,
           need: int | None = None, budget: float | None = None, jobs: int = 1) -> Any:
    """Automatic shape reuse (``mirage opt -D batch=16`` after a search at batch 8): when
    the cache holds no entry for ``program`` but one for the same program at other sizes
    under the same options, that search's designs are re-instantiated and re-tuned at
    ``program``'s sizes beside the designs enumerated there (``budget`` seconds,
    ``jobs`` workers), ranked, and only ``need`` (default: ``top``) are certified, best
    first (:func:`mirage_cli.search.driver.reuse`). Returns the :class:`~mirage_cli.search.driver.Outcome`, or None when
    there is nothing to reuse or no known design verifies at these sizes (the caller
    then searches)."""
    from mirage_cli.search.driver import Outcome, reuse

    opts = options.as_json()
    k = key(program, opts)
    if has(k) and not _short(k, need or options.top):
        return None
    fam = get_family(program, opts)
    if fam is None:
        return None
    text, sizes = fam
    try:
        known = [g for g, _ in serialize.loads_candidates(text, "<cache>")]
    except MirageError:
        return None
    res = reuse(program, known, options, on_progress, need, (budget, jobs))
    at = ", ".join(f"{k}={v}" for k, v in sorted(sizes.items()))
    if not res.candidates:
        info(f"search: no design of the cached search at {at} verifies at these sizes; "
             f"searching")
        return None
    found = res.progress.designs - res.progress.reused
    info(f"search: reused the {res.progress.reused} design(s) of the cached search of this "
         f"program at {at}, ranked with the {found} more found at these sizes; "
         f"{len(res.candidates)} verified at these sizes")
    pairs = [(c.graph, {**c.meta(i), "reused_from": f"cache ({at})"})
             for i, c in enumerate(res.candidates)]
    text = serialize.dumps_candidates(pairs)
    # Stored as this program's result: a rerun at these sizes is an exact hit (one
    # that needs more candidates than were certified reuses again: _short).
    if res.complete:
        put(k, text, program, opts, family=False)
    return Outcome(text, pairs, False, True, res.progress)


def _short(k: str, need: int) -> bool:
    """Whether the exact entry under ``k`` is a reuse's that certified fewer than
    ``need`` candidates (``mirage opt --gpu`` after a plain ``mirage opt`` at these
    sizes). Read without checks: the entry is only a hint here; whatever it holds is
    not shipped from this function."""
    text = peek(k)
    if text is None:
        return False
    try:
        cands = serialize.loads_candidates(text, "<cache>")
    except MirageError:
        return False
    return len(cands) < need and all("reused_from" in m for _, m in cands)
