"""A shape reuse at larger sizes tunes the family's designs in the order of their
predicted time there, and stops where no other design can rank above the ones it needs
(``driver._walked``): lora 8 -> 16 tunes a few of its 50 designs and ships what a fresh
search ships."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from test_reuse_verify import _cache, opt, seed  # noqa: F401 (_cache: its cache directory)
from test_reuse_verify import program as lora

from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph
from mirage_cli.search import driver
from mirage_cli.search.design import design_of
from mirage_cli.search.driver import SearchOptions, SearchResult, reuse_designs, search
from mirage_cli.search.reuse import _bounds

LORA = Path(__file__).resolve().parent.parent / "examples" / "lora.mir"
SMALL = {"hidden": 64, "n": 256}


@functools.cache
def at_8() -> SearchResult:
    return search(lora(8), SearchOptions())


def test_the_family_records_where_its_designs_ranked(tmp_path: Path) -> None:
    seed(tmp_path, 8)
    (f,) = (tmp_path / "cache").glob("*.family.json")
    fam = json.loads(f.read_text())
    res = at_8()
    assert res.pool is not None and res.tuned_us is not None
    assert len(fam["tuned_us"]) == len(fam["designs"]) == len(res.pool)
    timed = [us for us in fam["tuned_us"] if us is not None]
    assert len(timed) == len(res.tuned_us) == res.progress.tuned == 24  # tune_designs
    assert min(timed) == res.candidates[0].cost.time_us  # nothing rejected here
    assert fam["rejected"] == []


def test_a_reuse_at_larger_sizes_tunes_only_the_designs_that_can_win(tmp_path: Path
                                                                    ) -> None:
    seed(tmp_path, 8)
    log, cands, _ = opt(tmp_path, 16)
    assert "the same dimensions split: nothing enumerated" in log
    # 7 of the 24 the search at batch 8 tuned (the whole pool ranked: all 24 again).
    assert "; 7 tuned fully, 1 verified at these sizes" in log
    fresh = search(lora(16), SearchOptions(top=1))
    assert cands[0][0] == fresh.candidates[0].graph
    pool = at_8().pool
    assert pool is not None
    every = reuse_designs(lora(16), pool, SearchOptions(), need=1)
    assert every.progress.tuned == 24 and every.candidates[0].graph == cands[0][0]


def test_the_walk_stops_where_the_next_design_cannot_rank_above() -> None:
    res = at_8()
    assert res.pool is not None and res.tuned_us is not None
    walk = reuse_designs(lora(16), res.pool, SearchOptions(), need=1, bounds=res.tuned_us)
    n = walk.progress.tuned
    order = sorted(res.tuned_us, key=res.tuned_us.__getitem__)
    best = walk.candidates[0].cost.time_us
    # Every design it left untuned was predicted, at batch 8, above the best at 16
    # (by the slack); the last it tuned was not.
    assert all(driver.WALK_SLACK * res.tuned_us[d] > best for d in order[n:])
    assert driver.WALK_SLACK * res.tuned_us[order[n - 1]] <= best
    # Needing three candidates walks at least as far.
    three = reuse_designs(lora(16), res.pool, SearchOptions(), need=3, bounds=res.tuned_us)
    assert three.progress.tuned >= n and len(three.candidates) == 3


def walked(res: SearchResult, n: int) -> set[Any]:
    """The first ``n`` designs of the walk (by their predicted time at batch 8)."""
    assert res.tuned_us is not None
    return set(sorted(res.tuned_us, key=res.tuned_us.__getitem__)[:n])


def test_designs_the_family_rejected_do_not_bound_the_walk() -> None:
    res = at_8()
    assert res.pool is not None and res.tuned_us is not None
    plain = reuse_designs(lora(16), res.pool, SearchOptions(), need=1, bounds=res.tuned_us)
    refused = reuse_designs(lora(16), res.pool, SearchOptions(), need=1,
                            bounds=res.tuned_us, refused=walked(res, plain.progress.tuned))
    assert refused.progress.tuned > plain.progress.tuned
    # Still ranked and verified: they pass at these sizes, so the same one ships.
    assert refused.candidates[0].graph == plain.candidates[0].graph


def test_a_rejection_the_walk_did_not_expect_ranks_every_design(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The walk stopped where no design left could rank above its best; with every
    # design it tuned rejected here, one left untuned ships, so all are ranked.
    res = at_8()
    assert res.pool is not None and res.tuned_us is not None
    plain = reuse_designs(lora(16), res.pool, SearchOptions(), need=1, bounds=res.tuned_us)
    gone = walked(res, plain.progress.tuned)
    real = driver._verify_one

    def reject_walked(p: Graph, g: Graph, seed: int) -> Any:
        return driver.Verdict(False, "rejected by the test", seed) \
            if design_of(g)[0] in gone else real(p, g, seed)

    monkeypatch.setattr(driver, "_verify_one", reject_walked)
    again = reuse_designs(lora(16), res.pool, SearchOptions(), need=1, bounds=res.tuned_us)
    every = reuse_designs(lora(16), res.pool, SearchOptions(), need=1)
    assert again.progress.tuned == every.progress.tuned == 24
    assert again.candidates[0].graph == every.candidates[0].graph
    assert again.candidates[0].design not in gone


def test_no_walk_at_smaller_sizes_or_with_another_parameter_smaller() -> None:
    res = at_8()
    assert res.pool is not None and res.tuned_us is not None
    times = [res.tuned_us.get(d) for d in res.pool]
    sizes = dict(lora(8).params)
    assert _bounds(lora(16), sizes, res.pool, times) == res.tuned_us
    assert _bounds(lora(4), sizes, res.pool, times) is None
    bigger_n = load_graph(str(LORA), {**SMALL, "n": 128, "batch": 16})
    assert _bounds(bigger_n, sizes, res.pool, times) is None


@pytest.mark.parametrize("damage", [
    lambda f: f.__setitem__("tuned_us", f["tuned_us"][1:]),           # one short
    lambda f: f["tuned_us"].__setitem__(0, "4.5"),                    # not a number
    lambda f: f["tuned_us"].__setitem__(0, -1.0),                     # not positive
    lambda f: f.__setitem__("rejected", [len(f["designs"])]),         # out of range
    lambda f: f.pop("rejected"),                                      # missing
])
def test_a_damaged_family_ranking_is_a_miss(tmp_path: Path, damage: Any) -> None:
    seed(tmp_path, 8)
    (f,) = (tmp_path / "cache").glob("*.family.json")
    fam = json.loads(f.read_text())
    damage(fam)
    f.write_text(json.dumps(fam))
    log, cands, _ = opt(tmp_path, 16)
    assert "search: reused" not in log
    assert cands and all("reused_from" not in m for _, m in cands)
