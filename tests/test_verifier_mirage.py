"""Mirage's published LoRA candidates verify against the program, and are rejected
against mutated programs (so the full table in docs/verification.md, made with
``python -m mirage_cli.verifier.mirage_table``, is not passing trivially)."""

from __future__ import annotations

import pytest
from shared_data import MUGRAPHS

from mirage_cli.builder import GraphBuilder
from mirage_cli.ir import Graph
from mirage_cli.loading import load_graphs
from mirage_cli.verifier.api import Verifier

CKPTS = MUGRAPHS
pytestmark = pytest.mark.skipif(not (CKPTS / "lora.json").exists(),
                                reason="Mirage checkpoints not available")


def lora(variant: str) -> Graph:
    b = GraphBuilder("lora")
    x = b.input("X", (16, 256), "f16")
    w = b.input("W", (256, 4096), "f16")
    a = b.input("A", (256, 16), "f16")
    bb = b.input("B", (16, 4096), "f16")
    xw = b.op("matmul", x, w)
    xab = b.op("matmul", b.op("matmul", x, a), bb)
    out = {"ok": lambda: b.op("add", xw, xab), "sub": lambda: b.op("sub", xw, xab),
           "no_lora": lambda: b.op("add", xw, b.op("mul_scalar", xab, scalar=0.5))}[variant]()
    b.output(out)
    return b.build()


@pytest.mark.parametrize("variant,expected", [("ok", True), ("sub", False),
                                              ("no_lora", False)])
def test_lora_candidates(variant: str, expected: bool) -> None:
    v = Verifier(lora(variant), seed=3)
    for cand in load_graphs(str(CKPTS / "lora.json")):
        assert v.check(cand, trials=2).equivalent is expected
