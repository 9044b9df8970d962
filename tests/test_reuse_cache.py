"""Automatic shape reuse through the cache: `mirage opt -D batch=2` after a search of the
same program at batch 1 re-instantiates the cached designs beside those enumerated
at the new sizes and verifies the best; a changed program or changed options search again."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from seeded_cache import start_from

from mirage_cli import serialize
from mirage_cli.cli import main
from mirage_cli.loading import load_graph
from mirage_cli.search.driver import SearchOptions, search

ROOT = Path(__file__).resolve().parent.parent
LORA = ROOT / "examples" / "lora.mir"
SIZES = ["-D", "hidden=64", "-D", "n=256"]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))


def opt(tmp_path: Path, prog: Path, batch: int, *extra: str) -> tuple[str, list]:  # type: ignore[type-arg]
    temps = tmp_path / f"t{batch}{len(extra)}"
    r = CliRunner().invoke(main, ["opt", str(prog), "-o", str(tmp_path / "o.cu"), *SIZES,
                                  "-D", f"batch={batch}", "--jobs", "1", "--save-temps",
                                  str(temps), *extra])
    assert r.exit_code == 0, r.output
    cands = serialize.loads_candidates(next(temps.glob("*.cands.ugraph.json")).read_text())
    return r.output, cands


def seed(tmp_path: Path) -> None:
    """The cache ``opt(tmp_path, LORA, 1)`` leaves in an empty one, for a test that does
    not read that run's output (:mod:`seeded_cache`)."""
    start_from(("test_reuse_cache", "lora", 1), tmp_path / "cache",
               lambda: opt(tmp_path, LORA, 1))


def test_new_sizes_reuse_the_cached_designs(tmp_path: Path) -> None:
    out1, first = opt(tmp_path, LORA, 1)
    assert "reused" not in out1 and all("reused_from" not in m for _, m in first)
    out2, cands = opt(tmp_path, LORA, 2)
    assert "search: reused the" in out2 and "batch=1" in out2
    assert cands and all(m["reused_from"] == "cache (batch=1, hidden=64, n=256, rank=16)"
                         for _, m in cands)
    assert all(m["verification"]["equivalent"] for _, m in cands)
    prog = load_graph(str(LORA), {"batch": 2, "hidden": 64, "n": 256})
    assert cands[0][0].tensor_types()["O"] == prog.tensor_types()["O"]
    # A fresh search at the new sizes finds nothing the model prefers.
    fresh = search(prog, SearchOptions())
    assert cands[0][1]["cost"]["time_us"] <= fresh.candidates[0].cost.time_us + 1e-3
    # The same sizes again: the exact cache entry (the reused result), not a reuse.
    out3, again = opt(tmp_path, LORA, 2)
    assert "search: reused" not in out3 and again == cands


def test_a_changed_program_or_options_search_again(tmp_path: Path) -> None:
    seed(tmp_path)
    changed = tmp_path / "lora2.mir"
    changed.write_text(LORA.read_text().replace("O = add(XW, XAB)", "O = add(XAB, XW)"))
    assert changed.read_text() != LORA.read_text()
    out, cands = opt(tmp_path, changed, 2)
    assert "reused" not in out and all("reused_from" not in m for _, m in cands)
    out, _ = opt(tmp_path, LORA, 2, "--max-block-ops", "11")
    assert "reused" not in out



def test_a_reuse_a_search_would_cut_searches_instead(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # When the reused designs' best is predicted slower than the unfused program, a
    # search at these sizes would also cut the program into parts; a pool of whole
    # designs cannot stand for that, so the reuse gives way to the search.
    from mirage_cli.search import driver

    seed(tmp_path)
    calls: list[int] = []

    def slower(program, cands):  # type: ignore[no-untyped-def]
        calls.append(len(cands))
        return not calls[1:]   # true for the reuse's check only

    monkeypatch.setattr(driver, "cuts_too", slower)
    out, cands = opt(tmp_path, LORA, 2)
    assert "predicted slower than the unfused program at these sizes; searching" in out
    assert "search: reused the" not in out
    assert cands and all("reused_from" not in m for _, m in cands)
