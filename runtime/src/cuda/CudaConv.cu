//===- CudaConv.cu - Convolutional networks (forward) ----------------------===//
//
// Convolutions as GEMMs over an im2col workspace (the image itself for
// 1x1 stride-1 kernels), batch normalisation with the batch's statistics,
// and max and average pooling, on f32. Their gradients run on the CPU
// backend.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"

#include <array>

namespace loom::rt::cuda {
namespace {

/// col[n][g][ci, kh, kw][oh, ow] = x[n][g * Cg + ci][oh * stride - pad + kh][ow * stride - pad + kw]
/// (zero outside the image): a convolution becomes one GEMM per image and group.
struct ConvShape {
  int64_t N, C, H, W, groups, Cg, KH, KW, Ho, Wo, stride, pad;
};
__global__ void im2colKernel(const float *x, float *col, ConvShape s) {
  int64_t K = s.Cg * s.KH * s.KW, P = s.Ho * s.Wo, total = s.N * s.groups * K * P;
  GRID_LOOP(i, total) {
    int64_t pos = i % P, k = (i / P) % K, ng = i / (P * K), g = ng % s.groups, n = ng / s.groups;
    int64_t ci = k / (s.KH * s.KW), kh = (k / s.KW) % s.KH, kw = k % s.KW;
    int64_t ih = (pos / s.Wo) * s.stride - s.pad + kh, iw = (pos % s.Wo) * s.stride - s.pad + kw;
    col[i] = ih >= 0 && ih < s.H && iw >= 0 && iw < s.W
                 ? x[((n * s.C + g * s.Cg + ci) * s.H + ih) * s.W + iw]
                 : 0.0f;
  }
}

/// Batch normalisation with the batch's statistics (as the CPU backend):
/// a block per channel, mean then variance over N x inner.
__global__ void batchNormKernel(const float *x, const float *g, const float *b, float *y, int64_t n, int64_t ch,
                                int64_t inner, float eps) {
  __shared__ float shared[32];
  int64_t c = blockIdx.x, count = n * inner;
  auto at = [&](int64_t i) { return ((i / inner) * ch + c) * inner + i % inner; };
  float sum = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x)
    sum += x[at(i)];
  float mean = blockSum(sum, shared) / float(count);
  float sq = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x)
    sq += (x[at(i)] - mean) * (x[at(i)] - mean);
  float inv = rsqrtf(blockSum(sq, shared) / float(count) + eps);
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x)
    y[at(i)] = (x[at(i)] - mean) * inv * g[c] + b[c];
}

/// Max or average pooling (the average counts the padding, as the CPU backend).
__global__ void poolKernel(bool max, const float *x, float *y, int64_t nc, int64_t H, int64_t W, int64_t Ho,
                           int64_t Wo, int64_t k, int64_t stride, int64_t pad) {
  GRID_LOOP(i, nc * Ho * Wo) {
    int64_t ow = i % Wo, oh = (i / Wo) % Ho, plane = i / (Ho * Wo);
    float acc = max ? -INFINITY : 0.0f;
    for (int64_t kh = 0; kh < k; ++kh)
      for (int64_t kw = 0; kw < k; ++kw) {
        int64_t ih = oh * stride - pad + kh, iw = ow * stride - pad + kw;
        if (ih < 0 || ih >= H || iw < 0 || iw >= W)
          continue;
        float v = x[(plane * H + ih) * W + iw];
        acc = max ? fmaxf(acc, v) : acc + v;
      }
    y[i] = max ? acc : acc / float(k * k);
  }
}

} // namespace

/// A convolution as GEMMs: W_g [Og, Cg*KH*KW] x col [Cg*KH*KW, Ho*Wo] per
/// image and group, where col is the image itself for 1x1 stride-1 kernels.
Launch CudaBackendImpl::buildConv2d(const Instruction &ins) {
  const Buffer &x = buf(ins.in[0]), &w = buf(ins.in[1]), &o = buf(ins.out[0]);
  ConvShape c{x.shape[0], x.shape[1], x.shape[2], x.shape[3], int64_t(num(ins, "groups", 1)), w.shape[1],
              w.shape[2], w.shape[3], o.shape[2], o.shape[3], int64_t(num(ins, "stride", 1)),
              int64_t(num(ins, "padding", 0))};
  int64_t O = w.shape[0], Og = O / c.groups, K = c.Cg * c.KH * c.KW, P = c.Ho * c.Wo;
  float *px = f(ins.in[0]), *pw = f(ins.in[1]), *po = f(ins.out[0]);
  bool direct = c.KH == 1 && c.KW == 1 && c.stride == 1 && c.pad == 0; // col == x
  if (!direct)
    reserve(size_t(c.N * c.groups * K * P) * sizeof(float));
  GemmTypes t; // f32 on TF32 tensor cores
  // Offsets (elements) of every (image, group) GEMM's operands.
  std::vector<std::array<int64_t, 3>> offsets;
  int64_t align = 0;
  for (int64_t n = 0; n < c.N; ++n)
    for (int64_t g = 0; g < c.groups; ++g) {
      int64_t a = g * Og * K, b = direct ? (n * c.C + g * c.Cg) * c.H * c.W : (n * c.groups + g) * K * P,
              out = (n * O + g * Og) * P;
      offsets.push_back({a, b, out});
      align |= (a | b | out) * 4;
    }
  // The GEMM plan is timed on the real result buffer and the image (or a
  // workspace-sized stand-in: the workspace is allocated after planning).
  float *colPlan = direct ? px : nullptr;
  if (!direct)
    LOOM_CUDA_CHECK(cudaMalloc(&colPlan, size_t(c.N * c.groups * K * P) * sizeof(float)));
  auto plan = planGemm(t, false, false, Og, P, K, pw, K, colPlan, P, po, P, align ? align : 256);
  if (!direct)
    cudaFree(colPlan);
  return [=](cudaStream_t s) {
    float *col = direct ? px : reinterpret_cast<float *>(workspace);
    if (!direct)
      im2colKernel<<<blocksFor(c.N * c.groups * K * P), kThreads, 0, s>>>(px, col, c);
    for (const auto &off : offsets)
      gemm(*plan, pw + off[0], col + off[1], po + off[2], s);
  };
}

Launch CudaBackendImpl::buildBatchNorm(const Instruction &ins) {
  const Buffer &x = buf(ins.in[0]);
  int64_t n = x.shape[0], ch = x.shape[1], inner = count(x.shape) / std::max<int64_t>(n * ch, 1);
  float eps = static_cast<float>(num(ins, "eps", 1e-5));
  float *px = f(ins.in[0]), *g = f(ins.in[1]), *b = f(ins.in[2]), *y = f(ins.out[0]);
  return [=](cudaStream_t s) { batchNormKernel<<<unsigned(ch), kThreads, 0, s>>>(px, g, b, y, n, ch, inner, eps); };
}

Launch CudaBackendImpl::buildPool(const Instruction &ins) {
  const std::string &op = ins.op;
  const Buffer &x = buf(ins.in[0]), &o = buf(ins.out[0]);
  int64_t k = int64_t(num(ins, "kernel", 1)), stride = int64_t(num(ins, "stride", 1)), pad = int64_t(num(ins, "padding", 0));
  float *px = f(ins.in[0]), *py = f(ins.out[0]);
  int64_t nc = x.shape[0] * x.shape[1], H = x.shape[2], W = x.shape[3], Ho = o.shape[2], Wo = o.shape[3];
  bool max = op == "max_pool2d";
  return [=](cudaStream_t s) {
    poolKernel<<<blocksFor(nc * Ho * Wo), kThreads, 0, s>>>(max, px, py, nc, H, W, Ho, Wo, k, stride, pad);
  };
}

void CudaBackendImpl::addConvBuilders(BuilderTable &table) {
  table["conv2d"] = &CudaBackendImpl::buildConv2d;
  table["batchnorm"] = &CudaBackendImpl::buildBatchNorm;
  for (const char *op : {"max_pool2d", "avg_pool2d"})
    table[op] = &CudaBackendImpl::buildPool;
}

} // namespace loom::rt::cuda
