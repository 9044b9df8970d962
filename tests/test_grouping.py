"""Launch order and grouped launches (codegen/grouping.py): levels, which kernels share
a launch, what each member's code becomes, and which inputs the first launch may copy
before its wait. On a GPU, ``codegen_cases.grouped_launches`` and every example are
checked against the reference by test_codegen_gpu."""

from __future__ import annotations

import dataclasses
import re

from codegen_cases import grouped_launches, resized_grouped_member, shallower_grouped_ring
from graphgen import graphs
from hypothesis import HealthCheck, assume, given, settings

from mirage_cli.builder import GraphBuilder
from mirage_cli.codegen.aliasing import aliasing
from mirage_cli.codegen.custom import lower_custom
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.grouping import MIN_GROUPED_STAGES, compatible, fit_residency, levels, merge
from mirage_cli.codegen.joins import joined_ops, joins
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.plan import Kernel, Param
from mirage_cli.diagnostics import MirageError


def test_levels_follow_the_data_through_shared_buffers() -> None:
    g = grouped_launches()
    kinds = [op.op for op in g.ops]
    assert kinds == ["custom", "exp", "custom", "exp", "reshape", "matmul"]
    # the reshape (op 4) launches nothing; the matmul reads it, so its producer's level
    assert levels(g, aliasing(g).free) == {0: 0, 2: 0, 1: 1, 3: 1, 5: 2}


def test_independent_kernels_that_run_alike_share_a_launch() -> None:
    prog = lower(grouped_launches())
    assert prog.launch_ops == ((0, 2), (1, 3), (5,))
    k0, k1, k5 = prog.kernels
    assert k0.waits_inside and k1.waits_inside and not k5.waits_inside
    assert k0.grid == (4, 1, 1) and k1.grid[0] > 1  # 2 + 2 blocks of the two streams
    assert [p.name for p in k0.params] == ["g0_p0", "g0_p1", "g0_p2", "g1_p0", "g1_p1", "g1_p2"]
    assert [p.arg for p in k0.params] == ["X", "WA", "ZA", "X", "WB", "ZB"]
    cu, _ = emit(prog)
    assert cu.count("mg_grid_wait();") == 2 + 2 + 1  # once per member, where it was


def _kernel(name: str, body: list[str], grid: tuple[int, int, int], threads: int = 128,
            wait_at: int = 0, cluster: int = 1) -> Kernel:
    return Kernel(name, (Param("const float* __restrict__", "p0", "X"),
                         Param("float* __restrict__", "p1", name)),
                  tuple(body), threads, grid, 1024, 0, name, None, 0, cluster, wait_at)


def test_a_member_keeps_its_block_index_grid_and_parameters() -> None:
    a = _kernel("A", ["const int i = blockIdx.x * gridDim.x + blockIdx.y;",
                      "p1[i] = p0[i];"], (3, 2, 1))
    b = _kernel("B", ["float w = p0[blockIdx.x];", "p1[blockIdx.x] = w;"], (5, 1, 1),
                wait_at=1)
    k = merge([a, b], "AB")
    assert k.grid == (11, 1, 1) and k.waits_inside and k.smem_bytes == 1024
    text = "\n".join(k.body)
    # member 0 owns blocks 0..5 (3 x 2), member 1 blocks 6..10
    assert "if (blockIdx.x < 6u) {" in text and "} else if (blockIdx.x < 11u) {" in text
    assert "const unsigned mg_bx = (blockIdx.x - 6u) % 5u;" in text
    assert "const int i = mg_bx * 3u + mg_by;" in text
    assert "g0_p1[i] = g0_p0[i];" in text
    # B's early line stays before its wait, the rest after
    body_b = text[text.index("else if"):]
    assert body_b.index("float w = g1_p0[mg_bx];") < body_b.index("mg_grid_wait();") \
        < body_b.index("g1_p1[mg_bx] = w;")
    assert not re.search(r"\bp[01]\b", text)  # no parameter left unrenamed


def test_only_kernels_that_run_alike_share_a_launch() -> None:
    a = _kernel("A", [], (4, 1, 2), cluster=2)
    assert compatible([a], _kernel("B", [], (8, 1, 2), cluster=2), "sm_90")
    assert not compatible([a], _kernel("B", [], (8, 1, 2), threads=256, cluster=2), "sm_90")
    assert not compatible([a], _kernel("B", [], (8, 1, 2)), "sm_90")            # no cluster
    assert not compatible([a], _kernel("B", [], (8, 1, 4), cluster=2), "sm_90")  # depth


def test_a_launch_keeps_each_members_blocks_per_sm() -> None:
    """A streaming kernel of many small blocks (16 resident per SM at 128 threads) does
    not join one whose blocks hold 100 KB (two per SM); two of 100 and 110 KB do (both
    two per SM), and one of 120 KB does not join them (one per SM), unless the whole
    launch fits the SMs at once."""
    def with_smem(name: str, smem: int, blocks: int = 200) -> Kernel:
        return dataclasses.replace(_kernel(name, [], (blocks, 1, 1)), smem_bytes=smem)

    big, bigger = with_smem("A", 100 * 1024), with_smem("B", 110 * 1024)
    assert not compatible([big], with_smem("S", 0, 4096), "sm_90")
    assert compatible([big], bigger, "sm_90")
    assert not compatible([big, bigger], with_smem("C", 120 * 1024), "sm_90")
    small = [with_smem("A", 100 * 1024, 40), with_smem("B", 110 * 1024, 40)]
    assert compatible(small, with_smem("C", 120 * 1024, 40), "sm_90")  # 120 <= 132 x 1


def test_a_deep_ring_is_made_shallower_to_share_a_launch() -> None:
    """The Qwen layer's query projection (6 stages of 18 KB: one block per SM) beside
    its key and value projections (two per SM): one stage less keeps two blocks of
    each per SM, and the three share a launch (240 blocks: all resident at once). A
    member that would need fewer than MIN_GROUPED_STAGES stages keeps its launch."""
    def projection(name: str, stages: int, base: int, blocks: int) -> Kernel:
        k = _kernel(name, [], (blocks, 1, 2), cluster=2)
        return dataclasses.replace(k, smem_bytes=base + stages * 18 * 1024,
                                   plan={"knobs": {"stages": stages}})

    q = projection("Q", 6, 6 * 1024, 56)
    k, v = projection("K", 6, -20 * 1024, 32), projection("V", 6, -20 * 1024, 32)
    asked: list[tuple[int, int]] = []

    def relower(i: int, stages: int | None, threads: int) -> Kernel | None:
        assert stages is not None and threads == 128
        asked.append((i, stages))
        return projection("Q", stages, 6 * 1024, 56)

    assert compatible([k], v, "sm_90") and not compatible([q], k, "sm_90")
    fitted = fit_residency([(1, q), (2, k), (3, v)], "sm_90", relower)
    assert fitted is not None and asked == [(1, 5)]
    assert [i for i, _ in fitted] == [1, 2, 3] and fitted[1][1] is k
    assert fitted[0][1].plan == {"knobs": {"stages": 5}}
    members = [m for _, m in fitted]
    assert compatible(members[:1], members[1], "sm_90")
    assert compatible(members[:2], members[2], "sm_90")
    # a member whose relowering is refused, or that would need too shallow a ring
    assert fit_residency([(1, q), (2, k)], "sm_90", lambda i, s, t: None) is None
    deep = projection("Q", 6, 60 * 1024, 56)  # two per SM only below 3 stages
    assert fit_residency([(1, deep), (2, k), (3, v)], "sm_90",
                         lambda i, s, t: projection("Q", s, 60 * 1024, 56)) is None
    assert MIN_GROUPED_STAGES > 2


def test_lowering_gives_a_deep_member_fewer_stages_to_share_a_launch() -> None:
    """The query projection alone plans six stages and one block per SM; lowered
    beside the key and value projections (two per SM) it runs five, in their launch."""
    g = shallower_grouped_ring()
    types = g.tensor_types()
    alone = lower_custom(g.ops[0], "q", types, "sm_90")
    others = [lower_custom(op, f"k{i}", types, "sm_90") for i, op in enumerate(g.ops[1:])]
    assert alone.plan is not None and alone.plan["knobs"]["stages"] == 6
    assert not compatible([alone], others[0], "sm_90")
    prog = lower(g)
    assert prog.launch_ops == ((0, 1, 2),)
    (k,) = prog.kernels
    assert k.plan is not None
    assert [m["knobs"]["stages"] for m in k.plan["grouped"]] == [5, 6, 6]
    assert k.smem_bytes < alone.smem_bytes


def test_a_member_of_another_block_size_is_lowered_at_the_largest_members() -> None:
    """The Llama layer's query projection (128 threads, 128 blocks) beside its key and
    value projections (256 threads, 64 blocks each): these are lowered again at 128
    threads and the three share a launch; the largest member keeps its size, and a
    member that cannot be lowered at it keeps the run apart."""
    def projection(name: str, threads: int, blocks: int, smem: int = 100 * 1024) -> Kernel:
        k = _kernel(name, [], (blocks, 1, 2), cluster=2)
        return dataclasses.replace(k, threads=threads, smem_bytes=smem,
                                   plan={"knobs": {"stages": 6, "threads": threads}})

    q, k, v = projection("Q", 128, 64), projection("K", 256, 32), projection("V", 256, 32)
    asked: list[tuple[int, int | None, int]] = []

    def relower(i: int, stages: int | None, threads: int) -> Kernel | None:
        asked.append((i, stages, threads))
        return projection("KV", threads, 32)

    assert not compatible([q], k, "sm_90")
    fitted = fit_residency([(1, q), (2, k), (3, v)], "sm_90", relower)
    assert fitted is not None and asked == [(2, None, 128), (3, None, 128)]
    assert fitted[0][1] is q and all(m.threads == 128 for _, m in fitted)
    # the key projection first: the query's size still rules, as it has more blocks
    asked.clear()
    fitted = fit_residency([(2, k), (1, q)], "sm_90", relower)
    assert fitted is not None and asked == [(2, None, 128)]
    assert fit_residency([(1, q), (2, k)], "sm_90", lambda i, s, t: None) is None
    # one block per SM (batch 8): 256 blocks in two rounds, each member alone in one
    big = [projection(n, t, b, 120 * 1024) for n, t, b in (("Q", 128, 64), ("K", 256, 32))]
    assert fit_residency([(1, big[0]), (2, big[1])], "sm_90",
                         lambda i, s, t: projection("K", t, 32, 120 * 1024)) is None
    # ... where members of one size still share a launch, as before
    same = projection("K", 128, 32, 120 * 1024)
    assert compatible([big[0]], same, "sm_90")


def test_lowering_gives_a_member_the_largest_members_block_size() -> None:
    """Lowered alone, the key and value projections run 256 threads and the query's
    128; in the program, the three share one launch of 128-thread blocks."""
    g = resized_grouped_member()
    types = g.tensor_types()
    alone = [lower_custom(op, f"k{i}", types, "sm_90") for i, op in enumerate(g.ops)]
    assert [k.threads for k in alone] == [128, 256, 256]
    prog = lower(g)
    assert prog.launch_ops == ((0, 1, 2),)
    (k,) = prog.kernels
    assert k.threads == 128 and k.plan is not None
    assert [m["knobs"]["threads"] for m in k.plan["grouped"]] == [128, 128, 128]


def test_a_kernel_left_out_of_the_first_launch_may_copy_inputs_early() -> None:
    """The first launch follows the caller's work, which may still write W (not a
    weight): its kernels copy nothing of W before their wait. A level-0 kernel that
    does not join it (other threads per block) is lowered for a later launch, where
    every input is ready."""
    def program(first: str):  # type: ignore[no-untyped-def]
        b = GraphBuilder("first_launch")
        x = b.input("X", (16, 2048), "f16")
        w = b.input("W", (2048, 256), "f16")
        e = b.input("E", (64, 1024), "f16")
        mm, ew = (lambda: b.op("matmul", x, w)), (lambda: b.op("exp", e))
        outs = [mm(), ew()] if first == "matmul" else [ew(), mm()]
        for o in outs:
            b.output(o)
        return b.build()

    def copies_early(prog) -> bool:  # type: ignore[no-untyped-def]
        (k,) = [k for k in prog.kernels if "matmul" in k.comment]
        return any("cp_async" in line for line in k.body[:k.wait_at])

    alone_first, after = lower(program("matmul")), lower(program("exp"))
    assert len(alone_first.kernels) == len(after.kernels) == 2  # not grouped
    assert not copies_early(alone_first)
    assert copies_early(after)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(graphs())
def test_every_kernel_runs_once_after_all_it_reads(g) -> None:  # type: ignore[no-untyped-def]
    """On random µGraphs: each kernel operator but the shared reshapes and the joined
    concatenations runs in exactly one launch, and every tensor a kernel reads was
    written by a kernel of an earlier launch (never by one of its own launch, which
    runs beside it)."""
    try:
        prog = lower(g)
    except MirageError:
        assume(False)  # a random graph the generator refuses (it says why; not tested here)
    free = aliasing(g).free | joined_ops(g, joins(g))
    runs = prog.launch_ops
    assert sorted(i for run in runs for i in run) == [i for i in range(len(g.ops))
                                                      if i not in free]
    launch_of = {i: n for n, run in enumerate(runs) for i in run}
    # a tensor -> the launched ops that write what it is read from
    writers: dict[str, set[int]] = {}
    for i, op in enumerate(g.ops):
        if i in free:
            writers[op.outputs[0].name] = set().union(*(writers.get(t, set())
                                                        for t in op.inputs))
            continue
        for t in op.inputs:
            for w in writers.get(t, ()):
                assert launch_of[w] < launch_of[i], (t, runs)
        for v in op.outputs:
            writers[v.name] = {i}
