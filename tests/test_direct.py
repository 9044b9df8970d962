"""Direct kernels (codegen/direct.py), no GPU: which block graphs are computed element by
element from global memory and why others are not, the plan that says so, and the
code's shape (no shared memory, no barrier, each per-row value computed once per
element). The results are checked against the float64 reference under the `gpu`
marker (`codegen_cases.split_combine` in test_plan_gpu.py, every example's combine
kernel in the fused µGraphs there)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from codegen_cases import invariant_max_after_loop, row_total, split_combine

from mirage_cli.builder import GraphBuilder
from mirage_cli.codegen.blockfacts import analyse, decompose
from mirage_cli.codegen.directfacts import direct_reads, direct_reason
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.nvrtc import compile_cuda
from mirage_cli.codegen.planner import knob_space, plan_kernel
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph, KernelOp
from mirage_cli.kplan import Knobs
from mirage_cli.loading import load_graph

ROOT = Path(__file__).resolve().parent.parent


def _customs(g: Graph) -> list[KernelOp]:
    return [op for op in g.ops if op.block is not None]


def _why(op: KernelOp) -> str | None:
    assert op.block is not None
    return direct_reason(analyse(decompose(op.block)))


def _body(cu: str, kernel: int) -> str:
    """The source of the ``kernel``-th kernel."""
    parts = cu.split('extern "C" __global__')
    return parts[kernel + 1].split("#ifndef __CUDACC_RTC__")[0]


def test_a_split_combine_is_computed_element_by_element() -> None:
    g = split_combine()
    (op,) = _customs(g)
    assert op.block is not None
    assert _why(op) is None
    # max over 8 splits, the rescaled total over 8, the rescaled sum down to the width
    # over 8 splits of two inputs.
    assert direct_reads(analyse(decompose(op.block))) == 8 + 16 + 16
    plan = plan_kernel(op.block, g.tensor_types(), "sm_90")
    assert plan.smem_bytes == 0 and plan.threads == 32   # one warp: 32 elements per block
    assert {t.home for t in plan.tiles} == {"global", "inline"}
    assert [r.strategy for r in plan.reductions] == ["thread", "thread"]
    cu, _ = emit(lower(g))
    body = _body(cu, 0)
    assert "__syncthreads" not in body and "extern __shared__" not in body
    assert "cp_async" not in body
    # Per element of each output: the maximum and the total once, as locals.
    assert body.count("const float r") == 2 * 2
    assert body.count("mg_st(p") == 2
    for arch in ("sm_80", "sm_90"):
        res = compile_cuda(cu, "split_combine.cu", arch)
        assert all(r.spill_stores == 0 for r in res.resources)


def test_the_attention_examples_combine_directly() -> None:
    for stem in ("gqa_fused", "qknorm_gqa_fused"):
        g = load_graph(str(ROOT / "examples" / "mugraphs" / f"{stem}.mir"), {"batch": 8})
        first, combine = _customs(g)
        assert _why(combine) is None
        assert "forloop" in (_why(first) or "")
        cu, _ = emit(lower(g))
        assert "__syncthreads" not in _body(cu, 1)


def _combine_of(splits: int, width: int = 16) -> Graph:
    b = GraphBuilder(f"combine_{splits}")
    l_ = b.input("L", (4, splits), "f16")
    o = b.input("O", (4, splits * width), "f16")
    k = b.custom((4, 1, 1), 128, 1)
    lt = k.load(l_, (0, None, None))
    ot = k.load(o, (0, None, None))
    r = k.op("div", k.op("acc_sum_to", ot, width=width), k.op("acc_sum_ld", lt))
    (y,) = k.finish([(r, "Y", (0, None, None))])
    b.output(y)
    return b.build()


def test_what_is_not_direct_is_named() -> None:
    assert _why(_customs(_combine_of(64))[0]) is None
    assert "reduces 128 values per result" in (_why(_customs(_combine_of(128))[0]) or "")
    rms = load_graph(str(ROOT / "examples" / "mugraphs" / "rmsnorm_linear_fused.mir"))
    assert "forloop" in (_why(_customs(rms)[0]) or "")
    # A 4096-long norm per row: the staged form (rows in registers) reads each once.
    ntrans = load_graph(str(ROOT / "examples" / "mugraphs" / "ntrans_fused.mir"))
    assert "at most 64" in (_why(_customs(ntrans)[0]) or "")
    b = GraphBuilder("scale")
    x = b.input("X", (4, 64), "f16")
    k = b.custom((4, 1, 1), 128, 1)
    (y,) = k.finish([(k.op("acc_sum", k.op("exp", k.load(x, (0, None, None)))), "Y",
                      (0, None, None))])
    b.output(y)
    assert "no reduction" in (_why(_customs(b.build())[0]) or "")
    # A reduction along a dimension other than the last reads other rows.
    b = GraphBuilder("cols")
    x = b.input("X", (4, 8, 16), "f16")
    k = b.custom((4, 1, 1), 128, 1)
    xt = k.load(x, (0, None, None))
    (y,) = k.finish([(k.op("acc_sum", k.op("div", xt, k.op("sum", xt, dim=1, keepdim=True))),
                      "Y", (0, None, None))])
    b.output(y)
    assert "leading dimensions" in (_why(_customs(b.build())[0]) or "")


def test_more_threads_than_output_elements_are_not_planned() -> None:
    g = _combine_of(16)   # 16 output elements per block
    (op,) = _customs(g)
    assert op.block is not None
    for t in (32, 128, 512):
        bg = dataclasses.replace(op.block, threads=t)
        assert plan_kernel(bg, g.tensor_types(), "sm_90").threads == 32
    # A pinned count is the user's: kept.
    assert plan_kernel(op.block, g.tensor_types(), "sm_90", Knobs(threads=128)).threads == 128


def test_an_invariant_reduction_read_after_the_loop_has_its_own_pass() -> None:
    # Computed where read after the loop, each of the 32 results of max(V) would be a
    # 64-long serial fold by one thread (mha_decode at batch 1: 81 us against 43).
    g = invariant_max_after_loop()
    (op,) = _customs(g)
    plan = plan_kernel(op.block, g.tensor_types(), "sm_90")
    assert plan.tile("b5").home == "smem"
    assert [(r.output, r.strategy, r.threads_per_row) for r in plan.reductions
            if r.output == "b5"] == [("b5", "rows", 8)]
    compile_cuda(emit(lower(g))[0], "invariant_max.cu", "sm_90")


def test_a_per_row_output_and_f32_partials_are_direct() -> None:
    # The combine's total alone, an [R, 1] output, from f32 partials: the per-row value
    # is the element.
    g = row_total()
    (op,) = _customs(g)
    assert _why(op) is None
    assert plan_kernel(op.block, g.tensor_types(), "sm_90").threads == 32
    cu, _ = emit(lower(g))
    body = _body(cu, 0)
    assert "__syncthreads" not in body and body.count("mg_st(p") == 1
    assert "const float* __restrict__" in body
    compile_cuda(cu, "row_total.cu", "sm_90")


def test_a_direct_kernel_offers_no_vector_stores() -> None:
    # It stores one element per thread: a pinned 16-byte store is refused, not ignored.
    g = _combine_of(16)
    (op,) = _customs(g)
    assert op.block is not None
    assert knob_space(op.block, g.tensor_types(), "sm_90")["vec"] == [1]
    with pytest.raises(MirageError, match="vec"):
        plan_kernel(op.block, g.tensor_types(), "sm_90", Knobs(vec=8))
