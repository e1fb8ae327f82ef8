//===- CudaConv.cu - Convolutional networks -------------------------------===//
//
// Convolutions and their input and filter gradients through cuDNN
// (CudnnConv.cpp), f32 or bf16, NCHW or NHWC (`layout = "nhwc"`, what the
// compiler chooses for the GPU); where the build has no cuDNN (or
// LOOM_CUDA_CONV=im2col asks), the NCHW forward on f32 as GEMMs over an
// im2col workspace. Batch normalisation with the batch's statistics and its
// gradient, and max and average pooling and their gradients, are our
// kernels on f32 or bf16 (f32 math), in either layout, with the CPU
// backend's semantics; channels last (what the GPU trains) they move eight
// channels a thread in 16-byte accesses, batch norms over grids of one
// wave with the slices' sums added without atomics, and max pooling's
// gradient from a byte per window naming its largest value.
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

/// A channel's mean and 1 / sqrt(var + eps) (the biased variance, as the
/// CPU backend), and for the gradient g·Σdy / count and g·Σdy·x̂ / count.
struct BatchNormStats {
  float mean, rstd, a, b;
};

/// Channel c's statistics from its sums s (Σ(x - K), Σ(x - K)², Σdy,
/// Σdy(x - K)), and for the gradient dgamma = Σdy·x̂ and dbeta = Σdy (dgamma
/// null for the forward). The shift K is x[c * channelStride] (inner for
/// NCHW, 1 for NHWC).
__device__ inline BatchNormStats statsFromSums(DPtr x, const double *s, DPtr gamma, DPtr dgamma, DPtr dbeta,
                                               int64_t c, int64_t channelStride, int64_t count, double eps) {
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
  return st;
}

/// Every channel's statistics from the sums batchNormSumsKernel added.
__global__ void batchNormStatsKernel(DPtr x, const double *sums, DPtr gamma, BatchNormStats *stats, DPtr dgamma,
                                     DPtr dbeta, int64_t ch, int64_t channelStride, int64_t count, double eps) {
  GRID_LOOP(c, ch) {
    stats[c] = statsFromSums(x, sums + c * 4, gamma, dgamma, dbeta, c, channelStride, count, eps);
  }
}

/// y = (x - mean) · rstd · gamma + beta, then max(y, 0) with a fused ReLU.
__global__ void batchNormApplyKernel(DPtr x, DPtr gamma, DPtr beta, const BatchNormStats *stats, DPtr y,
                                     int64_t total, int64_t ch, int64_t inner, bool relu) {
  GRID_LOOP(i, total) {
    int64_t c = (i / inner) % ch;
    BatchNormStats s = stats[c];
    float v = (x[i] - s.mean) * s.rstd * gamma[c] + beta[c];
    y.st(i, relu && !(v > 0.0f) ? 0.0f : v);
  }
}

/// dx = rstd · (gamma · dy - g·Σdy / count - x̂ · g·Σdy·x̂ / count), the CPU
/// backend's formula; with `act`, dy counts only where act > 0.
__global__ void batchNormGradApplyKernel(DPtr x, DPtr gamma, DPtr dy, DPtr act, const BatchNormStats *stats,
                                         DPtr dx, int64_t total, int64_t ch, int64_t inner) {
  GRID_LOOP(i, total) {
    int64_t c = (i / inner) % ch;
    BatchNormStats s = stats[c];
    float xh = (x[i] - s.mean) * s.rstd, d = act && !(act[i] > 0.0f) ? 0.0f : dy[i];
    dx.st(i, s.rstd * (gamma[c] * d - s.a - xh * s.b));
  }
}

//===--- Channels last ----------------------------------------------------===//
//
// A channels-last tensor is `rows` (N x H x W) rows of `ch` channels. Each
// thread owns V neighbouring channels (V = 8: one 16-byte access of bf16,
// two of f32, where the channels and pointers allow; else 1) and walks rows:
// a block of 256 threads covers `lanes` groups of V channels by 256 / lanes
// rows at a time, over its slice of rows (grid: channel tiles x slices). A
// thread keeps its channels' sums, or their statistics, in registers for
// every row it visits.

struct NhwcTile {
  int64_t rows, ch, rowsPerSlice;
  int lanes; // a power of two up to 32
};

/// V values of p from element i (a multiple of V), either dtype.
template <int V> __device__ inline void loadV(DPtr p, int64_t i, float out[V]) {
  if constexpr (V == 8)
    load8(p, i, out);
  else
    out[0] = p[i];
}
template <int V> __device__ inline void storeV(DPtr p, int64_t i, const float v[V]) {
  if constexpr (V == 8)
    store8(p, i, v);
  else
    p.st(i, v[0]);
}

/// This thread's first channel, and its slice's rows [begin, end) with the
/// first row it visits.
struct NhwcThread {
  int64_t c, row, end;
  int step;
};
template <int V> __device__ inline NhwcThread nhwcThread(const NhwcTile &t) {
  NhwcThread th;
  th.c = (int64_t(blockIdx.x) * t.lanes + threadIdx.x % t.lanes) * V;
  th.step = kThreads / t.lanes;
  int64_t begin = int64_t(blockIdx.y) * t.rowsPerSlice;
  th.row = begin + threadIdx.x / t.lanes;
  th.end = begin + t.rowsPerSlice < t.rows ? begin + t.rowsPerSlice : t.rows;
  return th;
}

/// Each slice's sums of its rows per channel, as batchNormSumsKernel adds
/// them (shifted by the channel's first value x[0, 0, 0, c]), into
/// partials[slice][sum][channel]; batchNormStatsNhwcKernel adds the slices.
/// With Grad, also Σdy and Σdy(x - K) (dy masked by `act` where given). A
/// thread loads U rows before it adds them, so that several loads are in
/// flight.
template <int V, bool Grad>
__global__ void __launch_bounds__(kThreads)
    batchNormPartialsNhwcKernel(DPtr x, DPtr dy, DPtr act, float *partials, NhwcTile t) {
  constexpr int U = Grad ? 2 : 4;
  __shared__ float rowsOf[kThreads][V + 1];
  NhwcThread th = nhwcThread<V>(t);
  float s[4][V] = {};
  if (th.c < t.ch) {
    float shift[V];
    loadV<V>(x, th.c, shift);
    for (int64_t r = th.row; r < th.end; r += U * th.step) {
      float xv[U][V], d[U][Grad ? V : 1];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        int64_t at = (r + u * th.step) * t.ch + th.c;
        bool in = r + u * th.step < th.end;
        if (in)
          loadV<V>(x, at, xv[u]);
        if constexpr (Grad) {
          if (in) {
            loadV<V>(dy, at, d[u]);
            if (act) {
              float a[V];
              loadV<V>(act, at, a);
#pragma unroll
              for (int e = 0; e < V; ++e)
                d[u][e] = a[e] > 0.0f ? d[u][e] : 0.0f;
            }
          }
        }
        if (!in) // rows past the slice add nothing
#pragma unroll
          for (int e = 0; e < V; ++e) {
            xv[u][e] = shift[e];
            if constexpr (Grad)
              d[u][e] = 0.0f;
          }
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int e = 0; e < V; ++e) {
          float v = xv[u][e] - shift[e];
          s[0][e] += v;
          s[1][e] += v * v;
          if constexpr (Grad) {
            s[2][e] += d[u][e];
            s[3][e] += d[u][e] * v;
          }
        }
    }
  }
  // Add the rows that share a channel: thread j < lanes·V finishes channel
  // tile start + j.
  int64_t channel = int64_t(blockIdx.x) * t.lanes * V + threadIdx.x;
  for (int k = 0; k < (Grad ? 4 : 2); ++k) {
#pragma unroll
    for (int e = 0; e < V; ++e)
      rowsOf[threadIdx.x][e] = s[k][e];
    __syncthreads();
    if (threadIdx.x < t.lanes * V && channel < t.ch) {
      int g = threadIdx.x / V, e = threadIdx.x % V;
      float total = 0;
      for (int r = 0; r < kThreads / t.lanes; ++r)
        total += rowsOf[r * t.lanes + g][e];
      partials[(int64_t(blockIdx.y) * 4 + k) * t.ch + channel] = total;
    }
    __syncthreads();
  }
}

/// Every channel's statistics from the slices' partial sums, added in
/// double: a block of 32 channels x kStatsLanes threads, each thread adding
/// every kStatsLanes-th slice.
constexpr int kStatsLanes = 32;
__global__ void batchNormStatsNhwcKernel(DPtr x, const float *partials, int64_t slices, DPtr gamma,
                                         BatchNormStats *stats, DPtr dgamma, DPtr dbeta, int64_t ch, int64_t count,
                                         double eps) {
  __shared__ double part[4][kStatsLanes][33];
  int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  int sums = dgamma ? 4 : 2;
  double s[4] = {0, 0, 0, 0};
  if (c < ch)
#pragma unroll 4
    for (int64_t slice = threadIdx.y; slice < slices; slice += kStatsLanes)
      for (int k = 0; k < sums; ++k)
        s[k] += partials[(slice * 4 + k) * ch + c];
  for (int k = 0; k < 4; ++k)
    part[k][threadIdx.y][threadIdx.x] = s[k];
  __syncthreads();
  if (threadIdx.y != 0 || c >= ch)
    return;
  for (int k = 0; k < 4; ++k)
    for (int y = 1; y < kStatsLanes; ++y)
      s[k] += part[k][y][threadIdx.x];
  stats[c] = statsFromSums(x, s, gamma, dgamma, dbeta, c, 1, count, eps);
}

/// This thread's channels' statistics, and gamma and beta (beta null for the gradient).
template <int V> struct NhwcChannels {
  float mean[V], rstd[V], a[V], b[V], g[V], beta[V];
  __device__ NhwcChannels(const BatchNormStats *stats, DPtr gamma, DPtr bt, int64_t c) {
    loadV<V>(gamma, c, g);
    if (bt)
      loadV<V>(bt, c, beta);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      BatchNormStats st = stats[c + e];
      mean[e] = st.mean, rstd[e] = st.rstd, a[e] = st.a, b[e] = st.b;
    }
  }
};

/// batchNormApplyKernel for channels last, U rows in flight a thread.
template <int V>
__global__ void __launch_bounds__(kThreads) batchNormApplyNhwcKernel(DPtr x, DPtr gamma, DPtr beta,
                                                                     const BatchNormStats *stats, DPtr y,
                                                                     NhwcTile t, bool relu) {
  constexpr int U = 4;
  NhwcThread th = nhwcThread<V>(t);
  if (th.c >= t.ch)
    return;
  NhwcChannels<V> k(stats, gamma, beta, th.c);
  for (int64_t r = th.row; r < th.end; r += U * th.step) {
    float v[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (r + u * th.step < th.end)
        loadV<V>(x, (r + u * th.step) * t.ch + th.c, v[u]);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (r + u * th.step >= th.end)
        break;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        float o = (v[u][e] - k.mean[e]) * k.rstd[e] * k.g[e] + k.beta[e];
        v[u][e] = relu && !(o > 0.0f) ? 0.0f : o;
      }
      storeV<V>(y, (r + u * th.step) * t.ch + th.c, v[u]);
    }
  }
}

/// batchNormGradApplyKernel for channels last, U rows in flight a thread.
template <int V>
__global__ void __launch_bounds__(kThreads) batchNormGradApplyNhwcKernel(DPtr x, DPtr gamma, DPtr dy, DPtr act,
                                                                         const BatchNormStats *stats, DPtr dx,
                                                                         NhwcTile t) {
  constexpr int U = 2;
  NhwcThread th = nhwcThread<V>(t);
  if (th.c >= t.ch)
    return;
  NhwcChannels<V> k(stats, gamma, DPtr{}, th.c);
  for (int64_t r = th.row; r < th.end; r += U * th.step) {
    float xv[U][V], d[U][V], a[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (r + u * th.step < th.end) {
        int64_t at = (r + u * th.step) * t.ch + th.c;
        loadV<V>(x, at, xv[u]);
        loadV<V>(dy, at, d[u]);
        if (act)
          loadV<V>(act, at, a[u]);
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (r + u * th.step >= th.end)
        break;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        float xh = (xv[u][e] - k.mean[e]) * k.rstd[e], de = act && !(a[u][e] > 0.0f) ? 0.0f : d[u][e];
        xv[u][e] = k.rstd[e] * (k.g[e] * de - k.a[e] - xh * k.b[e]);
      }
      storeV<V>(dx, (r + u * th.step) * t.ch + th.c, xv[u]);
    }
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

/// Whether a channels-last batch norm takes eight channels a thread: the
/// channels and every pointer allow 16-byte accesses.
bool nhwcWide(const BatchNormDims &d, std::initializer_list<DPtr> pointers) {
  bool wide = d.ch % 8 == 0;
  for (DPtr p : pointers)
    wide = wide && (!p || reinterpret_cast<uintptr_t>(p.p) % 16 == 0);
  return wide;
}

/// How a channels-last kernel is tiled: `lanes` groups of `vec` channels a
/// block, and the rows cut into slices over the grid's second dimension so
/// that the grid is one wave of `kernel` on `device` (as many blocks as its
/// SMs hold at once, so no SM idles through a last partial wave).
struct NhwcLaunch {
  NhwcTile tile;
  dim3 grid;
  int64_t slices;
};
NhwcLaunch nhwcLaunch(const BatchNormDims &d, int vec, const void *kernel, int device) {
  int sms = 0, perSm = 0;
  LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  LOOM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSm, kernel, kThreads, 0));
  // One wave. (Four waves of shorter blocks, tried so that NCCL's kernels
  // holding some SMs during data-parallel backward unbalance them less, cost
  // a quarter of ResNet-50's step at batch 32 on an H200: 12.0 ms against
  // 9.5, one GPU, 2026-11-27.)
  int64_t blocks = int64_t(std::max(sms, 1)) * std::max(perSm, 1);
  int64_t groups = d.ch / vec, lanes = 1;
  while (lanes < 32 && lanes < groups)
    lanes *= 2;
  int64_t tiles = (groups + lanes - 1) / lanes, step = kThreads / lanes, rows = d.n * d.inner;
  int64_t slices = std::clamp<int64_t>(blocks / tiles, 1, std::max<int64_t>((rows + step - 1) / step, 1));
  int64_t perSlice = std::max<int64_t>(((rows + slices - 1) / slices + step - 1) / step * step, 1);
  NhwcLaunch l;
  l.slices = std::clamp<int64_t>((rows + perSlice - 1) / perSlice, 1, 65535);
  l.tile = {rows, d.ch, perSlice, int(lanes)};
  l.grid = dim3(unsigned(tiles), unsigned(l.slices));
  return l;
}

/// The channels-last kernels for V channels a thread.
template <int V> struct NhwcKernels {
  static constexpr auto sums = batchNormPartialsNhwcKernel<V, false>;
  static constexpr auto gradSums = batchNormPartialsNhwcKernel<V, true>;
  static constexpr auto apply = batchNormApplyNhwcKernel<V>;
  static constexpr auto gradApply = batchNormGradApplyNhwcKernel<V>;
};
} // namespace

/// batchnorm (x, gamma, beta -> y) with the batch's statistics, or
/// batchnorm_grad (x, gamma, dy (, y) -> dx, dgamma, dbeta) recomputing them
/// with the sums the gradient needs, in one read of x and dy (and of a fused
/// ReLU's output y, which masks dy): per-channel sums, the statistics, then
/// the result. Channels last, each slice of rows writes its sums apart and
/// the statistics add them (no atomics); NCHW, blocks add theirs in double
/// atomically. The sums and statistics live in the workspace.
Launch CudaBackendImpl::buildBatchNormPass(const Instruction &ins, bool grad) {
  BatchNormDims d = batchNormDims(ins, buf(ins.in[0]).shape, where);
  int64_t ch = d.ch, inner = d.inner, total = d.n * ch * inner, count = d.n * inner;
  bool relu = d.relu;
  double eps = num(ins, "eps", 1e-5);
  DPtr x = fp(ins.in[0]), g = fp(ins.in[1]), b = grad ? DPtr{} : fp(ins.in[2]), dy = grad ? fp(ins.in[2]) : DPtr{};
  DPtr act = grad && relu ? fp(ins.in[3]) : DPtr{}, out = fp(ins.out[0]);
  DPtr dg = grad ? fp(ins.out[1]) : DPtr{}, db = grad ? fp(ins.out[2]) : DPtr{};
  size_t statsBytes = (size_t(ch) * sizeof(BatchNormStats) + 255) / 256 * 256;
  if (d.nhwc) {
    bool wide = nhwcWide(d, {x, g, b, dy, act, out});
    auto pick = [&](auto eight, auto one) { return wide ? eight : one; };
    auto sumsKernel = grad ? pick(NhwcKernels<8>::gradSums, NhwcKernels<1>::gradSums)
                           : pick(NhwcKernels<8>::sums, NhwcKernels<1>::sums);
    auto gradApply = pick(NhwcKernels<8>::gradApply, NhwcKernels<1>::gradApply);
    auto apply = pick(NhwcKernels<8>::apply, NhwcKernels<1>::apply);
    int vec = wide ? 8 : 1;
    NhwcLaunch sums = nhwcLaunch(d, vec, reinterpret_cast<const void *>(sumsKernel), device);
    NhwcLaunch last = nhwcLaunch(d, vec, grad ? reinterpret_cast<const void *>(gradApply)
                                              : reinterpret_cast<const void *>(apply), device);
    reserve(statsBytes + size_t(sums.slices) * 4 * size_t(ch) * sizeof(float));
    return [=](cudaStream_t s) {
      auto *stats = reinterpret_cast<BatchNormStats *>(workspace);
      auto *partials = reinterpret_cast<float *>(workspace + statsBytes);
      sumsKernel<<<sums.grid, kThreads, 0, s>>>(x, dy, act, partials, sums.tile);
      batchNormStatsNhwcKernel<<<unsigned((ch + 31) / 32), dim3(32, kStatsLanes), 0, s>>>(
          x, partials, sums.slices, g, stats, dg, db, ch, count, eps);
      if (grad)
        gradApply<<<last.grid, kThreads, 0, s>>>(x, g, dy, act, stats, out, last.tile);
      else
        apply<<<last.grid, kThreads, 0, s>>>(x, g, b, stats, out, last.tile, relu);
    };
  }
  size_t sumsBytes = size_t(ch) * 4 * sizeof(double);
  reserve(statsBytes + sumsBytes);
  unsigned slices = unsigned(std::clamp<int64_t>((count + kThreads * 32 - 1) / (kThreads * 32), 1, 65535));
  return [=](cudaStream_t s) {
    auto *stats = reinterpret_cast<BatchNormStats *>(workspace);
    double *sums = reinterpret_cast<double *>(workspace + statsBytes);
    LOOM_CUDA_CHECK(cudaMemsetAsync(sums, 0, sumsBytes, s));
    batchNormSumsKernel<<<dim3(unsigned(ch), slices), kThreads, 0, s>>>(x, dy, act, sums, d.n, ch, inner);
    batchNormStatsKernel<<<blocksFor(ch), kThreads, 0, s>>>(x, sums, g, stats, dg, db, ch, inner, count, eps);
    if (grad)
      batchNormGradApplyKernel<<<blocksFor(total), kThreads, 0, s>>>(x, g, dy, act, stats, out, total, ch, inner);
    else
      batchNormApplyKernel<<<blocksFor(total), kThreads, 0, s>>>(x, g, b, stats, out, total, ch, inner, relu);
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
