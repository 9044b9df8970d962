"""Inputs declared ``weight`` and the copies a kernel issues before its grid-dependency
wait (codegen/lower.py ``early_inputs``): the language, the file format, and what the
generated kernels may read before they wait."""

from __future__ import annotations

import dataclasses
import json
import re

from mirage_cli import serialize
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import early_inputs, lower
from mirage_cli.codegen.plan import Program
from mirage_cli.loading import load_graph
from mirage_cli.parser import parse_text
from mirage_cli.printer import print_graph

SRC = """program p(m = 16, k = 4096, n = 6144) {
  input X: f16[m, k];
  input W: f16[k, n] weight;
  Y = rms_norm(X);
  Z = matmul(Y, W);
  output Z;
}
"""


def test_weight_is_parsed_printed_and_kept_in_ugraph_json() -> None:
    g = parse_text(SRC, "p.mir")
    assert [(i.value.name, i.weight) for i in g.inputs] == [("X", False), ("W", True)]
    assert "  input W: f16[k, n] weight;" in print_graph(g)
    doc = json.loads(serialize.dumps(g))
    inputs = doc["graph"]["inputs"]
    assert inputs[1]["weight"] is True and "weight" not in inputs[0]
    back = serialize.loads(serialize.dumps(g), "p.ugraph.json")
    assert [i.weight for i in back.inputs] == [False, True]


def test_weight_stays_a_usable_name() -> None:
    g = parse_text("program p() {\n  input weight: f16[4, 4] weight;\n  input X: f16[2, 4];\n"
                   "  Y = matmul(X, weight);\n  output Y;\n}\n", "p.mir")
    assert g.inputs[0].value.name == "weight" and g.inputs[0].weight


def test_a_weight_flag_changes_the_search_cache_key() -> None:
    from mirage_cli.search.cache import program_hash

    g = parse_text(SRC, "p.mir")
    plain = dataclasses.replace(g, inputs=tuple(dataclasses.replace(i, weight=False)
                                                for i in g.inputs))
    assert program_hash(g) != program_hash(plain)


def test_first_kernel_reads_only_weights_early_and_later_kernels_any_input() -> None:
    g = parse_text(SRC, "p.mir")
    assert early_inputs(g, 0) == {"W"}
    assert early_inputs(g, 1) == {"X", "W"}
    plain = dataclasses.replace(g, inputs=tuple(dataclasses.replace(i, weight=False)
                                                for i in g.inputs))
    assert early_inputs(plain, 0) == frozenset()


# The head of each member's code in a grouped launch (codegen/grouping.py).
_MEMBER = re.compile(r"^  (?:\} else )?if \(blockIdx\.x < \d+u\) \{$", re.MULTILINE)


def _pre_wait_args(prog: Program, cu: str) -> list[set[str]]:
    """For each launch, the device tensors its statements before the wait name (in a
    grouped launch, each member's statements before its own wait)."""
    bodies = re.findall(r'extern "C" __global__[^{]*\{\n(.*?)\n\}\n', cu, re.DOTALL)
    out = []
    for k, body in zip(prog.kernels, bodies):
        members = _MEMBER.split(body)[1:] if k.waits_inside else [body]
        assert len(members) == (len(k.plan["grouped"]) if k.waits_inside else 1)
        pre = "".join(m[:m.index("mg_grid_wait();")] for m in members)
        names = {p.name: p.arg for p in k.params}
        out.append({names[n] for n in re.findall(r"\b(?:g\d+_)?p\d+\b", pre)})
    return out


def test_no_kernel_reads_anything_but_early_inputs_before_its_wait() -> None:
    """The safety rule, checked on the generated text of every example µGraph: before
    its wait a kernel names only parameters bound to inputs early for it (never an
    output, the workspace, or a tensor an earlier kernel of the call writes)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    seen_early = grouped_early = 0
    for path in sorted((root / "golden").glob("*.ugraph.json")):
        if ".cands." in path.name:
            continue
        g = load_graph(str(path))
        prog = lower(g)
        cu, _ = emit(prog)
        for i, names in enumerate(_pre_wait_args(prog, cu)):
            assert names <= early_inputs(g, min(i, 1)), (path.name, i, names)
            seen_early += bool(names)
            grouped_early += bool(names) and prog.kernels[i].waits_inside
    assert seen_early, "no golden µGraph copies anything before its wait"
    assert grouped_early, "no grouped launch copies anything before a member's wait"


def test_weights_are_copied_before_the_wait_and_activations_after() -> None:
    g = load_graph("examples/mugraphs/rmsnorm_linear_fused.mir")
    prog = lower(g)
    cu, _ = emit(prog)
    (names,) = _pre_wait_args(prog, cu)
    assert names == {"W"}
    plain = dataclasses.replace(g, inputs=tuple(dataclasses.replace(i, weight=False)
                                                for i in g.inputs))
    prog = lower(plain)
    cu, _ = emit(prog)
    assert _pre_wait_args(prog, cu) == [set()]


# LoRA as the search ships it at Llama-3 sizes: X @ A first, then one kernel streaming W
# whose product (X @ A) @ B is loop-invariant and read only after the loop.
LORA = """program lora(m = 16, k = 4096, n = 4096, r = 64) {
  input X: f16[m, k];
  input W: f16[k, n] weight;
  input A: f16[k, r] weight;
  input B: f16[r, n] weight;
  t0 = matmul(X, A);
  Y = custom(grid=(64, 1, 1), threads=128, forloop=32) {
    b0 = load X fmap(1);
    b1 = load W imap(x=1) fmap(0);
    b2 = load B imap(x=1);
    b3 = load t0;
    b4 = matmul(b0, b1);
    b5 = matmul(b3, b2);
    b6 = acc_sum(b4);
    b7 = add(b5, b6);
    store b7 -> Y omap(x=1);
  }
  output Y;
}
"""


def _second_kernel(src: str, tma: int) -> tuple[set[str], str, str]:
    from mirage_cli.commands.plan import planned
    from mirage_cli.kplan import Knobs

    g = planned(parse_text(src, "lora.mir"), "sm_90", [Knobs(tma=tma)])
    prog = lower(g, "sm_90")
    cu, _ = emit(prog)
    body = re.findall(r'extern "C" __global__[^{]*\{\n(.*?)\n\}\n', cu, re.DOTALL)[-1]
    at = body.index("mg_grid_wait();")
    return _pre_wait_args(prog, cu)[-1], body[:at], body[at:]


def test_a_loop_that_reads_no_invariant_runs_before_the_wait() -> None:
    """The LoRA kernel's loop streams X and W, both safe to read early; its invariant
    (X @ A) @ B reads the first kernel's t0 and only the epilogue reads it: the copies
    of B and t0 and their product go after the loop, and the wait with them."""
    for tma in (1, 0):
        names, pre, post = _second_kernel(LORA, tma)
        assert names == {"X", "W"}, tma
        assert "for (int it = 0;" in pre and "for (int it = 0;" not in post
        assert ("mg_tma2" in pre) == bool(tma)
        assert post.count("mg_cp_async16") == 2 and "mma" in post


def test_bulk_copies_go_before_the_wait_beside_staged_invariants() -> None:
    """As the first kernel (t0 an activation of the caller), the loop reads X, which the
    caller's last kernel may still be writing, so the invariants stay before the loop
    and the wait before both. W's bulk copies still go early: the invariants' wait for
    their cp.async copies does not wait for bulk copies, which complete on their own
    mbarriers (cp.async copies of W would be waited for with them: none go early)."""
    first = LORA.replace("  t0 = matmul(X, A);\n", "").replace(
        "  input B: f16[r, n] weight;\n", "  input B: f16[r, n] weight;\n  input t0: f16[m, r];\n")
    for tma, early in ((1, {"W"}), (0, set())):
        names, pre, post = _second_kernel(first, tma)
        assert names == early, tma
        assert "for (int it = 0;" in post and "mg_cp_async16" not in pre
