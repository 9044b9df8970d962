"""Whole layers (issue 14, item 2): the part plan (deterministic, within the limits,
barriers alone), stitching (one graph, round trip through .ugraph.json), fallback to
the unfused lowering of a part that does not verify, and `mirage opt` / `mirage
explain` on a small layer."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mirage_cli import interp, serialize
from mirage_cli.builder import GraphBuilder
from mirage_cli.codegen.aliasing import launched
from mirage_cli.golden import run_cli
from mirage_cli.ir import DType, Graph
from mirage_cli.loading import load_graph
from mirage_cli.parser import parse_text
from mirage_cli.search import layer
from mirage_cli.search.driver import SearchOptions
from mirage_cli.verifier.api import Verifier

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"batch": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "inter": 96,
         "kv": 8}


def random_program(n_ops: int, seed: int) -> Graph:
    """A program of ``n_ops`` operators over [8, 16] tensors: element-wise operators,
    matmuls with a square weight, rms_norm, rotate_half, and now and then a barrier (a
    reshape there and back), each reading one of the last few tensors."""
    rng = random.Random(seed)
    b = GraphBuilder(f"rand{seed}", ())
    b.input("X", (8, 16), DType.F32)
    b.input("W", (16, 16), DType.F32)
    live = ["X"]
    k = 0
    while k < n_ops:
        x = rng.choice(live[-3:])
        y = rng.choice(live[-3:])
        kind = rng.choice(["add", "mul", "exp", "matmul", "rms_norm", "silu", "barrier"])
        name = f"t{k}"
        if kind == "barrier" and k + 2 <= n_ops and rng.random() < 0.5:
            b.op("reshape", x, out=name + "r", d0=128)
            b.op("reshape", name + "r", out=name, d0=8, d1=16)
            k += 2
        elif kind == "barrier":
            b.op("rotate_half", x, out=name)
            k += 1
        elif kind in ("add", "mul"):
            b.op(kind, x, y, out=name)
            k += 1
        elif kind == "matmul":
            b.op("matmul", x, "W", out=name)
            k += 1
        else:
            b.op(kind, x, out=name)
            k += 1
        live.append(name)
    b.output(live[-1])
    return b.build()


@pytest.mark.parametrize("n_ops", [3, 5, 8, 13, 21, 30, 40])
@pytest.mark.parametrize("max_ops", [2, 4, 6])
def test_parts_cover_the_program_within_the_limits(n_ops: int, max_ops: int) -> None:
    g = random_program(n_ops, seed=n_ops)
    assert len(g.ops) == n_ops
    parts = layer.plan_parts(g, max_ops)
    assert parts == layer.plan_parts(g, max_ops)
    # printed and parsed back, the same plan
    from mirage_cli.printer import print_graph

    assert layer.plan_parts(parse_text(print_graph(g), "g.mir"), max_ops) == parts
    assert [p.index for p in parts] == list(range(len(parts)))
    assert parts[0].start == 0 and parts[-1].stop == n_ops
    assert all(a.stop == b.start for a, b in itertools.pairwise(parts))
    for p in parts:
        barrier = [layer.is_barrier(op) for op in g.ops[p.start:p.stop]]
        if p.searched:
            assert 1 <= p.stop - p.start <= max_ops + layer.SLACK and not any(barrier)
            # a part over max_ops is one a normalisation joined (rule 3)
            if p.stop - p.start > max_ops:
                assert g.ops[p.start].op == "rms_norm", p
        else:
            assert p.stop - p.start == 1 and barrier[0]
    # the fewest parts: each run between barriers in ceil(len / max_ops) parts
    runs, n = [], 0
    for op in g.ops:
        if layer.is_barrier(op):
            runs.append(n)
            n = 0
        else:
            n += 1
    runs.append(n)
    assert sum(p.searched for p in parts) == sum(-(-r // max_ops) for r in runs)
    assert sum(not p.searched for p in parts) == sum(
        layer.is_barrier(op) is not None for op in g.ops)


def test_runs_are_cut_where_fewest_bytes_are_live() -> None:
    src = """program p() {
  input X: f32[8, 1024];
  input W: f32[1024, 4];
  input V: f32[4, 1024];
  A = exp(X);
  B = matmul(A, W);
  C = exp(B);
  D = matmul(C, V);
  output D;
}
"""
    parts = layer.plan_parts(parse_text(src, "p.mir"), 2)
    # after B or C only [8, 4] is live; after A [8, 1024]: the cut is after B (earliest)
    assert [(p.start, p.stop) for p in parts] == [(0, 2), (2, 4)]
    assert "128 bytes live after 'B'" in parts[0].why


def test_a_normalisation_joins_the_part_that_reads_it() -> None:
    src = """program p() {
  input X: f32[8, 64];
  input R: f32[8, 64];
  input W: f32[64, 64];
  input V: f32[64, 64];
  A = matmul(X, W);
  H = add(R, A);
  N = rms_norm(H, eps=1e-05);
  U = matmul(N, V);
  S = silu(U);
  E = exp(S);
  output E, H;
}
"""
    g = parse_text(src, "p.mir")
    # two parts of at most 3 operators: the only cut is after N ...
    assert layer._best_cuts(g, 0, 6, 2, 3) == [3]
    # ... and it moves before the normalisation, into the part that reads it (3 + 1)
    parts = layer.plan_parts(g, 3)
    assert [(p.start, p.stop) for p in parts] == [(0, 2), (2, 6)]
    assert "moved before the normalisation N = rms_norm" in parts[0].why
    # a part that is the normalisation alone stays: the part before may not be empty
    assert [(p.start, p.stop) for p in layer.plan_parts(g, 1)] == [
        (i, i + 1) for i in range(6)]


def test_plan_does_not_depend_on_the_hash_seed() -> None:
    code = ("import json, sys; sys.path.insert(0, 'tests'); from test_layer import "
            "random_program; from mirage_cli.search import layer; print(json.dumps("
            "[p.as_json() for p in layer.plan_parts(random_program(40, 7), 4)]))")
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        outs.add(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                                capture_output=True, text=True).stdout)
    assert len(outs) == 1


def test_layer_examples_are_cut_at_their_barriers() -> None:
    g = load_graph(str(ROOT / "examples" / "llama3_8b_layer.mir"), {"batch": 8})
    parts = layer.plan_parts(g)
    names = [[op.outputs[0].name for op in g.ops[p.start:p.stop]] for p in parts]
    assert ["S", "SS", "P", "O"] in names  # attention, whole
    # the second norm joins gate/up (rule 3), then the down projection with its residual
    assert ["A", "H"] in names and ["N2", "U", "T", "SU", "M"] in names
    assert ["D", "Y"] in names
    assert "moved before the normalisation N2 = rms_norm" in parts[names.index(["A", "H"])].why
    for p in parts:
        if not p.searched:
            assert g.ops[p.start].op in ("reshape", "rotate_half", "concat")


def _fake_mapper(fused: dict[int, Graph]) -> layer.PartMapper:
    """Parts answered without a search: ``fused[k]`` (claimed certified) for part k,
    the part's own operators otherwise."""
    def run(tasks: list[layer.PartTask]) -> list[layer.PartResult]:  # type: ignore[override]
        out = []
        for t in tasks:
            g = fused.get(t.plan.index)
            verdict = {"equivalent": True, "certificate": {"bound": 1e-12}}
            out.append(layer.PartResult(t.plan, g if g is not None else t.graph,
                                        g is not None, verdict if g is not None else None,
                                        0.0, "test"))
        return out
    return run  # type: ignore[return-value]


TINY = """program tiny(rows = 8, hidden = 64, n = 32) {
  input X: f32[rows, hidden];
  input G: f32[hidden];
  input W: f32[hidden, n];
  Y = rms_norm(X, G, eps=1e-05);
  Z = matmul(Y, W);
  Z3 = reshape(Z, d0=rows, d1=2, d2=16);
  R = rotate_half(Z3);
  E = exp(R);
  S = sum(E, dim=2, keepdim=true);
  P = div(E, S);
  output P;
}
"""

FUSED_PART0 = """program tiny_part0() {
  input X: f32[8, 64];
  input G: f32[64];
  input W: f32[64, 32];
  Z = custom(grid=(4, 1, 1), threads=128, forloop=4) {
    x = load X fmap(1);
    g = load G fmap(0);
    w = load W imap(x=1) fmap(0);
    r = acc_rms_ld(x, eps=1e-05);
    xg = mul(x, g);
    m = matmul(xg, w);
    s = acc_sum(m);
    o = div(s, r);
    store o -> Z omap(x=1);
  }
  output Z;
}
"""


def test_stitched_layer_verifies_and_round_trips() -> None:
    prog = parse_text(TINY, "tiny.mir")
    res = layer.optimise_layer(prog, SearchOptions(), 1.0,
                               _fake_mapper({0: parse_text(FUSED_PART0, "f.mir")}))
    assert res.graph is not None and res.verdict["equivalent"]
    assert [op.op for op in res.graph.ops] == ["custom", "reshape", "rotate_half", "exp",
                                               "sum", "div"]
    assert res.graph.input_names == prog.input_names and res.graph.outputs == prog.outputs
    text = serialize.dumps(res.graph)
    assert serialize.loads(text) == res.graph and serialize.dumps(serialize.loads(text)) == text
    ins = interp.random_inputs(prog, 3)
    np.testing.assert_allclose(interp.run(res.graph, ins)["P"], interp.run(prog, ins)["P"],
                               rtol=1e-9, atol=1e-12)
    assert Verifier(prog, seed=1).check(res.graph, trials=2).equivalent is True


WRONG_PART0 = FUSED_PART0.replace("o = div(s, r);", "o = mul(s, r);")


def test_a_wrong_part_is_never_shipped() -> None:
    """A part that claims a certificate but computes something else: the check of the
    whole rejects the stitched graph, so `opt` ships the program unfused."""
    prog = parse_text(TINY, "tiny.mir")
    res = layer.optimise_layer(prog, SearchOptions(), 1.0,
                               _fake_mapper({0: parse_text(WRONG_PART0, "w.mir")}))
    assert res.graph is None and not res.verdict["equivalent"]


def test_a_part_that_does_not_verify_falls_back_to_its_operators(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mirage_cli.search import driver
    from mirage_cli.search.verify import Verdict

    def reject(*args: object) -> Verdict:
        return Verdict(False, "every candidate rejected (test)", 0)

    monkeypatch.setattr(driver, "verify", reject)
    monkeypatch.setattr(driver, "verify_composed", reject)
    prog = parse_text(TINY, "tiny.mir")
    opts = SearchOptions(max_kernel_ops=1)
    res = layer.optimise_layer(prog, opts, 5.0, layer.local_mapper(1), use_cache=False)
    assert res.parts[0].plan.searched and not res.parts[0].fused
    assert "unfused" in res.parts[0].note
    assert res.graph is not None and not res.graph.is_fused
    assert [op.op for op in res.graph.ops] == [op.op for op in prog.ops]


def test_opt_on_a_small_layer_keeps_part_files_and_explains(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "tiny.mir"
    src.write_text(TINY)
    temps = tmp_path / "temps"
    code, _, err = run_cli(("opt", str(src), "-o", str(tmp_path / "tiny.cu"), "--budget", "20",
                            "--max-kernel-ops", "1", "--save-temps", str(temps)))
    assert code == 0, err
    assert "whole layer: verified" in err
    opt_err = err
    names = sorted(p.name for p in temps.iterdir())
    # the matmul part, the reshape, and rotate_half (a block operator) with the softmax
    for k in range(3):
        assert f"tiny.part{k}.ugraph.json" in names and f"tiny.part{k}.best.ugraph.json" in names
    cands = temps / "tiny.cands.ugraph.json"
    ((g, meta),) = serialize.loads_candidates(cands.read_text())
    assert [p["index"] for p in meta["layer"]["parts"]] == list(range(3))
    code, out, err = run_cli(("explain", str(cands)))
    assert code == 0, err
    assert "part 1 (op 2): not searched: reshape is a kernel-level operator" in out
    assert "part 0 (ops 0..1): 1 kernel(s), verified (" in out
    code, out, err = run_cli(("explain", str(cands), "--json"))
    assert json.loads(out)["layer"]["parts"][0]["searched"] is True
    # the reshape between the two parts shares its buffer and launches nothing
    cu = (tmp_path / "tiny.cu").read_text()
    assert cu.count("__global__") <= launched(g) == len(g.ops) - 1
    assert f"{launched(g)} kernel(s) in {cu.count('__global__')} launch(es)" in opt_err


def test_explain_shows_the_parts_of_a_layer_program() -> None:
    code, out, err = run_cli(("explain", str(ROOT / "examples" / "llama3_8b_layer.mir"),
                              *[a for k, v in SMALL.items() for a in ("-D", f"{k}={v}")]))
    assert code == 0, err
    assert "is a barrier: reshape is a kernel-level operator" in out
    assert "not searched: concat is an operator the search never builds" in out


def test_only_layers_are_cut_other_examples_are_searched_whole() -> None:
    for path in sorted((ROOT / "examples").rglob("*.mir")):
        if "downstream" in path.parts:
            continue
        g = load_graph(str(path))
        assert layer.needs_layering(g) == path.stem.endswith("_layer"), path
    # without any barrier, only size decides
    def chain(n: int) -> Graph:
        b = GraphBuilder("chain", ())
        b.input("X", (8, 16), DType.F32)
        for k in range(n):
            b.op("exp", f"t{k - 1}" if k else "X", out=f"t{k}")
        b.output(f"t{n - 1}")
        return b.build()

    assert not layer.needs_layering(chain(layer.WHOLE_MAX_OPS))
    assert layer.needs_layering(chain(layer.WHOLE_MAX_OPS + 1))


def test_bench_gets_a_layer_through_opt_s_search_stage(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from mirage_cli.commands.bench import opt_candidates, opt_settings

    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    prog = parse_text(TINY, "tiny.mir")
    kw = {**opt_settings(jobs=1, top=1, budget=20.0), "max_kernel_ops": 1}
    (v,) = opt_candidates(prog, 1, kw)
    assert v.label == "opt#1 (shipped)" and v.graph is not None
    assert v.search["cached"] is False
    # Again: every part's search comes from the cache, and the row says so.
    (again,) = opt_candidates(prog, 1, kw)
    assert again.search["cached"] is True and again.graph == v.graph
    # the reshape, then rotate_half and the softmax fused (rotate_half is a block operator)
    assert [op.op for op in v.graph.ops][1:] == ["reshape", "custom"]


def test_executor_ray_without_ray_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    src = tmp_path / "tiny.mir"
    src.write_text(TINY)
    code, _, err = run_cli(("opt", str(src), "-o", str(tmp_path / "t.cu"), "--executor", "ray"))
    assert code == 2, err
    assert "--executor ray needs Ray: pip install 'mirage-cli[ray]'" in err
    assert not (tmp_path / "t.cu").exists()


QKV = """program qkv(rows = 8, hidden = 64) {
  input X: f32[rows, hidden];
  input G: f32[hidden];
  input WQ: f32[hidden, 32];
  input WK: f32[hidden, 16];
  input WV: f32[hidden, 16];
  N = rms_norm(X, G, eps=1e-05);
  Q = matmul(N, WQ);
  K = matmul(N, WK);
  V = matmul(N, WV);
  output Q, K, V;
}
"""


def test_output_cones_repeat_shared_operators_and_refuse_nested_outputs() -> None:
    from mirage_cli.search import partition

    cones = partition.output_cones(parse_text(QKV, "qkv.mir"))
    assert cones is not None
    assert [[op.op for op in c.ops] for c in cones] == [["rms_norm", "matmul"]] * 3
    assert [c.outputs for c in cones] == [("Q",), ("K",), ("V",)]
    assert [sorted(c.input_names) for c in cones] == [["G", "WQ", "X"], ["G", "WK", "X"],
                                                      ["G", "WV", "X"]]
    # An output read on the way to another (a residual sum and its normalisation):
    # a cone per output would repeat the first one's work.
    nested = QKV.replace("output Q, K, V;", "output N, Q;")
    assert partition.output_cones(parse_text(nested, "n.mir")) is None
    single = QKV.replace("output Q, K, V;", "output Q;")
    assert partition.output_cones(parse_text(single, "s.mir")) is None


def test_a_part_of_three_projections_joins_one_fused_kernel_per_output() -> None:
    import time

    from mirage_cli.search.verify import verify_composed

    prog = parse_text(QKV, "qkv.mir")
    plan = layer.PartPlan(0, 0, len(prog.ops), True, "test")
    task = layer.PartTask(plan, prog, SearchOptions(), 30.0, False)
    res = layer._per_output(task, None, time.time(), True, False)
    assert res is not None and res.fused and res.verdict is not None
    assert [op.op for op in res.graph.ops] == ["custom"] * 3
    assert [o.name for op in res.graph.ops for o in op.outputs] == ["Q", "K", "V"]
    assert res.graph.outputs == prog.outputs and res.graph.input_names == prog.input_names
    assert "one search per output (3 of 3 fused" in res.note
    ins = interp.random_inputs(prog, 5)
    got, want = interp.run(res.graph, ins), interp.run(prog, ins)
    for name in prog.outputs:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-12)
    assert Verifier(prog, seed=3).check(res.graph, trials=2).equivalent is True
    assert verify_composed(prog, res.graph, [res.verdict], 1).ok
    # Deterministic: the same join again.
    again = layer._per_output(task, None, time.time(), True, False)
    assert again is not None and serialize.dumps(again.graph) == serialize.dumps(res.graph)


def test_a_part_that_fuses_nothing_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # A part whose best µGraph is its own pre-defined kernels (a search that found
    # nothing better): its note must not read as a fused answer.
    from types import SimpleNamespace

    from mirage_cli.search import driver

    def own_operators(g: Graph, *args: object) -> SimpleNamespace:
        meta = {"verification": {"equivalent": True, "certificate": {"bound": 0.0}}}
        return SimpleNamespace(candidates=[(g, meta)], cached=False, complete=True,
                               progress=None)

    monkeypatch.setattr(driver, "cached_search", own_operators)
    prog = parse_text(QKV, "qkv.mir")
    plan = layer.PartPlan(0, 0, len(prog.ops), True, "test")
    res = layer.search_part(layer.PartTask(plan, prog, SearchOptions(), 1.0, False))
    assert "4 pre-defined kernel(s), nothing fused, verified (complete)" in res.note


def test_element_wise_operators_alone_fuse_into_one_kernel() -> None:
    # The layers' rotary embedding (q * cos + rotate_half(q) * sin, cos and sin
    # broadcast over the heads): its kernel closes a loop of one iteration with
    # acc_sum, the identity there, before its store.
    prog = parse_text("""program rot(batch = 2) {
  input Q4: f32[batch, 2, 4, 16];
  input COS: f32[batch, 1, 1, 16];
  input QR: f32[batch, 2, 4, 16];
  input SIN: f32[batch, 1, 1, 16];
  QC = mul(Q4, COS);
  QS = mul(QR, SIN);
  QE = add(QC, QS);
  output QE;
}
""", "rot.mir")
    from mirage_cli.search.driver import cached_search

    out = cached_search(prog, SearchOptions(), 60.0, 1, False, None, None)
    g, meta = out.candidates[0]
    assert [op.op for op in g.ops] == ["custom"]
    assert meta["verification"]["equivalent"]
    (op,) = g.ops
    assert op.block is not None and op.block.forloop == 1
    assert "acc_sum" in [b.op for b in op.block.ops]
    ins = interp.random_inputs(prog, 7)
    np.testing.assert_allclose(interp.run(g, ins)["QE"], interp.run(prog, ins)["QE"],
                               rtol=1e-9, atol=1e-12)
