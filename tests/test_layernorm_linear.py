"""LayerNorm (mean removed, eps, weight and bias) followed by a linear layer: the
one-kernel design the search finds with whole rows in a block, where it fits at the
Llama-3-8B width, and the numerical standing of the one-pass moments form
``var = E[x^2] - E[x]^2`` that a kernel walking the hidden dim would need."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from mirage_cli import interp
from mirage_cli.dtypes import round_to
from mirage_cli.parser import parse_text
from mirage_cli.search.cost import estimate
from mirage_cli.search.design import design_of, instantiate
from mirage_cli.search.driver import SearchOptions, search
from mirage_cli.verifier.numerics import safety_check

LAYERNORM_LINEAR = """
program ln_linear(batch = BATCH, hidden = HIDDEN, n = N) {
  input X: DT[batch, hidden];
  input G: DT[hidden];
  input Bias: DT[hidden];
  input W: DT[hidden, n];
  M = mean(X, dim=1, keepdim=true);
  C = sub(X, M);
  Nn = rms_norm(C, G, eps=1e-05);
  Y = add(Nn, Bias);
  Z = matmul(Y, W);
  output Z;
}
"""

# The normalisation from one pass of moments, E[x^2] + eps - E[x]^2 (acc_rms_ld with
# eps, squared), as a kernel walking the hidden dim would have to compute it; the
# matmul stays a pre-defined operator.
ONE_PASS = """
program ln_linear_one_pass(batch = BATCH, hidden = HIDDEN, n = N) {
  input X: DT[batch, hidden];
  input G: DT[hidden];
  input Bias: DT[hidden];
  input W: DT[hidden, n];
  Y = custom(grid=(batch, 1, 1), threads=128, forloop=1) {
    x = load X imap(x=0);
    g = load G;
    b = load Bias;
    m = acc_mean_ld(x);
    r = acc_rms_ld(x, eps=1e-05);
    r2 = mul(r, r);
    m2 = mul(m, m);
    v = sub(r2, m2);
    s = sqrt(v);
    c = sub(x, m);
    gc = mul(c, g);
    nn = div(gc, s);
    y = add(nn, b);
    store y -> Y omap(x=0);
  }
  Z = matmul(Y, W);
  output Z;
}
"""


def _g(text: str, batch: int, hidden: int, n: int, dtype: str = "f16"):
    src = (text.replace("BATCH", str(batch)).replace("HIDDEN", str(hidden))
           .replace("N)", f"{n})").replace("DT", dtype))
    return parse_text(src, "<test>", {})


@functools.cache  # two tests read it; a Graph is immutable
def _one_kernel_design():
    """The search's best design at batch 1 (small sizes): one custom kernel."""
    res = search(_g(LAYERNORM_LINEAR, 1, 512, 256),
                 SearchOptions(max_kernel_ops=1, max_block_ops=8, top=1))
    assert res.candidates, "no verified candidate"
    best = res.candidates[0]
    assert best.verdict["equivalent"] is True
    return best.graph


def test_search_fuses_layernorm_and_linear_into_one_kernel_at_batch_1():
    g = _one_kernel_design()
    (k,) = g.ops
    assert k.op == "custom" and k.block is not None
    block_ops = [o.op for o in k.block.ops]
    # The whole normalisation (mean, centring, rms with eps, weight, bias) is in the
    # block, before the matmul of the same block.
    for op in ("acc_mean_ld", "sub", "rms", "div", "add", "matmul"):
        assert op in block_ops, block_ops
    assert block_ops.index("matmul") > block_ops.index("add")
    rms = next(o for o in k.block.ops if o.op == "rms")
    assert dict(rms.attrs)["eps"] == 1e-05


def test_whole_row_design_fits_at_llama_width_for_batch_1_not_batch_16():
    """Why layernorm_linear_b16_f16 is two kernels: the whole-row design keeps the
    16 x 4096 rows of X in shared memory next to a 4096-row tile of W."""
    design, _ = design_of(_one_kernel_design())
    b1 = _g(LAYERNORM_LINEAR, 1, 4096, 4096, "bf16")
    g1 = instantiate(b1, design, (((256, 1, 1), 1),))
    assert g1 is not None and estimate(g1).fits
    b16 = _g(LAYERNORM_LINEAR, 16, 4096, 4096)
    for blocks in (64, 128, 256, 512):
        g16 = instantiate(b16, design, (((blocks, 1, 1), 1),))
        assert g16 is None or not estimate(g16).fits, blocks


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_one_pass_moments_fail_on_constant_rows_and_not_before(dtype):
    """On random rows, even with a common offset of 64 and 256 standard deviations,
    the one-pass moments are as accurate as the program, whose mean and centred rows
    are rounded to the dtype; on a constant row E[x^2] + eps - E[x]^2 rounds below
    zero and its square root is NaN, where the program's centred row is exactly 0:
    the numerics check rejects the form on those inputs (X held constant)."""
    prog = _g(LAYERNORM_LINEAR, 4, 1024, 16, dtype)
    cand = _g(ONE_PASS, 4, 1024, 16, dtype)
    verdict = safety_check(prog, cand, seed=0)
    assert not verdict.safe and verdict.failed_on.startswith("X = 16384")
    assert "NaN" in verdict.reason
    (_, e_p, e_c), constant = verdict.errors  # the random inputs passed
    assert e_c <= max(1e-2, 4 * e_p) and constant[0].startswith("X = 16384")
    # Rows with a common offset, where the check's zero-mean inputs cannot make it
    # cancel: there the program is worse.
    base = interp.random_inputs(prog, 0)
    types = {i.value.name: i.value.type for i in prog.inputs}
    for offset in (64.0, 256.0):
        ins = {k: round_to(types[k].dtype, v + np.float32(offset if k == "X" else 0.0))
               for k, v in base.items()}
        ref = interp.run(prog, ins, "float64")["Z"]
        errs = [float(np.linalg.norm(interp.run(g, ins, "native")["Z"].astype(np.float64)
                                     - ref) / np.linalg.norm(ref)) for g in (prog, cand)]
        assert np.isfinite(errs).all()
        assert errs[1] <= errs[0], (offset, errs)

