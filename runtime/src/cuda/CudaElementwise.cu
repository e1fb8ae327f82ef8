//===- CudaElementwise.cu - Elementwise kernels and their builders ---------===//
//
// fill, the binary operations with broadcasting, the unary functions and
// their gradients, casts between f32 and bf16 and rotary embeddings: general
// kernels over DPtr, and 16-byte vector kernels where the operands' dtype,
// sizes and addresses allow them.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"

namespace loom::rt::cuda {

__global__ void castKernel(DPtr x, DPtr y, int64_t n) { GRID_LOOP(i, n) y.st(i, x[i]); }

/// Same-shape operands, or a second operand repeating over leading dims (a bias).
__global__ void binaryContiguousKernel(int op, DPtr A, DPtr B, DPtr C, int64_t n, int64_t na, int64_t nb) {
  GRID_LOOP(i, n) {
    float a = A[na == n ? i : i % na], b = B[nb == n ? i : i % nb];
    C.st(i, op == kAdd ? a + b : op == kSub ? a - b : op == kMul ? a * b : a / b);
  }
}

namespace {

__global__ void fillKernel(DPtr y, int64_t n, float v) { GRID_LOOP(i, n) y.st(i, v); }

__global__ void binaryKernel(int op, DPtr A, DPtr B, DPtr C, int64_t n, Strided s) {
  GRID_LOOP(i, n) {
    int64_t oa, ob;
    offsets(s, i, oa, ob);
    float a = A[oa], b = B[ob];
    C.st(i, op == kAdd ? a + b : op == kSub ? a - b : op == kMul ? a * b : a / b);
  }
}

enum UnaryOp { kGelu, kGeluTanh, kRelu, kSilu, kExp, kTanh, kRsqrt, kNeg, kScale };
__device__ inline float applyUnary(int op, float x, float f) {
  switch (op) {
  case kGelu: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
  case kGeluTanh: return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
  case kRelu: return x > 0 ? x : 0.0f;
  case kSilu: return x / (1.0f + expf(-x));
  case kExp: return expf(x);
  case kTanh: return tanhf(x);
  case kRsqrt: return rsqrtf(x);
  case kNeg: return -x;
  default: return x * f;
  }
}
__global__ void unaryKernel(int op, DPtr x, DPtr y, int64_t n, float f) {
  GRID_LOOP(i, n) y.st(i, applyUnary(op, x[i], f));
}
/// d op(v) / dv, given v and out = op(v).
__device__ inline float unaryDerivative(int op, float v, float out) {
  float d;
  switch (op) {
    case kGelu: d = 0.5f * (1.0f + erff(v * 0.70710678118654752f)) + v * 0.39894228040143268f * expf(-0.5f * v * v); break;
    case kGeluTanh: {
      const float k = 0.79788456080286536f, a = 0.044715f;
      float t = tanhf(k * (v + a * v * v * v));
      d = 0.5f * (1 + t) + 0.5f * v * (1 - t * t) * k * (1 + 3 * a * v * v);
      break;
    }
    case kSilu: { float sg = 1.0f / (1.0f + expf(-v)); d = sg * (1 + v * (1 - sg)); break; }
    case kRelu: d = v > 0 ? 1.0f : 0.0f; break;
    case kTanh: d = 1 - out * out; break;
    case kExp: d = out; break;
    default: d = -0.5f * out * out * out; break; // rsqrt
  }
  return d;
}
__global__ void unaryGradKernel(int op, DPtr x, DPtr y, DPtr dy, DPtr dx, int64_t n) {
  GRID_LOOP(i, n) dx.st(i, dy[i] * unaryDerivative(op, x[i], y[i]));
}

__global__ void rotaryKernel(DPtr x, DPtr y, int64_t pairs, int64_t s, int64_t w,
                             int64_t d, double theta, float sign, const int32_t *positions) {
  GRID_LOOP(p, pairs) {
    int64_t at = p * 2, i = (at % d) / 2;
    // Serving: each row's own position; otherwise its index in the sequence.
    int64_t pos = positions ? positions[at / w] : (at / w) % s;
    float cs, sn, x0 = x[at], x1 = x[at + 1];
    rotaryAngle(sign * pos, i, d, theta, cs, sn);
    y.st(at, x0 * cs - x1 * sn);
    y.st(at + 1, x0 * sn + x1 * cs);
  }
}

//===--- Vectorised elementwise kernels -----------------------------------===//
// 16-byte loads and stores (8 bf16 or 4 f32 per thread) and 32-bit index
// arithmetic, for operands of one dtype whose sizes and addresses allow it
// (the host checks); the general kernels above handle everything else.

#define VEC_LOOP(i, T, n)                                                                                        \
  for (uint32_t i = (blockIdx.x * blockDim.x + threadIdx.x) * Pack<T>::N; i < (n);                               \
       i += gridDim.x * blockDim.x * Pack<T>::N)

/// C = A op B where B (or A) repeats over leading dims: na, nb divide n.
template <typename T>
__global__ void binaryVecKernel(int op, const T *A, const T *B, T *C, uint32_t n, uint32_t na, uint32_t nb) {
  VEC_LOOP(i, T, n) {
    Pack<T> a = load(A + (na == n ? i : i % na)), b = load(B + (nb == n ? i : i % nb)), c;
    for (int k = 0; k < Pack<T>::N; ++k) {
      float x = toF(a.v[k]), y = toF(b.v[k]);
      c.v[k] = fromF<T>(op == kAdd ? x + y : op == kSub ? x - y : op == kMul ? x * y : x / y);
    }
    *reinterpret_cast<Pack<T> *>(C + i) = c;
  }
}
/// C = A + B with A and C f32 and B bf16, all of n elements (n a multiple
/// of 4): gradient accumulation, an f32 sum adding a microbatch's bf16
/// gradient (16-byte loads of A, 8-byte loads of B).
__global__ void accumulateBf16Kernel(const float *A, const __nv_bfloat16 *B, float *C, uint32_t n) {
  for (uint32_t i = (blockIdx.x * blockDim.x + threadIdx.x) * 4; i < n; i += gridDim.x * blockDim.x * 4) {
    float4 a = *reinterpret_cast<const float4 *>(A + i);
    uint2 raw = *reinterpret_cast<const uint2 *>(B + i);
    const __nv_bfloat162 *b = reinterpret_cast<const __nv_bfloat162 *>(&raw);
    float2 b0 = __bfloat1622float2(b[0]), b1 = __bfloat1622float2(b[1]);
    *reinterpret_cast<float4 *>(C + i) = make_float4(a.x + b0.x, a.y + b0.y, a.z + b1.x, a.w + b1.y);
  }
}
template <typename T> __global__ void unaryVecKernel(int op, const T *X, T *Y, uint32_t n, float f) {
  VEC_LOOP(i, T, n) {
    Pack<T> x = load(X + i), y;
    for (int k = 0; k < Pack<T>::N; ++k)
      y.v[k] = fromF<T>(applyUnary(op, toF(x.v[k]), f));
    *reinterpret_cast<Pack<T> *>(Y + i) = y;
  }
}
template <typename T>
__global__ void unaryGradVecKernel(int op, const T *X, const T *Y, const T *DY, T *DX, uint32_t n) {
  VEC_LOOP(i, T, n) {
    Pack<T> x = load(X + i), y = load(Y + i), dy = load(DY + i), dx;
    for (int k = 0; k < Pack<T>::N; ++k)
      dx.v[k] = fromF<T>(toF(dy.v[k]) * unaryDerivative(op, toF(x.v[k]), toF(y.v[k])));
    *reinterpret_cast<Pack<T> *>(DX + i) = dx;
  }
}
/// f32 <-> bf16, 8 elements per thread.
template <typename From, typename To> __global__ void castVecKernel(const From *X, To *Y, uint32_t n) {
  for (uint32_t i = (blockIdx.x * blockDim.x + threadIdx.x) * 8; i < n; i += gridDim.x * blockDim.x * 8) {
    From x[8];
    To y[8];
    for (int h = 0; h < 8; h += Pack<From>::N)
      *reinterpret_cast<Pack<From> *>(x + h) = load(X + i + h);
    for (int k = 0; k < 8; ++k)
      y[k] = fromF<To>(toF(x[k]));
    for (int h = 0; h < 8; h += Pack<To>::N)
      *reinterpret_cast<Pack<To> *>(Y + i + h) = *reinterpret_cast<Pack<To> *>(y + h);
  }
}

} // namespace

Launch CudaBackendImpl::buildFill(const Instruction &ins) {
  auto n = [&](int64_t id) { return count(buf(id).shape); };
  DPtr y = fp(ins.out[0]);
  int64_t cnt = n(ins.out[0]);
  float v = static_cast<float>(num(ins, "value", 0));
  return [=](cudaStream_t s) { fillKernel<<<blocksFor(cnt), kThreads, 0, s>>>(y, cnt, v); };
}

Launch CudaBackendImpl::buildBinary(const Instruction &ins) {
  const std::string &op = ins.op;
  auto n = [&](int64_t id) { return count(buf(id).shape); };
  int code = op == "add" ? kAdd : op == "sub" ? kSub : op == "mul" ? kMul : kDiv;
  const Buffer &o = buf(ins.out[0]);
  // Fast path: each operand is the result's shape or repeats its trailing dims.
  auto trailing = [&](const Shape &in) {
    Shape t = in;
    while (!t.empty() && t.front() == 1 && t.size() > 0)
      t.erase(t.begin());
    return t.size() <= o.shape.size() && std::equal(t.rbegin(), t.rend(), o.shape.rbegin());
  };
  if (trailing(buf(ins.in[0]).shape) && trailing(buf(ins.in[1]).shape)) {
    DPtr a = fp(ins.in[0]), b = fp(ins.in[1]), y = fp(ins.out[0]);
    int64_t cnt = count(o.shape), na = n(ins.in[0]), nb = n(ins.in[1]);
    if (vectorizable({ins.in[0], ins.in[1], ins.out[0]}, {cnt, na, nb})) {
      uint32_t un = uint32_t(cnt), ua = uint32_t(na), ub = uint32_t(nb);
      if (y.bf)
        return [=](cudaStream_t s) {
          using T = __nv_bfloat16;
          binaryVecKernel<<<vecBlocks(un, 8), kThreads, 0, s>>>(code, (const T *)a.p, (const T *)b.p, (T *)y.p, un, ua, ub);
        };
      return [=](cudaStream_t s) {
        binaryVecKernel<<<vecBlocks(un, 4), kThreads, 0, s>>>(code, (const float *)a.p, (const float *)b.p, (float *)y.p, un, ua, ub);
      };
    }
    // An f32 sum plus a bf16 tensor of its size (gradient accumulation over
    // microbatches): the general kernel converts each element by its dtype
    // and reached about 0.9 TB/s on an H200.
    int bfSide = !a.bf && b.bf ? 1 : a.bf && !b.bf ? 0 : -1;
    auto aligned = [&](int64_t id, int bytes) { return reinterpret_cast<uintptr_t>(ptr(buf(id))) % bytes == 0; };
    if (code == kAdd && bfSide >= 0 && !y.bf && na == cnt && nb == cnt && cnt % 4 == 0 && cnt < (int64_t(1) << 31) &&
        aligned(ins.in[1 - bfSide], 16) && aligned(ins.out[0], 16) && aligned(ins.in[bfSide], 8)) {
      const float *f = static_cast<const float *>((bfSide ? a : b).p);
      const __nv_bfloat16 *h = static_cast<const __nv_bfloat16 *>((bfSide ? b : a).p);
      float *out = static_cast<float *>(y.p);
      uint32_t un = uint32_t(cnt);
      return [=](cudaStream_t s) { accumulateBf16Kernel<<<vecBlocks(un, 4), kThreads, 0, s>>>(f, h, out, un); };
    }
    return [=](cudaStream_t s) { binaryContiguousKernel<<<blocksFor(cnt), kThreads, 0, s>>>(code, a, b, y, cnt, na, nb); };
  }
  Strided st = strided(o.shape, broadcastTo(buf(ins.in[0]).shape, o.shape), broadcastTo(buf(ins.in[1]).shape, o.shape));
  DPtr a = fp(ins.in[0]), b = fp(ins.in[1]), y = fp(ins.out[0]);
  int64_t cnt = count(o.shape);
  return [=](cudaStream_t s) { binaryKernel<<<blocksFor(cnt), kThreads, 0, s>>>(code, a, b, y, cnt, st); };
}

Launch CudaBackendImpl::buildUnary(const Instruction &ins) {
  const std::string &op = ins.op;
  auto n = [&](int64_t id) { return count(buf(id).shape); };
  static const std::map<std::string, int> unaries = {
      {"relu", kRelu}, {"silu", kSilu}, {"exp", kExp}, {"tanh", kTanh}, {"rsqrt", kRsqrt}, {"neg", kNeg}, {"scale", kScale}};
  int code = op == "gelu" ? (flag(ins, "approximate") ? kGeluTanh : kGelu) : unaries.at(op);
  float factor = static_cast<float>(num(ins, "factor", 1.0));
  DPtr x = fp(ins.in[0]), y = fp(ins.out[0]);
  int64_t cnt = n(ins.out[0]);
  if (vectorizable({ins.in[0], ins.out[0]}, {cnt})) {
    uint32_t un = uint32_t(cnt);
    if (y.bf)
      return [=](cudaStream_t s) {
        using T = __nv_bfloat16;
        unaryVecKernel<<<vecBlocks(un, 8), kThreads, 0, s>>>(code, (const T *)x.p, (T *)y.p, un, factor);
      };
    return [=](cudaStream_t s) {
      unaryVecKernel<<<vecBlocks(un, 4), kThreads, 0, s>>>(code, (const float *)x.p, (float *)y.p, un, factor);
    };
  }
  return [=](cudaStream_t s) { unaryKernel<<<blocksFor(cnt), kThreads, 0, s>>>(code, x, y, cnt, factor); };
}

Launch CudaBackendImpl::buildUnaryGrad(const Instruction &ins) {
  auto n = [&](int64_t id) { return count(buf(id).shape); };
  std::string fn = ins.attrs.value("fn", "");
  static const std::map<std::string, int> fns = {{"gelu", kGelu}, {"gelu_tanh", kGeluTanh}, {"silu", kSilu},
                                                 {"relu", kRelu}, {"tanh", kTanh}, {"exp", kExp}, {"rsqrt", kRsqrt}};
  int code = fns.at(fn);
  DPtr x = fp(ins.in[0]), y = fp(ins.in[1]), dy = fp(ins.in[2]), dx = fp(ins.out[0]);
  int64_t cnt = n(ins.out[0]);
  if (vectorizable({ins.in[0], ins.in[1], ins.in[2], ins.out[0]}, {cnt})) {
    uint32_t un = uint32_t(cnt);
    if (dx.bf)
      return [=](cudaStream_t s) {
        using T = __nv_bfloat16;
        unaryGradVecKernel<<<vecBlocks(un, 8), kThreads, 0, s>>>(code, (const T *)x.p, (const T *)y.p, (const T *)dy.p,
                                                                  (T *)dx.p, un);
      };
    return [=](cudaStream_t s) {
      unaryGradVecKernel<<<vecBlocks(un, 4), kThreads, 0, s>>>(code, (const float *)x.p, (const float *)y.p,
                                                                (const float *)dy.p, (float *)dx.p, un);
    };
  }
  return [=](cudaStream_t s) { unaryGradKernel<<<blocksFor(cnt), kThreads, 0, s>>>(code, x, y, dy, dx, cnt); };
}

Launch CudaBackendImpl::buildCast(const Instruction &ins) {
  const Buffer &x = buf(ins.in[0]), &o = buf(ins.out[0]);
  if (x.dtype != o.dtype) { // f32 <-> bf16
    DPtr in = fp(ins.in[0]), out = fp(ins.out[0]);
    int64_t cnt = count(o.shape);
    if (cnt % 8 == 0 && cnt < (int64_t(1) << 31) && reinterpret_cast<uintptr_t>(in.p) % 16 == 0 &&
        reinterpret_cast<uintptr_t>(out.p) % 16 == 0) {
      uint32_t un = uint32_t(cnt);
      using T = __nv_bfloat16;
      if (out.bf)
        return [=](cudaStream_t s) { castVecKernel<<<vecBlocks(un, 8), kThreads, 0, s>>>((const float *)in.p, (T *)out.p, un); };
      return [=](cudaStream_t s) { castVecKernel<<<vecBlocks(un, 8), kThreads, 0, s>>>((const T *)in.p, (float *)out.p, un); };
    }
    return [=](cudaStream_t s) { castKernel<<<blocksFor(cnt), kThreads, 0, s>>>(in, out, cnt); };
  }
  char *pi = ptr(x), *po = ptr(o);
  int64_t bytes = o.bytes;
  return [=](cudaStream_t s) { LOOM_CUDA_CHECK(cudaMemcpyAsync(po, pi, bytes, cudaMemcpyDeviceToDevice, s)); };
}

Launch CudaBackendImpl::buildRotary(const Instruction &ins) {
  const Buffer &x = buf(ins.in[0]);
  int64_t heads = static_cast<int64_t>(num(ins, "num_heads", 1));
  int64_t sLen = x.shape[1], w = x.shape[2], d = w / heads, pairs = count(x.shape) / 2;
  double theta = num(ins, "theta", 10000.0);
  float sign = flag(ins, "inverse") ? -1.0f : 1.0f;
  DPtr px = fp(ins.in[0]), y = fp(ins.out[0]);
  const int32_t *positions = nullptr;
  if (ins.in.size() == 2) {
    const Buffer &pb = buf(ins.in[1]);
    if (pb.dtype != LOOM_I32 || count(pb.shape) != count(x.shape) / w)
      fail(LOOM_INVALID_BUNDLE, where, ": rotary positions must be i32, one per row");
    positions = reinterpret_cast<const int32_t *>(ptr(pb));
  }
  return [=](cudaStream_t s) {
    rotaryKernel<<<blocksFor(pairs), kThreads, 0, s>>>(px, y, pairs, sLen, w, d, theta, sign, positions);
  };
}

void CudaBackendImpl::addElementwiseBuilders(BuilderTable &table) {
  table["fill"] = &CudaBackendImpl::buildFill;
  for (const char *op : {"add", "sub", "mul", "div"})
    table[op] = &CudaBackendImpl::buildBinary;
  for (const char *op : {"gelu", "relu", "silu", "exp", "tanh", "rsqrt", "neg", "scale"})
    table[op] = &CudaBackendImpl::buildUnary;
  table["unary_grad"] = &CudaBackendImpl::buildUnaryGrad;
  table["cast"] = &CudaBackendImpl::buildCast;
  table["rotary"] = &CudaBackendImpl::buildRotary;
}

} // namespace loom::rt::cuda
