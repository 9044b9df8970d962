"""Automatic shape reuse through the search cache (``mirage opt -D batch=16`` after a
search at batch 8).

A complete search records, in the cache's family entry (:func:`.cache.get_family`:
the same program at any sizes, same options), its whole *design pool* (every design
the enumeration found, split forms included; designs are size-free,
:mod:`.design`), the *size pattern* of its sizes (:func:`.family.size_pattern`), each
design's best predicted µs where it tuned the design fully, and the designs its
verification rejected. At new sizes :func:`reused` hands the pool to :func:`mirage_cli.search.driver.reuse_designs`, which
tunes, ranks and certifies at the new sizes:

- same size pattern: the enumeration at the new sizes would find exactly this pool
  (the generator sees sizes only through the facts the pattern records), so nothing is
  enumerated: no search units, no Z3;
- another pattern that differs only in coincidences between sizes (lora, gqa at batch
  16: the same dimensions split, :func:`.family.split_facts`): nothing is enumerated
  either, the pool is ranked alone;
- another pattern where other dimensions split (batch 1 -> 8: dimensions of 1 become
  splittable): the designs enumerated at the new sizes are ranked beside the pool's.

Either way the ranking is a search's ranking at the new sizes over at least the
designs a search would find there, and only the candidates the caller needs are
certified, best first. In the first two cases at sizes no smaller than the family's
(:func:`_bounds`), the designs are tuned in the order of their predicted µs at the
family's sizes, and only until the next one's, less a slack, is above the best found
(:func:`mirage_cli.search.driver._walked`: a design's predicted time does not fall as
its tensors grow, so none after it can rank above those); lora 8 -> 16 tunes 3 of
its 50 designs. A reuse whose best is predicted slower than the unfused
program gives way to a search, which would also cut the program into parts. A
candidate whose design the family's search certified, and which with its program
satisfies the carry precondition against that certified
µGraph (:mod:`mirage_cli.verifier.carry`: the only size that changes is a pointwise
dimension of both), takes that certificate (``verification.carried``; :func:`_carried`
is the ``certify`` hook of the driver's verification loop); any other is certified at
the smallest batch where it keeps its tiles and the precondition holds, and carried
from there (:func:`_certified_small`), or else at the sizes it ships at.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from mirage_cli import serialize
from mirage_cli.builder import GraphBuilder
from mirage_cli.console import info
from mirage_cli.ir import Graph
from mirage_cli.search.cache import get_family, has, key, peek, put
from mirage_cli.search.design import Design
from mirage_cli.search.family import (
    BadDesign,
    design_from_json,
    indices_from_json,
    size_pattern,
    split_facts,
    times_from_json,
)
from mirage_cli.search.verify import Verdict
from mirage_cli.verifier.api import DEFAULT_BOUND

if TYPE_CHECKING:
    from mirage_cli.verifier.carry import Carry


def reused(program: Graph, options: Any, on_progress: Any = None,
           need: int | None = None, budget: float | None = None, jobs: int = 1) -> Any:
    """Automatic shape reuse: when the cache holds no entry for ``program`` but a
    family entry (the same program at other sizes, the same options), that search's
    design pool is tuned, ranked and certified at ``program``'s sizes (enumerating at
    these sizes too when the size pattern differs; ``budget`` seconds, ``jobs``
    workers), and only ``need`` (default: ``top``) are certified, best first. Returns
    the :class:`~mirage_cli.search.driver.Outcome`, or None when there is nothing to
    reuse or no design verifies at these sizes (the caller then searches)."""
    from mirage_cli.search.driver import Outcome, cuts_too, reuse_designs

    opts = options.as_json()
    k = key(program, opts)
    if has(k) and not _short(k, need or options.top):
        return None
    fam = get_family(program, opts)
    if fam is None:
        return None
    sizes, pattern = fam["sizes"], fam["pattern"]
    try:
        pool = [design_from_json(d) for d in fam["designs"]]
        times = times_from_json(fam["tuned_us"], len(pool))
        refused = {pool[i] for i in indices_from_json(fam["rejected"], len(pool))}
    except BadDesign as e:
        info(f"warning: ignoring the cached family entry of this program: {e}")
        return None
    same = pattern == size_pattern(program)
    old = _at_sizes(program, sizes)
    coincidences = not same and old is not None and split_facts(old) == split_facts(program)
    source = _certified_at(old, opts)
    res = reuse_designs(program, pool, options, on_progress, need, budget, jobs,
                        enumerate_here=not (same or coincidences),
                        certify=partial(_carried, program, source, _moved(program, sizes),
                                        options.seed),
                        bounds=_bounds(program, sizes, pool, times), refused=refused)
    at = ", ".join(f"{k}={v}" for k, v in sorted(sizes.items()))
    if not res.candidates:
        info(f"search: no design of the cached search at {at} verifies at these sizes; "
             f"searching")
        return None
    if cuts_too(program, res.candidates):
        # A search here would also cut the program into parts (driver.cuts_too), which
        # a pool of whole-program designs cannot stand for: mqa_decode at batch 8 after
        # a search at batch 1 shipped its unfused lowering, where a search at batch 8
        # found a three-kernel design the model ranks first (docs/perf-log.md v20).
        info(f"search: the best design of the cached search at {at} is predicted slower "
             f"than the unfused program at these sizes; searching")
        return None
    found = res.progress.designs - res.progress.reused
    how = ("the same size pattern: nothing enumerated" if same else
           "another size pattern, the same dimensions split: nothing enumerated"
           if coincidences else
           f"another size pattern: ranked with the {found} more found at these sizes")
    info(f"search: reused the {res.progress.reused} design(s) of the cached search of this "
         f"program at {at} ({how}); {res.progress.tuned} tuned fully, "
         f"{len(res.candidates)} verified at these sizes")
    pairs = [(c.graph, {**c.meta(i), "reused_from": f"cache ({at})"})
             for i, c in enumerate(res.candidates)]
    text = serialize.dumps_candidates(pairs)
    # Stored as this program's result: a rerun at these sizes is an exact hit (one
    # that needs more candidates than were certified reuses again: _short).
    if res.complete:
        put(k, text, program, opts)
    return Outcome(text, pairs, False, True, res.progress)


def _bounds(program: Graph, sizes: dict[str, Any], pool: list[Design],
            times: list[float | None]) -> dict[Design, float] | None:
    """The pool designs' predicted µs at the family's sizes, where the search tuned
    them, when no parameter of ``program`` is smaller than there: the order and the
    bound of the reuse's tuning (:func:`mirage_cli.search.driver._walked`). None at
    smaller sizes, where a design's time falls and bounds nothing."""
    if not all(type(sizes.get(k)) is int and v >= sizes[k] for k, v in program.params):
        return None
    return {d: us for d, us in zip(pool, times) if us is not None}


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


# -- certificates carried along a pointwise size parameter (verifier/carry.py) ------------


@dataclass(frozen=True)
class Certified:
    """The search at the family's sizes: its program, rebuilt at those sizes, and its
    certified candidates by design (each with its verification record)."""

    program: Graph
    by_design: dict[Design, tuple[Graph, dict[str, Any]]]


def _certified_at(old: Graph | None, opts: dict[str, Any]) -> Certified | None:
    """The exact cache entry of the family's search, when the program rebuilt at its
    sizes (``old``) has one whose candidates load (checked as µGraphs); None otherwise
    (then every reused candidate is certified at smaller or at the new sizes)."""
    from mirage_cli.diagnostics import MirageError
    from mirage_cli.search.design import design_of

    text = None if old is None else peek(key(old, opts))
    if old is None or text is None:
        return None
    try:
        cands = serialize.loads_candidates(text, "<cache>")
    except MirageError:
        return None
    by_design: dict[Design, tuple[Graph, dict[str, Any]]] = {}
    for g, meta in cands:
        by_design.setdefault(design_of(g)[0], (g, meta))
    return Certified(old, by_design)


def _at_sizes(program: Graph, sizes: dict[str, Any]) -> Graph | None:
    """``program`` rebuilt at other parameter values (its inputs' dimensions as
    written, re-evaluated; its operators re-typed), or None where that is not possible
    (a custom kernel, a dimension not written over the parameters, a shape that no
    longer fits). A program whose attributes hold sizes (a reshape) rebuilds to another
    program, whose cache key then finds nothing."""
    from mirage_cli.diagnostics import MirageError
    from mirage_cli.parser import eval_int
    from mirage_cli.syntax import parse_dim_expr

    if set(sizes) != {k for k, _ in program.params} or \
            not all(type(v) is int for v in sizes.values()):
        return None
    params = tuple((k, int(sizes[k])) for k, _ in program.params)
    b = GraphBuilder(program.name, params)
    try:
        for i in program.inputs:
            if len(i.dims_src) != i.value.type.rank:
                return None
            shape = [eval_int(parse_dim_expr(s), dict(params), "a dimension")
                     for s in i.dims_src]
            b.input(i.value.name, shape, i.value.type.dtype, i.dims_src, weight=i.weight)
        for op in program.ops:
            if op.block is not None or len(op.outputs) != 1:
                return None
            b.op_with(op.op, op.inputs, dict(op.attrs), out=op.outputs[0].name)
        for o in program.outputs:
            b.output(o)
        return b.build()
    except MirageError:
        return None


def _carried(program: Graph, source: Certified | None, param: str | None, seed: int,
             d: Design, g: Graph, first: bool) -> Verdict | None:
    """The driver's ``certify`` hook (:data:`mirage_cli.search.driver.Certify`): the
    verdict of ``g`` carried from the family's certified candidate of the same design;
    failing that, certified at a smaller value of ``param`` (the size that changed) and
    carried from there (:func:`_certified_small`); None (certify it at these sizes)
    when neither applies. The candidate to ship (``first``) also carries the float64
    and numerics records when the certified one has them; when it does not, the driver
    runs those two checks at these sizes, as for any chosen candidate."""
    v = None if source is None else _from_family(program, source, seed, d, g, first)
    if v is None and param is not None:
        v = _certified_small(program, param, seed, d, g, first)
    return v


def _from_family(program: Graph, source: Certified, seed: int, d: Design, g: Graph,
                 first: bool) -> Verdict | None:
    """``g``'s verdict carried from the family's certified candidate of design ``d``."""
    from mirage_cli.verifier.carry import NotCarried, carry

    found = source.by_design.get(d)
    if found is None:
        return None
    g_old, meta = found
    rec = meta.get("verification")
    if not _trial_certified(rec, seed):
        return None
    assert isinstance(rec, dict)
    try:
        how = carry(source.program, g_old, program, g)
    except NotCarried as e:
        info(f"search: certificate not carried from {_at(source.program)}: {e}")
        return None
    floats = {k: rec[k] for k in ("float64", "numerics")} if first and _floats_ok(rec) \
        else {}
    info(f"search: certificate carried from {_at(source.program)} along '{how.param}' "
         f"(no finite-field trials at these sizes)")
    return _carried_verdict(rec.get("method"), rec["seed"], rec["certificate"], how,
                            source.program, floats)


def _moved(program: Graph, sizes: dict[str, Any]) -> str | None:
    """The one size parameter whose value differs between the family's search and
    ``program`` (None: none or several)."""
    diff = [k for k, v in program.params if sizes.get(k) != v]
    return diff[0] if len(diff) == 1 else None


# The smaller sizes tried for a certificate, smallest first: the trials' cost grows
# with every tensor that depends on the parameter.
SMALL_TRIES = 16


def _certified_small(program: Graph, param: str, seed: int, d: Design, g: Graph,
                     first: bool) -> Verdict | None:
    """``g`` certified at the smallest value of ``param`` below this one where the same
    design, every block's tiles kept (:func:`.carry.grids_at`), instantiates and the
    carry precondition holds, then carried here. gqa at batch 16 ships a tiling that
    the search at batch 8 did not certify; its trials and float checks at batch 16
    took 28 s of a 35 s reuse, at batch 1 they hold a sixteenth of the data. None when
    no smaller size qualifies, or the candidate fails there (then it is certified at
    these sizes, as any other)."""
    from mirage_cli.diagnostics import MirageError
    from mirage_cli.search.design import design_of, instantiate
    from mirage_cli.search.driver import float_checks
    from mirage_cli.search.verify import verify
    from mirage_cli.verifier.carry import NotCarried, carry, grids_at

    now = dict(program.params)[param]
    tuning = design_of(g)[1]
    for value in range(1, min(now, SMALL_TRIES + 1)):
        small = _at_sizes(program, {**dict(program.params), param: value})
        grids = None if small is None else grids_at(small, program, g)
        if small is None or grids is None or len(grids) != len(tuning):
            continue
        g_small = instantiate(small, d, tuple((gr, t[1]) for gr, t in zip(grids, tuning)))
        if g_small is None:
            continue
        try:
            how = carry(small, g_small, program, g)
        except NotCarried:
            continue
        try:
            verdict = verify(small, g_small, seed)
        except MirageError:  # not the program's signature: the driver rejects it
            return None
        floats = float_checks(small, g_small, seed) if first and verdict.ok else {}
        if not verdict.ok or floats is None:
            return None
        info(f"search: certified at {_at(small)} and carried along '{how.param}' "
             f"(the same design and tiles; no finite-field trials at these sizes)")
        return _carried_verdict(verdict.method, seed, verdict.detail["certificate"], how,
                                small, floats)
    return None


def _carried_verdict(method: Any, seed: int, certificate: Any, how: Carry,
                     certified: Graph, floats: dict[str, Any]) -> Verdict:
    """The verdict of a candidate whose certificate (``method``, ``seed``, its record)
    was won on ``certified``, the program at other sizes, and carries to these along
    ``how`` (with the float64 and numerics records in ``floats``, when they came with
    it)."""
    return Verdict(True, f"{method}, carried along a pointwise size parameter", seed,
                   {"certificate": certificate,
                    "carried": {**how.as_json(), "certified_at": dict(certified.params)},
                    **floats})


def _trial_certified(rec: Any, seed: int) -> bool:
    """A record of finite-field trials run (not itself carried) to the default bound
    with this seed, verdict equivalent."""
    if not isinstance(rec, dict) or rec.get("equivalent") is not True or "carried" in rec \
            or rec.get("seed") != seed:
        return False
    cert = rec.get("certificate")
    bound = cert.get("bound") if isinstance(cert, dict) else None
    return isinstance(cert, dict) and cert.get("verdict") == "equivalent" and \
        type(bound) is float and bound <= DEFAULT_BOUND


def _floats_ok(rec: dict[str, Any]) -> bool:
    f64, num = rec.get("float64"), rec.get("numerics")
    return isinstance(f64, dict) and f64.get("verdict") == "close" and \
        isinstance(num, dict) and num.get("verdict") == "safe"


def _at(program: Graph) -> str:
    return ", ".join(f"{k}={v}" for k, v in program.params)
