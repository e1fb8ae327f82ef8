//===- FlashAttentionTest.cpp - Fused bf16 attention against a reference --===//
//
// Runs the flash kernels (runtime/src/cuda/FlashAttention.cu) on random bf16
// operands and compares output and gradients with attention computed in
// double on the host from the same bf16 values. Shapes cover every head
// dimension with a kernel, sequence lengths that are not multiples of the
// 64-row tiles, causal masks with more keys than queries, and grouped-query
// heads. The same cases run through cuDNN's fused attention where this
// build has it (CudnnAttention.MatchesReference), and AttentionSpeed times
// both on GPT-2 350M's shape. Skips where there is no GPU.
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Tensor.h"
#include "runtime/src/cuda/CudnnAttention.h"
#include "runtime/src/cuda/FlashAttention.h"

#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <vector>

using namespace loom::rt;

namespace {

struct Case {
  int b, s, t, heads, kv, d;
  bool causal;
  bool packed = false; // q|k|v side by side in one [B, S, W] tensor (self-attention), dq|dk|dv likewise
};

std::vector<uint16_t> randomBf16(size_t n, std::mt19937 &rng, std::vector<double> &values) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> out(n);
  values.resize(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = floatToBf16(dist(rng));
    values[i] = bf16ToFloat(out[i]);
  }
  return out;
}

double relativeL2(const std::vector<double> &want, const std::vector<uint16_t> &got) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    double d = bf16ToFloat(got[i]) - want[i];
    num += d * d;
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

void *upload(const std::vector<uint16_t> &host) {
  void *p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, host.size() * 2), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  return p;
}
std::vector<uint16_t> download(void *p, size_t n) {
  std::vector<uint16_t> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), p, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

void check(const Case &c, bool cudnnAttention = false) {
  SCOPED_TRACE(testing::Message() << "B=" << c.b << " S=" << c.s << " T=" << c.t << " H=" << c.heads
                                  << " KV=" << c.kv << " D=" << c.d << (c.causal ? " causal" : "")
                                  << (c.packed ? " packed" : ""));
  std::mt19937 rng(c.s * 131 + c.d);
  size_t nq = size_t(c.b) * c.s * c.heads * c.d, nk = size_t(c.b) * c.t * c.kv * c.d;
  std::vector<double> q, k, v, dout;
  auto hq = randomBf16(nq, rng, q), hk = randomBf16(nk, rng, k), hv = randomBf16(nk, rng, v),
       hdo = randomBf16(nq, rng, dout);
  double scale = 1.0 / std::sqrt(double(c.d));
  int group = c.heads / c.kv, shift = c.t - c.s;
  std::vector<double> o(nq, 0), dq(nq, 0), dk(nk, 0), dv(nk, 0);
  auto qi = [&](int b, int i, int h, int d) { return ((size_t(b) * c.s + i) * c.heads + h) * c.d + d; };
  auto ki = [&](int b, int j, int h, int d) { return ((size_t(b) * c.t + j) * c.kv + h) * c.d + d; };
  for (int b = 0; b < c.b; ++b)
    for (int h = 0; h < c.heads; ++h) {
      int hk_ = h / group;
      for (int i = 0; i < c.s; ++i) {
        std::vector<double> p(c.t, 0.0);
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < c.t; ++j) {
          if (c.causal && j > i + shift)
            continue;
          double x = 0;
          for (int d = 0; d < c.d; ++d)
            x += q[qi(b, i, h, d)] * k[ki(b, j, hk_, d)];
          p[j] = x * scale;
          mx = std::max(mx, p[j]);
        }
        for (int j = 0; j < c.t; ++j)
          p[j] = c.causal && j > i + shift ? 0.0 : std::exp(p[j] - mx), sum += p[j];
        for (int j = 0; j < c.t; ++j)
          p[j] /= sum;
        for (int d = 0; d < c.d; ++d) {
          double acc = 0;
          for (int j = 0; j < c.t; ++j)
            acc += p[j] * v[ki(b, j, hk_, d)];
          o[qi(b, i, h, d)] = acc;
        }
        // Gradients: dP = dO V^T, dS = P (dP - rowsum(dO o)).
        double di = 0;
        for (int d = 0; d < c.d; ++d)
          di += dout[qi(b, i, h, d)] * o[qi(b, i, h, d)];
        for (int j = 0; j < c.t; ++j) {
          double dp = 0;
          for (int d = 0; d < c.d; ++d)
            dp += dout[qi(b, i, h, d)] * v[ki(b, j, hk_, d)];
          double ds = p[j] * (dp - di);
          for (int d = 0; d < c.d; ++d) {
            dv[ki(b, j, hk_, d)] += p[j] * dout[qi(b, i, h, d)];
            dq[qi(b, i, h, d)] += scale * ds * k[ki(b, j, hk_, d)];
            dk[ki(b, j, hk_, d)] += scale * ds * q[qi(b, i, h, d)];
          }
        }
      }
    }
  flash::Params p;
  p.batch = c.b, p.s = c.s, p.t = c.t, p.heads = c.heads, p.kvHeads = c.kv, p.headDim = c.d, p.causal = c.causal;
  p.scale = float(scale);
  // Packed: one [B, S, W] tensor holds q|k|v per row, another receives dq|dk|dv.
  int64_t wq = int64_t(c.heads) * c.d, wk = int64_t(c.kv) * c.d, W = wq + 2 * wk;
  size_t rows = size_t(c.b) * c.s;
  auto pack = [&](const std::vector<uint16_t> &a, const std::vector<uint16_t> &b, const std::vector<uint16_t> &v) {
    std::vector<uint16_t> x(rows * W);
    for (size_t r = 0; r < rows; ++r) {
      std::copy_n(a.begin() + r * wq, wq, x.begin() + r * W);
      std::copy_n(b.begin() + r * wk, wk, x.begin() + r * W + wq);
      std::copy_n(v.begin() + r * wk, wk, x.begin() + r * W + wq + wk);
    }
    return x;
  };
  auto unpack = [&](const std::vector<uint16_t> &x, int64_t at, int64_t width) {
    std::vector<uint16_t> out(rows * width);
    for (size_t r = 0; r < rows; ++r)
      std::copy_n(x.begin() + r * W + at, width, out.begin() + r * width);
    return out;
  };
  void *dQ, *dK, *dV, *packedX = nullptr, *packedG = nullptr;
  if (c.packed) {
    ASSERT_EQ(c.s, c.t);
    packedX = upload(pack(hq, hk, hv));
    dQ = packedX, dK = static_cast<uint16_t *>(packedX) + wq, dV = static_cast<uint16_t *>(packedX) + wq + wk;
    p.ldq = p.ldk = p.lddq = p.lddk = W;
  } else {
    dQ = upload(hq), dK = upload(hk), dV = upload(hv);
  }
  void *dDO = upload(hdo);
  void *dO = nullptr, *gQ = nullptr, *gK = nullptr, *gV = nullptr, *ws = nullptr;
  ASSERT_EQ(cudaMalloc(&dO, nq * 2), cudaSuccess);
  if (c.packed) {
    ASSERT_EQ(cudaMalloc(&packedG, rows * W * 2), cudaSuccess);
    gQ = packedG, gK = static_cast<uint16_t *>(packedG) + wq, gV = static_cast<uint16_t *>(packedG) + wq + wk;
  } else {
    ASSERT_EQ(cudaMalloc(&gQ, nq * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&gK, nk * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&gV, nk * 2), cudaSuccess);
  }
  ASSERT_EQ(cudaMalloc(&ws, flash::backwardWorkspace(p)), cudaSuccess);
  float *lse = nullptr;
  ASSERT_EQ(cudaMalloc(&lse, size_t(c.b) * c.heads * c.s * sizeof(float)), cudaSuccess);
  p.q = dQ, p.k = dK, p.v = dV;
  std::unique_ptr<cudnn::Attention> fused;
  if (cudnnAttention) {
    std::string why;
    fused = cudnn::build(p, /*backward=*/true, why);
    ASSERT_TRUE(fused) << why;
    cudaFree(ws);
    ASSERT_EQ(cudaMalloc(&ws, std::max<size_t>(fused->workspaceBytes(), 16)), cudaSuccess);
  }
  auto result = [&](void *at, int64_t offset, int64_t width, size_t n) {
    return c.packed ? unpack(download(packedG, rows * W), offset, width) : download(at, n);
  };
  // Twice: the backward recomputing the forward, then reusing its O and lse.
  for (bool reuse : {false, true}) {
    if (fused && !reuse)
      continue; // cuDNN's backward always takes the forward's O and statistics
    SCOPED_TRACE(reuse ? "backward with the forward's O and lse" : "backward recomputing the forward");
    ASSERT_EQ(c.packed ? cudaMemset(packedG, 0xff, rows * W * 2) : cudaMemset(gQ, 0xff, nq * 2),
              cudaSuccess); // NaNs unless written
    if (fused) {
      ASSERT_EQ(fused->forward(dO, lse, ws, nullptr), "");
      ASSERT_EQ(fused->backward(dO, lse, dDO, gQ, gK, gV, ws, nullptr), "");
    } else {
      ASSERT_EQ(flash::forward(p, dO, reuse ? lse : nullptr, nullptr), cudaSuccess);
      ASSERT_EQ(flash::backward(p, dDO, gQ, gK, gV, ws, nullptr, reuse ? dO : nullptr, reuse ? lse : nullptr),
                cudaSuccess);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    // bf16 inputs are exact in the reference; what differs is P rounded to
    // bf16 before its products and the bf16 results (about 2^-9 each).
    EXPECT_LT(relativeL2(o, download(dO, nq)), 1e-2) << "O";
    EXPECT_LT(relativeL2(dq, result(gQ, 0, wq, nq)), 2e-2) << "dQ";
    EXPECT_LT(relativeL2(dk, result(gK, wq, wk, nk)), 2e-2) << "dK";
    EXPECT_LT(relativeL2(dv, result(gV, wq + wk, wk, nk)), 2e-2) << "dV";
  }
  if (c.packed)
    for (void *ptr : {packedX, packedG})
      cudaFree(ptr);
  else
    for (void *ptr : {dQ, dK, dV, gQ, gK, gV})
      cudaFree(ptr);
  for (void *ptr : {dDO, dO, ws, static_cast<void *>(lse)})
    cudaFree(ptr);
}

} // namespace

TEST(FlashAttention, MatchesReference) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    GTEST_SKIP() << "no CUDA device";
  for (Case c : {Case{2, 100, 100, 4, 4, 64, true}, Case{1, 64, 64, 2, 2, 16, false},
                 Case{2, 37, 150, 4, 2, 32, true}, Case{1, 130, 130, 2, 1, 128, true},
                 Case{1, 200, 77, 2, 2, 64, false}, Case{1, 256, 256, 8, 2, 64, true},
                 Case{2, 100, 100, 4, 4, 64, true, true}, Case{1, 130, 130, 4, 2, 32, true, true}})
    check(c);
}

TEST(CudnnAttention, MatchesReference) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    GTEST_SKIP() << "no CUDA device";
  if (!cudnn::compiledIn())
    GTEST_SKIP() << "this build has no cuDNN frontend";
  for (Case c : {Case{2, 100, 100, 4, 4, 64, true}, Case{1, 64, 64, 2, 2, 16, false},
                 Case{1, 130, 130, 2, 1, 128, true}, Case{1, 256, 256, 8, 2, 64, true},
                 Case{2, 100, 100, 4, 4, 64, true, true}, Case{1, 130, 130, 4, 2, 32, true, true}})
    check(c, /*cudnnAttention=*/true);
}

/// Forward and backward of GPT-2 350M's attention (batch 8, 16 heads of 64,
/// 1024 tokens, causal, q|k|v packed), 20 of each captured in a CUDA graph:
/// the GPU's time per call without launch overheads, ours and cuDNN's.
TEST(AttentionSpeed, Gpt2Medium) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    GTEST_SKIP() << "no CUDA device";
  const int64_t B = 8, S = 1024, H = 16, D = 64, W = 3 * H * D;
  flash::Params p;
  p.batch = B, p.s = S, p.t = S, p.heads = H, p.kvHeads = H, p.headDim = D, p.causal = true;
  p.scale = 0.125f, p.ldq = p.ldk = p.lddq = p.lddk = W;
  std::mt19937 rng(7);
  std::vector<double> ignored;
  void *x = upload(randomBf16(size_t(B * S * W), rng, ignored)), *dout = upload(randomBf16(size_t(B * S * H * D), rng, ignored));
  void *o = nullptr, *g = nullptr, *ws = nullptr;
  float *lse = nullptr;
  ASSERT_EQ(cudaMalloc(&o, B * S * H * D * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&g, B * S * W * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&lse, B * H * S * 4), cudaSuccess);
  p.q = x, p.k = static_cast<char *>(x) + 2 * H * D, p.v = static_cast<char *>(x) + 4 * H * D;
  char *gq = static_cast<char *>(g), *gk = gq + 2 * H * D, *gv = gq + 4 * H * D;
  std::string why;
  std::unique_ptr<cudnn::Attention> fused = cudnn::compiledIn() ? cudnn::build(p, true, why) : nullptr;
  size_t wsBytes = std::max(flash::backwardWorkspace(p), fused ? fused->workspaceBytes() : 0);
  ASSERT_EQ(cudaMalloc(&ws, wsBytes), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto time = [&](const std::function<void()> &call) {
    call(); // warm-up, outside the graph
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    for (int i = 0; i < 20; ++i)
      call();
    EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    cudaEvent_t a, b;
    cudaEventCreate(&a), cudaEventCreate(&b);
    cudaGraphLaunch(exec, stream);
    cudaEventRecord(a, stream);
    cudaGraphLaunch(exec, stream);
    cudaEventRecord(b, stream);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    cudaGraphExecDestroy(exec), cudaGraphDestroy(graph), cudaEventDestroy(a), cudaEventDestroy(b);
    return ms * 1000 / 20;
  };
  float ffwd = time([&] { flash::forward(p, o, lse, stream); });
  float fbwd = time([&] { flash::backward(p, dout, gq, gk, gv, ws, stream, o, lse); });
  std::printf("flash attention: forward %.1f us, backward %.1f us per call\n", ffwd, fbwd);
  if (fused) {
    float cfwd = time([&] { EXPECT_EQ(fused->forward(o, lse, ws, stream), ""); });
    float cbwd = time([&] { EXPECT_EQ(fused->backward(o, lse, dout, gq, gk, gv, ws, stream), ""); });
    std::printf("cuDNN attention: forward %.1f us, backward %.1f us per call\n", cfwd, cbwd);
  } else {
    std::printf("cuDNN attention: not timed (%s)\n", why.c_str());
  }
  cudaStreamDestroy(stream);
  for (void *ptr : {x, dout, o, g, ws, static_cast<void *>(lse)})
    cudaFree(ptr);
}
