"""The Z3 oracle: may a candidate's expression still become part of the target?

Abstract expressions (:mod:`.abstract`) become Z3 terms over an uninterpreted sort
``E`` (tensors) with uninterpreted functions (``add mul div exp silu sqrt ...``,
``sum: N x E -> E``, ``size: N -> E``); sizes are constants of a second sort ``N`` with
ground facts ``le(a, b)`` between every pair in use. Two families of axioms, after the
Mirage paper (§4.3):

- *equivalence*: ``add``/``mul`` commutative and associative, ``mul(div(a, b), c) = div(mul(a, c), b)``, ``div(div(a, b), c) =
  div(a, mul(b, c))``, ``sum(n, div(a, b)) = div(sum(n, a), b)``,
  ``sum(n, add(a, b)) = add(sum(n, a), sum(n, b))`` (indices are abstracted, so sums
  commute with what the abstraction cannot tell apart, exactly as in Mirage).
  Distributivity of ``mul`` over ``add`` is left out: with commutativity and
  associativity, E-matching on it does not saturate (every query on the ntrans
  program timed out), and none of the benchmarks needs it;
- *subexpression*: a predicate ``S`` holding for the target's outputs and closed
  downwards (``S(f(x, y)) -> S(x) & S(y)`` for every function), and *partial sums*:
  ``S(sum(n, x)) & le(m, n) -> S(sum(m, x))`` (a forloop or grid split of a reduction
  computes a partial sum of it).

A query asks Z3 to refute ``not S(c)`` (subexpression) or ``c != t`` (equivalence).
Answers: ``unsat`` -> yes; ``sat`` -> no. ``unknown`` comes in two kinds: *incomplete
quantifiers* means E-matching saturated every axiom instance reachable from the terms
without finding a proof, and the candidate is pruned (Mirage's rule too: only a proof
keeps a candidate); any other unknown (the per-query resource limit) *keeps* the
candidate. The per-query limit is Z3's deterministic resource count (``rlimit``,
:data:`QUERY_RLIMIT`), not time, so the answer does not depend on the machine's load;
a wall-clock timeout (``timeout_ms``, far above what the resource limit allows) stays as
a safety stop, and a query it ends is counted apart (``unknown_timeout``: the search
then reports that its result may depend on timing).
Both are safe for correctness: pruning only ever removes candidates, and every
candidate the search emits is verified independently (:mod:`.verify`), so a wrong
answer here can cost completeness or time, never a wrong µGraph. Every query is asked
once per target (a cache keyed by the normalised term).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import z3

from mirage_cli.semantics.terms import REDUCTIONS, Term, children

# Functions of two tensor arguments; everything else with tensor arguments is unary
# (or n-ary via folding for add/mul). Sizes take the second sort.
_BINARY = ("add", "mul", "div", "concat")

# Z3 resource units per query. Z3 counts them deterministically; on this machine it
# spends about 120 000 a second on these queries, so this is about the 1 s timeout the
# oracle used before; the largest query of the Llama layer's parts needs about 5 200.
QUERY_RLIMIT = 150_000
# Wall-clock safety stop per query (ms): a query ended by it is reported, not hidden.
QUERY_TIMEOUT_MS = 20_000


@dataclass
class OracleStats:
    queries: int = 0
    cache_hits: int = 0
    unknown_saturated: int = 0
    unknown_limit: int = 0     # the resource limit ended the query (deterministic)
    unknown_timeout: int = 0   # the wall-clock safety stop ended it (timing-dependent)
    counted_out: int = 0   # rejected by the occurrence-count filter, before Z3
    seconds: float = 0.0


@dataclass
class Oracle:
    """Subexpression / equivalence queries against one target (a tuple of output
    expressions). Not thread-safe; each worker process builds its own."""

    targets: Sequence[Term]
    timeout_ms: int = QUERY_TIMEOUT_MS
    rlimit: int = QUERY_RLIMIT
    stats: OracleStats = field(default_factory=OracleStats)

    def __post_init__(self) -> None:
        self._ctx = z3.Context()
        self.E = z3.DeclareSort("E", self._ctx)
        self.N = z3.DeclareSort("N", self._ctx)
        self._funcs: dict[tuple[str, int], z3.FuncDeclRef] = {}
        self._sizes: dict[int, z3.ExprRef] = {}
        self._consts: dict[str, z3.ExprRef] = {}
        self._cache: dict[tuple[str, Term, int], bool] = {}
        self._fits: dict[Term, bool] = {}  # _may_fit's answers: the search asks again
        self._enc: dict[Term, z3.ExprRef] = {}
        self.S = z3.Function("S", self.E, z3.BoolSort(ctx=self._ctx))
        self.le = z3.Function("le", self.N, self.N, z3.BoolSort(ctx=self._ctx))
        self.solver = z3.Solver(ctx=self._ctx)
        self.solver.set("rlimit", self.rlimit)  # per check: Z3 counts from the call
        self.solver.set("timeout", self.timeout_ms)
        self.solver.set("mbqi", False)  # E-matching only: saturation answers quickly
        # Z3 otherwise catches Ctrl-C during a check itself and answers "unknown", which
        # the search reads as a timeout and goes on: the interrupt was lost (a search
        # interrupted while in a query ran to its budget). Without it Python's handler
        # sees the signal once the query returns (within its resource limit). A global
        # parameter: the solver-level one is not honoured.
        z3.set_param("ctrl_c", False)
        self._axiomatised: set[str] = set()
        self._target_z3 = [self.encode(t) for t in self.targets]
        self._target_counts = [_counts(t) for t in self.targets]
        for t in self._target_z3:
            self.solver.add(self.S(t))

    # -- encoding ------------------------------------------------------------

    def _fn(self, name: str, arity: int) -> z3.FuncDeclRef:
        key = (name, arity)
        if key not in self._funcs:
            if name in REDUCTIONS:
                decl = z3.Function(name, self.N, self.E, self.E)
            elif name == "size":
                decl = z3.Function(name, self.N, self.E)
            else:
                decl = z3.Function(name, *([self.E] * arity), self.E)
            self._funcs[key] = decl
            self._axiomatise(name, decl, arity)
        return self._funcs[key]

    def _size(self, n: int) -> z3.ExprRef:
        if n not in self._sizes:
            c = z3.Const(f"n{n}", self.N)
            facts = [c != d for d in self._sizes.values()]
            for m, d in self._sizes.items():
                facts.append(self.le(d, c) if m <= n else z3.Not(self.le(d, c)))
                facts.append(self.le(c, d) if n <= m else z3.Not(self.le(c, d)))
            facts.append(self.le(c, c))
            self._sizes[n] = c
            self.solver.add(*facts)
        return self._sizes[n]

    def _const(self, name: str) -> z3.ExprRef:
        if name not in self._consts:
            self._consts[name] = z3.Const(name, self.E)
        return self._consts[name]

    def encode(self, t: Term) -> z3.ExprRef:
        """The Z3 term of ``t`` (memoised: candidate terms share most subterms)."""
        hit = self._enc.get(t)
        if hit is None:
            hit = self._enc[t] = self._encode(t)
        return hit

    def _encode(self, t: Term) -> z3.ExprRef:
        head = t[0]
        if head == "in":
            return self._const(f"in:{t[1]}")
        if head == "const":
            return self._const(f"c:{t[1]}")
        if head == "size":
            return self._fn("size", 1)(self._size(t[1]))
        if head in REDUCTIONS:
            return self._fn(head, 2)(self._size(t[1]), self.encode(t[2]))
        args = [self.encode(c) for c in children(t)]
        if head in ("add", "mul"):
            f = self._fn(head, 2)
            acc = args[-1]
            for a in reversed(args[:-1]):
                acc = f(a, acc)
            return acc
        return self._fn(head, len(args))(*args)

    # -- axioms ----------------------------------------------------------------

    def _axiomatise(self, name: str, f: z3.FuncDeclRef, arity: int) -> None:
        """Add the axioms that mention ``name`` (once; the solver is at base level
        whenever new symbols are encoded: queries use assumptions, never push)."""
        if name in self._axiomatised:
            return
        self._axiomatised.add(name)
        x, y, z = z3.Consts("x y z", self.E)
        m, n = z3.Consts("m n", self.N)
        S, fa = self.S, z3.ForAll
        ax: list[z3.BoolRef] = []
        if name in REDUCTIONS:
            ax.append(fa([n, x], z3.Implies(S(f(n, x)), S(x)), patterns=[f(n, x)]))
            ax.append(fa([m, n, x], z3.Implies(z3.And(S(f(n, x)), self.le(m, n)),
                                               S(f(m, x))),
                         patterns=[z3.MultiPattern(f(m, x), f(n, x))]))
        elif name == "size":
            pass
        elif arity == 2:
            ax.append(fa([x, y], z3.Implies(S(f(x, y)), z3.And(S(x), S(y))),
                         patterns=[f(x, y)]))
        else:
            ax.append(fa([x], z3.Implies(S(f(x)), S(x)), patterns=[f(x)]))
        if name in ("add", "mul"):
            ax.append(fa([x, y], f(x, y) == f(y, x), patterns=[f(x, y)]))
            ax.append(fa([x, y, z], f(f(x, y), z) == f(x, f(y, z)), patterns=[f(f(x, y), z)]))
        self.solver.add(*ax)
        self._cross_axioms()

    def _cross_axioms(self) -> None:
        """Axioms relating two symbols, added once both are declared."""
        have = {k[0]: v for k, v in self._funcs.items()}
        x, y, z = z3.Consts("x y z", self.E)
        n = z3.Const("n", self.N)
        fa = z3.ForAll
        rules: list[tuple[str, tuple[str, ...], Callable[[], z3.BoolRef]]] = [
            ("mul_div", ("mul", "div"), lambda: fa(
                [x, y, z], have["mul"](have["div"](x, y), z) ==
                have["div"](have["mul"](x, z), y), patterns=[have["mul"](have["div"](x, y), z)])),
            ("div_div", ("mul", "div"), lambda: fa(
                [x, y, z], have["div"](have["div"](x, y), z) ==
                have["div"](x, have["mul"](y, z)), patterns=[have["div"](have["div"](x, y), z)])),
            ("sum_div", ("sum", "div"), lambda: fa(
                [n, x, y], have["sum"](n, have["div"](x, y)) ==
                have["div"](have["sum"](n, x), y), patterns=[have["sum"](n, have["div"](x, y))])),
            ("sum_add", ("sum", "add"), lambda: fa(
                [n, x, y], have["sum"](n, have["add"](x, y)) ==
                have["add"](have["sum"](n, x), have["sum"](n, y)),
                patterns=[have["sum"](n, have["add"](x, y))])),
        ]
        # Derived subexpression lemmas (consequences of mul_div, div_div, sum_div,
        # commutativity and the downward closure of S), stated with triggers on the
        # target's own terms: E-matching cannot find the instances of those axioms
        # that would build a larger term around a candidate (e.g. that ``x / r`` is
        # part of ``(c * sum(x * y)) / (r * s)``). Each lemma only yields smaller terms.
        S = self.S
        w = z3.Const("w", self.E)
        rules += [
            ("sub_div_mul", ("mul", "div"), lambda: fa(
                [x, y, z], z3.Implies(S(have["div"](have["mul"](x, y), z)),
                                      S(have["div"](y, z))),
                patterns=[have["div"](have["mul"](x, y), z)])),
            ("sub_div_mul_mul", ("mul", "div"), lambda: fa(
                [x, y, z, w], z3.Implies(S(have["div"](have["mul"](x, y), have["mul"](z, w))),
                                         S(have["div"](x, z))),
                patterns=[have["div"](have["mul"](x, y), have["mul"](z, w))])),
            ("sub_div_sum", ("sum", "div"), lambda: fa(
                [n, x, y], z3.Implies(S(have["div"](have["sum"](n, x), y)),
                                      S(have["div"](x, y))),
                patterns=[have["div"](have["sum"](n, x), y)])),
        ]
        for key, needs, make in rules:
            if key not in self._axiomatised and all(s in have for s in needs):
                self._axiomatised.add(key)
                self.solver.add(make())

    # -- queries ---------------------------------------------------------------

    def is_subexpr(self, t: Term) -> bool:
        """May ``t`` be a subexpression of (some output of) the target?"""
        fits = self._fits.get(t)
        if fits is None:
            fits = self._fits[t] = self._may_fit(t)
        if not fits:
            self.stats.counted_out += 1
            return False
        return self._cached("sub", t, -1)

    def _may_fit(self, t: Term) -> bool:
        """A necessary condition checked before Z3: every axiom preserves how often
        each input, and each function symbol no axiom mentions (``exp``, ``silu``,
        ``sqrt`` ...), occurs in a term, and a subterm never has more of them than its
        term; so ``t`` may be a subexpression only if some output has at least as
        many of each. (A sound filter: it never rejects what Z3 could prove.)"""
        need = _counts(t)
        return any(all(have.get(k, 0) >= n for k, n in need.items())
                   for have in self._target_counts)

    def is_equiv(self, t: Term, output: int) -> bool:
        """Is ``t`` equivalent to the target's output number ``output``?"""
        if _counts(t) != self._target_counts[output]:  # see _may_fit: counts are kept
            self.stats.counted_out += 1
            return False
        return self._cached("eq", t, output)

    def _cached(self, kind: str, t: Term, output: int) -> bool:
        key = (kind, t, output)
        hit = self._cache.get(key)
        if hit is not None:
            self.stats.cache_hits += 1
            return hit
        result = self._ask(kind, t, output)
        self._cache[key] = result
        return result

    def _ask(self, kind: str, t: Term, output: int) -> bool:
        import time

        start = time.perf_counter()
        c = self.encode(t)  # at base level: new symbols add their axioms here
        # The negated goal is an assumption, not an assertion: axiom instances found
        # for earlier queries stay in the solver, so later queries start warm.
        goal = z3.Not(self.S(c)) if kind == "sub" else c != self._target_z3[output]
        r = self.solver.check(goal)
        reason = self.solver.reason_unknown() if r == z3.unknown else ""
        self.stats.queries += 1
        self.stats.seconds += time.perf_counter() - start
        if r == z3.unsat:
            return True
        if r == z3.sat:
            return False
        if "incomplete quantifiers" in reason:
            self.stats.unknown_saturated += 1
            return False
        # Z3 says "canceled" for both limits; only the wall-clock one takes its time.
        if time.perf_counter() - start < self.timeout_ms / 1000:
            self.stats.unknown_limit += 1
        else:
            self.stats.unknown_timeout += 1
        return True


# Symbols that some axiom creates, deletes or duplicates; their counts may change.
_REWRITTEN = frozenset({"add", "mul", "div", "sum", "size", "const"})


def _counts(t: Term) -> dict[object, int]:
    """Occurrences of each input and each non-rewritten function symbol in ``t``."""
    out: dict[object, int] = {}

    def walk(x: Term) -> None:
        head = x[0]
        if head == "in":
            out[("in", x[1])] = out.get(("in", x[1]), 0) + 1
        elif head not in _REWRITTEN:
            out[head] = out.get(head, 0) + 1
        for c in children(x):
            walk(c)

    walk(t)
    return out
