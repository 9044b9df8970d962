"""Shape reuse certifies only what ships: `mirage opt -D batch=2` after a search at batch 1
re-verifies the first-ranked reused candidate at the new sizes (and the next ones only
when it fails), a later run that needs more candidates (``--gpu``) reuses again, and
the verifier does not repeat a trial or a float64 draw it already made."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from seeded_cache import start_from

from mirage_cli import interp, serialize
from mirage_cli.cli import main
from mirage_cli.loading import load_graph
from mirage_cli.search.driver import SearchOptions, SearchResult, reuse, search
from mirage_cli.verifier import api
from mirage_cli.verifier.api import Verifier
from mirage_cli.verifier.crosscheck import crosscheck
from mirage_cli.verifier.numerics import safety_check

ROOT = Path(__file__).resolve().parent.parent
LORA = ROOT / "examples" / "lora.mir"
SIZES = {"hidden": 64, "n": 256}


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))


def opt(tmp_path: Path, batch: int) -> tuple[str, list[Any], str]:
    """`mirage opt` of lora at ``batch``: its log, candidates file and .cu text."""
    temps, cu = tmp_path / f"t{batch}", tmp_path / f"o{batch}.cu"
    defs = [a for k, v in {**SIZES, "batch": batch}.items() for a in ("-D", f"{k}={v}")]
    r = CliRunner().invoke(main, ["opt", str(LORA), "-o", str(cu), *defs, "--jobs", "1",
                                  "--save-temps", str(temps)])
    assert r.exit_code == 0, r.output
    cands = serialize.loads_candidates(next(temps.glob("*.cands.ugraph.json")).read_text())
    return r.output, cands, cu.read_text()


def seed(tmp_path: Path, batch: int) -> None:
    """The cache ``opt(tmp_path, batch)`` leaves in an empty one, for a test that does
    not read that run's output (:mod:`seeded_cache`)."""
    start_from(("lora", tuple(SIZES.items()), batch), tmp_path / "cache",
               lambda: opt(tmp_path, batch))


def program(batch: int) -> Any:
    return load_graph(str(LORA), {**SIZES, "batch": batch})


@functools.cache  # several tests start from it; none changes it
def searched(batch: int) -> SearchResult:
    """A fresh search's one candidate for lora at ``batch``."""
    return search(program(batch), SearchOptions(top=1))


def test_reuse_certifies_the_shipped_candidate_at_the_new_sizes(tmp_path: Path) -> None:
    _, first, _ = opt(tmp_path, 1)
    assert len(first) == 3  # the search keeps --top 3 for the family
    log, cands, cu = opt(tmp_path, 2)
    assert "search: reused the" in log and "1 verified at these sizes" in log
    assert len(cands) == 1 and cands[0][1]["reused_from"].startswith("cache (batch=1")
    cert = cands[0][1]["verification"]
    assert cert["equivalent"] and cert["certificate"]["bound"] <= 2.0 ** -40
    assert cert["float64"]["verdict"] == "close" and cert["numerics"]["verdict"] == "safe"
    # Independently: the shipped µGraph is equivalent to the program at batch 2.
    independent = Verifier(program(2), seed=7).certify(cands[0][0])
    assert independent.verdict == "equivalent"
    # And it is what a fresh search at batch 2 ships.
    fresh = search(program(2), SearchOptions())
    assert cands[0][0] == fresh.candidates[0].graph
    # The rerun at batch 2 is the exact cache entry: the same single candidate.
    log2, again, cu2 = opt(tmp_path, 2)
    assert "search: reused" not in log2 and again == cands and cu2 == cu


def test_a_run_that_needs_more_candidates_reuses_again(tmp_path: Path) -> None:
    from mirage_cli.search.reuse import reused

    seed(tmp_path, 1)
    opt(tmp_path, 2)  # stores one certified candidate at batch 2
    out = reused(program(2), SearchOptions(), need=3)  # as `opt --gpu` asks
    assert out is not None and len(out.candidates) == 3
    assert all(m["verification"]["equivalent"] for _, m in out.candidates)
    assert reused(program(2), SearchOptions(), need=3) is None  # now the exact entry


def test_reuse_goes_down_the_ranking_when_the_first_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mirage_cli.verifier import crosscheck as cc

    _, first, _ = opt(tmp_path, 1)
    real = cc.crosscheck
    seen: list[Any] = []

    def first_one_far(a: Any, b: Any, seed: int = 0) -> Any:
        res = real(a, b, seed)
        seen.append(b)
        return res if len(seen) > 1 else type(res)(**{**res.__dict__, "close": False})

    monkeypatch.setattr(cc, "crosscheck", first_one_far)
    res = reuse(program(2), [g for g, _ in first], SearchOptions(), need=1)
    assert len(seen) == 2 and seen[0] != seen[1]
    assert res.progress.rejected == 1 and res.progress.verified == 1
    assert len(res.candidates) == 1 and res.candidates[0].graph == seen[1]
    assert res.candidates[0].verdict["float64"]["verdict"] == "close"


def test_certify_after_check_does_not_rerun_a_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    prog = program(2)
    cand = searched(2).candidates[0].graph
    v = Verifier(prog, seed=3)
    runs: list[int] = []
    real = v._run

    def counted(g: Any, t: int) -> Any:
        if g is cand:
            runs.append(t)
        return real(g, t)

    monkeypatch.setattr(v, "_run", counted)
    assert v.check(cand, trials=1).equivalent is True
    cert = v.certify(cand, crosscheck_float64=False)
    assert cert.verdict == "equivalent" and cert.field_verdict.trials >= 2
    assert sorted(runs) == list(range(cert.field_verdict.trials))  # each trial once
    assert api.Verifier(prog, seed=3).certify(cand, crosscheck_float64=False).to_json() \
        == cert.to_json()


def test_crosscheck_and_safety_share_one_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    prog = program(2)
    cand = searched(2).candidates[0].graph
    draws: list[int] = []
    real = interp.random_inputs

    def counted(g: Any, seed: int = 0) -> Any:
        draws.append(seed)
        return real(g, seed)

    monkeypatch.setattr(interp, "random_inputs", counted)
    first = crosscheck(prog, cand, 11)
    assert first.close and safety_check(prog, cand, 11).safe
    assert draws == [11]
    # The shared arrays are read-only, and give the same verdicts as a fresh draw.
    assert all(not x.flags.writeable for x in first.inputs.values())
    assert crosscheck(prog, cand, 12).close and draws == [11, 12]
    again = crosscheck(prog, cand, 11)
    assert draws == [11, 12, 11] and again.max_rel_err == first.max_rel_err


def test_automatic_reuse_ranks_the_designs_found_at_the_new_sizes_too() -> None:
    # Which designs exist depends on the sizes: an automatic reuse enumerates at the new
    # sizes and ranks those beside the known ones (with no known design it still finds
    # every candidate a search finds); the explicit --reuse path enumerates nothing.
    fresh = searched(2)
    res = reuse(program(2), [], SearchOptions(), need=1, enumerate_with=(None, 1))
    assert res.progress.units_total > 0 and res.progress.reused == 0
    assert [c.graph for c in res.candidates] == [c.graph for c in fresh.candidates]
    alone = reuse(program(2), [], SearchOptions(), need=1)
    assert alone.progress.units_total == 0 and alone.candidates == []


def test_the_certify_hook_is_asked_first_in_rank_order(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """The driver's verification loop asks ``certify`` (the carried certificate's way
    in, search/reuse.py) before any finite-field trial: its verdicts are the
    candidates' records, only the one to ship is asked as such, and a hook that
    refuses everything leaves the reuse exactly as without one."""
    from mirage_cli.search.design import design_of
    from mirage_cli.search.driver import reuse_designs
    from mirage_cli.search.verify import Verdict

    designs = [c.design for c in search(program(1), SearchOptions()).candidates]
    trials: list[int] = []
    real = Verifier._run
    monkeypatch.setattr(Verifier, "_run", lambda v, g, t: trials.append(t) or real(v, g, t))
    asked: list[tuple[Any, bool]] = []

    def accept(d: Any, g: Any, first: bool) -> Verdict:
        asked.append((g, first))
        assert design_of(g)[0] == d
        return Verdict(True, "hook", 0, {"certificate": {"by": "hook"}})

    res = reuse_designs(program(2), designs, SearchOptions(), need=3, certify=accept)
    assert trials == []  # nothing verified with trials
    assert [c.graph for c in res.candidates] == [g for g, _ in asked]
    assert [f for _, f in asked] == [True, False, False]
    assert all(c.verdict["method"] == "hook" for c in res.candidates)
    # The one to ship still gets the float64 and numerics checks, run by the driver.
    assert res.candidates[0].verdict["float64"]["verdict"] == "close"
    assert all("float64" not in c.verdict for c in res.candidates[1:])

    refused: list[Any] = []
    full = reuse_designs(program(2), designs, SearchOptions(), need=3,
                         certify=lambda d, g, first: refused.append(g))
    plain = reuse_designs(program(2), designs, SearchOptions(), need=3)
    assert refused == [c.graph for c in full.candidates]
    assert [c.verdict for c in full.candidates] == [c.verdict for c in plain.candidates]
    assert trials and all(c.verdict["certificate"]["finite_field"]["trials"] >= 1
                          for c in full.candidates)

    # Records that come with the verdict of the one to ship are kept, not run again;
    # a verdict that refuses a candidate moves the reuse on down the ranking.
    from mirage_cli.verifier import crosscheck as cc

    monkeypatch.setattr(cc, "crosscheck", lambda *a, **k: pytest.fail("float64 rerun"))
    floats = {"float64": {"verdict": "close", "by": "hook"},
              "numerics": {"verdict": "safe", "by": "hook"}}

    def carried_floats(d: Any, g: Any, first: bool) -> Verdict:
        if g == plain.candidates[0].graph:
            return Verdict(False, "refused", 0, {})
        return Verdict(True, "hook", 0, {"certificate": {}, **(floats if first else {})})

    res = reuse_designs(program(2), designs, SearchOptions(), need=1,
                        certify=carried_floats)
    assert res.progress.rejected == 1 and res.progress.verified == 1
    assert res.candidates[0].graph == plain.candidates[1].graph
    assert res.candidates[0].verdict == {"equivalent": True, "method": "hook", "seed": 0,
                                         "certificate": {}, **floats}


def test_a_candidate_certified_at_a_smaller_batch_carries_to_its_own() -> None:
    """A reused design that the family's search did not certify is certified at the
    smallest batch where the same design and tiles instantiate and the carry
    precondition holds, and carried: that certificate is the
    candidate's, and an independent certification at batch 4 agrees. A wrong
    candidate fails at the small size and is not carried."""
    import dataclasses

    from mirage_cli.search.design import instantiate
    from mirage_cli.search.reuse import _certified_small

    prog = program(4)
    best = searched(4).candidates[0]
    v = _certified_small(prog, "batch", 0, best.design, best.graph, True)
    assert v is not None and v.ok
    small = v.detail["carried"]["from"]
    assert small < 4 and v.detail["carried"]["to"] == 4
    assert v.detail["carried"]["certified_at"]["batch"] == small
    assert v.detail["certificate"]["bound"] <= 2.0 ** -40
    assert v.detail["float64"]["verdict"] == "close"
    assert v.detail["numerics"]["verdict"] == "safe"
    assert Verifier(prog, seed=9).certify(best.graph).verdict == "equivalent"
    # Not the one to ship: no float checks.
    other = _certified_small(prog, "batch", 0, best.design, best.graph, False)
    assert other is not None and "float64" not in other.detail

    def mutant(step: Any) -> Any:  # every add of the design made a sub
        if hasattr(step, "ops"):
            return dataclasses.replace(step, ops=tuple(
                dataclasses.replace(o, op="sub") if o.op == "add" else o for o in step.ops))
        return dataclasses.replace(step, op="sub") if step.op == "add" else step

    wrong = dataclasses.replace(best.design, steps=tuple(mutant(s) for s in best.design.steps))
    assert wrong != best.design
    g = instantiate(prog, wrong, best.tuning)
    assert g is not None
    assert _certified_small(prog, "batch", 0, wrong, g, True) is None


def test_a_candidate_of_another_signature_is_left_to_the_driver(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool design can instantiate at the new sizes with an output of another shape
    (rmsnorm_linear at batch 16 ranked one whose Z was 8192 wide); the verifier raises
    on it, and the small certificate declines (the driver then rejects the candidate)
    instead of letting the error end the run."""
    from mirage_cli.diagnostics import MirageError
    from mirage_cli.search import verify as verify_mod
    from mirage_cli.search.reuse import _certified_small

    prog = program(4)
    best = searched(4).candidates[0]

    def other_signature(*args: Any) -> Any:
        raise MirageError("output #0 differs")

    monkeypatch.setattr(verify_mod, "verify", other_signature)
    assert _certified_small(prog, "batch", 0, best.design, best.graph, True) is None


def test_the_search_keeps_verifiers_of_its_last_references_only() -> None:
    """Each verifier holds its reference's random inputs (gigabytes for a layer's
    parts): the search keeps those of the most recent references, not all of them."""
    from mirage_cli.parser import parse_text
    from mirage_cli.search import verify

    graphs = [parse_text(f"""
program p{i}(n = {8 * (i + 1)}) {{
  input X: f16[4, n];
  Y = mul_scalar(X, scalar=2.0);
  output Y;
}}
""", f"p{i}.mir") for i in range(verify.MAX_VERIFIERS + 2)]
    verify._VERIFIERS.clear()
    made = [verify._verifier(g, 0) for g in graphs]
    assert len(verify._VERIFIERS) == verify.MAX_VERIFIERS
    assert verify._verifier(graphs[-1], 0) is made[-1]  # a recent one is reused
    assert verify._verifier(graphs[0], 0) is not made[0]  # an old one was dropped
    verify._VERIFIERS.clear()
