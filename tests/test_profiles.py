"""Device profiles (`--target`) and the model reading the kernel plan."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mirage_cli import profiles, serialize
from mirage_cli.cli import main
from mirage_cli.diagnostics import MirageError
from mirage_cli.search import cache, cost

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "explain_data"


@pytest.fixture(autouse=True)
def _default_profile():  # type: ignore[no-untyped-def]
    yield
    cost.use_profile(profiles.DEFAULT_TARGET)


def lora() -> list:  # type: ignore[type-arg]
    return serialize.loads_candidates((DATA / "lora.cands.ugraph.json").read_text())


def test_shipped_profiles_load_and_differ() -> None:
    h100, h200 = profiles.load("sm_90/h100"), profiles.load("h200")
    assert h100.dram_bw == 3.35e12 and h100.peak_flops == 400e12 and h100.num_sms == 132
    assert h200.dram_bw == 4.2e12 and h200.extra["dram_bw_nominal"] == 4.8e12
    assert h200.peak_flops == 790e12 and h200.l2_bytes == 50 << 20
    assert not h100.calibrated and h100.digest != h200.digest
    assert profiles.from_json(h200.as_json(), "x") == h200  # round trip


def test_profile_changes_the_prediction_and_the_cache_key() -> None:
    g = lora()[0][0]
    p = profiles.load("h100")
    cost.use_profile(p)
    slow, k1 = cost.estimate(g).time_us, cache.key(g, {})
    cost.use_profile(dataclasses.replace(p, launch_us=p.launch_us * 2))
    assert cost.estimate(g).time_us > slow and cache.key(g, {}) != k1
    cost.use_profile(dataclasses.replace(p, fit={**p.fit, "const_us": 1.0}))
    assert cost.estimate(g).time_us == pytest.approx(slow + 1.0, abs=1e-6)


@pytest.mark.parametrize(("target", "msg"), [
    ("a100", "unknown target"), ("sm_80/h200", "is for sm_90"),
    ("missing.json", "cannot read")])
def test_bad_target_is_exit_2(target: str, msg: str) -> None:
    r = CliRunner().invoke(main, ["explain", str(DATA / "lora.cands.ugraph.json"),
                                  "--target", target])
    assert r.exit_code == 2 and msg in r.output, r.output


def test_bench_takes_the_target_and_refuses_a_bad_one_before_the_gpu() -> None:
    r = CliRunner().invoke(main, ["bench", "--gpu", "0", "--target", "a100"])
    assert r.exit_code == 2 and "unknown target" in r.output, r.output


def test_a_profile_for_another_gpu_is_named() -> None:
    # The default profile on an H100 (the bench's notice there; opt --gpu's too).
    h200, h100 = profiles.load("sm_90/h200"), profiles.load("sm_90/h100")
    notice = profiles.mismatch(h200, "NVIDIA H100 80GB HBM3")
    assert notice is not None and "--target sm_90/h100" in notice
    assert profiles.mismatch(h200, "NVIDIA H200") is None
    assert profiles.mismatch(h100, "NVIDIA H100 80GB HBM3") is None
    assert "--target sm_90/h200" in (profiles.mismatch(h100, "NVIDIA H200") or "")
    assert profiles.mismatch(h200, "NVIDIA A100-SXM4-80GB") is None  # no profile of its own


def test_bad_profile_file_names_the_field(tmp_path: Path) -> None:
    doc = profiles.load("h200").as_json()
    doc["dram_bw"] = -1
    f = tmp_path / "dev.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(MirageError, match="'dram_bw' is missing or out of range"):
        profiles.load(str(f))
    f.write_text("{bad")
    with pytest.raises(MirageError, match=r"dev.json:1:2: error: invalid JSON"):
        profiles.load(str(f))


@pytest.mark.parametrize("key, value, msg", [
    ("scalar_copy_slowdown", 0.5, "'scalar_copy_slowdown' must be a number >= 1"),
    ("block_stream_bw", 0, "'block_stream_bw' must be a number > 0"),
    ("stage_penalty", -1, "'stage_penalty' must be a number >= 0"),
    ("mma_flops", "fast", "'mma_flops' must be a number > 0"),
    ("mem_util_exp", 1.5, r"'mem_util_exp' must be a number in \[0, 1\]"),
    ("chain_mma_flops", 0, "'chain_mma_flops' must be a number > 0"),
    ("bulk_l2_bw", -1, "'bulk_l2_bw' must be a number > 0"),
    ("bulk_mem_util_exp", 2, r"'bulk_mem_util_exp' must be a number in \[0, 1\]"),
])
def test_bad_optional_figure_names_the_field(tmp_path: Path, key: str, value: object,
                                             msg: str) -> None:
    doc = profiles.load("h200").as_json()
    doc[key] = value
    f = tmp_path / "dev.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(MirageError, match=msg):
        profiles.load(str(f))
    del doc[key]
    f.write_text(json.dumps(doc))
    # Absent, the figure takes its default (stage_penalty 0, the others none).
    assert getattr(profiles.load(str(f)), key) == (0.0 if key == "stage_penalty" else None)


def test_explain_reports_the_profile() -> None:
    r = CliRunner().invoke(main, ["explain", str(DATA / "lora.cands.ugraph.json"),
                                  "--target", "sm_90/h200", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["model"]["profile"] == "h200" and doc["model"]["dram_bw"] == 4.2e12


def test_the_model_reads_the_plan(tmp_path: Path) -> None:
    """Occupancy comes from the plan's threads and shared memory, and a plan that does
    not fit the profile's shared memory is a named constraint violation."""
    g = lora()[0][0]
    ks = cost.kernel_costs(g)
    op = next(op for op in g.ops if op.block is not None)
    k = next(k for k, o in zip(ks, g.ops) if o.block is not None)
    from mirage_cli.codegen.planner import plan_kernel

    plan = plan_kernel(op.block, g.tensor_types(), "sm_90")
    assert k.plan_smem == plan.smem_bytes and k.threads == plan.threads
    p = profiles.load("h100")
    assert k.per_sm == max(1, min(p.max_threads_per_sm // plan.threads,
                                  p.smem_per_sm // max(plan.smem_bytes, 1), 32))
    cost.use_profile(dataclasses.replace(p, smem_per_block=plan.smem_bytes - 1))
    c = cost.estimate(g)
    assert not c.fits and any("plan's shared memory" in v for v in c.violations)
    # explain names the violated constraint (a profile file with that limit).
    f = tmp_path / "small.json"
    f.write_text(json.dumps(dataclasses.replace(p, smem_per_block=plan.smem_bytes - 1)
                            .as_json()))
    r = CliRunner().invoke(main, ["explain", str(DATA / "lora.cands.ugraph.json"),
                                  "--json", "--target", str(f)])
    doc = json.loads(r.stdout)
    k0 = doc["chosen"]["kernels"][0]
    assert doc["chosen"]["fits"] is False and k0["smem_source"] == "plan"
    assert any("exceeds" in t for t in k0["tight"])


def test_bulk_copy_figures_price_only_kernels_that_copy_with_tma() -> None:
    """bulk_l2_bw and bulk_mem_util_exp replace l2_bw and mem_util_exp for a kernel
    whose plan copies its loop inputs with bulk tensor copies, not for one that uses
    cp.async; absent (the shipped profiles), nothing changes."""
    from mirage_cli.commands.plan import planned
    from mirage_cli.kplan import Knobs
    from tests.test_search_models import _streaming_matmul

    g = _streaming_matmul(32, 4096, 4096, 32)  # one kernel, 32 of 132 SMs
    p = profiles.load("h200")
    assert p.bulk_l2_bw is None and p.bulk_mem_util_exp is None
    faster = dataclasses.replace(p, bulk_l2_bw=2 * p.l2_bw, bulk_mem_util_exp=0.0)
    for tma, changes in ((0, False), (1, True)):
        pg = planned(g, "sm_90", [Knobs(tma=tma)])
        base, bulk = cost.kernel_costs(pg, p), cost.kernel_costs(pg, faster)
        if changes:
            assert bulk[0].l2_us == pytest.approx(base[0].l2_us / 2)
            assert bulk[0].stream_us < base[0].stream_us
        else:
            assert bulk == base


def test_a_chain_kernel_is_priced_at_the_chain_rate() -> None:
    """chain_mma_flops prices the tensor-core work of a kernel whose plan keeps a
    matmul chain in registers, and no other kernel's."""
    from mirage_cli.commands.plan import planned
    from mirage_cli.kplan import Knobs
    from mirage_cli.loading import load_graph

    gqa = load_graph(str(ROOT / "examples/mugraphs/gqa_fused.mir"), {"batch": 8})
    gqa = planned(gqa, "sm_90", [Knobs(wgmma=0)])  # mma.sync: the wgmma rate is not used
    streaming = lora()[0][0]
    p = profiles.load("h200")
    assert p.chain_mma_flops == 350e12 and p.mma_flops == 130e12
    chain = cost.kernel_costs(gqa, p)[0]
    assert chain.compute_us == pytest.approx(chain.flops / 350e12 / chain.util * 1e6)
    slower = dataclasses.replace(p, chain_mma_flops=p.chain_mma_flops / 2)
    assert cost.kernel_costs(gqa, slower)[0].compute_us == pytest.approx(2 * chain.compute_us)
    assert cost.kernel_costs(gqa, slower)[1] == cost.kernel_costs(gqa, p)[1]  # the combine
    assert cost.kernel_costs(streaming, slower) == cost.kernel_costs(streaming, p)


def test_a_wgmma_chain_without_side_work_is_priced_at_the_wgmma_rate(tmp_path: Path) -> None:
    """chain_wgmma_flops prices a chain whose plan runs as wgmma and whose loop is the
    chain alone (gqa); qknorm_gqa's chain, whose loop also computes the key norms, keeps
    chain_mma_flops under the same plan knobs (docs/perf-log.md v29)."""
    from test_plan import qknorm_chain_as_shipped

    from mirage_cli.commands.plan import planned
    from mirage_cli.kplan import Knobs
    from mirage_cli.loading import load_graph

    src = tmp_path / "qknorm_chain.mir"
    src.write_text(qknorm_chain_as_shipped())
    p = profiles.load("h200")
    assert p.chain_wgmma_flops == 440e12
    slower = dataclasses.replace(p, chain_wgmma_flops=p.chain_wgmma_flops / 2)
    gqa = load_graph(str(ROOT / "examples/mugraphs/gqa_fused.mir"), {"batch": 8})
    for name, g, rate, threads in (("gqa", gqa, 440e12, 128),
                                   ("qknorm", load_graph(str(src)), 350e12, 256)):
        wg = planned(g, "sm_90", [Knobs(wgmma=1, threads=threads)])
        assert wg.ops[0].plan is not None and wg.ops[0].plan.knobs.wgmma == 1
        chain = cost.kernel_costs(wg, p)[0]
        assert chain.compute_us == pytest.approx(chain.flops / rate * 1e6), name
        halved = cost.kernel_costs(wg, slower)[0].compute_us
        assert halved == pytest.approx(chain.compute_us * (2 if rate == 440e12 else 1)), name
        sync = cost.kernel_costs(planned(g, "sm_90", [Knobs(wgmma=0)]), p)[0]
        assert sync.compute_us == pytest.approx(sync.flops / 350e12 * 1e6), name


def test_a_chain_exposes_the_lesser_term_as_its_pipeline_fill() -> None:
    """A chain's pipeline keeps several iterations' K and V tiles in flight, so its
    fill is the lesser of memory and compute, not one iteration of the bound: the
    forloop barely moves a memory-bound chain's prediction (gqa's chain at batch 1 ran
    5.98 us at 2 iterations and 5.79 at 8 on an H100, docs/perf-log.md v23), and gqa at
    batch 1 ranks its 64-row tiling with 16 key chunks (7.49 us in all) before the
    128-row one with 32 (9.49)."""
    from mirage_cli.loading import load_graph
    from mirage_cli.search.design import design_of, instantiate

    assert cost._fill_s(3.0, 1.0, chain=True) == 1.0
    assert cost._fill_s(3.0, 1.0, chain=False) == 3.0
    g = load_graph(str(ROOT / "examples/gqa.mir"), {"batch": 1})
    # gqa_fused's grid: (groups, key chunks, row chunks).
    design, tuning = design_of(load_graph(str(ROOT / "examples/mugraphs/gqa_fused.mir"),
                                          {"batch": 1}))

    def tuned(grid: tuple[int, int, int], forloop: int) -> object:
        x = instantiate(g, design, ((grid, forloop), tuning[1]))
        assert x is not None
        return x

    rows64, rows128 = tuned((2, 16, 4), 8), tuned((2, 32, 2), 8)
    assert cost.estimate(rows64).time_us < cost.estimate(rows128).time_us
    at8, at2 = cost.kernel_costs(rows64)[0], cost.kernel_costs(tuned((2, 16, 4), 2))[0]
    assert at8.stream_us < at2.stream_us < 1.15 * at8.stream_us


def test_an_operand_gathered_from_an_f32_tile_slows_the_tensor_cores() -> None:
    """A block matmul whose plan reads an operand ``direct`` from a tile computed into
    shared memory as f32 (element by element, with a conversion) has its tensor-core
    term scalar_copy_slowdown times slower, as a K tile off the mma step already had;
    a weight read ``direct`` as staged (16-bit) is not. lora's second matmul reads
    X @ A so; rmsnorm_linear's and gated_mlp's read only staged weights."""
    from mirage_cli.codegen.planner import plan_kernel

    def gathered(name: str) -> list[frozenset[str]]:
        g = serialize.loads_candidates((DATA / f"{name}.cands.ugraph.json").read_text())[0][0]
        types = g.tensor_types()
        return [cost._gathered_mmas(op.block, plan_kernel(op.block, types, "sm_90"))
                for op in g.ops if op.block is not None]

    assert gathered("rmsnorm_linear") == [frozenset()]
    assert gathered("gated_mlp") == [frozenset()]
    g = lora()[0][0]
    (k,) = [i for i, op in enumerate(g.ops) if op.block is not None]
    bg, types = g.ops[k].block, g.tensor_types()
    (second,) = gathered("lora")[0]
    assert [o.outputs[0].name for o in bg.ops if o.op == "matmul"][-1] == second
    extra = cost._custom(bg, types, frozenset({second})).gathered - cost._custom(bg, types).gathered
    assert extra > 0
    p = profiles.load("h200")
    slowed = cost.kernel_costs(g, p)[k]
    plain = cost.kernel_costs(g, dataclasses.replace(p, scalar_copy_slowdown=1))[k]
    assert slowed.compute_us - plain.compute_us == pytest.approx(
        (p.scalar_copy_slowdown - 1) * extra / p.flop_rate * 1e6)
