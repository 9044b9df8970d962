"""The core: builder, interpreter and JSON agree on the fused RMSNorm+MatMul."""

import numpy as np

from mirage_cli import interp, serialize
from mirage_cli.builder import GraphBuilder


def _program():
    b = GraphBuilder("rmsnorm_linear")
    x = b.input("X", (4, 64), "f16")
    w = b.input("W", (64, 32), "f16")
    b.output(b.op("matmul", b.op("rms_norm", x, out="Y"), w, out="Z"))
    return b.build()


def _fused():
    b = GraphBuilder("rmsnorm_linear_fused")
    x = b.input("X", (4, 64), "f16")
    w = b.input("W", (64, 32), "f16")
    k = b.custom((4, 1, 1), 128, 4)
    xt = k.load(x, (None, None, None), 1)
    wt = k.load(w, (1, None, None), 0)
    r = k.op("acc_rms_ld", xt)
    s = k.op("acc_sum", k.op("matmul", xt, wt))
    (z,) = k.finish([(k.op("div", s, r), "Z", (1, None, None))])
    b.output(z)
    return b.build()


def test_fused_equals_program_in_float64():
    p, f = _program(), _fused()
    ins = interp.random_inputs(p, seed=3)
    a = interp.run(p, ins)["Z"]
    c = interp.run(f, ins)["Z"]
    np.testing.assert_allclose(c, a, rtol=1e-12, atol=1e-12)


def test_json_round_trip():
    for g in (_program(), _fused()):
        assert serialize.loads(serialize.dumps(g)) == g
