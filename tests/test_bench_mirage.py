"""Mirage's checkpoint candidates bound to the program they are compared with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from shared_data import MUGRAPHS

from mirage_cli import interp
from mirage_cli.diagnostics import MirageError
from mirage_cli.importers.bind import bind
from mirage_cli.importers.mirage import import_checkpoint
from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph
from mirage_cli.parser import parse_text

ROOT = Path(__file__).resolve().parent.parent
GQA = ROOT / "examples" / "gqa.mir"
needs_ckpts = pytest.mark.skipif(not (MUGRAPHS / "gqa_bs1.json").is_file(),
                                 reason="Mirage checkpoints not available")


def _gqa(batch: int) -> Graph:
    return load_graph(str(GQA), {"batch": batch})


def _import(path: Path) -> list[Graph]:
    return import_checkpoint(path.read_text(), str(path))


# -- binding a candidate to its program -------------------------------------------------


# Input and output names that collide with the candidate's own (in0.., t0, t1, out0).
CLASHING = """
program clash() {
  input t1: f16[2, 256, 64];
  input t0: f16[2, 64, 4096];
  input out0: f16[2, 4096, 64];
  A = matmul(t1, t0);
  E = exp(A);
  S = sum(E, dim=2, keepdim=true);
  P = div(E, S);
  in0 = matmul(P, out0);
  output in0;
}
"""


@needs_ckpts
@pytest.mark.parametrize("program", ["gqa", "clash"])
def test_bind_takes_the_program_names_and_keeps_the_function(program: str) -> None:
    cand = _import(MUGRAPHS / "gqa_bs1.json")[0]
    prog = _gqa(1) if program == "gqa" else parse_text(CLASHING, "<t>", {})
    g = bind(cand, prog)
    assert g.input_names == prog.input_names and g.outputs == prog.outputs
    assert cand.input_names == ("in0", "in1", "in2")  # what changed, changed here
    ins = interp.random_inputs(cand, seed=3)
    before = interp.run(cand, ins)[cand.outputs[0]]
    after = interp.run(g, dict(zip(g.input_names, ins.values())))[g.outputs[0]]
    assert np.array_equal(before, after)
    assert [op.block.grid for op in g.ops if op.block] == \
        [op.block.grid for op in cand.ops if op.block]


@needs_ckpts
def test_bind_names_the_position_that_differs() -> None:
    cand = _import(MUGRAPHS / "gqa_bs8.json")[0]
    with pytest.raises(MirageError) as e:
        bind(cand, _gqa(1))
    assert "input #0 differs" in e.value.message and "f16[16, 256, 64]" in e.value.message


def test_bind_refuses_an_input_returned_as_output() -> None:
    ident = parse_text("program c() {\n  input X: f16[4, 8];\n  Y = exp(X);\n  output X;\n"
                       "  output Y;\n}\n", "<t>", {})
    prog = parse_text("program p() {\n  input A: f16[4, 8];\n  B = exp(A);\n  C = exp(B);\n"
                      "  output B;\n  output C;\n}\n", "<t>", {})
    with pytest.raises(MirageError, match="output #0 .* is 'X', which is also its input"):
        bind(ident, prog)
