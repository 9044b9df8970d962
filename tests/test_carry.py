"""A certificate carried along a pointwise size parameter (verifier/carry.py): the
precondition holds for the examples' batch dimension, fails for every way a candidate
can mix d indices, and the shape reuse uses it (docs/verification.md §10)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mirage_cli import ops
from mirage_cli.builder import GraphBuilder
from mirage_cli.cli import main
from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph
from mirage_cli.verifier.api import Verifier
from mirage_cli.verifier.carry import NotCarried, carry, grids_at, why_not

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ("rmsnorm_linear", "gated_mlp", "lora", "ntrans", "gqa", "qknorm_gqa")
H = 8  # hidden size of the hand-built graphs below


def test_every_operator_has_an_index_rule() -> None:
    """Exactly one source per operator: its registry row's ``index``, or for an
    accumulator its ``AccumSpec``; an element-wise operator's is pointwise."""
    for name, opdef in ops.REGISTRY.items():
        if name == "custom":
            continue  # its block graph is walked
        assert (opdef.index is not None) != (opdef.accum is not None), name
        assert not opdef.elementwise or opdef.index is ops.Index.POINTWISE, name


def test_the_rule_is_the_registry_rows() -> None:
    """carry reads the row's ``index``: ``sum`` over the d axis is refused by its
    rule, follows another rule when the row says so, and without one is refused as
    having none (fail closed)."""
    def why() -> str | None:
        return why_not(_prog(1), _row_sum(1), _prog(2), _row_sum(2))

    assert why() == "'sum' reduces over the d axis"
    with ops.scratch_registry() as reg:
        reg["sum"] = dataclasses.replace(ops.get("sum"), index=ops.Index.MIX_LAST)
        # A (wrong) rule that mixes only the last dimension lets the sum through; the
        # add that spreads its one row over every row is then refused.
        assert why() == "'add' broadcasts one d index over several"
        reg["sum"] = dataclasses.replace(ops.get("sum"), index=None)
        assert why() == "operator 'sum' has no index rule"
    assert why() == "'sum' reduces over the d axis"


def test_the_registry_refuses_a_second_source_of_the_rule() -> None:
    with ops.scratch_registry():
        with pytest.raises(AssertionError, match="maps indices pointwise"):
            ops.register(dataclasses.replace(ops.get("add"), name="add2",
                                             index=ops.Index.MIX_LAST))
        with pytest.raises(AssertionError, match="index rule is its AccumSpec"):
            ops.register(dataclasses.replace(ops.get("acc_sum"), name="acc2",
                                             index=ops.Index.POINTWISE))


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("sizes", [(1, 2), (8, 16)])
def test_the_examples_batch_is_pointwise(name: str, sizes: tuple[int, int]) -> None:
    """Each example and its hand-fused µGraph (examples/mugraphs) carry along batch."""
    prog = [load_graph(str(ROOT / "examples" / f"{name}.mir"), {"batch": b}) for b in sizes]
    fused = [load_graph(str(ROOT / "examples" / "mugraphs" / f"{name}_fused.mir"),
                        {"batch": b}) for b in sizes]
    c = carry(prog[0], fused[0], prog[1], fused[1])
    assert (c.param, c.old, c.new) == ("batch", *sizes)
    assert c.axes  # some input depends on batch, at dimension 0
    assert all(ax == 0 for _, ax in c.axes)


def test_another_parameter_or_two_at_once_is_not_carried() -> None:
    path = str(ROOT / "examples" / "rmsnorm_linear.mir")
    a = load_graph(path, {"batch": 1, "hidden": 64, "n": 64})
    # hidden is reduced over by rms_norm and the matmul: not pointwise.
    b = load_graph(path, {"batch": 1, "hidden": 128, "n": 64})
    assert why_not(a, a, b, b) == "'rms_norm' mixes along the d axis"
    c = load_graph(path, {"batch": 2, "hidden": 64, "n": 128})
    assert "2 size parameters differ" in (why_not(a, a, c, c) or "")


# -- hand-built programs and candidates, at batch = b -------------------------------------

Build = Callable[[int], Graph]


def _prog(b: int) -> Graph:
    """O = X * 1 (row-wise: the identity)."""
    g = GraphBuilder("p", (("batch", b),))
    g.input("X", (b, H), "f32", ("batch", str(H)))
    g.op("mul_scalar", "X", out="O", scalar=1.0)
    g.output("O")
    return g.build()


def _row_sum(b: int) -> Graph:
    """Every row replaced by the sum of the rows: X at batch 1, wrong at batch 2."""
    g = GraphBuilder("p", (("batch", b),))
    g.input("X", (b, H), "f32", ("batch", str(H)))
    g.op("sum", "X", out="S", dim=0, keepdim=True)
    g.op("mul_scalar", "X", out="Z", scalar=0.0)
    g.op("add", "S", "Z", out="O")
    g.output("O")
    return g.build()


def _row_sum_in_a_block(b: int) -> Graph:
    """The same mixing inside one custom kernel (a block reduction over the d axis)."""
    g = GraphBuilder("p", (("batch", b),))
    g.input("X", (b, H), "f32", ("batch", str(H)))
    k = g.custom((1, 1, 1), 128, 1)
    x = k.op("acc_sum", k.load("X"))
    s = k.op("sum", x, dim=0, keepdim=True)
    z = k.op("mul_scalar", x, scalar=0.0)
    k.finish([(k.op("add", s, z), "O", (None, None, None))])
    g.output("O")
    return g.build()


def _loop_over_d(b: int) -> Graph:
    """X loaded with the forloop over its batch dimension (the rows summed in pairs)."""
    g = GraphBuilder("p", (("batch", b),))
    g.input("X", (b, H), "f32", ("batch", str(H)))
    k = g.custom((1, 1, 1), 128, 2)
    x = k.load("X", fmap=0)
    k.finish([(k.op("acc_sum", k.op("mul_scalar", x, scalar=1.0)), "O", (None, None, None))])
    g.output("O")
    return g.build()


def _reshape_prog(b: int, mixing: bool) -> Graph:
    g = GraphBuilder("p", (("batch", b),))
    g.input("X", (2 * b, H), "f32", ("2 * batch", str(H)))
    dims = {"d0": b, "d1": 2 * H} if mixing else {"d0": 2 * b, "d1": 2, "d2": H // 2}
    g.op("reshape", "X", out="R", **dims)
    g.op("mul_scalar", "R", out="O", scalar=2.0)
    g.output("O")
    return g.build()


def _grid_mixes(b: int) -> Graph:
    """Grid axis x splits the rows of X and the columns of W at once: block i
    computes rows i with columns i only (d paired with another dimension)."""
    g = GraphBuilder("p", (("batch", b),))
    g.input("X", (b, H), "f32", ("batch", str(H)))
    g.input("W", (H, 4), "f32", (str(H), "4"))
    k = g.custom((2, 1, 1), 128, 1)
    m = k.op("matmul", k.load("X", (0, None, None)), k.load("W", (1, None, None)))
    k.finish([(k.op("acc_sum", m), "O", (0, None, None))])
    g.output("O")
    return g.build()


def _split_rows(b: int) -> Graph:
    """A pointwise kernel whose grid splits the rows: carried."""
    g = GraphBuilder("p", (("batch", b),))
    g.input("X", (b, H), "f32", ("batch", str(H)))
    k = g.custom((b, 2, 1), 128, 1)
    x = k.op("acc_sum", k.load("X", (0, 1, None)))
    k.finish([(k.op("mul_scalar", x, scalar=1.0), "O", (0, 1, None))])
    g.output("O")
    return g.build()


def test_a_row_mixing_candidate_right_at_size_1_is_not_carried() -> None:
    """The candidate is equivalent at batch 1 (certified there) and wrong at batch 2:
    the precondition refuses to carry it, and the full certificate rejects it."""
    for cand in (_row_sum, _row_sum_in_a_block):
        at1 = Verifier(_prog(1), seed=0).certify(cand(1))
        assert at1.verdict == "equivalent"
        with pytest.raises(NotCarried, match="reduces over the d axis"):
            carry(_prog(1), cand(1), _prog(2), cand(2))
        assert Verifier(_prog(2), seed=0).certify(cand(2)).verdict == "not equivalent"


@pytest.mark.parametrize("cand, reason", [
    (_loop_over_d, "forloop iterates over the d axis"),
])
def test_the_forloop_over_d_is_not_carried(cand: Build, reason: str) -> None:
    with pytest.raises(NotCarried, match=reason):
        carry(cand(2), cand(2), cand(4), cand(4))


def test_a_reshape_that_mixes_d_is_not_carried() -> None:
    with pytest.raises(NotCarried, match="reshape mixes the d axis"):
        carry(_reshape_prog(1, True), _reshape_prog(1, True),
              _reshape_prog(2, True), _reshape_prog(2, True))
    # Splitting a dimension after d keeps rows apart: carried.
    assert why_not(_reshape_prog(1, False), _reshape_prog(1, False),
                   _reshape_prog(2, False), _reshape_prog(2, False)) is None


def test_a_grid_axis_that_pairs_d_with_another_dimension_is_not_carried() -> None:
    prog = [_grid_mixes(b) for b in (2, 4)]
    with pytest.raises(NotCarried, match="also splits a tensor that does not depend on d"):
        carry(prog[0], prog[0], prog[1], prog[1])


def test_a_kernel_split_along_d_is_carried_and_its_grid_may_change() -> None:
    c = carry(_prog(2), _split_rows(2), _prog(4), _split_rows(4))
    assert c.as_json() == {"dimension": "batch", "from": 2, "to": 4, "axes": {"X": 0}}
    # Along any other grid axis the tiling must not change.
    with pytest.raises(NotCarried, match="changes along a dimension other than d"):
        carry(_prog(2), _split_rows(2), _prog(2 * 2), _split_rows_other_grid(4))


def test_grids_at_keeps_every_block_s_tiles() -> None:
    # At batch 8 the grid splits the 8 rows into 8 blocks of one: at batch 2, 2 blocks.
    assert grids_at(_prog(2), _prog(8), _split_rows(8)) == [(2, 2, 1)]
    assert carry(_prog(2), _split_rows(2), _prog(8), _split_rows(8)).old == 2
    assert grids_at(_prog(3), _prog(8), _split_rows(8)) == [(3, 2, 1)]
    # Blocks of two rows do not tile 3 rows; a candidate that is not pointwise along d
    # gets no proposal either.
    pairs = GraphBuilder("p", (("batch", 8),))
    pairs.input("X", (8, H), "f32", ("batch", str(H)))
    k = pairs.custom((4, 2, 1), 128, 1)
    x = k.op("acc_sum", k.load("X", (0, 1, None)))
    k.finish([(k.op("mul_scalar", x, scalar=1.0), "O", (0, 1, None))])
    pairs.output("O")
    assert grids_at(_prog(4), _prog(8), pairs.build()) == [(2, 2, 1)]
    assert grids_at(_prog(3), _prog(8), pairs.build()) is None
    assert grids_at(_prog(1), _prog(2), _row_sum(2)) is None


def _split_rows_other_grid(b: int) -> Graph:
    g = GraphBuilder("p", (("batch", b),))
    g.input("X", (b, H), "f32", ("batch", str(H)))
    k = g.custom((b, 4, 1), 128, 1)
    x = k.op("acc_sum", k.load("X", (0, 1, None)))
    k.finish([(k.op("mul_scalar", x, scalar=1.0), "O", (0, 1, None))])
    g.output("O")
    return g.build()


# -- the shape reuse ----------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def _opt(tmp: Path, mir: Path, batch: int, sizes: dict[str, int], tag: str
         ) -> tuple[str, dict[str, Any], str]:
    temps, cu = tmp / f"t{tag}", tmp / f"{tag}.cu"
    defs = [a for k, v in {**sizes, "batch": batch}.items() for a in ("-D", f"{k}={v}")]
    r = CliRunner().invoke(main, ["opt", str(mir), "-o", str(cu), *defs, "--jobs", "1",
                                  "--save-temps", str(temps)])
    assert r.exit_code == 0, r.output
    doc = json.loads(next(temps.glob("*.cands.ugraph.json")).read_text())
    return r.output, doc["candidates"][0]["meta"], cu.read_text()


def test_reuse_carries_the_certificate_and_ships_what_a_fresh_search_ships(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mir, sizes = ROOT / "examples" / "rmsnorm_linear.mir", {"hidden": 64, "n": 128}
    _opt(cache, mir, 2, sizes, "a")
    tried: list[Graph] = []
    real = Verifier._run
    monkeypatch.setattr(Verifier, "_run", lambda v, g, t: tried.append(g) or real(v, g, t))
    log, meta, cu = _opt(cache, mir, 4, sizes, "b")
    assert "search: reused the" in log and "certificate carried from batch=2" in log
    # No finite-field trial of the shipped design at batch 4 (a design the batch-2
    # search did not certify, ranked higher at batch 4, is tried, and may be rejected).
    shipped = load_graph(str(next((cache / "tb").glob("*.best.ugraph.json"))), {})
    assert _kernels(shipped) not in {_kernels(g) for g in tried}
    ver = meta["verification"]
    assert ver["carried"] == {"dimension": "batch", "from": 2, "to": 4, "axes": {"X": 0},
                              "certified_at": {"batch": 2, "hidden": 64, "n": 128}}
    assert ver["certificate"]["bound"] <= 2.0 ** -40
    assert ver["float64"]["verdict"] == "close" and ver["numerics"]["verdict"] == "safe"
    # `mirage explain` says where the certificate was computed.
    cands = str(next((cache / "tb").glob("*.cands.ugraph.json")))
    text = CliRunner().invoke(main, ["explain", cands]).output
    assert "certificate: carried along 'batch' from 2 to 4: finite-field trials at " \
           "batch=2, hidden=64, n=128" in text
    doc = json.loads(CliRunner().invoke(main, ["explain", cands, "--json"]).output)
    assert doc["certificate"]["from"] == 2 and doc["certificate"]["axes"] == {"X": 0}
    # Independently, at batch 4: equivalent, and the same .cu as a fresh search.
    monkeypatch.setattr(Verifier, "_run", real)
    best = load_graph(str(next((cache / "tb").glob("*.best.ugraph.json"))), {})
    prog4 = load_graph(str(mir), {**sizes, "batch": 4})
    assert Verifier(prog4, seed=5).certify(best).verdict == "equivalent"
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(cache / "empty"))
    _, fresh_meta, fresh_cu = _opt(cache, mir, 4, sizes, "c")
    assert fresh_cu == cu and "carried" not in fresh_meta["verification"]


def _kernels(g: Graph) -> tuple[object, ...]:
    """A µGraph's kernels without their tuning plans (what a trial runs)."""
    return tuple((op.op, op.inputs, op.block) for op in g.ops)


def test_reuse_of_a_batch_reducing_program_certifies_in_full(cache: Path) -> None:
    mir = cache / "colsum.mir"
    mir.write_text("program colsum(batch = 2, h = 64) {\n"
                   "  input X: f32[batch, h];\n  input W: f32[h, h];\n"
                   "  S = sum(X, dim=0, keepdim=true);\n  O = matmul(S, W);\n"
                   "  output O;\n}\n")
    _opt(cache, mir, 2, {}, "a")
    log, meta, _ = _opt(cache, mir, 4, {}, "b")
    assert "search: reused the" in log and "certificate carried" not in log
    assert "certificate not carried from batch=2, h=64: 'sum' reduces over the d axis" in log
    ver = meta["verification"]
    assert "carried" not in ver and ver["certificate"]["finite_field"]["trials"] >= 1
