"""Automatic shape reuse through the search cache (``mirage opt -D batch=16`` after a
search at batch 8).

A complete search records, in the cache's family entry (:func:`.cache.get_family`:
the same program at any sizes, same options), its whole *design pool* (every design
the enumeration found, split forms included; designs are size-free,
:mod:`.design`) and the *size pattern* of its sizes (:func:`.family.size_pattern`). At new
sizes :func:`reused` hands the pool to :func:`mirage_cli.search.driver.reuse_designs`, which
tunes, ranks and certifies at the new sizes:

- same size pattern: the enumeration at the new sizes would find exactly this pool
  (the generator sees sizes only through the facts the pattern records), so nothing is
  enumerated: no search units, no Z3;
- another pattern (batch 1 -> 8: dimensions of 1 become splittable; lora at batch 16:
  the batch equals the LoRA rank): the designs enumerated at the new sizes are ranked
  beside the pool's.

Either way the ranking is a search's ranking at the new sizes over at least the
designs a search would find there, and only the candidates the caller needs are
certified, best first, at the sizes they ship at.
"""

from __future__ import annotations

from typing import Any

from mirage_cli import serialize
from mirage_cli.console import info
from mirage_cli.ir import Graph
from mirage_cli.search.cache import get_family, has, key, peek, put
from mirage_cli.search.family import BadDesign, design_from_json, size_pattern


def reused(program: Graph, options: Any, on_progress: Any = None,
           need: int | None = None, budget: float | None = None, jobs: int = 1) -> Any:
    """Automatic shape reuse: when the cache holds no entry for ``program`` but a
    family entry (the same program at other sizes, the same options), that search's
    design pool is tuned, ranked and certified at ``program``'s sizes (enumerating at
    these sizes too when the size pattern differs; ``budget`` seconds, ``jobs``
    workers), and only ``need`` (default: ``top``) are certified, best first. Returns
    the :class:`~mirage_cli.search.driver.Outcome`, or None when there is nothing to
    reuse or no design verifies at these sizes (the caller then searches)."""
    from mirage_cli.search.driver import Outcome, reuse_designs

    opts = options.as_json()
    k = key(program, opts)
    if has(k) and not _short(k, need or options.top):
        return None
    fam = get_family(program, opts)
    if fam is None:
        return None
    pool_json, sizes, pattern = fam
    try:
        pool = [design_from_json(d) for d in pool_json]
    except BadDesign as e:
        info(f"warning: ignoring the cached family entry of this program: {e}")
        return None
    same = pattern == size_pattern(program)
    res = reuse_designs(program, pool, options, on_progress, need, budget, jobs,
                        enumerate_here=not same)
    at = ", ".join(f"{k}={v}" for k, v in sorted(sizes.items()))
    if not res.candidates:
        info(f"search: no design of the cached search at {at} verifies at these sizes; "
             f"searching")
        return None
    found = res.progress.designs - res.progress.reused
    how = ("the same size pattern: nothing enumerated" if same else
           f"another size pattern: ranked with the {found} more found at these sizes")
    info(f"search: reused the {res.progress.reused} design(s) of the cached search of this "
         f"program at {at} ({how}); {len(res.candidates)} verified at these sizes")
    pairs = [(c.graph, {**c.meta(i), "reused_from": f"cache ({at})"})
             for i, c in enumerate(res.candidates)]
    text = serialize.dumps_candidates(pairs)
    # Stored as this program's result: a rerun at these sizes is an exact hit (one
    # that needs more candidates than were certified reuses again: _short).
    if res.complete:
        put(k, text, program, opts)
    return Outcome(text, pairs, False, True, res.progress)


def _short(k: str, need: int) -> bool:
    """Whether the exact entry under ``k`` is a reuse's that certified fewer than
    ``need`` candidates (``mirage opt --gpu`` after a plain ``mirage opt`` at these
    sizes). Read without checks: the entry is only a hint here; whatever it holds is
    not shipped from this function."""
    from mirage_cli.diagnostics import MirageError

    text = peek(k)
    if text is None:
        return False
    try:
        cands = serialize.loads_candidates(text, "<cache>")
    except MirageError:
        return False
    return len(cands) < need and all("reused_from" in m for _, m in cands)
