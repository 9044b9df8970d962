"""The conformance suite every registry row must pass, as functions over one row.

For an operator the suite builds two programs that compute the same thing: the
operator applied to whole tensors at kernel level (the reference) and the operator
inside a custom kernel, on tiles of a grid of blocks (the candidate). Accumulators
have no kernel-level form, so for them the reference is the accumulator over one
forloop iteration (one tile spanning the whole reduced dimension) and the candidate
walks the same data in four iterations. Then each interpretation of the row must
agree with itself across the two forms, on random inputs:

- the numpy interpreter (float64, elementwise tolerance);
- the finite-field evaluation (the verifier finds the two equivalent);
- the abstract term (the search gives both outputs the same term);
- and the interpretations must agree with each other: where the field model is exact
  arithmetic, numpy's result on integer inputs mapped into the field is the field's
  residue; a random-function field model uses a function symbol of the abstract term.

:func:`compiles` lowers the candidate and compiles it with NVRTC (no GPU needed);
:func:`runs_on_gpu` runs it against the float64 interpreter. A wrong CUDA spelling
fails the first or the second.

Plain functions taking an operator name, so a test can run them on a scratch registry
(:func:`mirage_cli.ops.scratch_registry`) holding operators the product does not have.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mirage_cli import interp, ops
from mirage_cli.ir import Graph
from mirage_cli.parser import parse_text
from mirage_cli.semantics.accum import Reduce, is_extreme
from mirage_cli.semantics.terms import show

ROWS, COLS, GRID = 64, 256, 4
# Attribute values a conformance program gives an operator's required attributes.
ATTR_VALUES = {"scalar": "0.75", "dim": "1", "width": "8", "d0": str(ROWS * COLS)}


@dataclass(frozen=True)
class Pair:
    """Two programs that must compute the same outputs from the same inputs."""

    op: str
    reference: Graph
    candidate: Graph


def _attrs(opdef: ops.OpDef) -> str:
    given = [f"{s.name}={ATTR_VALUES[s.name]}" for s in opdef.attrs if s.required]
    return (", " + ", ".join(given)) if given else ""


def _inputs(opdef: ops.OpDef) -> list[str]:
    return ["X", "W"][:opdef.arity[0]]


def _kernel_pair(opdef: ops.OpDef) -> tuple[str, str]:
    """Kernel-level op versus the op on row blocks of a grid (X split by rows; W split
    alike for element-wise operators, whole for matmul), passed through an ``acc_sum``
    over one iteration (the identity: a custom kernel ends in an accumulator). A
    block-only operator's reference is the same kernel with a grid of one block."""
    ins = _inputs(opdef)
    matmul = opdef.cuda.kind == "matmul"
    shapes = {"X": f"[{ROWS}, {COLS}]", "W": f"[{COLS}, 32]" if matmul else f"[{ROWS}, {COLS}]"}
    decl = "".join(f"  input {n}: f32{shapes[n]};\n" for n in ins)
    loads = "".join(f"    {n.lower()} = load {n}{'' if matmul and n == 'W' else ' imap(x=0)'};\n"
                    for n in ins)
    bcall = f"{opdef.name}({', '.join(n.lower() for n in ins)}{_attrs(opdef)})"

    def blocked(name: str, grid: int) -> str:
        return (f"program {name}() {{\n{decl}  Y = custom(grid=({grid}, 1, 1), threads=128, "
                f"forloop=1) {{\n{loads}    y = {bcall};\n    s = acc_sum(y);\n"
                f"    store s -> Y omap(x=0);\n  }}\n  output Y;\n}}\n")

    if ops.KERNEL not in opdef.levels:
        return blocked("ref", 1), blocked("cand", GRID)
    call = f"{opdef.name}({', '.join(ins)}{_attrs(opdef)})"
    return f"program ref() {{\n{decl}  Y = {call};\n  output Y;\n}}\n", blocked("cand", GRID)


def _accum_program(name: str, opdef: ops.OpDef, forloop: int) -> str:
    spec = opdef.accum
    assert spec is not None
    # reduce none keeps the tile, so the loop walks rows (a tile is GRID rows); the
    # others reduce the last dim, so the loop walks columns.
    fmap = 0 if spec.reduce is Reduce.NONE else 1
    imap = "imap(x=1)" if spec.reduce is Reduce.NONE else "imap(x=0)"
    omap = "omap(x=1)" if spec.reduce is Reduce.NONE else "omap(x=0)"
    return (f"program {name}() {{\n  input X: f32[{ROWS}, {COLS}];\n"
            f"  Y = custom(grid=({GRID}, 1, 1), threads=128, forloop={forloop}) {{\n"
            f"    x = load X {imap} fmap({fmap});\n"
            f"    a = {opdef.name}(x{_attrs(opdef)});\n"
            f"    store a -> Y {omap};\n  }}\n  output Y;\n}}\n")


def _movement_pair(opdef: ops.OpDef) -> tuple[str, str]:
    """A kernel-only operator without a decomposition (data movement: ``reshape``,
    the only one today) has no block form to compare with: its reference is the operator
    alone, its candidate the operator followed by a custom kernel that copies the
    result block by block. What this checks is that the row's meanings agree with each
    other (numpy with the field residue for residue, the terms, the CUDA spelling with
    numpy on the GPU), each through the same pipeline as every other row."""
    call = f"{opdef.name}(X{_attrs(opdef)})"
    decl = f"  input X: f32[{ROWS}, {COLS}];\n"
    ref = f"program ref() {{\n{decl}  Y = {call};\n  output Y;\n}}\n"
    cand = (f"program cand() {{\n{decl}  T = {call};\n  Y = custom(grid=({GRID}, 1, 1), "
            f"threads=128, forloop=1) {{\n    t = load T imap(x=0);\n    s = acc_sum(t);\n"
            f"    store s -> Y omap(x=0);\n  }}\n  output Y;\n}}\n")
    return ref, cand


def pair(op: str) -> Pair:
    """The reference and candidate programs of operator ``op``."""
    opdef = ops.get(op)
    if ops.BLOCK not in opdef.levels:
        ref, cand = _movement_pair(opdef)
        return Pair(op, parse_text(ref, "ref.mir"), parse_text(cand, "cand.mir"))
    if opdef.accum is not None:
        if opdef.accum.reduce is Reduce.NONE:
            # Combining whole tiles over iterations has no one-iteration form with the
            # same output; compare two blockings of the kept columns instead.
            ref = _accum_program("ref", opdef, GRID).replace(f"grid=({GRID}, 1, 1)",
                                                             "grid=(2, 1, 1)")
            cand = _accum_program("cand", opdef, GRID)
        else:
            ref, cand = _accum_program("ref", opdef, 1), _accum_program("cand", opdef, GRID)
    else:
        ref, cand = _kernel_pair(opdef)
    return Pair(op, parse_text(ref, "ref.mir"), parse_text(cand, "cand.mir"))


def _inputs_for(g: Graph, seed: int) -> dict[str, np.ndarray]:
    # Positive inputs keep sqrt/rsqrt/div defined for every operator.
    xs = interp.random_inputs(g, seed)
    return {k: np.abs(v) + np.float32(0.5) for k, v in xs.items()}


def numpy_agrees(p: Pair, seed: int = 0) -> None:
    ins = _inputs_for(p.reference, seed)
    a = interp.run(p.reference, ins)["Y"]
    b = interp.run(p.candidate, ins)["Y"]
    assert a.shape == b.shape, (p.op, a.shape, b.shape)
    np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-9, err_msg=p.op)


def field_agrees(p: Pair, seed: int = 0) -> None:
    from mirage_cli.verifier.api import Verifier

    verdict = Verifier(p.reference, seed=seed).check(p.candidate, trials=2)
    assert verdict.equivalent is True, (p.op, verdict)


def terms_agree(p: Pair) -> None:
    from mirage_cli.search.analysis import analyze

    ta, tb = analyze(p.reference).outputs[0].term, analyze(p.candidate).outputs[0].term
    assert ta == tb, (p.op, show(ta), show(tb))


def meanings_name_each_other(op: str) -> None:
    """A field model by a random function uses a symbol of the abstract term (so a
    max modelled as a min, or a tanh as a gelu, is caught without a GPU)."""
    from mirage_cli.search.abstract import op_symbols

    opdef = ops.get(op)
    fn = opdef.field.random_fn
    if fn is not None:
        assert fn in op_symbols(op), (op, fn, op_symbols(op))
    if opdef.accum is not None and is_extreme(opdef.accum.combine):
        assert fn == opdef.accum.combine.value, (op, fn)


def is_exact(op: str) -> bool:
    """Whether the row's field model is plain field arithmetic with no inversion of a
    data value (no random function, no exp): then numpy and the field must agree
    exactly on integer inputs, residue for residue."""
    f = ops.get(op).field
    return f.random_fn is None and not f.uses_exp and f.inverts is None


def numpy_matches_field(p: Pair, seed: int = 0) -> None:
    """On small integer inputs (so that every float64 result is an exact dyadic
    rational) the interpreter's result, mapped into the field, is the field's."""
    from mirage_cli.semantics.field import P, Q, const
    from mirage_cli.semantics.values import FVal, TrialContext
    from mirage_cli.verifier.evaluate import evaluate

    g = p.reference
    rng = np.random.default_rng(seed)
    ints = {i.value.name: rng.integers(0, 8, i.value.type.shape) for i in g.inputs}
    y = interp.run(g, {k: v.astype(np.float32) for k, v in ints.items()})["Y"]
    fin = [FVal.of(ints[i.value.name] % P, ints[i.value.name] % Q) for i in g.inputs]
    (out,) = evaluate(g, fin, TrialContext(seed, 0))
    want = np.vectorize(lambda v: const(float(v), P), otypes=[np.int64])(y)
    np.testing.assert_array_equal(np.asarray(out.p, dtype=np.int64), want, err_msg=p.op)


def compiles(p: Pair, arch: str = "sm_90") -> None:
    from mirage_cli.codegen.emit import emit
    from mirage_cli.codegen.lower import lower
    from mirage_cli.codegen.nvrtc import compile_cuda

    cu, _ = emit(lower(p.candidate))
    res = compile_cuda(cu, f"{p.op}.cu", arch)
    assert res.cubin, p.op


def runs_on_gpu(device: object, p: Pair) -> None:
    """The candidate's generated CUDA on the positive inputs the CPU checks use (sqrt,
    rsqrt and div are defined there), against the float64 reference."""
    from mirage_cli.codegen.bench import build, compare

    ins = _inputs_for(p.candidate, 3)
    want = interp.run(p.reference, ins, "float64")
    loaded = build(device, p.candidate)  # type: ignore[arg-type]
    try:
        chk = compare(loaded.run(ins), want, list(p.candidate.outputs))
    finally:
        loaded.unload()
    assert chk.ok, f"{p.op}: {chk.reason}"


def conforms_on_cpu(op: str) -> None:
    """Everything but the GPU run."""
    p = pair(op)
    numpy_agrees(p)
    if is_exact(op):
        numpy_matches_field(p)
    field_agrees(p)
    terms_agree(p)
    meanings_name_each_other(op)
    compiles(p)


def operators() -> list[str]:
    """Every registry operator a conformance pair is built for: all but ``custom``
    (a whole kernel, tested by every example) and the kernel-only composites, which
    have no block form (their meanings are checked through the decomposition the
    search uses). Kernel-only operators without a decomposition (data movement) get
    the pair of :func:`_movement_pair`."""
    return [n for n, d in sorted(ops.REGISTRY.items())
            if n != "custom" and (ops.BLOCK in d.levels or d.decompose is None)]
