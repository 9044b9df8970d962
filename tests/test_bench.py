"""`mirage bench`: the copy kernel of the floor, the candidates `mirage opt` keeps, the
renderings of the results (table, JSON, CSV, plot), the SDPA baseline's recogniser of
plain softmax attention, the per-kernel rates and the command line. The GPU tests run
the command end to end, the SDPA baseline and the per-kernel timing."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mirage_cli.cli import main
from mirage_cli.codegen import benchreport, copybw
from mirage_cli.codegen.bench import (
    Attention,
    Row,
    Variant,
    achieved,
    attention_pattern,
    opt_variants,
    sdpa_shape,
    with_rates,
)
from mirage_cli.codegen.copybw import Bandwidth
from mirage_cli.loading import load_graph
from mirage_cli.parser import parse_text

ROOT = Path(__file__).resolve().parent.parent

SMALL = """
program rmsnorm_linear(rows = 4, hidden = 64, n = 32) {
  input X: f16[rows, hidden];
  input W: f16[hidden, n];
  Y = rms_norm(X);
  Z = matmul(Y, W);
  output Z;
}
"""


# -- the copy kernel -------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_copy_kernel_compiles_with_no_spills(arch):
    pytest.importorskip("cuda.bindings")
    from mirage_cli.codegen.nvrtc import compile_cuda

    c = compile_cuda(copybw.SOURCE, "mirage_copy.cu", arch)
    assert c.cubin
    [res] = c.resources
    assert res.kernel == copybw.KERNEL
    assert (res.spill_stores, res.spill_loads, res.stack) == (0, 0, 0)


def test_copy_kernel_moves_16_bytes_per_access():
    nv = pytest.importorskip("cuda.bindings.nvrtc")
    err, prog = nv.nvrtcCreateProgram(copybw.SOURCE.encode(), b"c.cu", 0, [], [])
    assert int(err) == 0
    try:
        (res,) = nv.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=compute_90"])
        assert int(res) == 0
        _, size = nv.nvrtcGetPTXSize(prog)
        buf = b" " * size
        nv.nvrtcGetPTX(prog, buf)
    finally:
        nv.nvrtcDestroyProgram(prog)
    ptx = buf.decode(errors="replace")
    loads = [ln for ln in ptx.splitlines() if "ld.global" in ln]
    stores = [ln for ln in ptx.splitlines() if "st.global" in ln]
    # The unrolled body and the remainder loop; every access is a 4 x 32-bit vector.
    assert len(loads) == len(stores) == copybw.UNROLL + 1
    assert all(".v4." in ln for ln in loads + stores)


@pytest.mark.parametrize("nbytes", [1 << 30, 3 * 64 * 256 * 7 + 64])
def test_copy_launch_shapes_cover_the_buffer(nbytes):
    shapes = copybw.launch_shapes(nbytes, sms=132)
    one = shapes["one-per-thread"]
    # One unrolled iteration per thread covers every 16-byte word; one block fewer
    # would not.
    assert one * copybw.THREADS * copybw.CHUNK >= nbytes
    assert (one - 1) * copybw.THREADS * copybw.CHUNK < nbytes
    assert 0 < shapes["persistent"] <= min(one, 132 * 8)


# -- renderings from synthetic rows ------------------------------------------------------


BW = Bandwidth(copy_kernel=4.25e12, launch="persistent",
               shapes={"persistent": 4.25e12, "one-per-thread": 4.1e12}, memcpy=2.77e12,
               nbytes=1 << 30)
PLAN = {"threads": 256, "reduction": "block", "vector_bytes": 16}


def _rows() -> list[Row]:
    base = {"unfused": 40.0, "eager": 20.0, "compile": 16.0}
    k1 = [{"name": "k0", "grid": [132, 1, 1], "threads": 256, "dynamic_smem_bytes": 49152,
           "scratch_bytes": 0, "plan": PLAN}]
    k2 = [{"name": "k0", "grid": [64, 2, 1], "threads": 128, "dynamic_smem_bytes": 0,
           "scratch_bytes": 0, "plan": None}]
    return [
        Row("rmsnorm_linear", 1, "rmsnorm_linear_fused", 30.0, True, 2e-4, "", 12.0, dict(base),
            BW.copy_kernel, k2),
        Row("rmsnorm_linear", 1, "opt#1 (shipped)", 8.0, True, 1e-4, "", 12.0, dict(base),
            BW.copy_kernel, k1, shipped=True, predicted_us=7.5,
            search={"cached": True, "complete": True, "rank": 0}),
        Row("rmsnorm_linear", 1, "opt#2", None, False, math.nan, "RuntimeError: boom", 12.0,
            dict(base), BW.copy_kernel, predicted_us=9.0),
        Row("rmsnorm_linear", 8, "opt#1 (shipped)", 24.0, True, 3e-4, "", 12.5,
            {"unfused": 50.0, "eager": 30.0, "compile": None}, BW.copy_kernel, k1, shipped=True),
        Row("lora", 1, "lora_fused", None, True, None, "n/a: grid does not divide", 0.5,
            {"unfused": 3.0, "eager": 10.0, "compile": 10.0}, BW.copy_kernel),
    ]


def _doc():
    return benchreport.document("NVIDIA H200", "sm_90", "mirage bench --gpu 0", BW, _rows())


def test_json_carries_bandwidth_plans_and_no_nan():
    text = benchreport.dumps(_doc())
    doc = json.loads(text)  # strict JSON: allow_nan=False would have raised on NaN
    assert doc["bandwidth"]["copy_kernel_bytes_per_s"] == 4.25e12
    assert doc["bandwidth"]["memcpy_bytes_per_s"] == 2.77e12
    rows = doc["rows"]
    assert len(rows) == 5
    assert rows[2]["rel_err"] is None and rows[2]["ok"] is False
    assert rows[1]["kernels"][0]["plan"] == PLAN and rows[0]["kernels"][0]["plan"] is None
    assert rows[1]["kernels"][0]["grid"] == [132, 1, 1]
    assert rows[1]["shipped"] is True and rows[1]["predicted_us"] == 7.5
    assert all(r["bandwidth"] == 4.25e12 for r in rows)


def test_markdown_table_numbers():
    md = benchreport.markdown(_doc())
    assert "4250 GB/s" in md and "cuMemcpyDtoDAsync: 2770 GB/s" in md
    lines = [ln for ln in md.splitlines() if ln.startswith("| rmsnorm_linear | 1 | opt#1")]
    assert len(lines) == 1
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    # µs, unfused, eager, compile, floor, vs unfused/eager/compile, % floor, predicted, err
    assert cells[2:] == ["opt#1 (shipped)", "8.0", "40.0", "20.0", "16.0", "12.0", "5.00×",
                         "2.50×", "2.00×", "150%", "7.5", "1.0e-04"]
    assert "| opt#2 FAIL: RuntimeError: boom | - |" in md
    assert "lora_fused (n/a: grid does not divide)" in md
    header = md.splitlines()[2]
    assert header.count("|") == md.splitlines()[3].count("|")


def test_an_unfinished_report_says_so_and_a_finished_one_has_no_such_key():
    assert "unfinished" not in json.loads(benchreport.dumps(_doc()))
    doc = benchreport.document("NVIDIA H200", "sm_90", "mirage bench --gpu 0", BW,
                               _rows()[:3], "1 of 2 program and batch pairs measured")
    assert json.loads(benchreport.dumps(doc))["unfinished"] == doc["unfinished"]
    md = benchreport.markdown(doc)
    assert md.startswith("**Unfinished run: 1 of 2 program and batch pairs measured.**")
    assert md.count("| rmsnorm_linear | 1 |") == 3


def test_csv_one_row_per_variant_with_kernels():
    rows = list(csv.DictReader(io.StringIO(benchreport.csv_text(_doc()))))
    assert [(r["benchmark"], r["batch"], r["variant"]) for r in rows] == [
        ("rmsnorm_linear", "1", "rmsnorm_linear_fused"), ("rmsnorm_linear", "1", "opt#1 (shipped)"),
        ("rmsnorm_linear", "1", "opt#2"), ("rmsnorm_linear", "8", "opt#1 (shipped)"),
        ("lora", "1", "lora_fused")]
    shipped = rows[1]
    assert shipped["shipped"] == "1" and float(shipped["us"]) == 8.0
    assert float(shipped["eager_us"]) == 20.0 and float(shipped["compile_us"]) == 16.0
    assert float(shipped["floor_fraction"]) == pytest.approx(1.5)
    assert float(shipped["bandwidth_gb_s"]) == pytest.approx(4250.0)
    assert json.loads(shipped["kernels"])[0]["plan"] == PLAN
    assert rows[2]["us"] == "" and rows[2]["rel_err"] == "" and rows[2]["ok"] == "0"
    assert rows[3]["compile_us"] == ""


def test_plot_series_groups_variants_and_baselines():
    batches, labels, series, floors = benchreport.plot_series(_doc(), "rmsnorm_linear")
    assert batches == [1, 8]
    assert labels == ["rmsnorm_linear_fused", "opt#1 (shipped)", "opt#2", "unfused", "eager",
                      "compile"]
    assert series["opt#1 (shipped)"] == [8.0, 24.0]
    assert series["rmsnorm_linear_fused"] == [30.0, None]
    assert series["opt#2"] == [None, None]
    assert series["eager"] == [20.0, 30.0] and series["compile"] == [16.0, None]
    assert floors == [12.0, 12.5]


def test_plot_writes_an_image():
    pytest.importorskip("matplotlib")
    png = benchreport.plot(_doc(), "bench.png")
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


# -- the candidates `mirage opt` keeps ---------------------------------------------------


class _Outcome:
    def __init__(self, cands):
        self.candidates, self.cached, self.complete = cands, False, True


def test_opt_variants_mark_what_select_ships():
    a, b, c = (parse_text(SMALL.replace("n = 32", f"n = {n}"), "<t>", {}) for n in (32, 64, 96))
    cands = [(g, {"rank": i, "cost": {"time_us": 1.0 + i}}) for i, g in enumerate((a, b, c))]
    vs = opt_variants(a, 2, lambda g: _Outcome(cands), lambda out: out.candidates[1][0])
    assert [v.label for v in vs] == ["opt#1", "opt#2 (shipped)"]
    assert [v.predicted_us for v in vs] == [1.0, 2.0] and vs[1].graph == b
    none = opt_variants(a, 3, lambda g: _Outcome([]), lambda out: None)
    assert len(none) == 1 and none[0].graph is None and not none[0].ok


def test_opt_variants_mark_the_unfused_lowering_when_opt_ships_it():
    """opt ships the program itself when every candidate is predicted slower
    (commands.opt.stage_ship): the bench times and marks that, not candidate 1."""
    from mirage_cli.commands.opt import stage_ship
    from mirage_cli.search.cost import estimate

    a, b = (parse_text(SMALL.replace("n = 32", f"n = {n}"), "<t>", {}) for n in (32, 1 << 20))
    slow = [(b, {"rank": 0, "cost": {"time_us": 1e6}})]
    vs = opt_variants(a, 1, lambda g: _Outcome(slow), lambda out: a)
    assert [v.label for v in vs] == ["opt: unfused (shipped)", "opt#1"]
    assert vs[0].graph == a and vs[0].shipped and not vs[1].shipped
    assert vs[0].predicted_us == estimate(a).time_us
    # stage_ship itself: the candidate, unless the model predicts it slower than the
    # program (b reads a weight 32768 times a's, so it stands in for a slower candidate).
    assert stage_ship(a, _Outcome([(a, {})])) == (a, None)
    best, why = stage_ship(a, _Outcome([(b, {})]))
    assert best is a and "predicted slower than the unfused program" in why
    assert stage_ship(a, _Outcome([(b, {})]), require_fused=True) == (b, None)
    assert stage_ship(a, _Outcome([])) == (None, None)


def test_bench_candidates_are_what_opt_ships(tmp_path, monkeypatch):
    from mirage_cli.commands.bench import opt_candidates, opt_settings
    from mirage_cli.search.cost import TIE_REL

    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    prog = tmp_path / "small.mir"
    prog.write_text(SMALL)
    r = CliRunner().invoke(main, ["opt", str(prog), "-o", str(tmp_path / "s.cu"), "--jobs", "1",
                                  "--save-temps", str(tmp_path / "t")])
    assert r.exit_code == 0, r.output
    shipped = load_graph(str(tmp_path / "t" / "small.best.ugraph.json"), {})
    vs = opt_candidates(load_graph(str(prog), {}), 2, opt_settings(jobs=1, top=2))
    assert [v.label for v in vs] == ["opt#1 (shipped)", "opt#2"]
    assert vs[0].shipped and not vs[1].shipped
    assert vs[0].graph == shipped and vs[1].graph != shipped
    # Found through opt's cache entry: the same search, with the same options.
    assert all(v.search is not None and v.search["cached"] for v in vs)
    # Ranked by the search's rule: faster first, predictions within 1% ordered by the
    # tie rule (search/cost.py).
    assert vs[0].predicted_us is not None and vs[1].predicted_us is not None
    assert vs[0].predicted_us <= vs[1].predicted_us * (1 + TIE_REL)


def test_bench_certifies_only_the_candidates_it_times(monkeypatch):
    """``--top N`` needs N certified candidates, not the search's own top: a cache entry
    from a plain `mirage opt` (one certified, at sizes reused from another search)
    serves ``--top 1`` without verifying again."""
    from mirage_cli.commands import bench as cmd
    from mirage_cli.commands import opt

    needs: list[int | None] = []

    def search(g, kw, budget, need=None):  # type: ignore[no-untyped-def]
        needs.append(need)
        raise RuntimeError("stop here")

    monkeypatch.setattr(opt, "stage_search", search)
    prog = parse_text(SMALL, "<t>", {})
    for top in (1, 2):
        cmd.opt_candidates(prog, top, cmd.opt_settings(jobs=1, top=top))
    assert needs == [1, 2]


def test_a_failing_search_is_a_row():
    from mirage_cli.commands import bench as cmd

    def broken(*a, **k):
        raise RuntimeError("no solver")

    prog = parse_text(SMALL, "<t>", {})
    orig = cmd.opt_variants
    cmd.opt_variants = broken
    try:
        [v] = cmd.opt_candidates(prog, 3, cmd.opt_settings(jobs=1))
    finally:
        cmd.opt_variants = orig
    assert isinstance(v, Variant) and not v.ok and v.graph is None
    assert "search failed: RuntimeError: no solver" in v.reason


def test_run_bench_rows_floor_and_variants(tmp_path, monkeypatch):
    """The assembly of rows, with the GPU measurement replaced by fixed times."""
    from mirage_cli.codegen import bench
    from mirage_cli.codegen.bench import Check, Measured

    timed: list[str] = []

    def fake_measure(dev, label, g, ref, replays, scale, per_kernel=False):
        timed.append(label)
        if label == "opt#2":
            return Measured(None, Check(False, 0.5, "relative L2 error 0.5 > 0.01"))
        return Measured(10.0 + len(timed), Check(True, 1e-4),
                        [{"name": "k", "grid": [1, 1, 1], "threads": 32,
                          "dynamic_smem_bytes": 0, "scratch_bytes": 0, "plan": None}])

    monkeypatch.setattr(bench, "_measure", fake_measure)
    monkeypatch.setattr(bench, "input_scale", lambda g, seed=0: 1.0)
    prog = tmp_path / "examples" / "small.mir"
    prog.parent.mkdir()
    prog.write_text(SMALL)
    fused = tmp_path / "examples" / "mugraphs" / "small_fused.mir"
    fused.parent.mkdir()
    fused.write_text(SMALL.replace("rows = 4", "rows = 6"))  # the wrong shape: n/a

    def load(p, d):
        if p == fused:
            raise bench.MirageError("grid does not tile rows")
        return load_graph(str(p), {})

    a, b = (parse_text(SMALL.replace("n = 32", f"n = {n}"), "<t>", {}) for n in (32, 64))

    def cands(g):
        return [Variant("opt#1 (shipped)", a, shipped=True, predicted_us=3.0),
                Variant("opt#2", b, predicted_us=4.0)]

    class Dev:
        name, arch, l2_bytes = "fake", "sm_90", 50 << 20

    pairs = bench.discover(tmp_path)
    assert pairs == [(prog, [fused])]
    reports: list[tuple[list[str], int, int]] = []
    bw, rows = bench.run_bench(Dev(), pairs, (1, 2), use_torch=False, load=load,
                               candidates=cands, bandwidth=BW,  # type: ignore[arg-type]
                               progress=lambda bw, rows, done, total: reports.append(
                                   ([r.variant for r in rows], done, total)))
    assert bw is BW
    # the rows so far after each program and batch but the last (the command writes
    # its reports then: a run stopped early keeps them)
    assert reports == [(["small_fused", "opt#1 (shipped)", "opt#2"], 1, 2)]
    assert timed == ["unfused", "opt#1 (shipped)", "opt#2"] * 2
    assert [r.variant for r in rows] == ["small_fused", "opt#1 (shipped)", "opt#2"] * 2
    fixed, shipped, failed = rows[:3]
    assert fixed.us is None and fixed.ok and fixed.reason.startswith("n/a: ")
    assert shipped.shipped and shipped.us == 12.0 and shipped.baselines == {"unfused": 11.0}
    assert shipped.kernels[0]["threads"] == 32 and shipped.predicted_us == 3.0
    assert not failed.ok and failed.us is None and "0.5 > 0.01" in failed.reason
    # inputs X (4 x 64) and W (64 x 32), output Z (4 x 32), all f16
    nbytes = 2 * (4 * 64 + 64 * 32 + 4 * 32)
    assert shipped.floor_us == pytest.approx(nbytes / BW.copy_kernel * 1e6)
    assert all(r.bandwidth == BW.copy_kernel for r in rows)


def test_a_program_without_a_batch_parameter_is_left_out_with_a_warning(monkeypatch, tmp_path,
                                                                         capsys):
    """--batch cannot size a program with no batch parameter: it is left out with a
    warning, and the other programs are benched; any other error still stops the bench."""
    from mirage_cli.codegen import bench
    from mirage_cli.codegen.bench import Check, Measured

    monkeypatch.setattr(bench, "_measure", lambda *a, **k: Measured(10.0, Check(True, 1e-4)))
    monkeypatch.setattr(bench, "input_scale", lambda g, seed=0: 1.0)
    (tmp_path / "examples").mkdir()
    sized = SMALL.replace("(rows = 4,", "(batch = 1, rows = 4,").replace(
        "f16[rows, hidden]", "f16[rows * batch, hidden]")
    (tmp_path / "examples" / "sized.mir").write_text(sized.replace("rmsnorm_linear", "sized"))
    (tmp_path / "examples" / "fixed.mir").write_text(SMALL.replace("rmsnorm_linear", "fixed"))

    class Dev:
        name, arch, l2_bytes = "fake", "sm_90", 50 << 20

    _, rows = bench.run_bench(Dev(), bench.discover(tmp_path), (1, 2),  # type: ignore[arg-type]
                              use_torch=False, bandwidth=BW)
    assert sorted({(r.benchmark, r.batch) for r in rows}) == [("sized", 1), ("sized", 2)]
    err = capsys.readouterr().err
    assert "fixed.mir:leftout:theprogramhasno'batch'parameter" in "".join(err.split())
    (tmp_path / "examples" / "fixed.mir").write_text("program fixed(batch = 1) {")
    with pytest.raises(bench.MirageError):
        bench.run_bench(Dev(), bench.discover(tmp_path), (1,),  # type: ignore[arg-type]
                        use_torch=False, bandwidth=BW)


def test_own_sizes_bench_each_program_at_its_declared_batch(monkeypatch, tmp_path):
    """--batch own (run_bench's batches None) benches each program once, at its own
    sizes, its rows carrying its batch parameter's value; a root with no examples/
    holds the programs itself (--root examples/models)."""
    from mirage_cli.codegen import bench
    from mirage_cli.codegen.bench import Check, Measured
    from mirage_cli.commands.bench import parse_batches

    monkeypatch.setattr(bench, "_measure", lambda *a, **k: Measured(10.0, Check(True, 1e-4)))
    monkeypatch.setattr(bench, "input_scale", lambda g, seed=0: 1.0)
    sized = SMALL.replace("(rows = 4,", "(batch = 3, rows = 4,").replace(
        "f16[rows, hidden]", "f16[rows * batch, hidden]")
    (tmp_path / "sized_b3.mir").write_text(sized.replace("rmsnorm_linear", "sized_b3"))
    (tmp_path / "fixed.mir").write_text(SMALL.replace("rmsnorm_linear", "fixed"))
    pairs = bench.discover(tmp_path)
    assert [p.stem for p, _ in pairs] == ["fixed", "sized_b3"]

    class Dev:
        name, arch, l2_bytes = "fake", "sm_90", 50 << 20

    assert parse_batches("own") is None and parse_batches("1,8") == (1, 8)
    _, rows = bench.run_bench(Dev(), pairs, None, use_torch=False,  # type: ignore[arg-type]
                              bandwidth=BW)
    assert sorted({(r.benchmark, r.batch) for r in rows}) == [("fixed", 0), ("sized_b3", 3)]
    own = load_graph(str(tmp_path / "sized_b3.mir"))  # batch = 3: 12 rows
    assert all(r.floor_us == pytest.approx(bench.floor_us(own, BW.copy_kernel))
               for r in rows if r.benchmark == "sized_b3")


# -- the command line ----------------------------------------------------------------------


@pytest.mark.parametrize("batch", ["1,x", "0", "8,-1", ""])
def test_bad_batch_exits_2(batch):
    r = CliRunner().invoke(main, ["bench", "--gpu", "0", "--batch", batch, "--root", str(ROOT)])
    assert r.exit_code == 2
    assert f"--batch {batch}" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("top", ["0", "-2", "three"])
def test_bad_top_exits_2(top):
    r = CliRunner().invoke(main, ["bench", "--gpu", "0", "--top", top, "--root", str(ROOT)])
    assert r.exit_code == 2 and "--top" in r.output


def test_plot_without_matplotlib_exits_2_before_measuring(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    r = CliRunner().invoke(main, ["bench", "--gpu", "0", "--plot", "b.png", "--root", str(ROOT)])
    assert r.exit_code == 2 and "--plot needs matplotlib" in r.output
    r = CliRunner().invoke(main, ["bench", "--gpu", "0", "--plot", "b.txt", "--root", str(ROOT)])
    assert r.exit_code == 2 and "must end in .png" in r.output


def test_bench_command_writes_every_output(tmp_path, monkeypatch):
    """The command end to end with the GPU replaced: device, copy bandwidth and
    measurements are fakes; the search, the rows and every file are real."""
    from mirage_cli.codegen import bench, runner
    from mirage_cli.codegen.bench import Check, Measured

    class Dev:
        name, arch, l2_bytes = "fake", "sm_90", 50 << 20

        def __init__(self, ordinal):
            assert ordinal == 0

    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "Device", Dev)
    monkeypatch.setattr(copybw, "measure", lambda dev: BW)
    monkeypatch.setattr(bench, "_measure", lambda dev, label, g, ref, replays, scale,
                        per_kernel=False:
                        Measured(5.0 if label != "unfused" else 9.0, Check(True, 1e-4)))
    monkeypatch.setattr(bench, "input_scale", lambda g, seed=0: 1.0)
    (tmp_path / "examples").mkdir()
    batched = SMALL.replace("rows", "batch").replace("rmsnorm_linear", "small")
    (tmp_path / "examples" / "small.mir").write_text(batched)
    out = tmp_path / "out"
    args = ["bench", "--gpu", "0", "--root", str(tmp_path), "--batch", "1", "--top", "2",
            "--jobs", "1", "--no-torch", "--json", str(out / "b.json"), "--csv",
            str(out / "b.csv"), "--markdown", str(out / "b.md")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "b.json").read_text())
    assert [row["variant"] for row in doc["rows"]] == ["opt#1 (shipped)", "opt#2"]
    assert doc["rows"][0]["baselines"] == {"unfused": 9.0}
    assert doc["bandwidth"]["copy_kernel_bytes_per_s"] == BW.copy_kernel
    assert len(list(csv.DictReader((out / "b.csv").open()))) == 2
    assert "| small | 1 | opt#1 (shipped) | 5.0 | 9.0 |" in (out / "b.md").read_text()
    assert "4250 GB/s" in " ".join(r.output.split())


# -- on the GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_bench_lora_end_to_end(tmp_path, monkeypatch):
    from mirage_cli.codegen.runner import gpu_available

    if not gpu_available():
        pytest.skip("no CUDA GPU")
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    args = ["bench", "--gpu", "0", "--only", "lora", "--batch", "1", "--top", "2",
            "--replays", "3", "--root", str(ROOT), "--json", str(out), "--csv",
            str(tmp_path / "bench.csv")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    bw = doc["bandwidth"]
    assert bw["copy_kernel_bytes_per_s"] > 0 and bw["memcpy_bytes_per_s"] > 0
    # The table's title gives it (rich may wrap the title: compare words).
    words = " ".join(r.output.split())
    assert (f"/ {bw['copy_kernel_bytes_per_s'] / 1e9:.0f} GB/s, the bandwidth of a 16-byte "
            f"streaming copy kernel") in words
    variants = [row["variant"] for row in doc["rows"]]
    assert variants[:3] == ["lora_fused", "opt#1 (shipped)", "opt#2"]
    for row in doc["rows"]:
        assert row["ok"] and row["us"] > 0 and row["rel_err"] <= 1e-2
        assert row["floor_us"] > 0 and row["bandwidth"] == bw["copy_kernel_bytes_per_s"]
        assert row["kernels"] and all(k["threads"] > 0 for k in row["kernels"])
    assert len(list(csv.DictReader((tmp_path / "bench.csv").open()))) == len(doc["rows"])


def test_opt_settings_are_opts_own_defaults():
    """The bench searches with opt's defaults: pruning and the cache on (a flag's default
    read as a truthy sentinel once turned both off)."""
    from mirage_cli.commands.bench import opt_settings

    kw = opt_settings(jobs=1)
    assert kw["no_prune"] is False and kw["no_cache"] is False and kw["jobs"] == 1


def test_inputs_are_drawn_once_per_program_and_read_only():
    """Every variant of a program times over the same input copies: drawn once, shared
    read-only, and dropped when another program's inputs are drawn."""
    from mirage_cli.codegen import bench

    a = parse_text("program a() {\n  input X: f16[4, 8];\n  Y = exp(X);\n  output Y;\n}\n")
    b = parse_text("program b() {\n  input Z: f32[2, 8];\n  Y = exp(Z);\n  output Y;\n}\n")
    first = bench.scaled_inputs(a, 3, 0.5)
    assert bench.scaled_inputs(a, 3, 0.5) is first
    assert not first["X"].flags.writeable
    assert bench.scaled_inputs(a, 4, 0.5)["X"].tolist() != first["X"].tolist()
    bench.scaled_inputs(b, 3, 0.5)
    again = bench.scaled_inputs(a, 3, 0.5)
    assert again is not first and again["X"].tolist() == first["X"].tolist()


# -- the SDPA baseline: which programs are plain softmax attention -----------------------

ATTN = """
program attn(b = 2, l = 4, d = 8, s = 16) {
  input Q: f16[b, l, d];
  input K: f16[b, d, s];
  input V: f16[b, s, d];
  A = matmul(Q, K);
  S = mul_scalar(A, scalar=0.25);
  P = softmax(S, dim=2);
  O = matmul(P, V);
  output O;
}
"""
SCALE_128 = 0.08838834764831845  # 1/sqrt(128), as the examples write it


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("name", ["mha_decode", "mqa_decode"])
def test_attention_examples_are_plain_attention(name, batch):
    g = load_graph(str(ROOT / "examples" / f"{name}.mir"), {"batch": batch})
    assert attention_pattern(g) == Attention("Q", "K", "V", SCALE_128)


@pytest.mark.parametrize("name", ["gqa", "qknorm_gqa", "rmsnorm_linear", "gated_mlp", "lora",
                                  "ntrans"])
def test_other_examples_are_not_plain_attention(name):
    # gqa is exp / sum / div: no max subtraction, so not the function SDPA computes.
    g = load_graph(str(ROOT / "examples" / f"{name}.mir"), {"batch": 1})
    assert attention_pattern(g) is None


def test_attention_without_a_scale_has_scale_one():
    g = parse_text(ATTN.replace("  S = mul_scalar(A, scalar=0.25);\n", "")
                   .replace("softmax(S", "softmax(A"))
    assert attention_pattern(g) == Attention("Q", "K", "V", 1.0)
    assert attention_pattern(parse_text(ATTN)) == Attention("Q", "K", "V", 0.25)


@pytest.mark.parametrize("old, new", [
    ("softmax(S, dim=2)", "softmax(S, dim=1)"),             # softmax over a non-last dim
    ("mul_scalar(A, scalar=0.25)", "neg(A)"),               # another op in the scale's place
    ("S = mul_scalar(A, scalar=0.25);\n  P = softmax(S, dim=2);",
     "S = softmax(A, dim=2);\n  P = mul_scalar(S, scalar=0.25);"),  # scaled after softmax
    ("A = matmul(Q, K);\n  S = mul_scalar(A, scalar=0.25);",
     "QS = mul_scalar(Q, scalar=0.25);\n  S = matmul(QS, K);"),     # scale on Q: not exactly
    ("output O;", "output O;\n  output A;"),                # another output
    ("input Q: f16[b, l, d]", "input Q: f16[1, l, d]"),     # broadcast batch dims
])
def test_near_attention_is_not_plain_attention(old, new):
    assert old in ATTN
    assert attention_pattern(parse_text(ATTN.replace(old, new))) is None


def test_sdpa_shapes_add_a_head_dim():
    assert sdpa_shape((256, 1, 128)) == (256, 1, 1, 128)   # mha_decode's Q
    assert sdpa_shape((8, 32, 128)) == (8, 1, 32, 128)     # mqa_decode's Q: 32 query rows
    assert sdpa_shape((4, 8)) == (1, 1, 4, 8)
    assert sdpa_shape((2, 3, 4, 5)) == (2, 3, 4, 5)


@pytest.mark.parametrize("src", ["attn", "mqa_decode"])
def test_sdpa_fn_computes_the_program(src):
    """The baseline's function against the float64 reference, on the CPU (SDPA runs
    there too), with the bench's own inputs and check."""
    torch = pytest.importorskip("torch")
    from mirage_cli.codegen import bench

    g = (parse_text(ATTN) if src == "attn" else
         load_graph(str(ROOT / "examples" / "mqa_decode.mir"), {"batch": 1}))
    att = attention_pattern(g)
    assert att is not None
    ins = bench.scaled_inputs(g, 0, 1.0)
    xs = [torch.from_numpy(ins[i.value.name].copy()).to(torch.float16) for i in g.inputs]
    (out,) = bench.sdpa_fn(g, att)(*bench.sdpa_inputs(g, att)(xs))
    got = {g.outputs[0]: out.float().numpy()}
    chk = bench.compare(got, bench.reference_outputs(g, 0, 1.0), list(g.outputs))
    assert chk.ok, chk.reason


def _baseline_doc(sdpa: float | None) -> dict:
    rows = [Row("mha_decode", 1, "opt#1 (shipped)", 10.0, True, 1e-4, "", 5.0,
                {"unfused": 40.0, "eager": 30.0, "compile": 20.0, "sdpa": sdpa}, BW.copy_kernel,
                shipped=True),
            Row("lora", 1, "opt#1 (shipped)", 4.0, True, 1e-4, "", 0.5,
                {"unfused": 8.0, "eager": 10.0, "compile": 10.0}, BW.copy_kernel, shipped=True)]
    return benchreport.document("NVIDIA H200", "sm_90", "mirage bench --gpu 0", BW, rows)


def test_sdpa_column_beside_eager_and_compile():
    doc = _baseline_doc(12.5)
    assert benchreport.baselines(doc) == ["unfused", "eager", "compile", "sdpa"]
    head, body = benchreport.table_cells(doc)
    assert head[4:8] == ["unfused µs", "eager µs", "compile µs", "sdpa µs"]
    assert head[9:13] == ["vs unfused", "vs eager", "vs compile", "vs sdpa"]
    attn, lora = body
    assert attn[7] == "12.5" and attn[12] == "1.25×"
    assert lora[7] == "-" and lora[12] == "-"   # not plain attention: no SDPA
    rows = list(csv.DictReader(io.StringIO(benchreport.csv_text(doc))))
    assert float(rows[0]["sdpa_us"]) == 12.5 and rows[1]["sdpa_us"] == ""
    assert json.loads(benchreport.dumps(doc))["rows"][0]["baselines"]["sdpa"] == 12.5
    assert benchreport.plot_series(doc, "mha_decode")[2]["sdpa"] == [12.5]


def test_no_sdpa_column_without_attention():
    doc = _baseline_doc(None)
    doc["rows"][0]["baselines"].pop("sdpa")
    assert "sdpa µs" not in benchreport.table_cells(doc)[0]


# -- achieved rates per kernel (--per-kernel) ----------------------------------------------


def test_achieved_rates_arithmetic():
    # 268435456 FLOPs and 270598144 bytes (mha_decode's Q @ K at batch 8) in 100 µs
    tflop_s, gb_s = achieved(268435456, 270598144, 100.0)
    assert tflop_s == pytest.approx(2.68435456) and gb_s == pytest.approx(2705.98144)
    assert achieved(10**12, 10**9, 1e6) == pytest.approx((1.0, 1.0))  # 1 s
    assert achieved(1, 1, None) == (None, None) and achieved(1, 1, 0.0) == (None, None)


def _kernel(name: str, grid: list[int], threads: int) -> dict:
    return {"name": name, "grid": grid, "threads": threads, "dynamic_smem_bytes": 0,
            "scratch_bytes": 0, "plan": None}


def test_with_rates_matches_kernels_counts_and_times():
    ks = [_kernel("k0", [132, 1, 1], 256), _kernel("k1", [8, 1, 1], 128)]
    out = with_rates(ks, ["custom", "softmax"], [(2_000_000, 4_000_000), (0, 1_000_000)],
                     {"k0": 2.0, "k1": 0.5})
    assert out[0]["op"] == "custom" and out[0]["us"] == 2.0
    assert out[0]["tflop_s"] == pytest.approx(1.0) and out[0]["gb_s"] == pytest.approx(2000.0)
    assert out[1]["tflop_s"] == 0.0 and out[1]["gb_s"] == pytest.approx(2000.0)
    assert out[0]["grid"] == [132, 1, 1] and "flops" not in ks[0]  # inputs left alone
    # No counts (the model failed, or not one per kernel), no time: rates unknown.
    for counts in (None, [(1, 1)]):
        unk = with_rates(ks, ["custom", "softmax"], counts, {"k0": 2.0})
        assert [k["tflop_s"] for k in unk] == [None, None]
        assert unk[0]["us"] == 2.0 and unk[1]["us"] is None


def test_model_counts_are_the_cost_models():
    from mirage_cli.codegen.bench import model_counts
    from mirage_cli.search.cost import kernel_costs

    g = load_graph(str(ROOT / "examples" / "mugraphs" / "gqa_fused.mir"), {"batch": 1})
    counts = model_counts(g, [(i,) for i in range(len(g.ops))])
    assert len(counts) == len(g.ops)
    assert counts == [(c.flops, c.dram_bytes) for c in kernel_costs(g)]


def test_model_counts_and_kinds_add_up_per_launch():
    """A grouped launch (codegen/grouping.py) carries the sum of its kernels' counts
    and their kinds joined; a reshape that launches nothing is in no launch."""
    from codegen_cases import reshape_aliases

    from mirage_cli.codegen.bench import launch_kinds, model_counts
    from mirage_cli.codegen.lower import lower
    from mirage_cli.search.cost import kernel_costs

    g = reshape_aliases()
    runs = lower(g).launch_ops
    assert runs == ((1, 6), (4, 5))
    ks = kernel_costs(g)
    assert model_counts(g, runs) == [
        (ks[1].flops + ks[6].flops, ks[1].dram_bytes + ks[6].dram_bytes),
        (ks[4].flops + ks[5].flops, ks[4].dram_bytes + ks[5].dram_bytes)]
    assert launch_kinds(g, runs) == ["exp+reshape", "exp+reshape"]


def test_kernel_times_launch_each_kernel_alone():
    """Without a GPU: a fake device and module record what each timed graph enqueues.
    Each kernel is captured alone, over the rotating input copies, and the program and
    every buffer are restored afterwards."""
    from mirage_cli.codegen import bench
    from mirage_cli.codegen.lower import lower
    from mirage_cli.codegen.plan import Launch

    g = load_graph(str(ROOT / "examples" / "mugraphs" / "gqa_fused.mir"), {"batch": 1})
    prog = lower(g)
    live: set[int] = set()
    captured: list[list[tuple[str, ...]]] = []

    class Dev:
        l2_bytes = 1 << 20

        def __init__(self):
            self.next = 0

        def alloc(self, nbytes):
            self.next += 1
            live.add(self.next)
            return self.next

        def free(self, ptr):
            live.remove(ptr)

        def sync(self):
            pass

        def time_graph(self, record, calls, replays):
            captured.append([])
            for i in range(calls):
                record(i)
            return float(len(captured))

    dev = Dev()

    class Module:
        def __init__(self):
            self.prog = prog

        def alloc(self):
            ptrs = {b.name: dev.alloc(1) for b in prog.inputs + prog.outputs}
            return bench.Buffers(ptrs, dev.alloc(1))

        def free(self, bufs):
            for q in [*bufs.ptrs.values(), bufs.workspace]:
                dev.free(q)

        def upload_inputs(self, bufs, ins):
            pass

        def enqueue(self, bufs, steps=None):
            captured[-1].append(tuple(s.kernel for s in steps or self.prog.steps
                                      if isinstance(s, Launch)))

    mod = Module()
    times = bench.kernel_times(dev, mod, g, 3, 0.25)  # type: ignore[arg-type]
    names = [k.name for k in prog.kernels]
    assert len(names) == 2 and times == {names[0]: 1.0, names[1]: 2.0}
    n = bench.copies_needed(dev, g)  # type: ignore[arg-type]
    assert [set(c) for c in captured] == [{(names[0],)}, {(names[1],)}]
    assert all(len(c) == max(n, 8) for c in captured)
    assert mod.prog is prog and not live


def _per_kernel_doc() -> dict:
    rows = _rows()
    rows[1].kernels = with_rates(rows[1].kernels, ["custom"], [(24_000_000, 16_000_000)],
                                 {"k0": 7.5})
    return benchreport.document("NVIDIA H200", "sm_90", "mirage bench --gpu 0", BW, rows)


def test_per_kernel_lines_under_the_row():
    doc = _per_kernel_doc()
    k = json.loads(benchreport.dumps(doc))["rows"][1]["kernels"][0]
    assert (k["us"], k["flops"], k["dram_bytes"], k["op"]) == (7.5, 24_000_000, 16_000_000,
                                                               "custom")
    assert k["tflop_s"] == pytest.approx(3.2) and k["gb_s"] == pytest.approx(2133.33, rel=1e-4)
    assert k["grid"] == [132, 1, 1] and k["threads"] == 256
    md = benchreport.markdown(doc).splitlines()
    row = next(i for i, ln in enumerate(md) if ln.startswith("| rmsnorm_linear | 1 | opt#1"))
    cells = [c.strip() for c in md[row + 1].strip("|").split("|")]
    line = "└ k0 custom grid 132×1×1, 256 threads: 3.20 TFLOP/s, 2133 GB/s"
    assert cells[:4] == ["", "", line, "7.5"]
    assert md[row + 1].count("|") == md[2].count("|")   # as many cells as the header
    assert md[row + 2].startswith("| rmsnorm_linear | 1 | opt#2")  # one line per kernel
    # Rows whose kernels were not timed one by one get no lines.
    assert sum("└" in ln for ln in md) == 1
    assert json.loads(list(csv.DictReader(io.StringIO(benchreport.csv_text(doc))))[1]
                      ["kernels"])[0]["tflop_s"] == pytest.approx(3.2)


def test_run_bench_sdpa_only_for_attention_and_per_kernel(tmp_path, monkeypatch):
    """The SDPA baseline joins the row's baselines for plain attention only, and
    ``per_kernel`` reaches the variants' measurements (not the unfused baseline's)."""
    from mirage_cli.codegen import bench
    from mirage_cli.codegen.bench import Check, Measured

    calls: list[tuple[str, bool]] = []
    sdpa: list[Attention] = []

    def fake_measure(dev, label, g, ref, replays, scale, per_kernel=False):
        calls.append((label, per_kernel))
        return Measured(10.0, Check(True, 1e-4))

    def fake_sdpa(dev, g, att, replays, scale):
        sdpa.append(att)
        return 7.0, Check(True, 1e-3)

    monkeypatch.setattr(bench, "_measure", fake_measure)
    monkeypatch.setattr(bench, "input_scale", lambda g, seed=0: 1.0)
    monkeypatch.setattr(bench, "torch_unavailable", lambda: None)
    monkeypatch.setattr(bench, "_torch_baseline", lambda dev, g, compiled, replays, scale:
                        (20.0 if compiled else 30.0, Check(True, 1e-3)))
    monkeypatch.setattr(bench, "_sdpa_baseline", fake_sdpa)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "attn.mir").write_text(ATTN)
    (tmp_path / "examples" / "small.mir").write_text(SMALL)
    a = parse_text(ATTN)

    class Dev:
        name, arch, l2_bytes = "fake", "sm_90", 50 << 20

    def cands(g):
        return [Variant("opt#1 (shipped)", g, shipped=True)]

    _, rows = bench.run_bench(Dev(), bench.discover(tmp_path), (1,),  # type: ignore[arg-type]
                              load=lambda p, d: load_graph(str(p), {}), bandwidth=BW,
                              per_kernel=True, candidates=cands)
    by_bench = {r.benchmark: r for r in rows}
    assert by_bench["attn"].baselines == {"unfused": 10.0, "eager": 30.0, "compile": 20.0,
                                          "sdpa": 7.0}
    assert "sdpa" not in by_bench["rmsnorm_linear"].baselines
    assert sdpa == [attention_pattern(a)]
    assert calls == [("unfused", False), ("opt#1 (shipped)", True)] * 2


def test_a_failing_sdpa_baseline_is_a_row(monkeypatch):
    """SDPA that does not match the reference is a FAIL row, as eager's would be."""
    from mirage_cli.codegen import bench
    from mirage_cli.codegen.bench import Check, Measured

    monkeypatch.setattr(bench, "_measure", lambda *a, **k: Measured(10.0, Check(True, 1e-4)))
    monkeypatch.setattr(bench, "input_scale", lambda g, seed=0: 1.0)
    monkeypatch.setattr(bench, "_torch_baseline", lambda *a: (20.0, Check(True, 1e-3)))
    monkeypatch.setattr(bench, "_sdpa_baseline", lambda *a: (
        None, Check(False, 0.3, "relative L2 error 0.3 > 0.01")))
    rows = bench._bench_one(object(), parse_text(ATTN), 1, [], BW.copy_kernel, 3,  # type: ignore[arg-type]
                            True, True, False, 1.0)
    assert [r.variant for r in rows] == ["baseline sdpa", "(no fused µGraph)"]
    assert not rows[0].ok and "0.3 > 0.01" in rows[0].reason
    assert rows[1].baselines["sdpa"] is None


def test_per_kernel_option_reaches_the_report(tmp_path, monkeypatch):
    """`mirage bench --per-kernel`: the measurements are asked for per-kernel times and
    the Markdown prints each kernel under its row (GPU replaced by fakes)."""
    from mirage_cli.codegen import bench, runner
    from mirage_cli.codegen.bench import Check, Measured

    class Dev:
        name, arch, l2_bytes = "fake", "sm_90", 50 << 20

        def __init__(self, ordinal):
            pass

    def fake_measure(dev, label, g, ref, replays, scale, per_kernel=False):
        ks = [_kernel("k0", [64, 1, 1], 128)]
        if per_kernel:
            ks = with_rates(ks, ["custom"], [(5_000_000, 10_000_000)], {"k0": 5.0})
        return Measured(5.0, Check(True, 1e-4), ks)

    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "Device", Dev)
    monkeypatch.setattr(copybw, "measure", lambda dev: BW)
    monkeypatch.setattr(bench, "_measure", fake_measure)
    monkeypatch.setattr(bench, "input_scale", lambda g, seed=0: 1.0)
    (tmp_path / "examples" / "mugraphs").mkdir(parents=True)
    batched = SMALL.replace("rows", "batch").replace("rmsnorm_linear", "small")
    (tmp_path / "examples" / "small.mir").write_text(batched)
    (tmp_path / "examples" / "mugraphs" / "small_fused.mir").write_text(batched)
    base = ["bench", "--gpu", "0", "--root", str(tmp_path), "--batch", "1", "--no-search",
            "--no-torch"]
    for flag, lines in (([], 0), (["--per-kernel"], 1)):
        md = tmp_path / f"b{lines}.md"
        r = CliRunner().invoke(main, base + flag + ["--markdown", str(md)])
        assert r.exit_code == 0, r.output
        text = md.read_text()
        assert text.count("└ k0 custom grid 64×1×1, 128 threads: 1.00 TFLOP/s, 2000 GB/s") \
            == lines


# -- on the GPU: the SDPA baseline and per-kernel timing -----------------------------------


def _gpu() -> None:
    from mirage_cli.codegen.runner import gpu_available

    if not gpu_available():
        pytest.skip("no CUDA GPU")


@pytest.mark.gpu
def test_sdpa_baseline_on_gpu():
    _gpu()
    from mirage_cli.codegen import bench
    from mirage_cli.codegen.runner import Device

    why_not = bench.torch_unavailable()
    if why_not:
        pytest.skip(why_not)
    g = load_graph(str(ROOT / "examples" / "mqa_decode.mir"), {"batch": 1})
    att = attention_pattern(g)
    assert att is not None
    us, chk = bench._sdpa_baseline(Device(0), g, att, 3, bench.input_scale(g))
    assert chk.ok, chk.reason
    assert us is not None and us > 0 and chk.rel_err <= 1e-2


@pytest.mark.gpu
def test_per_kernel_times_on_gpu():
    """Each kernel of a fused µGraph timed alone: one positive time per launch, the
    rates from the cost model's counts."""
    _gpu()
    from mirage_cli.codegen import bench
    from mirage_cli.codegen.runner import Device

    dev = Device(0)
    prog = load_graph(str(ROOT / "examples" / "gqa.mir"), {"batch": 1})
    g = load_graph(str(ROOT / "examples" / "mugraphs" / "gqa_fused.mir"), {"batch": 1})
    scale = bench.input_scale(prog)
    m = bench._measure(dev, "gqa_fused", g, prog, 3, scale, per_kernel=True)
    assert m.check.ok and m.us is not None
    assert [k["op"] for k in m.kernels] == [op.op for op in g.ops]
    for k in m.kernels:
        assert k["us"] > 0 and k["flops"] > 0 and k["dram_bytes"] > 0
        assert k["tflop_s"] == pytest.approx(k["flops"] / k["us"] / 1e6)
        assert k["gb_s"] == pytest.approx(k["dram_bytes"] / k["us"] / 1e3)


def test_precompiled_cubins_are_loaded_without_compiling_again(monkeypatch) -> None:
    """``run_bench(workers=N)`` compiles every program and variant ahead on N processes;
    the measurements then load those cubins (compiled from the same source text)."""
    pytest.importorskip("cuda.bindings")
    from mirage_cli.codegen import bench

    g = parse_text(SMALL, "<t>", {})
    h = parse_text(SMALL.replace("n = 32", "n = 64"), "<t>", {})
    bench._CUBINS.clear()
    bench.precompile([g, h, g], "sm_90", 2)
    assert list(bench._CUBINS) == [(g, "sm_90"), (h, "sm_90")]

    def no_compile(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("compiled again")

    loaded: list[bytes] = []

    class Dev:
        arch = "sm_90"

        def load(self, prog, cubin):  # type: ignore[no-untyped-def]
            loaded.append(cubin)

    monkeypatch.setattr(bench, "compile_cuda", no_compile)
    bench.build(Dev(), g)  # type: ignore[arg-type]
    assert loaded == [bench._CUBINS[(g, "sm_90")]]
    bench._CUBINS.clear()


def test_references_computed_ahead_are_the_ones_computed_here(monkeypatch):
    """`References` on spawned workers gives each program the input scale and float64
    reference that computing them in this process gives (only where they are computed
    changes), and a program it did not take ahead is computed here."""
    from mirage_cli.codegen import bench

    progs = [parse_text(SMALL.replace("n = 32", f"n = {n}"), "<t>", {}) for n in (32, 64)]
    here = [bench.input_scale(g) for g in progs]
    expect = [bench.interp.run(g, bench.scaled_inputs(g, 0, s), "float64")
              for g, s in zip(progs, here)]
    bench._REFERENCES.clear()
    monkeypatch.setattr(bench, "AHEAD_BYTES", 0)
    refs = bench.References(progs, workers=2)
    try:
        assert len(refs._futures) == 2  # both went to the workers
        for g, s, outs in zip(progs, here, expect):
            assert refs.scale(g) == s
            assert (g, 0, s) in bench._REFERENCES  # the worker's, not recomputed here
            got = bench.reference_outputs(g, 0, s)
            assert got.keys() == outs.keys()
            assert all(np.array_equal(got[k], outs[k]) for k in outs)
        extra = parse_text(SMALL.replace("n = 32", "n = 96"), "<t>", {})
        assert refs.scale(extra) == bench.input_scale(extra)
    finally:
        refs.close()
