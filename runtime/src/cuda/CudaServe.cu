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

constexpr int kAttnThreads = 256;
constexpr int kMaxGroup = 8; // query heads per key/value head held in registers

template <typename T> __device__ inline float toFloat(T v);
template <> __device__ inline float toFloat(float v) { return v; }
template <> __device__ inline float toFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

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
      float kv = toFloat(krow[d]);
      for (int g = 0; g < group; ++g)
        acc[g] += qs[g * D + d] * kv;
    }
    for (int g = 0; g < group; ++g)
      scores[g * maxKeys + p] = acc[g];
  }
  __syncthreads();
  // Softmax per query head: a warp per head.
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
  __syncthreads();
  // Output: each thread a dimension and a stride of keys (consecutive
  // threads read consecutive dimensions of a value row); partial sums
  // reduced in shared memory.
  const int split = blockDim.x / D > 0 ? blockDim.x / D : 1;
  const int d = threadIdx.x % D, part = threadIdx.x / D;
  float acc[kMaxGroup] = {};
  if (threadIdx.x < split * D)
    for (int p = part; p < keys; p += split) {
      float vv = toFloat(vc[rowOf(p) + d]);
      for (int g = 0; g < group; ++g)
        acc[g] += scores[g * maxKeys + p] * vv;
    }
  __syncthreads();
  float *partial = smem; // [split][group][D]
  if (threadIdx.x < split * D)
    for (int g = 0; g < group; ++g)
      partial[(part * group + g) * D + d] = acc[g];
  __syncthreads();
  for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
    float s = 0;
    for (int k = 0; k < split; ++k)
      s += partial[k * group * D + i];
    o.st((int64_t(token) * heads + kh * group + i / D) * D + i % D, s);
  }
}

} // namespace

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
  int splitMax = std::max(1, kAttnThreads / D);
  size_t shared = std::max<size_t>(size_t(group) * (D + maxKeys), size_t(splitMax) * group * D) * sizeof(float);
  if (shared > 227 * 1024)
    fail(LOOM_UNSUPPORTED, where, ": paged attention over ", maxKeys, " positions needs ", shared,
         " bytes of shared memory; compile with a smaller --max-seq");
  bool bf = kc.dtype == LOOM_BF16;
  if (shared > 48 * 1024) {
    if (bf)
      LOOM_CUDA_CHECK(cudaFuncSetAttribute(pagedAttentionKernel<__nv_bfloat16>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)));
    else
      LOOM_CUDA_CHECK(cudaFuncSetAttribute(pagedAttentionKernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(shared)));
  }
  float scale = float(num(ins, "scale", 1.0 / std::sqrt(double(D))));
  int64_t n = q.shape[0] * q.shape[1], numBlocks = kc.shape[0] / blockSize;
  DPtr pq = fp(ins.in[0]), po = fp(ins.out[0]);
  const void *pk = ptr(kc), *pv = ptr(buf(ins.in[2]));
  if (kc.dtype != buf(ins.in[2]).dtype || (kc.dtype != LOOM_BF16 && kc.dtype != LOOM_F32))
    fail(LOOM_UNSUPPORTED, where, ": paged attention caches must both be f32 or bf16");
  const int32_t *pp = reinterpret_cast<const int32_t *>(ptr(pos)), *pt = reinterpret_cast<const int32_t *>(ptr(table));
  long long *err = errorWord;
  return [=](cudaStream_t s) {
    dim3 grid{unsigned(n), unsigned(kvHeads), 1u};
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
