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

/// Maximum of a row of v values, and the sum of exp(x - max) over it, by
/// one block (every thread gets the result).
__device__ float rowMax(DPtr lr, int64_t v, float *shared) {
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x)
    mx = fmaxf(mx, lr[j]);
  return blockMax(mx, shared);
}
__device__ float rowSumExp(DPtr lr, int64_t v, float mx, float *shared) {
  float sum = 0;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x)
    sum += expf(lr[j] - mx);
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
  if (t < 0 || t >= v) {
    if (threadIdx.x == 0)
      raise(err, 2, row, t);
    return;
  }
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
__global__ void rowMaxKernel(DPtr logits, float *rowMaxOut, int64_t v) {
  __shared__ float shared[32];
  float mx = rowMax(logits + blockIdx.x * v, v, shared);
  if (threadIdx.x == 0)
    rowMaxOut[blockIdx.x] = mx;
}
__global__ void rowSumTargetKernel(DPtr logits, const void *targets, bool wide, const float *rowMax,
                                   float *stats, int64_t rows, int64_t v, int64_t start, int64_t full,
                                   long long *err) {
  __shared__ float shared[32];
  int64_t row = blockIdx.x;
  DPtr lr = logits + row * v;
  int64_t t = readIndex(targets, wide, row);
  if (t < 0 || t >= full) {
    if (threadIdx.x == 0)
      raise(err, 2, row, t);
    return;
  }
  float mx = rowMax[row], sum = rowSumExp(lr, v, mx, shared);
  if (threadIdx.x == 0) {
    stats[row] = sum;
    stats[rows + row] = t >= start && t < start + v ? lr[t - start] : 0.0f;
  }
}
__global__ void splitLossRowsKernel(const float *rowMax, const float *stats, float *rowLoss, int64_t rows) {
  GRID_LOOP(r, rows) rowLoss[r] = logf(stats[r]) + rowMax[r] - stats[rows + r];
}
__global__ void splitCrossEntropyGradKernel(DPtr logits, const void *targets, bool wide, const float *rowMax,
                                            const float *stats, const float *dloss, DPtr dl, int64_t rows,
                                            int64_t v, int64_t start) {
  int64_t row = blockIdx.x;
  DPtr lr = logits + row * v, out = dl + row * v;
  int64_t t = readIndex(targets, wide, row) - start;
  float scale = *dloss / rows, mx = rowMax[row], sum = stats[row];
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x)
    out.st(j, (expf(lr[j] - mx) / sum - (j == t ? 1.0f : 0.0f)) * scale);
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

void CudaBackendImpl::addLossBuilders(BuilderTable &table) {
  for (const char *op : {"cross_entropy", "cross_entropy_grad"})
    table[op] = &CudaBackendImpl::buildCrossEntropy;
}

} // namespace loom::rt::cuda
