"""`mirage bench --mirage-ckpt DIR`: Mirage's own checkpoint candidates, bound to the
program by position, certified, and timed as ``mirage#k`` rows beside ours. The GPU
is replaced by fixed measurements here; the GPU test benches gqa at batch 1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from shared_data import MUGRAPHS

from mirage_cli import interp
from mirage_cli.cli import main
from mirage_cli.codegen import bench, benchreport, copybw, runner
from mirage_cli.codegen.bench import Check, Measured, Variant
from mirage_cli.codegen.copybw import Bandwidth
from mirage_cli.diagnostics import MirageError
from mirage_cli.importers.bind import bind
from mirage_cli.importers.mirage import import_checkpoint
from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph
from mirage_cli.parser import parse_text

ROOT = Path(__file__).resolve().parent.parent
GQA = ROOT / "examples" / "gqa.mir"
needs_ckpts = pytest.mark.skipif(not (MUGRAPHS / "gqa_bs1.json").is_file(),
                                 reason="Mirage checkpoints not available")
BW = Bandwidth(copy_kernel=4.25e12, launch="persistent", shapes={"persistent": 4.25e12},
               memcpy=2.77e12, nbytes=1 << 30)


def _gqa(batch: int) -> Graph:
    return load_graph(str(GQA), {"batch": batch})


def _candidates(name: str, first: int) -> list[dict]:  # type: ignore[type-arg]
    return json.loads((MUGRAPHS / name).read_text())[:first]  # type: ignore[no-any-return]


def _ckpt_dir(tmp: Path) -> Path:
    """gqa_bs1.json: the first 3 candidates of Mirage's; gqa.json: one candidate of
    gqa_bs8.json (16 KV heads: another batch than 1)."""
    d = tmp / "ckpts"
    d.mkdir()
    (d / "gqa_bs1.json").write_text(json.dumps(_candidates("gqa_bs1.json", 3)))
    (d / "gqa.json").write_text(json.dumps(_candidates("gqa_bs8.json", 1)))
    return d


def _import(path: Path) -> list[Graph]:
    return import_checkpoint(path.read_text(), str(path))


# -- binding a candidate to its program -------------------------------------------------


# Input and output names that collide with the candidate's own (in0.., t0, t1, out0).
CLASHING = """
program clash() {
  input t1: f16[2, 256, 64];
  input t0: f16[2, 64, 4096];
  input out0: f16[2, 4096, 64];
  A = matmul(t1, t0);
  E = exp(A);
  S = sum(E, dim=2, keepdim=true);
  P = div(E, S);
  in0 = matmul(P, out0);
  output in0;
}
"""


@needs_ckpts
@pytest.mark.parametrize("program", ["gqa", "clash"])
def test_bind_takes_the_program_names_and_keeps_the_function(program: str) -> None:
    cand = _import(MUGRAPHS / "gqa_bs1.json")[0]
    prog = _gqa(1) if program == "gqa" else parse_text(CLASHING, "<t>", {})
    g = bind(cand, prog)
    assert g.input_names == prog.input_names and g.outputs == prog.outputs
    assert cand.input_names == ("in0", "in1", "in2")  # what changed, changed here
    ins = interp.random_inputs(cand, seed=3)
    before = interp.run(cand, ins)[cand.outputs[0]]
    after = interp.run(g, dict(zip(g.input_names, ins.values())))[g.outputs[0]]
    assert np.array_equal(before, after)
    assert [op.block.grid for op in g.ops if op.block] == \
        [op.block.grid for op in cand.ops if op.block]


@needs_ckpts
def test_bind_carries_the_programs_weight_declarations() -> None:
    """A Mirage candidate bound to lora.mir copies W, A and B early, as opt's do."""
    from mirage_cli.loading import load_graph

    prog = load_graph(str(ROOT / "examples" / "lora.mir"), {"batch": 8})
    cand = _import(MUGRAPHS / "lora.json")[0]
    g = bind(cand, prog)
    assert [i.weight for i in g.inputs] == [i.weight for i in prog.inputs] == \
        [False, True, True, True]


@needs_ckpts
def test_bind_names_the_position_that_differs() -> None:
    cand = _import(MUGRAPHS / "gqa_bs8.json")[0]
    with pytest.raises(MirageError) as e:
        bind(cand, _gqa(1))
    assert "input #0 differs" in e.value.message and "f16[16, 256, 64]" in e.value.message


def test_bind_refuses_an_input_returned_as_output() -> None:
    ident = parse_text("program c() {\n  input X: f16[4, 8];\n  Y = exp(X);\n  output X;\n"
                       "  output Y;\n}\n", "<t>", {})
    prog = parse_text("program p() {\n  input A: f16[4, 8];\n  B = exp(A);\n  C = exp(B);\n"
                      "  output B;\n  output C;\n}\n", "<t>", {})
    with pytest.raises(MirageError, match="output #0 .* is 'X', which is also its input"):
        bind(ident, prog)


# -- which files, which rows --------------------------------------------------------------


def test_checkpoint_files_by_example_and_batch(tmp_path: Path) -> None:
    for name in ("gqa_bs1.json", "gqa_bs8.json", "gqa.json", "qknorm_gqa_bs1.json",
                 "gqa_bs1.ugraph.json"):
        (tmp_path / name).write_text("[]")
    assert bench.checkpoint_files(tmp_path, "gqa", 1) == [tmp_path / "gqa_bs1.json",
                                                          tmp_path / "gqa.json"]
    assert bench.checkpoint_files(tmp_path, "gqa", 16) == [tmp_path / "gqa.json"]
    assert bench.checkpoint_files(tmp_path, "lora", 1) == []


@needs_ckpts
def test_rows_numbered_in_checkpoint_order_mismatch_reported(tmp_path: Path) -> None:
    d = _ckpt_dir(tmp_path)
    (d / "gqa_bs16.json").write_text("[{\"not\": \"a candidate\"}]")
    seen: list[tuple[str, ...]] = []

    def verify(program: Graph, g: Graph) -> tuple[bool, dict]:  # type: ignore[type-arg]
        seen.append(g.input_names)
        ok = len(seen) != 2  # the second candidate "fails"
        return ok, {"equivalent": ok, "method": "fake"}

    def run() -> list[Variant]:
        seen.clear()
        return bench.mirage_variants(_gqa(1), bench.checkpoint_files(d, "gqa", 1), verify,
                                     plan=lambda g: g, price=lambda g: 7.0)
    vs = run()
    assert [v.label for v in vs] == ["mirage#1", "mirage#2", "mirage#3", "mirage"]
    assert seen == [("Q", "K", "V")] * 3  # verified after binding to the program
    one, failed, three, other = vs
    assert one.ok and one.graph is not None and one.predicted_us == 7.0
    assert one.search == {"checkpoint": "gqa_bs1.json", "index": 0,
                          "verify": {"equivalent": True, "method": "fake"}}
    assert three.search is not None and three.search["index"] == 2
    assert not failed.ok and failed.graph is None
    assert "gqa_bs1.json candidate 1 is not certified equivalent" in failed.reason
    # The batch-8 checkpoint under the un-suffixed name: reported, not timed, not a failure.
    assert other.ok and other.graph is None
    assert other.reason.startswith("n/a: gqa.json: input #0 differs")
    # Deterministic: the same rows, and the same graphs, a second time.
    again = run()
    assert [(v.label, v.reason, v.graph) for v in again] == \
        [(v.label, v.reason, v.graph) for v in vs]
    # A file that is not a checkpoint is a FAIL row, never an exception.
    [bad] = bench.mirage_variants(_gqa(1), [d / "gqa_bs16.json"], verify)
    assert bad.label == "mirage" and not bad.ok and "gqa_bs16.json: cannot import" in bad.reason


@needs_ckpts
def test_certification_is_real(tmp_path: Path) -> None:
    """The command's verifier certifies Mirage's candidates against gqa and rejects them
    against a program with the same signature that does not normalise."""
    from mirage_cli.commands.bench import certify

    d = _ckpt_dir(tmp_path)
    files = [d / "gqa_bs1.json"]
    good = bench.mirage_variants(_gqa(1), files, certify(0))
    assert [v.ok and v.graph is not None for v in good] == [True] * 3
    assert all(v.search and v.search["verify"]["bound"] < 1e-9 for v in good)
    unnormalised = GQA.read_text().replace("P = div(E, S);", "P = mul(E, E);")
    wrong = parse_text(unnormalised, "<t>", {"batch": 1})
    bad = bench.mirage_variants(wrong, files, certify(0))
    assert [(v.label, v.ok, v.graph) for v in bad] == \
        [("mirage#1", False, None), ("mirage#2", False, None), ("mirage#3", False, None)]
    assert all("not certified equivalent" in v.reason for v in bad)


def test_run_bench_puts_mirage_rows_after_ours(tmp_path: Path, monkeypatch) -> None:
    """Row order per batch: hand-written, opt's, Mirage's; every row measured the same
    way, against the program."""
    small = ("program small(batch = 4) {\n  input X: f16[batch, 64];\n  Y = exp(X);\n"
             "  output Y;\n}\n")
    (tmp_path / "examples" / "mugraphs").mkdir(parents=True)
    (tmp_path / "examples" / "small.mir").write_text(small)
    prog_path = tmp_path / "examples" / "small.mir"
    measured: list[tuple[str, str]] = []

    def fake_measure(dev, label, g, ref, replays, scale, per_kernel=False):  # type: ignore[no-untyped-def]
        measured.append((label, ref.name))
        return Measured(3.0, Check(True, 1e-4))

    monkeypatch.setattr(bench, "_measure", fake_measure)
    monkeypatch.setattr(bench, "input_scale", lambda g, seed=0: 1.0)
    asked: list[tuple[Path, int]] = []

    def ckpts(path: Path, batch: int, g: Graph) -> list[Variant]:
        asked.append((path, batch))
        return [Variant("mirage#1", g, search={"checkpoint": "x", "index": 0}),
                Variant("mirage", None, "n/a: x.json: input #0 differs")]

    class Dev:
        name, arch, l2_bytes = "fake", "sm_90", 50 << 20

    _, rows = bench.run_bench(Dev(), bench.discover(tmp_path), (1, 2),  # type: ignore[arg-type]
                              use_torch=False, candidates=lambda g: [Variant("opt#1", g)],
                              bandwidth=BW, checkpoints=ckpts)
    assert asked == [(prog_path, 1), (prog_path, 2)]
    assert [(r.batch, r.variant) for r in rows] == [
        (b, v) for b in (1, 2) for v in ("opt#1", "mirage#1", "mirage")]
    assert measured == [("unfused", "small"), ("opt#1", "small"), ("mirage#1", "small")] * 2
    m = rows[1]
    assert m.us == 3.0 and m.baselines == {"unfused": 3.0} and m.floor_us > 0
    assert m.search == {"checkpoint": "x", "index": 0}
    assert rows[2].ok and rows[2].us is None and rows[2].reason.startswith("n/a: ")


def test_mirage_rows_have_their_own_colour() -> None:
    shades = {benchreport.color(f"mirage#{k}") for k in (1, 2, 3)}
    assert len(shades) == 3
    assert not shades & {benchreport.color(x) for x in ("opt#1", "opt#2", "opt#3",
                                                         "gqa_fused", "compile")}


# -- the command line ----------------------------------------------------------------------


def test_missing_checkpoint_dir_exits_2(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["bench", "--gpu", "0", "--root", str(ROOT),
                                  "--mirage-ckpt", str(tmp_path / "nowhere")])
    assert r.exit_code == 2 and "--mirage-ckpt" in r.output and "Traceback" not in r.output


@needs_ckpts
def test_bench_command_with_mirage_checkpoints(tmp_path: Path, monkeypatch) -> None:
    """End to end with the GPU replaced: real import, binding, certification, planning
    and pricing; every mirage row measured against the program, with opt's fields."""
    class Dev:
        name, arch, l2_bytes = "fake", "sm_90", 50 << 20

        def __init__(self, ordinal: int) -> None:
            assert ordinal == 0

    def fake_measure(dev, label, g, ref, replays, scale, per_kernel=False):  # type: ignore[no-untyped-def]
        assert ref.name == "gqa" and g.input_names == ref.input_names
        assert [i.value.type for i in g.inputs] == [i.value.type for i in ref.inputs]
        assert all(op.plan is not None for op in g.ops if op.block is not None)
        kernels = [{"name": f"k{i}", "grid": list(op.block.grid), "threads": op.plan.threads,
                    "dynamic_smem_bytes": 0, "scratch_bytes": 0, "plan": op.plan.as_json()}
                   for i, op in enumerate(g.ops) if op.block is not None and op.plan]
        return Measured(20.0 if label == "unfused" else 10.0, Check(True, 1e-3), kernels)

    monkeypatch.setattr(runner, "Device", Dev)
    monkeypatch.setattr(copybw, "measure", lambda dev: BW)
    monkeypatch.setattr(bench, "_measure", fake_measure)
    monkeypatch.setattr(bench, "input_scale", lambda g, seed=0: 1.0)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "gqa.mir").write_text(GQA.read_text())
    d = _ckpt_dir(tmp_path)
    out = tmp_path / "b.json"
    r = CliRunner().invoke(main, ["bench", "--gpu", "0", "--root", str(tmp_path), "--batch",
                                  "1", "--no-search", "--no-torch", "--mirage-ckpt", str(d),
                                  "--json", str(out), "--markdown", str(tmp_path / "b.md")])
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["rows"]
    assert [row["variant"] for row in rows] == ["mirage#1", "mirage#2", "mirage#3", "mirage"]
    grids = [[list(op.block.grid) for op in g.ops if op.block]
             for g in _import(d / "gqa_bs1.json")]
    for row, index in zip(rows, range(3)):
        assert row["ok"] and row["us"] == 10.0 and row["baselines"] == {"unfused": 20.0}
        assert row["search"]["checkpoint"] == "gqa_bs1.json" and row["search"]["index"] == index
        assert row["search"]["verify"]["equivalent"] is True
        assert row["predicted_us"] > 0 and row["floor_us"] > 0
        assert [k["grid"] for k in row["kernels"]] == grids[index]
        assert all(k["plan"] for k in row["kernels"])
    assert rows[3]["ok"] and rows[3]["us"] is None and "gqa.json" in rows[3]["reason"]
    md = (tmp_path / "b.md").read_text()
    assert "| gqa | 1 | mirage#1 | 10.0 | 20.0 |" in md
    assert "mirage (n/a: gqa.json: input #0 differs" in md


# -- on the GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_ckpts
def test_bench_gqa_mirage_candidates_on_gpu(tmp_path: Path, monkeypatch) -> None:
    """Every candidate of Mirage's gqa_bs1.json passes the bench's correctness check
    (NaN-poisoned outputs, rel. L2 error ≤ 1e-2 against float64) and is timed."""
    if not runner.gpu_available():
        pytest.skip("no CUDA GPU")
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(main, ["bench", "--gpu", "0", "--only", "gqa", "--batch", "1",
                                  "--no-search", "--no-torch", "--replays", "3", "--root",
                                  str(ROOT), "--mirage-ckpt", str(MUGRAPHS), "--json",
                                  str(out)])
    assert out.is_file(), r.output
    doc = json.loads(out.read_text())
    rows = [row for row in doc["rows"] if row["variant"].startswith("mirage")]
    n = len(json.loads((MUGRAPHS / "gqa_bs1.json").read_text()))
    assert [row["variant"] for row in rows] == [f"mirage#{k + 1}" for k in range(n)]
    for k, row in enumerate(rows):
        assert row["ok"], f"{row['variant']}: {row['reason']}"
        assert row["us"] > 0 and row["rel_err"] <= 1e-2 and row["floor_us"] > 0
        assert (row["search"]["checkpoint"], row["search"]["index"]) == ("gqa_bs1.json", k)
        assert row["kernels"] and all(kn["threads"] > 0 and kn["plan"] for kn in row["kernels"])
    assert r.exit_code == 0, r.output
