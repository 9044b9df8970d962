"""On a GPU: every legal value of every plan knob, on every example's fused µGraph and
on the hand-built corner cases, computes the float64 reference's result (outputs
poisoned with NaN first, f16 rel L2 ≤ 1e-2). One knob is set at a time; the others
stay the planner's choice."""

from __future__ import annotations

from pathlib import Path

import pytest
from codegen_cases import CASES
from test_plan import CLUSTER_FORMS

from mirage_cli.codegen.planner import knob_space
from mirage_cli.codegen.runner import gpu_available
from mirage_cli.commands.plan import planned
from mirage_cli.ir import Graph
from mirage_cli.kplan import Knobs
from mirage_cli.loading import load_graph

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
FUSED = sorted((ROOT / "examples" / "mugraphs").glob("*.mir"))


@pytest.fixture(scope="module")
def device():  # type: ignore[no-untyped-def]
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from mirage_cli.codegen.runner import Device
    return Device(0)


def knob_variants(g: Graph) -> list[tuple[str, Graph]]:
    """``g`` with each legal value of each knob pinned (where legal for a kernel)."""
    types = g.tensor_types()
    spaces = [knob_space(op.block, types, "sm_90") for op in g.ops if op.block is not None]
    out = []
    for knob in Knobs.names():
        for value in sorted({v for s in spaces for v in s[knob]}):
            pins = [Knobs(**{knob: value}) if value in s[knob] else Knobs() for s in spaces]
            out.append((f"{knob}={value}", planned(g, "sm_90", pins)))
    return out


def _check_all(device, g: Graph) -> None:  # type: ignore[no-untyped-def]
    from mirage_cli.codegen.bench import check_graph

    failed = []
    for label, vg in knob_variants(g):
        loaded, chk = check_graph(device, vg, seed=11)
        loaded.unload()
        if not chk.ok:
            failed.append(f"{label}: {chk.reason}")
    assert not failed, f"{g.name}: " + "; ".join(failed)


@pytest.mark.parametrize("path", FUSED, ids=lambda p: p.stem)
def test_every_knob_value_on_examples(device, path: Path) -> None:  # type: ignore[no-untyped-def]
    _check_all(device, load_graph(str(path), {"batch": 1}))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_knob_value_on_cases(device, name: str) -> None:  # type: ignore[no-untyped-def]
    g = CASES[name]()
    if any(op.block is not None for op in g.ops):
        _check_all(device, g)


@pytest.mark.parametrize("stem,batch,pins,form", CLUSTER_FORMS,
                         ids=[f"{c[0]}-{c[3]}" for c in CLUSTER_FORMS])
def test_cluster_combine_forms_on_gpu(device, stem: str, batch: int, pins: Knobs,  # type: ignore[no-untyped-def]
                                      form: str) -> None:
    from mirage_cli.codegen.bench import check_graph

    g = load_graph(str(ROOT / "examples" / "mugraphs" / f"{stem}.mir"), {"batch": batch})
    loaded, chk = check_graph(device, planned(g, "sm_90", [pins] * len(g.ops)), seed=5)
    loaded.unload()
    assert chk.ok, f"{stem} ({form}): {chk.reason}"


@pytest.mark.parametrize("pins,dtype,online", [
    (Knobs(chain=1), "f16", False), (Knobs(chain=1, ksplit=2), "f16", False),
    (Knobs(chain=0), "f16", False), (Knobs(chain=1), "bf16", False),
    (Knobs(chain=1), "f16", True)],
    ids=["chain", "chain-ksplit2", "no-chain", "chain-bf16", "chain-online"])
def test_packed_query_chain_on_gpu(device, tmp_path: Path, pins: Knobs, dtype: str,  # type: ignore[no-untyped-def]
                                   online: bool) -> None:
    """The chain whose A operand is a tile computed before the loop (test_chain.py), its
    key norms from the B fragments (2 warp groups); also with a running maximum."""
    from test_chain import QKNORM_ONE_KERNEL, online_qknorm_chain

    from mirage_cli.codegen.bench import check_graph

    src = tmp_path / "qk.mir"
    text = online_qknorm_chain() if online else QKNORM_ONE_KERNEL
    src.write_text(text.replace("f16[", f"{dtype}["))
    loaded, chk = check_graph(device, planned(load_graph(str(src)), "sm_90", [pins]), seed=3)
    loaded.unload()
    assert chk.ok, chk.reason


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_key_norms_through_shared_memory_in_a_chain_on_gpu(  # type: ignore[no-untyped-def]
        device, tmp_path: Path, dtype: str) -> None:
    """qknorm's chain kernel as shipped at batch 8 (128 query rows, 512 threads, 8 warp
    groups): the key norms by 8-lane groups into shared memory, their sqrt written as a
    reciprocal by the reducing lanes, the barrier after the first matmul (test_plan)."""
    from test_plan import qknorm_chain_as_shipped

    from mirage_cli.codegen.bench import check_graph

    src = tmp_path / "qk.mir"
    src.write_text(qknorm_chain_as_shipped().replace("f16[", f"{dtype}["))
    g = planned(load_graph(str(src)), "sm_90", [Knobs(chain=1, threads=512)])
    assert [op.plan.threads for op in g.ops if op.plan is not None] == [512]
    loaded, chk = check_graph(device, g, seed=7)
    loaded.unload()
    assert chk.ok, chk.reason


def test_a_chain_whose_queries_change_every_iteration_on_gpu(  # type: ignore[no-untyped-def]
        device, tmp_path: Path) -> None:
    """The first matmul's A operand computed in the loop: written, then a barrier, then
    read (test_chain.loop_query_chain)."""
    from test_chain import loop_query_chain

    from mirage_cli.codegen.bench import check_graph

    src = tmp_path / "qk.mir"
    src.write_text(loop_query_chain())
    loaded, chk = check_graph(device, planned(load_graph(str(src)), "sm_90", [Knobs(chain=1)]),
                              seed=9)
    loaded.unload()
    assert chk.ok, chk.reason


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_mqa_chain_every_knob_value_on_gpu(  # type: ignore[no-untyped-def]
        device, tmp_path: Path, dtype: str) -> None:
    """mqa_decode's rescaled split at batch 8 as shipped (a running maximum carried by
    the chain on mma.sync), every legal knob value: among them its K and V tiles by bulk
    copies into swizzled boxes (tma=1), read by ldmatrix (test_tma.py)."""
    from test_tma import MQA_CHAIN_B8

    src = tmp_path / "mqa8.mir"
    src.write_text(MQA_CHAIN_B8.replace("f16[", f"{dtype}["))
    _check_all(device, load_graph(str(src)))


@pytest.mark.parametrize("ksplit,push", [(3, 0), (6, 0), (3, 1)])
def test_clusters_of_three_and_six_on_gpu(device, tmp_path: Path, ksplit: int,  # type: ignore[no-untyped-def]
                                          push: int) -> None:
    """A forloop of 24 split over clusters of sizes that are not powers of two, each
    block's 24 / ksplit iterations combined over distributed shared memory (pulled by
    every block, or pushed to block 0)."""
    from plan_programs import RMSNORM_LINEAR_24

    from mirage_cli.codegen.bench import check_graph

    src = tmp_path / "rl24.mir"
    src.write_text(RMSNORM_LINEAR_24)
    g = load_graph(str(src))
    loaded, chk = check_graph(device, planned(g, "sm_90", [Knobs(ksplit=ksplit, push=push)]), seed=7)
    loaded.unload()
    assert chk.ok, chk.reason
