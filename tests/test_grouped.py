"""Kernels that share a launch, tuned together (search/grouped.py) and priced as one
launch (search/cost.py ``grouped_us``)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from mirage_cli import interp, serialize
from mirage_cli.codegen.lower import lower
from mirage_cli.ir import Graph
from mirage_cli.parser import parse_text
from mirage_cli.search import cost, grouped, layer, partition
from mirage_cli.search.driver import SearchOptions, cached_search
from mirage_cli.verifier.api import Verifier

# A normalisation feeding three projections, the key and value ones of few columns:
# the shape of a decoder layer's first part at a size the default tests can search.
QKV = """program qkv(rows = 1, hidden = 1024, q = 4096, kv = 512) {
  input X: bf16[rows, hidden];
  input G: bf16[hidden] weight;
  input WQ: bf16[hidden, q] weight;
  input WK: bf16[hidden, kv] weight;
  input WV: bf16[hidden, kv] weight;
  N = rms_norm(X, G, eps=1e-06);
  Q = matmul(N, WQ);
  K = matmul(N, WK);
  V = matmul(N, WV);
  output Q, K, V;
}
"""


def _task() -> layer.PartTask:
    prog = parse_text(QKV, "qkv.mir")
    return layer.PartTask(layer.PartPlan(0, 0, len(prog.ops), True, "test"), prog,
                          SearchOptions(), 60.0, False)


@pytest.fixture(scope="module")
def searched() -> tuple[list[Graph], layer.PartResult]:
    """The part searched one output at a time and joined, and each output's best
    µGraph as its own search tuned it: the join runs exactly those searches (checked
    here), so they are recorded there instead of run a second time."""
    from mirage_cli.search import driver

    cones = partition.output_cones(_task().graph)
    assert cones is not None
    seen: list[tuple[tuple[Any, ...], driver.Outcome]] = []

    def recorded(*args: Any) -> driver.Outcome:
        seen.append((args, cached_search(*args)))
        return seen[-1][1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(driver, "cached_search", recorded)
        res = layer._per_output(_task(), None, time.time(), True, False)
    assert res is not None
    assert [serialize.dumps(args[0]) for args, _ in seen] == \
        [serialize.dumps(c) for c in cones]
    assert all(args[1:] == (SearchOptions(top=1), 60.0, 1, False, None, None)
               for args, _ in seen)
    return [out.candidates[0][0] for _, out in seen], res


@pytest.fixture(scope="module")
def alone(searched: tuple[list[Graph], layer.PartResult]) -> list[Graph]:
    """Each output's best µGraph as its own search tuned it."""
    return searched[0]


@pytest.fixture(scope="module")
def joined(searched: tuple[list[Graph], layer.PartResult]) -> layer.PartResult:
    return searched[1]


def test_a_grouped_launch_is_priced_once_with_its_members_streams_added(alone: list
                                                                        ) -> None:
    g = layer.join_outputs(_task().graph, alone)
    ks = cost.kernel_costs(g)
    assert ks == cost.kernel_costs(g, co_blocks={})  # alone: nothing changes
    assert cost.grouped_us(ks[:1]) == ks[0].time_us
    blocks = [k.blocks for k in ks]
    co = {i: sum(blocks) - b for i, b in enumerate(blocks)}
    shared = cost.kernel_costs(g, co_blocks=co)
    for k, s in zip(ks, shared):
        # Each member sees the whole grid: its share of the SMs and its rounds.
        assert s.util == min(1.0, sum(blocks) / cost.profile().num_sms)
        assert s.waves == -(-sum(blocks) // cost.profile().num_sms)
        assert s.launch_us == k.launch_us and s.dram_us == k.dram_us
    want = (max(sum(s.stream_us for s in shared), max(s.block_us for s in shared))
            + max(s.sync_us for s in shared) + max(s.launch_us for s in shared))
    assert cost.grouped_us(shared) == pytest.approx(want)
    # One launch instead of three.
    assert cost.grouped_us(shared) < sum(k.time_us for k in ks)


def test_outputs_sharing_a_launch_are_tuned_together(alone: list,
                                                     joined: layer.PartResult) -> None:
    task = _task()
    prog = task.graph
    assert "tuned together for their shared launch" in joined.note
    before = layer.join_outputs(prog, alone)
    got = joined.graph
    assert [(op.block.grid, op.block.forloop) for op in got.ops if op.block] != \
        [(op.block.grid, op.block.forloop) for op in before.ops if op.block]
    # What the model prices is what codegen launches: the three in one grid.
    assert lower(got).launch_ops == ((0, 1, 2),)
    # The query projection (the most bytes) keeps its tiling, and the others' blocks
    # stream fewer bytes each than its blocks.
    assert got.ops[0].block == before.ops[0].block
    ks = cost.kernel_costs(got)
    assert all(k.dram_bytes / k.blocks < ks[0].dram_bytes / ks[0].blocks for k in ks[1:])
    assert grouped.layout_us(got) < grouped.layout_us(before) * (1 - cost.TIE_REL)
    # Each retuned output is certified again: the join still computes the part.
    assert joined.verdict is not None and joined.verdict["certificate"]["bound"] < 1e-12
    assert Verifier(prog, seed=3).check(got, trials=2).equivalent is True
    ins = interp.random_inputs(prog, 5)
    want, have = interp.run(prog, ins), interp.run(got, ins)
    for name in prog.outputs:
        np.testing.assert_allclose(have[name], want[name], rtol=2e-2, atol=2e-2)
    again = layer._per_output(task, None, time.time(), True, False)
    assert again is not None and serialize.dumps(again.graph) == serialize.dumps(got)


def test_a_retuned_output_that_does_not_verify_keeps_its_own_tuning(
        alone: list, monkeypatch: pytest.MonkeyPatch) -> None:
    from mirage_cli.search import verify as verify_mod

    def refuse(reference, candidate, seed):  # type: ignore[no-untyped-def]
        return verify_mod.Verdict(False, "refused by the test", seed, {})

    monkeypatch.setattr(verify_mod, "verify", refuse)
    res = layer._per_output(_task(), None, time.time(), True, False)
    assert res is not None and "tuned together" not in res.note
    assert serialize.dumps(res.graph) == \
        serialize.dumps(layer.join_outputs(_task().graph, alone))
