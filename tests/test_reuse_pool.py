"""Shape reuse from the family entry's design pool: at sizes of the same size pattern
nothing is enumerated and the reuse ships what a fresh search ships; at sizes of
another pattern the designs enumerated there are ranked beside the pool's; a damaged
pool is a miss; a reuse verifies only as many candidates as it ships."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mirage_cli import serialize
from mirage_cli.cli import main
from mirage_cli.ir import DType, Graph
from mirage_cli.loading import load_graph
from mirage_cli.search import driver
from mirage_cli.search.cost import rank
from mirage_cli.search.design import CustomD, Design
from mirage_cli.search.driver import SearchOptions, reuse_designs, search
from mirage_cli.search.family import (
    BadDesign,
    design_from_json,
    design_to_json,
    size_pattern,
    split_facts,
)

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "examples" / "gated_mlp.mir"
LORA = ROOT / "examples" / "lora.mir"
GQA = ROOT / "examples" / "gqa.mir"
MQA = ROOT / "examples" / "mqa_decode.mir"
SMALL = {"hidden": 64, "n": 64}


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))


def mlp(batch: int) -> Graph:
    return load_graph(str(MLP), {**SMALL, "batch": batch})


def opt(tmp_path: Path, batch: int) -> tuple[str, list[Any]]:
    temps = tmp_path / f"t{batch}"
    r = CliRunner().invoke(main, ["opt", str(MLP), "-o", str(tmp_path / "o.cu"),
                                  "-D", "hidden=64", "-D", "n=64", "-D", f"batch={batch}",
                                  "--jobs", "1", "--save-temps", str(temps)])
    assert r.exit_code == 0, r.output
    return r.output, serialize.loads_candidates(
        next(temps.glob("*.cands.ugraph.json")).read_text())


def family_file(tmp_path: Path) -> Path:
    (f,) = (tmp_path / "cache").glob("*.family.json")
    return f


def test_the_size_pattern_tells_sizes_apart_only_where_the_generator_can() -> None:
    # Rows of batch (gated_mlp at hidden = n = 64): 8 and 16 are alike (8/2 = 4 and
    # 16/2 = 8 equal no other size), 1 is never split, 64 equals hidden.
    assert size_pattern(mlp(8)) == size_pattern(mlp(16))
    assert size_pattern(mlp(1)) != size_pattern(mlp(8)) != size_pattern(mlp(64))
    # lora at batch 16: the batch equals the LoRA rank (16), so shapes that differ at
    # batch 8 are equal there (a [batch, rank] tile is square).
    def lora(batch: int) -> str:
        return size_pattern(load_graph(str(LORA), {"batch": batch}))
    assert lora(8) != lora(16)
    # gqa at batch 16: 2 * batch = 32 is half the head dimension 64; at batch 8 it is
    # 16, a quarter, which the generator never forms.
    def gqa(batch: int, d: int = 64) -> str:
        return size_pattern(load_graph(str(GQA), {"batch": batch, "d": d}))
    assert gqa(8) != gqa(16) and gqa(8, 128) == gqa(16, 128)


def test_same_pattern_reuses_the_pool_and_ships_the_fresh_pick(tmp_path: Path) -> None:
    opt(tmp_path, 8)
    fam = json.loads(family_file(tmp_path).read_text())
    pool = [design_from_json(d) for d in fam["designs"]]
    # The rule's premise, on this program: the pool is the enumeration at batch 16.
    fresh = search(mlp(16), SearchOptions())
    assert fresh.pool is not None and pool == fresh.pool
    log, cands = opt(tmp_path, 16)
    assert "the same size pattern: nothing enumerated" in log
    assert len(cands) == 1 and cands[0][1]["reused_from"].startswith("cache (batch=8")
    assert cands[0][0] == fresh.candidates[0].graph  # what the fresh search ships
    cert = cands[0][1]["verification"]
    assert cert["equivalent"] and cert["float64"]["verdict"] == "close"


def test_another_pattern_ships_a_design_the_cached_pool_lacks(tmp_path: Path) -> None:
    # Which designs exist depends on the sizes: the design a fresh search of MQA at
    # batch 2 ships splits the batch over the grid, which at batch 1 (a dimension of
    # size 1) no design can. The reuse from batch 1 enumerates at batch 2 too
    # (another size pattern) and ships it; the pool alone would have shipped a design
    # the model ranks after it.
    small = {"heads": 4, "d": 16, "seq": 32}

    def mqa(batch: int) -> Graph:
        return load_graph(str(MQA), {**small, "batch": batch})

    def opt_mqa(batch: int) -> tuple[str, list[Any]]:
        temps = tmp_path / f"m{batch}"
        defs = [a for k, v in {**small, "batch": batch}.items() for a in ("-D", f"{k}={v}")]
        r = CliRunner().invoke(main, ["opt", str(MQA), "-o", str(tmp_path / "m.cu"), *defs,
                                      "--jobs", "1", "--save-temps", str(temps)])
        assert r.exit_code == 0, r.output
        return r.output, serialize.loads_candidates(
            next(temps.glob("*.cands.ugraph.json")).read_text())

    assert size_pattern(mqa(1)) != size_pattern(mqa(2))
    opt_mqa(1)
    pool = [design_from_json(d) for d in
            json.loads(family_file(tmp_path).read_text())["designs"]]
    fresh = search(mqa(2), SearchOptions(top=1)).candidates[0]
    assert fresh.design not in pool
    assert any(ld.imap[0] == 0 for step in fresh.design.steps
               if isinstance(step, CustomD) for ld in step.loads)  # the batch split
    log, cands = opt_mqa(2)
    assert "another size pattern: ranked with the" in log
    assert cands[0][0] == fresh.graph
    alone = reuse_designs(mqa(2), pool, SearchOptions(), need=1).candidates[0]
    assert alone.design != fresh.design
    # The search's own order (predicted time, then the tie rule) puts the fresh pick first.
    first = rank([alone, fresh], lambda c: c.cost, lambda c: serialize.dumps(c.graph))[0]
    assert first is fresh


def test_a_pattern_that_differs_in_coincidences_only_enumerates_nothing(tmp_path: Path
                                                                        ) -> None:
    # At batch 16 half of X's 2 x batch rows is the LoRA rank (16), at batch 8 it is
    # not: another size pattern, but the same dimensions split. The reuse
    # ranks the pool alone, and here ships what a fresh search at batch 16 ships.
    sizes = {"hidden": 64, "n": 256}

    def lora(batch: int) -> Graph:
        return load_graph(str(LORA), {**sizes, "batch": batch})

    assert size_pattern(lora(8)) != size_pattern(lora(16))
    assert split_facts(lora(8)) == split_facts(lora(16))
    assert split_facts(lora(1)) != split_facts(lora(8))  # 2 x batch = 2 halves to 1
    defs = [a for k, v in sizes.items() for a in ("-D", f"{k}={v}")]
    for batch in (8, 16):
        temps = tmp_path / f"l{batch}"
        r = CliRunner().invoke(main, ["opt", str(LORA), "-o", str(tmp_path / "l.cu"), *defs,
                                      "-D", f"batch={batch}", "--jobs", "1",
                                      "--save-temps", str(temps)])
        assert r.exit_code == 0, r.output
    assert "another size pattern, the same dimensions split: nothing enumerated" in r.output
    assert "units 0/0" in r.output
    cands = serialize.loads_candidates(next(temps.glob("*.cands.ugraph.json")).read_text())
    assert cands[0][0] == search(lora(16), SearchOptions(top=1)).candidates[0].graph


def test_designs_round_trip_through_json() -> None:
    res = search(load_graph(str(LORA), {"batch": 2, "hidden": 64, "n": 256}),
                 SearchOptions())
    assert res.pool
    for d in res.pool:
        doc = json.loads(json.dumps(design_to_json(d)))
        assert design_from_json(doc) == d
    # A store's dtype (the rescaled split's f32 partials) too.
    d = res.pool[0]
    wide = Design(tuple(replace(s, stores=tuple(replace(st, dtype=DType.F32) for st in s.stores))
                        if isinstance(s, CustomD) else s for s in d.steps), d.outputs)
    assert wide != d
    assert design_from_json(json.loads(json.dumps(design_to_json(wide)))) == wide


@functools.cache
def _one_design() -> Design:
    res = search(mlp(8), SearchOptions(max_kernel_ops=1, top=1))
    assert res.pool
    return res.pool[0]


@pytest.mark.parametrize("damage", [
    lambda s: s["ops"][0].__setitem__(1, [99]),            # an operand out of range
    lambda s: s["ops"][0].__setitem__(0, "no_such_op"),    # an unknown operator
    lambda s: s.__setitem__("axes", "2"),                  # a string for an integer
    lambda s: s["loads"][0].__setitem__(1, [0, None]),     # an imap of two axes
    lambda s: s["stores"][0].__setitem__(0, -1),           # a negative tile index
    lambda s: s["stores"][0].append("f64"),                # an unknown dtype
    lambda s: s.__setitem__("extra", 1),                   # an unknown key
])
def test_a_damaged_design_does_not_decode(damage: Any) -> None:
    doc = design_to_json(_one_design())
    design_from_json(doc)
    damage(next(s for s in doc["steps"] if "loads" in s))
    with pytest.raises(BadDesign):
        design_from_json(doc)


def test_a_damaged_pool_is_a_miss(tmp_path: Path) -> None:
    opt(tmp_path, 8)
    f = family_file(tmp_path)
    fam = json.loads(f.read_text())
    custom = next(s for d in fam["designs"] for s in d["steps"] if "loads" in s)
    custom["ops"][0][1] = [99]
    f.write_text(json.dumps(fam))
    log, cands = opt(tmp_path, 16)
    assert "ignoring the cached family entry" in log and "search: reused" not in log
    assert cands and all("reused_from" not in m for _, m in cands)


def test_a_reuse_verifies_only_what_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    # A search verifies --jobs candidates at a time; a reuse that ships one verifies
    # one (the first in rank order passes here), whatever --jobs is.
    pool = search(mlp(8), SearchOptions()).pool
    assert pool
    seen: list[Graph] = []
    real = driver._verify_one

    def counted(p: Graph, g: Graph, seed: int) -> Any:
        seen.append(g)
        return real(p, g, seed)

    monkeypatch.setattr(driver, "_verify_one", counted)
    res = reuse_designs(mlp(16), pool, SearchOptions(), need=1, jobs=2)
    assert [c.graph for c in res.candidates] == seen and len(seen) == 1
    seen.clear()
    three = reuse_designs(mlp(16), pool, SearchOptions(), need=3, jobs=2)
    assert len(three.candidates) == 3 and [c.graph for c in three.candidates] == seen


def test_the_pool_cannot_push_a_fresh_design_out_of_the_tuning() -> None:
    # The designs tuned fully are the best few by their first tuning; a reuse at
    # another size pattern takes that many from the designs found at these sizes and
    # as many again from the pool, so it tunes whatever a search here would.
    firsts = [((False, t, 0, i), d, None) for i, (t, d) in
              enumerate([(1.0, "pool-a"), (2.0, "pool-b"), (3.0, "fresh-a"), (4.0, "fresh-b")])]
    assert driver._best_of(firsts, 2, None) == ["pool-a", "pool-b"]  # type: ignore[arg-type]
    groups = [["fresh-a", "fresh-b"], ["pool-a", "pool-b"]]
    assert driver._best_of(firsts, 1, groups) == ["pool-a", "fresh-a"]  # type: ignore[arg-type]
    assert driver._best_of(firsts, 2, groups) == ["pool-a", "pool-b", "fresh-a", "fresh-b"]  # type: ignore[arg-type]


def test_a_reuse_at_another_pattern_ranks_in_two_groups(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    pool = search(mlp(8), SearchOptions()).pool
    assert pool
    seen: list[Any] = []
    real = driver._ranked

    def spy(*args: Any, **kw: Any) -> Any:
        seen.append(kw.get("groups"))
        return real(*args, **kw)

    monkeypatch.setattr(driver, "_ranked", spy)
    reuse_designs(mlp(16), pool, SearchOptions(), need=1, enumerate_here=True)
    (groups,) = seen
    assert groups is not None and set(groups[1]) == set(pool)
    assert groups[0] and set(groups[0]) | set(groups[1]) >= set(pool)
    seen.clear()
    reuse_designs(mlp(16), pool, SearchOptions(), need=1)
    assert seen == [None]
