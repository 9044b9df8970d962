"""Calibration on CPU: the fit recovers known coefficients from a synthetic measured
table, `mirage calibrate --fit` writes a profile `--target` accepts, tools/model_fit.py
reports rank correlation and picks, and the calibration kernels compile (NVRTC)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mirage_cli import profiles, serialize
from mirage_cli.cli import main
from mirage_cli.loading import load_graph
from mirage_cli.profiles import calibrate as cal
from mirage_cli.search import cost, measure

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "explain_data"
SIZES = {"lora": {"batch": 1, "hidden": 64, "n": 256},
         "gqa": {"batch": 1, "rows": 16, "d": 16, "seq": 64},
         "rmsnorm_linear": {"batch": 1, "hidden": 64, "n": 64}}
TRUE_FIT = {"stream": 2.5, "sync": 0.0, "launch": 1.6, "const_us": 3.0}


@pytest.fixture(autouse=True)
def _default_profile():  # type: ignore[no-untyped-def]
    yield
    cost.use_profile(profiles.DEFAULT_TARGET)


def synthetic(tmp_path: Path, noise: float = 0.0) -> Path:
    """A selection table whose times follow the h200 model with TRUE_FIT (times
    multiplied by a deterministic noise factor in [1 - noise, 1 + noise]). The unfused
    programs are among the variants, so kernel counts vary (launch vs constant)."""
    base = profiles.load("h200")
    truth = dataclasses.replace(base, fit=TRUE_FIT)
    rng = np.random.default_rng(0)
    rows = []
    for name in ("lora", "gqa", "rmsnorm_linear"):
        gs = [g for g, _ in serialize.loads_candidates(
            (DATA / f"{name}.cands.ugraph.json").read_text())]
        vs, _ = measure.variants(gs, 3, "sm_90", tunings=3, knobs=2)
        prog = load_graph(str(ROOT / "examples" / f"{name}.mir"), SIZES[name])
        vs.append(dataclasses.replace(vs[0], label="unfused", graph=prog))
        samples = [cal.Sample(name, v.graph, 1.0) for v in vs]
        times = cal.predict(samples, truth)
        rows.append({"program": name, "batch": 1, "variants": [
            {"label": v.label, "graph": serialize.graph_to_json(v.graph), "ok": True,
             "measured_us": t * (1 + noise * rng.uniform(-1, 1)), "predicted_us": 0.0}
            for v, t in zip(vs, times)] + [
            {"label": "wrong", "graph": serialize.graph_to_json(vs[0].graph), "ok": False,
             "measured_us": None, "predicted_us": 0.0}]})
    f = tmp_path / "measured.json"
    f.write_text(json.dumps({"format": "mirage-cli/selection-table", "version": 1,
                             "device": "synthetic", "rows": rows}))
    return f


def test_fit_recovers_known_coefficients(tmp_path: Path) -> None:
    samples = cal.load_samples(json.loads(synthetic(tmp_path).read_text()), "m.json")
    assert len(samples) >= 12 and all(s.group != "wrong" for s in samples)
    fitted = cal.fit(samples, profiles.load("h200"))
    for k, v in TRUE_FIT.items():
        assert fitted.fit[k] == pytest.approx(v, rel=1e-6, abs=1e-6), (k, fitted.fit)
    pred = cal.predict(samples, fitted)
    assert cal.spearman(pred, [s.measured_us for s in samples]) == pytest.approx(1.0)


def test_fit_is_non_negative_under_noise(tmp_path: Path) -> None:
    samples = cal.load_samples(json.loads(synthetic(tmp_path, 0.2).read_text()), "m.json")
    fitted = cal.fit(samples, profiles.load("h200"))
    assert all(v >= 0 for v in fitted.fit.values()) and fitted.calibrated


def test_spearman_and_pick_ratio() -> None:
    assert cal.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert cal.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert cal.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.8660254)  # tied ranks
    assert cal.pick_ratio([3.0, 1.0, 2.0], [10.0, 12.0, 8.0]) == pytest.approx(1.5)


def test_calibrate_fit_writes_a_usable_profile(tmp_path: Path) -> None:
    f = synthetic(tmp_path)
    out = tmp_path / "device.json"
    r = CliRunner().invoke(main, ["calibrate", "--fit", str(f), "--target", "sm_90/h200",
                                  "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "Spearman 1.000" in r.output
    n = len(cal.load_samples(json.loads(f.read_text()), "m"))
    assert f"fit over {n} timed variants" in r.output
    r2 = CliRunner().invoke(main, ["calibrate", "--fit", str(f), "--fit", str(f), "-o",
                                   str(tmp_path / "twice.json")])
    assert r2.exit_code == 0 and f"fit over {2 * n} timed variants" in r2.output
    prof = profiles.load(str(out))
    assert prof.calibrated and prof.fit["stream"] == pytest.approx(2.5)
    r = CliRunner().invoke(main, ["explain", str(DATA / "lora.cands.ugraph.json"),
                                  "--target", str(out), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["model"]["fit"]["stream"] == \
        pytest.approx(2.5)


def test_calibrate_needs_something_to_do_and_checks_its_input(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["calibrate", "-o", str(tmp_path / "d.json")])
    assert r.exit_code == 2 and "give --gpu N" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    r = CliRunner().invoke(main, ["calibrate", "--fit", str(bad), "-o", str(tmp_path / "d")])
    assert r.exit_code == 2 and "not a measured selection table" in r.output
    assert not (tmp_path / "d").exists()


def test_model_fit_tool_reports_both_models(tmp_path: Path) -> None:
    f = synthetic(tmp_path)
    out = tmp_path / "r.json"
    png = tmp_path / "s.png"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "model_fit.py"), str(f),
                        "--json", str(out), "--png", str(png)], check=False, capture_output=True,
                       text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert set(doc) == {"uncalibrated (h200)", "fitted, in sample",
                        "fitted, leave one program out"}
    fitted = doc["fitted, in sample"]
    assert fitted["samples"] >= 12 and fitted["examples"] == 3
    assert fitted["spearman"] == pytest.approx(1.0) and fitted["picks_within_15pct"] == 3
    loo = doc["fitted, leave one program out"]
    assert loo["samples"] == fitted["samples"] and loo["per_example"].keys() == \
        fitted["per_example"].keys()
    assert "Spearman" in p.stdout and "pick within 15%" in p.stdout
    try:
        import matplotlib  # noqa: F401
        assert png.read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert "no scatter plot" in p.stderr


def test_calibration_kernels_compile() -> None:
    cubin = cal.compile_kernels("sm_90")
    assert len(cubin) > 1000


def test_measured_figures_make_a_loadable_profile(tmp_path: Path) -> None:
    m = {"device": "NVIDIA H200", "arch": "sm_90", "num_sms": 132, "dram_bw": 4.1e12,
         "l2_bw": 11e12, "l2_bytes": 60 << 20, "launch_us": 1.9, "fma_flops": 60e12,
         "peak_flops": 650e12, "barrier_us": 0.02, "smem_per_block": 232448,
         "smem_per_sm": 233472, "regs_per_sm": 65536, "max_threads_per_sm": 2048,
         "copy": {"copy_kernel_bytes_per_s": 4.1e12}}
    p = cal.profile_from_measurements(profiles.load("h200"), m)
    f = tmp_path / "d.json"
    f.write_text(json.dumps(p.as_json()))
    q = profiles.load(str(f))
    assert q == p and q.calibrated and q.iter_us == 0.02 and q.dram_bw == 4.1e12
    assert q.fit == {"stream": 1.0, "sync": 1.0, "launch": 1.0, "const_us": 0.0,
                     "cluster_us": 0.0}


def test_model_fit_tool_varies_profile_figures(tmp_path: Path) -> None:
    """--vary evaluates the profile at every combination of the figures' values, one
    line each; an unknown figure is refused."""
    f = synthetic(tmp_path)
    run = [sys.executable, str(ROOT / "tools" / "model_fit.py"), str(f)]
    env = {"PYTHONPATH": str(ROOT), "PATH": ""}
    p = subprocess.run(run + ["--vary", "bulk_l2_bw=3e12,4.2e12", "--vary",
                              "bulk_mem_util_exp=0,0.25"], check=False, capture_output=True,
                       text=True, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 4 and all("picks within 15%" in ln for ln in lines)
    assert {ln.split(":")[0] for ln in lines} == {
        f"bulk_l2_bw={a}, bulk_mem_util_exp={b}" for a in ("3e+12", "4.2e+12") for b in ("0", "0.25")}
    p = subprocess.run(run + ["--vary", "warp_speed=1,2"], check=False, capture_output=True,
                       text=True, cwd=ROOT, env=env)
    assert p.returncode != 0 and "expected FIGURE=V1,V2" in p.stderr


def test_a_cluster_split_pays_the_fitted_cluster_term() -> None:
    # lora_fused's kernel at batch 64 split over clusters of 2 (test_plan's cluster
    # forms): the fitted cluster_us is added once to that kernel, nothing to the same
    # kernel whole, and a profile without the term (the shipped ones) prices both as
    # before it existed.
    from mirage_cli.commands.plan import planned
    from mirage_cli.kplan import Knobs

    g = load_graph(str(ROOT / "examples/mugraphs/lora_fused.mir"), {"batch": 64})
    split = planned(g, "sm_90", [Knobs(ksplit=2, stages=1)] * len(g.ops))
    whole = planned(g, "sm_90", [Knobs(ksplit=1, stages=1)] * len(g.ops))
    base = profiles.load("h200")
    assert "cluster_us" not in base.fit
    fitted = dataclasses.replace(base, fit={**base.fit, "cluster_us": 1.5})
    for graph, extra in ((split, 1.5), (whole, 0.0)):
        before, after = cost.kernel_costs(graph, base), cost.kernel_costs(graph, fitted)
        assert [k.cluster_us for k in before] == [0.0] * len(before)
        assert sum(k.cluster_us for k in after) == pytest.approx(extra)
        assert sum(a.time_us - b.time_us for a, b in zip(after, before)) == \
            pytest.approx(extra)


def test_the_fit_keeps_the_coefficients_that_rank_better(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    # Where the least-squares stage gives coefficients that rank the variants badly
    # (here, forced: the constant alone, which ties every variant of a program), the
    # ratio stage replaces them with coefficients that rank as the times were measured.
    samples = cal.load_samples(json.loads(synthetic(tmp_path).read_text()), "m.json")
    base = profiles.load("h200")
    canonical = [serialize.dumps(s.graph) for s in samples]
    const_only = np.zeros(len(profiles.FIT_TERMS))
    const_only[profiles.FIT_TERMS.index("const_us")] = 5.0
    costs = cal.estimates(samples, base)
    forced = cal.ranking_score(samples, costs, canonical,
                               list(cal.terms(samples, base) @ const_only))
    monkeypatch.setattr(cal, "_least_squares", lambda x, y: const_only)
    fitted = cal.fit(samples, base)
    score = cal.ranking_score(samples, costs, canonical, cal.predict(samples, fitted))
    assert score > forced and score[0] == 3 and score[1] > 0.95
    assert fitted.fit["stream"] > 0 and fitted.calibrated


def test_ranking_score_counts_picks_by_the_tie_rule() -> None:
    # Two variants predicted within 1% tie; the tie rule then prefers fewer kernels,
    # whatever the raw predictions say.
    one, two = (cost.Cost(0, 0, 0, n, 0, 1, True, t) for n, t in ((1, 10.05), (2, 10.0)))
    g = load_graph(str(ROOT / "examples" / "lora.mir"), SIZES["lora"])
    samples = [cal.Sample("p@1", g, 3.0), cal.Sample("p@1", g, 4.0)]
    assert cal.model_pick([one, two], ["a", "b"]) == 0
    good, rho = cal.ranking_score(samples, [one, two], ["a", "b"], [10.05, 10.0])
    assert good == 1 and rho == pytest.approx(-1.0)  # picked: 3.0 µs, the best
    far = cost.Cost(0, 0, 0, 2, 0, 1, True, 5.0)
    assert cal.model_pick([one, far], ["a", "b"]) == 1
    assert cal.pick_ratio([10.05, 5.0], [3.0, 4.0], 1) == pytest.approx(4 / 3)
