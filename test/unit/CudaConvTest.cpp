//===- CudaConvTest.cpp - CNN instructions: CUDA backend against CPU ------===//
//
// Each convolution, pooling and batch-norm instruction (forward and
// gradient) runs alone on random operands on the CUDA backend and on the
// CPU backend (the reference that defines the instructions), and their
// results are compared. Shapes cover 1x1, 3x3 and 7x7 kernels, stride 2,
// padding, groups and batch norms with several blocks per channel (alone
// and with a fused ReLU); f32
// with full f32 products (TF32 off for the whole binary) and bf16 with
// bf16's tolerance; NCHW, and NHWC (`layout = "nhwc"`: the same cases with
// their tensors channels last, filters OHWI) as loom-nhwc-layout compiles
// for the GPU. Skips where there is no GPU.
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Bundle.h"
#include "loom/rt/Tensor.h"
#include "runtime/src/Backend.h"
#include "runtime/src/cuda/CudnnConv.h"
#include "test/unit/GpuAgainstCpu.h"

#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace loom::rt;
using loom::rt::test::Operands;
using loom::rt::test::floatBytes;
using loom::rt::test::programFor;
using loom::rt::test::compare;
using loom::rt::test::haveGpu;
using loom::rt::test::kTf32Off;

namespace {

/// An NCHW (or OIHW) shape stored channels last: NHWC (or OHWI).
Shape channelsLast(const Shape &s) { return {s[0], s[2], s[3], s[1]}; }

/// The shape as the layout stores it, and the layout's attribute.
Shape laidOut(const Shape &s, bool nhwc) { return nhwc ? channelsLast(s) : s; }
nlohmann::json withLayout(nlohmann::json attrs, bool nhwc) {
  if (nhwc)
    attrs["layout"] = "nhwc";
  return attrs;
}

struct ConvCase {
  Shape x, w;
  int64_t stride, pad, groups;
};

const ConvCase kConvCases[] = {
    {{2, 8, 6, 6}, {16, 8, 1, 1}, 1, 0, 1},   // 1x1 (the bottlenecks' first and last)
    {{2, 8, 7, 7}, {16, 8, 1, 1}, 2, 0, 1},   // 1x1 stride 2 (the downsampling shortcut)
    {{2, 8, 9, 9}, {8, 8, 3, 3}, 1, 1, 1},    // 3x3, padded
    {{2, 8, 10, 10}, {16, 8, 3, 3}, 2, 1, 1}, // 3x3 stride 2 (v1.5's downsampling)
    {{2, 3, 20, 20}, {8, 3, 7, 7}, 2, 3, 1},  // the 7x7 stem
    {{2, 8, 6, 6}, {8, 4, 3, 3}, 1, 1, 2},    // grouped
};

void convolutions(loom_dtype_t dt, double tol, bool nhwc = false) {
  for (const ConvCase &c : kConvCases) {
    int64_t ho = (c.x[2] + 2 * c.pad - c.w[2]) / c.stride + 1, wo = (c.x[3] + 2 * c.pad - c.w[3]) / c.stride + 1;
    Shape x = laidOut(c.x, nhwc), w = laidOut(c.w, nhwc), y = laidOut({c.x[0], c.w[0], ho, wo}, nhwc);
    nlohmann::json attrs = withLayout({{"stride", c.stride}, {"padding", c.pad}, {"groups", c.groups}}, nhwc);
    compare("conv2d", {{x, w}, {y}}, attrs, dt, tol);
    compare("conv2d_grad_input", {{y, w}, {x}}, attrs, dt, tol);
    compare("conv2d_grad_filter", {{x, y}, {w}}, attrs, dt, tol);
  }
}

struct PoolCase {
  Shape x;
  int64_t kernel, stride, pad;
};

const PoolCase kPoolCases[] = {
    {{2, 4, 9, 9}, 3, 2, 1},   // ResNet's max pool (overlapping windows)
    {{2, 3, 8, 8}, 2, 2, 0},   // disjoint windows
    {{2, 3, 7, 7}, 3, 1, 1},   // stride 1, padded
    {{2, 2, 7, 7}, 7, 1, 0},   // one window over the image (a global average)
    {{2, 16, 9, 9}, 3, 2, 1},  // NHWC: eight channels a thread (max pooling's byte-per-window pass)
};

void pooling(loom_dtype_t dt, double tol, bool nhwc = false) {
  for (const PoolCase &c : kPoolCases) {
    int64_t ho = (c.x[2] + 2 * c.pad - c.kernel) / c.stride + 1, wo = (c.x[3] + 2 * c.pad - c.kernel) / c.stride + 1;
    Shape x = laidOut(c.x, nhwc), y = laidOut({c.x[0], c.x[1], ho, wo}, nhwc);
    nlohmann::json attrs = withLayout({{"kernel", c.kernel}, {"stride", c.stride}, {"padding", c.pad}}, nhwc);
    compare("max_pool2d", {{x}, {y}}, attrs, dt, tol);
    compare("max_pool2d_grad", {{x, y}, {x}}, attrs, dt, tol);
    compare("avg_pool2d", {{x}, {y}}, attrs, dt, tol);
    compare("avg_pool2d_grad", {{y}, {x}}, attrs, dt, tol);
  }
}

const Shape kBatchNormCases[] = {
    {4, 6, 5, 5},    // one block per channel
    {16, 3, 40, 40}, // several blocks per channel, added in double
    {3, 5, 1, 1},    // 1x1 images (a norm over the batch only)
    {4, 70, 6, 6},   // NHWC: channels over several blocks of 32, the last one partial
    {16, 8, 40, 40}, // NHWC: eight channels a thread, many slices of rows
    {2, 320, 5, 5},  // NHWC: eight channels a thread (40 groups: blocks of 240 threads, flat kernels)
    {2, 2064, 3, 3}, // NHWC: more than 2,048 channels, the tiled eight-channel kernels
};

void batchNorms(loom_dtype_t dt, double tol, bool nhwc = false) {
  for (const Shape &nchw : kBatchNormCases) {
    Shape x = laidOut(nchw, nhwc), c{nchw[1]};
    nlohmann::json attrs = withLayout({{"eps", 1e-5}}, nhwc);
    nlohmann::json relu = attrs;
    relu["activation"] = "relu"; // batch norm + ReLU fused; the gradient's fourth input is the ReLU's output
    for (double mean : {0.0, 3.0}) { // 3: the mean well away from zero next to the spread
      compare("batchnorm", {{x, c, c}, {x}}, attrs, dt, tol, mean);
      compare("batchnorm_grad", {{x, c, x}, {x, c, c}}, attrs, dt, tol, mean);
      compare("batchnorm", {{x, c, c}, {x}}, relu, dt, tol, mean);
      compare("batchnorm_grad", {{x, c, x, x}, {x, c, c}}, relu, dt, tol, mean);
    }
  }
}

} // namespace

// Full f32 products: cuDNN's FMA-only algorithms against the CPU's double
// accumulation; summation order is the only difference.
TEST(CudaConv, ConvolutionsF32) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(kTf32Off);
  convolutions(LOOM_F32, 1e-4);
}

// bf16 operands and results, f32 accumulation on both sides: results differ
// by bf16 roundings (2^-9 relative) where the sums land near a tie.
TEST(CudaConv, ConvolutionsBf16) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  convolutions(LOOM_BF16, 1e-2);
}

TEST(CudaConv, PoolingF32) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  pooling(LOOM_F32, 1e-6);
}

TEST(CudaConv, PoolingBf16) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  pooling(LOOM_BF16, 1e-2);
}

// The GPU adds in f32 within a block (double across blocks), the CPU in
// double: dgamma's sums of ~25,000 terms differ by a few 1e-6 at worst.
TEST(CudaConv, BatchNormF32) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  batchNorms(LOOM_F32, 1e-4);
}

TEST(CudaConv, BatchNormBf16) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  batchNorms(LOOM_BF16, 1e-2);
}

// Channels last (what loom-nhwc-layout compiles for the GPU): cuDNN with
// CUDNN_TENSOR_NHWC descriptors and OHWI filters, and our NHWC batch-norm
// and pooling kernels, against the CPU backend's NHWC forms at the same
// tolerances as NCHW.
TEST(CudaConv, ConvolutionsNhwcF32) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(kTf32Off);
  convolutions(LOOM_F32, 1e-4, true);
}

TEST(CudaConv, ConvolutionsNhwcBf16) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  convolutions(LOOM_BF16, 1e-2, true);
}

TEST(CudaConv, PoolingNhwcF32) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  pooling(LOOM_F32, 1e-6, true);
}

TEST(CudaConv, PoolingNhwcBf16) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  pooling(LOOM_BF16, 1e-2, true);
}

TEST(CudaConv, BatchNormNhwcF32) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  batchNorms(LOOM_F32, 1e-4, true);
}

TEST(CudaConv, BatchNormNhwcBf16) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  batchNorms(LOOM_BF16, 1e-2, true);
}

// A run of SGD updates (what ResNet-50's update program is: 161 of them) in
// one launch, against the CPU backend's one at a time: momentum, weight
// decay and clipping by a given norm, bf16 gradients as --target cuda
// trains, two steps so that the momentum carries.
TEST(CudaConv, SgdRun) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  loom::rt::test::ProgramBuilder p;
  int64_t step = p.add({1}, LOOM_F32, "step"), norm = p.add({1}, LOOM_F32, "norm");
  nlohmann::json attrs = {{"lr", 0.1}, {"momentum", 0.9}, {"weight_decay", 1e-4}, {"clip", 1.0}};
  std::vector<Instruction> program;
  std::vector<int64_t> params, moments;
  for (int64_t n : {5000, 3, 70000}) { // a chunk's tail, a tensor smaller than a chunk, many chunks
    int64_t w = p.add({n}, LOOM_F32, "w"), g = p.add({n}, LOOM_BF16, "g"), m = p.add({n}, LOOM_F32, "m");
    program.push_back(Instruction{"sgd", {w, g, m, step, norm}, {w, m}, attrs});
    params.push_back(w), moments.push_back(m);
  }
  RankProgram r = p.finish(program);
  auto cpu = makeCpuBackend(r, 2);
  auto gpu = makeCudaBackend(r, 0);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (const Buffer &b : r.buffers) {
    std::vector<char> bytes = floatBytes(b, [&](int64_t) {
      return b.id == step ? 1.0f : b.id == norm ? 2.5f : b.name[0] == 'm' ? 0.0f : dist(rng);
    });
    cpu->upload(b, bytes.data());
    gpu->upload(b, bytes.data());
  }
  for (Backend *be : {cpu.get(), gpu.get()}) {
    be->prepare("forward", program);
    be->run("forward");
    be->run("forward");
  }
  for (std::vector<int64_t> *ids : {&params, &moments})
    for (int64_t id : *ids) {
      const Buffer &b = r.buffers[id];
      int64_t n = numElements(b.shape).value();
      std::vector<float> got(n), want(n);
      gpu->download(b, got.data());
      cpu->download(b, want.data());
      for (int64_t i = 0; i < n; ++i)
        ASSERT_NEAR(got[i], want[i], 1e-6 * (1 + std::fabs(want[i]))) << b.name << "[" << i << "]";
    }
}

// How convolution engines are chosen (cudnn::fastestCandidate): the candidate
// that takes least time wins, whatever the order, and one that fails is
// passed over. The candidates here are device-to-device copies of 1, 64 and
// 16 MiB and one that fails.
TEST(CudaConv, FastestCandidateTimed) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const size_t mib = size_t(1) << 20, sizes[] = {64 * mib, 1 * mib, 0, 16 * mib};
  void *from = nullptr, *to = nullptr;
  ASSERT_EQ(cudaMalloc(&from, 64 * mib), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&to, 64 * mib), cudaSuccess);
  auto copy = [&](int i) {
    return sizes[i] != 0 && cudaMemcpyAsync(to, from, sizes[i], cudaMemcpyDeviceToDevice, nullptr) == cudaSuccess;
  };
  float ms = 0;
  EXPECT_EQ(loom::rt::cudnn::fastestCandidate(4, copy, ms), 1);
  EXPECT_GT(ms, 0.0f);
  EXPECT_LT(ms, 1.0f); // 1 MiB at hundreds of GB/s
  EXPECT_EQ(loom::rt::cudnn::fastestCandidate(1, [](int) { return false; }, ms), -1);
  cudaFree(from);
  cudaFree(to);
}
