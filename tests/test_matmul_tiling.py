"""The tiling of a pre-defined matmul (codegen/matmul_tiling.py, chosen by
search/cost.py): legal candidates, the model's choice, and that the model costs a
pre-defined matmul as the kernel it lowers to."""

from __future__ import annotations

import dataclasses

import pytest

from mirage_cli.codegen import matmul_tiling
from mirage_cli.codegen.lower import lower
from mirage_cli.interp import random_inputs, run
from mirage_cli.ir import DType, KernelOp, TensorType, Value
from mirage_cli.loading import graphs_from_text
from mirage_cli.search import cost

F16 = DType.F16


def _matmul(a: tuple[int, ...], b: tuple[int, ...], dtype: DType = F16
            ) -> tuple[KernelOp, dict[str, TensorType]]:
    from mirage_cli.ops import infer_matmul

    ta, tb = TensorType(a, dtype), TensorType(b, dtype)
    tc = infer_matmul([ta, tb], {})
    return KernelOp("matmul", ("a", "b"), (Value("c", tc),)), {"a": ta, "b": tb, "c": tc}


def test_candidates_are_every_vector_width_and_k_tile() -> None:
    op, types = _matmul((8, 14336), (14336, 4096))
    sizes = [s for s, _ in matmul_tiling.candidates(op, types)]
    assert {bn for bn, _ in sizes} == {w for w in range(8, 257, 8) if 4096 % w == 0}
    assert {bk for _, bk in sizes} == {16, 32, 64, 128, 256, 512}
    for (bn, bk), k in matmul_tiling.candidates(op, types):
        assert k.block is not None and k.block.forloop == 14336 // bk
        assert k.block.grid == (4096 // bn, 1, 1)


def test_a_decode_projection_runs_about_one_block_per_sm() -> None:
    """A few rows against a large weight: the model's pick streams W with about one
    block per SM (fewer blocks read DRAM at a bounded rate each, many more pay waves)."""
    sms = cost.profile().num_sms
    for a, b in [((1, 4096), (4096, 4096)), ((8, 4096), (4096, 14336)),
                 ((16, 14336), (14336, 4096)), ((8, 3584), (3584, 18944))]:
        op, types = _matmul(a, b)
        k = cost.lowered(op, types)
        assert k.block is not None
        (kc,) = cost.kernel_costs(_graph(op, types))
        assert sms // 2 <= kc.blocks <= 2 * sms, (a, b, k.block.grid, kc.blocks)


def _graph(op: KernelOp, types: dict[str, TensorType]):  # type: ignore[no-untyped-def]
    from mirage_cli.ir import Graph, Input

    return Graph("m", (), (Input(Value("a", types["a"])), Input(Value("b", types["b"]))),
                 (op,), ("c",))


def test_the_model_costs_a_predefined_matmul_as_the_kernel_it_runs() -> None:
    op, types = _matmul((8, 4096), (4096, 6144))
    custom = cost.lowered(op, types)
    assert custom.block is not None
    assert cost.kernel_costs(_graph(op, types)) == cost.kernel_costs(_graph(custom, types))


def test_the_choice_does_not_move_with_the_fitted_coefficients() -> None:
    op, types = _matmul((16, 4096), (4096, 14336))
    before = cost.lowered(op, types)
    p = cost.profile()
    try:
        cost.use_profile(dataclasses.replace(p, fit={"stream": 3.0, "sync": 0.1,
                                                     "launch": 2.0, "const_us": 1.0}))
        assert cost.lowered(op, types) == before
    finally:
        cost.use_profile(p)


def test_f32_and_untileable_matmuls_keep_the_scalar_kernel() -> None:
    """f32 has no tensor-core path here; a K of 60 has no K tile of whole mma steps."""
    for a, b, dt in [((8, 64), (64, 64), DType.F32), ((8, 60), (60, 64), F16)]:
        op, types = _matmul(a, b, dt)
        assert matmul_tiling.candidates(op, types) == []
        assert cost.lowered(op, types) is op


PROGRAM = """
program attn(b = 2, h = 4, g = 2, d = 16, s = 64) {
  input Q: f16[b, h, g, d];
  input K: f16[b, h, d, s];
  input V: f16[b, h, s, d];
  input W: f16[d, 32];
  S = matmul(Q, K);
  O = matmul(S, V);
  P = matmul(O, W);
  output P;
}
"""


@pytest.mark.parametrize("b", [1, 2])
def test_batched_matmuls_lower_to_custom_kernels_that_compute_the_program(b: int) -> None:
    """Two batch dimensions (attention's batch and heads) map to grid z and y; a
    batch of 1 is broadcast. The lowered kernels' block graphs, run by the
    interpreter, give the program's result."""
    import numpy as np

    (g,) = graphs_from_text(PROGRAM, "attn.mir", {"b": b})
    types = g.tensor_types()
    lowered = [cost.lowered(op, types) for op in g.ops]
    assert all(k.block is not None for k in lowered)
    fused = dataclasses.replace(g, ops=tuple(lowered))
    feeds = random_inputs(g)
    want, got = run(g, feeds), run(fused, feeds)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-9, atol=1e-9)
    lower(fused)  # and the codegen plans and emits them
