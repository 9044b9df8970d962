"""Property: a random row-wise program and the same operators fused into one custom
kernel (rows split over the grid) are equivalent for the finite-field verifier, and
changing one operator of the fused kernel is caught."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from mirage_cli import interp
from mirage_cli.builder import GraphBuilder
from mirage_cli.ir import Graph
from mirage_cli.verifier.api import Verifier

# (operator, arity, attrs); every one acts row by row on 4x8 tensors.
STEPS = [("add", 2, {}), ("sub", 2, {}), ("mul", 2, {}), ("exp", 1, {}), ("silu", 1, {}),
         ("square", 1, {}), ("neg", 1, {}), ("mul_scalar", 1, {"scalar": 0.375}),
         ("matmul", 1, {}), ("rowsum", 1, {}), ("rms_norm", 1, {}), ("div", 2, {})]
SWAP = {"add": "sub", "sub": "add", "mul": "add", "exp": "silu", "silu": "relu",
        "square": "neg", "neg": "square", "mul_scalar": "neg", "matmul": "neg",
        "rowsum": "neg", "rms_norm": "neg", "div": "mul"}

program = st.lists(st.tuples(st.integers(0, len(STEPS) - 1), st.integers(0, 9)),
                   min_size=1, max_size=6)


def _apply(add, steps: list[tuple[int, int]], xs: list[str], w: str,  # type: ignore[no-untyped-def]
           mutate: int | None) -> str:
    """Build the steps with ``add(op, *ins, **attrs)``; values: inputs then results."""
    vals = list(xs)
    exp_used = False
    for k, (i, pick) in enumerate(steps):
        name, _, attrs = STEPS[i]
        if name == "exp" and exp_used:
            name = "square"
        exp_used = exp_used or name == "exp"
        if mutate == k:
            name = SWAP[name]
        cur, other = vals[-1], vals[pick % len(vals)]
        if name == "matmul":
            vals.append(add("matmul", cur, w))
        elif name == "rowsum":
            vals.append(add("mul", cur, add("sum", cur, dim=1, keepdim=True)))
        elif name in ("add", "sub", "mul", "div"):
            vals.append(add(name, cur, other))
        else:
            # attrs belong to the drawn operator, which a swap may have replaced.
            vals.append(add(name, cur, **(attrs if name == "mul_scalar" else {})))
    return vals[-1]


def unfused(steps: list[tuple[int, int]]) -> Graph:
    b = GraphBuilder("unfused")
    xs = [b.input(f"X{i}", (4, 8), "f32") for i in range(2)]
    w = b.input("W", (8, 8), "f32")
    b.output(_apply(b.op, steps, xs, w, None))
    return b.build()


def fused(steps: list[tuple[int, int]], mutate: int | None = None) -> Graph:
    b = GraphBuilder("fused")
    xs = [b.input(f"X{i}", (4, 8), "f32") for i in range(2)]
    w = b.input("W", (8, 8), "f32")
    k = b.custom((2, 1, 1), 128, 1)
    tiles = [k.load(x, (0, None, None)) for x in xs]
    wt = k.load(w)
    out = _apply(k.op, steps, tiles, wt, mutate)
    (o,) = k.finish([(k.op("acc_sum", out), None, (0, None, None))])
    b.output(o)
    return b.build()


@settings(max_examples=40, deadline=None)
@given(program)
def test_fusing_preserves_the_function(steps: list[tuple[int, int]]) -> None:
    ref = unfused(steps)
    # A program that divides by an identically zero value (e.g. x - x) has no value to
    # compare; the verifier rightly answers "undecided" for it (tested elsewhere).
    out = interp.run(ref, interp.random_inputs(ref, seed=0))[ref.outputs[0]]
    assume(bool(np.isfinite(out).all()))
    v = Verifier(ref, seed=len(steps))
    assert v.check(fused(steps), trials=2).equivalent is True


@settings(max_examples=40, deadline=None)
@given(program, st.integers(0, 5))
@example([(0, 1), (11, 2)], 0)  # the mutant computes (x - x) and divides by it
# Program and mutant are both identically zero: (y + 2x) x^2 / x - (y + 2x) x, and the
# same with y - x for y + x. float64 leaves rounding noise there, which is no difference.
@example([(0, 0), (0, 0), (2, 0), (2, 0), (11, 0), (1, 4)], 0)
def test_a_changed_operator_is_caught(steps: list[tuple[int, int]], where: int) -> None:
    where %= len(steps)
    v = Verifier(unfused(steps), seed=1)
    a, b = fused(steps), fused(steps, where)
    if a == b:
        return
    # The change may be invisible if the changed value is unused downstream, so judge
    # by the float64 reference: if the real outputs differ, the field must say so.
    from mirage_cli.verifier.crosscheck import crosscheck

    cc = crosscheck(a, b)
    # NaN from a division by a value that is zero on part of the domain (relu(x)/relu(x))
    # is a domain error, not a different function: the field, where relu is a random
    # function, rightly sees x/x = 1 there. Only finite differences must be caught.
    finite = all(np.isfinite(o).all() for o in cc.outputs_a + cc.outputs_b)
    # Outputs that are rounding noise around zero in both graphs (a function that is
    # identically zero, computed by cancellation) do not tell two functions apart.
    noise = finite and max(float(np.abs(o).max()) for o in cc.outputs_a + cc.outputs_b) < 1e-9
    if not cc.close and finite and not noise:
        verdict = v.check(b, trials=2)
        # Never "equivalent"; "undecided" only where the mutant divides by a value
        # that is identically zero (e.g. x - x), which no trial can evaluate.
        assert verdict.equivalent is False or (
            verdict.equivalent is None and "zero divisor" in verdict.reason), verdict
