"""Matmul chains planned into registers (the attention family, ``codegen/chain.py``),
without a GPU: which block graphs qualify and why others do not, the plan (no shared
memory for the score, the warp layout, the knob's range), the emitted code (the score
never touches shared memory), and every knob value of the hand-built chain cases
compiling without spills. ``tests/test_plan_gpu.py`` checks each against float64."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from codegen_cases import (
    attention_chain,
    attention_chain_batched,
    short_rows_chain_4d,
    short_rows_chain_batched,
    short_rows_online_chain,
)

from mirage_cli.codegen.blockfacts import analyse, decompose
from mirage_cli.codegen.chainfacts import Chain, chain_form
from mirage_cli.codegen.chainplan import (
    FRAG_REGS_MAX,
    ChainLayout,
    chain_of,
    frag_regs,
    held_a_regs,
    holds_a,
    layout,
    row_tiles,
)
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.nvrtc import compile_cuda
from mirage_cli.codegen.planner import knob_space, plan_kernel
from mirage_cli.commands.plan import planned
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.kplan import Knobs
from mirage_cli.loading import load_graph

ROOT = Path(__file__).resolve().parent.parent


def _kernel(g: Graph, i: int = 0):  # type: ignore[no-untyped-def]
    return [op for op in g.ops if op.block is not None][i]


def test_gqa_fused_is_a_chain_with_the_score_in_registers() -> None:
    g = load_graph(str(ROOT / "examples/mugraphs/gqa_fused.mir"), {"batch": 1})
    op = _kernel(g)
    ch = chain_form(analyse(decompose(op.block)))
    assert isinstance(ch, Chain)
    assert [o.op for o in ch.links] == ["exp"] and [o.op for o in ch.row_accs] == ["acc_sum_ld"]
    types = g.tensor_types()
    on, off = (plan_kernel(op.block, types, "sm_90", Knobs(chain=c)) for c in (1, 0))
    assert on.knobs.chain == 1 and off.knobs.chain == 0
    assert {t.name for t in on.tiles if t.home == "frag"} == {"s", "e", "ev"}
    assert all(t.smem_offset < 0 for t in on.tiles if t.home == "frag")
    # The f32 score and exp tiles (64 x 64 each) leave shared memory.
    assert off.smem_bytes - on.smem_bytes >= 2 * 64 * 64 * 4
    mm = {m.output: m for m in on.mmas}
    assert mm["ev"].a_path == "frag" and mm["ev"].accumulator == "o"
    assert [r.strategy for r in on.reductions] == ["quad"]


def test_the_chain_kernel_keeps_the_score_out_of_shared_memory() -> None:
    g = planned(load_graph(str(ROOT / "examples/mugraphs/gqa_fused.mir"), {"batch": 1}),
                "sm_90", [Knobs(chain=1), Knobs()])
    cu, _ = emit(lower(g, "sm_90"))
    body = cu  # kernel 1 (the combine) has no tensor named s, e or l
    assert "buf_s" not in body and "buf_e" not in body   # no f32 score tiles
    assert "mg_pack_f16(mg_s[0][0][0], mg_s[0][0][1])" in body  # fragments as A operand
    assert "__shfl_xor_sync(0xffffffffu, acc_l[m][h], 1)" in body  # row sums by shuffles


# The design `mirage opt` ships for qknorm_gqa at batch 1 (smaller key count): Q is
# normalised once before the loop, K's norm divides the score inside it.
QKNORM_ONE_KERNEL = """program qk(batch = 1, rows = 256, d = 64, seq = 512) {
  input Q: f16[2 * batch, rows, d];
  input K: f16[2 * batch, d, seq];
  input V: f16[2 * batch, seq, d];
  O = custom(grid=(16, 1, 1), threads=128, forloop=8) {
    b0 = load Q imap(x=1);
    b1 = load K fmap(2);
    b2 = load V fmap(1);
    b3 = rms_norm(b0);
    b4 = mul(b1, b1);
    b5 = matmul(b3, b1);
    b6 = mean(b4, dim=1, keepdim=true);
    b7 = sqrt(b6);
    b8 = div(b5, b7);
    b9 = mul_scalar(b8, scalar=0.125);
    b10 = exp(b9);
    b11 = acc_sum_ld(b10);
    b12 = matmul(b10, b2);
    b13 = acc_sum(b12);
    b14 = div(b13, b11);
    store b14 -> O omap(x=1);
  }
  output O;
}
"""


def test_a_normalised_query_is_packed_for_the_chain(tmp_path: Path) -> None:
    """The A operand rms_norm(Q) is computed once before the loop: it is written as a
    padded f16 tile that ldmatrix reads, and the chain applies."""
    src = tmp_path / "qk.mir"
    src.write_text(QKNORM_ONE_KERNEL)
    g = load_graph(str(src))
    op = _kernel(g)
    ch = chain_form(analyse(decompose(op.block)))
    assert isinstance(ch, Chain)
    a_operand = ch.first.inputs[0]
    assert a_operand not in {bi.value.name for bi in op.block.inputs}
    plan = plan_kernel(op.block, g.tensor_types(), "sm_90", Knobs(chain=1))
    tile = {t.name: t for t in plan.tiles}[a_operand]
    assert tile.home == "smem" and tile.pitch > 0 and tile.vec == 8 and tile.smem_offset >= 0
    cu, _ = emit(lower(planned(g, "sm_90", [Knobs(chain=1)] + [Knobs()] * (len(g.ops) - 1))))
    assert f"mg_st(sm_{a_operand}_0 + (" in cu          # written in f16 with its pitch
    assert compile_cuda(cu, "k.cu", "sm_90").cubin
    # Without ldmatrix there is no packed tile, hence no chain.
    off = plan_kernel(op.block, g.tensor_types(), "sm_90", Knobs(ldmatrix=0))
    assert {t.name: t for t in off.tiles}[a_operand].pitch == 0 and off.knobs.chain == 0


def _not_a_chain(why: str, rows: int = 32) -> Graph:
    """A two-matmul kernel that is no chain for the reason ``why`` (or, at 20 rows, for
    its rows)."""
    from mirage_cli.builder import GraphBuilder

    b = GraphBuilder("nc")
    q = b.input("Q", (1, rows, 32), "f16")
    kk = b.input("K", (1, 32, 64), "f16")
    v = b.input("V", (1, 64, 16), "f16")
    k = b.custom((1, 1, 1), 128, 2)
    qt, kt, vt = k.load(q, (0, None, None)), k.load(kk, (0, None, None), 2), \
        k.load(v, (0, None, None), 1)
    if why == "computed":
        kt = k.op("exp", kt)
    s = k.op("matmul", qt, kt)
    e = k.op("exp", s)
    o = k.op("acc_sum", k.op("matmul", e, vt))
    if why == "three":
        o = k.op("acc_sum", k.op("matmul", e, vt))
    stores = [(o, "O", (0, None, None))]
    if why == "store":
        stores.append((k.op("acc_max", e), "M", (0, None, None)))
    for name in k.finish(stores):
        b.output(name)
    return b.build()


@pytest.mark.parametrize("why", ["computed", "store", "three"])
def test_graphs_that_are_not_chains_say_why(why: str) -> None:
    g = _not_a_chain(why)
    reason = chain_form(analyse(decompose(_kernel(g).block)))
    assert isinstance(reason, str)
    assert {"computed": "computed, not loaded", "store": "has no fragment form",
            "three": "not exactly two"}[why] in reason
    assert knob_space(_kernel(g).block, g.tensor_types(), "sm_90")["chain"] == [0]
    with pytest.raises(MirageError):
        planned(g, "sm_90", [Knobs(chain=1)])


def test_the_warp_layout_follows_threads_and_kwarps() -> None:
    ch = chain_form(analyse(decompose(_kernel(attention_chain()).block)))
    assert isinstance(ch, Chain)
    lay = layout(ch, 4, 2)  # two 16-row tiles, four warps: two split each tile's columns
    assert not isinstance(lay, str)
    assert (lay.groups, lay.kwarps, lay.tiles_per_warp, lay.score_tiles) == (2, 2, 1, 2)
    assert "do not split" in str(layout(ch, 4, 1))
    batched = chain_form(analyse(decompose(_kernel(attention_chain_batched()).block)))
    assert isinstance(batched, Chain)
    two = layout(batched, 2, 1)  # two warps, two tiles each, in one matrix of the batch
    assert not isinstance(two, str) and two.tiles_per_warp == 2


def _compile_every_knob_value(g, space: dict[str, list[int]]) -> None:  # type: ignore[no-untyped-def]
    """Each knob of ``space`` pinned to each of its values compiles for sm_90 without
    spills. A value the planner picks anyway emits the same source, so each distinct
    source is compiled once."""
    sources: dict[str, tuple[str, int]] = {}
    for knob, values in space.items():
        for value in values:
            pg = planned(g, "sm_90", [Knobs(**{knob: value})])
            sources.setdefault(emit(lower(pg, "sm_90"))[0], (knob, value))
    for cu, (knob, value) in sources.items():
        res = compile_cuda(cu, f"{g.name}.cu", "sm_90")
        assert all(r.spill_stores == 0 and r.stack == 0 for r in res.resources), \
            (knob, value, res.resources)


@pytest.mark.parametrize("case", [attention_chain, attention_chain_batched],
                         ids=lambda f: f.__name__)
def test_every_knob_value_of_the_chain_cases_compiles(case) -> None:  # type: ignore[no-untyped-def]
    g = case()
    types = g.tensor_types()
    space = knob_space(_kernel(g).block, types, "sm_90")
    assert space["chain"] == [0, 1]
    _compile_every_knob_value(g, space)


def test_a_chain_of_fewer_than_16_rows_fills_one_padded_tile() -> None:
    # A decode GQA's 4 (Llama-3) or 7 (Qwen2) query heads per KV head: one 16-row
    # tile a matrix, its padding rows read from the zero row, clamped where a link
    # reads a per-row tile, and never stored; no wgmma (a warpgroup needs 64 rows).
    g = short_rows_online_chain()
    ch = chain_form(analyse(decompose(_kernel(g).block)))
    assert isinstance(ch, Chain) and ch.online is not None
    assert row_tiles(ch) == 1
    space = knob_space(_kernel(g).block, g.tensor_types(), "sm_90")
    assert space["chain"] == [1] and space["wgmma"] == [0]
    cu = emit(lower(planned(g, "sm_90", []), "sm_90"))[0]
    assert "< 4 ? (const void*)" in cu and "(const void*)mg_zero" in cu
    assert "min(mg_mi0 * 16 + mg_g + 8, 3)" in cu
    assert "if (r1 < 4)" in cu and "if (r0 < 4)" in cu
    batched = chain_form(analyse(decompose(_kernel(short_rows_chain_batched()).block)))
    assert isinstance(batched, Chain) and row_tiles(batched) == 2  # one a matrix
    # A decode layer's 4-D tile of one (batch element, KV head): two unit batch dims.
    four = chain_form(analyse(decompose(_kernel(short_rows_chain_4d()).block)))
    assert isinstance(four, Chain) and row_tiles(four) == 1
    # More than 16 rows that are not a multiple of 16 stay outside the chain.
    reason = chain_form(analyse(decompose(_kernel(_not_a_chain("rows20", 20)).block)))
    assert isinstance(reason, str) and "multiples of the mma shape" in reason


@pytest.mark.parametrize("case", [short_rows_online_chain, short_rows_chain_batched,
                                  short_rows_chain_4d],
                         ids=lambda f: f.__name__)
def test_every_knob_value_of_the_short_chain_cases_compiles(case) -> None:  # type: ignore[no-untyped-def]
    g = case()
    _compile_every_knob_value(g, knob_space(_kernel(g).block, g.tensor_types(), "sm_90"))


def test_loop_invariant_query_fragments_are_loaded_once() -> None:
    """The first matmul's A (the queries, staged before the loop) is loaded by ldmatrix
    once and held in registers (a_path "held"); the loop reads no A fragment from
    shared memory. Where the fragments would not fit beside the score and output
    fragments, each iteration loads them again."""
    g = load_graph(str(ROOT / "examples/mugraphs/gqa_fused.mir"), {"batch": 1})
    op = _kernel(g)
    plan = plan_kernel(op.block, g.tensor_types(), "sm_90", Knobs(chain=1))
    assert {m.output: m.a_path for m in plan.mmas} == {"s": "held", "ev": "frag"}
    cu, _ = emit(lower(planned(g, "sm_90", [Knobs(chain=1), Knobs()]), "sm_90"))
    assert "unsigned mg_ha[1][4][4];" in cu             # 4 K steps of one 16-row tile
    assert cu.count("mg_ldsm_x4(mg_ha[0][") == 4        # before the loop, once each
    assert "mg_ldsm_x4(ra0_0" not in cu                 # none inside it
    a = analyse(decompose(op.block))
    ch = chain_form(a)
    assert isinstance(ch, Chain)
    lay = layout(ch, 4, 1)
    assert isinstance(lay, ChainLayout) and holds_a(a, ch, lay)
    wide = ChainLayout(groups=1, kwarps=1, tiles_per_warp=2, score_tiles=8, out_tiles=8)
    assert frag_regs(ch, wide) + held_a_regs(a, ch, wide) > FRAG_REGS_MAX
    assert not holds_a(a, ch, wide)


def test_column_split_warps_write_and_add_their_fragments_in_pairs() -> None:
    """After the loop each column-split warp writes (the first) or adds (the others, in
    order after a barrier) its accumulator fragments to the f32 tile two neighbouring
    columns at a time, one 8-byte access each, never element by element."""
    g = attention_chain()
    ch = chain_form(analyse(decompose(_kernel(g).block)))
    assert isinstance(ch, Chain)
    acc = ch.acc.outputs[0].name
    cu, _ = emit(lower(planned(g, "sm_90", [Knobs(chain=1, kwarps=2, threads=128)]), "sm_90"))
    writes = cu.count(f"*reinterpret_cast<float2*>(&buf_{acc}[")
    adds = cu.count(f"{{ float2* mg_p = reinterpret_cast<float2*>(&buf_{acc}[")
    assert writes > 0 and adds == writes  # level 1 adds what level 0 wrote
    assert f"buf_{acc}[" not in "".join(line for line in cu.splitlines()
                                        if "acc_" + acc + "[" in line and "float2" not in line)


def _plans(g: Graph) -> list:  # type: ignore[type-arg]
    return [op.plan for op in g.ops if op.block is not None]


def _qknorm(tmp_path: Path, text: str = QKNORM_ONE_KERNEL) -> Graph:
    src = tmp_path / "qk.mir"
    src.write_text(text)
    return load_graph(str(src))


def test_key_norms_come_from_the_b_fragments_with_few_warp_groups(tmp_path: Path) -> None:
    # The key norms (mean of K * K over the head dimension, one per column of the
    # first matmul's B operand) are folded from the B fragments each warp loads: its
    # 4 elements of column lane/4 per n8 tile and K step, 2 shuffles per column, the
    # reciprocal of sqrt gathered to the lanes holding each score column. Nothing of
    # it in shared memory, no barrier in the iteration besides the ring's.
    g = _qknorm(tmp_path)
    a = analyse(decompose(g.ops[0].block))
    ch = chain_of(a)
    assert isinstance(ch, Chain) and ch.cols is not None
    assert [op.outputs[0].name for op in ch.cols.reduces] == ["b6"] and ch.cols.read == ("b7",)
    (plan,) = _plans(planned(g, "sm_90", [Knobs(threads=128, kwarps=2)]))
    homes = {t.name: t.home for t in plan.tiles}
    assert (homes["b6"], homes["b7"]) == ("frag", "frag")
    assert ("b6", "quad") in {(r.output, r.strategy) for r in plan.reductions}
    cu, _ = emit(lower(planned(g, "sm_90", [Knobs(threads=128, kwarps=2)])))
    loop = cu.split("for (int it = 0;")[1].split("\n  __syncthreads();")[0]
    assert loop.count("__syncthreads();") == 1 and "buf_b6" not in cu and "buf_b7" not in cu
    assert "mg_unpack_f16(rb0_0," in loop and "mg_cs_b6[j] = mg_warp_sum(mg_cs_b6[j], 4);" in loop
    assert "mg_cg_b7_3_1 = __shfl_sync(0xffffffffu, mg_cv_b7_3, (2 * mg_t + 1) * 4);" in loop
    assert "(v16 * mg_cg_b7_0_0)" in loop or "* mg_cg_b7_0_0)" in loop
    assert compile_cuda(cu, "k.cu", "sm_90").cubin
    # Eight warp groups would each fold the same columns again: all warps compute them
    # once into shared memory instead (colstats.FRAGMENT_STATS_GROUPS).
    (plan,) = _plans(planned(g, "sm_90", [Knobs(threads=256, kwarps=1)]))
    assert {t.name: t.home for t in plan.tiles}["b6"] == "smem"


def test_a_side_tensor_that_is_not_per_column_keeps_the_shared_memory_form(
        tmp_path: Path) -> None:
    # The key norms times the queries: a tensor of the score's shape, which no warp's B
    # fragments give.
    g = _qknorm(tmp_path, QKNORM_ONE_KERNEL.replace("b7 = sqrt(b6);", "b7 = mul(b6, b0);"))
    ch = chain_of(analyse(decompose(g.ops[0].block)))
    assert isinstance(ch, Chain) and ch.cols is None
    (plan,) = _plans(planned(g, "sm_90", [Knobs(threads=128, kwarps=2)]))
    homes = {t.name: t.home for t in plan.tiles}
    assert "frag" not in (homes["b6"], homes["b7"])


def loop_query_chain() -> str:
    """A chain whose first matmul's A operand is computed in every iteration (queries
    loaded with the keys' fmap and normalised), without key norms."""
    text = (QKNORM_ONE_KERNEL
            .replace("input Q: f16[2 * batch, rows, d];", "input Q: f16[2 * batch, rows, 8 * d];")
            .replace("b0 = load Q imap(x=1);", "b0 = load Q imap(x=1) fmap(2);")
            .replace("b8 = div(b5, b7);", "b8 = mul_scalar(b5, scalar=1.0);"))
    for line in ("    b4 = mul(b1, b1);\n", "    b6 = mean(b4, dim=1, keepdim=true);\n",
                 "    b7 = sqrt(b6);\n"):
        text = text.replace(line, "")
    return text


def test_a_first_operand_computed_in_the_loop_is_written_before_the_first_matmul(
        tmp_path: Path) -> None:
    # The first matmul reads the tile the loop's side passes write, so their barrier
    # stays before it (elsewhere it waits after the first matmul, which then overlaps
    # them).
    g = _qknorm(tmp_path, loop_query_chain())
    cu, _ = emit(lower(planned(g, "sm_90", [Knobs(chain=1)])))
    loop = cu.split("for (int it = 0;")[1]
    first_mma = loop.index("mg_mma_f16(mg_s[")
    last_write = loop.rindex("mg_st(sm_b3_0 + (", 0, first_mma)
    assert "__syncthreads();" in loop[last_write:first_mma]


def online_qknorm_chain() -> str:
    """The qknorm chain with a running maximum subtracted before exp (the online form)."""
    return QKNORM_ONE_KERNEL.replace("    b10 = exp(b9);", "    bm = acc_max_ld(b9);\n"
                                     "    bd = sub(b9, bm);\n    b10 = exp(bd);")


def test_a_running_maximum_chain_reads_key_norms_from_its_fragments(tmp_path: Path) -> None:
    # The values the running maximum is taken of already divide by the key norms: the
    # links before the maximum (Online.early) read the gathered registers too.
    g = _qknorm(tmp_path, online_qknorm_chain())
    ch = chain_of(analyse(decompose(g.ops[0].block)))
    assert ch is not None and ch.online is not None and ch.cols is not None
    cu, _ = emit(lower(planned(g, "sm_90", [Knobs(threads=128, kwarps=2)])))
    loop = cu.split("for (int it = 0;")[1].split("\n  __syncthreads();")[0]
    assert "buf_b7" not in cu and loop.count("* mg_cg_b7_") == 16
    assert compile_cuda(cu, "k.cu", "sm_90").cubin
