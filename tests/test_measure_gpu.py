"""Measured selection on a real GPU: `mirage tune --gpu 0` and `mirage opt --gpu 0` on
two small examples. Every variant must compute the right result (a wrong one is a code
generator bug, listed in the failure), the shipped one must be the fastest timed, and
the measured times must be recorded and cached."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from mirage_cli import serialize
from mirage_cli.cli import main
from mirage_cli.codegen.runner import gpu_available

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "explain_data"


@pytest.fixture(autouse=True)
def _gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    monkeypatch.setenv("MIRAGE_CACHE_DIR", str(tmp_path / "cache"))


def _check_measured(path: Path) -> list:  # type: ignore[type-arg]
    cands = serialize.loads_candidates(path.read_text())
    wrong = [(m["measured"]["variant"], m["measured"]["reason"]) for _, m in cands
             if not m["measured"]["ok"]]
    assert not wrong, f"variants computing a wrong result on the GPU: {wrong}"
    times = [m["measured_us"] for _, m in cands]
    assert all(t > 0 for t in times) and times[0] == min(times)
    assert len(cands) >= 4 and len({m["measured"]["design"] for _, m in cands}) >= 1
    return cands


def test_tune_gpu_measures_and_caches(tmp_path: Path) -> None:
    out = tmp_path / "best.ugraph.json"
    argv = ["tune", str(DATA / "lora.cands.ugraph.json"), "--gpu", "0", "-o", str(out)]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    first = _check_measured(out)
    r2 = CliRunner().invoke(main, argv)
    assert r2.exit_code == 0 and f"({len(first)} cached)" in r2.output, r2.output


@pytest.mark.parametrize("name", ["rmsnorm_linear", "gqa"])
def test_opt_gpu_ships_the_fastest_variant(tmp_path: Path, name: str) -> None:
    cu = tmp_path / f"{name}.cu"
    r = CliRunner().invoke(main, ["opt", str(ROOT / "examples" / f"{name}.mir"), "-o",
                                  str(cu), "-D", "batch=8", "--gpu", "0",
                                  "--save-temps", str(tmp_path / "t")])
    assert r.exit_code == 0, r.output
    cands = _check_measured(tmp_path / "t" / f"{name}.measured.ugraph.json")
    best = serialize.loads((tmp_path / "t" / f"{name}.best.ugraph.json").read_text())
    assert [op.block for op in best.ops] == [op.block for op in cands[0][0].ops]
    assert cu.exists() and "measure: shipped" in r.output


def test_calibrate_measures_plausible_figures(tmp_path: Path) -> None:
    from mirage_cli import profiles

    out = tmp_path / "device.json"
    r = CliRunner().invoke(main, ["calibrate", "--gpu", "0", "--target", "sm_90/h200",
                                  "-o", str(out)])
    assert r.exit_code == 0, r.output
    p = profiles.load(str(out))
    assert p.calibrated and p.num_sms >= 16
    assert 0.3e12 < p.dram_bw < 20e12 and p.l2_bw > p.dram_bw
    assert 0 < p.launch_us < 20 and p.barrier_us is not None and 0 < p.barrier_us < 1
    assert 10e12 < p.peak_flops < 5000e12 and p.fma_flops < p.peak_flops
    assert p.smem_per_block <= p.smem_per_sm


def test_a_kernel_that_faults_does_not_fail_the_variants_after_it() -> None:
    # A fault (here a trap; in the field a misaligned shared-memory address) leaves the
    # context unusable: without a fresh one, every variant timed after the faulting
    # one failed with its error and was reported as computing a wrong result.
    import re

    from mirage_cli.codegen.emit import emit
    from mirage_cli.codegen.lower import lower
    from mirage_cli.codegen.nvrtc import compile_cuda
    from mirage_cli.commands.plan import planned
    from mirage_cli.kplan import Knobs
    from mirage_cli.loading import load_graph
    from mirage_cli.search import measure

    timer = measure.GpuTimer(0)
    g = planned(load_graph(str(ROOT / "examples" / "mugraphs" / "rmsnorm_linear_fused.mir")),
                timer.arch, [])
    prog = lower(g, timer.arch)
    cu, _ = emit(prog)
    trap = re.sub(r"(__global__[^{]*\{)", r'\1 asm volatile("trap;");', cu, count=1)
    assert trap != cu
    good = compile_cuda(cu, "good.cu", timer.arch).cubin
    bad = compile_cuda(trap, "bad.cu", timer.arch).cubin
    v = measure.Variant("d0.t0.k0", 0, g, (), (Knobs(),), 0.0)
    faulted = timer.time(v, bad, g)
    assert not faulted.ok and "faulted" in (faulted.reason or "")
    after = timer.time(v, good, g)
    assert after.ok and after.us is not None and after.us > 0, after
