//===- CudaConv.cu - Convolutional networks -------------------------------===//
//
// Convolutions and their input and filter gradients through cuDNN
// (CudnnConv.cpp), f32 or bf16, NCHW or NHWC (`layout = "nhwc"`, what the
// compiler chooses for the GPU); where the build has no cuDNN (or
// LOOM_CUDA_CONV=im2col asks), the NCHW forward on f32 as GEMMs over an
// im2col workspace. Batch normalisation with the batch's statistics and its
// gradient, and max and average pooling and their gradients, are our
// kernels on f32 or bf16 (f32 math), in either layout, with the CPU
// backend's semantics.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"
#include "runtime/src/cuda/CudnnConv.h"

#include <array>
#include <cstdlib>

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

/// Per-channel sums of a batch norm's input over N x inner, shifted by the
/// channel's first value K = x[0, c, 0] so that the variance does not
/// cancel where the mean is large next to the spread: {Σ(x - K),
/// Σ(x - K)², Σdy, Σdy(x - K)} (the last two for the gradient). A grid of
/// (channel, slice) blocks adds its slices in double (sums zeroed first).
/// One element's part of a channel's batch-norm sums: of x - shift and its
/// square, and with dy (counted only where a fused ReLU's output `act` is
/// positive) of dy and dy (x - shift).
__device__ inline void addToSums(const DPtr &x, const DPtr &dy, const DPtr &act, int64_t at, float shift, float *s) {
  float v = x[at] - shift;
  s[0] += v;
  s[1] += v * v;
  if (dy) {
    float d = act && !(act[at] > 0.0f) ? 0.0f : dy[at];
    s[2] += d;
    s[3] += d * v;
  }
}

/// With `act` (a fused ReLU's output), dy counts only where act > 0.
__global__ void batchNormSumsKernel(DPtr x, DPtr dy, DPtr act, double *sums, int64_t n, int64_t ch, int64_t inner) {
  __shared__ float shared[32];
  int64_t c = blockIdx.x, count = n * inner;
  float shift = x[c * inner];
  float s[4] = {0, 0, 0, 0};
  for (int64_t i = blockIdx.y * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.y) * blockDim.x) {
    addToSums(x, dy, act, ((i / inner) * ch + c) * inner + i % inner, shift, s);
  }
  for (int t = 0; t < (dy ? 4 : 2); ++t) {
    float total = blockSum(s[t], shared);
    if (threadIdx.x == 0)
      atomicAdd(&sums[c * 4 + t], double(total));
  }
}

/// batchNormSumsKernel for channels last: a block of 32 x 8 threads reads 32
/// neighbouring channels of 8 positions at a time (coalesced), each thread
/// keeping its channel's sums, shifted by the channel's first value x[0, 0,
/// 0, c]; the block adds its 8 rows of sums before one atomic per channel
/// and sum. `rows` is N x H x W.
constexpr int kNhwcRows = 8;
__global__ void batchNormSumsNhwcKernel(DPtr x, DPtr dy, DPtr act, double *sums, int64_t rows, int64_t ch) {
  __shared__ float shared[4][kNhwcRows][33];
  int64_t c = blockIdx.x * 32 + threadIdx.x;
  float s[4] = {0, 0, 0, 0};
  if (c < ch) {
    float shift = x[c];
    for (int64_t r = blockIdx.y * int64_t(kNhwcRows) + threadIdx.y; r < rows; r += int64_t(gridDim.y) * kNhwcRows) {
      addToSums(x, dy, act, r * ch + c, shift, s);
    }
  }
  for (int t = 0; t < 4; ++t)
    shared[t][threadIdx.y][threadIdx.x] = s[t];
  __syncthreads();
  if (threadIdx.y == 0 && c < ch)
    for (int t = 0; t < (dy ? 4 : 2); ++t) {
      float total = 0;
      for (int r = 0; r < kNhwcRows; ++r)
        total += shared[t][r][threadIdx.x];
      atomicAdd(&sums[c * 4 + t], double(total));
    }
}

/// A channel's mean and 1 / sqrt(var + eps) (the biased variance, as the
/// CPU backend), and for the gradient g·Σdy / count and g·Σdy·x̂ / count.
struct BatchNormStats {
  float mean, rstd, a, b;
};

/// From the sums: each channel's statistics, and for the gradient
/// dgamma = Σdy·x̂ and dbeta = Σdy (dgamma null for the forward). The shift
/// K is x[c * channelStride] (inner for NCHW, 1 for NHWC).
__global__ void batchNormStatsKernel(DPtr x, const double *sums, DPtr gamma, BatchNormStats *stats, DPtr dgamma,
                                     DPtr dbeta, int64_t ch, int64_t channelStride, int64_t count, double eps) {
  GRID_LOOP(c, ch) {
    const double *s = sums + c * 4;
    double centred = s[0] / double(count); // mean - K
    double var = fmax(s[1] / double(count) - centred * centred, 0.0), rstd = 1.0 / sqrt(var + eps);
    BatchNormStats st{float(double(x[c * channelStride]) + centred), float(rstd), 0.0f, 0.0f};
    if (dgamma) {
      // Σdy(x - mean) = Σdy(x - K) - (mean - K)·Σdy
      double sumDy = s[2], sumDyXh = rstd * (s[3] - centred * s[2]), g = gamma[c];
      dgamma.st(c, float(sumDyXh));
      dbeta.st(c, float(sumDy));
      st.a = float(g * sumDy / double(count));
      st.b = float(g * sumDyXh / double(count));
    }
    stats[c] = st;
  }
}

/// y = (x - mean) · rstd · gamma + beta, then max(y, 0) with a fused ReLU.
__global__ void batchNormApplyKernel(DPtr x, DPtr gamma, DPtr beta, const BatchNormStats *stats, DPtr y,
                                     int64_t total, int64_t ch, int64_t inner, bool nhwc, bool relu) {
  GRID_LOOP(i, total) {
    int64_t c = nhwc ? i % ch : (i / inner) % ch;
    BatchNormStats s = stats[c];
    float v = (x[i] - s.mean) * s.rstd * gamma[c] + beta[c];
    y.st(i, relu && !(v > 0.0f) ? 0.0f : v);
  }
}

/// dx = rstd · (gamma · dy - g·Σdy / count - x̂ · g·Σdy·x̂ / count), the CPU
/// backend's formula; with `act`, dy counts only where act > 0.
__global__ void batchNormGradApplyKernel(DPtr x, DPtr gamma, DPtr dy, DPtr act, const BatchNormStats *stats,
                                         DPtr dx, int64_t total, int64_t ch, int64_t inner, bool nhwc) {
  GRID_LOOP(i, total) {
    int64_t c = nhwc ? i % ch : (i / inner) % ch;
    BatchNormStats s = stats[c];
    float xh = (x[i] - s.mean) * s.rstd, d = act && !(act[i] > 0.0f) ? 0.0f : dy[i];
    dx.st(i, s.rstd * (gamma[c] * d - s.a - xh * s.b));
  }
}

/// A pooling's sizes; the tensors are NCHW, or NHWC with nhwc.
struct PoolShape {
  int64_t N, C, H, W, Ho, Wo, k, stride, pad;
  bool nhwc;
};

/// The index of [n, c, h, w] in a tensor of height `hs` and width `ws`.
__device__ inline int64_t poolAt(const PoolShape &p, int64_t n, int64_t c, int64_t h, int64_t w, int64_t hs,
                                 int64_t ws) {
  return p.nhwc ? ((n * hs + h) * ws + w) * p.C + c : ((n * p.C + c) * hs + h) * ws + w;
}

/// The [n, c, h, w] of element i of a tensor of height `hs` and width `ws`.
__device__ inline void poolSplit(const PoolShape &p, int64_t i, int64_t hs, int64_t ws, int64_t &n, int64_t &c,
                                 int64_t &h, int64_t &w) {
  if (p.nhwc) {
    c = i % p.C, i /= p.C, w = i % ws, i /= ws, h = i % hs, n = i / hs;
  } else {
    w = i % ws, i /= ws, h = i % hs, i /= hs, c = i % p.C, n = i / p.C;
  }
}

/// Max or average pooling (the average counts the padding, as the CPU backend).
__global__ void poolKernel(bool max, DPtr x, DPtr y, PoolShape p) {
  GRID_LOOP(i, p.N * p.C * p.Ho * p.Wo) {
    int64_t n, c, oh, ow;
    poolSplit(p, i, p.Ho, p.Wo, n, c, oh, ow);
    float acc = max ? -INFINITY : 0.0f;
    for (int64_t kh = 0; kh < p.k; ++kh)
      for (int64_t kw = 0; kw < p.k; ++kw) {
        int64_t ih = oh * p.stride - p.pad + kh, iw = ow * p.stride - p.pad + kw;
        if (ih < 0 || ih >= p.H || iw < 0 || iw >= p.W)
          continue;
        float v = x[poolAt(p, n, c, ih, iw, p.H, p.W)];
        acc = max ? fmaxf(acc, v) : acc + v;
      }
    y.st(i, max ? acc : acc / float(p.k * p.k));
  }
}

/// Pooling's gradient, gathered: each input position adds the gradients of
/// the windows that hold it (no atomics, so bf16 results and a fixed order).
/// A max window passes its gradient to its first largest value in the CPU
/// backend's scan order (rows, then columns; strictly greater replaces).
__global__ void poolGradKernel(bool max, DPtr x, DPtr dy, DPtr dx, PoolShape p) {
  GRID_LOOP(i, p.N * p.C * p.H * p.W) {
    int64_t n, c, ih, iw;
    poolSplit(p, i, p.H, p.W, n, c, ih, iw);
    // Windows oh with oh·stride - pad <= ih <= oh·stride - pad + k - 1.
    int64_t loH = ih + p.pad - p.k + 1, loW = iw + p.pad - p.k + 1;
    int64_t ohBegin = loH <= 0 ? 0 : (loH + p.stride - 1) / p.stride, ohEnd = (ih + p.pad) / p.stride + 1;
    int64_t owBegin = loW <= 0 ? 0 : (loW + p.stride - 1) / p.stride, owEnd = (iw + p.pad) / p.stride + 1;
    ohEnd = ohEnd < p.Ho ? ohEnd : p.Ho;
    owEnd = owEnd < p.Wo ? owEnd : p.Wo;
    float acc = 0.0f;
    for (int64_t oh = ohBegin; oh < ohEnd; ++oh)
      for (int64_t ow = owBegin; ow < owEnd; ++ow) {
        float g = dy[poolAt(p, n, c, oh, ow, p.Ho, p.Wo)];
        if (!max) {
          acc += g / float(p.k * p.k);
          continue;
        }
        int64_t bestH = -1, bestW = -1;
        float best = -INFINITY;
        for (int64_t kh = 0; kh < p.k; ++kh)
          for (int64_t kw = 0; kw < p.k; ++kw) {
            int64_t h = oh * p.stride - p.pad + kh, w = ow * p.stride - p.pad + kw;
            if (h < 0 || h >= p.H || w < 0 || w >= p.W)
              continue;
            float v = x[poolAt(p, n, c, h, w, p.H, p.W)];
            if (v > best)
              best = v, bestH = h, bestW = w;
          }
        if (bestH == ih && bestW == iw)
          acc += g;
      }
    dx.st(i, acc);
  }
}

} // namespace

/// Whether an instruction's `layout` says channels last.
bool channelsLast(const Instruction &ins, const std::string &where) {
  auto it = ins.attrs.find("layout");
  if (it == ins.attrs.end())
    return false;
  std::string layout = it->is_string() ? it->get<std::string>() : "";
  if (layout != "nchw" && layout != "nhwc")
    fail(LOOM_INVALID_BUNDLE, where, ": layout must be nchw or nhwc, got ", it->dump());
  return layout == "nhwc";
}

/// A convolution as GEMMs: W_g [Og, Cg*KH*KW] x col [Cg*KH*KW, Ho*Wo] per
/// image and group, where col is the image itself for 1x1 stride-1 kernels.
Launch CudaBackendImpl::buildIm2colConv2d(const Instruction &ins) {
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

/// cuDNN runs the convolutions unless this build has none or
/// LOOM_CUDA_CONV=im2col asks for our forward (f32; to compare against).
Launch CudaBackendImpl::buildConv2d(const Instruction &ins) {
  static const std::string mode = [] {
    const char *e = std::getenv("LOOM_CUDA_CONV");
    return std::string(e ? e : "cudnn");
  }();
  if (mode != "cudnn" && mode != "im2col")
    fail(LOOM_INVALID_ARGUMENT, "LOOM_CUDA_CONV is '", mode, "'; use cudnn or im2col");
  if (mode == "im2col" || !cudnn::convolutionCompiledIn()) {
    if (channelsLast(ins, where))
      fail(LOOM_UNSUPPORTED, where, ": NHWC convolutions run through cuDNN (",
           cudnn::convolutionCompiledIn() ? "LOOM_CUDA_CONV=im2col asks for the NCHW GEMMs"
                                          : "this runtime was built without it",
           "); compile the bundle with --layout nchw");
    return buildIm2colConv2d(ins);
  }
  return buildCudnnConv2d(ins);
}

/// conv2d (x, filter -> y), conv2d_grad_input (dy, filter -> dx) and
/// conv2d_grad_filter (x, dy -> dfilter) through cuDNN; every operand f32
/// or every operand bf16.
Launch CudaBackendImpl::buildCudnnConv2d(const Instruction &ins) {
  using cudnn::ConvPass;
  ConvPass pass = ins.op == "conv2d_grad_input"    ? ConvPass::GradInput
                  : ins.op == "conv2d_grad_filter" ? ConvPass::GradFilter
                                                   : ConvPass::Forward;
  const Buffer &x = pass == ConvPass::GradInput ? buf(ins.out[0]) : buf(ins.in[0]);
  const Buffer &w = pass == ConvPass::GradFilter ? buf(ins.out[0]) : buf(ins.in[1]);
  const Buffer &y = pass == ConvPass::Forward ? buf(ins.out[0]) : pass == ConvPass::GradInput ? buf(ins.in[0]) : buf(ins.in[1]);
  DPtr a = fp(ins.in[0]), b = fp(ins.in[1]), out = fp(ins.out[0]);
  if (a.bf != b.bf || a.bf != out.bf)
    fail(LOOM_UNSUPPORTED, where, ": the CUDA backend's convolutions take operands of one dtype (f32 or bf16)");
  cudnn::ConvGeometry g;
  g.nhwc = channelsLast(ins, where);
  if (g.nhwc) { // x [n, h, w, c], filter [o, kh, kw, c / groups], y [n, ho, wo, o]
    g.n = x.shape[0], g.h = x.shape[1], g.w = x.shape[2], g.c = x.shape[3];
    g.o = w.shape[0], g.kh = w.shape[1], g.kw = w.shape[2], g.ho = y.shape[1], g.wo = y.shape[2];
  } else {
    g.n = x.shape[0], g.c = x.shape[1], g.h = x.shape[2], g.w = x.shape[3];
    g.o = w.shape[0], g.kh = w.shape[2], g.kw = w.shape[3], g.ho = y.shape[2], g.wo = y.shape[3];
  }
  g.stride = int64_t(num(ins, "stride", 1)), g.pad = int64_t(num(ins, "padding", 0));
  g.groups = int64_t(num(ins, "groups", 1));
  g.bf16 = a.bf;
  g.tf32 = f32Compute() == CUBLAS_COMPUTE_32F_FAST_TF32;
  std::string why;
  std::shared_ptr<cudnn::Convolution> conv = cudnn::buildConvolution(g, pass, a.p, b.p, why);
  if (!conv)
    fail(LOOM_UNSUPPORTED, where, ": ", why);
  reserve(conv->workspaceBytes());
  std::string what = where;
  return [=](cudaStream_t s) {
    if (std::string e = conv->run(a.p, b.p, out.p, workspace, s); !e.empty())
      fail(LOOM_INTERNAL, what, ": cuDNN convolution failed: ", e);
  };
}

namespace {
/// Blocks per channel for batchNormSumsKernel: enough for the GPU to be
/// busy with few channels, each thread still adding a few dozen values.
unsigned batchNormSlices(int64_t count) {
  return unsigned(std::clamp<int64_t>((count + kThreads * 32 - 1) / (kThreads * 32), 1, 65535));
}

/// A batch norm's input as [n, ch, inner]: the channel is dimension 1, or
/// the last with layout nhwc; relu: a ReLU fused after it (activation).
struct BatchNormDims {
  int64_t n, ch, inner;
  bool nhwc, relu;
};
BatchNormDims batchNormDims(const Instruction &ins, const Shape &x, const std::string &where) {
  bool nhwc = channelsLast(ins, where);
  auto act = ins.attrs.find("activation");
  bool relu = act != ins.attrs.end();
  if (relu && !(act->is_string() && act->get<std::string>() == "relu"))
    fail(LOOM_INVALID_BUNDLE, where, ": activation must be relu, got ", act->dump());
  if (relu && ins.op == "batchnorm_grad" && ins.in.size() != 4)
    fail(LOOM_INVALID_BUNDLE, where, ": batchnorm_grad with activation relu takes the ReLU's output as a fourth input");
  int64_t n = x[0], ch = nhwc ? x.back() : x[1];
  return {n, ch, numElements(x).value_or(0) / std::max<int64_t>(n * ch, 1), nhwc, relu};
}

/// The per-channel sums of x (and dy, masked by act) into `sums`, zeroed first.
void launchBatchNormSums(const BatchNormDims &d, DPtr x, DPtr dy, DPtr act, double *sums, cudaStream_t s) {
  LOOM_CUDA_CHECK(cudaMemsetAsync(sums, 0, size_t(d.ch) * 4 * sizeof(double), s));
  if (d.nhwc) {
    int64_t rows = d.n * d.inner;
    unsigned slices = unsigned(std::clamp<int64_t>((rows + kNhwcRows * 32 - 1) / (kNhwcRows * 32), 1, 65535));
    batchNormSumsNhwcKernel<<<dim3(unsigned((d.ch + 31) / 32), slices), dim3(32, kNhwcRows), 0, s>>>(
        x, dy, act, sums, rows, d.ch);
  } else {
    batchNormSumsKernel<<<dim3(unsigned(d.ch), batchNormSlices(d.n * d.inner)), kThreads, 0, s>>>(
        x, dy, act, sums, d.n, d.ch, d.inner);
  }
}
} // namespace

/// Batch normalisation with the batch's statistics: per-channel sums (one
/// read of x), the statistics, then y. The sums and statistics live in the
/// workspace.
Launch CudaBackendImpl::buildBatchNorm(const Instruction &ins) {
  BatchNormDims d = batchNormDims(ins, buf(ins.in[0]).shape, where);
  int64_t n = d.n, ch = d.ch, inner = d.inner, total = n * ch * inner, channelStride = d.nhwc ? 1 : inner;
  bool nhwc = d.nhwc, relu = d.relu;
  double eps = num(ins, "eps", 1e-5);
  DPtr x = fp(ins.in[0]), g = fp(ins.in[1]), b = fp(ins.in[2]), y = fp(ins.out[0]);
  size_t sumsBytes = (size_t(ch) * 4 * sizeof(double) + 255) / 256 * 256;
  reserve(sumsBytes + size_t(ch) * sizeof(BatchNormStats));
  return [=](cudaStream_t s) {
    double *sums = reinterpret_cast<double *>(workspace);
    auto *stats = reinterpret_cast<BatchNormStats *>(workspace + sumsBytes);
    launchBatchNormSums(d, x, DPtr{}, DPtr{}, sums, s);
    batchNormStatsKernel<<<blocksFor(ch), kThreads, 0, s>>>(x, sums, g, stats, DPtr{}, DPtr{}, ch, channelStride,
                                                            n * inner, eps);
    batchNormApplyKernel<<<blocksFor(total), kThreads, 0, s>>>(x, g, b, stats, y, total, ch, inner, nhwc, relu);
  };
}

/// batchnorm_grad (x, gamma, dy (, y) -> dx, dgamma, dbeta): the statistics
/// are recomputed from x with the sums the gradient needs, in one read of x
/// and dy (and of a fused ReLU's output y, which masks dy).
Launch CudaBackendImpl::buildBatchNormGrad(const Instruction &ins) {
  BatchNormDims d = batchNormDims(ins, buf(ins.in[0]).shape, where);
  int64_t n = d.n, ch = d.ch, inner = d.inner, total = n * ch * inner, channelStride = d.nhwc ? 1 : inner;
  bool nhwc = d.nhwc;
  double eps = num(ins, "eps", 1e-5);
  DPtr x = fp(ins.in[0]), g = fp(ins.in[1]), dy = fp(ins.in[2]), act = d.relu ? fp(ins.in[3]) : DPtr{};
  DPtr dx = fp(ins.out[0]), dg = fp(ins.out[1]), db = fp(ins.out[2]);
  size_t sumsBytes = (size_t(ch) * 4 * sizeof(double) + 255) / 256 * 256;
  reserve(sumsBytes + size_t(ch) * sizeof(BatchNormStats));
  return [=](cudaStream_t s) {
    double *sums = reinterpret_cast<double *>(workspace);
    auto *stats = reinterpret_cast<BatchNormStats *>(workspace + sumsBytes);
    launchBatchNormSums(d, x, dy, act, sums, s);
    batchNormStatsKernel<<<blocksFor(ch), kThreads, 0, s>>>(x, sums, g, stats, dg, db, ch, channelStride, n * inner,
                                                            eps);
    batchNormGradApplyKernel<<<blocksFor(total), kThreads, 0, s>>>(x, g, dy, act, stats, dx, total, ch, inner, nhwc);
  };
}

namespace {
PoolShape poolShape(const Shape &x, const Shape &y, int64_t k, int64_t stride, int64_t pad, bool nhwc) {
  if (nhwc)
    return {x[0], x[3], x[1], x[2], y[1], y[2], k, stride, pad, true};
  return {x[0], x[1], x[2], x[3], y[2], y[3], k, stride, pad, false};
}
} // namespace

Launch CudaBackendImpl::buildPool(const Instruction &ins) {
  PoolShape p = poolShape(buf(ins.in[0]).shape, buf(ins.out[0]).shape, int64_t(num(ins, "kernel", 1)),
                          int64_t(num(ins, "stride", 1)), int64_t(num(ins, "padding", 0)), channelsLast(ins, where));
  DPtr x = fp(ins.in[0]), y = fp(ins.out[0]);
  bool max = ins.op == "max_pool2d";
  return [=](cudaStream_t s) { poolKernel<<<blocksFor(p.N * p.C * p.Ho * p.Wo), kThreads, 0, s>>>(max, x, y, p); };
}

/// max_pool2d_grad (x, dy -> dx) and avg_pool2d_grad (dy -> dx).
Launch CudaBackendImpl::buildPoolGrad(const Instruction &ins) {
  bool max = ins.op == "max_pool2d_grad";
  const Buffer &dyb = buf(ins.in[max ? 1 : 0]), &dxb = buf(ins.out[0]);
  PoolShape p = poolShape(dxb.shape, dyb.shape, int64_t(num(ins, "kernel", 1)), int64_t(num(ins, "stride", 1)),
                          int64_t(num(ins, "padding", 0)), channelsLast(ins, where));
  DPtr x = max ? fp(ins.in[0]) : DPtr{}, dy = fp(ins.in[max ? 1 : 0]), dx = fp(ins.out[0]);
  return [=](cudaStream_t s) { poolGradKernel<<<blocksFor(p.N * p.C * p.H * p.W), kThreads, 0, s>>>(max, x, dy, dx, p); };
}

void CudaBackendImpl::addConvBuilders(BuilderTable &table) {
  table["conv2d"] = &CudaBackendImpl::buildConv2d;
  for (const char *op : {"conv2d_grad_input", "conv2d_grad_filter"})
    table[op] = &CudaBackendImpl::buildCudnnConv2d;
  table["batchnorm"] = &CudaBackendImpl::buildBatchNorm;
  table["batchnorm_grad"] = &CudaBackendImpl::buildBatchNormGrad;
  for (const char *op : {"max_pool2d", "avg_pool2d"})
    table[op] = &CudaBackendImpl::buildPool;
  for (const char *op : {"max_pool2d_grad", "avg_pool2d_grad"})
    table[op] = &CudaBackendImpl::buildPoolGrad;
}

} // namespace loom::rt::cuda
