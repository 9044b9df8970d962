// Storage types and helpers. The device code needs no header, so NVRTC compiles it
// without a CUDA toolkit; f16/bf16 are converted with PTX instructions.
struct __align__(2) mg_f16 { unsigned short bits; };
struct __align__(2) mg_bf16 { unsigned short bits; };

__device__ __forceinline__ float mg_ld(float v) { return v; }
__device__ __forceinline__ float mg_ld(mg_f16 v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
__device__ __forceinline__ float mg_ld(mg_bf16 v) {
  return __uint_as_float(((unsigned)v.bits) << 16);
}
__device__ __forceinline__ void mg_st(float* p, float v) { *p = v; }
__device__ __forceinline__ void mg_st(mg_f16* p, float v) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  p->bits = h;
}
__device__ __forceinline__ void mg_st(mg_bf16* p, float v) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  p->bits = h;
}
// Programmatic dependent launch (sm_90 and later): the entry point lets each kernel
// start while the kernel before it in the stream drains. Each kernel waits here, and
// returns once that kernel has finished and its writes are visible. Before the wait
// a kernel only computes addresses and copies the first pipeline stages of inputs
// that no kernel still running can be writing: inputs declared `weight`, or any
// input of the program once an earlier kernel of this call has waited. On a launch
// without the attribute the wait returns at once; before sm_90 it is not emitted.
__device__ __forceinline__ void mg_grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// After its wait, each kernel lets the next one in the stream launch: its blocks take
// the SMs this kernel's blocks free and copy their weights while this one finishes.
// Released only after the wait, so a kernel launched early never runs alongside the
// kernel two places ahead of it.
__device__ __forceinline__ void mg_grid_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// exp(x) as one ex2.approx of x * log2(e): the multiply and MUFU.EX2, where expf's range
// reduction takes about ten instructions (an attention kernel runs one exp per score
// element: its loop is bound by issuing instructions). Relative error below
// |x| * 2^-23 + 2^-22; subnormal results are kept (not .ftz), infinities and NaN pass.
__device__ __forceinline__ float mg_exp(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504088896341f));
  return y;
}
// 1 / x as one rcp.approx (MUFU.RCP), within 1 ulp over the whole range (subnormal
// results kept: not .ftz; infinities, zeros and NaN as IEEE division gives them).
__device__ __forceinline__ float mg_rcp(float x) {
  float r;
  asm("rcp.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
// a / b within 2 ulp of the rounded quotient: a times the reciprocal of b, a subnormal
// b (whose reciprocal would overflow) scaled by 2^24 first. The IEEE `/` is a
// refinement sequence with a call to a slow path for special operands (3.3 KB more code
// in gated_mlp's kernel); with approximate divisions in their epilogues, gated_mlp and
// rmsnorm_linear ran 0.4-1.4 us faster a call on an H200 (docs/perf-log.md v51).
__device__ __forceinline__ float mg_div(float a, float b) {
  const float s = fabsf(b) < 1.17549435e-38f ? 16777216.0f : 1.0f;
  return a * mg_rcp(b * s) * s;
}
// x * sigmoid(x): the denominator is at least 1, so its reciprocal needs no scaling
// (it is 0 where exp(-x) overflows, as the limit is).
__device__ __forceinline__ float mg_silu(float x) { return x * mg_rcp(1.0f + mg_exp(-x)); }
__device__ __forceinline__ float mg_gelu(float x) {
  return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}
// Sum (max) over aligned groups of `lanes` lanes (a power of two up to the warp).
__device__ __forceinline__ float mg_warp_sum(float v, int lanes = 32) {
#pragma unroll
  for (int o = lanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float mg_warp_max(float v, int lanes = 32) {
#pragma unroll
  for (int o = lanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// A whole block's sum (max) of v, returned to every thread: warp shuffles, then the
// warps' results through `red` (one float per warp). `red` is free again on return.
__device__ __forceinline__ float mg_block_sum(float v, float* red) {
  v = mg_warp_sum(v);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  v = 0.0f;
  for (int w = 0; w < (int)(blockDim.x / 32); ++w) v += red[w];
  __syncthreads();
  return v;
}
__device__ __forceinline__ float mg_block_max(float v, float* red) {
  v = mg_warp_max(v);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < (int)(blockDim.x / 32); ++w) v = fmaxf(v, red[w]);
  __syncthreads();
  return v;
}
// 16-byte asynchronous global->shared copies (sm_80+), in commit groups.
__device__ __forceinline__ void mg_cp_async16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void mg_cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void mg_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
__device__ __forceinline__ void mg_cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}
// An element of a concatenation read where its two parts are (codegen/joins.py):
// element o of the joined tensor is element o % P of a period of P elements, the first
// H of which are the first part's (one period of it), the rest the second part's.
template <int P, int H, typename T>
__device__ __forceinline__ const T* mg_join(const T* a, const T* b, int o) {
  const int q = o / P, r = o - q * P;
  return r < H ? a + q * H + r : b + q * (P - H) + (r - H);
}
// A shifted join (codegen/joins.py): the concatenation of rows of H elements and rows
// of P - H < E elements along the last dimension, where the first part's rows start
// anywhere in a chunk of E elements (16 bytes). A staged tile keeps, in each of its
// rows, the aligned chunks that cover that row's first-part elements: chunk j of the
// tile row that starts at element o of the joined tensor, copied only where it starts
// inside the first part's row (whose buffer is whole chunks: no copy reads past it).
template <int P, int H, int E, typename T>
__device__ __forceinline__ void mg_cp_shifted(T* dst, const T* a, int o, int j) {
  const int q = o / P, c = o - q * P;
  const int at = ((q * H + c) & ~(E - 1)) + j * E;
  if (c < H && at < (q + 1) * H) mg_cp_async16(dst, a + at);
}
// The 16 bits of element (r, c) of such a tile (rows `pitch` apart) whose row 0 starts
// at element o of the joined tensor (its rows P apart): at its row's shift in shared
// memory where its column is the first part's, else the second part's in global memory.
template <int P, int H, int E, typename T>
__device__ __forceinline__ unsigned mg_shifted16(const T* sm, int pitch, const T* b, int o,
                                                 int r, int c) {
  const int q = o / P + r, c0 = o % P;
  if (c0 + c < H) return sm[r * pitch + ((q * H + c0) & (E - 1)) + c].bits;
  return b[q * (P - H) + (c0 + c - H)].bits;
}
// Bulk tensor copies (TMA, sm_90): a tensor map (encoded by the host, passed by value
// as a __grid_constant__ parameter) describes a device tensor and a box; one thread
// copies a box into shared memory, and the copy's bytes complete a phase of an
// mbarrier on which every thread waits. Before sm_90 these are never called.
struct __align__(64) mg_tmap { unsigned long long q[16]; };
__device__ __forceinline__ unsigned mg_smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mg_mbar_init(unsigned long long* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(mg_smem_addr(b)) : "memory");
#endif
}
__device__ __forceinline__ void mg_mbar_fence_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// Expect `bytes` more on the barrier's current phase, without arriving.
__device__ __forceinline__ void mg_mbar_expect(unsigned long long* b, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;"
               :: "r"(mg_smem_addr(b)), "r"(bytes) : "memory");
#endif
}
// Arrive (the phase's one arrival) expecting `bytes` more.
__device__ __forceinline__ void mg_mbar_arrive_expect(unsigned long long* b, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(mg_smem_addr(b)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mg_mbar_wait(unsigned long long* b, int parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("{\n .reg .pred p;\n MG_WAIT:\n"
               " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
               " @!p bra MG_WAIT;\n}" :: "r"(mg_smem_addr(b)), "r"(parity) : "memory");
#endif
}
// The cache policy of a tensor the grid reads once (no block reads another's tile: a
// weight streamed by a decode matmul, a head's key and value cache): the first evicted
// from the L2, so that the stream does not push out what is read again (the activations
// every block reads, the outputs, the kernel's code). 0.05-0.4 us a call off
// rmsnorm_linear and gated_mlp on an H200 (docs/perf-log.md v51).
__device__ __forceinline__ unsigned long long mg_l2_evict_first() {
  unsigned long long p = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));  // pure: CSE it
#endif
  return p;
}
// A bulk tensor copy of the box at coordinates c0.. of map m into dst, its bytes
// completing on mbarrier b; kOnce: with the read-once cache policy above.
template <bool kOnce = false>
__device__ __forceinline__ void mg_tma2(void* dst, const mg_tmap* m, int c0, int c1,
                                        unsigned long long* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kOnce) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5;"
                 :: "r"(mg_smem_addr(dst)), "l"(m), "r"(c0), "r"(c1),
                    "r"(mg_smem_addr(b)), "l"(mg_l2_evict_first()) : "memory");
  } else {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(mg_smem_addr(dst)), "l"(m), "r"(c0), "r"(c1),
                    "r"(mg_smem_addr(b)) : "memory");
  }
#endif
}
template <bool kOnce = false>
__device__ __forceinline__ void mg_tma3(void* dst, const mg_tmap* m, int c0, int c1, int c2,
                                        unsigned long long* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kOnce) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".L2::cache_hint [%0], [%1, {%2, %3, %4}], [%5], %6;"
                 :: "r"(mg_smem_addr(dst)), "l"(m), "r"(c0), "r"(c1), "r"(c2),
                    "r"(mg_smem_addr(b)), "l"(mg_l2_evict_first()) : "memory");
  } else {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];"
                 :: "r"(mg_smem_addr(dst)), "l"(m), "r"(c0), "r"(c1), "r"(c2),
                    "r"(mg_smem_addr(b)) : "memory");
  }
#endif
}
template <bool kOnce = false>
__device__ __forceinline__ void mg_tma4(void* dst, const mg_tmap* m, int c0, int c1, int c2, int c3,
                                        unsigned long long* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kOnce) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".L2::cache_hint [%0], [%1, {%2, %3, %4, %5}], [%6], %7;"
                 :: "r"(mg_smem_addr(dst)), "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                    "r"(mg_smem_addr(b)), "l"(mg_l2_evict_first()) : "memory");
  } else {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 :: "r"(mg_smem_addr(dst)), "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                    "r"(mg_smem_addr(b)) : "memory");
  }
#endif
}
template <bool kOnce = false>
__device__ __forceinline__ void mg_tma5(void* dst, const mg_tmap* m, int c0, int c1, int c2, int c3, int c4,
                                        unsigned long long* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kOnce) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".L2::cache_hint [%0], [%1, {%2, %3, %4, %5, %6}], [%7], %8;"
                 :: "r"(mg_smem_addr(dst)), "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4),
                    "r"(mg_smem_addr(b)), "l"(mg_l2_evict_first()) : "memory");
  } else {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
                 :: "r"(mg_smem_addr(dst)), "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4),
                    "r"(mg_smem_addr(b)) : "memory");
  }
#endif
}
// Tensor cores: D = A * B + D, m16n8k16, f32 accumulators; operands packed from f32.
__device__ __forceinline__ unsigned mg_pack_f16(float lo, float hi) {
  unsigned d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ unsigned mg_pack_bf16(float lo, float hi) {
  unsigned d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
// Two 16-bit products, each rounded once: the product of two 16-bit values is exact in
// f32, so this is the f32 product rounded to the dtype (bf16 by fma with -0: sm_80 has
// no bf16x2 multiply).
__device__ __forceinline__ unsigned mg_hmul2_f16(unsigned a, unsigned b) {
  unsigned d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ unsigned mg_hmul2_bf16(unsigned a, unsigned b) {
  unsigned d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}
__device__ __forceinline__ unsigned mg_pack_f162(float2 v) { return mg_pack_f16(v.x, v.y); }
__device__ __forceinline__ unsigned mg_pack_bf162(float2 v) { return mg_pack_bf16(v.x, v.y); }
// The two 16-bit elements of a packed register (an mma fragment), as floats.
__device__ __forceinline__ void mg_unpack_f16(unsigned u, float& lo, float& hi) {
  lo = mg_ld(mg_f16{(unsigned short)(u & 0xffffu)});
  hi = mg_ld(mg_f16{(unsigned short)(u >> 16)});
}
__device__ __forceinline__ void mg_unpack_bf16(unsigned u, float& lo, float& hi) {
  lo = __uint_as_float(u << 16);
  hi = __uint_as_float(u & 0xffff0000u);
}
template <typename T>
__device__ __forceinline__ unsigned mg_bits2(T lo, T hi) {
  return (unsigned)lo.bits | ((unsigned)hi.bits << 16);
}
__device__ __forceinline__ void mg_mma_f16(float* d, unsigned a0, unsigned a1, unsigned a2,
                                           unsigned a3, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mg_mma_bf16(float* d, unsigned a0, unsigned a1, unsigned a2,
                                            unsigned a3, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// ldmatrix: four (or two, transposed) 8x8 matrices of 16-bit elements from shared
// memory, one 16-byte row address per lane, straight into mma operand registers.
__device__ __forceinline__ void mg_ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2,
                                           unsigned& r3, const void* p) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(s));
}
__device__ __forceinline__ void mg_ldsm_x2_t(unsigned& r0, unsigned& r1, const void* p) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
               : "=r"(r0), "=r"(r1) : "r"(s));
}
__device__ __forceinline__ void mg_ldsm_x4_t(unsigned& r0, unsigned& r1, unsigned& r2,
                                             unsigned& r3, const void* p) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(s));
}
// Eight f32 values rounded and stored as one 16-byte access.
struct __align__(16) mg_u4 { unsigned x, y, z, w; };
__device__ __forceinline__ void mg_st8(mg_f16* p, float v0, float v1, float v2, float v3,
                                       float v4, float v5, float v6, float v7) {
  mg_u4 u = {mg_pack_f16(v0, v1), mg_pack_f16(v2, v3), mg_pack_f16(v4, v5),
             mg_pack_f16(v6, v7)};
  *reinterpret_cast<mg_u4*>(p) = u;
}
__device__ __forceinline__ void mg_st8(mg_bf16* p, float v0, float v1, float v2, float v3,
                                       float v4, float v5, float v6, float v7) {
  mg_u4 u = {mg_pack_bf16(v0, v1), mg_pack_bf16(v2, v3), mg_pack_bf16(v4, v5),
             mg_pack_bf16(v6, v7)};
  *reinterpret_cast<mg_u4*>(p) = u;
}
// Eight f32 values kept in f32 (a wider store than the tile's, docs/ir.md): two
// 16-byte accesses.
__device__ __forceinline__ void mg_st8(float* p, float v0, float v1, float v2, float v3,
                                       float v4, float v5, float v6, float v7) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v0, v1, v2, v3);
  reinterpret_cast<float4*>(p)[1] = make_float4(v4, v5, v6, v7);
}
// Eight 16-bit values from one 16-byte (aligned) access, as f32.
template <typename T>
__device__ __forceinline__ void mg_ld8(const T* p, float* f) {
  const mg_u4 u = *reinterpret_cast<const mg_u4*>(p);
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    T lo, hi;
    lo.bits = (unsigned short)(w[i] & 0xffffu);
    hi.bits = (unsigned short)(w[i] >> 16);
    f[2 * i] = mg_ld(lo);
    f[2 * i + 1] = mg_ld(hi);
  }
}
// (Host compilation sees these too: nvcc parses every kernel body in its host pass.)
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// Thread-block clusters (sm_90): a barrier over every thread of the cluster (release /
// acquire, so shared-memory writes before it are seen after it), and a load from (a
// store to) the shared memory of block `rank` of the cluster at the address `p` has in
// this block.
__device__ __forceinline__ void mg_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The two halves of that barrier, apart: a block arrives once it reads no peer's shared
// memory any more, and waits before it exits (its own shared memory must outlive the
// peers' reads of it).
__device__ __forceinline__ void mg_cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void mg_cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The shared::cluster address of what `p` points to here, in block `rank` of the cluster.
__device__ __forceinline__ unsigned mg_mapa(const void* p, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(r) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
  return r;
}
__device__ __forceinline__ float4 mg_dsmem_ld4(const float* p, unsigned rank) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(mg_mapa(p, rank)) : "memory");
  return v;
}
__device__ __forceinline__ float mg_dsmem_ld(const float* p, unsigned rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(mg_mapa(p, rank)) : "memory");
  return v;
}
__device__ __forceinline__ void mg_dsmem_st(float* p, unsigned rank, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(mg_mapa(p, rank)), "f"(v) : "memory");
}
// The push form of a cluster's combine (push=1): every block arrives once at its start,
// block 0 after initialising the mbarrier that counts the bytes pushed to it; the
// others wait on that before their first push, which stores into block 0's shared
// memory (at the address `p` has here) and completes as many bytes of its mbarrier
// (at the address `bar` has here). Block 0 arrives expecting them and waits, both with
// cluster scope: the bytes come from other blocks.
__device__ __forceinline__ void mg_cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void mg_push4(const float* p, float4 v, const unsigned long long* bar,
                                         unsigned rank) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 "
               "[%0], {%1, %2, %3, %4}, [%5];"
               :: "r"(mg_mapa(p, rank)), "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)),
                  "r"(__float_as_uint(v.z)), "r"(__float_as_uint(v.w)),
                  "r"(mg_mapa(bar, rank)) : "memory");
}
__device__ __forceinline__ void mg_push(const float* p, float v, const unsigned long long* bar,
                                        unsigned rank) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
               :: "r"(mg_mapa(p, rank)), "r"(__float_as_uint(v)), "r"(mg_mapa(bar, rank))
               : "memory");
}
__device__ __forceinline__ void mg_mbar_arrive_expect_cluster(unsigned long long* b,
                                                              unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cluster.shared::cta.b64 _, [%0], %1;"
               :: "r"(mg_smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mg_mbar_wait_cluster(unsigned long long* b, int parity) {
  asm volatile("{\n .reg .pred p;\n MG_CWAIT:\n"
               " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
               " @!p bra MG_CWAIT;\n}"
               :: "r"(mg_smem_addr(b)), "r"(parity) : "memory");
}
#endif
// Warpgroup matrix multiply (wgmma, sm_90a): 4 consecutive warps multiply 64 rows; each
// warp's A fragments and accumulators are those of mma.m16n8k16 over its 16 rows, so a
// kernel switches between the two paths without touching its registers. B is read from
// shared memory through a descriptor: a 64-column box of 16-bit elements, rows of 128
// bytes with the 128-byte swizzle of a bulk tensor copy, 1024-byte aligned groups of 8
// rows (stride 1024), N contiguous (the transposed, "MN-major" B). Compiled only for the
// arch-specific target (sm_90a); elsewhere the kernels take their ldmatrix path.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ unsigned long long mg_wg_desc(const void* p) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  return (unsigned long long)((a & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ void mg_wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void mg_wg_commit_wait() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
// The operands of one m64n64k16: this warp's 32 accumulators (8 m16n8 fragments of its
// 16 rows over the box's 64 columns), its 4 A registers, B's descriptor; the predicate
// p = 1 accumulates into d.
#define MG_WG_ACC(d) "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define MG_WG_OPS "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
__device__ __forceinline__ void mg_wgmma_f16(float (*d)[4], unsigned a0, unsigned a1,
                                             unsigned a2, unsigned a3, unsigned long long b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " MG_WG_OPS
               : MG_WG_ACC(d) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
}
__device__ __forceinline__ void mg_wgmma_bf16(float (*d)[4], unsigned a0, unsigned a1,
                                              unsigned a2, unsigned a3, unsigned long long b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " MG_WG_OPS
               : MG_WG_ACC(d) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
}
#endif
