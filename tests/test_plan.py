"""The kernel plan (no GPU): round trip through `.ugraph.json`, pinning, validation of
illegal pins (exit 2, a diagnostic), and every legal value of every knob lowering to
code that NVRTC compiles for sm_80 and sm_90 without spills."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from plan_programs import MHA_SOFTMAX_B1, MQA_SPLIT_B16, RMSNORM_LINEAR_24

from mirage_cli import serialize
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.nvrtc import compile_cuda
from mirage_cli.codegen.planner import knob_space, plan_kernel
from mirage_cli.commands.plan import planned
from mirage_cli.diagnostics import MirageError
from mirage_cli.golden import run_cli
from mirage_cli.ir import Graph
from mirage_cli.kplan import Knobs
from mirage_cli.loading import load_graph

ROOT = Path(__file__).resolve().parent.parent
FUSED = sorted((ROOT / "examples" / "mugraphs").glob("*.mir"))


def _plans(g: Graph) -> list:  # type: ignore[type-arg]
    return [op.plan for op in g.ops if op.block is not None]


@pytest.mark.parametrize("path", FUSED, ids=lambda p: p.stem)
def test_plan_round_trip(path: Path) -> None:
    g = planned(load_graph(str(path)), "sm_90", [])
    assert all(p is not None for p in _plans(g))
    text = serialize.dumps(g)
    back = serialize.loads(text)
    assert back == g and serialize.dumps(back) == text
    assert '"plan"' in text and '"knobs"' in text


def test_pinned_knobs_reach_the_code() -> None:
    g = load_graph(str(ROOT / "examples/mugraphs/rmsnorm_linear_fused.mir"))
    for stages in (2, 3):
        pg = planned(g, "sm_90", [Knobs(stages=stages, kwarps=1)])
        (plan,) = _plans(pg)
        assert plan.knobs.stages == stages and plan.mmas[0].kwarps == 1
        # The code generator follows the plan recorded in the µGraph.
        cu, _ = emit(lower(serialize.loads(serialize.dumps(pg))))
        # One barrier per iteration: wait until S - 2 groups are pending.
        assert f"mg_cp_async_wait<{stages - 2}>();" in cu


def test_a_tile_computed_in_the_loop_for_tensor_cores_is_16_bit_and_padded() -> None:
    # qknorm's K normalised in each iteration is the B operand of Q @ K: written in f16
    # to padded rows (one copy, not one per pipeline stage), read by ldmatrix.trans.
    g = load_graph(str(ROOT / "examples/mugraphs/qknorm_gqa_fused.mir"))
    plan = _plans(planned(g, "sm_90", [Knobs()]))[0]
    kn = next(t for t in plan.tiles if t.name == "kn")
    assert (kn.home, kn.pitch, kn.vec, kn.stages) == ("smem", 72, 8, 1)
    assert next(m for m in plan.mmas if m.output == "s").b_path == "ldmatrix.trans"
    cu, _ = emit(lower(planned(g, "sm_90", [Knobs()])))
    assert "mg_st(sm_kn_0 + (" in cu and "buf_kn" not in cu


def test_a_weighted_tile_is_scaled_in_registers_and_uneven_tiles_have_no_branch() -> None:
    # x * w before the loop's matmul: no tile of its own, A's fragments are x's, scaled
    # by w's pairs; 9 tiles over 4 warps: the last tile of a warp clamped, not skipped.
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from codegen_cases import weighted_norm_uneven_tiles

    g = planned(weighted_norm_uneven_tiles(), "sm_90", [Knobs()])
    for plan in _plans(g):
        assert next(t for t in plan.tiles if t.name == "b4").home == "inline"
        assert plan.mmas[0].a_path == "scaled"
    cu, _ = emit(lower(g))
    # The operands in the operator's order: x * w in bf16, w * x in f16.
    assert cu.count("mg_hmul2_bf16(ra") == 4 and cu.count("mg_hmul2_f16(mg_v, ra") == 4
    assert "ra0 = mg_hmul2_bf16(ra0, mg_v);" in cu and "ra3 = mg_hmul2_f16(mg_v, ra3);" in cu
    assert cu.count("const int q = min(mg_grp + 4 * j, 8);") == 2
    loop = cu[cu.index("for (int it = 0;"):]
    assert "if (q < 9)" not in loop[:loop.index("mg_mma_bf16(")]
    # With ldmatrix off the product is computed where the direct path reads it.
    off = planned(weighted_norm_uneven_tiles(), "sm_90", [Knobs(ldmatrix=0)] * 2)
    assert all(p.mmas[0].a_path == "direct" for p in _plans(off))
    assert "mg_hmul2" not in emit(lower(off))[0].split("extern \"C\"", 1)[1]


def test_two_row_tiles_share_each_b_fragment() -> None:
    # 32 (and 24) rows: each warp owns both 16-row tiles of its 8-column tiles, loads
    # the two A fragments once a step and each B fragment once for both.
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from codegen_cases import two_row_tiles

    cu, _ = emit(lower(planned(two_row_tiles(), "sm_90", [Knobs()])))
    step = cu[cu.index("unsigned mg_ra[2][4];"):]
    step = step[:step.index("acc_b4[2 + jn]") + 200]
    assert step.count("mg_ldsm_x4(") == 2 and step.count("mg_ldsm_x2_t(") == 1
    assert "acc_b4[0 + jn], mg_ra[0][0]" in step and "acc_b4[2 + jn], mg_ra[1][0]" in step
    assert cu.count("unsigned mg_ra[2][4];") == 2


def test_k_split_warps_combine_in_order_without_atomics() -> None:
    # Each level of K-split warps writes (level 0) or adds (later levels) its own
    # fragments after a barrier: one writer per element and level, a fixed order.
    g = load_graph(str(ROOT / "examples/mugraphs/rmsnorm_linear_fused.mir"))
    for kwarps in (2, 4):
        cu, _ = emit(lower(planned(g, "sm_90", [Knobs(kwarps=kwarps, threads=256)])))
        assert "atomicAdd" not in cu
        for lvl in range(kwarps):
            assert f"if (mg_ks == {lvl}) {{" in cu
        assert cu.count("] += acc_") == 4 * (kwarps - 1)


def test_plan_fits_the_target() -> None:
    g = load_graph(str(ROOT / "examples/mugraphs/gqa_fused.mir"))
    types = g.tensor_types()
    for arch, limit in (("sm_80", 163 * 1024), ("sm_90", 227 * 1024)):
        for op in g.ops:
            assert op.block is not None
            assert plan_kernel(op.block, types, arch).smem_bytes <= limit


def test_illegal_pins_are_rejected() -> None:
    g = load_graph(str(ROOT / "examples/mugraphs/ntrans_fused.mir"))
    types = g.tensor_types()
    (op,) = g.ops
    assert op.block is not None
    with pytest.raises(MirageError, match="stages=3 is not legal"):
        plan_kernel(op.block, types, "sm_90", Knobs(stages=3))
    with pytest.raises(MirageError, match="unsupported target"):
        plan_kernel(op.block, types, "sm_70")
    # A thread count that is no whole number of warps is refused before anything plans
    # with it (a pin of 0 threads once sent the thread search into an endless loop).
    for bad in (0, 48, 2048):
        with pytest.raises(MirageError, match=f"threads={bad} is not legal"):
            plan_kernel(op.block, types, "sm_90", Knobs(threads=bad))


RMSNORM_LINEAR_B16 = """program rmsnorm_linear(batch = 16, hidden = 4096, n = 6144) {
  input X: f16[2 * batch, hidden];
  input W: f16[hidden, n] weight;
  Z = custom(grid=(64, 1, 1), threads=128, forloop=32) {
    b0 = load X fmap(1);
    b1 = load W imap(x=1) fmap(0);
    b2 = acc_rms_ld(b0);
    b3 = matmul(b0, b1);
    b4 = acc_sum(b3);
    b5 = div(b4, b2);
    store b5 -> Z omap(x=1);
  }
  output Z;
}
"""



def test_a_plan_with_a_deeper_ring_replans_from_its_own_knobs(tmp_path: Path) -> None:
    # On cp.async (tma=0), unpadded rows (pad=0) leave room for a sixth stage of
    # mqa_decode's split kernel at batch 16, where padded rows stop at five. The plan's
    # own knobs, pinned again (as `mirage plan` and codegen do with a recorded plan),
    # are legal: the depths are those of the plan with the other knobs pinned, not of
    # the default (bulk copies into unpadded boxes, which reach six as well).
    src = tmp_path / "mqa16.mir"
    src.write_text(MQA_SPLIT_B16)
    g = load_graph(str(src))
    types = g.tensor_types()
    (op,) = g.ops
    assert op.block is not None
    assert plan_kernel(op.block, types, "sm_90", Knobs()).knobs.stages == 6
    cp = Knobs(tma=0)
    assert knob_space(op.block, types, "sm_90", cp)["stages"] == [1, 2, 3, 4, 5]
    plan = plan_kernel(op.block, types, "sm_90", Knobs(pad=0, tma=0))
    assert plan.knobs.stages == 6
    assert plan_kernel(op.block, types, "sm_90", plan.knobs) == plan
    unpadded = Knobs(pad=0, tma=0)
    assert knob_space(op.block, types, "sm_90", unpadded)["stages"] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(MirageError, match=r"stages=6 is not legal .*legal values: 1, 2, 3, 4, 5\)"):
        plan_kernel(op.block, types, "sm_90", Knobs(stages=6, tma=0))

def test_the_zero_row_is_16_byte_aligned_at_every_thread_count(tmp_path: Path) -> None:
    # ldmatrix reads the zero row for the rows past a short A tile; it follows the
    # per-warp partials, which took 8 bytes at 64 threads and left it misaligned (a
    # misaligned-address fault on an H100 when the tuner tried threads=64).
    src = tmp_path / "mha1.mir"
    src.write_text(MHA_SOFTMAX_B1)
    g = load_graph(str(src))
    types = g.tensor_types()
    (op,) = g.ops
    assert op.block is not None
    for threads in knob_space(op.block, types, "sm_90")["threads"]:
        plan = plan_kernel(op.block, types, "sm_90", Knobs(threads=threads))
        offsets = {t.name: t.smem_offset for t in plan.tiles}
        assert "$zero" in offsets and "$red" in offsets, threads
        assert offsets["$zero"] % 16 == 0, (threads, offsets["$zero"])

def test_stages_stop_where_the_loop_tiles_leave_shared_memory(tmp_path: Path) -> None:
    # What `mirage opt` ships for rmsnorm_linear at batch 16: 6 stages of X's and W's
    # tiles fit beside each other, 7 would push W's into global memory (4x slower on
    # the H200). Such a depth is not a value of the knob, and pinning it is an error.
    src = tmp_path / "rl16.mir"
    src.write_text(RMSNORM_LINEAR_B16)
    g = load_graph(str(src))
    types = g.tensor_types()
    (op,) = g.ops
    assert op.block is not None
    assert knob_space(op.block, types, "sm_90")["stages"] == [1, 2, 3, 4, 5, 6]
    plan = plan_kernel(op.block, types, "sm_90", Knobs(stages=6))
    assert {t.name: t.home for t in plan.tiles}["b1"] == "smem"
    with pytest.raises(MirageError, match=r"stages=7 is not legal .*legal values: 1, 2, 3, 4, 5, 6\)"):
        plan_kernel(op.block, types, "sm_90", Knobs(stages=7))
    # At batch 1 (2 rows of X) the deepest ring fits.
    src.write_text(RMSNORM_LINEAR_B16.replace("batch = 16", "batch = 1"))
    g1 = load_graph(str(src))
    (op1,) = g1.ops
    assert op1.block is not None
    assert knob_space(op1.block, g1.tensor_types(), "sm_90")["stages"] == list(range(1, 9))


def test_plan_cli_diagnostics(tmp_path: Path) -> None:
    src = str(ROOT / "examples/mugraphs/rmsnorm_linear_fused.mir")
    code, out, err = run_cli(("plan", src, "--pin", "kwarps=3"))
    assert code == 2 and "kwarps=3 is not legal" in err and "Traceback" not in err
    code, out, err = run_cli(("plan", src, "--pin", "warps=3"))
    assert code == 2 and "unknown knob 'warps'" in err
    bad = tmp_path / "bad.ugraph.json"
    doc = json.loads(serialize.dumps(planned(load_graph(src), "sm_90", [])))
    doc["graph"]["ops"][0]["plan"]["knobs"]["stages"] = "many"
    bad.write_text(json.dumps(doc))
    code, out, err = run_cli(("codegen", str(bad)))
    assert code == 2 and "plan.knobs.stages" in err and "Traceback" not in err
    code, out, err = run_cli(("plan", src, "--pin", "stages=2", "--json"))
    assert code == 0 and json.loads(out)[0]["plan"]["knobs"]["stages"] == 2


def test_plan_prints_the_recorded_plan(tmp_path: Path) -> None:
    """Without pins, `mirage plan` shows (and writes) the plan a file carries."""
    src = str(ROOT / "examples/mugraphs/rmsnorm_linear_fused.mir")
    pinned_file = tmp_path / "p.ugraph.json"
    code, _, err = run_cli(("plan", src, "--pin", "stages=2", "-o", str(pinned_file)))
    assert code == 0, err
    code, out, err = run_cli(("plan", str(pinned_file), "--json"))
    assert code == 0 and json.loads(out)[0]["plan"]["knobs"]["stages"] == 2
    code, out, err = run_cli(("plan", str(pinned_file), "--pin", "stages=3", "--json"))
    assert code == 0 and json.loads(out)[0]["plan"]["knobs"]["stages"] == 3


# One example per kind of kernel: tensor-core accumulation, a materialised mma with a
# second mma, row reductions, and a generated matmul from the unfused lowering.
KNOB_CASES = ["rmsnorm_linear_fused", "gqa_fused", "ntrans_fused", "lora_fused"]


@pytest.mark.parametrize("stem", KNOB_CASES)
def test_every_knob_value_compiles(stem: str) -> None:
    g = load_graph(str(ROOT / "examples" / "mugraphs" / f"{stem}.mir"))
    types = g.tensor_types()
    variants: list[list[Knobs]] = []
    spaces = [knob_space(op.block, types, "sm_90") for op in g.ops if op.block is not None]
    for knob in Knobs.names():
        for value in sorted({v for s in spaces for v in s[knob]}):
            pins = [Knobs(**{knob: value}) if value in s[knob] else Knobs() for s in spaces]
            variants.append(pins)
    assert len(variants) >= 10
    # A knob pinned to the value the planner picks anyway emits the same source: each
    # distinct source is compiled once (about 40% of the variants are such repeats).
    sources: dict[tuple[str, str], list[Knobs]] = {}
    for pins in variants:
        for arch in ("sm_80", "sm_90"):
            try:
                pg = planned(g, arch, pins)
            except MirageError:
                continue  # a value legal on sm_90 that does not fit sm_80's shared memory
            sources.setdefault((emit(lower(pg, arch))[0], arch), pins)
    for (cu, arch), pins in sources.items():
        res = compile_cuda(cu, f"{g.name}.cu", arch)
        assert all(r.spill_stores == 0 and r.stack == 0 for r in res.resources), \
            (pins, arch, res.resources)


def test_threads_knob_changes_the_launch() -> None:
    g = load_graph(str(ROOT / "examples/mugraphs/ntrans_fused.mir"))
    for t in (128, 512):
        (k,) = lower(planned(g, "sm_90", [Knobs(threads=t)])).kernels
        assert k.threads == t and f"__launch_bounds__({t}, 1)" in emit(
            dataclasses.replace(lower(g), kernels=(k,)))[0]


def test_opt_records_the_plan_it_ships(tmp_path: Path) -> None:
    src = tmp_path / "lora.mir"
    src.write_text((ROOT / "examples/lora.mir").read_text().replace("n = 4096", "n = 512"))
    temps = tmp_path / "temps"
    code, _, err = run_cli(("opt", str(src), "-o", str(tmp_path / "lora.cu"), "--save-temps",
                            str(temps), "--jobs", "1"))
    assert code == 0, err
    best = load_graph(str(temps / "lora.best.ugraph.json"))
    plans = _plans(best)
    assert plans and all(p is not None for p in plans)
    # The shipped code is the code of the recorded plan.
    assert (tmp_path / "lora.cu").read_text().count("plan: ") == len(plans)
    cu, _ = emit(lower(best, name=lower(best).name))
    assert cu == (tmp_path / "lora.cu").read_text()


def test_fmt_plan_and_codegen_pins(tmp_path: Path) -> None:
    src = str(ROOT / "examples/mugraphs/lora_fused.mir")
    code, out, err = run_cli(("fmt", src, "--plan"))
    assert code == 0 and "# kernel 0:" in out and "#   mma xw:" in out
    reparsed = tmp_path / "x.mir"
    reparsed.write_text(out)
    assert load_graph(str(reparsed)) == load_graph(src)  # the plan lines are comments
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps([{"kwarps": 1, "stages": 2}]))
    code, cu, err = run_cli(("codegen", src, "--plan", str(pins)))
    assert code == 0 and "2 stage(s), kwarps 1" in cu
    pins.write_text(json.dumps([{"kwarps": 3}]))
    code, _, err = run_cli(("codegen", src, "--plan", str(pins)))
    assert code == 2 and "kwarps=3 is not legal" in err


def test_ksplit_spreads_the_forloop_over_a_cluster() -> None:
    g = load_graph(str(ROOT / "examples/mugraphs/rmsnorm_linear_fused.mir"))
    types = g.tensor_types()
    (op,) = g.ops
    assert op.block is not None
    assert knob_space(op.block, types, "sm_90")["ksplit"] == [1, 2, 4, 8]
    assert knob_space(op.block, types, "sm_80")["ksplit"] == [1]   # clusters are sm_90
    assert knob_space(op.block, types, "sm_90")["push"] == [0, 1]
    assert knob_space(op.block, types, "sm_80")["push"] == [0]
    gqa = load_graph(str(ROOT / "examples/mugraphs/gqa_fused.mir"))
    first = gqa.ops[0].block
    assert first is not None and knob_space(first, gqa.tensor_types(), "sm_90")["ksplit"] == [1]
    (k,) = lower(planned(g, "sm_90", [Knobs(ksplit=4)])).kernels
    assert k.grid == (op.block.grid[0], 1, 4) and k.cluster == 4
    cu, _ = emit(lower(planned(g, "sm_90", [Knobs(ksplit=4)])))
    assert "__cluster_dims__(1, 1, 4)" in cu and "mg_cluster_sync();" in cu
    assert compile_cuda(cu, "k.cu", "sm_90").cubin
    with pytest.raises(MirageError, match="ksplit=4 is not legal"):
        planned(g, "sm_80", [Knobs(ksplit=4)])


def test_clusters_of_any_size_that_divides_the_forloop(tmp_path: Path) -> None:
    src = tmp_path / "rl24.mir"
    src.write_text(RMSNORM_LINEAR_24)
    g = load_graph(str(src))
    (op,) = g.ops
    assert op.block is not None
    assert knob_space(op.block, g.tensor_types(), "sm_90")["ksplit"] == [1, 2, 3, 4, 6, 8]
    for ks, push in ((3, 0), (6, 0), (3, 1)):
        pg = planned(g, "sm_90", [Knobs(ksplit=ks, push=push)])
        (k,) = lower(pg).kernels
        assert k.grid == (40, 1, ks) and k.cluster == ks
        cu, _ = emit(lower(pg))
        # each block runs its own 24 / ks iterations, from its rank's first one
        assert f"__cluster_dims__(1, 1, {ks})" in cu
        assert f"const int mg_it0 = (int)mg_rank * {24 // ks};" in cu
        assert f"for (int it = 0; it < {24 // ks}; ++it)" in cu
        res = compile_cuda(cu, "k.cu", "sm_90")
        assert all(r.spill_stores == 0 and r.stack == 0 for r in res.resources)
    with pytest.raises(MirageError, match="ksplit=5 is not legal"):
        planned(g, "sm_90", [Knobs(ksplit=5)])


def test_the_push_receive_area_holds_a_slot_per_other_block(tmp_path: Path) -> None:
    """Block 0's receive area: its mbarrier, then for each of the cluster's other blocks
    a slot of every accumulator tile (f32, padded to 16 bytes), where they push."""
    src = tmp_path / "rl24.mir"
    src.write_text(RMSNORM_LINEAR_24)
    g = load_graph(str(src))
    pulled = planned(g, "sm_90", [Knobs(ksplit=3, stages=4)]).ops[0].plan
    pushed = planned(g, "sm_90", [Knobs(ksplit=3, stages=4, push=1)]).ops[0].plan
    assert pulled is not None and pushed is not None
    rows = 8  # 2 * batch: r is a row's sum of squares, s the 8 x 128 tile of X @ W
    slot = 16 * -(-rows * 4 // 16) + rows * 128 * 4
    assert pushed.smem_bytes - pulled.smem_bytes == 16 + 2 * slot
    recv = next(t for t in pushed.tiles if t.name == "$recv")
    cu, _ = emit(lower(planned(g, "sm_90", [Knobs(ksplit=3, stages=4, push=1)])))
    assert f"mg_smem + {recv.smem_offset});" in cu   # the mbarrier first
    assert f"mg_smem + {recv.smem_offset + 16} + (mg_rank - 1) * {slot})" in cu
    assert f"mg_mbar_arrive_expect_cluster(mg_recv_bar, {2 * 4 * (rows + rows * 128)}u);" in cu


# (example, batch, pins) -> the cluster combine's form: the shared epilogue where the
# staging ring holds a copy of every accumulator tile, the combine into block 0 where not,
# the push to block 0 where pinned (whichever of the other two would apply).
CLUSTER_FORMS = [("rmsnorm_linear_fused", 16, Knobs(ksplit=2), "shared"),
                 ("gated_mlp_fused", 1, Knobs(ksplit=4, stages=1), "shared"),
                 ("lora_fused", 64, Knobs(ksplit=2, stages=1), "block0"),
                 ("rmsnorm_linear_fused", 16, Knobs(ksplit=2, push=1), "push"),
                 ("gated_mlp_fused", 1, Knobs(ksplit=4, stages=1, push=1), "push"),
                 ("lora_fused", 64, Knobs(ksplit=2, stages=1, push=1), "push")]


@pytest.mark.parametrize("stem,batch,pins,form", CLUSTER_FORMS,
                         ids=[f"{c[0]}-{c[3]}" for c in CLUSTER_FORMS])
def test_cluster_combine_form(stem: str, batch: int, pins: Knobs, form: str) -> None:
    g = load_graph(str(ROOT / f"examples/mugraphs/{stem}.mir"), {"batch": batch})
    cu, _ = emit(lower(planned(g, "sm_90", [pins] * len(g.ops))))
    kernel = cu[cu.index("extern \"C\" __global__"):]
    if form == "shared":   # every block stores its share; none returns early
        assert "mg_cluster_arrive();" in kernel and "  mg_cluster_wait();" in kernel
        assert "(int)mg_rank * " in kernel and "mg_rank != 0" not in kernel
    elif form == "push":   # no cluster barrier at the end: the others push and return
        assert "mg_cluster_sync();" not in kernel and "mg_cluster_arrive();" not in kernel
        assert "mg_cluster_arrive_relaxed();" in kernel and "if (mg_rank != 0) {" in kernel
        assert "mg_push" in kernel and "mg_mbar_wait_cluster(mg_recv_bar, 0);" in kernel
    else:
        assert "if (mg_rank != 0) return;" in kernel and "mg_cluster_arrive();" not in kernel
    assert compile_cuda(cu, "k.cu", "sm_90").cubin


def test_each_output_is_stored_as_wide_as_its_own_rows_allow() -> None:
    # gqa_fused's first kernel stores a row sum (one column per block: element by
    # element) and a 64-wide output tile (16-byte stores); vec 1 stores both one
    # element at a time.
    g = load_graph(str(ROOT / "examples/mugraphs/gqa_fused.mir"))
    bg = g.ops[0].block
    assert bg is not None and knob_space(bg, g.tensor_types(), "sm_90")["vec"] == [1, 8]
    k0 = emit(lower(planned(g, "sm_90", [Knobs()])))[0].split("__global__")[1]
    assert "mg_st(p3 + (" in k0 and "mg_st8(p4 + (" in k0 and "mg_st(p4 + (" not in k0
    k0 = emit(lower(planned(g, "sm_90", [Knobs(vec=1)])))[0].split("__global__")[1]
    assert "mg_st8(" not in k0 and "mg_st(p4 + (" in k0


def test_the_loop_stages_are_in_flight_with_the_invariant_tiles() -> None:
    # gqa_fused copies Q once and K, V through a ring: the ring's first S - 1 stages are
    # issued before the wait for Q, which waits for Q's own commit group alone (the
    # cp.async ring, pinned: by default K and V come by bulk copies, test_tma.py).
    g = load_graph(str(ROOT / "examples/mugraphs/gqa_fused.mir"))
    for stages in (2, 4):
        k0 = emit(lower(planned(g, "sm_90", [Knobs(stages=stages, wgmma=0, tma=0)])))[0]
        k0 = k0.split("__global__")[1]
        q_copy = k0.index("mg_cp_async16(sm_q_0")
        ring = k0.index("mg_cp_async16((sm_k_0")
        wait = k0.index(f"mg_cp_async_wait<{stages - 1}>();")
        assert q_copy < ring < wait < k0.index("const auto* sm_q = sm_q_0;")
        assert k0[q_copy:wait].count("mg_cp_async_commit();") == stages
        assert "mg_cp_async_wait_all();" not in k0[:k0.index("for (int it = 0;")]


def qknorm_chain_as_shipped() -> str:
    """A qknorm attention chain kernel with one head of 128 query rows per block and 512
    threads, as mirage opt ships qknorm_gqa's at batch 8 (8 warp groups; on sm_90 the
    planner now gives it 256 threads, one warpgroup per 64 rows, test_wgmma.py)."""
    from test_chain import QKNORM_ONE_KERNEL

    return (QKNORM_ONE_KERNEL.replace("rows = 256", "rows = 128")
            .replace("grid=(16, 1, 1), threads=128", "grid=(2, 1, 1), threads=512")
            .replace("imap(x=1)", "imap(x=0)").replace("fmap(", "imap(x=0) fmap(")
            .replace("omap(x=1)", "omap(x=0)"))


def test_few_strided_results_are_reduced_by_lane_groups_and_divided_by_reciprocal(
        tmp_path: Path) -> None:
    # A qknorm attention's key norms: mean(k * k, dim=1) over [64, 64] K tiles, fewer
    # results than threads, each a column of K. Computed where read they were
    # 64 serial folds by 64 threads; planned, 8 lanes share a column and combine by
    # shuffles. sqrt of it is only ever a broadcast divisor: it is stored as its
    # reciprocal and the quotient multiplies. In a kernel without a matmul chain
    # (qknorm_gqa_fused) and in one with it (the form mirage opt ships).
    src = tmp_path / "qk.mir"
    src.write_text(qknorm_chain_as_shipped())
    cases = [(load_graph(str(ROOT / "examples/mugraphs/qknorm_gqa_fused.mir")), "km", "kr",
              Knobs(chain=0)), (load_graph(str(src)), "b6", "b7", Knobs(chain=1))]
    for g, mean, root, pins in cases:
        plan = _plans(planned(g, "sm_90", [pins]))[0]
        reds = {r.output: r for r in plan.reductions}
        assert reds[mean].strategy == "rows" and reds[mean].threads_per_row == 8
        assert {t.name: t.home for t in plan.tiles}[mean] == "smem"
        k0 = emit(lower(planned(g, "sm_90", [pins])))[0].split("__global__")[1]
        assert "const int mg_rl = threadIdx.x % 8;" in k0
        assert re.search(r"([\w\[\]]+) = mg_warp_sum\(\1, 8\);", k0)
        # The norms' sqrt is written by the lanes that combine each mean, no pass of
        # its own (fused_finish), as its reciprocal: one rsqrtf.
        assert re.search(rf"buf_{mean}\[row\] = (fin\d+);\s*buf_{root}\[row\] = "
                         rf"rsqrtf\(\1\);", k0)
        assert f"written with {mean}" in {t.name: t.owner for t in plan.tiles}[root]
        reads = re.findall(rf"const float (v\d+) = buf_{root}\[", k0)
        assert reads and all(re.search(rf"\* {v}\)", k0) for v in reads)
        assert not any(re.search(rf"/ {v}\)", k0) for v in reads)
        if pins.chain == 1:  # the loop's one barrier after the side pass waits after QK^T
            loop = k0.split("for (int it = 0;")[1]
            first_mma = loop.index("mg_mma_f16(mg_s[")
            assert loop.index("__syncthreads();", loop.index("__syncthreads();") + 1) > first_mma
            assert loop.count("__syncthreads();", 0, first_mma) == 1


@pytest.mark.parametrize("expr,shape,inverted", [
    ("div(a, s)", "n, 1", True),     # a broadcast divisor: one reciprocal per row
    ("div(a, s)", "n, 64", False),   # one division per element either way
    ("div(s, a)", "n, 1", False),    # a numerator
])
def test_only_a_broadcast_divisor_is_stored_as_its_reciprocal(
        tmp_path: Path, expr: str, shape: str, inverted: bool) -> None:
    from mirage_cli.codegen.blockfacts import analyse, decompose, stored_inverse

    src = tmp_path / "p.mir"
    src.write_text(
        f"program p(n = 64) {{\n  input A: f16[n, 64];\n  input B: f16[{shape}];\n"
        "  C = custom(grid=(1, 1, 1), threads=128, forloop=1) {\n"
        "    a = load A imap();\n    b = load B imap();\n    s = sqrt(b);\n"
        f"    r = {expr};\n    o = acc_sum(r);\n    store o -> C omap();\n  }}\n  output C;\n}}\n")
    bg = load_graph(str(src)).ops[0].block
    assert bg is not None
    assert stored_inverse("s", analyse(decompose(bg))) is inverted


def _normed_queries(tmp_path: Path, rows: int, length: int, threads: int) -> Graph:
    """One kernel that normalises Q (rows x length) before its loop, then multiplies
    it by 4 slices of K: qknorm_gqa's query norm."""
    src = tmp_path / "normed.mir"
    src.write_text(f"""program normed() {{
  input Q: f16[{rows}, {length}];
  input K: f16[{length}, 256];
  O = custom(grid=(1, 1, 1), threads={threads}, forloop=4) {{
    q = load Q imap();
    k = load K imap() fmap(1);
    n = rms_norm(q);
    m = matmul(n, k);
    s = acc_sum(m);
    store s -> O omap();
  }}
  output O;
}}
""")
    return load_graph(str(src))


def test_a_norm_only_divided_by_is_stored_as_its_reciprocal(tmp_path: Path) -> None:
    # rms_norm(Q) before the loop: the norm (a row reduction) is written as 1 / sqrt by
    # the lane that combines its row, and the pass that normalises Q multiplies, its 16
    # elements per thread in an unrolled loop (the loop phase's rule, before the loop
    # too). qknorm_gqa's queries; docs/perf-log.md v27 item 8.
    g = _normed_queries(tmp_path, 128, 64, 512)
    (plan,) = _plans(planned(g, "sm_90", [Knobs()]))
    assert {t.name: t.home for t in plan.tiles}["n__rms"] == "smem"
    k0 = emit(lower(g))[0].split("__global__")[1]
    assert re.search(r"buf_n__rms\[row\] = rsqrtf\(", k0)
    norm = k0[k0.index("buf_n__rms[row] ="):k0.index("for (int it = 0;")]
    assert re.search(r"#pragma unroll\s*for \(int j\d+ = 0; j\d+ < 16;", norm)
    assert re.search(r"mg_st\(sm_n_0 \+ \(.*\), \(v\d+ \* v\d+\)\);", norm)
    assert "/ v" not in norm


STRIDED_MAX = """program p() {
  input X: f16[4, 512, 128];
  Z = custom(grid=(4, 1, 1), threads=256, forloop=2) {
    x = load X imap(x=0) fmap(1);
    m = max(x, dim=1, keepdim=true);
    e = exp(m);
    s = acc_sum(e);
    store s -> Z omap(x=0);
  }
  output Z;
}
"""


def test_a_strided_reduction_reads_its_column_one_element_at_a_time(tmp_path: Path) -> None:
    # max over the 256 rows of a staged [256, 128] tile, 128 results: 8 lanes per
    # column, each lane down its column (row pitch 136). The 16-byte row reads of a
    # reduction along the last dimension would read 8 columns of one row instead.
    src = tmp_path / "p.mir"
    src.write_text(STRIDED_MAX)
    cu, _ = emit(lower(load_graph(str(src))))
    assert re.search(r"fmaxf\(([\w\[\]]+), mg_ld\(sm_x\[(\w+) \* 136 \+ w\w+\]\)\)", cu)
    assert "mg_ld8(sm_x" not in cu
    # Loaded once, before the loop, the same reduction is planned the same way (computed
    # where read, each of its 128 results would be a 256-long fold by one thread), and
    # reads its columns the same way.
    src.write_text(STRIDED_MAX.replace("imap(x=0) fmap(1)", "imap(x=0)")
                   .replace("f16[4, 512, 128]", "f16[4, 256, 128]"))
    g = load_graph(str(src))
    (plan,) = _plans(planned(g, "sm_90", [Knobs()]))
    assert {t.name: t.home for t in plan.tiles}["m"] == "smem"
    assert [(r.output, r.strategy, r.threads_per_row) for r in plan.reductions] == [
        ("m", "rows", 8)]
    cu, _ = emit(lower(g))
    assert re.search(r"fmaxf\(([\w\[\]]+), mg_ld\(sm_x\[(\w+) \* 136 \+ w\w+\]\)\)", cu)
    assert "mg_ld8(sm_x" not in cu


@pytest.mark.parametrize("length,rows,threads,chunk_lanes", [
    (64, 128, 256, 8),       # qknorm_gqa's queries: one lane per 16-byte chunk
    (128, 64, 256, 16),      # a head dimension of 128
    (256, 4, 128, None),     # 32 chunks: whole warps, as before
    (4096, 16, 128, None),   # a hidden row
])
def test_a_short_row_takes_one_lane_per_chunk(tmp_path: Path, length: int, rows: int,
                                              threads: int, chunk_lanes: int | None) -> None:
    """A row reduction along the last dimension takes whole warps per row, but a row of
    fewer than 32 chunks of 8 elements no more lanes than it has chunks; its rows are
    then combined into registers before any is stored."""
    from mirage_cli.codegen.blockfacts import threads_per_row

    g = _normed_queries(tmp_path, rows, length, threads)
    (plan,) = _plans(planned(g, "sm_90", [Knobs()]))
    whole = threads_per_row(rows, plan.threads)
    lanes = min(whole, chunk_lanes) if chunk_lanes else whole
    red = {r.output: r for r in plan.reductions}["n__rms"]
    assert red.strategy == "rows" and red.threads_per_row == lanes
    k0 = emit(lower(g))[0].split("__global__")[1]
    passes = -(-rows // (plan.threads // lanes))
    assert (re.search(rf"float r\d+\[{passes}\];", k0) is not None) == (
        lanes <= 32 and 1 < passes <= 8)
