"""Measured selection on CPU: the GPU seam (`measure.Timer`) is a fake that checks each
variant with the reference interpreter instead of a kernel and returns deterministic
times, so selection, the cache, the metadata and wrong-result rejection are tested
without a device. The real timer is exercised by tests/test_measure_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from plan_programs import MQA_SPLIT_B16

from mirage_cli import interp, serialize
from mirage_cli.cli import main
from mirage_cli.codegen import bench
from mirage_cli.ir import Graph
from mirage_cli.kplan import Knobs
from mirage_cli.loading import load_graph
from mirage_cli.search import measure
from mirage_cli.search.design import design_of
from mirage_cli.search.measure import Timing, Variant

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "explain_data"
LORA = {"batch": 1, "hidden": 64, "n": 256}


def cands(name: str = "lora") -> list[Graph]:
    return [g for g, _ in serialize.loads_candidates(
        (DATA / f"{name}.cands.ugraph.json").read_text())]


class FakeTimer:
    """Checks a variant by interpreting it (f32, as a kernel computes) against the
    float64 reference; ``wrong`` variants get their outputs corrupted first; the time
    of a variant is ``times[label]`` or a fixed function of its label."""

    device = "Fake GPU"
    arch = "sm_90"

    def __init__(self, times: dict[str, float] | None = None, wrong: set[str] = frozenset()
                 ) -> None:
        self.times = times or {}
        self.wrong = set(wrong)
        self.calls: list[str] = []

    def time(self, v: Variant, cubin: bytes, reference: Graph) -> Timing:
        self.calls.append(v.label)
        assert isinstance(cubin, bytes)
        outs = interp.run(v.graph, bench.scaled_inputs(v.graph, 0, 1.0), "native")
        if v.label in self.wrong:
            outs = {k: np.asarray(o) + 1.0 for k, o in outs.items()}
        chk = bench.compare(outs, bench.reference_outputs(reference, 0, 1.0),
                            list(v.graph.outputs))
        if not chk.ok:
            return Timing(None, False, chk.rel_err, chk.reason)
        us = self.times.get(v.label, 10.0 + sum(map(ord, v.label)) % 7)
        return Timing(us, True, chk.rel_err)


def no_compile(jobs: list[tuple[Graph, str]], workers: int) -> list[bytes | str]:
    return [b"cubin" for _ in jobs]


def fake_device(monkeypatch: pytest.MonkeyPatch, knobs_per_tuning: int) -> list[FakeTimer]:
    """The GPU seam faked: every timer opened is a :class:`FakeTimer`, kept in the list
    returned; nothing is compiled."""
    timers: list[FakeTimer] = []

    def fake_gpu(ordinal: int) -> FakeTimer:
        timers.append(FakeTimer())
        return timers[-1]

    monkeypatch.setattr(measure, "GpuTimer", fake_gpu)
    monkeypatch.setattr(measure, "compile_all", no_compile)
    monkeypatch.setattr(measure, "KNOBS_PER_TUNING", knobs_per_tuning)
    return timers


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))


def test_variants_are_deterministic_bounded_and_planned() -> None:
    cs = cands()
    a, _ = measure.variants(cs, 2, "sm_90", tunings=3, knobs=3)
    b, _ = measure.variants(cs, 2, "sm_90", tunings=3, knobs=3)
    assert [v.key for v in a] == [v.key for v in b]
    assert 3 < len(a) <= 2 * 3 * 3 and {v.design for v in a} == {0, 1}
    # The model's pick comes first: the first candidate, its own tuning, default knobs.
    assert design_of(a[0].graph)[1] == design_of(cs[0])[1]
    assert all(k.as_json() == {} for k in a[0].knobs)
    assert all(op.plan is not None for v in a for op in v.graph.ops if op.block is not None)
    assert len({v.key for v in a}) == len(a)  # no variant timed twice
    # Knob deviations really change a plan knob of some kernel.
    assert any(k.as_json() for v in a for k in v.knobs)


def test_knob_deviations_come_in_the_measured_order(tmp_path: Path) -> None:
    assert sorted(measure.KNOB_ORDER) == sorted(Knobs.names())
    # mqa_decode's split kernel at batch 16 (two warps per 16-row tile, six stages,
    # bulk copies, 128 threads): each knob's nearest other value in the measured order
    # of the knobs, then the next values round again.
    src = tmp_path / "mqa16.mir"
    src.write_text(MQA_SPLIT_B16)
    g = load_graph(str(src))
    sets = measure.knob_sets(g, "sm_90", 5)
    assert [s[0].as_json() for s in sets] == [
        {}, {"kwarps": 1}, {"stages": 5}, {"tma": 0}, {"threads": 64}]
    second = [s[0].as_json() for s in measure.knob_sets(g, "sm_90", 100)][9:12]
    assert second == [{"kwarps": 4}, {"stages": 4}, {"threads": 256}]
    assert len(measure.knob_sets(g, "sm_90", 100)) == 15  # every deviation, each once
    assert measure.knob_sets(g, "sm_90", 1) == [(Knobs(),)]


def test_selection_ships_the_fastest_and_records_times() -> None:
    cs = cands()
    vs, _ = measure.variants(cs, 2, "sm_90", tunings=2, knobs=2)
    fastest = vs[-1].label
    timer = FakeTimer({fastest: 1.5})
    prog = cs[0]
    res = measure.measure(cs, prog, timer, top=2, tunings=2, knobs=2, compiler=no_compile)
    assert res.variants[res.best].label == fastest
    pairs = res.candidates()
    assert pairs[0][1]["measured_us"] == 1.5 and pairs[0][1]["rank"] == 0
    times = [m["measured_us"] for _, m in pairs]
    assert times == sorted(times)
    assert all(m["measured"]["device"] == "Fake GPU" and m["measured"]["ok"] for _, m in pairs)
    s = res.summary()
    assert s["shipped_us"] == s["fastest_us"] == 1.5 and s["model_pick"] == vs[0].label
    # The file written is a candidates file that explain reads (measured times shown).
    text = serialize.dumps_candidates(pairs)
    assert serialize.loads_candidates(text)[0][1]["measured_us"] == 1.5


def test_wrong_variant_is_dropped_and_reported(capsys: pytest.CaptureFixture[str]) -> None:
    cs = cands()
    vs, _ = measure.variants(cs, 1, "sm_90", tunings=2, knobs=2)
    bad = vs[1].label
    timer = FakeTimer({bad: 0.5}, wrong={bad})   # the "fastest" computes garbage
    res = measure.measure(cs, cs[0], timer, top=1, tunings=2, knobs=2, compiler=no_compile)
    assert res.variants[res.best].label != bad
    assert [res.variants[i].label for i in res.wrong] == [bad]
    err = capsys.readouterr().err
    assert f"variant {bad} computes a wrong result" in err and "bug" in err
    last = res.candidates()[-1][1]
    assert last["measured"]["ok"] is False and last["measured_us"] is None
    assert "relative L2 error" in last["measured"]["reason"]


def test_a_variant_that_does_not_compile_is_not_shipped() -> None:
    cs = cands()

    def broken(jobs: list[tuple[Graph, str]], workers: int) -> list[bytes | str]:
        return ["NVRTC: error"] + [b"x"] * (len(jobs) - 1)

    res = measure.measure(cs, cs[0], FakeTimer(), top=1, tunings=2, knobs=1,
                          compiler=broken)
    assert res.best != 0 and "does not compile" in res.timings[0].reason


def test_rejected_by_reverification_falls_to_the_next() -> None:
    cs = cands()
    vs, _ = measure.variants(cs, 1, "sm_90", tunings=2, knobs=2)
    timer = FakeTimer({vs[0].label: 1.0, vs[1].label: 2.0})
    res = measure.measure(cs, cs[0], timer, top=1, tunings=2, knobs=2, compiler=no_compile,
                          accept=lambda g: g != vs[0].graph)
    assert res.variants[res.best].label == vs[1].label


def test_timings_are_cached_by_device() -> None:
    cs = cands()
    first = FakeTimer()
    r1 = measure.measure(cs, cs[0], first, top=1, tunings=2, knobs=2, compiler=no_compile)
    again = FakeTimer()
    r2 = measure.measure(cs, cs[0], again, top=1, tunings=2, knobs=2, compiler=no_compile)
    assert first.calls and not again.calls and r2.cached == len(r2.variants)
    assert [t.us for t in r2.timings] == [t.us for t in r1.timings] and r2.best == r1.best
    other = FakeTimer()
    other.device = "Other GPU"
    measure.measure(cs, cs[0], other, top=1, tunings=2, knobs=2, compiler=no_compile)
    assert other.calls == first.calls  # another device: timed again
    fresh = FakeTimer()
    measure.measure(cs, cs[0], fresh, top=1, tunings=2, knobs=2, compiler=no_compile,
                    use_cache=False)
    assert fresh.calls == first.calls


def test_a_damaged_cache_entry_is_a_miss(tmp_path: Path) -> None:
    cs = cands()
    measure.measure(cs, cs[0], FakeTimer(), top=1, tunings=1, knobs=1, compiler=no_compile)
    (entry,) = (tmp_path / "cache").glob("*.measure.json")
    doc = json.loads(entry.read_text())
    for t in doc["timings"].values():
        t["us"] = -1.0  # not a time
    entry.write_text(json.dumps(doc))
    again = FakeTimer()
    measure.measure(cs, cs[0], again, top=1, tunings=1, knobs=1, compiler=no_compile)
    assert again.calls


def test_real_compilation_of_variants() -> None:
    """The compile step is NVRTC for real (no GPU needed): every variant compiles."""
    cs = cands()
    vs, _ = measure.variants(cs, 1, "sm_90", tunings=1, knobs=2)
    out = measure.compile_all([(v.graph, "sm_90") for v in vs], 1)
    assert out and all(isinstance(c, bytes) and len(c) > 1000 for c in out), out


def test_opt_gpu_ships_the_measured_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """`mirage opt --gpu 0` with the GPU seam faked: the shipped µGraph is the fastest
    variant, with its plan knobs, and the timed variants are kept with --save-temps."""
    timers: list[FakeTimer] = []

    def fake_gpu(ordinal: int) -> FakeTimer:
        t = FakeTimer()
        t.times = {"d0.t1.k1": 0.25}
        timers.append(t)
        return t

    monkeypatch.setattr(measure, "GpuTimer", fake_gpu)
    monkeypatch.setattr(measure, "compile_all", no_compile)
    monkeypatch.setattr(measure, "TUNINGS_PER_DESIGN", 2)
    monkeypatch.setattr(measure, "KNOBS_PER_TUNING", 2)
    cu = tmp_path / "lora.cu"
    r = CliRunner().invoke(main, ["opt", str(ROOT / "examples" / "lora.mir"), "-o", str(cu),
                                  *[a for k, v in LORA.items() for a in ("-D", f"{k}={v}")],
                                  "--gpu", "0", "--top", "2", "--jobs", "1",
                                  "--save-temps", str(tmp_path / "t")])
    assert r.exit_code == 0, r.output
    assert timers and "d0.t1.k1" in timers[0].calls
    measured = serialize.loads_candidates((tmp_path / "t" / "lora.measured.ugraph.json")
                                          .read_text())
    assert measured[0][1]["measured"]["variant"] == "d0.t1.k1"
    assert measured[0][1]["measured_us"] == 0.25
    best = serialize.loads((tmp_path / "t" / "lora.best.ugraph.json").read_text())
    want = [op.plan.knobs for op in measured[0][0].ops if op.plan is not None]
    assert [op.plan.knobs for op in best.ops if op.plan is not None] == want
    assert design_of(best) == design_of(measured[0][0])
    assert "measure: shipped d0.t1.k1" in r.output


def test_gpu_without_a_device_is_exit_2(tmp_path: Path) -> None:
    from mirage_cli.codegen.runner import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present")
    r = CliRunner().invoke(main, ["opt", str(ROOT / "examples" / "lora.mir"), "-o",
                                  str(tmp_path / "x.cu"), "--gpu", "0"])
    assert r.exit_code == 2 and "--gpu 0" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x.cu").exists()


def test_reference_is_the_program() -> None:
    """`opt --gpu` checks variants against the program's own float64 value."""
    prog = load_graph(str(ROOT / "examples" / "lora.mir"), LORA)
    cs = cands()
    res = measure.measure(cs, prog, FakeTimer(), top=1, tunings=1, knobs=2,
                          compiler=no_compile)
    assert all(t.ok for t in res.timings)


def test_tune_gpu_writes_every_variant_fastest_first(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure, "GpuTimer", lambda ordinal: FakeTimer({"d1.t0.k0": 0.5}))
    monkeypatch.setattr(measure, "compile_all", no_compile)
    out = tmp_path / "best.ugraph.json"
    r = CliRunner().invoke(main, ["tune", str(DATA / "lora.cands.ugraph.json"), "--gpu", "0",
                                  "--top", "2", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("#0: d1.t0.k0 0.500 us measured")
    pairs = serialize.loads_candidates(out.read_text())
    assert pairs[0][1]["measured"]["variant"] == "d1.t0.k0" and len(pairs) > 4


def test_tune_gpu_measures_within_the_pins(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # --pin with --gpu times only tunings within the pins, the pinned knobs held in
    # every variant (it used to time the file's own tunings and drop the pins).
    timers = fake_device(monkeypatch, 4)
    first = cands()[0]
    assert design_of(first)[1][0][0] == (32, 1, 1)  # lora's own grid: 16 is another
    f, out = tmp_path / "first.ugraph.json", tmp_path / "m.ugraph.json"
    f.write_text(serialize.dumps_candidates([(first, {})]))
    r = CliRunner().invoke(main, ["tune", str(f), "--gpu", "0", "--top", "1", "-o", str(out),
                                  "--pin", "k0.grid=16x1x1,k0.pad=0"])
    assert r.exit_code == 0, r.output
    pairs = serialize.loads_candidates(out.read_text())
    assert len(pairs) == len(timers[0].calls) >= 2  # the pinned knob and free ones
    for g, _ in pairs:
        (kernel,) = [op for op in g.ops if op.block is not None][:1]
        assert kernel.block.grid == (16, 1, 1) and kernel.plan.knobs.pad == 0
