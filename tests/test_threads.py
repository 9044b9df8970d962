"""The planner's default thread counts for tensor-core kernels, and the shape of a
reduction a thread folds alone (docs/perf-log.md v20 has the measurements)."""

from __future__ import annotations

import re
from pathlib import Path

from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.planner import plan_kernel
from mirage_cli.commands.plan import planned
from mirage_cli.ir import Graph
from mirage_cli.kplan import Knobs
from mirage_cli.loading import graphs_from_text, load_graph

ROOT = Path(__file__).resolve().parent.parent
MUGRAPHS = ROOT / "examples" / "mugraphs"


def _kernel_plans(g: Graph, target: str = "sm_90") -> list:  # type: ignore[type-arg]
    types = g.tensor_types()
    return [plan_kernel(op.block, types, target) for op in g.ops if op.block is not None]


def _variant(tmp_path: Path, stem: str, old: str, new: str) -> Graph:
    text = (MUGRAPHS / f"{stem}.mir").read_text()
    assert old in text
    path = tmp_path / f"{stem}.mir"
    path.write_text(text.replace(old, new))
    return load_graph(str(path))


def test_a_chain_gets_one_warp_per_16_row_tile(tmp_path: Path) -> None:
    # gqa_fused's blocks hold 64 query rows (4 tiles of 16): 4 warps. Halving grid.z
    # gives each block 128 rows: 8 warps, each owning one 16-row tile of the score.
    four = _kernel_plans(load_graph(str(MUGRAPHS / "gqa_fused.mir")))[0]
    eight = _kernel_plans(_variant(tmp_path, "gqa_fused", "grid=(2 * batch, 16, 4)",
                                   "grid=(2 * batch, 16, 2)"))[0]
    assert (four.threads, four.knobs.chain) == (128, 1)
    assert (eight.threads, eight.knobs.chain) == (256, 1)
    assert [m.tiles_per_warp for m in eight.mmas] == [m.tiles_per_warp for m in four.mmas]


def test_a_chain_fed_by_a_normalised_operand_is_seen_as_a_chain(tmp_path: Path) -> None:
    # The thread count is chosen on the graph the planner lays out (rms_norm
    # decomposed): Q normalised before the loop still feeds a chain.
    text = (MUGRAPHS / "gqa_fused.mir").read_text()
    text = text.replace("s = matmul(q, k);", "qn = rms_norm(q);\n    s = matmul(qn, k);")
    path = tmp_path / "gqa_norm.mir"
    path.write_text(text.replace("grid=(2 * batch, 16, 4)", "grid=(2 * batch, 16, 2)"))
    plan = _kernel_plans(load_graph(str(path)))[0]
    assert (plan.threads, plan.knobs.chain) == (256, 1)


def test_a_score_through_shared_memory_gets_512_threads() -> None:
    # qknorm_gqa_fused normalises K in each iteration: no chain, the score tile goes
    # through shared memory and the element work over it takes every thread.
    plan = _kernel_plans(load_graph(str(MUGRAPHS / "qknorm_gqa_fused.mir")))[0]
    assert plan.knobs.chain == 0 and plan.threads == 512
    assert any(t.name == "s" and t.home == "smem" for t in plan.tiles)


def test_a_matmul_after_the_loop_keeps_the_block_graphs_threads() -> None:
    # lora's low-rank product runs once, after the loop: not element-bound.
    plan = _kernel_plans(load_graph(str(MUGRAPHS / "lora_fused.mir")))[0]
    assert plan.threads == 128
    assert any(m.output == "lo" and m.accumulator == "" for m in plan.mmas)


def test_a_threads_own_fold_keeps_independent_partials() -> None:
    # K's column norms (64 squares each), with as many threads as columns, are folded
    # by one thread per column: four partial sums, unrolled, instead of one chain of 64
    # dependent adds. (With more threads than columns, lanes share a column: test_plan.)
    g = load_graph(str(MUGRAPHS / "qknorm_gqa_fused.mir"))
    cu, _ = emit(lower(planned(g, "sm_90", [Knobs(threads=64), Knobs()])))
    assert re.search(r"float (acc\d+)_p\[4\];", cu)
    assert re.search(r"for \(int k\d+ = 0; k\d+ < 64; k\d+ \+= 4\)", cu)


def test_a_chain_with_side_work_in_its_loop_gets_512_threads() -> None:
    # qknorm_gqa's one-kernel form computes the key norms (mean of squares over the
    # head dimension) in each iteration besides the chain: 512 threads, the extra warps
    # splitting the score columns (H100: 82.5 -> 50.5 µs at batch 8, perf-log v21),
    # where its mmas are mma.sync (sm_80). On sm_90 one warp per 16-row tile runs it
    # as wgmma warpgroups, faster still (perf-log v28). Without the norms, the same
    # chain keeps one warp per 16-row tile.
    from tests.test_tune_starts import ONE_KERNEL

    normed = ONE_KERNEL.replace("grid=(16, 1, 1)", "grid=(4, 1, 1)")
    plain = normed
    for line in ("    b4 = mul(b1, b1);\n", "    b6 = mean(b4, dim=1, keepdim=true);\n",
                 "    b7 = sqrt(b6);\n"):
        assert line in plain
        plain = plain.replace(line, "")
    plain = plain.replace("b8 = div(b5, b7);", "b8 = mul_scalar(b5, scalar=1.0);")
    (side,) = _kernel_plans(graphs_from_text(normed, "normed.mir")[0], "sm_80")
    (alone,) = _kernel_plans(graphs_from_text(plain, "plain.mir")[0], "sm_80")
    assert (side.threads, side.knobs.chain) == (512, 1) and side.knobs.kwarps == 2
    assert (alone.threads, alone.knobs.chain, alone.knobs.kwarps) == (256, 1, 1)
    (side90,) = _kernel_plans(graphs_from_text(normed, "normed.mir")[0])
    assert (side90.threads, side90.knobs.kwarps, side90.knobs.wgmma) == (256, 1, 1)
