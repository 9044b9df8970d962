"""Automatic shape reuse through the search cache (``mirage opt -D batch=16`` after a
search at batch 8).

A complete search records, in the cache's family entry (:func:`.cache.get_family`:
the same program at any sizes, same options), its whole *design pool* (every design
the enumeration found, split forms included; designs are size-free,
:mod:`.design`) and the *size pattern* of its sizes (:func:`size_pattern`). At new
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

import hashlib
import json
from typing import Any

from mirage_cli import ops, serialize
from mirage_cli.console import info
from mirage_cli.ir import Graph
from mirage_cli.search.cache import get_family, has, key, peek, put
from mirage_cli.search.design import CustomD, Design, LoadD, OpD, PredefD, Step, StoreD


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


# -- the size pattern ---------------------------------------------------------------


def size_pattern(program: Graph) -> str:
    """A digest of every fact about ``program``'s sizes that the design enumeration
    (:mod:`.enumerate`) can read; equal digests give equal design pools.

    The generator sees a dimension n whole or split in :data:`.enumerate.REP_SPLIT`
    = 2 parts (n/2), and a stored partial result concatenated over 2 blocks (2 per
    reduced dimension); it compares such sizes for equality (operand shapes,
    broadcasting, which unifies equal-size dimensions into one index), tests them
    against 1 and for divisibility (splits, group widths), and writes actual sizes
    into expressions (a reduction's extent) and attributes (an output's width).
    So the pattern records: each dimension's class among the values {1, 2, n, n/2}
    of every dimension (numbered by first occurrence, so 8 and 16 are alike but
    16 = 64/4 is not 32 = 64/2), which classes divide which, the index labels and
    expressions of every tensor (exact sizes of what is reduced), and the outputs'
    last dimensions."""
    from mirage_cli.search.analysis import analyze

    an = analyze(program)
    ids: dict[int, int] = {1: 0, 2: 1}
    dims: list[tuple[int, int]] = []
    for v in an.values.values():
        for n in v.type.shape:
            whole = ids.setdefault(n, len(ids))
            half = ids.setdefault(n // 2, len(ids)) if n % 2 == 0 else -1
            dims.append((whole, half))
    atoms = sorted(ids, key=ids.__getitem__)
    divides = [[a % b == 0 for b in atoms] for a in atoms]
    doc = {"dims": dims, "divides": divides,
           "labels": [list(v.labels) for v in an.values.values()],
           "terms": [repr(v.term) for v in an.values.values()],
           "widths": [v.type.shape[-1] for v in an.outputs]}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# -- designs as JSON (the family entry's pool) -------------------------------------------


def design_to_json(d: Design) -> dict[str, Any]:
    """A design as plain JSON (no sizes: grids and forloop ranges are tuning)."""
    return {"steps": [_step_json(s) for s in d.steps], "outputs": list(d.outputs)}


def _step_json(s: Step) -> dict[str, Any]:
    if isinstance(s, PredefD):
        return {"predef": s.op, "args": list(s.args), "attrs": [list(a) for a in s.attrs],
                "name": s.name}
    return {"loads": [[ld.source, list(ld.imap), ld.fmap] for ld in s.loads],
            "ops": [[o.op, list(o.args), [list(a) for a in o.attrs]] for o in s.ops],
            "stores": [[st.tile, st.name, list(st.omap)] for st in s.stores],
            "axes": s.axes, "looped": s.looped}


class BadDesign(ValueError):
    """A design document that is not one :func:`design_to_json` writes."""


def design_from_json(doc: Any) -> Design:
    """The inverse of :func:`design_to_json`, checked (the cache is anyone's to
    write): every index in range, every operator known, every value of its type.
    What it returns is still only a candidate: it is instantiated through the builder
    and verified before it ships."""
    doc = _obj(doc, ("steps", "outputs"))
    steps = tuple(_step(s) for s in _list(doc["steps"]))
    return Design(steps, tuple(_str(o) for o in _list(doc["outputs"])))


def _step(doc: Any) -> Step:
    if isinstance(doc, dict) and "predef" in doc:
        d = _obj(doc, ("predef", "args", "attrs", "name"))
        return PredefD(_op(d["predef"]), tuple(_str(a) for a in _list(d["args"])),
                       _attrs(d["attrs"]), _str(d["name"]))
    d = _obj(doc, ("loads", "ops", "stores", "axes", "looped"))
    loads = tuple(LoadD(_str(src), _axes(imap), _opt_int(fmap))
                  for src, imap, fmap in (_tuple(x, 3) for x in _list(d["loads"])))
    block_ops: list[OpD] = []
    for x in _list(d["ops"]):
        op, args, attrs = _tuple(x, 3)
        idx = tuple(_int(a, len(loads) + len(block_ops)) for a in _list(args))
        block_ops.append(OpD(_op(op), idx, _attrs(attrs)))
    tiles = len(loads) + len(block_ops)
    stores = tuple(StoreD(_int(t, tiles), _str(name), _axes(omap))
                   for t, name, omap in (_tuple(x, 3) for x in _list(d["stores"])))
    if not isinstance(d["looped"], bool):
        raise BadDesign("looped is not a boolean")
    return CustomD(loads, tuple(block_ops), stores, _int(d["axes"], 4), d["looped"])


def _obj(doc: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(doc, dict) or set(doc) != set(keys):
        raise BadDesign(f"expected an object with keys {', '.join(keys)}")
    return doc


def _list(doc: Any) -> list[Any]:
    if not isinstance(doc, list):
        raise BadDesign("expected a list")
    return doc


def _tuple(doc: Any, n: int) -> list[Any]:
    if not isinstance(doc, list) or len(doc) != n:
        raise BadDesign(f"expected a list of {n}")
    return doc


def _str(doc: Any) -> str:
    if not isinstance(doc, str):
        raise BadDesign("expected a string")
    return doc


def _int(doc: Any, below: int) -> int:
    if type(doc) is not int or not 0 <= doc < below:
        raise BadDesign(f"expected an integer in [0, {below})")
    return doc


def _opt_int(doc: Any) -> int | None:
    return None if doc is None else _int(doc, 4)  # a tensor dimension (rank <= 4)


def _axes(doc: Any) -> tuple[int | None, int | None, int | None]:
    a, b, c = (_opt_int(x) for x in _tuple(doc, 3))
    return a, b, c


def _op(doc: Any) -> str:
    name = _str(doc)
    try:
        ops.get(name)
    except KeyError:
        raise BadDesign(f"unknown operator '{name}'") from None
    return name


def _attrs(doc: Any) -> tuple[tuple[str, int | float | bool | str], ...]:
    out = []
    for pair in _list(doc):
        k, v = _tuple(pair, 2)
        if not isinstance(v, (int, float, bool, str)):
            raise BadDesign("an attribute value is a number, a boolean or a string")
        out.append((_str(k), v))
    return tuple(out)
