"""Numerical side of equivalence: constants the finite field cannot tell apart, the
element-wise float64 tolerance, and numerical safety of softmax rewrites."""

from __future__ import annotations

import numpy as np

from mirage_cli.parser import parse_text
from mirage_cli.verifier import crosscheck as cc
from mirage_cli.verifier.api import Verifier
from mirage_cli.verifier.field import P

SCALED = """
program scaled(n = 64) {
  input X: f32[4, n];
  input W: f32[n, n];
  Y = matmul(X, W);
  Z = mul_scalar(Y, scalar=SCALAR);
  output Z;
}
"""


def _g(text: str):
    return parse_text(text, "<test>", {})


def test_a_constant_equal_to_one_mod_p_is_not_one():
    fooling = 1 + P * 2.0 ** -52  # an exact float64, and 1 in Z_P
    assert fooling != 1.0
    a = _g(SCALED.replace("SCALAR", "1.0"))
    b = _g(SCALED.replace("SCALAR", repr(fooling)))
    v = Verifier(a, seed=0)
    verdict = v.check(b, trials=1)
    assert verdict.equivalent is False
    assert verdict.mismatch is not None and verdict.mismatch.modulus == "Q"
    assert v.certify(b).verdict == "not equivalent"
    # An equal constant still verifies.
    assert v.certify(_g(SCALED.replace("SCALAR", "1.0"))).verdict == "equivalent"


def test_float64_tolerance_is_per_element():
    y = np.array([1e6, 1e6, 1.0, -2.0])
    x = y.copy()
    x[2] *= 1 + 1e-7  # a change far below 1e-9 of the largest element
    assert not cc._distance(x, y)[1] <= cc.RTOL
    # Reassociation-sized noise on an element that cancelled to nearly zero passes.
    z = np.array([1.0, -1.0, 1e-14, 3.0])
    w = z.copy()
    w[2] += 1e-16
    assert cc._distance(w, z)[1] <= cc.RTOL
    assert cc._distance(np.array([np.nan, 1.0]), np.array([0.0, 1.0]))[1] == np.inf
