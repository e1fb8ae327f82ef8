//===- CudaConv.cu - Convolutions and pooling ------------------------------===//
//
// Convolutions and their input and filter gradients through cuDNN
// (CudnnConv.cpp), f32 or bf16, NCHW or NHWC (`layout = "nhwc"`, what the
// compiler chooses for the GPU); where the build has no cuDNN (or
// LOOM_CUDA_CONV=im2col asks), the NCHW forward on f32 as GEMMs over an
// im2col workspace. Max and average pooling and their gradients are our
// kernels on f32 or bf16 (f32 math), in either layout, with the CPU
// backend's semantics; channels last, max pooling moves eight channels a
// thread in 16-byte accesses and takes its gradient from a byte per window
// naming its largest value. Batch norms are in CudaBatchNorm.cu.
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

/// Max pooling channels last, eight channels a thread (16-byte accesses):
/// y, or with Arg each window's first largest value in the CPU backend's
/// scan order (rows, then columns; strictly greater replaces) as its offset
/// kh·k + kw in the window (255: none, where every value is -inf or NaN), a
/// byte per output element, for maxPoolGradNhwcKernel: each input position
/// then gathers the gradients of the windows whose choice it is, in
/// poolGradKernel's order.
template <bool Arg> __global__ void maxPoolNhwcKernel(DPtr x, DPtr y, uint8_t *arg, PoolShape p) {
  int64_t groups = p.C / 8;
  GRID_LOOP(i, p.N * p.Ho * p.Wo * groups) {
    int64_t c = i % groups * 8, rest = i / groups, ow = rest % p.Wo, oh = rest / p.Wo % p.Ho, n = rest / (p.Wo * p.Ho);
    float best[8], v[8];
    uint8_t at[8];
#pragma unroll
    for (int e = 0; e < 8; ++e)
      best[e] = -INFINITY, at[e] = 255;
    for (int64_t kh = 0; kh < p.k; ++kh)
      for (int64_t kw = 0; kw < p.k; ++kw) {
        int64_t ih = oh * p.stride - p.pad + kh, iw = ow * p.stride - p.pad + kw;
        if (ih < 0 || ih >= p.H || iw < 0 || iw >= p.W)
          continue;
        load8(x, ((n * p.H + ih) * p.W + iw) * p.C + c, v);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (!Arg)
            best[e] = fmaxf(best[e], v[e]);
          else if (v[e] > best[e])
            best[e] = v[e], at[e] = uint8_t(kh * p.k + kw);
        }
      }
    if constexpr (Arg)
      *reinterpret_cast<uint2 *>(arg + i * 8) = *reinterpret_cast<const uint2 *>(at);
    else
      store8(y, i * 8, best);
  }
}

__global__ void maxPoolGradNhwcKernel(const uint8_t *arg, DPtr dy, DPtr dx, PoolShape p) {
  int64_t groups = p.C / 8;
  GRID_LOOP(i, p.N * p.H * p.W * groups) {
    int64_t c = i % groups * 8, rest = i / groups, iw = rest % p.W, ih = rest / p.W % p.H, n = rest / (p.W * p.H);
    int64_t loH = ih + p.pad - p.k + 1, loW = iw + p.pad - p.k + 1;
    int64_t ohBegin = loH <= 0 ? 0 : (loH + p.stride - 1) / p.stride, ohEnd = (ih + p.pad) / p.stride + 1;
    int64_t owBegin = loW <= 0 ? 0 : (loW + p.stride - 1) / p.stride, owEnd = (iw + p.pad) / p.stride + 1;
    ohEnd = ohEnd < p.Ho ? ohEnd : p.Ho;
    owEnd = owEnd < p.Wo ? owEnd : p.Wo;
    float acc[8] = {}, g[8];
    for (int64_t oh = ohBegin; oh < ohEnd; ++oh)
      for (int64_t ow = owBegin; ow < owEnd; ++ow) {
        int64_t o = ((n * p.Ho + oh) * p.Wo + ow) * p.C + c;
        uint2 packed = *reinterpret_cast<const uint2 *>(arg + o);
        const uint8_t *at = reinterpret_cast<const uint8_t *>(&packed);
        int mine = int((ih - (oh * p.stride - p.pad)) * p.k + (iw - (ow * p.stride - p.pad)));
        load8(dy, o, g);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (at[e] == mine)
            acc[e] += g[e];
      }
    store8(dx, i * 8, acc);
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
PoolShape poolShape(const Shape &x, const Shape &y, int64_t k, int64_t stride, int64_t pad, bool nhwc) {
  if (nhwc)
    return {x[0], x[3], x[1], x[2], y[1], y[2], k, stride, pad, true};
  return {x[0], x[1], x[2], x[3], y[2], y[3], k, stride, pad, false};
}
} // namespace

namespace {
/// Whether a max pooling runs as the channels-last kernels: eight channels
/// of 16-byte-aligned tensors, windows of at most 254 positions.
bool maxPoolVectorised(const PoolShape &p, std::initializer_list<DPtr> pointers) {
  bool ok = p.nhwc && p.C % 8 == 0 && p.k * p.k < 255;
  for (DPtr q : pointers)
    ok = ok && (!q || reinterpret_cast<uintptr_t>(q.p) % 16 == 0);
  return ok;
}
} // namespace

Launch CudaBackendImpl::buildPool(const Instruction &ins) {
  PoolShape p = poolShape(buf(ins.in[0]).shape, buf(ins.out[0]).shape, int64_t(num(ins, "kernel", 1)),
                          int64_t(num(ins, "stride", 1)), int64_t(num(ins, "padding", 0)), channelsLast(ins, where));
  DPtr x = fp(ins.in[0]), y = fp(ins.out[0]);
  bool max = ins.op == "max_pool2d";
  if (max && maxPoolVectorised(p, {x, y}))
    return [=](cudaStream_t s) { maxPoolNhwcKernel<false><<<blocksFor(p.N * p.Ho * p.Wo * p.C / 8), kThreads, 0, s>>>(x, y, nullptr, p); };
  return [=](cudaStream_t s) { poolKernel<<<blocksFor(p.N * p.C * p.Ho * p.Wo), kThreads, 0, s>>>(max, x, y, p); };
}

/// max_pool2d_grad (x, dy -> dx) and avg_pool2d_grad (dy -> dx).
Launch CudaBackendImpl::buildPoolGrad(const Instruction &ins) {
  bool max = ins.op == "max_pool2d_grad";
  const Buffer &dyb = buf(ins.in[max ? 1 : 0]), &dxb = buf(ins.out[0]);
  PoolShape p = poolShape(dxb.shape, dyb.shape, int64_t(num(ins, "kernel", 1)), int64_t(num(ins, "stride", 1)),
                          int64_t(num(ins, "padding", 0)), channelsLast(ins, where));
  DPtr x = max ? fp(ins.in[0]) : DPtr{}, dy = fp(ins.in[max ? 1 : 0]), dx = fp(ins.out[0]);
  if (max && maxPoolVectorised(p, {x, dy, dx})) {
    int64_t outputs = p.N * p.Ho * p.Wo * p.C;
    reserve(size_t(outputs));
    return [=](cudaStream_t s) {
      auto *arg = reinterpret_cast<uint8_t *>(workspace);
      maxPoolNhwcKernel<true><<<blocksFor(outputs / 8), kThreads, 0, s>>>(x, DPtr{}, arg, p);
      maxPoolGradNhwcKernel<<<blocksFor(p.N * p.H * p.W * p.C / 8), kThreads, 0, s>>>(arg, dy, dx, p);
    };
  }
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
