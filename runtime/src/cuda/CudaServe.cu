//===- CudaServe.cu - The paged key/value cache on the GPU ----------------===//
//
// kv_write copies each token's key and value rows into the cache rows the
// scheduler gave it, sixteen bytes at a time. paged_attention gives one
// block of threads to each (token, key/value head): its query heads share
// every key and value row they load, as grouped-query attention allows. The
// block's warps score the token's cached keys (a lane per few dimensions,
// reduced by shuffles), the scores stay in shared memory for the softmax,
// and the weighted values are summed per dimension. Decoding reads each
// cached row once per step; the weights' GEMMs, not this, bound a step.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"
#include "runtime/src/cuda/CudaKernelsCommon.cuh"

#include <cstdlib>
#include <string>
#include <type_traits>

namespace loom::rt::cuda {

namespace {

/// Error codes in the backend's error word (CudaBackend.cu names them).
constexpr long long kBadSlot = 3, kBadPosition = 4, kBadBlock = 5;

__global__ void kvWriteKernel(const char *k, const char *v, const int32_t *slots, char *kc, char *vc,
                              int64_t n, int64_t rowBytes, int64_t rows, long long *err) {
  int64_t packs = rowBytes / 16;
  GRID_LOOP(i, n * packs) {
    int64_t t = i / packs, j = i % packs, s = slots[t];
    if (s < 0)
      continue; // padding
    if (s >= rows) {
      if (j == 0)
        raise(err, kBadSlot, t, s);
      continue;
    }
    reinterpret_cast<int4 *>(kc + s * rowBytes)[j] = reinterpret_cast<const int4 *>(k + t * rowBytes)[j];
    reinterpret_cast<int4 *>(vc + s * rowBytes)[j] = reinterpret_cast<const int4 *>(v + t * rowBytes)[j];
  }
}

/// The same for rows that are not a multiple of sixteen bytes: two bytes at
/// a time (bf16 or half an f32).
__global__ void kvWriteNarrowKernel(const uint16_t *k, const uint16_t *v, const int32_t *slots, uint16_t *kc,
                                    uint16_t *vc, int64_t n, int64_t rowHalves, int64_t rows, long long *err) {
  GRID_LOOP(i, n * rowHalves) {
    int64_t t = i / rowHalves, j = i % rowHalves, s = slots[t];
    if (s < 0)
      continue;
    if (s >= rows) {
      if (j == 0)
        raise(err, kBadSlot, t, s);
      continue;
    }
    kc[s * rowHalves + j] = k[t * rowHalves + j];
    vc[s * rowHalves + j] = v[t * rowHalves + j];
  }
}

/// A decoding layer's rotary embeddings of q and k and its cache write in
/// one launch: a thread per pair of q, of k (rotated, stored to the token's
/// cache row and to k's result unless kOut is null: nothing else reads it)
/// or of v (copied to the cache row). The same arithmetic as the rotary
/// kernel's.
__global__ void rotaryCacheKernel(DPtr q, DPtr qOut, int64_t wq, DPtr k, DPtr kOut, int64_t wk, DPtr v, int64_t wv,
                                  int64_t d, double theta, const int32_t *positions, const int32_t *slots, DPtr kc,
                                  DPtr vc, int64_t n, int64_t rows, long long *err) {
  startDependents();
  waitPrevious(); // q, k and v are the previous kernel's
  const int64_t qPairs = n * wq / 2, kPairs = n * wk / 2, vPairs = n * wv / 2;
  GRID_LOOP(p, qPairs + kPairs + vPairs) {
    if (p < qPairs + kPairs) {
      const bool isQ = p < qPairs;
      const int64_t w = isQ ? wq : wk, at = (isQ ? p : p - qPairs) * 2, t = at / w, i = (at % d) / 2;
      DPtr x = isQ ? q : k, y = isQ ? qOut : kOut;
      float cs, sn, x0 = x[at], x1 = x[at + 1];
      rotaryAngle(float(positions[t]), i, d, theta, cs, sn);
      float y0 = x0 * cs - x1 * sn, y1 = x0 * sn + x1 * cs;
      if (y) { // k's result is left out where only the cache write read it
        y.st(at, y0);
        y.st(at + 1, y1);
      }
      if (isQ)
        continue;
      int64_t slot = slots[t];
      if (slot < 0)
        continue; // padding
      if (slot >= rows) {
        if (at % w == 0)
          raise(err, kBadSlot, t, slot);
        continue;
      }
      // The cache has k's result's type: the same rounding as copying it.
      kc.st(slot * wk + at % w, y0);
      kc.st(slot * wk + at % w + 1, y1);
    } else {
      const int64_t at = (p - qPairs - kPairs) * 2, t = at / wv, slot = slots[t];
      if (slot < 0 || slot >= rows)
        continue; // padding; a bad slot is reported by k's pairs
      vc.st(slot * wv + at % wv, v[at]);
      vc.st(slot * wv + at % wv + 1, v[at + 1]);
    }
  }
}

constexpr int kAttnThreads = 256;
/// Rotary and attention launch as programmatic dependents (launchAfter) in
/// steps of at most this many tokens, as decoding's products do. Measured
/// on an H200 with all three so launched: GPT-2 350M's batch-1 decoding
/// took 0.909-0.924 ms a token against 0.967. At batch 32 (its products
/// are cuBLASLt's) one run each way gave 20,383 tokens/s against 21,077,
/// within what runs without it vary (20,366-21,077), so larger steps keep
/// plain launches until a measurement says otherwise.
constexpr int64_t kDependentTokens = 8;
constexpr int kMaxGroup = 8; // query heads per key/value head held in registers


/// Softmax of each query head's scores ([group][maxKeys], the first `keys`
/// of each row) in place: a warp per head.
__device__ inline void softmaxScores(float *scores, int group, int keys, int maxKeys) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int g = warp; g < group; g += warps) {
    float mx = -INFINITY;
    for (int p = lane; p < keys; p += 32)
      mx = fmaxf(mx, scores[g * maxKeys + p]);
    for (int off = 16; off > 0; off /= 2)
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float sum = 0;
    for (int p = lane; p < keys; p += 32) {
      float e = __expf(scores[g * maxKeys + p] - mx);
      scores[g * maxKeys + p] = e;
      sum += e;
    }
    for (int off = 16; off > 0; off /= 2)
      sum += __shfl_xor_sync(0xffffffffu, sum, off);
    float inv = 1.0f / sum;
    for (int p = lane; p < keys; p += 32)
      scores[g * maxKeys + p] *= inv;
  }
}

/// The block's output: the sums of `parts` partial outputs ([parts][group][D]
/// in shared memory) of the group's query heads, stored from `at` on.
__device__ inline void storeSums(const float *partial, int parts, int group, int D, DPtr o, int64_t at) {
  for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
    float sum = 0;
    for (int k = 0; k < parts; ++k)
      sum += partial[k * group * D + i];
    o.st(at + i, sum);
  }
}

/// Block (token, kv head). Shared memory: the group's queries [group][D]
/// and their scores [group][keys]; the partial outputs reuse it at the end.
/// A thread scores whole keys (its row read in one pass, no shuffles), so
/// a decoding token's few hundred keys take one or two rounds.
template <typename T>
__global__ void pagedAttentionKernel(DPtr q, const T *kc, const T *vc, const int32_t *positions, const int32_t *table,
                                     DPtr o, int heads, int kvHeads, int D, int blockSize, int perSeq,
                                     int64_t numBlocks, float scale, int maxKeys, long long *err) {
  extern __shared__ float smem[];
  const int token = blockIdx.x, kh = blockIdx.y, group = heads / kvHeads;
  const int W = kvHeads * D;
  float *qs = smem;               // [group][D]
  float *scores = qs + group * D; // [group][maxKeys]
  const int32_t *blocks = table + int64_t(token) * perSeq;
  int pos = positions[token];
  if (pos < 0 || pos >= maxKeys) {
    if (threadIdx.x == 0 && kh == 0)
      raise(err, kBadPosition, token, pos);
    return;
  }
  const int keys = pos + 1;
  for (int b = threadIdx.x; b <= pos / blockSize; b += blockDim.x)
    if (blocks[b] < 0 || blocks[b] >= numBlocks)
      raise(err, kBadBlock, token, blocks[b]);
  for (int i = threadIdx.x; i < group * D; i += blockDim.x)
    qs[i] = q[(int64_t(token) * heads + kh * group + i / D) * D + i % D] * scale;
  __syncthreads();
  auto rowOf = [&](int p) {
    int b = blocks[p / blockSize];
    b = b < 0 || b >= numBlocks ? 0 : b; // reported above; read something in bounds
    return (int64_t(b) * blockSize + p % blockSize) * W + int64_t(kh) * D;
  };
  for (int p = threadIdx.x; p < keys; p += blockDim.x) {
    const T *krow = kc + rowOf(p);
    float acc[kMaxGroup] = {};
    for (int d = 0; d < D; ++d) {
      float kv = toF(krow[d]);
      for (int g = 0; g < group; ++g)
        acc[g] += qs[g * D + d] * kv;
    }
    for (int g = 0; g < group; ++g)
      scores[g * maxKeys + p] = acc[g];
  }
  __syncthreads();
  softmaxScores(scores, group, keys, maxKeys);
  __syncthreads();
  // Output: each thread a dimension and a stride of keys (consecutive
  // threads read consecutive dimensions of a value row); partial sums
  // reduced in shared memory.
  const int split = blockDim.x / D > 0 ? blockDim.x / D : 1;
  const int d = threadIdx.x % D, part = threadIdx.x / D;
  float acc[kMaxGroup] = {};
  if (threadIdx.x < split * D)
    for (int p = part; p < keys; p += split) {
      float vv = toF(vc[rowOf(p) + d]);
      for (int g = 0; g < group; ++g)
        acc[g] += scores[g * maxKeys + p] * vv;
    }
  __syncthreads();
  float *partial = smem; // [split][group][D]
  if (threadIdx.x < split * D)
    for (int g = 0; g < group; ++g)
      partial[(part * group + g) * D + d] = acc[g];
  __syncthreads();
  storeSums(partial, split, group, D, o, (int64_t(token) * heads + kh * group) * D);
}

/// Sixteen bytes of a cache row as floats.
template <typename T> struct Pack;
template <> struct Pack<float> {
  static constexpr int N = 4;
  __device__ static void load(const float *p, float *out) {
    float4 v = *reinterpret_cast<const float4 *>(p);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  }
};
template <> struct Pack<__nv_bfloat16> {
  static constexpr int N = 8;
  __device__ static void load(const __nv_bfloat16 *p, float *out) {
    int4 v = *reinterpret_cast<const int4 *>(p);
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&v);
    for (int i = 0; i < 4; ++i) {
      float2 f = __bfloat1622float2(h[i]);
      out[2 * i] = f.x, out[2 * i + 1] = f.y;
    }
  }
};

constexpr int kVecThreads = 256;

/// The same attention with sixteen-byte loads, for rows whose head slices
/// are sixteen-byte aligned. The token's block table is read into shared
/// memory once, so each key's address costs no global load. Scores: a
/// thread per key, its row read as D/N independent vectors. Output: the
/// threads split into key groups of D/N threads, each thread a vector of
/// dimensions over its group's keys, and the groups' sums reduced in
/// shared memory. Every load of a loop is independent of the others, so
/// many are in flight (the old kernel's chained table-then-row loads left
/// decoding bound by their latency).
template <typename T, int G>
__global__ void __launch_bounds__(kVecThreads)
    pagedAttentionVecKernel(DPtr q, const T *kc, const T *vc, const int32_t *positions, const int32_t *table,
                            DPtr o, int heads, int kvHeads, int D, int blockSize, int perSeq, int64_t numBlocks,
                            float scale, int maxKeys, long long *err) {
  constexpr int N = Pack<T>::N;
  extern __shared__ float smem[];
  startDependents();
  waitPrevious(); // q and the cache are earlier kernels'
  const int token = blockIdx.x, kh = blockIdx.y;
  constexpr int group = G; // query heads per key/value head, unrolled
  const int64_t W = int64_t(kvHeads) * D;
  float *qs = smem;                                           // [group][D]
  float *scores = qs + group * D;                             // [group][maxKeys]
  int *tbl = reinterpret_cast<int *>(scores + group * maxKeys); // [perSeq]
  const int32_t *blocks = table + int64_t(token) * perSeq;
  const int pos = positions[token];
  if (pos < 0 || pos >= maxKeys) {
    if (threadIdx.x == 0 && kh == 0)
      raise(err, kBadPosition, token, pos);
    return;
  }
  const int keys = pos + 1, used = pos / blockSize + 1;
  for (int b = threadIdx.x; b < used; b += blockDim.x) {
    int e = blocks[b];
    if (e < 0 || e >= numBlocks) {
      if (kh == 0)
        raise(err, kBadBlock, token, e);
      e = 0; // reported; read something in bounds
    }
    tbl[b] = e;
  }
  for (int i = threadIdx.x; i < group * D; i += blockDim.x)
    qs[i] = q[(int64_t(token) * heads + kh * group + i / D) * D + i % D] * scale;
  __syncthreads();
  auto rowOf = [&](int p) { return (int64_t(tbl[p / blockSize]) * blockSize + p % blockSize) * W + int64_t(kh) * D; };
  for (int p = threadIdx.x; p < keys; p += blockDim.x) {
    const T *krow = kc + rowOf(p);
    float acc[G] = {};
    for (int d = 0; d < D; d += N) {
      float kv[N];
      Pack<T>::load(krow + d, kv);
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int g = 0; g < G; ++g)
          acc[g] += qs[g * D + d + j] * kv[j];
    }
#pragma unroll
    for (int g = 0; g < G; ++g)
      scores[g * maxKeys + p] = acc[g];
  }
  __syncthreads();
  softmaxScores(scores, group, keys, maxKeys);
  __syncthreads();
  const int chunks = D / N, groups = blockDim.x / chunks;
  const int c = threadIdx.x % chunks, kg = threadIdx.x / chunks;
  float acc[G][N] = {};
  if (kg < groups) {
#pragma unroll 4
    for (int p = kg; p < keys; p += groups) {
      float vv[N];
      Pack<T>::load(vc + rowOf(p) + c * N, vv);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float w = scores[g * maxKeys + p];
#pragma unroll
        for (int j = 0; j < N; ++j)
          acc[g][j] += w * vv[j];
      }
    }
  }
  __syncthreads(); // the scores are read: the partial sums overlay them
  float *partial = smem; // [groups][group][D]
  if (kg < groups)
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int j = 0; j < N; ++j)
        partial[(kg * group + g) * D + c * N + j] = acc[g][j];
  __syncthreads();
  storeSums(partial, groups, group, D, o, (int64_t(token) * heads + kh * group) * D);
}

constexpr int kDecodeThreads = 256;
constexpr int kDecodeUnroll = 4; // keys a lane loads before using them

/// Decoding's attention, a query token at a time: block (token, key/value
/// head, GQ of its query heads). Each key is read by a few lanes (D/N, a
/// sixteen-byte slice each, its score reduced by shuffles); a lane keeps its
/// keys' running maximum, sum of exponentials and weighted values (online
/// softmax), so keys and values are loaded together, kDecodeUnroll keys per
/// lane at a time, with nothing between the loads and the block table but
/// shared memory. The key slots of a warp are combined by shuffles, the
/// warps' in shared memory, in order.
///
/// Launched as a programmatic dependent, the block reads the positions and
/// the block table (the step's inputs: `early`, no kernel of the program
/// writes them) and its first round of keys and values that earlier steps
/// wrote (positions below pos + 1 - stepTokens: this step's tokens of the
/// sequence are at most its last stepTokens positions) before the previous
/// kernel ends; q and the newest rows come after.
template <typename T, int GQ>
__global__ void __launch_bounds__(kDecodeThreads)
    pagedDecodeKernel(DPtr q, const T *kc, const T *vc, const int32_t *positions, const int32_t *table, DPtr o,
                      int heads, int kvHeads, int D, int blockSize, int perSeq, int64_t numBlocks, float scale,
                      int stepTokens, bool early, long long *err) {
  constexpr int N = Pack<T>::N;
  extern __shared__ float smem[];
  startDependents();
  if (!early)
    waitPrevious();
  const int token = blockIdx.x, kh = blockIdx.y;
  const int h0 = kh * (heads / kvHeads) + blockIdx.z * GQ; // the block's first query head
  const int lanesPerKey = D / N, keysPerWarp = 32 / lanesPerKey;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane / lanesPerKey, c = lane % lanesPerKey;
  const int slots = (blockDim.x / 32) * keysPerWarp, slot = warp * keysPerWarp + sub;
  const int warps = blockDim.x / 32;
  int *tbl = reinterpret_cast<int *>(smem);
  float *stats = smem + ((perSeq + 3) / 4) * 4; // [warps][GQ] maxima, then sums, then [warps][GQ][D] values
  float *sums = stats + warps * GQ, *values = sums + warps * GQ;
  const int32_t *blocks = table + int64_t(token) * perSeq;
  const int pos = positions[token];
  if (pos < 0 || pos >= perSeq * blockSize) {
    if (threadIdx.x == 0 && kh == 0 && blockIdx.z == 0)
      raise(err, kBadPosition, token, pos);
    return;
  }
  const int keys = pos + 1;
  for (int b = threadIdx.x; b <= pos / blockSize; b += blockDim.x) {
    int e = blocks[b];
    if (e < 0 || e >= numBlocks) {
      if (kh == 0 && blockIdx.z == 0)
        raise(err, kBadBlock, token, e);
      e = 0; // reported; read something in bounds
    }
    tbl[b] = e;
  }
  __syncthreads();
  const int64_t W = int64_t(kvHeads) * D;
  float kv[kDecodeUnroll][N], vv[kDecodeUnroll][N];
  // Loads this lane's keys and values of the round at `base` whose
  // positions are in [lo, hi); the others are left as they are.
  auto loadRound = [&](int base, int lo, int hi) {
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const int p = base + u * slots + slot;
      if (p >= lo && p < hi) {
        const int64_t row = (int64_t(tbl[p / blockSize]) * blockSize + p % blockSize) * W + int64_t(kh) * D + c * N;
        Pack<T>::load(kc + row, kv[u]);
        Pack<T>::load(vc + row, vv[u]);
      }
    }
  };
#pragma unroll
  for (int u = 0; u < kDecodeUnroll; ++u)
#pragma unroll
    for (int j = 0; j < N; ++j)
      kv[u][j] = 0.0f, vv[u][j] = 0.0f;
  const int written = early ? max(0, keys - stepTokens) : 0; // keys earlier steps wrote
  loadRound(0, 0, written);
  waitPrevious(); // q and this step's cache rows are earlier kernels'
  loadRound(0, written, keys);
  float qv[GQ][N];
#pragma unroll
  for (int g = 0; g < GQ; ++g)
#pragma unroll
    for (int j = 0; j < N; ++j)
      qv[g][j] = q[(int64_t(token) * heads + h0 + g) * D + c * N + j] * scale;
  float mx[GQ], total[GQ], acc[GQ][N];
#pragma unroll
  for (int g = 0; g < GQ; ++g) {
    mx[g] = -INFINITY, total[g] = 0.0f;
#pragma unroll
    for (int j = 0; j < N; ++j)
      acc[g][j] = 0.0f;
  }
  // Rounds are uniform across a warp (its lanes shuffle together); a lane
  // past the last key computes on zeros and keeps nothing.
  for (int base = 0; base < keys; base += slots * kDecodeUnroll) {
    if (base > 0) {
#pragma unroll
      for (int u = 0; u < kDecodeUnroll; ++u)
#pragma unroll
        for (int j = 0; j < N; ++j)
          kv[u][j] = 0.0f, vv[u][j] = 0.0f;
      loadRound(base, 0, keys);
    }
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const bool live = base + u * slots + slot < keys;
#pragma unroll
      for (int g = 0; g < GQ; ++g) {
        float sc = 0.0f;
#pragma unroll
        for (int j = 0; j < N; ++j)
          sc += qv[g][j] * kv[u][j];
        for (int off = lanesPerKey / 2; off > 0; off /= 2)
          sc += __shfl_xor_sync(0xffffffffu, sc, off);
        if (!live)
          continue;
        const float m = fmaxf(mx[g], sc), keep = __expf(mx[g] - m), w = __expf(sc - m);
        total[g] = total[g] * keep + w;
#pragma unroll
        for (int j = 0; j < N; ++j)
          acc[g][j] = acc[g][j] * keep + w * vv[u][j];
        mx[g] = m;
      }
    }
  }
  // A warp's key slots (lanes lanesPerKey apart) combined by shuffles...
  for (int off = lanesPerKey; off < 32; off *= 2)
#pragma unroll
    for (int g = 0; g < GQ; ++g) {
      const float om = __shfl_xor_sync(0xffffffffu, mx[g], off), ot = __shfl_xor_sync(0xffffffffu, total[g], off);
      const float m = fmaxf(mx[g], om);
      const float a = mx[g] == -INFINITY ? 0.0f : __expf(mx[g] - m), b = om == -INFINITY ? 0.0f : __expf(om - m);
#pragma unroll
      for (int j = 0; j < N; ++j)
        acc[g][j] = acc[g][j] * a + __shfl_xor_sync(0xffffffffu, acc[g][j], off) * b;
      total[g] = total[g] * a + ot * b, mx[g] = m;
    }
  // ...then the warps' in shared memory.
  if (sub == 0)
#pragma unroll
    for (int g = 0; g < GQ; ++g) {
      if (c == 0)
        stats[warp * GQ + g] = mx[g], sums[warp * GQ + g] = total[g];
#pragma unroll
      for (int j = 0; j < N; ++j)
        values[(warp * GQ + g) * D + c * N + j] = acc[g][j];
    }
  __syncthreads();
  for (int i = threadIdx.x; i < GQ * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    float m = -INFINITY;
    for (int s = 0; s < warps; ++s)
      m = fmaxf(m, stats[s * GQ + g]);
    float t = 0.0f, out = 0.0f;
    for (int s = 0; s < warps; ++s) {
      const float ms = stats[s * GQ + g];
      if (ms == -INFINITY)
        continue; // a warp without keys
      const float w = __expf(ms - m);
      t += w * sums[s * GQ + g];
      out += w * values[(s * GQ + g) * D + d];
    }
    o.st((int64_t(token) * heads + h0 + g) * D + d, out / t);
  }
}

/// Block per row: each thread the largest of its stride of columns (the
/// first on ties, NaN never), then the block's.
template <typename T> __global__ void argmaxRowsKernel(const T *x, int64_t cols, int32_t *out) {
  const T *row = x + int64_t(blockIdx.x) * cols;
  float best = -INFINITY;
  int64_t at = -1;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = toF(row[c]);
    if (v == v && (at < 0 || v > best))
      best = v, at = c;
  }
  __shared__ float bests[32];
  __shared__ int64_t ats[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  auto better = [](float v, int64_t a, float w, int64_t b) { // (w, b) beats (v, a)
    return b >= 0 && (a < 0 || w > v || (w == v && b < a));
  };
  for (int off = 16; off > 0; off /= 2) {
    float w = __shfl_down_sync(0xffffffffu, best, off);
    int64_t b = __shfl_down_sync(0xffffffffu, at, off);
    if (better(best, at, w, b))
      best = w, at = b;
  }
  if (lane == 0)
    bests[warp] = best, ats[warp] = at;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < int(blockDim.x / 32); ++w)
      if (better(best, at, bests[w], ats[w]))
        best = bests[w], at = ats[w];
    out[blockIdx.x] = int32_t(at < 0 ? 0 : at);
  }
}

} // namespace

void CudaBackendImpl::argmaxRows(const Buffer &b, int64_t rows, int64_t cols, int32_t *out) {
  int64_t size = b.dtype == LOOM_BF16 ? 2 : 4;
  if ((b.dtype != LOOM_BF16 && b.dtype != LOOM_F32) || cols < 1 || rows < 0 || rows * cols * size > b.bytes)
    fail(LOOM_INVALID_ARGUMENT, "argmax of ", rows, " rows of ", cols, " over '", b.name, "' (", dtypeName(b.dtype),
         shapeStr(b.shape), ")");
  if (rows == 0)
    return;
  LOOM_CUDA_CHECK(cudaSetDevice(device));
  if (rows > argmaxCapacity) {
    cudaFree(argmaxOut);
    argmaxOut = nullptr, argmaxCapacity = 0;
    LOOM_CUDA_CHECK(cudaMalloc(&argmaxOut, size_t(rows) * sizeof(int32_t)));
    argmaxCapacity = rows;
  }
  if (b.dtype == LOOM_BF16)
    argmaxRowsKernel<<<unsigned(rows), 1024, 0, stream>>>(reinterpret_cast<const __nv_bfloat16 *>(ptr(b)), cols,
                                                          argmaxOut);
  else
    argmaxRowsKernel<<<unsigned(rows), 1024, 0, stream>>>(reinterpret_cast<const float *>(ptr(b)), cols, argmaxOut);
  LOOM_CUDA_CHECK(cudaGetLastError());
  LOOM_CUDA_CHECK(cudaMemcpyAsync(out, argmaxOut, size_t(rows) * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
}

Launch CudaBackendImpl::buildKvWrite(const Instruction &ins) {
  const Buffer &k = buf(ins.in[0]), &slots = buf(ins.in[2]), &kc = buf(ins.out[0]);
  if (k.shape.size() != 3 || kc.shape.size() != 2 || kc.shape[1] != k.shape[2] || k.dtype != kc.dtype ||
      buf(ins.in[1]).shape != k.shape || buf(ins.out[1]).shape != kc.shape || slots.dtype != LOOM_I32 ||
      count(slots.shape) != k.shape[0] * k.shape[1])
    fail(LOOM_INVALID_BUNDLE, where, ": kv_write expects k, v [1, N, W], i32 slots [N] and caches [rows, W] of k's dtype");
  int64_t n = count(slots.shape), rowBytes = kc.shape[1] * int64_t(dtypeSize(kc.dtype)), rows = kc.shape[0];
  const char *pk = ptr(k), *pv = ptr(buf(ins.in[1]));
  const int32_t *ps = reinterpret_cast<const int32_t *>(ptr(slots));
  char *pkc = ptr(kc), *pvc = ptr(buf(ins.out[1]));
  long long *err = errorWord;
  bool wide = rowBytes % 16 == 0;
  for (const char *p : {pk, pv, static_cast<const char *>(pkc), static_cast<const char *>(pvc)})
    wide = wide && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  if (wide)
    return [=](cudaStream_t s) {
      kvWriteKernel<<<blocksFor(n * (rowBytes / 16)), kThreads, 0, s>>>(pk, pv, ps, pkc, pvc, n, rowBytes, rows, err);
    };
  return [=](cudaStream_t s) {
    kvWriteNarrowKernel<<<blocksFor(n * (rowBytes / 2)), kThreads, 0, s>>>(
        reinterpret_cast<const uint16_t *>(pk), reinterpret_cast<const uint16_t *>(pv), ps,
        reinterpret_cast<uint16_t *>(pkc), reinterpret_cast<uint16_t *>(pvc), n, rowBytes / 2, rows, err);
  };
}

bool CudaBackendImpl::rotaryCacheTogether(const std::vector<Instruction> &instrs, size_t i) {
  if (i + 2 >= instrs.size())
    return false;
  const Instruction &rq = instrs[i], &rk = instrs[i + 1], &kw = instrs[i + 2];
  if (rq.op != "rotary" || rk.op != "rotary" || kw.op != "kv_write" || rq.in.size() != 2 || rk.in.size() != 2 ||
      rq.in[1] != rk.in[1] || kw.in.size() != 3 || kw.out.size() != 2 || kw.in[0] != rk.out[0])
    return false;
  for (const Instruction *r : {&rq, &rk})
    if (flag(*r, "inverse") || num(*r, "theta", 10000.0) != num(rq, "theta", 10000.0))
      return false;
  const Buffer &q = buf(rq.in[0]), &k = buf(rk.in[0]), &v = buf(kw.in[1]), &kc = buf(kw.out[0]),
               &pos = buf(rq.in[1]), &slots = buf(kw.in[2]);
  int64_t hq = int64_t(num(rq, "num_heads", 1)), hk = int64_t(num(rk, "num_heads", 1));
  if (q.shape.size() != 3 || k.shape.size() != 3 || v.shape != k.shape || q.shape[1] != k.shape[1] || hq < 1 ||
      hk < 1 || q.shape[2] % hq || k.shape[2] % hk || q.shape[2] / hq != k.shape[2] / hk || (q.shape[2] / hq) % 2 ||
      kc.shape.size() != 2 || kc.shape[1] != k.shape[2] || buf(kw.out[1]).shape != kc.shape ||
      pos.dtype != LOOM_I32 || slots.dtype != LOOM_I32 || count(pos.shape) != q.shape[1] ||
      count(slots.shape) != q.shape[1] || buf(rq.out[0]).shape != q.shape || buf(rk.out[0]).shape != k.shape ||
      buf(rk.out[0]).dtype != kc.dtype || v.dtype != kc.dtype || buf(kw.out[1]).dtype != kc.dtype)
    return false;
  // A result may take its own input's place (each thread reads its pair
  // before writing it), but no other operand's. k's result is not written
  // where only the cache write reads it (the memory planner may have put it
  // where q was read).
  auto inPlace = [&](int64_t out, int64_t in) {
    return buf(out).offset == buf(in).offset && buf(out).bytes == buf(in).bytes;
  };
  std::vector<std::pair<int64_t, int64_t>> written{{rq.out[0], rq.in[0]}};
  if (rotaryKeysRead(instrs, i))
    written.push_back({rk.out[0], rk.in[0]});
  for (auto [out, own] : written)
    for (int64_t in : {rq.in[0], rk.in[0], kw.in[1], rq.in[1], kw.in[2], kw.out[0], kw.out[1]})
      if (overlaps(out, in) && !(in == own && inPlace(out, in)))
        return false;
  return written.size() == 1 || !overlaps(rq.out[0], rk.out[0]);
}

bool CudaBackendImpl::rotaryKeysRead(const std::vector<Instruction> &instrs, size_t i) {
  int64_t k = instrs[i + 1].out[0];
  return buf(k).role != BufferRole::Activation || readAfter(instrs, i + 3, k);
}

Launch CudaBackendImpl::buildRotaryCache(const std::vector<Instruction> &instrs, size_t i) {
  const Instruction &rq = instrs[i], &rk = instrs[i + 1], &kw = instrs[i + 2];
  const Buffer &q = buf(rq.in[0]), &k = buf(rk.in[0]), &kc = buf(kw.out[0]);
  int64_t n = q.shape[1], wq = q.shape[2], wk = k.shape[2], d = wq / int64_t(num(rq, "num_heads", 1));
  double theta = num(rq, "theta", 10000.0);
  DPtr pq = fp(rq.in[0]), qo = fp(rq.out[0]), pk = fp(rk.in[0]), pv = fp(kw.in[1]);
  DPtr ko = rotaryKeysRead(instrs, i) ? fp(rk.out[0]) : DPtr{};
  DPtr pkc = fp(kw.out[0]), pvc = fp(kw.out[1]);
  const int32_t *positions = reinterpret_cast<const int32_t *>(ptr(buf(rq.in[1])));
  const int32_t *slots = reinterpret_cast<const int32_t *>(ptr(buf(kw.in[2])));
  int64_t rows = kc.shape[0], total = n * (wq + 2 * wk) / 2;
  long long *err = errorWord;
  bool small = n <= kDependentTokens;
  return [=](cudaStream_t s) {
    launchAfter(small, rotaryCacheKernel, dim3(blocksFor(total)), dim3(kThreads), 0, s, pq, qo, wq, pk, ko, wk, pv, wk, d,
                theta, positions, slots, pkc, pvc, n, rows, err);
  };
}

Launch CudaBackendImpl::buildPagedAttention(const Instruction &ins) {
  const Buffer &q = buf(ins.in[0]), &kc = buf(ins.in[1]), &pos = buf(ins.in[3]), &table = buf(ins.in[4]);
  int heads = int(num(ins, "num_heads", 1)), kvHeads = int(num(ins, "num_kv_heads", heads));
  int blockSize = int(num(ins, "block_size", 0));
  if (q.shape.size() != 3 || kc.shape.size() != 2 || heads < 1 || kvHeads < 1 || heads % kvHeads ||
      q.shape[2] % heads || blockSize < 1 || table.shape.size() != 2 || pos.dtype != LOOM_I32 ||
      table.dtype != LOOM_I32 || table.shape[0] != q.shape[0] * q.shape[1])
    fail(LOOM_INVALID_BUNDLE, where, ": inconsistent paged attention shapes");
  int D = int(q.shape[2] / heads), group = heads / kvHeads, perSeq = int(table.shape[1]);
  if (group > kMaxGroup || D > kAttnThreads)
    fail(LOOM_UNSUPPORTED, where, ": paged attention supports up to ", kMaxGroup,
         " query heads per key/value head and head dimensions up to ", kAttnThreads, ", got ", group, " and ", D);
  int maxKeys = perSeq * blockSize;
  bool bf = kc.dtype == LOOM_BF16;
  if (kc.dtype != buf(ins.in[2]).dtype || (kc.dtype != LOOM_BF16 && kc.dtype != LOOM_F32))
    fail(LOOM_UNSUPPORTED, where, ": paged attention caches must both be f32 or bf16");
  int64_t n = q.shape[0] * q.shape[1], numBlocks = kc.shape[0] / blockSize;
  DPtr pq = fp(ins.in[0]), po = fp(ins.out[0]);
  const void *pk = ptr(kc), *pv = ptr(buf(ins.in[2]));
  const int32_t *pp = reinterpret_cast<const int32_t *>(ptr(pos)), *pt = reinterpret_cast<const int32_t *>(ptr(table));
  long long *err = errorWord;
  float scale = float(num(ins, "scale", 1.0 / std::sqrt(double(D))));
  bool small = n <= kDependentTokens;
  // Sixteen-byte loads where every head slice of a row is aligned to them.
  int pack = bf ? 8 : 4;
  bool vec = D % pack == 0 && reinterpret_cast<uintptr_t>(pk) % 16 == 0 && reinterpret_cast<uintptr_t>(pv) % 16 == 0 &&
             kVecThreads / (D / pack) >= 1;
  static const bool oldKernel = [] {
    return envIs("LOOM_CUDA_PAGED_SCALAR", "1");
  }();
  vec = vec && !oldKernel;
  size_t shared;
  if (vec) {
    int groups = kVecThreads / (D / pack);
    shared = std::max<size_t>(size_t(group) * (D + maxKeys) * sizeof(float) + size_t(perSeq) * sizeof(int),
                              size_t(groups) * group * D * sizeof(float));
  } else {
    int splitMax = std::max(1, kAttnThreads / D);
    shared = std::max<size_t>(size_t(group) * (D + maxKeys), size_t(splitMax) * group * D) * sizeof(float);
  }
  if (shared > 227 * 1024)
    fail(LOOM_UNSUPPORTED, where, ": paged attention over ", maxKeys, " positions needs ", shared,
         " bytes of shared memory; compile with a smaller --max-seq");
  auto allow = [&](const void *kernel) {
    if (shared > 48 * 1024)
      LOOM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)));
  };
  dim3 grid{unsigned(n), unsigned(kvHeads), 1u};
  // A kernel of cache element T (tag: a null T*) and its launch.
  auto vecLaunch = [&](auto tag, auto kernel) -> Launch {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    allow(reinterpret_cast<const void *>(kernel));
    return [=](cudaStream_t s) {
      launchAfter(small, kernel, grid, dim3(kVecThreads), shared, s, pq, static_cast<const T *>(pk),
                  static_cast<const T *>(pv), pp, pt, po, heads, kvHeads, D, blockSize, perSeq, numBlocks, scale,
                  maxKeys, err);
    };
  };
  const float *f32 = nullptr;
  const __nv_bfloat16 *b16 = nullptr;
  // The decoding kernel in steps of few (token, query head) pairs, where a
  // key's slices fill whole warps; the kernel above otherwise. On an H200
  // the decoding kernel took TinyLlama (groups of 8) from 1.38-1.39 to
  // 1.31-1.32 ms a token; for GPT-2's ungrouped heads it was no faster at
  // one sequence until it loaded earlier steps' keys before the previous
  // kernel's end (then 0.843-0.860 ms a token against 0.866-0.871), and
  // slower at 32 sequences (17.4 against 21.1 thousand tokens/s), which
  // the size rule leaves to the kernel above. LOOM_CUDA_PAGED=vec or
  // =decode chooses one.
  int sms = 0;
  LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const char *choice = std::getenv("LOOM_CUDA_PAGED");
  std::string paged = choice ? choice : "";
  int lanesPerKey = D / pack;
  bool decode = vec && lanesPerKey <= 32 && 32 % lanesPerKey == 0 &&
                (paged == "decode" || (paged != "vec" && n * heads < 2 * int64_t(sms)));
  if (decode) {
    // Query heads per block: as many as keep about two blocks per
    // multiprocessor (each block reads its key/value head's rows once).
    int gq = 1;
    for (int g : {4, 2})
      if (group % g == 0 && n * kvHeads * (group / g) >= 2 * int64_t(sms)) {
        gq = g;
        break;
      }
    size_t smem = ((size_t(perSeq) + 3) / 4 * 4 + size_t(kDecodeThreads / 32) * gq * (2 + D)) * sizeof(float);
    // The positions and block table are read before the previous kernel
    // ends where they are the step's inputs (kernels of the program write
    // neither), as are the cache rows earlier steps wrote.
    bool early = small && readOnlyHere(ins.in[3]) && readOnlyHere(ins.in[4]);
    int stepTokens = int(n);
    if (smem <= 48 * 1024) {
      dim3 dgrid{unsigned(n), unsigned(kvHeads), unsigned(group / gq)};
      auto launch = [&](auto tag, auto kernel) -> Launch {
        using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
        return [=](cudaStream_t s) {
          launchAfter(small, kernel, dgrid, dim3(kDecodeThreads), smem, s, pq, static_cast<const T *>(pk),
                      static_cast<const T *>(pv), pp, pt, po, heads, kvHeads, D, blockSize, perSeq, numBlocks, scale,
                      stepTokens, early, err);
        };
      };
      switch (gq * 2 + bf) {
      case 2: return launch(f32, pagedDecodeKernel<float, 1>);
      case 3: return launch(b16, pagedDecodeKernel<__nv_bfloat16, 1>);
      case 4: return launch(f32, pagedDecodeKernel<float, 2>);
      case 5: return launch(b16, pagedDecodeKernel<__nv_bfloat16, 2>);
      case 8: return launch(f32, pagedDecodeKernel<float, 4>);
      case 9: return launch(b16, pagedDecodeKernel<__nv_bfloat16, 4>);
      default: break;
      }
    }
  }
  if (vec) {
    switch (group * 2 + bf) {
    case 2: return vecLaunch(f32, pagedAttentionVecKernel<float, 1>);
    case 3: return vecLaunch(b16, pagedAttentionVecKernel<__nv_bfloat16, 1>);
    case 4: return vecLaunch(f32, pagedAttentionVecKernel<float, 2>);
    case 5: return vecLaunch(b16, pagedAttentionVecKernel<__nv_bfloat16, 2>);
    case 8: return vecLaunch(f32, pagedAttentionVecKernel<float, 4>);
    case 9: return vecLaunch(b16, pagedAttentionVecKernel<__nv_bfloat16, 4>);
    case 16: return vecLaunch(f32, pagedAttentionVecKernel<float, 8>);
    case 17: return vecLaunch(b16, pagedAttentionVecKernel<__nv_bfloat16, 8>);
    default: break; // other group sizes: the general kernel
    }
  }
  allow(bf ? reinterpret_cast<const void *>(pagedAttentionKernel<__nv_bfloat16>)
           : reinterpret_cast<const void *>(pagedAttentionKernel<float>));
  return [=](cudaStream_t s) {
    if (bf)
      pagedAttentionKernel<__nv_bfloat16><<<grid, kAttnThreads, shared, s>>>(
          pq, static_cast<const __nv_bfloat16 *>(pk), static_cast<const __nv_bfloat16 *>(pv), pp, pt, po, heads,
          kvHeads, D, blockSize, perSeq, numBlocks, scale, maxKeys, err);
    else
      pagedAttentionKernel<float><<<grid, kAttnThreads, shared, s>>>(
          pq, static_cast<const float *>(pk), static_cast<const float *>(pv), pp, pt, po, heads, kvHeads, D,
          blockSize, perSeq, numBlocks, scale, maxKeys, err);
  };
}

void CudaBackendImpl::addServeBuilders(BuilderTable &table) {
  table["kv_write"] = &CudaBackendImpl::buildKvWrite;
  table["paged_attention"] = &CudaBackendImpl::buildPagedAttention;
}

} // namespace loom::rt::cuda
