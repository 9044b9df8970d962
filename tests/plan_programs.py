"""Programs with explicit custom kernels that plan tests share."""

from pathlib import Path

# mqa_decode's split kernel at batch 16, as `mirage opt` ships it: two 16-row tiles of
# queries per block, a running maximum, five pipeline stages by default.
MQA_SPLIT_B16 = """program mqa_decode(batch = 16, heads = 32, d = 128, seq = 4096) {
  input Q: f16[batch, heads, d];
  input K: f16[batch, d, seq];
  input V: f16[batch, seq, d];
  (O_online0, O_online1, O_online2, O_online3) = custom(grid=(16, 8, 1), threads=128, forloop=8) {
    b0 = load Q imap(x=0);
    b1 = load K imap(x=0, y=2) fmap(2);
    b2 = load V imap(x=0, y=1) fmap(1);
    b3 = matmul(b0, b1);
    b4 = mul_scalar(b3, scalar=0.08838834764831845);
    b5 = acc_max_ld(b4);
    b6 = sub(b4, b5);
    b7 = exp(b6);
    b8 = acc_sum_ld(b7);
    b9 = matmul(b7, b2);
    b10 = acc_sum(b9);
    b11 = mul_scalar(b0, scalar=0.0);
    b12 = add(b5, b11);
    store b5 -> O_online0: f32 omap(x=0, y=2);
    store b8 -> O_online1: f32 omap(x=0, y=2);
    store b10 -> O_online2: f32 omap(x=0, y=2);
    store b12 -> O_online3: f32 omap(x=0, y=2);
  }
  output O_online0, O_online1, O_online2, O_online3;
}
"""


# mha_decode's softmax kernel at batch 1 (one design `mirage opt` keeps): a matmul whose
# A tile has one row (ldmatrix reads a zero row for the others) and block-wide row
# reductions (one partial per warp in shared memory).
MHA_SOFTMAX_B1 = """program mha_decode(batch = 1, heads = 32, d = 128, seq = 4096) {
  input Q: f16[heads * batch, 1, d];
  input K: f16[heads * batch, d, seq];
  t0 = custom(grid=(32, 1, 1), threads=128, forloop=8) {
    b0 = load Q imap(x=0) fmap(2);
    b1 = load K imap(x=0) fmap(1);
    b2 = matmul(b0, b1);
    b3 = acc_sum(b2);
    b4 = mul_scalar(b3, scalar=0.08838834764831845);
    b5 = max(b4, dim=2, keepdim=true);
    b6 = sub(b4, b5);
    b7 = exp(b6);
    b8 = sum(b7, dim=2, keepdim=true);
    b9 = div(b7, b8);
    store b9 -> t0 omap(x=0);
  }
  output t0;
}
"""

# RMSNorm + linear at a Llama-3.2-3B QKV projection's sizes (hidden 3072, 5120
# columns): the example's fused µGraph as 40 tiles of 128 columns over 24 iterations,
# so that clusters of 3 and 6 split the forloop evenly (120 and 240 launched blocks
# where clusters of 2 launch 80).
RMSNORM_LINEAR_24 = (Path(__file__).resolve().parent.parent / "examples" / "mugraphs"
                     / "rmsnorm_linear_fused.mir").read_text().replace(
    "(batch = 8, hidden = 4096, n = 6144)", "(batch = 4, hidden = 3072, n = 5120)").replace(
    "grid=(192, 1, 1), threads=128, forloop=32", "grid=(40, 1, 1), threads=128, forloop=24")
