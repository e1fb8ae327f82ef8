//===- CudaBatchNorm.cu - Batch normalisation and its gradient -----------===//
//
// Batch normalisation with the batch's statistics (training), optionally
// with a fused ReLU, and its gradient recomputing those statistics, f32 or
// bf16 with f32 math and the CPU backend's semantics: per-channel sums,
// the statistics, then the result, in either layout. NCHW, blocks add
// their sums in double atomically; channels last (what the GPU trains),
// each block of rows writes its sums apart and a small kernel adds them
// (no atomics), eight channels a thread in 16-byte accesses over grids of
// one wave: flat grids with typed loads where x, dy, the ReLU's output and
// the result share a dtype, tiled ones otherwise.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"

#include <cstdlib>

namespace loom::rt::cuda {
namespace {

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
/// every kStatsLanes-th slice. Into `stats` (the tiled kernels), or as
/// per-channel coefficients into coef[k][channel] (the flat ones): forward
/// {mean, rstd·gamma, beta}, so that y = (x - mean)·coef1 + beta; gradient
/// {mean, rstd·gamma, -rstd²·b, -rstd·a}, so that dx = coef1·dy + coef2·(x -
/// mean) + coef3 (the CPU backend's rstd·(gamma·dy - a - x̂·b), a and b as
/// in BatchNormStats).
constexpr int kStatsLanes = 32;
__global__ void batchNormStatsNhwcKernel(DPtr x, const float *partials, int64_t slices, DPtr gamma, DPtr beta,
                                         BatchNormStats *stats, float *coef, DPtr dgamma, DPtr dbeta, int64_t ch,
                                         int64_t count, double eps) {
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
  BatchNormStats st = statsFromSums(x, s, gamma, dgamma, dbeta, c, 1, count, eps);
  if (stats)
    stats[c] = st;
  if (!coef)
    return;
  double rstd = st.rstd, g = gamma[c];
  coef[c] = st.mean;
  coef[ch + c] = float(rstd * g);
  if (!dgamma) {
    coef[2 * ch + c] = beta[c];
    return;
  }
  coef[2 * ch + c] = float(-rstd * rstd * double(st.b));
  coef[3 * ch + c] = float(-rstd * double(st.a));
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

//===--- Channels last, one dtype, eight channels a thread -----------------===//
//
// What the GPU trains: x, dy, a fused ReLU's output and the result all bf16
// (or all f32), the channels a multiple of eight. The tensor is `n8` groups
// of eight channels, `groups` of them a row, walked by a flat grid whose
// blocks hold a whole number of rows' groups, so that each thread keeps one
// group of channels (and its coefficients) throughout. Typed loads (no
// branch on the dtype per access: the tiled kernels' eight-channel forms
// take 80-122 registers, these 40-68) and one row in flight a thread.
// ResNet-50 --target cuda on an H200 (2026-11-28): 21.4 ms a step at batch
// 128 against 23.9 with the tiled kernels (LOOM_CUDA_BN_FLAT=0), 8.7 against
// 9.2 at batch 32; timed alone at batch 128, the 53 gradients took 6.0 ms
// against 9.1 (3.3 TB/s against 2.2) and the forwards 3.4 against 3.5.

template <typename T> struct Eight;
template <> struct Eight<bf16> {
  static __device__ void ld(const void *p, int64_t group, float o[8]) {
    Pack<bf16> v = load(static_cast<const bf16 *>(p) + group * 8);
#pragma unroll
    for (int e = 0; e < 8; ++e)
      o[e] = __bfloat162float(v.v[e]);
  }
  static __device__ void st(void *p, int64_t group, const float v[8]) { store8(static_cast<bf16 *>(p) + group * 8, v); }
};
template <> struct Eight<float> {
  static __device__ void ld(const void *p, int64_t group, float o[8]) {
    const float4 *q = static_cast<const float4 *>(p) + group * 2;
    float4 a = q[0], b = q[1];
    o[0] = a.x, o[1] = a.y, o[2] = a.z, o[3] = a.w, o[4] = b.x, o[5] = b.y, o[6] = b.z, o[7] = b.w;
  }
  static __device__ void st(void *p, int64_t group, const float v[8]) {
    float4 *q = static_cast<float4 *>(p) + group * 2;
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
};

/// The flat walk: this thread's first group, the grid's stride and the
/// channel group it keeps (the stride is a multiple of `groups`).
struct FlatWalk {
  int64_t first, stride, group;
  __device__ FlatWalk(int64_t groups)
      : first(int64_t(blockIdx.x) * blockDim.x + threadIdx.x), stride(int64_t(gridDim.x) * blockDim.x),
        group(first % groups) {}
};

/// Each block's per-channel sums (as batchNormPartialsNhwcKernel's) into
/// partials[block][sum][channel].
template <typename T, bool Grad>
__global__ void __launch_bounds__(kThreads)
    batchNormPartialsFlatKernel(const void *x, const void *dy, const void *act, float *partials, int64_t groups,
                                int64_t n8) {
  __shared__ float rowsOf[kThreads][9];
  FlatWalk w(groups);
  float shift[8], s[4][8] = {};
  Eight<T>::ld(x, w.group, shift);
  for (int64_t i = w.first; i < n8; i += w.stride) {
    float v[8], d[8];
    Eight<T>::ld(x, i, v);
    if constexpr (Grad) {
      Eight<T>::ld(dy, i, d);
      if (act) {
        float a[8];
        Eight<T>::ld(act, i, a);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          d[e] = a[e] > 0.0f ? d[e] : 0.0f;
      }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float c = v[e] - shift[e];
      s[0][e] += c;
      s[1][e] += c * c;
      if constexpr (Grad) {
        s[2][e] += d[e];
        s[3][e] += d[e] * c;
      }
    }
  }
  int64_t ch = groups * 8, rows = blockDim.x / groups;
  for (int k = 0; k < (Grad ? 4 : 2); ++k) {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      rowsOf[threadIdx.x][e] = s[k][e];
    __syncthreads();
    for (int64_t c = threadIdx.x; c < ch; c += blockDim.x) {
      float total = 0;
      for (int64_t r = 0; r < rows; ++r)
        total += rowsOf[r * groups + c / 8][c % 8];
      partials[(int64_t(blockIdx.x) * 4 + k) * ch + c] = total;
    }
    __syncthreads();
  }
}

__device__ inline void coefficients(const float *coef, int64_t ch, int64_t group, int k, float out[8]) {
  Eight<float>::ld(coef + k * ch, group, out);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    batchNormApplyFlatKernel(const void *x, const float *coef, void *y, int64_t groups, int64_t n8, bool relu) {
  FlatWalk w(groups);
  float mean[8], scale[8], beta[8];
  int64_t ch = groups * 8;
  coefficients(coef, ch, w.group, 0, mean), coefficients(coef, ch, w.group, 1, scale);
  coefficients(coef, ch, w.group, 2, beta);
  for (int64_t i = w.first; i < n8; i += w.stride) {
    float v[8];
    Eight<T>::ld(x, i, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float o = (v[e] - mean[e]) * scale[e] + beta[e];
      v[e] = relu && !(o > 0.0f) ? 0.0f : o;
    }
    Eight<T>::st(y, i, v);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) batchNormGradApplyFlatKernel(const void *x, const void *dy,
                                                                         const void *act, const float *coef, void *dx,
                                                                         int64_t groups, int64_t n8) {
  FlatWalk w(groups);
  float mean[8], c1[8], c2[8], c3[8];
  int64_t ch = groups * 8;
  coefficients(coef, ch, w.group, 0, mean), coefficients(coef, ch, w.group, 1, c1);
  coefficients(coef, ch, w.group, 2, c2), coefficients(coef, ch, w.group, 3, c3);
  for (int64_t i = w.first; i < n8; i += w.stride) {
    float v[8], d[8], a[8];
    Eight<T>::ld(x, i, v);
    Eight<T>::ld(dy, i, d);
    if (act)
      Eight<T>::ld(act, i, a);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float de = act && !(a[e] > 0.0f) ? 0.0f : d[e];
      v[e] = c1[e] * de + c2[e] * (v[e] - mean[e]) + c3[e];
    }
    Eight<T>::st(dx, i, v);
  }
}

} // namespace

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

/// As many blocks of `threads` as `device`'s SMs hold at once (at least one).
int64_t blocksInOneWave(const void *kernel, int threads, int device) {
  int sms = 0, perSm = 0;
  LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  LOOM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSm, kernel, threads, 0));
  return int64_t(std::max(sms, 1)) * std::max(perSm, 1);
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
  // One wave. (Four waves of shorter blocks, tried so that NCCL's kernels
  // holding some SMs during data-parallel backward unbalance them less, cost
  // a quarter of ResNet-50's step at batch 32 on an H200: 12.0 ms against
  // 9.5, one GPU, 2026-11-27.)
  int64_t blocks = blocksInOneWave(kernel, kThreads, device);
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

/// The flat channels-last kernels (batchNormPartialsFlatKernel and the
/// rest) for one batch norm, where they apply: channels last, x, dy, the
/// ReLU's output and the result of one dtype, 16-byte aligned, the channels
/// a multiple of eight and at most 2,048. Blocks of a whole number of rows'
/// groups, the grid one wave (or fewer blocks where the tensor is small).
struct FlatBatchNorm {
  struct Grid {
    unsigned blocks = 0, threads = 0;
  } sums, last;
  void (*sumsKernel)(const void *, const void *, const void *, float *, int64_t, int64_t) = nullptr;
  void (*apply)(const void *, const float *, void *, int64_t, int64_t, bool) = nullptr;
  void (*gradApply)(const void *, const void *, const void *, const float *, void *, int64_t, int64_t) = nullptr;

  bool plan(const BatchNormDims &d, std::initializer_list<DPtr> tensors, bool grad, int device) {
    static const bool enabled = [] { // LOOM_CUDA_BN_FLAT=0: the tiled kernels, to compare
      return !envIs("LOOM_CUDA_BN_FLAT", "0");
    }();
    if (!enabled || !nhwcWide(d, tensors) || d.ch / 8 > kThreads)
      return false;
    bool bf = tensors.begin()->bf;
    for (DPtr p : tensors)
      if (p && p.bf != bf)
        return false;
    if (bf) {
      sumsKernel = grad ? batchNormPartialsFlatKernel<bf16, true> : batchNormPartialsFlatKernel<bf16, false>;
      apply = batchNormApplyFlatKernel<bf16>, gradApply = batchNormGradApplyFlatKernel<bf16>;
    } else {
      sumsKernel = grad ? batchNormPartialsFlatKernel<float, true> : batchNormPartialsFlatKernel<float, false>;
      apply = batchNormApplyFlatKernel<float>, gradApply = batchNormGradApplyFlatKernel<float>;
    }
    int64_t groups = d.ch / 8, n8 = d.n * d.inner * groups;
    sums = grid(reinterpret_cast<const void *>(sumsKernel), groups, n8, device);
    last = grid(grad ? reinterpret_cast<const void *>(gradApply) : reinterpret_cast<const void *>(apply), groups, n8,
                device);
    return true;
  }
  static Grid grid(const void *kernel, int64_t groups, int64_t n8, int device) {
    Grid g;
    g.threads = unsigned(groups * (kThreads / groups));
    int64_t wave = blocksInOneWave(kernel, int(g.threads), device), needed = (n8 + g.threads - 1) / g.threads;
    g.blocks = unsigned(std::clamp<int64_t>(std::min(wave, needed), 1, 65535));
    return g;
  }
};

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
  if (FlatBatchNorm f; d.nhwc && f.plan(d, {x, dy, act, out}, grad, device)) {
    size_t coefBytes = (size_t(ch) * 4 * sizeof(float) + 255) / 256 * 256;
    reserve(coefBytes + size_t(f.sums.blocks) * 4 * size_t(ch) * sizeof(float));
    int64_t groups = ch / 8, n8 = total / 8;
    return [=](cudaStream_t s) {
      auto *coef = reinterpret_cast<float *>(workspace);
      auto *partials = reinterpret_cast<float *>(workspace + coefBytes);
      f.sumsKernel<<<f.sums.blocks, f.sums.threads, 0, s>>>(x.p, dy.p, act.p, partials, groups, n8);
      batchNormStatsNhwcKernel<<<unsigned((ch + 31) / 32), dim3(32, kStatsLanes), 0, s>>>(
          x, partials, f.sums.blocks, g, b, nullptr, coef, dg, db, ch, count, eps);
      if (grad)
        f.gradApply<<<f.last.blocks, f.last.threads, 0, s>>>(x.p, dy.p, act.p, coef, out.p, groups, n8);
      else
        f.apply<<<f.last.blocks, f.last.threads, 0, s>>>(x.p, coef, out.p, groups, n8, relu);
    };
  }
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
          x, partials, sums.slices, g, DPtr{}, stats, nullptr, dg, db, ch, count, eps);
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

} // namespace loom::rt::cuda
