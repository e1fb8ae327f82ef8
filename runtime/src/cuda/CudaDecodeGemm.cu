//===- CudaDecodeGemm.cu - Products of a few rows by [N, K] weights -------===//
//
// A decoding step multiplies one row per sequence by every weight matrix:
// its time is reading the weights once. A serving bundle prepares its bf16
// weights laid out [N, K] (loomc's --weight-layout nk), so each output's
// weights are one contiguous row: here a warp reads that row in
// sixteen-byte loads, eight in flight per lane, multiplies it by every row
// of x (at most 8, read through L1) and sums its lanes by shuffles. No
// split over K, no partial sums, no second pass; the result does not depend
// on timing. Consecutive products of one input (Llama's q, k and v; gate
// and up) run as segments of one launch, their weight rows numbered one
// after another. The epilogues of matmul (bias, tanh GELU, residual) apply
// per output.
//
// The backend times this against cuBLASLt for each product, as decoding
// runs it (the L2 cache flushed: the weights come from memory), and keeps
// the faster. LOOM_CUDA_GEMV=0 keeps cuBLASLt, =1 this kernel wherever it
// applies; LOOM_CUDA_GEMV_VERBOSE=1 prints each timing.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"
#include "runtime/src/cuda/CudaKernelsCommon.cuh"

#include <cstdio>
#include <cstdlib>
#include <string>

namespace loom::rt::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kInFlight = 8; // sixteen-byte weight loads a lane issues before using them
constexpr int kMaxSegments = 4;
constexpr int kEpiBias = 1, kEpiGelu = 2, kEpiResidual = 4;

struct GemvSegment {
  const bf16 *w = nullptr; // [n, k]
  DPtr out, bias, residual; // out and residual [rows, n], bias [n]
  int64_t n = 0, first = 0; // outputs; the first's number over all segments
  int epi = 0;
};

struct GemvArgs {
  GemvSegment seg[kMaxSegments];
  int segments = 0;
  const bf16 *x = nullptr; // [rows, k]
  int rows = 0, k = 0;
  int64_t outputs = 0; // over all segments
};

/// Sixteen bytes of weights, not kept in L1 (each is read once; x stays).
__device__ inline int4 loadStreaming(const bf16 *p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ inline float geluTanh(float x) {
  const float c = 0.7978845608028654f; // sqrt(2 / pi)
  return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

/// R: rows rounded up (1, 2, 4 or 8); one warp per output.
template <int R> __global__ void __launch_bounds__(32 * kWarpsPerBlock) decodeGemvKernel(const GemvArgs args) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t j = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (j >= args.outputs)
    return;
  int s = 0;
  while (s + 1 < args.segments && j >= args.seg[s + 1].first)
    ++s;
  const GemvSegment &g = args.seg[s];
  const int64_t n = j - g.first;
  const int K = args.k, rows = args.rows;
  const bf16 *w = g.w + n * K;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    acc[r] = 0.0f;
  for (int base = lane * 8; base < K; base += 256 * kInFlight) {
    int4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      int k = base + u * 256;
      v[u] = k < K ? loadStreaming(w + k) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      int k = base + u * 256;
      if (k >= K)
        break;
      const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&v[u]);
      float2 wf[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        wf[e] = __bfloat1622float2(h[e]);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r >= rows)
          break;
        Pack<bf16> xv = load(args.x + int64_t(r) * K + k);
        const __nv_bfloat162 *xh = reinterpret_cast<const __nv_bfloat162 *>(xv.v);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float2 xf = __bfloat1622float2(xh[e]);
          acc[r] = fmaf(xf.x, wf[e].x, acc[r]);
          acc[r] = fmaf(xf.y, wf[e].y, acc[r]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
    acc[r] = warpSum(acc[r]);
  if (lane != 0)
    return;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= rows)
      break;
    float y = acc[r];
    if (g.epi & kEpiBias)
      y += g.bias[n];
    if (g.epi & kEpiGelu)
      y = geluTanh(y);
    if (g.epi & kEpiResidual)
      y += g.residual[int64_t(r) * g.n + n];
    g.out.st(int64_t(r) * g.n + n, y);
  }
}

bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

/// 0: cuBLASLt; 1: this kernel; 2: the faster (read when a program is prepared).
int gemvMode() {
  const char *e = std::getenv("LOOM_CUDA_GEMV");
  return e && std::string(e) == "0" ? 0 : e && std::string(e) == "1" ? 1 : 2;
}

} // namespace

std::optional<CudaBackendImpl::GemvShape> CudaBackendImpl::decodeGemvShape(const Instruction &ins) {
  if (ins.op != "matmul" || gemvMode() == 0 || !flag(ins, "transpose_b") || flag(ins, "transpose_a") ||
      ins.out.size() != 1 || ins.in.size() < 2)
    return std::nullopt;
  auto found = ins.attrs.find("epilogue");
  std::string epilogue = found != ins.attrs.end() && found->is_string() ? found->get<std::string>() : "";
  int epi = epilogue == "" ? 0
            : epilogue == "bias" ? kEpiBias
            : epilogue == "bias_gelu" ? kEpiBias | kEpiGelu
            : epilogue == "residual" ? kEpiResidual
            : epilogue == "bias_residual" ? kEpiBias | kEpiResidual
                                          : -1;
  size_t operands = 2 + ((epi & kEpiBias) ? 1 : 0) + ((epi & kEpiResidual) ? 1 : 0);
  if (epi < 0 || ins.in.size() != operands)
    return std::nullopt;
  const Buffer &a = buf(ins.in[0]), &b = buf(ins.in[1]), &o = buf(ins.out[0]);
  if (!isBf16(a) || !isBf16(b) || b.shape.size() != 2 || a.shape.empty() || o.shape.empty())
    return std::nullopt;
  if (o.dtype != LOOM_F32 && o.dtype != LOOM_BF16)
    return std::nullopt;
  int64_t n = b.shape[0], k = b.shape[1];
  if (a.shape.back() != k || o.shape.back() != n || k % 8 != 0 || k > (int64_t(1) << 30))
    return std::nullopt;
  int64_t rows = count(a.shape) / k;
  if (rows < 1 || rows > 8 || count(o.shape) != rows * n)
    return std::nullopt;
  for (size_t i = 2; i < ins.in.size(); ++i) {
    const Buffer &e = buf(ins.in[i]);
    bool bias = (epi & kEpiBias) && i == 2;
    if (e.dtype != o.dtype || count(e.shape) != (bias ? n : rows * n))
      return std::nullopt;
  }
  if (!aligned16(ptr(a)) || !aligned16(ptr(b)))
    return std::nullopt;
  GemvShape s;
  s.rows = rows, s.n = n, s.k = k, s.epi = epi;
  return s;
}

Launch CudaBackendImpl::buildDecodeGemv(const std::vector<const Instruction *> &group) {
  GemvArgs args;
  std::optional<GemvShape> first = decodeGemvShape(*group.front());
  if (!first || group.size() > size_t(kMaxSegments))
    fail(LOOM_INTERNAL, where, ": not a product for the decoding kernel");
  args.x = reinterpret_cast<const bf16 *>(ptr(buf(group.front()->in[0])));
  args.rows = int(first->rows), args.k = int(first->k);
  for (const Instruction *ins : group) {
    std::optional<GemvShape> s = decodeGemvShape(*ins);
    if (!s || s->rows != first->rows || s->k != first->k || ins->in[0] != group.front()->in[0])
      fail(LOOM_INTERNAL, where, ": the decoding kernel's products differ in their input");
    GemvSegment &g = args.seg[args.segments++];
    g.w = reinterpret_cast<const bf16 *>(ptr(buf(ins->in[1])));
    g.out = fp(ins->out[0]);
    size_t next = 2;
    if (s->epi & kEpiBias)
      g.bias = fp(ins->in[next++]);
    if (s->epi & kEpiResidual)
      g.residual = fp(ins->in[next++]);
    g.n = s->n, g.first = args.outputs, g.epi = s->epi;
    args.outputs += s->n;
  }
  int64_t blocks = (args.outputs + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > int64_t(1) << 31)
    fail(LOOM_UNSUPPORTED, where, ": ", args.outputs, " outputs are too many for one launch");
  dim3 grid{unsigned(blocks)}, block{32 * kWarpsPerBlock};
  int rows = args.rows;
  return [=](cudaStream_t s) {
    if (rows == 1)
      decodeGemvKernel<1><<<grid, block, 0, s>>>(args);
    else if (rows == 2)
      decodeGemvKernel<2><<<grid, block, 0, s>>>(args);
    else if (rows <= 4)
      decodeGemvKernel<4><<<grid, block, 0, s>>>(args);
    else
      decodeGemvKernel<8><<<grid, block, 0, s>>>(args);
  };
}

Launch CudaBackendImpl::buildProducts(const std::vector<const Instruction *> &group) {
  std::vector<Launch> theirs;
  for (const Instruction *ins : group)
    theirs.push_back(buildMatmul(*ins));
  Launch sequence = [theirs](cudaStream_t s) {
    for (const Launch &l : theirs)
      l(s);
  };
  bool eligible = true;
  for (const Instruction *ins : group)
    eligible &= decodeGemvShape(*ins).has_value();
  if (!eligible)
    return sequence;
  Launch ours = buildDecodeGemv(group);
  if (gemvMode() == 1)
    return ours;
  // Timed as decoding runs them: the weights from memory, three runs each.
  cudaEvent_t e0, e1;
  LOOM_CUDA_CHECK(cudaEventCreate(&e0));
  LOOM_CUDA_CHECK(cudaEventCreate(&e1));
  auto time = [&](const Launch &l) {
    l(stream); // warm: modules loaded, plans made
    float total = 0;
    for (int r = 0; r < 3; ++r) {
      flushL2();
      float ms = 0;
      LOOM_CUDA_CHECK(cudaEventRecord(e0, stream));
      l(stream);
      LOOM_CUDA_CHECK(cudaEventRecord(e1, stream));
      LOOM_CUDA_CHECK(cudaEventSynchronize(e1));
      LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      total += ms;
    }
    return total / 3;
  };
  float mine = time(ours), cublas = time(sequence);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  static const bool verbose = std::getenv("LOOM_CUDA_GEMV_VERBOSE") != nullptr;
  if (verbose) {
    std::optional<GemvShape> s = decodeGemvShape(*group.front());
    int64_t n = 0;
    for (const Instruction *ins : group)
      n += decodeGemvShape(*ins)->n;
    std::fprintf(stderr, "loom: decode product %lldx%lldx%lld (%zu segment%s): ours %.2f us, cuBLASLt %.2f us\n",
                 (long long)s->rows, (long long)n, (long long)s->k, group.size(), group.size() == 1 ? "" : "s",
                 mine * 1e3, cublas * 1e3);
  }
  return mine <= cublas ? ours : sequence;
}

bool CudaBackendImpl::productsTogether(const Instruction &a, const Instruction &b) {
  if (a.op != "matmul" || b.op != "matmul" || a.in.empty() || b.in.empty() || a.in[0] != b.in[0])
    return false;
  std::optional<GemvShape> sa = decodeGemvShape(a), sb = decodeGemvShape(b);
  if (!sa || !sb || sa->rows != sb->rows || sa->k != sb->k)
    return false;
  // b must not read what a writes (its input is a's input; its epilogue's
  // operands must be other tensors), nor write where a reads or writes.
  auto overlap = [&](int64_t x, int64_t y) {
    const Buffer &p = buf(x), &q = buf(y);
    return p.offset < q.offset + q.bytes && q.offset < p.offset + p.bytes;
  };
  for (int64_t id : b.in)
    if (overlap(id, a.out[0]))
      return false;
  for (int64_t id : a.in)
    if (overlap(b.out[0], id))
      return false;
  return !overlap(b.out[0], a.out[0]);
}

} // namespace loom::rt::cuda
