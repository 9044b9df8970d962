"""Row kernels with their rows in registers (codegen/rowregs.py), no GPU: which block
graphs qualify and why others do not, the plan that says so, and the code's shape (no
shared-memory tiles, 16-byte loads and stores, one barrier per row reduction). The
results are checked against the float64 reference under the `gpu` marker
(the last test here)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mirage_cli.codegen.blockfacts import analyse, decompose, rows_in_registers
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.nvrtc import compile_cuda
from mirage_cli.codegen.planner import plan_kernel
from mirage_cli.codegen.runner import gpu_available
from mirage_cli.ir import Graph
from mirage_cli.kplan import Knobs
from mirage_cli.loading import load_graph
from mirage_cli.search import measure

ROOT = Path(__file__).resolve().parent.parent
NTRANS = ROOT / "examples" / "mugraphs" / "ntrans_fused.mir"


def _custom(g: Graph):  # type: ignore[no-untyped-def]
    (op,) = [op for op in g.ops if op.block is not None]
    return op


def test_ntrans_keeps_its_rows_in_registers() -> None:
    g = load_graph(str(NTRANS))
    op = _custom(g)
    plan = plan_kernel(op.block, g.tensor_types(), "sm_90")
    assert plan.smem_bytes == 0 and all(t.home == "regs" for t in plan.tiles)
    assert {r.strategy for r in plan.reductions} == {"block"} and len(plan.reductions) == 2
    cu, _ = emit(lower(g))
    body = cu[cu.index("__global__"):cu.index("#ifndef __CUDACC_RTC__")]
    assert "extern __shared__" not in body and "cp_async" not in body
    assert body.count("__syncthreads();") == 2          # one per row reduction
    assert body.count("mg_ld8(p") == 3 and body.count("mg_st8(") == 1
    for arch in ("sm_80", "sm_90"):
        res = compile_cuda(cu, "ntrans.cu", arch)
        assert all(r.spill_stores == 0 for r in res.resources)



def test_a_row_plan_resolves_every_knob_and_its_deviations_rank() -> None:
    # The measured selection ranks knob deviations by their distance from the plan's
    # own values: an unresolved knob (tma was None) crashed opt --gpu on ntrans.
    g = load_graph(str(NTRANS))
    op = _custom(g)
    knobs = plan_kernel(op.block, g.tensor_types(), "sm_90").knobs
    assert None not in dataclasses.astuple(knobs)
    sets = measure.knob_sets(g, "sm_90", 100)
    assert len(sets) > 1 and sets[0] == (Knobs(),)

def _why(g: Graph, threads: int | None = None) -> str | None:
    op = _custom(g)
    bg = op.block if threads is None else dataclasses.replace(op.block, threads=threads)
    return rows_in_registers(analyse(decompose(bg)), g.tensor_types(), bg.threads)


def test_what_does_not_qualify_is_named() -> None:
    rms = load_graph(str(ROOT / "examples" / "mugraphs" / "rmsnorm_linear_fused.mir"))
    assert "forloop" in (_why(rms) or "")
    g = load_graph(str(NTRANS))
    assert _why(g, 512) is None
    # 4096-element rows in 16-byte chunks over 384 threads: chunks would straddle rows.
    assert "multiple of 8 x 384 threads" in (_why(g, 384) or "")


RESIDUAL = ROOT / "examples" / "mugraphs" / "residual_rmsnorm_fused.mir"


def test_a_weighted_residual_rmsnorm_keeps_its_rows_in_registers() -> None:
    # The weight is an [L] row every row shares; the norm is an accumulator of one
    # iteration (acc_rms_ld), reduced like rms_norm, kept as its reciprocal.
    g = load_graph(str(RESIDUAL))
    op = _custom(g)
    plan = plan_kernel(op.block, g.tensor_types(), "sm_90")
    assert plan.smem_bytes == 0 and all(t.home == "regs" for t in plan.tiles)
    assert [r.output for r in plan.reductions] == ["n"]
    cu, _ = emit(lower(g))
    body = cu[cu.index("__global__"):cu.index("#ifndef __CUDACC_RTC__")]
    assert "extern __shared__" not in body and body.count("__syncthreads();") == 1
    assert body.count("mg_ld8(p") == 3 and body.count("mg_st8(") == 2
    assert "rsqrtf(" in body and "1e-05f" in body
    # A row accumulator over more than one iteration is not a row reduction.
    two = dataclasses.replace(op.block, forloop=2)
    why = rows_in_registers(analyse(decompose(two)), g.tensor_types(), two.threads)
    assert why is not None


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("batch", [1, 8, 16])
def test_residual_rmsnorm_row_kernel_matches_the_reference_on_gpu(batch: int) -> None:
    from mirage_cli.codegen import bench
    from mirage_cli.codegen.runner import Device

    prog = load_graph(str(ROOT / "examples" / "models" / "llama3_residual_rmsnorm_b16_bf16.mir"),
                      {"batch": batch})
    g = load_graph(str(RESIDUAL), {"batch": batch})
    _, chk = bench.check_graph(Device(0), g, reference=prog, scale=bench.input_scale(prog))
    assert chk.ok, chk.reason


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("batch", [1, 8, 16])
def test_ntrans_row_kernel_matches_the_reference_on_gpu(batch: int) -> None:
    from mirage_cli.codegen import bench
    from mirage_cli.codegen.runner import Device

    prog = load_graph(str(ROOT / "examples" / "ntrans.mir"), {"batch": batch})
    g = load_graph(str(NTRANS), {"batch": batch})
    assert g.tensor_types()["O"].shape == (8 * batch, 4096)
    _, chk = bench.check_graph(Device(0), g, reference=prog, scale=bench.input_scale(prog))
    assert chk.ok, chk.reason
