"""Matmul chains as warpgroup wgmma (sm_90a, ``chainplan.wgmma_reason``): when the
planner chooses it, which pins it refuses and why, the code it emits beside the
m16n8 path, and (under ``gpu``) results against the float64 reference for each
shape of the path: one and two 64-column boxes, f16 and bf16, two matrices per block,
a running maximum."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mirage_cli.codegen import chainplan
from mirage_cli.codegen.blockfacts import analyse, decompose
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.nvrtc import compile_cuda, machine_arch
from mirage_cli.codegen.planner import knob_space, plan_kernel
from mirage_cli.commands.plan import planned
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.kplan import Knobs
from mirage_cli.loading import load_graph


def chain_mir(dtype: str = "f16", d: int = 64, keys: int = 64, heads_per_block: int = 1,
              online: bool = False, rows: int = 128) -> str:
    """An attention chain kernel: ``keys`` keys per forloop iteration, head dimension
    ``d``, ``heads_per_block`` matrices in each block's tiles, 4 heads, 512 keys."""
    exp = ("    bm = acc_max_ld(b4);\n    bd = sub(b4, bm);\n    b5 = exp(bd);\n" if online
           else "    b5 = exp(b4);\n")
    threads = min(512, 32 * heads_per_block * rows // 16)
    return (f"program wg(heads = 4, rows = {rows}, d = {d}, seq = 512) {{\n"
            f"  input Q: {dtype}[heads, rows, d];\n"
            f"  input K: {dtype}[heads, d, seq];\n"
            f"  input V: {dtype}[heads, seq, d];\n"
            f"  O = custom(grid=({4 // heads_per_block}, 1, 1), threads={threads}, "
            f"forloop={512 // keys}) {{\n"
            "    b0 = load Q imap(x=0);\n"
            "    b1 = load K imap(x=0) fmap(2);\n"
            "    b2 = load V imap(x=0) fmap(1);\n"
            "    b3 = matmul(b0, b1);\n"
            "    b4 = mul_scalar(b3, scalar=0.125);\n"
            f"{exp}"
            "    b6 = acc_sum_ld(b5);\n"
            "    b7 = matmul(b5, b2);\n"
            "    b8 = acc_sum(b7);\n"
            "    b9 = div(b8, b6);\n"
            "    store b9 -> O omap(x=0);\n"
            "  }\n"
            "  output O;\n"
            "}\n")


def _graph(tmp_path: Path, text: str) -> Graph:
    src = tmp_path / "wg.mir"
    src.write_text(text)
    return load_graph(str(src))


def _plan(g: Graph, pins: Knobs | None = None):  # type: ignore[no-untyped-def]
    op = g.ops[0]
    assert op.block is not None
    return plan_kernel(op.block, g.tensor_types(), "sm_90", pins)


def test_a_chain_of_whole_warpgroups_runs_as_wgmma_by_default(tmp_path: Path) -> None:
    plan = _plan(_graph(tmp_path, chain_mir()))
    assert plan.knobs.wgmma == 1 and plan.knobs.tma == 1 and plan.knobs.kwarps == 1
    assert [m.b_path for m in plan.mmas] == ["wgmma", "wgmma"]
    tiles = {t.name: t for t in plan.tiles}
    assert tiles["b1"].swizzle == 128 and tiles["b2"].swizzle == 128
    assert tiles["b0"].swizzle == 0  # the queries: loaded once, read by ldmatrix


@pytest.mark.parametrize("text,why", [
    (chain_mir(keys=32), "multiples of 64"),
    (chain_mir(rows=32), "whole warpgroups"),
], ids=["32-key-score", "32-rows"])
def test_chains_outside_the_warpgroup_shapes_keep_mma_sync(tmp_path: Path, text: str,
                                                          why: str) -> None:
    g = _graph(tmp_path, text)
    op = g.ops[0]
    assert op.block is not None
    assert knob_space(op.block, g.tensor_types(), "sm_90")["wgmma"] == [0]
    plan = _plan(g)
    assert plan.knobs.chain == 1 and plan.knobs.wgmma == 0
    assert {m.b_path for m in plan.mmas} == {"ldmatrix.trans"}
    a = analyse(decompose(dataclasses.replace(op.block, threads=plan.threads)))
    ch = chainplan.chain_of(a)
    assert ch is not None
    lay = chainplan.layout(ch, plan.threads // 32, 1)
    assert isinstance(lay, chainplan.ChainLayout)
    reason = chainplan.wgmma_reason(ch, lay)
    assert reason is not None and why in reason


def test_other_pins_that_exclude_wgmma_leave_it_off(tmp_path: Path) -> None:
    g = _graph(tmp_path, chain_mir())
    assert _plan(g, Knobs(tma=0)).knobs.wgmma == 0
    assert _plan(g, Knobs(kwarps=2)).knobs.wgmma == 0
    assert _plan(g, Knobs(chain=0)).knobs.wgmma == 0
    assert _plan(g, Knobs(wgmma=0)).knobs.tma == 1  # its K and V tiles: bulk copies


def test_a_pinned_wgmma_that_cannot_be_is_refused(tmp_path: Path) -> None:
    g = _graph(tmp_path, chain_mir())
    with pytest.raises(MirageError, match="needs tma=1"):
        _plan(g, Knobs(wgmma=1, tma=0))
    with pytest.raises(MirageError, match="kwarps=2"):
        _plan(g, Knobs(wgmma=1, kwarps=2))


def test_the_cli_refuses_an_illegal_wgmma_pin_with_exit_2(tmp_path: Path) -> None:
    src = tmp_path / "wg.mir"
    src.write_text(chain_mir(keys=32))
    r = subprocess.run([sys.executable, "-m", "mirage_cli", "plan", str(src), "--pin",
                        "wgmma=1"], check=False, capture_output=True, text=True)
    assert r.returncode == 2
    assert "plan knob wgmma=1 is not legal for this kernel (legal values: 0)" in r.stderr


@pytest.mark.parametrize("kw", [
    {}, {"dtype": "bf16"}, {"d": 128}, {"keys": 128}, {"heads_per_block": 2},
    {"online": True},
], ids=["f16", "bf16", "two-output-boxes", "two-score-boxes", "two-matrices", "online"])
def test_the_wgmma_path_is_emitted_beside_mma_sync_and_compiles_for_both(
        tmp_path: Path, kw: dict) -> None:  # type: ignore[type-arg]
    text = chain_mir(**kw)
    g = planned(_graph(tmp_path, text), "sm_90", [Knobs(wgmma=1, threads=256)
                                                  if kw.get("online") else Knobs()])
    plan = g.ops[0].plan
    assert plan is not None and plan.knobs.wgmma == 1
    cu, _ = emit(lower(g))
    loop = cu.split("for (int it = 0;")[1]
    d, keys = kw.get("d", 64), kw.get("keys", 64)
    fn = "mg_wgmma_bf16(" if kw.get("dtype") == "bf16" else "mg_wgmma_f16("
    # Per iteration: (d / 16) K steps x (keys / 64) boxes, then (keys / 16) x (d / 64).
    assert loop.count(fn) == (d // 16) * (keys // 64) + (keys // 16) * (d // 64)
    assert loop.count("#if defined(__CUDA_ARCH_FEAT_SM90_ALL)") == 2
    assert "mg_ldsm_x4_t(" in loop  # the m16n8 path of other targets
    for exact in (False, True):  # sm_90a (wgmma), then plain sm_90 (mma.sync)
        log = compile_cuda(cu, "wg.cu", "sm_90", exact=exact).log
        spills = re.findall(r"(\d+) bytes spill stores", log)
        assert spills and all(s == "0" for s in spills), log


def _qknorm(tmp_path: Path, dtype: str = "f16") -> Graph:
    """qknorm's chain kernel as shipped at batch 8 (test_plan), its key norms computed
    by all warps from the K tile in shared memory (8 warp groups: not from fragments)."""
    from test_plan import qknorm_chain_as_shipped

    return _graph(tmp_path, qknorm_chain_as_shipped().replace("f16[", f"{dtype}["))


def test_key_norms_read_the_swizzled_key_tile_of_a_wgmma_chain(tmp_path: Path) -> None:
    g = planned(_qknorm(tmp_path), "sm_90", [Knobs(threads=256)])
    plan = g.ops[0].plan
    assert plan is not None and plan.knobs.wgmma == 1
    tiles = {t.name: t for t in plan.tiles}
    k_tile = g.ops[0].block.inputs[1].value.name  # type: ignore[union-attr]
    assert tiles[k_tile].swizzle == 128
    cu, _ = emit(lower(g))
    loop = cu.split("for (int it = 0;")[1]
    # The norms' loads of K go through the swizzle (expr.swizzled_address), none by pitch.
    assert f"sm_{k_tile}[" not in loop
    assert loop.count(f"reinterpret_cast<const unsigned char*>(sm_{k_tile})") > 0
    for exact in (False, True):
        assert compile_cuda(cu, "qk.cu", "sm_90", exact=exact).cubin


def test_sm_90_is_built_for_its_arch_specific_target() -> None:
    # The wgmma paths are compiled only for sm_90a; the cubin runs on the same GPUs.
    assert machine_arch("sm_90") == "sm_90a"
    assert machine_arch("sm_80") == "sm_80"


GPU_CASES = [({}, Knobs()), ({}, Knobs(wgmma=0)), ({"dtype": "bf16"}, Knobs()),
             ({"d": 128}, Knobs()), ({"keys": 128}, Knobs()), ({"heads_per_block": 2}, Knobs()),
             ({"online": True}, Knobs(wgmma=1, threads=256)),
             ({"online": True, "dtype": "bf16"}, Knobs(wgmma=1, threads=256))]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_a_wgmma_chain_with_key_norms_matches_the_float64_reference_on_gpu(
        tmp_path: Path, dtype: str) -> None:
    from mirage_cli.codegen.runner import Device, gpu_available

    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from mirage_cli.codegen.bench import check_graph

    g = planned(_qknorm(tmp_path, dtype), "sm_90", [Knobs(threads=256)])
    assert g.ops[0].plan is not None and g.ops[0].plan.knobs.wgmma == 1
    loaded, chk = check_graph(Device(0), g, seed=17)
    loaded.unload()
    assert chk.ok, chk.reason


@pytest.mark.gpu
@pytest.mark.parametrize("kw,pins", GPU_CASES,
                         ids=["f16", "f16-mma-sync", "bf16", "two-output-boxes",
                              "two-score-boxes", "two-matrices", "online", "online-bf16"])
def test_wgmma_chains_match_the_float64_reference_on_gpu(
        tmp_path: Path, kw: dict, pins: Knobs) -> None:  # type: ignore[type-arg]
    from mirage_cli.codegen.runner import Device, gpu_available

    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from mirage_cli.codegen.bench import check_graph

    g = planned(_graph(tmp_path, chain_mir(**kw)), "sm_90", [pins])
    plan = g.ops[0].plan
    assert plan is not None and plan.knobs.wgmma == (0 if pins.wgmma == 0 else 1)
    loaded, chk = check_graph(Device(0), g, seed=13)
    loaded.unload()
    assert chk.ok, chk.reason


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, {"online": True}], ids=["plain", "online"])
def test_the_mma_sync_path_of_a_wgmma_plan_matches_float64_on_gpu(
        tmp_path: Path, kw: dict) -> None:  # type: ignore[type-arg]
    # What nvcc -arch=sm_90 builds from the same source: the m16n8 path reading the
    # bulk-copied swizzled tiles by ldmatrix.
    from mirage_cli.codegen.runner import Device, gpu_available

    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from mirage_cli.codegen.bench import compare, input_scale, reference_outputs, scaled_inputs

    pins = Knobs(wgmma=1, threads=256) if kw else Knobs()
    g = planned(_graph(tmp_path, chain_mir(**kw)), "sm_90", [pins])
    assert g.ops[0].plan is not None and g.ops[0].plan.knobs.wgmma == 1
    prog = lower(g)
    cu, _ = emit(prog)
    loaded = Device(0).load(prog, compile_cuda(cu, "wg.cu", "sm_90", exact=True).cubin)
    scale = input_scale(g, 19)
    outs = loaded.run(scaled_inputs(g, 19, scale))
    loaded.unload()
    chk = compare(outs, reference_outputs(g, 19, scale), list(g.outputs))
    assert chk.ok, chk.reason
