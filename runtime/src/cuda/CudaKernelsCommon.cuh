//===- CudaKernelsCommon.cuh - What the CUDA backend's kernels share -*- CUDA -*-===//
//
// The float tensor kernels load and store through (DPtr), strided index
// arithmetic, warp and block reductions, 16-byte accesses, the device-side
// error report, and the kernels that more than one file of the backend
// launches (each defined once, in the file of its concern).
//
//===----------------------------------------------------------------------===//

#ifndef LOOM_RUNTIME_CUDA_CUDAKERNELSCOMMON_CUH
#define LOOM_RUNTIME_CUDA_CUDAKERNELSCOMMON_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace loom::rt::cuda {

/// A value of either storage type in f32, and back (rounding to nearest).
template <typename T> __device__ inline float toF(T v);
template <> __device__ inline float toF(float v) { return v; }
template <> __device__ inline float toF(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ inline T fromF(float v);
template <> __device__ inline float fromF(float v) { return v; }
template <> __device__ inline __nv_bfloat16 fromF(float v) { return __float2bfloat16_rn(v); }

constexpr int kMaxRank = 8;
constexpr int kThreads = 256;

struct Strided {
  int rank = 0;
  int64_t shape[kMaxRank] = {};
  int64_t a[kMaxRank] = {}; // element strides of the first input over `shape`
  int64_t b[kMaxRank] = {}; // of the second input
};

__device__ inline void offsets(const Strided &s, int64_t i, int64_t &oa, int64_t &ob) {
  oa = 0, ob = 0;
  for (int d = s.rank - 1; d >= 0; --d) {
    int64_t idx = i % s.shape[d];
    i /= s.shape[d];
    oa += idx * s.a[d];
    ob += idx * s.b[d];
  }
}

/// A float tensor in device memory, f32 or bf16: kernels load and store
/// through it, computing in f32 (bf16 results rounded to nearest even, as
/// the CPU backend rounds them). The dtype test is uniform across a launch.
struct DPtr {
  void *p = nullptr;
  bool bf = false;
  __host__ __device__ DPtr operator+(int64_t off) const {
    return {static_cast<char *>(p) + off * (bf ? 2 : 4), bf};
  }
  __device__ float operator[](int64_t i) const {
    return bf ? __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]) : static_cast<const float *>(p)[i];
  }
  __device__ void st(int64_t i, float v) const {
    if (bf)
      static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v);
    else
      static_cast<float *>(p)[i] = v;
  }
  __host__ __device__ explicit operator bool() const { return p != nullptr; }
};

#define GRID_LOOP(i, n) for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

enum BinaryOp { kAdd, kSub, kMul, kDiv };

/// Sixteen bytes of T, loaded or stored at once.
template <typename T> struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};
template <typename T> __device__ inline Pack<T> load(const T *p) { return *reinterpret_cast<const Pack<T> *>(p); }

__device__ inline float warpSum(float v) {
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

__device__ inline float blockSum(float v, float *shared) {
  v = warpSum(v);
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0)
    shared[warp] = v;
  __syncthreads();
  float total = 0;
  for (int w = 0; w < (blockDim.x + 31) / 32; ++w)
    total += shared[w];
  return total;
}

__device__ inline float blockMax(float v, float *shared) {
  for (int o = 16; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0)
    shared[warp] = v;
  __syncthreads();
  float best = -INFINITY;
  for (int w = 0; w < (blockDim.x + 31) / 32; ++w)
    best = fmaxf(best, shared[w]);
  return best;
}

/// Two adjacent values of p from element i (even), either dtype.
__device__ inline float2 ld2(DPtr p, int64_t i) { // i even
  return p.bf ? __bfloat1622float2(reinterpret_cast<const __nv_bfloat162 *>(p.p)[i / 2])
              : reinterpret_cast<const float2 *>(p.p)[i / 2];
}
__device__ inline void st2(DPtr p, int64_t i, float a, float b) {
  if (p.bf)
    reinterpret_cast<__nv_bfloat162 *>(p.p)[i / 2] = __floats2bfloat162_rn(a, b);
  else
    reinterpret_cast<float2 *>(p.p)[i / 2] = make_float2(a, b);
}

using bf16 = __nv_bfloat16;

/// Two ranks' values of a gradient combined in f32 (0 sum, 1 mean of two,
/// 2 max): the peer all-reduce's sums, and the updates that read a pair of
/// bf16 gradients (DeferredPart), the same bits on both ranks (a + b is b + a).
__device__ inline float combinePair(float a, float b, int op) {
  return op == 2 ? fmaxf(a, b) : op == 1 ? (a + b) * 0.5f : a + b;
}
/// Elements [4q, 4q + 4) of two bf16 tensors (8-byte aligned) combined.
__device__ inline float4 combinePair4(const __nv_bfloat16 *mine, const __nv_bfloat16 *theirs, int64_t q, int op) {
  uint2 a = __ldg(reinterpret_cast<const uint2 *>(mine) + q), b = __ldg(reinterpret_cast<const uint2 *>(theirs) + q);
  const __nv_bfloat16 *x = reinterpret_cast<const __nv_bfloat16 *>(&a), *y = reinterpret_cast<const __nv_bfloat16 *>(&b);
  return make_float4(combinePair(__bfloat162float(x[0]), __bfloat162float(y[0]), op),
                     combinePair(__bfloat162float(x[1]), __bfloat162float(y[1]), op),
                     combinePair(__bfloat162float(x[2]), __bfloat162float(y[2]), op),
                     combinePair(__bfloat162float(x[3]), __bfloat162float(y[3]), op));
}
/// Eight values of p from element i (a multiple of 8): one 16-byte load for
/// bf16, two for f32.
__device__ inline void load8(DPtr p, int64_t i, float out[8]) {
  if (p.bf) {
    Pack<bf16> v = load(static_cast<const bf16 *>(p.p) + i);
#pragma unroll
    for (int e = 0; e < 8; ++e)
      out[e] = __bfloat162float(v.v[e]);
  } else {
    Pack<float> a = load(static_cast<const float *>(p.p) + i), b = load(static_cast<const float *>(p.p) + i + 4);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      out[e] = a.v[e], out[e + 4] = b.v[e];
  }
}
__device__ inline void store8(bf16 *p, const float v[8]) {
  Pack<bf16> o;
#pragma unroll
  for (int e = 0; e < 8; ++e)
    o.v[e] = __float2bfloat16_rn(v[e]);
  *reinterpret_cast<Pack<bf16> *>(p) = o;
}
/// Eight values to p from element i (a multiple of 8), either dtype.
__device__ inline void store8(DPtr p, int64_t i, const float v[8]) {
  if (p.bf) {
    store8(static_cast<bf16 *>(p.p) + i, v);
  } else {
    float4 *q = reinterpret_cast<float4 *>(static_cast<float *>(p.p) + i);
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

/// The cosine and sine a rotary embedding turns pair i of a head of d
/// dimensions by at position `pos` (negative: the inverse turn).
__device__ inline void rotaryAngle(float pos, int64_t i, int64_t d, double theta, float &cs, float &sn) {
  float angle = pos * static_cast<float>(pow(theta, -2.0 * i / d));
  cs = cosf(angle), sn = sinf(angle);
}

/// Device-side error report: [code, position, value].
__device__ inline void raise(long long *err, long long code, long long pos, long long value) {
  if (atomicCAS(reinterpret_cast<unsigned long long *>(err), 0ull, static_cast<unsigned long long>(code)) == 0ull) {
    err[1] = pos;
    err[2] = value;
  }
}

__device__ inline int64_t readIndex(const void *ids, bool wide, int64_t i) {
  return wide ? static_cast<const int64_t *>(ids)[i] : static_cast<const int32_t *>(ids)[i];
}

//===--- Kernels launched from more than one file -------------------------===//

// CudaElementwise.cu
__global__ void castKernel(DPtr x, DPtr y, int64_t n);
/// Same-shape operands, or a second operand repeating over leading dims (a bias).
__global__ void binaryContiguousKernel(int op, DPtr A, DPtr B, DPtr C, int64_t n, int64_t na, int64_t nb);

// CudaLoss.cu
__global__ void meanKernel(const float *x, int64_t n, float *out);
/// Vocabulary-parallel cross-entropy, in three steps around two all-reduces:
/// the row maxima of the local logits; then each row's sum of exp(l - max)
/// and its target logit (0 where another rank holds the target). `vec`: the
/// rows are whole 16-byte vectors, read (and the gradient written) eight
/// values at a time.
__global__ void rowMaxKernel(DPtr logits, float *rowMaxOut, int64_t v, bool vec);
__global__ void rowSumTargetKernel(DPtr logits, const void *targets, bool wide, const float *rowMax,
                                   float *stats, int64_t rows, int64_t v, int64_t start, int64_t full,
                                   long long *err, bool vec);
__global__ void splitLossRowsKernel(const float *rowMax, const float *stats, float *rowLoss, int64_t rows);
/// The gradient's seed is *dloss, or `seed` where dloss is null.
__global__ void splitCrossEntropyGradKernel(DPtr logits, const void *targets, bool wide, const float *rowMax,
                                            const float *stats, const float *dloss, float seed, DPtr dl,
                                            int64_t rows, int64_t v, int64_t start, bool vec);

/// Programmatic dependent launch (Hopper; launchAfter() in
/// CudaBackendImpl.h): a kernel so launched may begin while the kernel
/// before it in the stream is still ending. Before waitPrevious() it may
/// read only what no kernel of the running program writes: weights, the
/// inputs the host uploaded before the program, its arguments
/// (CudaBackendImpl::readOnlyHere decides), and what earlier runs wrote
/// that this one does not touch (the decoding attention's older cache
/// rows); startDependents() lets the next such kernel's blocks begin once
/// every block of this one has called it.
__device__ inline void waitPrevious() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ inline void startDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

} // namespace loom::rt::cuda

#endif
