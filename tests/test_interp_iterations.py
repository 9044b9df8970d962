"""The interpreter's stacked forloop (all iterations in one numpy call per operator)
computes exactly what the literal iteration-by-iteration evaluation computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from shared_data import MUGRAPHS

from mirage_cli import interp
from mirage_cli.builder import GraphBuilder
from mirage_cli.importers.mirage import import_checkpoint
from mirage_cli.ir import Graph

CKPTS = MUGRAPHS


def _awkward() -> Graph:
    """Per-iteration and invariant operands of different ranks, `dim` attributes inside
    the loop, every accumulator kind, an accumulator of an invariant value."""
    b = GraphBuilder("awkward")
    x = b.input("X", (8, 64), "f32")
    w = b.input("W", (64, 32), "f32")
    v = b.input("V", (32,), "f32")
    u = b.input("U", (8, 32), "f32")
    r = b.input("R", (128,), "f32")
    k = b.custom((2, 1, 1), 32, 4)
    xt = k.load(x, (0, None, None), 1)        # (4, 16) per iteration
    wt = k.load(w, (None, None, None), 0)     # (16, 32) per iteration
    vt = k.load(v)                            # (32,) invariant, rank 1
    ut = k.load(u, (0, None, None))           # (4, 32) invariant, rank 2
    rt = k.load(r, (None, None, None), 0)     # (32,) per iteration, rank 1
    a = k.op("add", k.op("matmul", xt, wt), vt)
    m = k.op("mul", ut, rt)                   # invariant rank 2 x per-iteration rank 1
    s = k.op("sum", m, dim=0, keepdim=True)
    s2 = k.op("sum", m, dim=1)
    c = k.op("concat", a, m, dim=1)
    e = k.op("exp", k.op("mul_scalar", c, scalar=0.125))
    outs = [
        (k.op("acc_sum", c), (0, None, None)),
        (k.op("acc_max", s), (0, None, None)),
        (k.op("div", k.op("acc_sum_ld", e), k.op("acc_rms_ld", a)), (0, None, None)),
        (k.op("acc_mean", s2), (0, None, None)),
        (k.op("acc_sum_to", e, width=16), (0, None, None)),
        (k.op("acc_mean_ld", m), (0, None, None)),
        (k.op("acc_sum", ut), (0, None, None)),
        (k.op("acc_max_ld", a), (0, None, None)),
        (k.op("acc_rms", rt), (0, None, None)),
    ]
    for name in k.finish([(t, None, omap) for t, omap in outs]):
        b.output(name)
    return b.build()


def _same(g: Graph, seed: int = 0) -> None:
    ins = {n: x.astype(np.float64) for n, x in interp.random_inputs(g, seed).items()}
    for precision in ("float64", "native"):
        fast = interp.run(g, ins, precision)  # type: ignore[arg-type]
        slow = interp.run(g, ins, precision, stack_iterations=False)  # type: ignore[arg-type]
        assert fast.keys() == slow.keys()
        for name in fast:
            assert fast[name].shape == slow[name].shape
            scale = float(np.abs(slow[name]).max())
            np.testing.assert_allclose(fast[name], slow[name], rtol=1e-12, atol=1e-12 * scale)


def test_awkward_block_graph() -> None:
    _same(_awkward())


@pytest.mark.skipif(not CKPTS.is_dir(), reason="Mirage checkpoints not available")
@pytest.mark.parametrize("name, index", [
    ("lora.json", 3), ("ntrans_bs1.json", 0), ("ntrans_bs1.json", 8), ("gqa_bs1.json", 0),
    ("gqa_bs1.json", 14), ("gqa_bs1.json", 24), ("rmsnorm_bs1.json", 17),
    ("single_gated_mlp.json", 0),
])
def test_mirage_candidates(name: str, index: int) -> None:
    path = str(CKPTS / name)
    _same(import_checkpoint(Path(path).read_text(), path)[index])
