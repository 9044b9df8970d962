"""A short, fixed-seed fuzzing run in the default suite (tests/fuzzing.py): mutants
of `.mir`, `.ugraph.json` and Mirage checkpoints through parse, fmt, run, verify,
codegen and import-mirage, each checked for exit codes, tracebacks, partial outputs
and time. The long campaign is tests/fuzz_campaign.py (docs/reliability.md)."""

from __future__ import annotations

import random
import sys
import tempfile
from functools import cache
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fuzzing


@cache
def seeds() -> dict[str, list[str]]:
    mirs = fuzzing.mir_seeds()
    return {"mir": mirs, "json": fuzzing.json_seeds(mirs),
            "checkpoint": fuzzing.checkpoint_seeds()}


@settings(max_examples=45, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["mir", "json", "checkpoint"]), st.randoms(use_true_random=False),
       st.integers(0, 2))
def test_mutants_keep_the_promises(kind: str, rnd: random.Random, turn: int) -> None:
    base = rnd.choice(seeds()[kind])
    text = fuzzing.mutate_mir(base, rnd) if kind == "mir" else fuzzing.mutate_json(base, rnd)
    with tempfile.TemporaryDirectory(prefix="mirage-fuzz-") as tmp:
        for r in fuzzing.run_mutant(kind, text, base, Path(tmp), turn):
            assert not r.problems, (r.command, r.problems, text[:2000])


def test_the_harness_sees_a_broken_promise(tmp_path: Path, monkeypatch) -> None:
    """The checks are live: an internal error, a stray temporary file and a missing
    output are each reported; a usage error is a clean exit 2."""
    bad = fuzzing.check_run("parse", ["parse", "--index", "x", "nofile"], [], tmp_path)
    assert bad.code == 2 and not bad.problems

    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("mirage_cli.commands.parse.load_graph", crash)
    r = fuzzing.check_run("parse", ["parse", "x.mir"], [], tmp_path)
    assert r.code == 3 and any(p.startswith("exit 3") for p in r.problems)
    monkeypatch.undo()
    (tmp_path / ".o.ugraph.json.123.tmp").write_text("half")
    src = tmp_path / "p.mir"
    src.write_text("program p() {\n  input X: f16[4];\n  output X;\n}\n")
    r = fuzzing.check_run("parse", ["parse", str(src), "-o", str(tmp_path / "o.ugraph.json")],
                          [tmp_path / "o.ugraph.json"], tmp_path)
    assert r.code == 0 and any("temporary files left" in p for p in r.problems)
    r = fuzzing.check_run("parse", ["parse", str(src)], [tmp_path / "never.ugraph.json"],
                          tmp_path)
    assert any("missing" in p for p in r.problems)
