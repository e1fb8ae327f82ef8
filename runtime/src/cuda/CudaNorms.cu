//===- CudaNorms.cu - Norms and reductions over rows and columns -----------===//
//
// LayerNorm and RMSNorm with their gradients, and reduce_sum/mean/max.
// Norms run a warp per row (its row in registers for bf16 rows of up to
// 2048); column sums (bias and norm-parameter gradients) run in two
// deterministic passes through per-chunk partials in the workspace.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"

#include <cstdlib>
#include <string>

namespace loom::rt::cuda {
namespace {

/// Column sums of a [rows, cols] matrix in two deterministic passes: each
/// block sums a chunk of rows for 32 columns into `partial[chunk][col]`.
__global__ void columnPartialKernel(DPtr x, const float *mean, const float *rstd,
                                    DPtr dy, float *partial, float *partialB, int64_t rows,
                                    int64_t cols, int64_t rowsPerChunk) {
  __shared__ float tile[8][33], tileB[8][33];
  int64_t col = blockIdx.x * 32 + threadIdx.x, chunk = blockIdx.y;
  int64_t r0 = chunk * rowsPerChunk, r1 = min(rows, r0 + rowsPerChunk);
  float acc = 0, accB = 0;
  if (col < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      if (dy) { // norm parameter gradients: sum dy * xhat and dy
        float d = dy[r * cols + col];
        acc += d * (x[r * cols + col] - mean[r]) * rstd[r];
        accB += d;
      } else {
        acc += x[r * cols + col];
      }
    }
  tile[threadIdx.y][threadIdx.x] = acc;
  tileB[threadIdx.y][threadIdx.x] = accB;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float s = 0, sb = 0;
    for (int k = 0; k < 8; ++k)
      s += tile[k][threadIdx.x], sb += tileB[k][threadIdx.x];
    partial[chunk * cols + col] = s;
    if (partialB)
      partialB[chunk * cols + col] = sb;
  }
}
/// The second pass: out[c] = scale * the sum over chunks of partial[k][c]
/// (and, where blockIdx.y is 1, outB from partialB). A block of 32 x 32
/// threads takes 32 columns; thread row y adds chunks y, y + 32, ... in
/// order and the block adds its 32 rows in order: fixed, whatever the GPU,
/// and 32 loads in flight a column where one thread a column waited for
/// each of a few hundred partials in turn (tens of microseconds).
__global__ void __launch_bounds__(1024) columnFinishKernel(const float *partial, DPtr out, const float *partialB,
                                                          DPtr outB, int64_t chunks, int64_t cols, float scale) {
  __shared__ float tile[32][33];
  if (blockIdx.y == 1)
    partial = partialB, out = outB;
  int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0;
  if (c < cols)
    for (int64_t k = threadIdx.y; k < chunks; k += 32)
      s += partial[k * cols + c];
  tile[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float sum = 0;
#pragma unroll
    for (int y = 0; y < 32; ++y)
      sum += tile[y][threadIdx.x];
    out.st(c, sum * scale);
  }
}
/// columnFinishKernel over `cols` columns of one or two partial tables.
void columnFinish(const float *partial, DPtr out, const float *partialB, DPtr outB, int64_t chunks, int64_t cols,
                  float scale, cudaStream_t s) {
  dim3 grid(unsigned((cols + 31) / 32), outB ? 2u : 1u), block(32, 32);
  columnFinishKernel<<<grid, block, 0, s>>>(partial, out, partialB, outB, chunks, cols, scale);
}

/// One thread per output: sums (or maxes) the reduced subspace. `s` maps the
/// kept index to the input offset in .a; `r` walks the reduced dims in .a.
__global__ void reduceKernel(int op, DPtr x, DPtr y, int64_t nOut, Strided s, Strided r,
                             int64_t nRed, float scale) {
  GRID_LOOP(o, nOut) {
    int64_t base, unused;
    offsets(s, o, base, unused);
    float acc = op == 1 ? -INFINITY : 0.0f;
    for (int64_t k = 0; k < nRed; ++k) {
      int64_t off, u2;
      offsets(r, k, off, u2);
      float v = x[base + off];
      acc = op == 1 ? fmaxf(acc, v) : acc + v;
    }
    y.st(o, op == 1 ? acc : acc * scale);
  }
}

/// LayerNorm / RMSNorm over rows of h; saves mean and 1/std per row.
__global__ void normKernel(DPtr x, DPtr g, DPtr b, DPtr y, int64_t h, float eps, bool rms, float *meanOut,
                           float *rstdOut) {
  __shared__ float shared[32];
  int64_t row = blockIdx.x;
  DPtr xr = x + row * h;
  float sum = 0;
  if (!rms)
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
      sum += xr[j];
  float mean = rms ? 0.0f : blockSum(sum, shared) / h;
  float sq = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    sq += (xr[j] - mean) * (xr[j] - mean);
  float rstd = rsqrtf(blockSum(sq, shared) / h + eps);
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    y.st(row * h + j, (xr[j] - mean) * rstd * g[j] + (b.p ? b[j] : 0.0f));
  if (threadIdx.x == 0 && meanOut) {
    meanOut[row] = mean;
    rstdOut[row] = rstd;
  }
}

__global__ void normGradDxKernel(DPtr x, DPtr g, DPtr dy, DPtr dx, int64_t h, float eps, bool rms,
                                 float *meanOut, float *rstdOut) {
  __shared__ float shared[32];
  int64_t row = blockIdx.x;
  DPtr xr = x + row * h, dyr = dy + row * h;
  float sum = 0;
  if (!rms)
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
      sum += xr[j];
  float mean = rms ? 0.0f : blockSum(sum, shared) / h;
  float sq = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    sq += (xr[j] - mean) * (xr[j] - mean);
  float rstd = rsqrtf(blockSum(sq, shared) / h + eps);
  float sd = 0, sdx = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    float d = dyr[j] * g[j];
    sd += d;
    sdx += d * (xr[j] - mean) * rstd;
  }
  sd = blockSum(sd, shared);
  sdx = blockSum(sdx, shared);
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    float xh = (xr[j] - mean) * rstd, d = dyr[j] * g[j];
    dx.st(row * h + j, rstd * (d - (rms ? 0.0f : sd / h) - xh * sdx / h));
  }
  if (threadIdx.x == 0) {
    meanOut[row] = mean;
    rstdOut[row] = rstd;
  }
}

//===--- Normalisation by warps -------------------------------------------===//
// A warp per row, two adjacent elements per lane access, reductions by
// shuffles only (rows of a multiple of 64 elements; blocks of 8 rows).
/// Mean (0 for RMSNorm) and 1/std of row `xr`, for every lane.
__device__ inline void rowMoments(DPtr xr, int h, bool rms, float eps, float &mean, float &rstd) {
  int lane = threadIdx.x % 32;
  float sum = 0;
  if (!rms)
    for (int j = 2 * lane; j < h; j += 64) {
      float2 v = ld2(xr, j);
      sum += v.x + v.y;
    }
  mean = rms ? 0.0f : warpSum(sum) / h;
  float sq = 0;
  for (int j = 2 * lane; j < h; j += 64) {
    float2 v = ld2(xr, j);
    sq += (v.x - mean) * (v.x - mean) + (v.y - mean) * (v.y - mean);
  }
  rstd = rsqrtf(warpSum(sq) / h + eps);
}
__global__ void normRowsKernel(DPtr x, DPtr g, DPtr b, DPtr y, int64_t rows, int h, float eps, bool rms) {
  int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= rows)
    return;
  DPtr xr = x + row * h, yr = y + row * h;
  float mean, rstd;
  rowMoments(xr, h, rms, eps, mean, rstd);
  for (int j = 2 * (threadIdx.x % 32); j < h; j += 64) {
    float2 v = ld2(xr, j), gg = ld2(g, j), bb = b.p ? ld2(b, j) : make_float2(0, 0);
    st2(yr, j, (v.x - mean) * rstd * gg.x + bb.x, (v.y - mean) * rstd * gg.y + bb.y);
  }
}
__global__ void normGradRowsKernel(DPtr x, DPtr g, DPtr dy, DPtr dx, int64_t rows, int h, float eps, bool rms,
                                   float *meanOut, float *rstdOut) {
  int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= rows)
    return;
  int lane = threadIdx.x % 32;
  DPtr xr = x + row * h, dyr = dy + row * h, dxr = dx + row * h;
  float mean, rstd;
  rowMoments(xr, h, rms, eps, mean, rstd);
  float sd = 0, sdx = 0;
  for (int j = 2 * lane; j < h; j += 64) {
    float2 v = ld2(xr, j), d = ld2(dyr, j), gg = ld2(g, j);
    sd += d.x * gg.x + d.y * gg.y;
    sdx += d.x * gg.x * (v.x - mean) * rstd + d.y * gg.y * (v.y - mean) * rstd;
  }
  sd = warpSum(sd), sdx = warpSum(sdx);
  for (int j = 2 * lane; j < h; j += 64) {
    float2 v = ld2(xr, j), d = ld2(dyr, j), gg = ld2(g, j);
    float a = rstd * (d.x * gg.x - (rms ? 0.0f : sd / h) - (v.x - mean) * rstd * sdx / h);
    float c = rstd * (d.y * gg.y - (rms ? 0.0f : sd / h) - (v.y - mean) * rstd * sdx / h);
    st2(dxr, j, a, c);
  }
  if (lane == 0) {
    meanOut[row] = mean;
    rstdOut[row] = rstd;
  }
}
/// columnPartialKernel with two adjacent columns per thread (64 per block).
__global__ void columnPartial2Kernel(DPtr x, const float *mean, const float *rstd, DPtr dy, float *partial,
                                     float *partialB, int64_t rows, int64_t cols, int64_t rowsPerChunk) {
  __shared__ float2 tile[8][33], tileB[8][33];
  int64_t col = blockIdx.x * 64 + threadIdx.x * 2, chunk = blockIdx.y;
  int64_t r0 = chunk * rowsPerChunk, r1 = min(rows, r0 + rowsPerChunk);
  float2 acc = make_float2(0, 0), accB = make_float2(0, 0);
  if (col < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      if (dy) {
        float2 d = ld2(dy, r * cols + col), v = ld2(x, r * cols + col);
        acc.x += d.x * (v.x - mean[r]) * rstd[r];
        acc.y += d.y * (v.y - mean[r]) * rstd[r];
        accB.x += d.x;
        accB.y += d.y;
      } else {
        float2 v = ld2(x, r * cols + col);
        acc.x += v.x;
        acc.y += v.y;
      }
    }
  tile[threadIdx.y][threadIdx.x] = acc;
  tileB[threadIdx.y][threadIdx.x] = accB;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float2 sum = make_float2(0, 0), sumB = make_float2(0, 0);
    for (int k = 0; k < 8; ++k) {
      sum.x += tile[k][threadIdx.x].x, sum.y += tile[k][threadIdx.x].y;
      sumB.x += tileB[k][threadIdx.x].x, sumB.y += tileB[k][threadIdx.x].y;
    }
    partial[chunk * cols + col] = sum.x;
    partial[chunk * cols + col + 1] = sum.y;
    if (partialB) {
      partialB[chunk * cols + col] = sumB.x;
      partialB[chunk * cols + col + 1] = sumB.y;
    }
  }
}

//===--- bf16 rows and columns with 16-byte accesses ----------------------===//
// Eight bf16 per access. Norms keep a warp's row in registers (h = 256 P,
// P <= MaxP) so x is read once; column sums give each thread eight columns.
/// Mean (0 for RMSNorm) and 1/std of a warp's row held in registers.
template <int MaxP>
__device__ inline void registerRowMoments(const float (&v)[MaxP][8], int P, int h, bool rms, float eps, float &mean,
                                          float &rstd) {
  float sum = 0, sq = 0;
#pragma unroll
  for (int k = 0; k < MaxP; ++k)
    if (k < P)
#pragma unroll
      for (int e = 0; e < 8; ++e)
        sum += v[k][e];
  mean = rms ? 0.0f : warpSum(sum) / h;
#pragma unroll
  for (int k = 0; k < MaxP; ++k)
    if (k < P)
#pragma unroll
      for (int e = 0; e < 8; ++e)
        sq += (v[k][e] - mean) * (v[k][e] - mean);
  rstd = rsqrtf(warpSum(sq) / h + eps);
}

template <int MaxP>
__global__ void __launch_bounds__(256) normRowsBf16Kernel(const bf16 *x, DPtr g, DPtr b, bf16 *y, int64_t rows,
                                                          int P, float eps, bool rms) {
  int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= rows)
    return;
  int lane = threadIdx.x % 32, h = 256 * P;
  const bf16 *xr = x + row * h;
  float v[MaxP][8];
#pragma unroll
  for (int k = 0; k < MaxP; ++k)
    if (k < P) {
      Pack<bf16> pk = load(xr + (k * 32 + lane) * 8);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        v[k][e] = __bfloat162float(pk.v[e]);
    }
  float mean, rstd;
  registerRowMoments<MaxP>(v, P, h, rms, eps, mean, rstd);
#pragma unroll
  for (int k = 0; k < MaxP; ++k)
    if (k < P) {
      int64_t j = (k * 32 + lane) * 8;
      float gg[8], bb[8] = {0, 0, 0, 0, 0, 0, 0, 0}, o[8];
      load8(g, j, gg);
      if (b)
        load8(b, j, bb);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        o[e] = (v[k][e] - mean) * rstd * gg[e] + bb[e];
      store8(y + row * h + j, o);
    }
}

/// A warp's row of a bf16 norm gradient in registers (h = 256 P): v becomes
/// x-hat and d holds dy (times gamma where `scaled`); the row's mean, 1/std
/// and the two means the input gradient subtracts: sd of dy * gamma (0 for
/// RMSNorm) and sdx of dy * gamma * x-hat.
template <int MaxP>
__device__ inline void normGradRow(const bf16 *x, DPtr g, const bf16 *dy, int64_t row, int P, bool rms, float eps,
                                   bool scaled, float (&v)[MaxP][8], float (&d)[MaxP][8], float &mean, float &rstd,
                                   float &sd, float &sdx) {
  int lane = threadIdx.x % 32, h = 256 * P;
#pragma unroll
  for (int k = 0; k < MaxP; ++k)
    if (k < P) {
      int64_t j = row * h + (k * 32 + lane) * 8;
      Pack<bf16> px = load(x + j), pd = load(dy + j);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        v[k][e] = __bfloat162float(px.v[e]), d[k][e] = __bfloat162float(pd.v[e]);
    }
  registerRowMoments<MaxP>(v, P, h, rms, eps, mean, rstd);
  sd = 0, sdx = 0;
#pragma unroll
  for (int k = 0; k < MaxP; ++k)
    if (k < P) {
      float gg[8];
      load8(g, (k * 32 + lane) * 8, gg);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        v[k][e] = (v[k][e] - mean) * rstd; // x-hat from here on
        float dg = d[k][e] * gg[e];        // dy * gamma
        if (scaled)
          d[k][e] = dg;
        sd += dg, sdx += dg * v[k][e];
      }
    }
  sd = rms ? 0.0f : warpSum(sd) / h, sdx = warpSum(sdx) / h;
}

template <int MaxP>
__global__ void __launch_bounds__(256) normGradRowsBf16Kernel(const bf16 *x, DPtr g, const bf16 *dy, bf16 *dx,
                                                              int64_t rows, int P, float eps, bool rms,
                                                              float *meanOut, float *rstdOut,
                                                              const bf16 *res = nullptr) {
  int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= rows)
    return;
  int lane = threadIdx.x % 32, h = 256 * P;
  float v[MaxP][8], d[MaxP][8], mean, rstd, sd, sdx;
  normGradRow<MaxP>(x, g, dy, row, P, rms, eps, true, v, d, mean, rstd, sd, sdx);
#pragma unroll
  for (int k = 0; k < MaxP; ++k)
    if (k < P) {
      float o[8];
#pragma unroll
      for (int e = 0; e < 8; ++e)
        o[e] = rstd * (d[k][e] - sd - v[k][e] * sdx);
      if (res) { // the residual stream's gradient (possibly dx itself: each lane reads its own elements first)
        Pack<bf16> pr = load(res + row * h + (k * 32 + lane) * 8);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          o[e] += __bfloat162float(pr.v[e]);
      }
      store8(dx + row * h + (k * 32 + lane) * 8, o);
    }
  if (lane == 0) {
    meanOut[row] = mean;
    rstdOut[row] = rstd;
  }
}

/// The bf16 norm gradient in one pass over its rows: a warp per row, as
/// normGradRowsBf16Kernel (dx, plus the residual stream's gradient), with
/// the norm parameters' gradients summed on the way. Each warp adds its
/// rows' dy * x-hat and dy into its own row of shared memory (no atomics),
/// the block adds its warps' rows in order into partial[block], and
/// columnFinishKernel adds the blocks' in order: deterministic, and x and dy
/// are read once (the two-pass form read both again for the column sums).
/// Warps: 8 for rows of up to 1024, 4 for up to 2048 (shared memory of
/// 2 h floats a warp: 64 KB either way); registers held to two blocks an SM.
template <int MaxP, int Warps>
__global__ void __launch_bounds__(Warps * 32, 16 / Warps) normGradFusedBf16Kernel(
    const bf16 *x, DPtr g, const bf16 *dy, bf16 *dx, int64_t rows, int P, float eps, bool rms, const bf16 *res,
    float *partial, float *partialB, int64_t rowsPerBlock) {
  extern __shared__ float acc[]; // [Warps][2][h]: dy * x-hat, then dy
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, h = 256 * P;
  float *mine = acc + int64_t(warp) * 2 * h;
  for (int i = lane * 4; i < 2 * h; i += 128)
    *reinterpret_cast<float4 *>(mine + i) = make_float4(0, 0, 0, 0);
  __syncwarp();
  int64_t r0 = int64_t(blockIdx.x) * rowsPerBlock, r1 = min(rows, r0 + rowsPerBlock);
  for (int64_t row = r0 + warp; row < r1; row += Warps) {
    float v[MaxP][8], d[MaxP][8], mean, rstd, sd, sdx; // d stays dy: the bias gradient sums it
    normGradRow<MaxP>(x, g, dy, row, P, rms, eps, false, v, d, mean, rstd, sd, sdx);
#pragma unroll
    for (int k = 0; k < MaxP; ++k)
      if (k < P) {
        int col = (k * 32 + lane) * 8;
        float gg[8], o[8];
        load8(g, col, gg);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          o[e] = rstd * (d[k][e] * gg[e] - sd - v[k][e] * sdx);
        if (res) { // possibly dx itself: each lane reads its own elements before it writes them
          Pack<bf16> pr = load(res + row * h + col);
#pragma unroll
          for (int e = 0; e < 8; ++e)
            o[e] += __bfloat162float(pr.v[e]);
        }
        store8(dx + row * h + col, o);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float4 a = *reinterpret_cast<const float4 *>(mine + col + 4 * half);
          float4 b = *reinterpret_cast<const float4 *>(mine + h + col + 4 * half);
          const float *vv = v[k] + 4 * half, *dd = d[k] + 4 * half;
          a.x += dd[0] * vv[0], a.y += dd[1] * vv[1], a.z += dd[2] * vv[2], a.w += dd[3] * vv[3];
          b.x += dd[0], b.y += dd[1], b.z += dd[2], b.w += dd[3];
          *reinterpret_cast<float4 *>(mine + col + 4 * half) = a;
          *reinterpret_cast<float4 *>(mine + h + col + 4 * half) = b;
        }
      }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < h; c += blockDim.x) {
    float sg = 0, sb = 0;
#pragma unroll
    for (int w = 0; w < Warps; ++w)
      sg += acc[int64_t(w) * 2 * h + c], sb += acc[int64_t(w) * 2 * h + h + c];
    partial[int64_t(blockIdx.x) * h + c] = sg;
    if (partialB)
      partialB[int64_t(blockIdx.x) * h + c] = sb;
  }
}

/// Per-chunk column sums of bf16 x (or, with dy, of dy * x-hat and dy: norm
/// parameter gradients), eight columns per thread; blocks of 32 x 8 threads
/// cover 256 columns.
__global__ void __launch_bounds__(256) columnPartial8Kernel(const bf16 *x, const float *mean, const float *rstd,
                                                            const bf16 *dy, float *partial, float *partialB,
                                                            int64_t rows, int64_t cols, int64_t rowsPerChunk) {
  __shared__ float tile[8][256], tileB[8][256];
  int64_t col = (int64_t(blockIdx.x) * 32 + threadIdx.x) * 8, chunk = blockIdx.y;
  int64_t r0 = chunk * rowsPerChunk, r1 = min(rows, r0 + rowsPerChunk);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, accB[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (col < cols)
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      Pack<bf16> pv = load(x + r * cols + col);
      if (dy) {
        Pack<bf16> pd = load(dy + r * cols + col);
        float m = mean[r], rs = rstd[r];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float dd = __bfloat162float(pd.v[e]);
          acc[e] += dd * (__bfloat162float(pv.v[e]) - m) * rs;
          accB[e] += dd;
        }
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e)
          acc[e] += __bfloat162float(pv.v[e]);
      }
    }
#pragma unroll
  for (int e = 0; e < 8; ++e)
    tile[threadIdx.y][threadIdx.x * 8 + e] = acc[e], tileB[threadIdx.y][threadIdx.x * 8 + e] = accB[e];
  __syncthreads();
  int t = threadIdx.y * 32 + threadIdx.x; // one column of the block's 256 per thread
  int64_t c = int64_t(blockIdx.x) * 256 + t;
  if (c < cols) {
    float sum = 0, sumB = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k)
      sum += tile[k][t], sumB += tileB[k][t];
    partial[chunk * cols + c] = sum;
    if (partialB)
      partialB[chunk * cols + c] = sumB;
  }
}

} // namespace

bool CudaBackendImpl::bf16Rows(const Instruction &ins, int64_t h) {
  if (h % 256 != 0 || h > 2048)
    return false;
  for (int64_t id : ins.in) {
    const Buffer &b = buf(id);
    if (reinterpret_cast<uintptr_t>(ptr(b)) % 16 != 0 || (b.dtype != LOOM_BF16 && b.dtype != LOOM_F32))
      return false;
  }
  for (int64_t id : ins.out)
    if (reinterpret_cast<uintptr_t>(ptr(buf(id))) % 16 != 0)
      return false;
  return isBf16(buf(ins.in[0])) && isBf16(buf(ins.out[0])) &&
         (ins.op.find("_grad") == std::string::npos || isBf16(buf(ins.in[2])));
}

Launch CudaBackendImpl::buildReduce(const Instruction &ins) {
  const std::string &op = ins.op;
  const Buffer &x = buf(ins.in[0]);
  std::vector<bool> reduced(x.shape.size(), false);
  for (auto &a : ins.attrs.at("axes"))
    reduced[a.get<int64_t>() < 0 ? a.get<int64_t>() + x.shape.size() : a.get<int64_t>()] = true;
  std::vector<int64_t> unit = stridesOf(x.shape), keptShape, keptStride, redShape, redStride;
  for (size_t d = 0; d < x.shape.size(); ++d)
    (reduced[d] ? redShape : keptShape).push_back(x.shape[d]), (reduced[d] ? redStride : keptStride).push_back(unit[d]);
  size_t lead = 0;
  while (lead < reduced.size() && reduced[lead])
    ++lead;
  bool leadingOnly = op != "reduce_max" && lead > 0 &&
                     std::none_of(reduced.begin() + lead, reduced.end(), [](bool r) { return r; });
  if (leadingOnly) { // sums over rows, per column (bias gradients): two deterministic passes
    int64_t rows = count(redShape), cols = count(keptShape);
    int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(rows / 64, 512)), per = (rows + chunks - 1) / chunks;
    float scale = op == "reduce_mean" ? 1.0f / float(rows) : 1.0f;
    DPtr px = fp(ins.in[0]), py = fp(ins.out[0]);
    bool vec8 = px.bf && cols % 8 == 0 && reinterpret_cast<uintptr_t>(px.p) % 16 == 0;
    reserve(size_t(chunks * cols) * sizeof(float));
    return [=](cudaStream_t s) {
      float *partial = reinterpret_cast<float *>(workspace);
      if (vec8) {
        dim3 grid(unsigned((cols + 255) / 256), unsigned(chunks)), block(32, 8);
        columnPartial8Kernel<<<grid, block, 0, s>>>(static_cast<const bf16 *>(px.p), nullptr, nullptr, nullptr,
                                                    partial, nullptr, rows, cols, per);
      } else if (cols % 2 == 0) {
        dim3 grid(unsigned((cols + 63) / 64), unsigned(chunks)), block(32, 8);
        columnPartial2Kernel<<<grid, block, 0, s>>>(px, nullptr, nullptr, DPtr{}, partial, nullptr, rows, cols, per);
      } else {
        dim3 grid(unsigned((cols + 31) / 32), unsigned(chunks)), block(32, 8);
        columnPartialKernel<<<grid, block, 0, s>>>(px, nullptr, nullptr, DPtr{}, partial, nullptr, rows, cols, per);
      }
      columnFinish(partial, py, nullptr, DPtr{}, chunks, cols, scale, s);
    };
  }
  if (keptShape.empty())
    keptShape = {1}, keptStride = {0};
  Strided ks = strided(keptShape, keptStride), rs = strided(redShape, redStride);
  int64_t nOut = count(keptShape), nRed = count(redShape);
  int code = op == "reduce_max" ? 1 : 0;
  float scale = op == "reduce_mean" ? 1.0f / float(nRed) : 1.0f;
  DPtr px = fp(ins.in[0]), py = fp(ins.out[0]);
  return [=](cudaStream_t s) { reduceKernel<<<blocksFor(nOut), kThreads, 0, s>>>(code, px, py, nOut, ks, rs, nRed, scale); };
}

Launch CudaBackendImpl::buildNorm(const Instruction &ins) {
  const std::string &op = ins.op;
  bool rms = op == "rmsnorm";
  const Buffer &x = buf(ins.in[0]);
  int64_t h = x.shape.back(), rows = count(x.shape) / h;
  float eps = static_cast<float>(num(ins, "eps", 1e-5));
  DPtr px = fp(ins.in[0]), g = fp(ins.in[1]), b = rms ? DPtr{} : fp(ins.in[2]), y = fp(ins.out[0]);
  if (int P = int(h / 256); bf16Rows(ins, h)) {
    const bf16 *xb = static_cast<const bf16 *>(px.p);
    bf16 *yb = static_cast<bf16 *>(y.p);
    unsigned blocks = unsigned((rows + 7) / 8);
    if (P <= 4)
      return [=](cudaStream_t s) { normRowsBf16Kernel<4><<<blocks, 256, 0, s>>>(xb, g, b, yb, rows, P, eps, rms); };
    return [=](cudaStream_t s) { normRowsBf16Kernel<8><<<blocks, 256, 0, s>>>(xb, g, b, yb, rows, P, eps, rms); };
  }
  if (h % 64 == 0 && h < (1 << 30))
    return [=](cudaStream_t s) {
      normRowsKernel<<<unsigned((rows + 7) / 8), 256, 0, s>>>(px, g, b, y, rows, int(h), eps, rms);
    };
  return [=](cudaStream_t s) { normKernel<<<int(rows), kThreads, 0, s>>>(px, g, b, y, h, eps, rms, nullptr, nullptr); };
}

Launch CudaBackendImpl::buildNormGrad(const Instruction &ins) {
  const std::string &op = ins.op;
  bool rms = op == "rmsnorm_grad";
  const Buffer &x = buf(ins.in[0]);
  int64_t h = x.shape.back(), rows = count(x.shape) / h;
  float eps = static_cast<float>(num(ins, "eps", 1e-5));
  DPtr px = fp(ins.in[0]), g = fp(ins.in[1]), dy = fp(ins.in[2]), dx = fp(ins.out[0]), dg = fp(ins.out[1]);
  DPtr db = rms ? DPtr{} : fp(ins.out[2]);
  // A fourth input: the residual stream's gradient, added to dx. The
  // register-row kernel adds it in place; the others write dx to the
  // workspace first (the residual may be dx's own buffer).
  DPtr res = ins.in.size() == 4 ? fp(ins.in[3]) : DPtr{};
  int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(rows / 64, 512)), per = (rows + chunks - 1) / chunks;
  bool fast = bf16Rows(ins, h) && (!res.p || (res.bf && reinterpret_cast<uintptr_t>(res.p) % 16 == 0));
  // One pass (normGradFusedBf16Kernel): about two blocks an SM, each a run
  // of rows; LOOM_CUDA_NORM_GRAD=two-pass runs the row and column kernels.
  static const bool twoPass = [] {
    const char *e = std::getenv("LOOM_CUDA_NORM_GRAD");
    return e && std::string(e) == "two-pass";
  }();
  bool fused = fast && !twoPass;
  int warps = h <= 1024 ? 8 : 4;
  size_t shared = size_t(warps) * 2 * size_t(h) * sizeof(float);
  if (fused) {
    int sms = 0;
    LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    per = (rows + 2 * sms - 1) / (2 * sms);
    per = std::max<int64_t>(warps, (per + warps - 1) / warps * warps);
    chunks = (rows + per - 1) / per;
    // The opt-in to 64 KB of shared memory is per device: on this one's.
    if (warps == 8)
      LOOM_CUDA_CHECK(cudaFuncSetAttribute(normGradFusedBf16Kernel<4, 8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(shared)));
    else
      LOOM_CUDA_CHECK(cudaFuncSetAttribute(normGradFusedBf16Kernel<8, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(shared)));
  }
  int64_t stats = (2 * rows + 2 * chunks * h) * int64_t(sizeof(float));
  stats = (stats + 255) / 256 * 256;
  reserve(stats + (res.p && !fast ? rows * h * int64_t(dx.bf ? 2 : 4) : 0));
  return [=](cudaStream_t s) {
    float *mean = reinterpret_cast<float *>(workspace), *rstd = mean + rows;
    float *partial = rstd + rows, *partialB = partial + chunks * h;
    DPtr out = res.p && !fast ? DPtr{static_cast<char *>(workspace) + stats, dx.bf} : dx;
    if (fused) {
      int P = int(h / 256);
      const bf16 *xb = static_cast<const bf16 *>(px.p), *dyb = static_cast<const bf16 *>(dy.p);
      const bf16 *rb = static_cast<const bf16 *>(res.p);
      bf16 *dxb = static_cast<bf16 *>(dx.p);
      if (warps == 8)
        normGradFusedBf16Kernel<4, 8><<<unsigned(chunks), 256, shared, s>>>(xb, g, dyb, dxb, rows, P, eps, rms, rb,
                                                                            partial, db ? partialB : nullptr, per);
      else
        normGradFusedBf16Kernel<8, 4><<<unsigned(chunks), 128, shared, s>>>(xb, g, dyb, dxb, rows, P, eps, rms, rb,
                                                                            partial, db ? partialB : nullptr, per);
    } else if (fast) {
      int P = int(h / 256);
      const bf16 *xb = static_cast<const bf16 *>(px.p), *dyb = static_cast<const bf16 *>(dy.p);
      const bf16 *rb = static_cast<const bf16 *>(res.p);
      bf16 *dxb = static_cast<bf16 *>(dx.p);
      if (P <= 4)
        normGradRowsBf16Kernel<4><<<unsigned((rows + 7) / 8), 256, 0, s>>>(xb, g, dyb, dxb, rows, P, eps, rms, mean,
                                                                           rstd, rb);
      else
        normGradRowsBf16Kernel<8><<<unsigned((rows + 7) / 8), 256, 0, s>>>(xb, g, dyb, dxb, rows, P, eps, rms, mean,
                                                                           rstd, rb);
      dim3 grid(unsigned((h + 255) / 256), unsigned(chunks)), block(32, 8);
      columnPartial8Kernel<<<grid, block, 0, s>>>(xb, mean, rstd, dyb, partial, partialB, rows, h, per);
    } else if (h % 64 == 0) {
      normGradRowsKernel<<<unsigned((rows + 7) / 8), 256, 0, s>>>(px, g, dy, out, rows, int(h), eps, rms, mean, rstd);
      dim3 grid(unsigned((h + 63) / 64), unsigned(chunks)), block(32, 8);
      columnPartial2Kernel<<<grid, block, 0, s>>>(px, mean, rstd, dy, partial, partialB, rows, h, per);
    } else {
      normGradDxKernel<<<int(rows), kThreads, 0, s>>>(px, g, dy, out, h, eps, rms, mean, rstd);
      dim3 grid(unsigned((h + 31) / 32), unsigned(chunks)), block(32, 8);
      columnPartialKernel<<<grid, block, 0, s>>>(px, mean, rstd, dy, partial, partialB, rows, h, per);
    }
    if (res.p && !fast)
      binaryContiguousKernel<<<blocksFor(rows * h), kThreads, 0, s>>>(kAdd, out, res, dx, rows * h, rows * h, rows * h);
    columnFinish(partial, dg, partialB, db, chunks, h, 1.0f, s);
  };
}

void CudaBackendImpl::addNormBuilders(BuilderTable &table) {
  for (const char *op : {"reduce_sum", "reduce_mean", "reduce_max"})
    table[op] = &CudaBackendImpl::buildReduce;
  for (const char *op : {"layernorm", "rmsnorm"})
    table[op] = &CudaBackendImpl::buildNorm;
  for (const char *op : {"layernorm_grad", "rmsnorm_grad"})
    table[op] = &CudaBackendImpl::buildNormGrad;
}

} // namespace loom::rt::cuda
