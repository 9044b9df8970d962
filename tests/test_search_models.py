"""The search on sub-graphs of real models: eps and weights fused into the normalising
kernel, mixed designs, non-power-of-two tilings, an answer for every program."""

from __future__ import annotations

import numpy as np
import pytest

from mirage_cli import interp, ops
from mirage_cli.ir import Graph
from mirage_cli.parser import parse_text
from mirage_cli.search.driver import SearchOptions, search
from mirage_cli.verifier.api import Verifier

RMSNORM_EPS_W = """
program rmsnorm_w_linear(rows = 8, hidden = 1024, n = 128) {
  input X: f16[rows, hidden];
  input G: f16[hidden];
  input W: f16[hidden, n];
  Y = rms_norm(X, G, eps=1e-05);
  Z = matmul(Y, W);
  output Z;
}
"""

FUSED_EPS = """
program rmsnorm_w_linear(rows = 8, hidden = 1024, n = 128) {
  input X: f16[rows, hidden];
  input G: f16[hidden];
  input W: f16[hidden, n];
  Z = custom(grid=(4, 1, 1), threads=128, forloop=8) {
    x = load X fmap(1);
    g = load G fmap(0);
    w = load W imap(x=1) fmap(0);
    r = acc_rms_ld(x, eps=EPS);
    xg = mul(x, g);
    m = matmul(xg, w);
    s = acc_sum(m);
    o = div(s, r);
    store o -> Z omap(x=1);
  }
  output Z;
}
"""


def _g(text: str):
    return parse_text(text, "<test>", {})


def test_accumulator_eps_is_sqrt_of_mean_plus_eps():
    spec = ops.get("acc_rms_ld").accum
    assert spec is not None
    tiles = np.arange(1.0, 13.0).reshape(3, 1, 4)  # 3 iterations of a 1x4 tile
    got = ops.np_accumulate(spec, tiles, None, eps=0.5)
    assert np.allclose(got, np.sqrt((tiles ** 2).sum() / 12 + 0.5))
    assert "eps" in {a.name for a in ops.get("acc_rms").attrs}
    assert "eps" not in {a.name for a in ops.get("acc_sum").attrs}


def test_fused_kernel_with_eps_verifies_and_a_wrong_eps_does_not():
    prog = _g(RMSNORM_EPS_W)
    v = Verifier(prog, seed=3)
    good = _g(FUSED_EPS.replace("EPS", "1e-05"))
    assert v.certify(good).verdict == "equivalent"
    ins = interp.random_inputs(prog, 1)
    ref = interp.run(prog, ins)["Z"]
    assert np.allclose(interp.run(good, ins)["Z"], ref, rtol=1e-12, atol=1e-12)
    for wrong in ("1e-06", "0.0"):  # a different eps, or none at all
        bad = _g(FUSED_EPS.replace("EPS", wrong))
        assert v.certify(bad).verdict == "not equivalent"


def test_search_fuses_rmsnorm_eps_and_weight_with_the_matmul():
    prog = _g(RMSNORM_EPS_W)
    res = search(prog, SearchOptions(max_kernel_ops=1, max_block_ops=6, top=1))
    assert res.candidates, "no verified candidate"
    best = res.candidates[0].graph
    assert [op.op for op in best.ops] == ["custom"]
    block = best.ops[0].block
    assert block is not None
    accs = [o for o in block.ops if o.op == "acc_rms_ld"]
    assert len(accs) == 1 and dict(accs[0].attrs)["eps"] == 1e-05
    # The weight is folded into the loop (multiplied before the matmul).
    assert "mul" in [o.op for o in block.ops]
    assert res.candidates[0].verdict["equivalent"] is True


RESIDUAL = """
program residual_rmsnorm(batch = 4, hidden = 256) {
  input X: bf16[batch, hidden];
  input R: bf16[batch, hidden];
  input G: bf16[hidden];
  H = add(X, R);
  Y = rms_norm(H, G, eps=1e-05);
  output H;
  output Y;
}
"""


def test_residual_sum_is_computed_once_in_the_fused_kernel():
    res = search(_g(RESIDUAL), SearchOptions(max_kernel_ops=1, max_block_ops=8, top=1))
    assert res.candidates
    (k,) = res.candidates[0].graph.ops
    assert k.block is not None
    block_ops = [o.op for o in k.block.ops]
    assert block_ops.count("add") == 1, block_ops  # X + R stored and normalised
    assert res.candidates[0].verdict["equivalent"] is True


MLP = """
program mlp(batch = 2, hidden = 64, inter = 96) {
  input X: f16[batch, hidden];
  input W1: f16[hidden, inter];
  input W3: f16[hidden, inter];
  input W2: f16[inter, hidden];
  A = matmul(X, W1);
  B = matmul(X, W3);
  S = silu(A);
  H = mul(S, B);
  O = matmul(H, W2);
  output O;
}
"""


def test_cut_program_parts_join_into_a_verified_mixed_design():
    from mirage_cli.search import partition
    from mirage_cli.search.driver import Progress, _mixed

    prog = _g(MLP)
    parts = partition.split(prog, 4)
    assert parts is not None
    first, second = parts
    assert first.outputs == ("H",) and [i.value.name for i in second.graph.inputs] == ["H", "W2"]
    assert partition.split(prog, 0) is None
    p = Progress()
    cands = _mixed(prog, SearchOptions(max_kernel_ops=1, max_block_ops=6, top=1), None, 1,
                   p, 0)
    assert cands, p.mixed
    g = cands[0].graph
    assert len(g.ops) == 2 and g.ops[0].op == "custom"  # gate/up fused, then the down proj
    assert Verifier(prog, seed=5).certify(g).verdict == "equivalent"
    assert "cut after 'H'" in p.mixed
    verdict = cands[0].verdict
    assert verdict["method"].startswith("composition") and verdict["bound"] <= 2 * 2.0 ** -40
    assert verdict["numerics"]["verdict"] == "safe"


def test_tuner_moves_reach_odd_divisors():
    from mirage_cli.search.tune import _moves

    assert _moves(256, 14336) == [128, 224, 448, 512]  # 14336 = 7 * 2^11
    assert 74 in _moves(64, 18944) and 37 in _moves(64, 18944)  # 18944 = 37 * 2^9
    assert _moves(2, 0) == [4]


def test_no_answer_says_which_constraint_excluded_the_fused_designs():
    from mirage_cli.search.driver import explain_none
    from mirage_cli.search.partition import MAX_DEPTH

    # A max-subtracted softmax needs its whole row in one block (the max before any
    # exp): 2 MB rows fit no block. At the depth limit there is no mixed-design
    # fallback, and one kernel excludes the two-kernel rescaled split.
    big = _g("program sm(rows = 4, n = 1048576) {\n  input X: f16[rows, n];\n"
             "  Y = softmax(X, dim=1);\n  output Y;\n}\n")
    res = search(big, SearchOptions(max_kernel_ops=1, max_block_ops=6, top=1),
                 depth=MAX_DEPTH)
    assert not res.candidates and res.progress.designs > 0
    why = explain_none(res.progress)
    assert "exceed the 227 KB of shared memory" in why and "the smallest needs" in why


QWEN_MLP_SLOW = """
program qwen2_mlp_b16_f16(batch = 16, hidden = 3584, inter = 18944) {
  input X: f16[batch, hidden];
  input W1: f16[hidden, inter];
  input W3: f16[hidden, inter];
  input W2: f16[inter, hidden];
  t0 = matmul(X, W1);
  O = custom(grid=(4, 1, 1), threads=128, forloop=9472) {
    b0 = load X imap(x=0);
    b1 = load W3 fmap(1);
    b2 = load W2 fmap(0);
    b3 = load t0 imap(x=0) fmap(1);
    b4 = matmul(b0, b1);
    b5 = silu(b3);
    b6 = mul(b4, b5);
    b7 = matmul(b6, b2);
    b8 = acc_sum(b7);
    store b8 -> O omap(x=0);
  }
  output O;
}
"""


def test_a_fused_answer_predicted_slower_than_unfused_is_not_shipped():
    """A design of 8 blocks looping over K two columns at a time (what the search found
    for qwen2_mlp at batch 16) is predicted far slower than the program's own lowering,
    so opt and the layer parts ship the unfused lowering; a good design is kept."""
    from mirage_cli.loading import load_graph
    from mirage_cli.search.driver import slower_than_unfused

    program = load_graph("examples/models/qwen2_mlp_b16_f16.mir")
    why = slower_than_unfused(program, parse_text(QWEN_MLP_SLOW, "slow.mir"))
    assert why is not None and "slower than the unfused program" in why
    small = parse_text(RMSNORM_EPS_W, "p.mir")
    fused = parse_text(FUSED_EPS.replace("EPS", "1e-05"), "f.mir")
    assert slower_than_unfused(small, fused) is None


def _streaming_matmul(grid: int, n: int, hidden: int, forloop: int) -> Graph:
    """One custom kernel streaming W[hidden, n] in ``grid`` column tiles."""
    return parse_text(f"""
program p(hidden = {hidden}, n = {n}) {{
  input X: f16[16, hidden];
  input W: f16[hidden, n];
  O = custom(grid=({grid}, 1, 1), threads=128, forloop={forloop}) {{
    x = load X fmap(1);
    w = load W imap(x=1) fmap(0);
    m = matmul(x, w);
    s = acc_sum(m);
    store s -> O omap(x=1);
  }}
  output O;
}}
""", "p.mir")


def test_tensor_cores_take_k_in_whole_steps_and_scalar_copies_cost_more():
    """The model counts a block matmul's K in steps of 16, and streams a loop input
    whose tile rows are not 16-byte multiples (148 f16 columns) the profile's
    scalar_copy_slowdown times slower than 128-column tiles of the same weight."""
    from mirage_cli.dtypes import DType
    from mirage_cli.ir import TensorType
    from mirage_cli.search import cost

    f16 = DType.F16
    a, b = TensorType((4, 1), f16), TensorType((1, 4096), f16)
    out = TensorType((4, 4096), f16)
    assert cost._block_flops("matmul", [a, b], out) == 16 * cost.op_flops("matmul", [a, b], out)
    a24 = TensorType((4, 24), f16)
    b24 = TensorType((24, 64), f16)
    out24 = TensorType((4, 64), f16)
    assert cost._block_flops("matmul", [a24, b24], out24) == 2 * 4 * 64 * 32

    def streamed(cols: int, grid: int) -> float:
        (k,) = cost.kernel_costs(_streaming_matmul(grid, cols * grid, 1024, 16))
        return k.stream_us / (k.dram_bytes + k.l2_bytes)

    slow = cost.profile().scalar_copy_slowdown
    assert slow is not None and slow > 5
    ratio = streamed(148, 128) / streamed(128, 128)
    assert slow * 0.8 < ratio < slow * 1.2


def test_a_grid_of_few_blocks_reads_in_proportion_to_its_blocks():
    """Below one block per SM, the model's memory time of a streaming kernel grows as its
    grid shrinks (measured on an H200: 4 to 64 blocks read 33-35 GB/s each with
    cp.async; on an H100 59-63 GB/s each with bulk tensor copies, which these kernels'
    default plans use)."""
    from mirage_cli.search import cost

    def stream(grid: int) -> tuple[float, int, int]:
        (k,) = cost.kernel_costs(_streaming_matmul(grid, 8192, 4096, 64))
        return k.stream_us, k.blocks, k.dram_bytes

    p = cost.profile()
    bw = p.bulk_stream_bw
    assert bw is not None and p.block_stream_bw is not None and bw > p.block_stream_bw
    (t8, b8, d8), (t16, b16, d16) = stream(8), stream(16)
    assert b8 < b16 <= 64  # launched blocks (a default K split may double them)
    assert t8 >= d8 / (b8 * bw) * 1e6 and t16 >= d16 / (b16 * bw) * 1e6
    assert t8 / t16 > 0.9 * b16 / b8


def test_a_k_tile_off_the_mma_step_gathers_fragments_element_by_element():
    """A block matmul whose K tile is not a multiple of 16 costs its tensor-core work
    scalar_copy_slowdown times over; one of whole steps does not."""
    from mirage_cli.search import cost

    def compute(forloop: int) -> float:
        (k,) = cost.kernel_costs(_streaming_matmul(64, 8192, 4096, forloop))
        return k.compute_us / k.flops

    slow = cost.profile().scalar_copy_slowdown
    assert slow is not None and slow > 1
    # 4096 / 512 = 8 rows of K per iteration (counted as one step of 16), 4096 / 256 = 16.
    assert compute(512) == pytest.approx(slow * compute(256))


def test_a_small_last_round_of_blocks_is_a_tail():
    """Blocks stream in rounds of those resident at once: 148 blocks at one per SM run
    132, then a tail of 16 at their own rate; at two per SM they all run at once."""
    import dataclasses

    from mirage_cli.search import cost

    p = cost.profile()
    assert p.block_stream_bw is not None and p.num_sms == 132
    dram = 271e6
    bw = p.block_stream_bw
    one, two = cost._block_rounds_s(dram, 148, 1, p, bw), cost._block_rounds_s(dram, 148, 2, p, bw)
    at_bw = dram / p.dram_bw
    assert two == pytest.approx(max(at_bw, dram / 148 / p.block_stream_bw))
    assert one == pytest.approx(132 / 148 * at_bw + dram / 148 / p.block_stream_bw)
    assert one > 1.5 * two
    # Whole rounds cost no more than the bandwidth when each block keeps up.
    fast = dataclasses.replace(p, block_stream_bw=1e12)
    assert cost._block_rounds_s(dram, 264, 1, fast, 1e12) == pytest.approx(at_bw)


def test_whole_designs_all_slower_than_unfused_send_the_search_to_the_cuts_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """When every ranked whole design is predicted slower than the unfused program, the
    cut program is searched before any whole design is verified, and the whole ones
    predicted slower than its answer are never verified (qwen2_mlp at batch 16 spent
    its whole budget certifying such designs; docs/perf-log.md v48)."""
    import dataclasses

    from mirage_cli.search import driver
    from mirage_cli.search.cost import estimate

    prog = _g(MLP)
    unfused = estimate(prog)
    ranked = [(None, (), prog, dataclasses.replace(unfused, time_us=unfused.time_us * k))
              for k in (2.0, 3.0)]
    assert driver._all_slower_than_unfused(prog, ranked)  # type: ignore[arg-type]
    assert not driver._all_slower_than_unfused(prog, ranked + [  # type: ignore[operator]
        (None, (), prog, dataclasses.replace(unfused, time_us=unfused.time_us / 2))])
    assert not driver._all_slower_than_unfused(prog, [])

    events: list[tuple[str, float]] = []
    verify_all, mixed = driver._verify_all, driver._mixed

    def spy_verify(program, batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        if program is prog:
            events.extend(("whole", c.time_us) for *_, c in batch)
        return verify_all(program, batch, *args, **kwargs)

    def spy_mixed(program, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = mixed(program, *args, **kwargs)
        if program is prog:
            events.append(("cut", out[0].cost.time_us if out else float("inf")))
        return out

    monkeypatch.setattr(driver, "_verify_all", spy_verify)
    monkeypatch.setattr(driver, "_mixed", spy_mixed)
    monkeypatch.setattr(driver, "_all_slower_than_unfused", lambda p, todo: p is prog)
    res = search(prog, SearchOptions(max_kernel_ops=1, max_block_ops=6, top=3))
    assert res.candidates and "cut after 'H'" in res.progress.mixed
    assert events[0][0] == "cut"  # the cuts first, then only whole designs faster
    assert all(kind == "whole" and t < events[0][1] for kind, t in events[1:])
