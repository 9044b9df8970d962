"""On a GPU: a whole layer as `mirage opt` ships it (parts searched, stitched,
verified) computes the program's float64 result (f16/bf16: rel L2 <= 1e-2, no NaN,
outputs poisoned first), at reduced sizes; the full-size unfused layers are covered
by tests/test_codegen_gpu.py (every example at batch 1 and 8)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mirage_cli.codegen.runner import gpu_available
from mirage_cli.loading import load_graph
from mirage_cli.search import layer
from mirage_cli.search.driver import SearchOptions

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
SMALL = {"batch": 8, "hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "inter": 512,
         "kv": 256}


@pytest.fixture(scope="module")
def device():  # type: ignore[no-untyped-def]
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from mirage_cli.codegen.runner import Device
    return Device(0)


@pytest.mark.parametrize("name", ["llama3_8b_layer", "qwen2_7b_layer"])
def test_stitched_layer_matches_float64(device, name: str) -> None:  # type: ignore[no-untyped-def]
    from mirage_cli.codegen.bench import check_graph

    prog = load_graph(str(ROOT / "examples" / f"{name}.mir"), SMALL)
    res = layer.optimise_layer(prog, SearchOptions(), 20.0, layer.local_mapper(2),
                               use_cache=False)
    assert res.graph is not None, res.verdict
    loaded, chk = check_graph(device, res.graph, seed=7, reference=prog)
    loaded.unload()
    assert chk.ok, f"{name}: {chk.reason}"
