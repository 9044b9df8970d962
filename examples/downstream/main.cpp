// A downstream program: two mirage-cli programs (LoRA and RMSNorm + linear), each
// built at two batch sizes, linked into this one binary. Every call is checked
// against a CPU reference and timed.
//
//   downstream [--device N | --all-devices] [--iters K]
//
// --all-devices runs every visible device at once, one host thread per device, in
// this one process (the launchers set their per-device state on each device).
// Exit 0 when every check passes.
#include "lora_b1.h"
#include "lora_b8.h"
#include "rmsnorm_linear_b1.h"
#include "rmsnorm_linear_b8.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

std::mutex print_mutex;

#define LOG(...)                                        \
  do {                                                  \
    std::lock_guard<std::mutex> lock_(print_mutex);     \
    std::printf(__VA_ARGS__);                           \
    std::fflush(stdout);                                \
  } while (0)

// A host tensor: f16 values (as the device sees them) and their float copy.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<__half> h;
  std::vector<float> f;
  size_t numel() const {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    return n;
  }
};

Tensor random_tensor(std::vector<int64_t> shape, std::mt19937& rng, float scale) {
  Tensor t;
  t.shape = shape;
  std::uniform_real_distribution<float> u(-scale, scale);
  for (size_t i = 0; i < t.numel(); ++i) {
    t.h.push_back(__float2half(u(rng)));
    t.f.push_back(__half2float(t.h.back()));
  }
  return t;
}

// C[m,n] = A[m,k] @ B[k,n], in double.
std::vector<double> matmul(const std::vector<double>& a, const std::vector<double>& b,
                           int64_t m, int64_t k, int64_t n) {
  std::vector<double> c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p) {
      const double x = a[i * k + p];
      for (int64_t j = 0; j < n; ++j) c[i * n + j] += x * b[p * n + j];
    }
  return c;
}

std::vector<double> to_double(const Tensor& t) { return std::vector<double>(t.f.begin(), t.f.end()); }

struct Device {
  int id;
  cudaStream_t stream;
};

#define CUDA_OK(call)                                                              \
  do {                                                                             \
    cudaError_t e_ = (call);                                                       \
    if (e_ != cudaSuccess) {                                                       \
      LOG("device %d: %s failed: %s\n", dev.id, #call, cudaGetErrorString(e_));    \
      return false;                                                                \
    }                                                                              \
  } while (0)

// Device copies of `ins` and an output poisoned with NaN; the workspace.
struct Buffers {
  std::vector<void*> ins;
  void* out = nullptr;
  void* ws = nullptr;
};

bool upload(const Device& dev, const std::vector<const Tensor*>& ins, size_t out_bytes,
            size_t ws_bytes, Buffers& b) {
  for (const Tensor* t : ins) {
    void* p = nullptr;
    CUDA_OK(cudaMalloc(&p, t->numel() * sizeof(__half)));
    CUDA_OK(cudaMemcpy(p, t->h.data(), t->numel() * sizeof(__half), cudaMemcpyHostToDevice));
    b.ins.push_back(p);
  }
  CUDA_OK(cudaMalloc(&b.out, out_bytes));
  CUDA_OK(cudaMemset(b.out, 0xFF, out_bytes));  // 0xFFFF is a NaN in f16
  if (ws_bytes) CUDA_OK(cudaMalloc(&b.ws, ws_bytes));
  return true;
}

void release(Buffers& b) {
  for (void* p : b.ins) cudaFree(p);
  cudaFree(b.out);
  cudaFree(b.ws);
}

// Relative L2 error of the device output against `ref`; no NaN allowed.
bool compare(const Device& dev, const char* name, const Buffers& b,
             const std::vector<double>& ref, double* rel) {
  std::vector<__half> got(ref.size());
  CUDA_OK(cudaMemcpy(got.data(), b.out, got.size() * sizeof(__half), cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = __half2float(got[i]);
    if (std::isnan(g)) {
      LOG("device %d: %s: NaN at element %zu\n", dev.id, name, i);
      return false;
    }
    num += (g - ref[i]) * (g - ref[i]);
    den += ref[i] * ref[i];
  }
  *rel = std::sqrt(num / (den > 0 ? den : 1));
  return *rel <= 1e-2;
}

// Microseconds per call of `call`, averaged over `iters` calls after a warm-up.
template <class F>
bool time_calls(const Device& dev, int iters, F call, double* us) {
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  CUDA_OK(call());
  CUDA_OK(cudaEventRecord(a, dev.stream));
  for (int i = 0; i < iters; ++i) CUDA_OK(call());
  CUDA_OK(cudaEventRecord(b, dev.stream));
  CUDA_OK(cudaEventSynchronize(b));
  float ms = 0;
  CUDA_OK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  *us = 1000.0 * ms / iters;
  return true;
}

// --- LoRA: O = X @ W + (X @ A) @ B --------------------------------------------

using LoraFn = cudaError_t (*)(const void*, const void*, const void*, const void*, void*, void*,
                               cudaStream_t);
using LoraChecked = cudaError_t (*)(const void*, const int64_t*, int, const void*, const int64_t*,
                                    int, const void*, const int64_t*, int, const void*,
                                    const int64_t*, int, void*, const int64_t*, int, void*,
                                    size_t, cudaStream_t);

struct Lora {
  const char* name;
  int64_t m, k, n, r;  // X[m,k], W[k,n], A[k,r], B[r,n]
  size_t ws;
  LoraFn fn;
  LoraChecked checked;
};

#define LORA(P) \
  Lora { #P, P##_IN0_DIM0, P##_IN0_DIM1, P##_IN1_DIM1, P##_IN2_DIM1, P##_WORKSPACE_BYTES, P, P##_checked }

bool run_lora(const Device& dev, const Lora& L, const Lora& other, int iters) {
  std::mt19937 rng(1234 + static_cast<unsigned>(L.m));
  Tensor X = random_tensor({L.m, L.k}, rng, 1.0f), W = random_tensor({L.k, L.n}, rng, 0.05f),
         A = random_tensor({L.k, L.r}, rng, 0.05f), B = random_tensor({L.r, L.n}, rng, 0.05f);
  std::vector<double> xw = matmul(to_double(X), to_double(W), L.m, L.k, L.n);
  std::vector<double> xa = matmul(to_double(X), to_double(A), L.m, L.k, L.r);
  std::vector<double> xab = matmul(xa, to_double(B), L.m, L.r, L.n);
  for (size_t i = 0; i < xw.size(); ++i) xw[i] += xab[i];
  Buffers b;
  if (!upload(dev, {&X, &W, &A, &B}, xw.size() * sizeof(__half), L.ws, b)) return false;
  const int64_t out_shape[2] = {L.m, L.n};
  // The checked entry: the right shapes run; the other batch size's shapes are refused.
  CUDA_OK(L.checked(b.ins[0], X.shape.data(), 2, b.ins[1], W.shape.data(), 2, b.ins[2],
                    A.shape.data(), 2, b.ins[3], B.shape.data(), 2, b.out, out_shape, 2, b.ws,
                    L.ws, dev.stream));
  const int64_t wrong_x[2] = {other.m, other.k};
  if (L.checked(b.ins[0], wrong_x, 2, b.ins[1], W.shape.data(), 2, b.ins[2], A.shape.data(), 2,
                b.ins[3], B.shape.data(), 2, b.out, out_shape, 2, b.ws, L.ws, dev.stream) !=
      cudaErrorInvalidValue) {
    LOG("device %d: %s_checked accepted X of %lld rows\n", dev.id, L.name, (long long)other.m);
    return false;
  }
  CUDA_OK(cudaStreamSynchronize(dev.stream));
  double rel = 0, us = 0;
  const bool ok = compare(dev, L.name, b, xw, &rel);
  if (!time_calls(dev, iters, [&] { return L.fn(b.ins[0], b.ins[1], b.ins[2], b.ins[3], b.out,
                                                 b.ws, dev.stream); }, &us)) return false;
  LOG("device %d: %-20s rel err %.2e  %8.2f us/call  %s\n", dev.id, L.name, rel, us,
      ok ? "ok" : "FAILED");
  release(b);
  return ok;
}

// --- RMSNorm + linear: Z = (X / sqrt(mean(X^2, -1))) @ W ----------------------

using RmsFn = cudaError_t (*)(const void*, const void*, void*, void*, cudaStream_t);

struct Rms {
  const char* name;
  int64_t m, k, n;  // X[m,k], W[k,n]
  size_t ws;
  RmsFn fn;
};

#define RMS(P) Rms { #P, P##_IN0_DIM0, P##_IN0_DIM1, P##_IN1_DIM1, P##_WORKSPACE_BYTES, P }

bool run_rms(const Device& dev, const Rms& R, int iters) {
  std::mt19937 rng(99 + static_cast<unsigned>(R.m));
  Tensor X = random_tensor({R.m, R.k}, rng, 1.0f), W = random_tensor({R.k, R.n}, rng, 0.05f);
  std::vector<double> y = to_double(X);
  for (int64_t i = 0; i < R.m; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < R.k; ++j) ss += y[i * R.k + j] * y[i * R.k + j];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(R.k));
    for (int64_t j = 0; j < R.k; ++j) y[i * R.k + j] *= inv;
  }
  std::vector<double> z = matmul(y, to_double(W), R.m, R.k, R.n);
  Buffers b;
  if (!upload(dev, {&X, &W}, z.size() * sizeof(__half), R.ws, b)) return false;
  CUDA_OK(R.fn(b.ins[0], b.ins[1], b.out, b.ws, dev.stream));
  CUDA_OK(cudaStreamSynchronize(dev.stream));
  double rel = 0, us = 0;
  const bool ok = compare(dev, R.name, b, z, &rel);
  if (!time_calls(dev, iters, [&] { return R.fn(b.ins[0], b.ins[1], b.out, b.ws, dev.stream); },
                  &us)) return false;
  LOG("device %d: %-20s rel err %.2e  %8.2f us/call  %s\n", dev.id, R.name, rel, us,
      ok ? "ok" : "FAILED");
  release(b);
  return ok;
}

// An earlier, unrelated error must not be reported by the next call as its own.
bool earlier_error_is_not_ours(const Device& dev, const Rms& R) {
  void* p = nullptr;
  std::mt19937 rng(7);
  Tensor X = random_tensor({R.m, R.k}, rng, 1.0f), W = random_tensor({R.k, R.n}, rng, 0.05f);
  Buffers b;
  cudaGetLastError();
  if (cudaMalloc(&p, ~size_t(0) >> 1) == cudaSuccess) cudaFree(p);  // fails: far too large
  bool ok = upload(dev, {&X, &W}, static_cast<size_t>(R.m * R.n) * sizeof(__half), R.ws, b);
  const cudaError_t e = ok ? R.fn(b.ins[0], b.ins[1], b.out, b.ws, dev.stream) : cudaSuccess;
  if (e != cudaSuccess) {
    LOG("device %d: %s reported an earlier error as its own: %s\n", dev.id, R.name,
        cudaGetErrorString(e));
    ok = false;
  }
  cudaGetLastError();  // clear the deliberate error
  release(b);
  return ok;
}

bool run_device(int id, int iters) {
  Device dev{id, nullptr};
  CUDA_OK(cudaSetDevice(id));
  CUDA_OK(cudaStreamCreateWithFlags(&dev.stream, cudaStreamNonBlocking));
  const Lora l1 = LORA(lora_b1), l8 = LORA(lora_b8);
  const Rms r1 = RMS(rmsnorm_linear_b1), r8 = RMS(rmsnorm_linear_b8);
  bool ok = run_lora(dev, l1, l8, iters);
  ok = run_lora(dev, l8, l1, iters) && ok;
  ok = run_rms(dev, r1, iters) && ok;
  ok = run_rms(dev, r8, iters) && ok;
  ok = earlier_error_is_not_ours(dev, r8) && ok;
  cudaStreamDestroy(dev.stream);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  int device = 0, iters = 50;
  bool all = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--device") && i + 1 < argc) {
      device = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--all-devices")) {
      all = true;
    } else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--device N | --all-devices] [--iters K]\n", argv[0]);
      return 2;
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 2;
  }
  std::vector<int> devices;
  if (all) {
    for (int d = 0; d < count; ++d) devices.push_back(d);
  } else if (device >= 0 && device < count) {
    devices.push_back(device);
  } else {
    std::fprintf(stderr, "--device %d: %d device(s) visible\n", device, count);
    return 2;
  }
  std::vector<char> ok(devices.size(), 0);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < devices.size(); ++i)
    threads.emplace_back([&, i] { ok[i] = run_device(devices[i], iters); });
  for (std::thread& t : threads) t.join();
  int failed = 0;
  for (char o : ok) failed += !o;
  std::printf("%zu device(s), %d failed\n", devices.size(), failed);
  return failed ? 1 : 0;
}
