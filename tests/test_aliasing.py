"""Reshapes that launch nothing (codegen/aliasing.py): which share a buffer, what the
lowering and the cost model make of them. On a GPU, ``codegen_cases.reshape_aliases``
is checked against the reference by test_codegen_gpu."""

from __future__ import annotations

import re

from codegen_cases import reshape_aliases

from mirage_cli.builder import GraphBuilder
from mirage_cli.codegen.aliasing import aliasing, launched
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.search.cost import estimate, kernel_costs


def test_each_storage_case() -> None:
    g = reshape_aliases()
    a = aliasing(g)
    names = [op.outputs[0].name for op in g.ops]
    kinds = {names[i]: g.ops[i].op for i in range(len(names))}
    free = {names[i] for i in a.free}
    r0, e, r1 = names[0], names[1], names[2]
    assert kinds[e] == "exp"
    # the reshape of X, the temporary's, and the one into R2 launch nothing; the
    # second output of the same tensor (R3) and X into R4 copy
    assert free == {r0, r1, "R2"}
    assert a.storage == {r0: "X", e: "R2", r1: "R2"}
    assert launched(g) == len(g.ops) - 3


def test_the_lowering_launches_no_kernel_for_a_shared_buffer() -> None:
    g = reshape_aliases()
    prog = lower(g)
    assert sum(map(len, prog.launch_ops)) == launched(g) == 4
    assert not any(i in aliasing(g).free for run in prog.launch_ops for i in run)
    e = g.ops[1].outputs[0].name
    assert prog.storage(e) == "R2" and not prog.temps  # nothing in the workspace
    cu, _ = emit(prog)
    launches = re.findall(r"\{\n(    (?:const )?mg_f16\* mg_a0.*?)void\* mg_args", cu, re.DOTALL)
    assert len(launches) == len(prog.kernels) == 2
    first, second = launches
    # exp reads X in place (R0 is X's buffer) and writes the output R2 (E's buffer);
    # F's kernel reads R1 there, as does the copy into R3
    assert "mg_a0 = (const mg_f16*)(mg_in0_X);" in first
    assert "mg_a1 = (mg_f16*)(mg_out0_R2);" in first
    assert second.count("(const mg_f16*)(mg_out0_R2);") == 2


def test_the_first_launched_kernel_reads_inputs_after_its_wait() -> None:
    """Op 0 launches nothing, so the matmul is the first kernel in the stream: it
    follows the caller's work, which may still be writing W (not a weight), and may
    copy nothing before its wait. Were it counted as the second kernel, W would be
    read early."""
    def program(weight: bool):  # type: ignore[no-untyped-def]
        b = GraphBuilder("first_launch")
        x = b.input("X", (2, 8, 2048), "f16")
        w = b.input("W", (2048, 256), "f16", weight=weight)
        b.output(b.op("matmul", b.op("reshape", x, d0=16, d1=2048), w))
        return b.build()

    def copied_early(weight: bool) -> bool:
        (k,) = lower(program(weight), "sm_90").kernels
        return any("cp_async" in line for line in k.body[:k.wait_at])

    assert not copied_early(False)
    assert copied_early(True)  # a weight is: the test can tell the two apart


def test_temporaries_share_one_workspace_slot() -> None:
    b = GraphBuilder("two_temps")
    x = b.input("X", (8, 64), "f16")
    e = b.op("exp", x)
    r = b.op("reshape", e, d0=512)
    b.output(b.op("exp", r))
    g = b.build()
    prog = lower(g)
    assert prog.launch_ops == ((0,), (2,)) and [t.name for t in prog.temps] == [e]
    assert prog.storage(r) == e


def test_the_model_prices_no_kernel_for_a_shared_buffer() -> None:
    g = reshape_aliases()
    ks = kernel_costs(g)
    assert [k.launched for k in ks] == [i not in aliasing(g).free for i in range(len(g.ops))]
    assert estimate(g).launches == 4
    free = next(k for k in ks if not k.launched)
    assert free.time_us == 0 and free.dram_bytes == 0 and free.binding.startswith("nothing")


def test_explain_counts_launched_kernels() -> None:
    from mirage_cli.search.explain import entry, entry_lines

    e, _ = entry(reshape_aliases(), "#0", 0, {}, "sm_90")
    assert [k["launches"] for k in e["kernels"]] == [0, 1, 0, 0, 1, 1, 1]
    assert entry_lines(e)[0].startswith("#0: 4 kernel(s), ")
    free = e["kernels"][0]
    assert free["kind"] == "reshape" and free["binds"].startswith("nothing")
