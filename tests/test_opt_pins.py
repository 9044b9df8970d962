"""`mirage opt --pin/--widen`: the tuning of the searched designs restricted or extended
as `mirage tune` does it, the tuning shipped checked against the program, and every
misuse a clear exit 2. The GPU path uses test_measure's fake device."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from test_measure import fake_device

from mirage_cli import serialize
from mirage_cli.cli import main
from mirage_cli.search import measure
from mirage_cli.search.design import design_of

ROOT = Path(__file__).resolve().parent.parent
LORA = ["-D", "batch=1"]  # at these sizes its designs loop (forloop 4 of up to 256)


@pytest.fixture(scope="module")
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def _cache(_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One search cache for the module: the program is searched once, every test tunes
    # what it found (the timing cache of --gpu lives there too; the fake device's
    # name keeps it apart from a real one's).
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(_cache_dir))


def _opt(tmp_path: Path, name: str, *extra: str) -> tuple[int, str, Path]:
    temps = tmp_path / name
    r = CliRunner().invoke(main, ["opt", str(ROOT / "examples" / "lora.mir"), *LORA, "-o",
                                  str(tmp_path / f"{name}.cu"), "--jobs", "1",
                                  "--save-temps", str(temps), *extra])
    return r.exit_code, r.output, temps


def _loop(temps: Path) -> tuple[tuple[int, int, int], int]:
    best = serialize.loads((temps / "lora.best.ugraph.json").read_text())
    return design_of(best)[1][0]


def test_a_pinned_forloop_and_knob_are_what_ships(tmp_path: Path) -> None:
    code, out, free = _opt(tmp_path, "free")
    assert code == 0, out
    grid, f = _loop(free)
    other = 2 if f != 2 else 4  # a legal forloop the unpinned search did not ship
    code, out, pinned = _opt(tmp_path, "pinned", "--pin", f"forloop={other},stages=1")
    assert code == 0, out
    assert _loop(pinned) == (grid, other)
    best = serialize.loads((pinned / "lora.best.ugraph.json").read_text())
    (plan,) = [op.plan for op in best.ops if op.block is not None]
    assert plan is not None and plan.knobs.stages == 1
    ranked = serialize.loads_candidates((pinned / "lora.pinned.ugraph.json").read_text())
    assert ranked and all(design_of(g)[1][0][1] in (other, 1) for g, _ in ranked)


def test_widened_values_are_ranked_with_the_design_own(tmp_path: Path) -> None:
    code, out, temps = _opt(tmp_path, "wide", "--widen", "forloop=2,16")
    assert code == 0, out
    loops = {design_of(g)[1][0][1] for g, _ in serialize.loads_candidates(
        (temps / "lora.pinned.ugraph.json").read_text())}
    assert {2, 16} <= loops


def test_a_tuning_the_finite_field_check_refuses_is_not_shipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure, "reverified", lambda program, seed=0: lambda g: False)
    code, out, _ = _opt(tmp_path, "refused", "--pin", "forloop=2")
    assert code == 2 and "finite-field check" in out and "Traceback" not in out
    assert not (tmp_path / "refused.cu").exists()


@pytest.mark.parametrize("args, says", [
    (["--pin", "forloop=3"], "no tuning within the pins is legal"),
    (["--pin", "bogus=1"], "--pin bogus: not a knob"),
    (["--widen", "stages=2,3"], "only grid and forloop are widened"),
    (["--pin", "k5.stages=1"], "custom kernels 0 to"),
])
def test_a_pin_that_cannot_hold_is_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    code, out, _ = _opt(tmp_path, "bad", *args)
    assert code == 2 and says in out and "Traceback" not in out, out
    assert not (tmp_path / "bad.cu").exists()


def test_pins_and_a_plan_file_are_exit_2(tmp_path: Path) -> None:
    plan = tmp_path / "pins.json"
    plan.write_text('[{"stages": 1}]')
    code, out, _ = _opt(tmp_path, "both", "--pin", "stages=1", "--plan", str(plan))
    assert code == 2 and "--plan and --pin" in out


def test_gpu_measures_only_tunings_within_the_pins(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    timers = fake_device(monkeypatch, 2)
    code, out, temps = _opt(tmp_path, "gpu", "--gpu", "0", "--top", "2",
                            "--pin", "forloop=2,pad=0")
    assert code == 0, out
    assert timers and timers[0].calls
    timed = serialize.loads_candidates((temps / "lora.pinned.ugraph.json").read_text())
    assert len(timed) == len(timers[0].calls)
    for g, _ in timed:
        kernel = next(op for op in g.ops if op.block is not None)
        assert kernel.plan is not None and kernel.plan.knobs.pad == 0
        assert design_of(g)[1][0][1] in (2, 1)


def test_a_forloop_pin_leaves_out_a_design_that_does_not_loop() -> None:
    """gqa's first design has no forloop: pinning one cannot hold there (it used to be
    instantiated with the pinned count, its accumulators run over the same tile again),
    so that design is left out and the looped one's tunings remain."""
    from mirage_cli.commands.tune import retune, within_pins
    from mirage_cli.diagnostics import MirageError
    from mirage_cli.search.design import custom_steps

    cands = [g for g, _ in serialize.loads_candidates(
        (ROOT / "tests" / "explain_data" / "gqa_forloop.cands.ugraph.json").read_text())]
    designs = list(dict.fromkeys(design_of(g)[0] for g in cands))
    firsts = [next(g for g in cands if design_of(g)[0] == d) for d in designs]
    flat = [g for g in firsts if not custom_steps(design_of(g)[0])[0].looped]
    assert flat, "the file's first design does not loop"
    with pytest.raises(MirageError, match="no tuning within the pins"):
        retune(flat[0], {"forloop": ["2"]}, {})
    _, ranked = within_pins(firsts, "forloop=2", (), "sm_90")
    assert ranked and all(custom_steps(design_of(g)[0])[0].looped and t[0][1] == 2
                          for g, t in ranked)


def test_tune_writes_from_the_first_tuning_a_trial_accepts(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`tune -o` starts its output at the first tuning that a finite-field trial finds
    equivalent to the file's first candidate (what `mirage codegen` would compile)."""
    tried: list[str] = []

    def one_refused(reference: object, seed: int = 0):  # type: ignore[no-untyped-def]
        def accept(g: object) -> bool:
            tried.append(serialize.dumps(g))  # type: ignore[arg-type]
            return len(tried) > 1
        return accept

    monkeypatch.setattr(measure, "reverified", one_refused)
    out = tmp_path / "t.ugraph.json"
    r = CliRunner().invoke(main, ["tune", str(ROOT / "tests" / "explain_data" /
                                              "gqa_forloop.cands.ugraph.json"),
                                  "--widen", "forloop=4,64", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "left out" in r.output
    pairs = serialize.loads_candidates(out.read_text())
    assert len(tried) == 2 and pairs[0][1]["verified"] is True
    assert not any(m["verified"] for _, m in pairs[1:])
    # The first written is the second tried (its plan knobs attached: compare designs).
    first_tried = serialize.loads(tried[1])
    assert design_of(pairs[0][0]) == design_of(first_tried)


def test_a_knob_pin_skips_the_tunings_where_it_is_illegal_and_is_priced(
        tmp_path: Path) -> None:
    """ksplit=3 divides a forloop of 24, not the widened 32: only the first is within
    the pins, and it is ranked with its pinned plan (120 blocks, not 80)."""
    from plan_programs import RMSNORM_LINEAR_24

    from mirage_cli.loading import load_graph

    src = tmp_path / "rl24.mir"
    src.write_text(RMSNORM_LINEAR_24)
    cands = tmp_path / "rl24.cands.ugraph.json"
    cands.write_text(serialize.dumps_candidates([(load_graph(str(src)), {})]))

    def tuned(*args: str) -> list[tuple[object, dict]]:  # type: ignore[type-arg]
        out = tmp_path / "t.ugraph.json"
        r = CliRunner().invoke(main, ["tune", str(cands), *args, "-o", str(out)])
        assert r.exit_code == 0, r.output
        return serialize.loads_candidates(out.read_text())  # type: ignore[return-value]

    three = tuned("--pin", "ksplit=3", "--widen", "forloop=32")
    assert [design_of(g)[1][0][1] for g, _ in three] == [24]  # type: ignore[arg-type]
    (g, meta), = three
    (plan,) = [op.plan for op in g.ops if op.block is not None]  # type: ignore[attr-defined]
    assert plan is not None and plan.knobs.ksplit == 3
    two = tuned("--pin", "ksplit=2")
    assert meta["cost"]["min_blocks"] == 120 and two[0][1]["cost"]["min_blocks"] == 80
    assert meta["cost"]["time_us"] != two[0][1]["cost"]["time_us"]
    r = CliRunner().invoke(main, ["tune", str(cands), "--pin", "ksplit=5"])
    assert r.exit_code == 2 and "ksplit=5 is not legal" in r.output
