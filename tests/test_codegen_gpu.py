"""On a GPU: every example, fused µGraph, hand-built case and imported Mirage
candidate computes the float64 reference's result (f16: rel L2 ≤ 1e-2, no NaN, every
element written: outputs are poisoned with NaN first)."""

from __future__ import annotations

from pathlib import Path

import pytest
from codegen_cases import CASES
from shared_data import MUGRAPHS

from mirage_cli.codegen.runner import gpu_available

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").rglob("*.mir"))
CHECKPOINTS = sorted(MUGRAPHS.glob("*.json"))


@pytest.fixture(scope="module")
def device():  # type: ignore[no-untyped-def]
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from mirage_cli.codegen.runner import Device
    return Device(0)


def _check(device, g) -> None:  # type: ignore[no-untyped-def]
    from mirage_cli.codegen.bench import check_graph
    loaded, chk = check_graph(device, g, seed=7)
    loaded.unload()
    assert chk.ok, f"{g.name}: {chk.reason}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("batch", [1, 8])
def test_example(device, path: Path, batch: int) -> None:  # type: ignore[no-untyped-def]
    from mirage_cli.diagnostics import MirageError
    from mirage_cli.loading import load_graph
    try:
        g = load_graph(str(path), {"batch": batch})
    except MirageError as e:  # a fixed grid that does not tile this batch
        pytest.skip(f"not defined at batch {batch}: {e.message}")
    _check(device, g)


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(device, name: str) -> None:  # type: ignore[no-untyped-def]
    _check(device, CASES[name]())


@pytest.mark.parametrize("path", CHECKPOINTS, ids=lambda p: p.stem)
def test_mirage_candidates(device, path: Path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("mirage_cli.importers.mirage")
    from mirage_cli.loading import load_graphs
    for g in load_graphs(str(path)):
        _check(device, g)
