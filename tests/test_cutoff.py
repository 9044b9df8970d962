"""Where a search ends (issue 14, must-show 1): work, not the clock. A search stopped by
its work limit (``max_states`` block-graph states per unit) gives the same output for
any ``--jobs`` and executor; the wall-clock budget is a safety stop that, when it ends
a search, is reported (``complete: false``, a warning) and never cached. The same
limit on Ray: ``tests/test_distributed.py``."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from test_distributed import LAYER  # the tiny layer both tests search

from mirage_cli.cli import main
from mirage_cli.parser import parse_text
from mirage_cli.search.driver import Outcome, SearchOptions, cached_search
from mirage_cli.search.enumerate import make_target
from mirage_cli.search.prune import Oracle

SMALL = """program rmsnorm_linear(rows = 8, hidden = 256, n = 64) {
  input X: f16[rows, hidden];
  input W: f16[hidden, n];
  Y = rms_norm(X);
  Z = matmul(Y, W);
  output Z;
}
"""

# Small enough that the limit stops some of SMALL's units (they build up to 40 states)
# and changes what is found; large enough that designs are still found.
LIMIT = 20


def _search(opts: SearchOptions, jobs: int) -> Outcome:
    return cached_search(parse_text(SMALL, "small.mir"), opts, 300.0, jobs, use_cache=False)


def test_the_work_limit_stops_the_search_the_same_way_for_any_jobs() -> None:
    limited = SearchOptions(max_kernel_ops=1, max_states=LIMIT)
    one, two = _search(limited, 1), _search(limited, 2)
    assert one.progress is not None and two.progress is not None
    assert one.progress.limited > 0  # the limit, not the end of the space, stopped it
    assert one.progress.limited == two.progress.limited
    assert one.progress.stats.explored == two.progress.stats.explored
    # a work limit is deterministic: the result is complete (cacheable), not clock-cut
    assert one.complete and two.complete and not one.progress.clock
    assert one.candidates and two.text == one.text
    full = _search(SearchOptions(max_kernel_ops=1), 1)
    assert full.progress is not None and full.progress.limited == 0
    assert full.progress.designs > one.progress.designs  # the limit did cut the space
    assert json.loads(one.text)["candidates"][0]["meta"]["complete"] is True


def test_the_budget_is_a_safety_stop_reported_loudly(tmp_path: Path) -> None:
    src = tmp_path / "small.mir"
    src.write_text(SMALL)
    # 0.1 s cannot cover this search (about 1 s): the clock ends it, so it warns.
    r = CliRunner().invoke(main, ["search", str(src), "--budget", "0.1", "--no-cache",
                                  "--max-kernel-ops", "1", "--json", "-o",
                                  str(tmp_path / "c.json")])
    assert "--budget safety stop ended" in r.output
    doc = json.loads(r.stdout[r.stdout.index("{"):])
    assert doc["complete"] is False and doc["stats"]["clock_stopped"]
    for meta in doc["candidates"]:
        assert meta["complete"] is False


def test_a_z3_query_stops_at_a_resource_count_not_a_time() -> None:
    """The per-query limit is Z3's deterministic resource count: a query that exceeds
    it is counted as such (the candidate kept), not as a wall-clock timeout."""
    target = make_target(parse_text(SMALL, "small.mir"))
    term = target.analysis.outputs[0].term
    starved = Oracle([term], rlimit=1)
    assert starved.is_subexpr(term)  # unknown: kept
    assert starved.stats.unknown_limit == 1 and starved.stats.unknown_timeout == 0
    fed = Oracle([term])
    assert fed.is_subexpr(term) and fed.stats.unknown_limit == 0




def test_a_layer_part_the_budget_stopped_is_named_in_a_warning(tmp_path: Path) -> None:
    src = tmp_path / "tiny.mir"
    src.write_text(LAYER)
    args = ["opt", str(src), "-o", str(tmp_path / "t.cu"), "--no-cache", "--jobs", "1",
            "--max-kernel-ops", "1", "--save-temps", str(tmp_path)]
    r = CliRunner().invoke(main, [*args, "--budget", "0.1"])
    assert r.exit_code == 0, r.output
    assert "--budget safety stop ended the search of part(s) 0, 2" in r.output
    meta = json.loads((tmp_path / "tiny.cands.ugraph.json").read_text())
    layer = meta["candidates"][0]["meta"]["layer"] if meta["candidates"] else None
    assert layer is None or layer["complete"] is False
    r = CliRunner().invoke(main, args)  # the default budget: every part ends by its work
    assert r.exit_code == 0 and "safety stop" not in r.output, r.output
    layer = json.loads((tmp_path / "tiny.cands.ugraph.json").read_text()
                       )["candidates"][0]["meta"]["layer"]
    assert layer["complete"] is True and all(p["complete"] for p in layer["parts"])
