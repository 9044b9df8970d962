"""Bulk tensor copies (codegen/tmaplan.py): which tiles the planner gives them, the
swizzled shared-memory layout that ldmatrix reads, the kernel and launcher text, and
(under ``gpu``) results against the float64 reference, also across back-to-back calls
whose copies start before the previous call has finished."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mirage_cli.codegen import tmaplan
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.expr import swizzled_address
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.nvrtc import compile_cuda
from mirage_cli.codegen.plan import swizzled
from mirage_cli.codegen.planner import knob_space, plan_kernel
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import DType, Graph, KernelOp, TensorType
from mirage_cli.kplan import Knobs
from mirage_cli.loading import load_graph

ROOT = Path(__file__).resolve().parent.parent


def _fused(stem: str, batch: int) -> Graph:
    return load_graph(str(ROOT / "examples" / "mugraphs" / f"{stem}.mir"), {"batch": batch})


def _eval(expr: str, **env: int) -> int:
    """A C integer expression of expr.swizzled_address, evaluated (non-negative operands)."""
    py = expr.replace("reinterpret_cast<const unsigned char*>(sm)", "0").replace("/", "//")
    return int(eval(py, {}, env))


@pytest.mark.parametrize("cols,swizzle", [(64, 128), (96, 64), (16, 32), (128, 128)])
def test_swizzled_address_is_the_hardware_pattern_and_conflict_free(cols: int,
                                                                     swizzle: int) -> None:
    t = TensorType((32, cols), DType.F16)
    assert tmaplan.swizzle_of(t) == swizzle
    expr = swizzled_address("sm", ["r", "c"], t, swizzle)
    mask = swizzle // 16 - 1
    for r in range(32):
        for c in range(0, cols, 8):
            box, inner = divmod(c * 2, swizzle)
            chunk = (inner // 16) ^ ((r * swizzle >> 7) & mask)
            want = box * 32 * swizzle + r * swizzle + chunk * 16
            assert _eval(expr, r=r, c=c) == want
    # ldmatrix reads 8 consecutive rows at one column: 8 distinct 16-byte bank groups.
    for r0 in range(0, 32, 8):
        for c in range(0, cols, 8):
            groups = {(_eval(expr, r=r0 + i, c=c) // 16) % 8 for i in range(8)}
            assert len(groups) == 8


@pytest.mark.parametrize("cols,span", [(56, 112), (24, 48), (72, 144), (8, 0), (264, 0)])
def test_rows_of_an_odd_number_of_chunks_are_one_unswizzled_box(cols: int, span: int) -> None:
    # 112, 48 and 144 bytes: 7, 3 and 9 chunks; 16 bytes: too narrow; 264 columns: wider
    # than a box.
    t = TensorType((32, cols), DType.F16)
    assert tmaplan.swizzle_of(t) == span
    if not span:
        return
    assert not swizzled(span) and tmaplan.boxes(t, span) == 1
    expr = swizzled_address("sm", ["r", "c"], t, span)
    for r in range(32):
        for c in range(0, cols, 8):
            assert _eval(expr, r=r, c=c) == r * cols * 2 + c * 2  # plain rows
    for c in range(0, cols, 8):  # and ldmatrix's 8 rows in 8 distinct bank groups
        assert len({(_eval(expr, r=i, c=c) // 16) % 8 for i in range(8)}) == 8


def test_a_weight_tile_of_112_byte_rows_comes_by_unswizzled_boxes() -> None:
    from codegen_cases import unswizzled_weight_boxes

    g = unswizzled_weight_boxes()
    (op,) = [o for o in g.ops if o.block is not None]
    assert op.block is not None
    plan = plan_kernel(op.block, g.tensor_types(), "sm_90", Knobs())
    assert plan.knobs.tma == 1
    tiles = {bi.source: plan.tile(bi.value.name) for bi in op.block.inputs}
    assert (tiles["W"].swizzle, tiles["W"].pitch) == (112, 56)
    assert "1 box(es) of 64 rows x 112 B, unswizzled" in tiles["W"].owner
    assert tiles["X"].swizzle == 128
    prog = lower(g)
    (k,) = prog.kernels
    spec = {p.arg: p.tmap for p in k.params if p.tmap is not None}["W"]
    assert spec.box == (56, 64) and spec.swizzle_enum == "CU_TENSOR_MAP_SWIZZLE_NONE"
    cu, _ = emit(prog)
    assert "CU_TENSOR_MAP_SWIZZLE_NONE" in cu[cu.index("#ifndef __CUDACC_RTC__"):]
    res = compile_cuda(cu, "g.cu", "sm_90")
    assert all(r.spill_stores == 0 and r.stack == 0 for r in res.resources)


def test_streaming_matmuls_copy_their_mma_operands_by_tma() -> None:
    g = _fused("gated_mlp_fused", 8)
    (op,) = [o for o in g.ops if o.block is not None]
    plan = plan_kernel(op.block, g.tensor_types(), "sm_90", Knobs())
    assert plan.knobs.tma == 1
    sw = {bi.source: plan.tile(bi.value.name).swizzle for bi in op.block.inputs}
    assert sw["W1"] and sw["W2"]
    # rmsnorm_linear: X is also read by the row sums, so it stays on cp.async.
    g = _fused("rmsnorm_linear_fused", 8)
    (op,) = [o for o in g.ops if o.block is not None]
    plan = plan_kernel(op.block, g.tensor_types(), "sm_90", Knobs())
    homes = {bi.source: plan.tile(bi.value.name).swizzle for bi in op.block.inputs}
    assert homes == {"X": 0, "W": 64}


def test_small_loops_keep_cp_async_but_may_pin_tma() -> None:
    g = _fused("lora_fused", 8)
    (op,) = [o for o in g.ops if o.block is not None]
    types = g.tensor_types()
    assert plan_kernel(op.block, types, "sm_90", Knobs()).knobs.tma == 0
    assert knob_space(op.block, types, "sm_90")["tma"] == [0, 1]
    pinned = plan_kernel(op.block, types, "sm_90", Knobs(tma=1))
    assert any(t.swizzle for t in pinned.tiles)


MQA_CHAIN_B8 = """program mqa_decode(batch = 8, heads = 32, d = 128, seq = 4096) {
  input Q: f16[batch, heads, d];
  input K: f16[batch, d, seq];
  input V: f16[batch, seq, d];
  (O0, O1, O2, O3) = custom(grid=(8, 16, 1), threads=128, forloop=8) {
    b0 = load Q imap(x=0);
    b1 = load K imap(x=0, y=2) fmap(2);
    b2 = load V imap(x=0, y=1) fmap(1);
    b3 = matmul(b0, b1);
    b4 = mul_scalar(b3, scalar=0.08838834764831845);
    b5 = acc_max_ld(b4);
    b6 = sub(b4, b5);
    b7 = exp(b6);
    b8 = acc_sum_ld(b7);
    b9 = matmul(b7, b2);
    b10 = acc_sum(b9);
    b11 = mul_scalar(b0, scalar=0.0);
    b12 = add(b5, b11);
    store b5 -> O0: f32 omap(x=0, y=2);
    store b8 -> O1: f32 omap(x=0, y=2);
    store b10 -> O2: f32 omap(x=0, y=2);
    store b12 -> O3: f32 omap(x=0, y=2);
  }
  output O0;
  output O1;
  output O2;
  output O3;
}
"""


def _one_kernel(tmp_path: Path, text: str) -> tuple[Graph, KernelOp, dict[str, TensorType]]:
    """A program of one custom kernel: the graph, the kernel and the tensor types."""
    src = tmp_path / "one.mir"
    src.write_text(text)
    g = load_graph(str(src))
    (op,) = g.ops
    assert op.block is not None
    return g, op, g.tensor_types()


def test_a_chain_on_mma_sync_takes_bulk_copies_of_its_b_tiles(tmp_path: Path) -> None:
    # mqa_decode's rescaled split at batch 8 (what `mirage opt` ships): its chain's K
    # and V tiles, its only loop inputs, read only by ldmatrix, come by bulk copies into
    # swizzled boxes by default; cp.async stays a tuning value.
    g, op, types = _one_kernel(tmp_path, MQA_CHAIN_B8)
    assert knob_space(op.block, types, "sm_90")["tma"] == [0, 1]
    plan = plan_kernel(op.block, types, "sm_90", Knobs())
    assert plan.knobs.tma == 1
    assert plan_kernel(op.block, types, "sm_90", Knobs(tma=0)).knobs.tma == 0
    assert plan.knobs.chain == 1 and plan.knobs.wgmma == 0
    sw = {bi.source: plan.tile(bi.value.name).swizzle for bi in op.block.inputs}
    assert sw == {"Q": 0, "K": 64, "V": 128}
    pinned = dataclasses.replace(g, ops=(dataclasses.replace(op, plan=plan),))
    cu, _ = emit(lower(pinned))
    assert "mg_tma2(" in cu or "mg_tma3(" in cu
    res = compile_cuda(cu, "mqa8.cu", "sm_90")
    assert all(r.spill_stores == 0 and r.stack == 0 for r in res.resources)


def test_a_chain_whose_keys_are_also_read_element_wise_keeps_cp_async(
        tmp_path: Path) -> None:
    # qknorm_gqa's chain at batch 1 on mma.sync: its key tiles also feed the key norms,
    # read element by element, so only the value tiles could come by bulk copies; with
    # part of the stream on cp.async the default stays cp.async (pinned, it plans).
    from test_chain import QKNORM_ONE_KERNEL

    _, op, types = _one_kernel(tmp_path, QKNORM_ONE_KERNEL)
    assert plan_kernel(op.block, types, "sm_90", Knobs(wgmma=0)).knobs.tma == 0
    plan = plan_kernel(op.block, types, "sm_90", Knobs(wgmma=0, tma=1))
    bulk = {bi.source for bi in op.block.inputs if plan.tile(bi.value.name).swizzle}
    assert bulk == {"V"}


def test_tma_is_sm_90_only() -> None:
    g = _fused("gated_mlp_fused", 8)
    (op,) = [o for o in g.ops if o.block is not None]
    types = g.tensor_types()
    assert knob_space(op.block, types, "sm_80")["tma"] == [0]
    plan = plan_kernel(op.block, types, "sm_80", Knobs())
    assert not any(t.swizzle for t in plan.tiles)
    with pytest.raises(MirageError, match="plan knob tma=1 is not legal"):
        plan_kernel(op.block, types, "sm_80", Knobs(tma=1))


def test_tma_kernel_text_and_compile() -> None:
    g = _fused("gated_mlp_fused", 8)
    prog = lower(g)
    cu, _ = emit(prog)
    (k,) = prog.kernels
    maps = [p for p in k.params if p.tmap is not None]
    assert {p.arg for p in maps} >= {"W1", "W2"}
    assert all(p.ctype == "const __grid_constant__ mg_tmap" for p in maps)
    assert "mg_tma2(" in cu and "mg_mbar_wait(" in cu
    host = cu[cu.index("#ifndef __CUDACC_RTC__"):]
    assert host.count("mg_encode_tmap_") == 1 + len(maps)  # the helper and each map
    assert "bulk tensor copies): compile with -arch=sm_90" in cu
    res = compile_cuda(cu, "g.cu", "sm_90")
    assert all(r.spill_stores == 0 and r.stack == 0 for r in res.resources)
    # The weights' boxes are copied before the wait, the activations' after it.
    body = re.search(r'extern "C" __global__[^{]*\{\n(.*?)\n\}\n', cu, re.DOTALL)
    assert body is not None
    pre = body.group(1)[:body.group(1).index("mg_grid_wait();")]
    names = {p.name: p.arg for p in k.params}
    assert {names[n] for n in re.findall(r"&(p\d+)", pre)} == {"W1", "W2"}


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: the launcher's host build needs it")
def test_tma_launcher_builds_with_nvcc(tmp_path: Path) -> None:
    cu, _ = emit(lower(_fused("gated_mlp_fused", 8)))
    src = tmp_path / "g.cu"
    src.write_text(cu)
    assert NVCC is not None
    r = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-O0", "-Xptxas", "-O1", "-c",
                        str(src), "-o", str(tmp_path / "g.o")],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]


# The same function as rmsnorm_linear_fused at hidden = n = 6144, on 16 blocks: a call
# that keeps 116 SMs free for the next call's blocks for hundreds of microseconds.
SLOW = """program slow_rmsnorm_linear(hidden = 6144) {
  input X: f16[16, hidden];
  input W: f16[hidden, hidden] weight;
  Z = custom(grid=(8, 1, 1), threads=128, forloop=192) {
    x = load X fmap(1);
    w = load W imap(x=1) fmap(0);
    r = acc_rms_ld(x);
    m = matmul(x, w);
    s = acc_sum(m);
    o = div(s, r);
    store o -> Z omap(x=1);
  }
  output Z;
}
"""


@pytest.mark.gpu
def test_back_to_back_calls_read_the_previous_output_after_it_is_written() -> None:
    """A slow call on a few SMs writes Z1; the next call, whose blocks start on the free
    SMs as soon as the first call's blocks have waited, reads Z1 as its activation
    while copying its weight early. Its result must be f(f(X)): Z1 and Z2 are poisoned
    before every pair of calls, so a read of Z1 before the first call ends shows as NaN.
    (Declaring X early too, a mutant of lower.early_inputs, fails this test.)"""
    from mirage_cli import interp
    from mirage_cli.codegen.bench import build, compare
    from mirage_cli.codegen.runner import (
        Buffers,
        Device,
        from_device_bytes,
        gpu_available,
        out_key,
    )
    from mirage_cli.dtypes import round_to
    from mirage_cli.parser import parse_text

    if not gpu_available():
        pytest.skip("no CUDA GPU")
    slow = parse_text(SLOW, "slow.mir")
    fast = load_graph(str(ROOT / "examples" / "mugraphs" / "rmsnorm_linear_fused.mir"),
                      {"batch": 8, "hidden": 6144})
    dev = Device(0)
    first, second = build(dev, slow), build(dev, fast)
    assert any(p.tmap for k in second.prog.kernels for p in k.params)
    zt = TensorType((16, 6144), DType.F16)
    rng = np.random.default_rng(3)
    x0 = round_to(DType.F16, rng.standard_normal((16, 6144)))
    w = round_to(DType.F16, rng.standard_normal((6144, 6144)) / 64)
    z1 = interp.run(fast, {"X": x0, "W": w}, "float64")["Z"]
    want = interp.run(fast, {"X": round_to(DType.F16, z1), "W": w}, "float64")["Z"]
    a = first.alloc()
    z2 = dev.alloc(zt.nbytes)
    ws = dev.alloc(max(16, second.prog.workspace_bytes))
    b = Buffers({"X": a.ptrs[out_key("Z")], "W": a.ptrs["W"], out_key("Z"): z2}, ws)
    try:
        first.upload_inputs(a, {"X": x0, "W": w})
        for _ in range(3):
            dev.poison(a.ptrs[out_key("Z")], zt)
            dev.poison(z2, zt)
            first.enqueue(a)
            second.enqueue(b)
            dev.sync()
            got = from_device_bytes(zt, dev.download(z2, zt.nbytes))
            chk = compare({"Z": got}, {"Z": want}, ["Z"])
            assert chk.ok, chk.reason
    finally:
        dev.free(z2)
        dev.free(ws)
        first.free(a)


@pytest.mark.parametrize("fact, span, slowdown", [
    ("narrow", 32, "narrow_box_slowdown"),   # the Llama layer's projections, perf-log v39
    ("plain", 112, "plain_box_slowdown"),    # the Qwen layer's projections, perf-log v42
])
def test_narrow_and_unswizzled_boxes_are_priced_slower(
        monkeypatch: pytest.MonkeyPatch, fact: str, span: int, slowdown: str) -> None:
    """The profile's box slowdowns: a plan with a box of 32-byte rows, or an
    unswizzled box (112-byte rows), streams its loop inputs that much slower than in
    the 64-byte swizzled boxes of the same bytes."""
    from mirage_cli.search import cost

    g = _fused("gated_mlp_fused", 8)
    (op,) = [o for o in g.ops if o.block is not None]
    assert op.block is not None
    types, p = g.tensor_types(), cost.profile()
    plan = plan_kernel(op.block, types, "sm_90", Knobs())
    facts = cost._facts(op.block, plan)
    assert facts.bulk and not facts.narrow and not facts.plain  # 64-byte boxes
    other = dataclasses.replace(plan, tiles=tuple(
        dataclasses.replace(t, swizzle=span) if t.swizzle else t for t in plan.tiles))
    other_facts = cost._facts(op.block, other)
    assert getattr(other_facts, fact)
    assert not getattr(other_facts, "plain" if fact == "narrow" else "narrow")
    assert getattr(p, slowdown) and getattr(p, slowdown) > 1
    wide = cost._kernel_cost(op, types, p)
    monkeypatch.setattr(cost, "_plan_facts",
                        lambda *a, **k: dataclasses.replace(facts, **{fact: True}))
    slow = cost._kernel_cost(op, types, p)
    assert slow.stream_us > wide.stream_us
    assert slow.dram_us == wide.dram_us and slow.l2_us == wide.l2_us  # same bytes
