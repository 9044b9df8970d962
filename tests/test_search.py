"""The µGraph search: abstract expressions, the Z3 oracle, the generator, the driver."""

from __future__ import annotations

from click.testing import CliRunner

from mirage_cli import serialize
from mirage_cli.cli import main
from mirage_cli.ir import DType
from mirage_cli.loading import load_graph
from mirage_cli.parser import parse_text
from mirage_cli.search import abstract as ab_search
from mirage_cli.search.analysis import analyze
from mirage_cli.search.design import design_of, instantiate
from mirage_cli.search.driver import SearchOptions, search
from mirage_cli.search.enumerate import Limits, Search, make_target
from mirage_cli.search.prune import Oracle
from mirage_cli.search.split import split_reduction
from mirage_cli.search.tune import tune
from mirage_cli.semantics import terms as ab
from mirage_cli.verifier.api import Verifier

RMSNORM = """
program rmsnorm_linear(rows = 4, hidden = 64, n = 32) {
  input X: f16[rows, hidden];
  input W: f16[hidden, n];
  Y = rms_norm(X);
  Z = matmul(Y, W);
  output Z;
}
"""

GQA = """
program gqa(b = 2, rows = 8, d = 16, seq = 64) {
  input Q: f16[b, rows, d];
  input K: f16[b, d, seq];
  input V: f16[b, seq, d];
  A = matmul(Q, K);
  E = exp(A);
  S = sum(E, dim=2, keepdim=true);
  P = div(E, S);
  O = matmul(P, V);
  output O;
}
"""


def _program(text: str = RMSNORM):
    return parse_text(text, "<test>", {})


def test_every_operator_has_an_abstract_rule():
    from mirage_cli import ops

    missing = [n for n, o in ops.REGISTRY.items() if o.abstract is None and n != "custom"]
    assert missing == []
    assert ab_search.op_symbols("rms_norm") == frozenset({"div", "sqrt", "sum", "mul"})


def test_fused_example_has_the_programs_expression():
    prog = load_graph("examples/rmsnorm_linear.mir")
    fused = load_graph("examples/mugraphs/rmsnorm_linear_fused.mir")
    t, f = analyze(prog).outputs[0].term, analyze(fused).outputs[0].term
    assert t == f  # normal form: the division leaves the sum in both
    assert ab.show(t).startswith("div(sum(4096, mul(W, X)), sqrt(")


def test_oracle_subexpressions_and_partial_sums():
    X, W = ab.inp("X"), ab.inp("W")
    target = analyze(_program()).outputs[0].term
    o = Oracle([target])
    assert o.is_subexpr(ab.sum_(16, ab.mul(X, W)))      # a forloop's partial matmul
    assert o.is_subexpr(ab.rms_term(64, X))
    assert not o.is_subexpr(ab.sum_(128, ab.mul(X, W)))  # more than the whole sum
    assert not o.is_subexpr(ab.fn("exp", X))
    assert not o.is_subexpr(ab.sum_(16, ab.mul(X, X, W)))
    assert o.is_equiv(target, 0)
    assert not o.is_equiv(ab.sum_(64, ab.mul(X, W)), 0)
    before = o.stats.queries
    o.is_subexpr(ab.sum_(16, ab.mul(X, W)))
    assert o.stats.queries == before  # cached


def test_pruning_shrinks_the_search():
    g = _program()
    counts = []
    for prune in (True, False):
        s = Search(make_target(g), Limits(max_kernel_ops=1, max_block_ops=4, prune=prune,
                                          max_tiles=60))
        designs = list(s.designs(s.initial(), 1))
        counts.append((s.stats.explored, len(designs)))
    assert counts[0][0] < counts[1][0]
    assert counts[0][1] >= 1


def test_generator_finds_mirages_rmsnorm_kernel():
    g = _program()
    s = Search(make_target(g), Limits(max_kernel_ops=1, max_block_ops=6))
    forms = set()
    for d in s.designs(s.initial(), 1):
        (k,) = d.steps
        forms.add((tuple(sorted(o.op for o in k.ops)), k.looped,
                   tuple((ld.source, ld.fmap) for ld in k.loads)))
    # Mirage's µGraph: X and W walked along the hidden dim by the forloop, rms and the
    # matmul accumulated, the division after the loop.
    assert (("acc_rms_ld", "acc_sum", "div", "matmul"), True, (("X", 1), ("W", 0))) in forms


def test_search_rediscovers_the_fused_rmsnorm_linear():
    # Rows of 1024 do not fit one tile well, so the forloop must walk the hidden dim:
    # the best kernel is Mirage's (sum of squares and X @ W accumulated together, the
    # division after the loop).
    g = _program(RMSNORM.replace("rows = 4, hidden = 64, n = 32", "rows = 8, hidden = 1024, n = 128"))
    res = search(g, SearchOptions(max_kernel_ops=1, max_block_ops=6, top=3))
    assert res.complete and res.candidates
    best = res.candidates[0].graph
    kernels = [op for op in best.ops]
    assert len(kernels) == 1 and kernels[0].op == "custom"
    block_ops = [o.op for o in kernels[0].block.ops]
    assert "acc_rms_ld" in block_ops and "matmul" in block_ops and block_ops[-1] == "div"
    v = Verifier(g, seed=7)
    for c in res.candidates:  # every emitted candidate verifies, independently
        assert v.certify(c.graph, crosscheck_float64=False).verdict == "equivalent"
        assert c.verdict["equivalent"] is True


def test_search_is_deterministic_across_jobs():
    g = _program()
    opts = SearchOptions(max_kernel_ops=1, max_block_ops=5, top=2)
    a = search(g, opts, jobs=1)
    b = search(g, opts, jobs=2)
    text = [serialize.dumps_candidates([(c.graph, c.meta(i)) for i, c in enumerate(r.candidates)])
            for r in (a, b)]
    assert text[0] == text[1]


def test_split_reduction_gives_verified_flash_decoding():
    g = _program(GQA)
    s = Search(make_target(g), Limits(max_kernel_ops=1, max_block_ops=6))
    found = wide_found = 0
    v = Verifier(g, seed=1)
    for d in s.designs(s.initial(), 1):
        tuned = tune(g, d, max_steps=0)
        sd = split_reduction(g, d, tuned[0][1]) if tuned else None
        if sd is None:
            continue
        best = tune(g, sd)
        if not best:
            continue
        cand = best[0][2]
        assert len(cand.ops) == 2
        assert v.certify(cand, crosscheck_float64=True).verdict == "equivalent"
        found += 1
        # The wide form, where the second kernel reads only the partials: the same
        # design with them in f32, converted back to the program's dtype as the
        # second kernel stores the output.
        wd = split_reduction(g, d, tuned[0][1], wide=True)
        reads_inputs = any(ld.source in {i.value.name for i in g.inputs}
                           for ld in sd.steps[1].loads)  # type: ignore[union-attr]
        assert (wd is None) == reads_inputs
        if wd is not None:
            wide = instantiate(g, wd, design_of(cand)[1])
            assert wide is not None
            assert {t.type.dtype for t in wide.ops[0].outputs} == {DType.F32}
            assert wide.tensor_types()[wide.outputs[0]] == g.tensor_types()[g.outputs[0]]
            assert v.certify(wide, crosscheck_float64=True).verdict == "equivalent"
            wide_found += 1
        if found >= 2 and wide_found:
            break
    assert found >= 2 and wide_found >= 1


def test_an_index_split_down_to_one_element_per_block_still_stores():
    # GQA's 2 groups over a grid axis of 2 leave each block one group: a tile dim of
    # size 1 that must keep its index, or no store maps it to its grid axis and the
    # design (one group per block, rows split, keys in the loop) does not exist.
    g = _program(GQA)
    s = Search(make_target(g), Limits(max_kernel_ops=1, max_block_ops=6))
    tensors = dict(s.initial().tensors)
    groups, rows, _ = tensors["Q"].labels
    keys = tensors["K"].labels[2]
    found = list(s.designs(s.initial(), 1, ((groups, rows), keys)))
    assert found
    assert all(d.steps[0].stores[0].omap == (0, 1, None) for d in found)


def test_search_command_writes_candidates_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    prog = tmp_path / "p.mir"
    prog.write_text(RMSNORM)
    out = tmp_path / "c.ugraph.json"
    args = ["search", str(prog), "-o", str(out), "--max-kernel-ops", "1",
            "--max-block-ops", "5", "--jobs", "1", "--top", "1"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    first = out.read_text()
    cands = serialize.loads_candidates(first)
    assert len(cands) == 1 and cands[0][1]["verification"]["equivalent"] is True
    out.unlink()
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and out.read_text() == first
    assert list((tmp_path / "cache").iterdir())


def test_opt_keeps_temps_and_writes_a_depfile(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    prog = tmp_path / "p.mir"
    prog.write_text(RMSNORM)
    cu = tmp_path / "out" / "p.cu"
    r = CliRunner().invoke(main, ["opt", str(prog), "-o", str(cu), "--save-temps",
                                  str(tmp_path / "t"), "-MD", "--max-kernel-ops", "1",
                                  "--max-block-ops", "5", "--jobs", "1", "--top", "1"])
    temps = sorted(p.name for p in (tmp_path / "t").iterdir())
    assert temps == ["p.best.ugraph.json", "p.cands.ugraph.json", "p.ugraph.json"]
    try:
        import mirage_cli.codegen.lower  # noqa: F401
    except ImportError:
        assert r.exit_code == 2 and "code generator" in r.output
        return
    assert r.exit_code == 0, r.output
    assert cu.exists() and cu.with_suffix(".h").exists()
    stamp = cu.with_suffix(".mir.stamp")
    dep = cu.with_suffix(".mir.d").read_text()
    assert dep.startswith(f"{stamp} {cu} {cu.with_suffix('.h')}:") and str(prog) in dep


QKNORM = """
program qknorm_gqa(b = 2, rows = 8, d = 16, seq = 64) {
  input Q: f16[b, rows, d];
  input K: f16[b, d, seq];
  input V: f16[b, seq, d];
  QN = rms_norm(Q);
  K2 = square(K);
  KM = mean(K2, dim=1, keepdim=true);
  KR = sqrt(KM);
  KN = div(K, KR);
  A = matmul(QN, KN);
  AS = mul_scalar(A, scalar=0.125);
  E = exp(AS);
  S = sum(E, dim=2, keepdim=true);
  P = div(E, S);
  O = matmul(P, V);
  output O;
}
"""


def test_oracle_keeps_every_tile_of_the_hand_written_qknorm_kernels():
    # The normalised tiles q / rms(q) and k / sqrt(mean(k^2)) sit inside the target's
    # (0.125 * sum(q k)) / (rms * sqrt) only up to the mul/div and sum/div axioms;
    # they must be kept, else no design normalises before the matmul.
    from mirage_cli import ops
    from mirage_cli.check import tile_type

    prog = load_graph("examples/qknorm_gqa.mir")
    hand = load_graph("examples/mugraphs/qknorm_gqa_fused.mir")
    oracle = make_target(prog).oracle
    env = {i.value.name: analyze(hand).values[i.value.name] for i in hand.inputs}
    for kop in hand.ops:
        bg = kop.block
        assert bg is not None
        tiles = {bi.value.name: ab.AVal(env[bi.source].term,
                                        tile_type(env[bi.source].type, bg.grid, bg.forloop,
                                                  bi.imap, bi.fmap), env[bi.source].labels)
                 for bi in bg.inputs}
        for o in bg.ops:
            opdef = ops.get(o.op)
            attrs = dict(opdef.attr_values(o.attrs))
            if opdef.is_accumulator:
                attrs[ab.FORLOOP_KEY] = bg.forloop
            tiles[o.outputs[0].name] = ab_search.apply(o.op, [tiles[n] for n in o.inputs], attrs)[0]
            assert oracle.is_subexpr(tiles[o.outputs[0].name].term), o.outputs[0].name
        for v, bo in zip(kop.outputs, bg.outputs):
            env[v.name] = ab.AVal(tiles[bo.source].term, v.type, tiles[bo.source].labels)
    assert oracle.is_equiv(env[prog.outputs[0]].term, 0)


def test_search_finds_a_verified_qknorm_kernel():
    # Before the derived subexpression lemmas of the oracle, every design divided the
    # whole score matrix by an outer product of norms (not certifiable: too many
    # inversions for the fields) or none was found at all.
    g = parse_text(QKNORM)
    res = search(g, SearchOptions(max_kernel_ops=1, max_block_ops=11, top=1))
    assert res.complete and res.candidates
    assert res.candidates[0].verdict["equivalent"] is True
    assert "rms_norm" in [o.op for o in res.candidates[0].graph.ops[0].block.ops]


def test_ctrl_c_during_a_pruning_query_reaches_the_search(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Z3 must not swallow Ctrl-C: by default it answers an interrupted check with
    "unknown", which the search reads as a timeout and carries on (the interrupt is
    lost); once an oracle exists the signal is left to Python, raised when the query
    returns. Run in a fresh process: the setting is process-wide."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "q.py"
    script.write_text(
        "import os, signal, threading, time, z3\n"
        "from mirage_cli.search.prune import Oracle\n"
        "o = Oracle([])\n"
        "x, y = (z3.BitVec(n, 128, ctx=o._ctx) for n in 'xy')\n"
        "# factoring a 128-bit product: no answer within the 1 s query timeout\n"
        "o.solver.add(x * y == 0xC2F0A7E3B8D1F4A9235B7E1D9F0C3A57, z3.ULT(x, 2**64),\n"
        "             z3.ULT(y, 2**64), z3.UGT(x, 1), z3.UGT(y, 1))\n"
        "threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()\n"
        "try:\n"
        "    r = o.solver.check()\n"
        "    time.sleep(2.0)\n"
        "    print('lost', o.solver.reason_unknown())\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n")
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(script)], check=False, capture_output=True,
                       text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.stdout.strip() == "interrupted", r.stdout + r.stderr


def test_a_whole_answer_slower_than_unfused_is_searched_cut_too():
    """The cut into parts runs when nothing whole verified, and also when the best
    whole answer is predicted slower than the unfused program; not otherwise."""
    import dataclasses

    from mirage_cli.search.cost import estimate
    from mirage_cli.search.driver import Candidate, cuts_too

    program = load_graph("examples/lora.mir")
    unfused = estimate(program)

    def cand(us: float) -> Candidate:
        return Candidate(program, None, (), dataclasses.replace(unfused, time_us=us), {})  # type: ignore[arg-type]

    assert cuts_too(program, [])
    assert cuts_too(program, [cand(unfused.time_us * 2)])
    assert not cuts_too(program, [cand(unfused.time_us / 2)])


GELU_MLP = """
program gelu_mlp(rows = 16, hidden = 64, inter = 256) {
  input X: f16[rows, hidden];
  input W1: f16[hidden, inter];
  input W2: f16[inter, hidden];
  A = matmul(X, W1);
  H = gelu(A);
  O = matmul(H, W2);
  output O;
}
"""


def test_a_custom_kernel_may_store_an_intermediate_for_predefined_operators():
    """The GELU MLP's first matmul with GELU as its epilogue, stored, then the second
    matmul as a pre-defined operator: a design that starts with a custom kernel and
    goes on (before, a custom kernel could only come last)."""
    from mirage_cli.search.design import CustomD, PredefD

    g = _program(GELU_MLP)
    t = make_target(g)
    s = Search(t, Limits(max_kernel_ops=2, max_block_ops=4))
    found = [d for cfg in s.configs(s.initial())
             for d in s.designs(s.initial(), 2, cfg)]
    mixed = [d for d in found if isinstance(d.steps[0], CustomD)
             and len(d.steps) == 2 and isinstance(d.steps[1], PredefD)]
    assert mixed
    first = mixed[0].steps[0]
    assert [o.op for o in first.ops] == ["matmul", "acc_sum", "gelu"]
    assert mixed[0].steps[1].op == "matmul"
    # With one kernel allowed, no intermediate is stored.
    one = [d for cfg in s.configs(s.initial()) for d in s.designs(s.initial(), 1, cfg)]
    assert all(len(d.steps) == 1 for d in one)
    # Instantiated and verified like any candidate.
    res = search(g, SearchOptions(max_kernel_ops=2, max_block_ops=4, top=40))
    mixed_g = [c.graph for c in res.candidates if [op.op for op in c.graph.ops] ==
               ["custom", "matmul"]]
    assert mixed_g
    assert Verifier(g, seed=3).certify(mixed_g[0], crosscheck_float64=False).verdict == \
        "equivalent"


def test_the_model_costs_elementwise_math_where_the_blocks_run_it():
    """GELU fused before the second matmul's loop is recomputed by every block along N in
    every iteration; as the first matmul's epilogue it runs once per element. The model
    counts it so, and ranks the epilogue form first."""
    from mirage_cli.ir import Graph
    from mirage_cli.search.cost import _custom, profile
    from mirage_cli.search.design import CustomD, PredefD

    g = _program(GELU_MLP.replace("rows = 16, hidden = 64, inter = 256",
                                  "rows = 16, hidden = 1024, inter = 4096"))
    t = make_target(g)
    s = Search(t, Limits(max_kernel_ops=2, max_block_ops=4))
    designs = [d for cfg in s.configs(s.initial()) for d in s.designs(s.initial(), 2, cfg)]
    designs += list(s.designs(s.initial(), 2, "predef"))

    def best(form: tuple[type, type]) -> tuple[float, Graph]:
        tuned = [r[0] for d in designs if len(d.steps) == 2
                 and tuple(type(x) for x in d.steps) == form for r in [tune(g, d)] if r]
        cost, _, graph = min(tuned, key=lambda c: c[0].time_us)
        return cost.time_us, graph
    epi_us, epi = best((CustomD, PredefD))
    loop_us, in_loop = best((PredefD, CustomD))
    gelu = 28 * 16 * 4096  # the registry's FLOPs of GELU on A
    assert epi.ops[0].block is not None and in_loop.ops[1].block is not None
    assert _custom(epi.ops[0].block, epi.tensor_types()).simt == gelu
    # In the loop, every block applies GELU to each tile of A it reads: a whole number
    # of times A, one per block along N.
    simt = _custom(in_loop.ops[1].block, in_loop.tensor_types()).simt
    assert simt % gelu == 0 and simt // gelu >= 2
    assert profile().simt_slowdown and profile().simt_slowdown > 1
    assert epi_us < loop_us
