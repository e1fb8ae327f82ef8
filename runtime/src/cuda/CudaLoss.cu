//===- CudaLoss.cu - Cross-entropy and its gradient ------------------------===//
//
// The softmax cross-entropy over rows of logits (a block per row, its
// maximum and sum of exponentials in one online pass) and its gradient; a
// target outside the vocabulary raises the device-side error word. The
// vocabulary-parallel kernels here run around CudaCollectives.cu's
// all-reduces.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"

namespace loom::rt::cuda {
namespace {

/// Whether row's target t is outside [0, v); thread 0 raises the error word
/// (code 2: the row and the value).
__device__ inline bool targetOutside(long long *err, int64_t row, int64_t t, int64_t v) {
  if (t >= 0 && t < v)
    return false;
  if (threadIdx.x == 0)
    raise(err, 2, row, t);
  return true;
}

/// Calls f(j, x) for this thread's values x = lr[j] of a row of v, spread
/// over the block: eight values a 16-byte load where the row is made of
/// whole vectors (`vec`: v a multiple of 8, the row aligned), one at a time
/// otherwise.
template <typename F> __device__ inline void forEachOfRow(DPtr lr, int64_t v, bool vec, F f) {
  if (vec) {
    for (int64_t j = 8 * threadIdx.x; j < v; j += 8 * blockDim.x) {
      float x[8];
      load8(lr, j, x);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        f(j + e, x[e]);
    }
  } else {
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x)
      f(j, float(lr[j]));
  }
}
/// Maximum of a row of v values, and the sum of exp(x - max) over it, by
/// one block (every thread gets the result).
__device__ float rowMax(DPtr lr, int64_t v, bool vec, float *shared) {
  float mx = -INFINITY;
  forEachOfRow(lr, v, vec, [&](int64_t, float x) { mx = fmaxf(mx, x); });
  return blockMax(mx, shared);
}
__device__ float rowSumExp(DPtr lr, int64_t v, bool vec, float mx, float *shared) {
  float sum = 0;
  forEachOfRow(lr, v, vec, [&](int64_t, float x) { sum += expf(x - mx); });
  return blockSum(sum, shared);
}

/// The same in one pass (an online softmax: the sum rescaled whenever the
/// maximum grows), each thread over pairs of adjacent values when v is even.
__device__ inline void onlineAdd(float &m, float &s, float x) {
  if (x > m) {
    s = s * expf(m - x) + 1.0f;
    m = x;
  } else if (x != -INFINITY) {
    s += expf(x - m);
  }
}
__device__ inline void onlineMerge(float &m, float &s, float m2, float s2) {
  float mx = fmaxf(m, m2);
  if (mx == -INFINITY)
    return;
  s = (m == -INFINITY ? 0.0f : s * expf(m - mx)) + (m2 == -INFINITY ? 0.0f : s2 * expf(m2 - mx));
  m = mx;
}
__device__ void rowStats(DPtr lr, int64_t v, float &mx, float &sum) {
  __shared__ float sm[32], ss[32];
  float m = -INFINITY, s = 0;
  if (lr.bf && v % 8 == 0 && reinterpret_cast<uintptr_t>(lr.p) % 16 == 0) { // 16-byte loads
    for (int64_t j = 8 * threadIdx.x; j < v; j += 8 * blockDim.x) {
      float x[8];
      load8(lr, j, x);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        onlineAdd(m, s, x[e]);
    }
  } else if (v % 2 == 0) {
    for (int64_t j = 2 * threadIdx.x; j < v; j += 2 * blockDim.x) {
      float2 x = lr.bf ? __bfloat1622float2(reinterpret_cast<const __nv_bfloat162 *>(lr.p)[j / 2])
                       : reinterpret_cast<const float2 *>(lr.p)[j / 2];
      onlineAdd(m, s, x.x);
      onlineAdd(m, s, x.y);
    }
  } else {
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x)
      onlineAdd(m, s, lr[j]);
  }
  for (int o = 16; o > 0; o >>= 1)
    onlineMerge(m, s, __shfl_xor_sync(0xffffffff, m, o), __shfl_xor_sync(0xffffffff, s, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0)
    sm[threadIdx.x / 32] = m, ss[threadIdx.x / 32] = s;
  __syncthreads();
  m = -INFINITY, s = 0;
  for (int w = 0; w < int(blockDim.x + 31) / 32; ++w)
    onlineMerge(m, s, sm[w], ss[w]);
  mx = m, sum = s;
}

__global__ void crossEntropyRowsKernel(DPtr logits, const void *targets, bool wide, float *rowLoss, int64_t v,
                                       long long *err) {
  int64_t row = blockIdx.x;
  DPtr lr = logits + row * v;
  int64_t t = readIndex(targets, wide, row);
  if (targetOutside(err, row, t, v))
    return;
  float mx, sum;
  rowStats(lr, v, mx, sum);
  if (threadIdx.x == 0)
    rowLoss[row] = logf(sum) + mx - lr[t];
}

__global__ void crossEntropyGradKernel(DPtr logits, const void *targets, bool wide, const float *dloss, DPtr dl,
                                       int64_t rows, int64_t v) {
  int64_t row = blockIdx.x;
  DPtr lr = logits + row * v, out = dl + row * v;
  int64_t t = readIndex(targets, wide, row);
  float mx, sum;
  rowStats(lr, v, mx, sum);
  float scale = *dloss / rows, inv = 1.0f / sum;
  if (lr.bf && out.bf && v % 8 == 0 && ((reinterpret_cast<uintptr_t>(lr.p) | reinterpret_cast<uintptr_t>(out.p)) % 16) == 0) {
    for (int64_t j = 8 * threadIdx.x; j < v; j += 8 * blockDim.x) {
      float x[8];
      load8(lr, j, x);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        x[e] = (expf(x[e] - mx) * inv - (j + e == t ? 1.0f : 0.0f)) * scale;
      store8(static_cast<bf16 *>(out.p) + j, x);
    }
    return;
  }
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x)
    out.st(j, (expf(lr[j] - mx) * inv - (j == t ? 1.0f : 0.0f)) * scale);
}

/// The loss and its gradient over the logits in place (loom-fuse-loss-
/// gradient): each row's statistics and loss, then the row overwritten by
/// (softmax - onehot) * scale. Every read of the row comes before the
/// block's first barrier in rowStats, every write after it.
__global__ void crossEntropyFusedKernel(DPtr logits, const void *targets, bool wide, float *rowLoss, float scale,
                                        int64_t v, long long *err) {
  int64_t row = blockIdx.x;
  DPtr lr = logits + row * v;
  int64_t t = readIndex(targets, wide, row);
  if (targetOutside(err, row, t, v))
    return;
  float xt = threadIdx.x == 0 ? lr[t] : 0.0f;
  float mx, sum;
  rowStats(lr, v, mx, sum);
  if (threadIdx.x == 0)
    rowLoss[row] = logf(sum) + mx - xt;
  float inv = 1.0f / sum;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x)
    lr.st(j, (expf(lr[j] - mx) * inv - (j == t ? 1.0f : 0.0f)) * scale);
}

/// The same for bf16 rows of v (a multiple of 8) that fit in shared memory:
/// the row is read from memory once, into shared memory as its maximum is
/// taken; the sum of exponentials and then the gradient come from there.
/// Two blocks of 1024 threads an SM where a row is at most about 113 KB
/// (GPT-2's 50,304: 98 KB). The block's maximum and sum are plain float
/// reductions (warp shuffles, then warp 0 over the 32 warps' values), and
/// exponentials are the hardware's ex2 (__expf, a relative error of about
/// 2^-21): an online softmax merged by every thread, with expf's accurate
/// sequence, made the kernel bound by its instructions (1.10-1.19 ms for
/// GPT-2 350M's logits on an H200 under ncu, 87% of the SMs' issue rate and
/// 28-31% of the memory's bandwidth).
constexpr int kFusedLossThreads = 1024;
__device__ inline float blockReduce(float v, float *partial, float *result, bool max) {
  for (int o = 16; o > 0; o >>= 1) {
    float other = __shfl_xor_sync(0xffffffff, v, o);
    v = max ? fmaxf(v, other) : v + other;
  }
  if (threadIdx.x % 32 == 0)
    partial[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = partial[threadIdx.x]; // 32 warps
    for (int o = 16; o > 0; o >>= 1) {
      float other = __shfl_xor_sync(0xffffffff, v, o);
      v = max ? fmaxf(v, other) : v + other;
    }
    if (threadIdx.x == 0)
      *result = v;
  }
  __syncthreads();
  return *result;
}

__global__ void __launch_bounds__(kFusedLossThreads, 2)
    crossEntropyFusedBf16Kernel(bf16 *logits, const void *targets, bool wide, float *rowLoss, float scale, int64_t v,
                                long long *err) {
  extern __shared__ uint4 rowCopy[];
  __shared__ float partial[32], maxOf, sumOf;
  int64_t row = blockIdx.x;
  uint4 *lr = reinterpret_cast<uint4 *>(logits + row * v);
  int64_t t = readIndex(targets, wide, row);
  if (targetOutside(err, row, t, v))
    return;
  int n = int(v / 8);
  auto max8 = [](const uint4 &q, float m) {
    const bf16 *h = reinterpret_cast<const bf16 *>(&q);
#pragma unroll
    for (int e = 0; e < 8; ++e)
      m = fmaxf(m, __bfloat162float(h[e]));
    return m;
  };
  // The row into shared memory, two 16-byte loads in flight a thread.
  float m = -INFINITY;
  for (int j = threadIdx.x; j < n; j += 2 * kFusedLossThreads) {
    int j2 = j + kFusedLossThreads;
    uint4 a = lr[j], b = j2 < n ? lr[j2] : make_uint4(0, 0, 0, 0);
    rowCopy[j] = a;
    m = max8(a, m);
    if (j2 < n) {
      rowCopy[j2] = b;
      m = max8(b, m);
    }
  }
  m = blockReduce(m, partial, &maxOf, true);
  float s = 0;
  for (int j = threadIdx.x; j < n; j += kFusedLossThreads) {
    uint4 q = rowCopy[j];
    const bf16 *h = reinterpret_cast<const bf16 *>(&q);
#pragma unroll
    for (int e = 0; e < 8; ++e)
      s += __expf(__bfloat162float(h[e]) - m);
  }
  s = blockReduce(s, partial, &sumOf, false);
  const bf16 *copy = reinterpret_cast<const bf16 *>(rowCopy);
  if (threadIdx.x == 0)
    rowLoss[row] = logf(s) + m - __bfloat162float(copy[t]);
  float inv = 1.0f / s;
  for (int j = threadIdx.x; j < n; j += kFusedLossThreads) {
    uint4 q = rowCopy[j];
    const bf16 *h = reinterpret_cast<const bf16 *>(&q);
    int at = int(t - 8 * int64_t(j)); // the target's place in this vector, if it is here
    float y[8];
#pragma unroll
    for (int e = 0; e < 8; ++e)
      y[e] = (__expf(__bfloat162float(h[e]) - m) * inv - (e == at ? 1.0f : 0.0f)) * scale;
    store8(reinterpret_cast<bf16 *>(lr + j), y);
  }
}

} // namespace

__global__ void meanKernel(const float *x, int64_t n, float *out) {
  __shared__ float shared[32];
  float s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    s += x[i];
  s = blockSum(s, shared);
  if (threadIdx.x == 0)
    *out = s / n;
}

/// Vocabulary-parallel cross-entropy, in three steps around two all-reduces:
/// the row maxima of the local logits; then each row's sum of exp(l - max)
/// and its target logit (0 where another rank holds the target).
///
/// Rows of whole 16-byte vectors (v a multiple of 8, the logits aligned:
/// `vec`) are read eight values a load; the others one at a time.
__global__ void rowMaxKernel(DPtr logits, float *rowMaxOut, int64_t v, bool vec) {
  __shared__ float shared[32];
  float mx = rowMax(logits + blockIdx.x * v, v, vec, shared);
  if (threadIdx.x == 0)
    rowMaxOut[blockIdx.x] = mx;
}
__global__ void rowSumTargetKernel(DPtr logits, const void *targets, bool wide, const float *rowMax,
                                   float *stats, int64_t rows, int64_t v, int64_t start, int64_t full,
                                   long long *err, bool vec) {
  __shared__ float shared[32];
  int64_t row = blockIdx.x;
  DPtr lr = logits + row * v;
  int64_t t = readIndex(targets, wide, row);
  if (targetOutside(err, row, t, full))
    return;
  float mx = rowMax[row], sum = rowSumExp(lr, v, vec, mx, shared);
  if (threadIdx.x == 0) {
    stats[row] = sum;
    stats[rows + row] = t >= start && t < start + v ? lr[t - start] : 0.0f;
  }
}
__global__ void splitLossRowsKernel(const float *rowMax, const float *stats, float *rowLoss, int64_t rows) {
  GRID_LOOP(r, rows) rowLoss[r] = logf(stats[r]) + rowMax[r] - stats[rows + r];
}
__global__ void splitCrossEntropyGradKernel(DPtr logits, const void *targets, bool wide, const float *rowMax,
                                            const float *stats, const float *dloss, float seed, DPtr dl,
                                            int64_t rows, int64_t v, int64_t start, bool vec) {
  int64_t row = blockIdx.x;
  DPtr lr = logits + row * v, out = dl + row * v;
  int64_t t = readIndex(targets, wide, row) - start;
  // Each element is read and written by the same thread: `out` may be the
  // logits themselves (the loss writing its gradient, loom-fuse-loss-gradient).
  float scale = (dloss ? *dloss : seed) / rows, mx = rowMax[row], inv = 1.0f / stats[row];
  if (vec) {
    for (int64_t j = 8 * threadIdx.x; j < v; j += 8 * blockDim.x) {
      float x[8];
      load8(lr, j, x);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        x[e] = (expf(x[e] - mx) * inv - (j + e == t ? 1.0f : 0.0f)) * scale;
      store8(out, j, x);
    }
    return;
  }
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x)
    out.st(j, (expf(lr[j] - mx) * inv - (j == t ? 1.0f : 0.0f)) * scale);
}

Launch CudaBackendImpl::buildCrossEntropy(const Instruction &ins) {
  const std::string &op = ins.op;
  const Buffer &logits = buf(ins.in[0]), &targets = buf(ins.in[1]);
  int64_t v = logits.shape.back(), rows = count(targets.shape);
  bool wide = targets.dtype == LOOM_I64;
  void *pt = ptr(targets);
  DPtr pl = fp(ins.in[0]);
  long long *err = errorWord;
  if (ins.attrs.contains("vocab_group"))
    return buildCommunication(ins);
  if (op == "cross_entropy" && ins.out.size() == 2)
    return buildFusedCrossEntropy(ins);
  if (op == "cross_entropy") {
    float *out = f(ins.out[0]);
    reserve(rows * sizeof(float));
    return [=](cudaStream_t s) {
      float *rowLoss = reinterpret_cast<float *>(workspace);
      crossEntropyRowsKernel<<<int(rows), kThreads, 0, s>>>(pl, pt, wide, rowLoss, v, err);
      meanKernel<<<1, 1024, 0, s>>>(rowLoss, rows, out);
    };
  }
  float *dl = f(ins.in[2]);
  DPtr out = fp(ins.out[0]);
  return [=](cudaStream_t s) { crossEntropyGradKernel<<<int(rows), kThreads, 0, s>>>(pl, pt, wide, dl, out, rows, v); };
}

/// The loss with its gradient written over the logits (loom-fuse-loss-
/// gradient): the bf16 rows through shared memory where they fit, else a
/// block per row reading it twice.
Launch CudaBackendImpl::buildFusedCrossEntropy(const Instruction &ins) {
  const Buffer &logits = buf(ins.in[0]), &targets = buf(ins.in[1]);
  if (ins.out[1] != ins.in[0])
    fail(LOOM_INVALID_BUNDLE, where, ": writes the loss's gradient over the logits: its second output must be its "
         "first input");
  if (!ins.attrs.contains("grad_scale") || !ins.attrs["grad_scale"].is_number())
    fail(LOOM_INVALID_BUNDLE, where, ": attribute 'grad_scale' (a number) is missing");
  int64_t v = logits.shape.back(), rows = count(targets.shape);
  bool wide = targets.dtype == LOOM_I64;
  void *pt = ptr(targets);
  DPtr pl = fp(ins.in[0]);
  long long *err = errorWord;
  float *out = f(ins.out[0]);
  float scale = static_cast<float>(ins.attrs["grad_scale"].get<double>()) / float(std::max<int64_t>(rows, 1));
  reserve(rows * sizeof(float));
  size_t shared = size_t(v) * sizeof(bf16);
  // LOOM_CUDA_FUSED_LOSS=global reads each row twice from memory instead.
  static const bool global = envIs("LOOM_CUDA_FUSED_LOSS", "global");
  bool inShared = pl.bf && v % 8 == 0 && reinterpret_cast<uintptr_t>(pl.p) % 16 == 0 && shared <= 200 * 1024 && !global;
  if (inShared) {
    int device = 0, most = 0;
    LOOM_CUDA_CHECK(cudaGetDevice(&device));
    LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    inShared = shared + 256 <= size_t(most);
    if (inShared)
      LOOM_CUDA_CHECK(cudaFuncSetAttribute(crossEntropyFusedBf16Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(shared)));
  }
  return [=](cudaStream_t s) {
    float *rowLoss = reinterpret_cast<float *>(workspace);
    if (inShared)
      crossEntropyFusedBf16Kernel<<<int(rows), kFusedLossThreads, shared, s>>>(static_cast<bf16 *>(pl.p), pt, wide,
                                                                               rowLoss, scale, v, err);
    else
      crossEntropyFusedKernel<<<int(rows), kThreads, 0, s>>>(pl, pt, wide, rowLoss, scale, v, err);
    meanKernel<<<1, 1024, 0, s>>>(rowLoss, rows, out);
  };
}

void CudaBackendImpl::addLossBuilders(BuilderTable &table) {
  for (const char *op : {"cross_entropy", "cross_entropy_grad"})
    table[op] = &CudaBackendImpl::buildCrossEntropy;
}

} // namespace loom::rt::cuda
