//===- CudaDecodeGemm.cu - Products of a few rows by [N, K] weights -------===//
//
// A decoding step multiplies one row per sequence by every weight matrix:
// its time is reading the weights once. A serving bundle prepares its bf16
// weights laid out [N, K] (loomc's --weight-layout nk), so each output's
// weights are one contiguous row, read in sixteen-byte loads. A block of
// eight warps computes four outputs: each warp takes an eighth of K for all
// four (every lane has four loads in flight), multiplies them by every row
// of x (at most 8, read through L1), sums its lanes by shuffles, and the
// warps' sums are added in shared memory. On an H200, timed layer by layer
// over TinyLlama's and GPT-2's products, this beat a warp per output and
// cuBLASLt (3.15 TB/s against 2.61 and 2.54 for TinyLlama's). No partial sums leave the block; the result does not depend on
// timing. Consecutive products of one input (Llama's q, k and v; gate
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

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace loom::rt::cuda {

namespace {

constexpr int kWarpsPerBlock = 8; // splitting K
constexpr int kOutputs = 4;       // per block, their weight loads in flight together
constexpr int kMaxSegments = 4;
constexpr int kEpiBias = 1, kEpiGelu = 2, kEpiResidual = 4;

struct GemvSegment {
  const bf16 *w = nullptr; // [n, k]
  DPtr out, bias, residual; // out and residual [rows, n], bias [n]
  int64_t n = 0, first = 0; // outputs; the first's number over all segments
  int epi = 0;
};

constexpr int kNormNone = 0, kNormRms = 1, kNormLayer = 2;

struct GemvArgs {
  GemvSegment seg[kMaxSegments];
  int segments = 0;
  const bf16 *x = nullptr; // [rows, k]
  int rows = 0, k = 0;
  int64_t outputs = 0; // over all segments
  // The norm whose result the products read, computed here from its input
  // x: gamma and beta [k] (beta for layernorm).
  int norm = kNormNone;
  const bf16 *gamma = nullptr, *beta = nullptr;
  float eps = 0;
  // Whether the weights may be read before the previous kernel ends (a
  // programmatic dependent launch): no kernel of the program writes them.
  bool preload = false;
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

/// Output o of output group `group` (kOutputs outputs a group, numbered
/// over every segment): its segment (-1 past the last output) and its
/// weights' row.
__device__ inline void locate(const GemvArgs &args, int64_t group, int o, int &seg, const bf16 *&w) {
  const int64_t j = group * kOutputs + o;
  int s = 0;
  while (s + 1 < args.segments && j >= args.seg[s + 1].first)
    ++s;
  seg = j < args.outputs ? s : -1;
  w = seg < 0 ? nullptr : args.seg[s].w + (j - args.seg[s].first) * int64_t(args.k);
}

/// Output o of `group` for row r: the warps' sums added in order (the result
/// does not depend on timing), times `scale` (a folded RMS norm's inverse
/// deviation), the product's epilogue, the store.
template <int R>
__device__ inline void storeOutput(const GemvArgs &args, const float (*sums)[R][kOutputs], int seg, int64_t group,
                                   int r, int o, float scale = 1.0f) {
  const GemvSegment &g = args.seg[seg];
  const int64_t n = group * kOutputs + o - g.first;
  float y = 0;
  for (int q = 0; q < kWarpsPerBlock; ++q)
    y += sums[q][r][o];
  y *= scale;
  if (g.epi & kEpiBias)
    y += g.bias[n];
  if (g.epi & kEpiGelu)
    y = geluTanh(y);
  if (g.epi & kEpiResidual)
    y += g.residual[int64_t(r) * g.n + n];
  g.out.st(int64_t(r) * g.n + n, y);
}

/// Sixteen bytes at element `at` of each output's weights row (zeros past K
/// or for an output past the last).
__device__ inline void loadWeights(const bf16 *const (&w)[kOutputs], int at, int K, int4 (&v)[kOutputs]) {
#pragma unroll
  for (int o = 0; o < kOutputs; ++o)
    v[o] = w[o] && at < K ? loadStreaming(w[o] + at) : make_int4(0, 0, 0, 0);
}

/// Each warp's sums over its lanes, into sums[warp] (lane 0 stores).
template <int R>
__device__ inline void warpSumsTo(float (&acc)[R][kOutputs], float (*sums)[R][kOutputs]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int o = 0; o < kOutputs; ++o) {
      float t = warpSum(acc[r][o]);
      if (lane == 0)
        sums[warp][r][o] = t;
    }
}

/// One step of K for every row: this lane's eight elements of x (row r at
/// k), each through f(r, e, value) (a folded norm), times the four
/// outputs' weights in v, into acc.
template <int R, typename F>
__device__ inline void multiplyStep(const GemvArgs &args, int k, const int4 (&v)[kOutputs], float (&acc)[R][kOutputs],
                                    F f) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= args.rows)
      break;
    Pack<bf16> xv = load(args.x + int64_t(r) * args.k + k);
    float xf[8];
#pragma unroll
    for (int e = 0; e < 8; ++e)
      xf[e] = f(r, e, __bfloat162float(xv.v[e]));
#pragma unroll
    for (int o = 0; o < kOutputs; ++o) {
      const __nv_bfloat162 *wh = reinterpret_cast<const __nv_bfloat162 *>(&v[o]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float2 wf = __bfloat1622float2(wh[e]);
        acc[r][o] = fmaf(xf[2 * e], wf.x, acc[r][o]);
        acc[r][o] = fmaf(xf[2 * e + 1], wf.y, acc[r][o]);
      }
    }
  }
}

/// The block's sum over K of f(x[r][k]) for each row r, into total[r]
/// (a folded layer norm's statistics).
template <int R, typename F>
__device__ inline void rowSums(const GemvArgs &args, F f, float *total, float (*scratch)[R]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float part[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    part[r] = 0.0f;
  for (int k = threadIdx.x * 8; k < args.k; k += blockDim.x * 8)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= args.rows)
        break;
      Pack<bf16> xv = load(args.x + int64_t(r) * args.k + k);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        part[r] += f(r, __bfloat162float(xv.v[e]));
    }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float v = warpSum(part[r]);
    if (lane == 0)
      scratch[warp][r] = v;
  }
  __syncthreads();
  if (threadIdx.x < R) {
    float t = 0;
    for (int w = 0; w < kWarpsPerBlock; ++w)
      t += scratch[w][threadIdx.x];
    total[threadIdx.x] = t;
  }
  __syncthreads();
}

/// R: rows rounded up (1, 2, 4 or 8). A block computes kOutputs outputs:
/// its warps split K (sixteen bytes of each output's weights per lane and
/// step, every output's load in flight at once), then add their sums in
/// shared memory. NORM folds the norm whose result the products read:
/// - kNormRms in one pass. The inverse deviation is one number a row, so it
///   multiplies the sums at the end: the block multiplies the weights by
///   gamma * x and adds up x * x from the same loads, and each output is
///   scaled by rsqrt(sum / K + eps) (no rounding of the norm's result to
///   bf16 between; within the products' tolerance of it).
/// - kNormLayer: each block first computes its rows' mean and inverse
///   deviation (while its first weights load) and normalises x as it reads
///   it, rounded to bf16 as the norm's own result would be.
template <int R, int NORM>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) decodeGemvKernel(const GemvArgs args) {
  __shared__ float sums[kWarpsPerBlock][R][kOutputs];
  __shared__ float scratch[kWarpsPerBlock][R];
  __shared__ float mean[R], inv[R];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int K = args.k, rows = args.rows;
  const bf16 *w[kOutputs];
  int seg[kOutputs];
#pragma unroll
  for (int o = 0; o < kOutputs; ++o)
    locate(args, blockIdx.x, o, seg[o], w[o]);
  const int first = (warp * 32 + lane) * 8, stride = 256 * kWarpsPerBlock;
  startDependents();
  if (!args.preload)
    waitPrevious();
  int4 v[kOutputs];
  loadWeights(w, first, K, v);
  // The weights' first loads are in flight; x (and the norm's input) are
  // the previous kernel's results.
  waitPrevious();
  if (NORM == kNormLayer) {
    rowSums<R>(args, [](int, float x) { return x; }, mean, scratch);
    if (threadIdx.x < R)
      mean[threadIdx.x] /= float(K);
    __syncthreads();
    rowSums<R>(args, [&](int r, float x) { return (x - mean[r]) * (x - mean[r]); }, inv, scratch);
    if (threadIdx.x < R)
      inv[threadIdx.x] = rsqrtf(inv[threadIdx.x] / float(K) + args.eps);
    __syncthreads();
  }
  float acc[R][kOutputs] = {};
  float squares[R] = {}; // kNormRms: this thread's part of each row's sum of squares
  for (int k = first; k < K; k += stride) {
    float gk[8], bk[8];
    if (NORM != kNormNone) {
      Pack<bf16> gv = load(args.gamma + k), bv;
      if (NORM == kNormLayer)
        bv = load(args.beta + k);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        gk[e] = __bfloat162float(gv.v[e]), bk[e] = NORM == kNormLayer ? __bfloat162float(bv.v[e]) : 0.0f;
    }
    multiplyStep<R>(args, k, v, acc, [&](int r, int e, float x) {
      if (NORM == kNormRms) {
        squares[r] = fmaf(x, x, squares[r]);
        return x * gk[e];
      }
      return NORM == kNormLayer ? __bfloat162float(__float2bfloat16_rn((x - mean[r]) * inv[r] * gk[e] + bk[e])) : x;
    });
    loadWeights(w, k + stride, K, v);
  }
  warpSumsTo<R>(acc, sums);
  if (NORM == kNormRms)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float t = warpSum(squares[r]);
      if (lane == 0)
        scratch[warp][r] = t;
    }
  __syncthreads();
  if (threadIdx.x >= R * kOutputs)
    return;
  const int r = threadIdx.x / kOutputs, o = threadIdx.x % kOutputs;
  if (r >= rows || seg[o] < 0)
    return;
  float scale = 1.0f;
  if (NORM == kNormRms) {
    float t = 0;
    for (int q = 0; q < kWarpsPerBlock; ++q) // in order: every block gets the same number
      t += scratch[q][r];
    scale = rsqrtf(t / float(K) + args.eps);
  }
  storeOutput<R>(args, sums, seg[o], blockIdx.x, r, o, scale);
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

namespace {

/// decodeGemvKernel for `rows` rows (rounded up to 1, 2, 4 or 8).
template <int NORM> void (*gemvKernelFor(int rows))(GemvArgs) {
  return rows == 1   ? decodeGemvKernel<1, NORM>
         : rows == 2 ? decodeGemvKernel<2, NORM>
         : rows <= 4 ? decodeGemvKernel<4, NORM>
                     : decodeGemvKernel<8, NORM>;
}

Launch launchGemv(const GemvArgs &args) {
  int64_t blocks = (args.outputs + kOutputs - 1) / kOutputs;
  dim3 grid{unsigned(blocks)}, block{32 * kWarpsPerBlock};
  // The norm's prologue is its own instantiation: the products without
  // one keep their registers (and so their occupancy).
  void (*kernel)(GemvArgs) = args.norm == kNormRms     ? gemvKernelFor<kNormRms>(args.rows)
                             : args.norm == kNormLayer ? gemvKernelFor<kNormLayer>(args.rows)
                                                       : gemvKernelFor<kNormNone>(args.rows);
  return [=](cudaStream_t s) { launchAfter(true, kernel, grid, block, 0, s, args); };
}

/// The norm's part of the arguments: x becomes the norm's input;
/// `at(i)` is the address of the norm's operand i.
template <typename At> void setNorm(GemvArgs &args, const Instruction *norm, float eps, At at) {
  if (!norm)
    return;
  args.norm = norm->op == "rmsnorm" ? kNormRms : kNormLayer;
  args.x = reinterpret_cast<const bf16 *>(at(0));
  args.gamma = reinterpret_cast<const bf16 *>(at(1));
  if (args.norm == kNormLayer)
    args.beta = reinterpret_cast<const bf16 *>(at(2));
  args.eps = eps;
}

} // namespace

bool CudaBackendImpl::normFeedsProducts(const std::vector<Instruction> &instrs, size_t i, size_t end) {
  const Instruction &nm = instrs[i];
  if ((nm.op != "rmsnorm" && nm.op != "layernorm") || nm.in.size() != (nm.op == "rmsnorm" ? 2u : 3u) ||
      nm.out.size() != 1 || i + 1 >= end || instrs[i + 1].in.empty() || instrs[i + 1].in[0] != nm.out[0])
    return false;
  const Buffer &x = buf(nm.in[0]), &y = buf(nm.out[0]);
  int64_t k = x.shape.empty() ? 0 : x.shape.back();
  if (!isBf16(x) || !isBf16(y) || x.shape != y.shape || k % 8 != 0 || !aligned16(ptr(x)) ||
      y.role != BufferRole::Activation)
    return false;
  for (size_t p = 1; p < nm.in.size(); ++p)
    if (!isBf16(buf(nm.in[p])) || buf(nm.in[p]).shape != Shape{k} || !aligned16(ptr(buf(nm.in[p]))))
      return false;
  // The products (or their slices) must not write where the norm reads.
  for (size_t j = i + 1; j < end; ++j)
    for (int64_t out : instrs[j].out)
      for (int64_t in : nm.in)
        if (overlaps(out, in))
          return false;
  // Nothing after them reads the norm's result (or a view of it).
  return !readAfter(instrs, end, nm.out[0]);
}

Launch CudaBackendImpl::buildDecodeGemv(const std::vector<const Instruction *> &group, const Instruction *norm) {
  GemvArgs args;
  std::optional<GemvShape> first = decodeGemvShape(*group.front());
  if (!first || group.size() > size_t(kMaxSegments))
    fail(LOOM_INTERNAL, where, ": not a product for the decoding kernel");
  args.x = reinterpret_cast<const bf16 *>(ptr(buf(group.front()->in[0])));
  args.rows = int(first->rows), args.k = int(first->k);
  args.preload = true;
  for (const Instruction *ins : group)
    args.preload = args.preload && readOnlyHere(ins->in[1]);
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
  setNorm(args, norm, norm ? float(num(*norm, "eps", 1e-5)) : 0.0f, [&](size_t p) { return ptr(buf(norm->in[p])); });
  return launchGemv(args);
}

Launch CudaBackendImpl::fasterProducts(Launch ours, Launch theirs, const std::string &what) {
  if (gemvMode() == 1)
    return ours;
  // Timed as decoding runs them: the weights from memory.
  ours(stream), theirs(stream); // warm: modules loaded, plans made
  float mine = timeOnStream([&] { ours(stream); }, true), cublas = timeOnStream([&] { theirs(stream); }, true);
  static const bool verbose = std::getenv("LOOM_CUDA_GEMV_VERBOSE") != nullptr;
  if (verbose)
    std::fprintf(stderr, "loom: decode product %s: ours %.2f us, cuBLASLt %.2f us\n", what.c_str(), mine * 1e3,
                 cublas * 1e3);
  return mine <= cublas ? ours : theirs;
}

Launch CudaBackendImpl::buildProducts(const std::vector<const Instruction *> &group, const Instruction *norm) {
  std::vector<Launch> theirs;
  if (norm)
    theirs.push_back(build(*norm));
  for (const Instruction *ins : group)
    theirs.push_back(buildMatmul(*ins));
  Launch sequence = [theirs](cudaStream_t s) {
    for (const Launch &l : theirs)
      l(s);
  };
  for (const Instruction *ins : group)
    if (!decodeGemvShape(*ins))
      return sequence;
  std::optional<GemvShape> s = decodeGemvShape(*group.front());
  int64_t n = 0;
  for (const Instruction *ins : group)
    n += decodeGemvShape(*ins)->n;
  return fasterProducts(buildDecodeGemv(group, norm), sequence,
                        cat(s->rows, "x", n, "x", s->k, " (", norm ? norm->op + " and " : "", group.size(),
                            group.size() == 1 ? " product)" : " products)"));
}

bool CudaBackendImpl::readOnlyHere(int64_t id) {
  BufferRole role = buf(id).role;
  if (role != BufferRole::Param && role != BufferRole::Cache && role != BufferRole::Input)
    return false;
  for (const Instruction &ins : instructions.at(building.first))
    for (int64_t out : ins.out)
      if (overlaps(out, id))
        return false;
  return true;
}

bool CudaBackendImpl::readAfter(const std::vector<Instruction> &instrs, size_t from, int64_t id) {
  int64_t storage = storageOf(rank, id);
  for (size_t j = from; j < instrs.size(); ++j)
    for (int64_t in : instrs[j].in)
      if (storageOf(rank, in) == storage)
        return true;
  return false;
}

size_t CudaBackendImpl::productSlicesEnd(const std::vector<Instruction> &instrs, size_t i, bool normFolded) {
  std::optional<GemvShape> s = decodeGemvShape(instrs[i]);
  if (!s || (s->epi & kEpiResidual))
    return i;
  const Instruction &mm = instrs[i];
  const Buffer &y = buf(mm.out[0]);
  size_t end = i + 1;
  std::vector<int64_t> outs;
  while (end < instrs.size() && end - i <= size_t(kMaxSegments)) {
    const Instruction &sl = instrs[end];
    if (sl.op != "slice" || sl.in.size() != 1 || sl.in[0] != mm.out[0] || sl.out.size() != 1)
      break;
    const Buffer &o = buf(sl.out[0]);
    int64_t axis = int64_t(num(sl, "axis", -1)), start = int64_t(num(sl, "start", -1));
    int64_t size = int64_t(num(sl, "size", -1));
    if ((axis != -1 && axis != int64_t(y.shape.size()) - 1) || start < 0 || size < 1 || start + size > s->n ||
        o.dtype != y.dtype || count(o.shape) != s->rows * size)
      break;
    for (size_t a = normFolded ? 1 : 0; a < mm.in.size(); ++a)
      if (overlaps(sl.out[0], mm.in[a]))
        return i;
    for (int64_t id : outs)
      if (overlaps(sl.out[0], id))
        return i;
    outs.push_back(sl.out[0]);
    ++end;
  }
  if (end == i + 1)
    return i;
  // The product's result (or a view of it) must be read by these slices
  // only: it is never written. An output of the program is read later.
  if (y.role != BufferRole::Activation || readAfter(instrs, end, mm.out[0]))
    return i;
  return end;
}

Launch CudaBackendImpl::buildProductSlices(const std::vector<Instruction> &instrs, size_t i, size_t end,
                                           const Instruction *norm) {
  const Instruction &mm = instrs[i];
  GemvShape s = *decodeGemvShape(mm);
  GemvArgs args;
  args.x = reinterpret_cast<const bf16 *>(ptr(buf(mm.in[0])));
  args.rows = int(s.rows), args.k = int(s.k);
  args.preload = readOnlyHere(mm.in[1]);
  const bf16 *w = reinterpret_cast<const bf16 *>(ptr(buf(mm.in[1])));
  for (size_t j = i + 1; j < end; ++j) {
    int64_t start = int64_t(num(instrs[j], "start", 0)), size = int64_t(num(instrs[j], "size", 0));
    GemvSegment &g = args.seg[args.segments++];
    g.w = w + start * s.k; // [N, K]: the slice's outputs are rows start.. of the weights
    g.out = fp(instrs[j].out[0]);
    if (s.epi & kEpiBias)
      g.bias = fp(mm.in[2]) + start;
    g.n = size, g.first = args.outputs, g.epi = s.epi;
    args.outputs += size;
  }
  setNorm(args, norm, norm ? float(num(*norm, "eps", 1e-5)) : 0.0f, [&](size_t p) { return ptr(buf(norm->in[p])); });
  Launch first = norm ? build(*norm) : Launch([](cudaStream_t) {});
  Launch product = buildMatmul(mm);
  Launch slices = end - i > 2 ? buildSlices(instrs, i + 1, end) : build(instrs[i + 1]);
  Launch theirs = [first, product, slices](cudaStream_t st) {
    first(st);
    product(st);
    slices(st);
  };
  return fasterProducts(launchGemv(args), theirs,
                        cat(s.rows, "x", s.n, "x", s.k, " (", norm ? norm->op + ", " : "", "product and ", end - i - 1,
                            " slices)"));
}

size_t CudaBackendImpl::decodeGroupEnd(const std::vector<Instruction> &instrs, size_t i, bool normFolded) {
  if (i >= instrs.size() || instrs[i].op != "matmul" || !decodeGemvShape(instrs[i]))
    return i;
  if (size_t end = productSlicesEnd(instrs, i, normFolded); end > i)
    return end;
  size_t end = i + 1;
  auto together = [&](size_t j) {
    for (size_t g = i; g < end; ++g)
      if (!productsTogether(instrs[g], instrs[j]))
        return false;
    return true;
  };
  while (end < instrs.size() && end - i < size_t(kMaxSegments) && together(end))
    ++end;
  return end;
}

Launch CudaBackendImpl::buildDecodeGroup(const std::vector<Instruction> &instrs, size_t i, size_t end,
                                         const Instruction *norm) {
  if (end > i + 1 && instrs[i + 1].op == "slice")
    return buildProductSlices(instrs, i, end, norm);
  std::vector<const Instruction *> group;
  for (size_t j = i; j < end; ++j)
    group.push_back(&instrs[j]);
  return buildProducts(group, norm);
}

bool CudaBackendImpl::productsTogether(const Instruction &a, const Instruction &b) {
  if (a.op != "matmul" || b.op != "matmul" || a.in.empty() || b.in.empty() || a.in[0] != b.in[0])
    return false;
  std::optional<GemvShape> sa = decodeGemvShape(a), sb = decodeGemvShape(b);
  if (!sa || !sb || sa->rows != sb->rows || sa->k != sb->k)
    return false;
  // b must not read what a writes (its input is a's input; its epilogue's
  // operands must be other tensors), nor write where a reads or writes.
  for (int64_t id : b.in)
    if (overlaps(id, a.out[0]))
      return false;
  for (int64_t id : a.in)
    if (overlaps(b.out[0], id))
      return false;
  return !overlaps(b.out[0], a.out[0]);
}

} // namespace loom::rt::cuda
