//===- CudaOptimizer.cu - AdamW, SGD, gradient norms and parameter casts ---===//
//
// The optimizer step: the step counter, gradient norms (deterministic
// sums of squares over many tensors), AdamW over a run of tensors in one
// launch (ours, or the compiler's generated kernel), SGD, and the f32 <->
// bf16 casts of a mixed-precision forward's parameters in one launch.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"

#include <cstdlib>
#include <tuple>

namespace loom::rt::cuda {

struct OptimizerArgs {
  double lr, minLr, wd, clip, warmup, total, b1, b2, eps, momentum;
};

namespace {

__global__ void stepKernel(float *s) { *s += 1.0f; }

/// f32 <-> bf16 conversions of many tensors in one launch (the parameters'
/// casts at the start of a mixed-precision forward), or with `Accumulate`
/// gradient sums (a microbatched step's runs of adds, loom-pipeline-
/// schedule's): out[i] += in[i], out f32. A block per chunk.
struct CastChunk {
  DPtr in, out;
  int64_t begin, end;
};
template <bool Accumulate> __global__ void __launch_bounds__(256) castChunksKernel(const CastChunk *chunks) {
  CastChunk c = chunks[blockIdx.x];
  int64_t begin = c.begin;
  if (((reinterpret_cast<uintptr_t>(c.in.p) | reinterpret_cast<uintptr_t>(c.out.p)) % 16) == 0) {
    int64_t end8 = begin + (c.end - begin) / 8 * 8;
    for (int64_t i = begin + int64_t(threadIdx.x) * 8; i < end8; i += int64_t(blockDim.x) * 8) {
      float v[8];
      load8(c.in, i, v);
      if (Accumulate) {
        float sum[8];
        load8(c.out, i, sum);
        for (int k = 0; k < 8; ++k)
          v[k] = sum[k] + v[k];
      }
      store8(c.out, i, v);
    }
    begin = end8;
  }
  for (int64_t i = begin + threadIdx.x; i < c.end; i += blockDim.x)
    c.out.st(i, Accumulate ? c.out[i] + c.in[i] : c.in[i]);
}

/// Sums of squares over many tensors: each block sums one chunk (16-byte
/// loads where aligned) into its own partial; sumPartialsKernel adds them
/// in a fixed order (deterministic, unlike atomics).
struct SquareChunk {
  DPtr g;
  int64_t begin, end;
  /// A deferred gradient (DeferredPart): g this rank's bf16 values, the
  /// gradient combinePair(g, theirs, op), read four at a time as its f32
  /// output would be (the same sums, in the same order).
  const __nv_bfloat16 *theirs = nullptr;
  int op = 0;
};
__global__ void __launch_bounds__(256) sumSquaresChunksKernel(const SquareChunk *chunks, double *partial) {
  __shared__ float shared[32];
  SquareChunk c = chunks[blockIdx.x];
  float s = 0;
  int64_t begin = c.begin;
  int pack = c.g.bf && !c.theirs ? 8 : 4;
  if (reinterpret_cast<uintptr_t>(c.g.p) % 16 == 0 && reinterpret_cast<uintptr_t>(c.theirs) % 8 == 0) {
    int64_t endV = begin + (c.end - begin) / pack * pack;
    for (int64_t i = begin + int64_t(threadIdx.x) * pack; i < endV; i += int64_t(blockDim.x) * pack) {
      float v[8];
      if (c.theirs) {
        float4 g = combinePair4(static_cast<const __nv_bfloat16 *>(c.g.p), c.theirs, i / 4, c.op);
        v[0] = g.x, v[1] = g.y, v[2] = g.z, v[3] = g.w, v[4] = v[5] = v[6] = v[7] = 0;
      } else if (c.g.bf) {
        load8(c.g, i, v);
      } else {
        Pack<float> a = load(static_cast<const float *>(c.g.p) + i);
        v[0] = a.v[0], v[1] = a.v[1], v[2] = a.v[2], v[3] = a.v[3], v[4] = v[5] = v[6] = v[7] = 0;
      }
#pragma unroll
      for (int e = 0; e < 8; ++e)
        s += v[e] * v[e];
    }
    begin = endV;
  }
  for (int64_t i = begin + threadIdx.x; i < c.end; i += blockDim.x) {
    float g = c.theirs ? combinePair(c.g[i], __bfloat162float(c.theirs[i]), c.op) : c.g[i];
    s += g * g;
  }
  s = blockSum(s, shared);
  if (threadIdx.x == 0)
    partial[blockIdx.x] = s;
}
__global__ void sumPartialsKernel(const double *partial, int64_t n, double *out) {
  __shared__ double shared[256];
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    s += partial[i];
  shared[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (int(threadIdx.x) < w)
      shared[threadIdx.x] += shared[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0)
    *out = shared[0];
}
__global__ void sqrtKernel(const double *acc, float *out) { *out = static_cast<float>(sqrt(*acc)); }

__device__ inline double scheduledRate(double lr, double minLr, double warmup, double total, double t) {
  if (warmup > 0 && t < warmup)
    return lr * (t + 1) / warmup;
  if (total <= 0)
    return lr;
  double progress = fmin(1.0, (t - warmup) / fmax(1.0, total - warmup));
  return minLr + 0.5 * (lr - minLr) * (1 + cos(M_PI * progress));
}

/// The step's scalars (learning rate, clip factor, bias corrections), once
/// per block in double, then float math per element.
struct StepScalars {
  float rate, scale, c1, c2;
};
__device__ StepScalars stepScalars(const float *step, const float *norm, const OptimizerArgs &a) {
  __shared__ StepScalars s;
  if (threadIdx.x == 0) {
    double t = *step;
    s.rate = static_cast<float>(scheduledRate(a.lr, a.minLr, a.warmup, a.total, t - 1));
    s.scale = a.clip > 0 && *norm > a.clip ? static_cast<float>(a.clip / *norm) : 1.0f;
    s.c1 = static_cast<float>(1 - pow(a.b1, t));
    s.c2 = static_cast<float>(1 - pow(a.b2, t));
  }
  __syncthreads();
  return s;
}

/// One AdamW (or SGD) update over many tensors at once (a run of the
/// program's adamw or sgd instructions with one set of hyperparameters):
/// each block updates one chunk of one tensor (AdamTensor and AdamChunk in
/// CudaBackendImpl.h), so a step's hundreds of small biases and norm scales
/// cost one launch, not one each.
/// Elements per block of the multi-tensor kernels (AdamW, casts): small
/// chunks keep the blocks running at once on neighbouring addresses.
/// LOOM_CUDA_CHUNK overrides it (a multiple of 8) for measurements.
int64_t chunkElements() {
  static const int64_t n = [] {
    const char *e = std::getenv("LOOM_CUDA_CHUNK");
    int64_t v = e ? std::atoll(e) : 2048;
    return v >= 8 && v % 8 == 0 ? v : int64_t(2048);
  }();
  return n;
}
constexpr int64_t kAdamChunk = 32768; // sums of squares: one stream per block

/// The step's AdamW scalars, once per launch (a one-thread kernel): the
/// update kernel then holds few registers and streams at full bandwidth.
__global__ void adamScalarsKernel(const float *step, const float *norm, OptimizerArgs a, StepScalars *out) {
  double t = *step;
  out->rate = static_cast<float>(scheduledRate(a.lr, a.minLr, a.warmup, a.total, t - 1));
  out->scale = a.clip > 0 && *norm > a.clip ? static_cast<float>(a.clip / *norm) : 1.0f;
  out->c1 = static_cast<float>(1 - pow(a.b1, t));
  out->c2 = static_cast<float>(1 - pow(a.b2, t));
}

__global__ void __launch_bounds__(256) adamwKernel(const AdamTensor *tensors, const AdamChunk *chunks,
                                                   const StepScalars *scalars, float b1, float b2, float eps) {
  const StepScalars s = *scalars;
  // m / c1 / (sqrt(v / c2) + eps) with one division: m / (c1 (sqrt(v) / sqrt(c2) + eps)).
  const float inv1 = 1.0f / s.c1, invSqrt2 = rsqrtf(s.c2);
  AdamChunk c = chunks[blockIdx.x];
  AdamTensor t = tensors[c.tensor];
  const float wd = t.wd;
  auto update = [&](float &pi, float gi, float &mi, float &vi) {
    gi *= s.scale;
    mi = b1 * mi + (1 - b1) * gi;
    vi = b2 * vi + (1 - b2) * gi * gi;
    pi -= s.rate * ((mi * inv1) / (sqrtf(vi) * invSqrt2 + eps) + wd * pi);
  };
  int64_t begin = c.begin;
  bool aligned = ((reinterpret_cast<uintptr_t>(t.p) | reinterpret_cast<uintptr_t>(t.g.p) |
                   reinterpret_cast<uintptr_t>(t.m) | reinterpret_cast<uintptr_t>(t.v)) % 16) == 0 &&
                 reinterpret_cast<uintptr_t>(t.copy) % 8 == 0 && reinterpret_cast<uintptr_t>(t.theirs) % 8 == 0;
  if (aligned) { // four at a time with 16-byte accesses (8 for bf16 gradients), then the chunk's tail
    int64_t end4 = begin + (c.end - begin) / 4 * 4;
    float4 *p4 = reinterpret_cast<float4 *>(t.p), *m4 = reinterpret_cast<float4 *>(t.m),
           *v4 = reinterpret_cast<float4 *>(t.v);
    for (int q = int(begin / 4) + threadIdx.x, e = int(end4 / 4); q < e; q += blockDim.x) {
      float4 gq;
      if (t.theirs) { // a deferred gradient: the pair's combination, as its f32 output would hold it
        gq = combinePair4(static_cast<const __nv_bfloat16 *>(t.g.p), t.theirs, q, t.op);
      } else if (t.g.bf) {
        uint2 raw = __ldg(reinterpret_cast<const uint2 *>(t.g.p) + q);
        float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&raw.x));
        float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&raw.y));
        gq = make_float4(lo.x, lo.y, hi.x, hi.y);
      } else {
        gq = __ldg(reinterpret_cast<const float4 *>(t.g.p) + q);
      }
      float4 pq = p4[q], mq = m4[q], vq = v4[q];
      update(pq.x, gq.x, mq.x, vq.x);
      update(pq.y, gq.y, mq.y, vq.y);
      update(pq.z, gq.z, mq.z, vq.z);
      update(pq.w, gq.w, mq.w, vq.w);
      p4[q] = pq;
      m4[q] = mq;
      v4[q] = vq;
      if (t.copy) {
        __nv_bfloat162 lo = __floats2bfloat162_rn(pq.x, pq.y), hi = __floats2bfloat162_rn(pq.z, pq.w);
        uint2 raw;
        raw.x = *reinterpret_cast<const unsigned *>(&lo);
        raw.y = *reinterpret_cast<const unsigned *>(&hi);
        reinterpret_cast<uint2 *>(t.copy)[q] = raw;
      }
    }
    begin = end4;
  }
  for (int64_t i = begin + threadIdx.x; i < c.end; i += blockDim.x) {
    update(t.p[i], t.theirs ? combinePair(t.g[i], __bfloat162float(t.theirs[i]), t.op) : t.g[i], t.m[i], t.v[i]);
    if (t.copy)
      t.copy[i] = __float2bfloat16_rn(t.p[i]);
  }
}

/// SGD with momentum over many tensors at once (a run of the program's sgd
/// instructions with one set of hyperparameters), a block per chunk as
/// adamwKernel: p -= rate · (m = momentum · m + scale · g + wd · p).
__global__ void __launch_bounds__(256) sgdChunksKernel(const AdamTensor *tensors, const AdamChunk *chunks,
                                                       const StepScalars *scalars, float momentum, float wd) {
  const StepScalars s = *scalars;
  AdamChunk c = chunks[blockIdx.x];
  AdamTensor t = tensors[c.tensor];
  for (int64_t i = c.begin + threadIdx.x; i < c.end; i += blockDim.x) {
    float gi = t.g[i] * s.scale + wd * t.p[i];
    float mi = momentum * t.m[i] + gi;
    t.m[i] = mi;
    t.p[i] -= s.rate * mi;
    if (t.copy)
      t.copy[i] = __float2bfloat16_rn(t.p[i]);
  }
}

__global__ void sgdKernel(float *p, DPtr g, float *m, __nv_bfloat16 *copy, const float *step, const float *norm,
                          int64_t n, OptimizerArgs a) {
  StepScalars s = stepScalars(step, norm, a);
  float momentum = static_cast<float>(a.momentum), wd = static_cast<float>(a.wd);
  GRID_LOOP(i, n) {
    float gi = g[i] * s.scale + wd * p[i];
    m[i] = momentum * m[i] + gi;
    p[i] -= s.rate * m[i];
    if (copy)
      copy[i] = __float2bfloat16_rn(p[i]);
  }
}

} // namespace

OptimizerArgs CudaBackendImpl::optimizerArgs(const Instruction &ins) {
  return {num(ins, "lr", 1e-3),      num(ins, "min_lr", 0),  num(ins, "weight_decay", 0), num(ins, "clip", 0),
          num(ins, "warmup", 0),     num(ins, "total_steps", 0), num(ins, "beta1", 0.9),
          num(ins, "beta2", 0.999),  num(ins, "eps", 1e-8),  num(ins, "momentum", 0)};
}

/// A chunk table over (input, output) pairs, made once here.
static std::vector<CastChunk> castChunks(const std::vector<std::pair<DPtr, DPtr>> &pairs,
                                         const std::vector<int64_t> &counts) {
  std::vector<CastChunk> chunks;
  for (size_t t = 0; t < pairs.size(); ++t)
    for (int64_t b = 0, step = chunkElements(); b < counts[t]; b += step)
      chunks.push_back({pairs[t].first, pairs[t].second, b, std::min(counts[t], b + step)});
  return chunks;
}

/// The casts instrs[begin, end) in one launch (a table of chunks).
Launch CudaBackendImpl::buildCasts(const std::vector<Instruction> &instrs, size_t begin, size_t end) {
  std::vector<std::pair<DPtr, DPtr>> pairs;
  std::vector<int64_t> counts;
  for (size_t i = begin; i < end; ++i) {
    int64_t cnt = count(buf(instrs[i].out[0]).shape);
    if (count(buf(instrs[i].in[0]).shape) != cnt)
      fail(LOOM_INVALID_BUNDLE, "instruction [", i, "] 'cast': input and output sizes differ");
    pairs.push_back({fp(instrs[i].in[0]), fp(instrs[i].out[0])}), counts.push_back(cnt);
  }
  std::vector<CastChunk> chunks = castChunks(pairs, counts);
  if (chunks.empty())
    return [](cudaStream_t) {};
  const CastChunk *dc = deviceArray(chunks);
  unsigned blocks = unsigned(chunks.size());
  return [=](cudaStream_t s) { castChunksKernel<false><<<blocks, 256, 0, s>>>(dc); };
}

Launch CudaBackendImpl::buildAccumulates(const std::vector<Instruction> &instrs, size_t begin, size_t end) {
  std::vector<std::pair<DPtr, DPtr>> pairs; // (gradient, its f32 sum)
  std::vector<int64_t> counts;
  for (size_t i = begin; i < end; ++i) {
    const Instruction &ins = instrs[i];
    int64_t sum = ins.out[0], g = ins.in[0] == sum ? ins.in[1] : ins.in[0];
    pairs.push_back({fp(g), fp(sum)}), counts.push_back(count(buf(sum).shape));
  }
  std::vector<CastChunk> chunks = castChunks(pairs, counts);
  if (chunks.empty())
    return [](cudaStream_t) {};
  if (chunks.size() > (size_t(1) << 31) - 1)
    fail(LOOM_UNSUPPORTED, where, ": ", chunks.size(), " accumulation chunks exceed one launch's grid");
  const CastChunk *dc = deviceArray(chunks);
  unsigned blocks = unsigned(chunks.size());
  return [=](cudaStream_t s) { castChunksKernel<true><<<blocks, 256, 0, s>>>(dc); };
}

/// An update's bf16 copy of its parameter (output `at`, where
/// loom-update-copies added one), or null.
__nv_bfloat16 *CudaBackendImpl::updateCopy(const Instruction &ins, size_t at) {
  if (ins.out.size() <= at)
    return nullptr;
  const Buffer &c = buf(ins.out[at]), &p = buf(ins.in[0]);
  if (c.dtype != LOOM_BF16 || count(c.shape) != count(p.shape))
    fail(LOOM_INVALID_BUNDLE, where, ": ", ins.op, "'s copy '", c.name, "' must be bf16 of ", count(p.shape),
         " elements, got ", dtypeName(c.dtype), " ", shapeStr(c.shape));
  return reinterpret_cast<__nv_bfloat16 *>(ptr(c));
}

/// The device tables of a multi-tensor update over `group` (parameter,
/// gradient, first moment and, with `second`, second moment as inputs 0-3),
/// fixed-size chunks of each tensor a block; made once here.
CudaBackendImpl::UpdateTables CudaBackendImpl::updateTables(const std::vector<const Instruction *> &group,
                                                            bool second) {
  std::vector<AdamTensor> tensors;
  std::vector<AdamChunk> chunks;
  for (const Instruction *ins : group) {
    int64_t cnt = count(buf(ins->in[0]).shape);
    tensors.push_back({f(ins->in[0]), fp(ins->in[1]), f(ins->in[2]), second ? f(ins->in[3]) : nullptr, cnt,
                       updateCopy(*ins, second ? 3 : 2)});
    tensors.back().wd = float(num(*ins, "weight_decay", 0));
    if (const DeferredPart *d = second ? deferredOf(ins->in[1]) : nullptr)
      std::tie(tensors.back().g, tensors.back().theirs, tensors.back().op) = deferredPair(*d);
    for (int64_t b = 0, step = chunkElements(); b < cnt; b += step)
      chunks.push_back({int64_t(tensors.size() - 1), b, std::min(cnt, b + step)});
  }
  if (chunks.size() > (size_t(1) << 31) - 1)
    fail(LOOM_UNSUPPORTED, where, ": ", chunks.size(), " ", group.front()->op, " chunks exceed one launch's grid");
  if (chunks.empty())
    return {};
  return {deviceArray(tensors), deviceArray(chunks), unsigned(chunks.size())};
}

/// AdamW over every tensor of `group` in one launch.
Launch CudaBackendImpl::buildAdamw(const std::vector<const Instruction *> &group) {
  const Instruction &first = *group.front();
  OptimizerArgs a = optimizerArgs(first);
  float *step = f(first.in[4]), *norm = f(first.in[5]);
  UpdateTables t = updateTables(group, true);
  if (!t.blocks)
    return [](cudaStream_t) {};
  StepScalars *scalars = deviceArray(std::vector<StepScalars>(1));
  float b1 = float(a.b1), b2 = float(a.b2), eps = float(a.eps);
  return [=](cudaStream_t s) {
    adamScalarsKernel<<<1, 1, 0, s>>>(step, norm, a, scalars);
    adamwKernel<<<t.blocks, 256, 0, s>>>(t.tensors, t.chunks, scalars, b1, b2, eps);
  };
}

/// SGD over every tensor of `group` in one launch: ResNet-50's 161 updates
/// were 161 launches.
Launch CudaBackendImpl::buildSgdRun(const std::vector<const Instruction *> &group) {
  const Instruction &first = *group.front();
  OptimizerArgs a = optimizerArgs(first);
  float *step = f(first.in[3]), *norm = f(first.in[4]);
  UpdateTables t = updateTables(group, false);
  if (!t.blocks)
    return [](cudaStream_t) {};
  StepScalars *scalars = deviceArray(std::vector<StepScalars>(1));
  float momentum = float(a.momentum), wd = float(a.wd);
  return [=](cudaStream_t s) {
    adamScalarsKernel<<<1, 1, 0, s>>>(step, norm, a, scalars);
    sgdChunksKernel<<<t.blocks, 256, 0, s>>>(t.tensors, t.chunks, scalars, momentum, wd);
  };
}

/// AdamW over the run `group` by the compiler's kernel (KernelWriter::writeAdam
/// in compiler/bundle/KernelGen.cpp): our one-thread kernel computes the step's
/// scalars, then a block per 2048-element chunk of each tensor, which the
/// kernel finds in the arena by the offsets it was compiled with.
Launch CudaBackendImpl::buildGeneratedAdamw(const std::vector<const Instruction *> &group) {
  const Instruction &first = *group.front();
  cudaKernel_t fn = generatedKernel(first);
  const nlohmann::json launch = first.attrs.value("launch", nlohmann::json::object());
  unsigned grid = launch.value("grid", 0u), block = launch.value("block", 0u);
  int64_t tensors = launch.value("tensors", int64_t(0)), chunk = launch.value("chunk", int64_t(0)), chunks = 0;
  for (const Instruction *ins : group)
    chunks += chunk > 0 ? (count(buf(ins->in[0]).shape) + chunk - 1) / chunk : 0;
  if (tensors != int64_t(group.size()) || block != 256 || chunk <= 0 || int64_t(grid) != chunks)
    fail(LOOM_INVALID_BUNDLE, where, ": AdamW kernel '", first.attrs.value("kernel", std::string()), "' covers ",
         tensors, " tensors in ", grid, " blocks; the program has ", group.size(), " in ", chunks);
  OptimizerArgs a = optimizerArgs(first);
  float *step = f(first.in[4]), *norm = f(first.in[5]);
  StepScalars *scalars = deviceArray(std::vector<StepScalars>(1));
  void *base = arena;
  return [=](cudaStream_t s) {
    adamScalarsKernel<<<1, 1, 0, s>>>(step, norm, a, scalars);
    launchGenerated(fn, grid, block, {base, base, base, base, scalars}, s); // the arena as f32, f32x4, bf16, bf16x4
  };
}

Launch CudaBackendImpl::buildSumOfSquares(const Instruction &ins, const std::set<int64_t> &skip) {
  std::vector<SquareChunk> chunks;
  for (size_t i = 0; i < ins.in.size(); ++i)
    if (!skip.count(int64_t(i))) {
      int64_t cnt = count(buf(ins.in[i]).shape);
      const DeferredPart *d = ins.op == "global_norm" ? deferredOf(ins.in[i]) : nullptr;
      for (int64_t b = 0; b < cnt; b += kAdamChunk) {
        chunks.push_back({fp(ins.in[i]), b, std::min(cnt, b + kAdamChunk)});
        if (d)
          std::tie(chunks.back().g, chunks.back().theirs, chunks.back().op) = deferredPair(*d);
      }
    }
  reserve(sizeof(double) * (chunks.size() + 1));
  if (chunks.empty())
    return [=](cudaStream_t s) { LOOM_CUDA_CHECK(cudaMemsetAsync(workspace, 0, sizeof(double), s)); };
  const SquareChunk *dc = deviceArray(chunks);
  int64_t n = int64_t(chunks.size());
  return [=](cudaStream_t s) {
    double *acc = reinterpret_cast<double *>(workspace);
    sumSquaresChunksKernel<<<unsigned(n), 256, 0, s>>>(dc, acc + 1);
    sumPartialsKernel<<<1, 256, 0, s>>>(acc + 1, n, acc);
  };
}

Launch CudaBackendImpl::buildGlobalNorm(const Instruction &ins) {
  if (ins.attrs.contains("group"))
    return buildCommunication(ins);
  Launch squares = buildSumOfSquares(ins, {});
  float *out = f(ins.out[0]);
  return [=](cudaStream_t s) {
    squares(s);
    sqrtKernel<<<1, 1, 0, s>>>(reinterpret_cast<double *>(workspace), out);
  };
}

Launch CudaBackendImpl::buildSgd(const Instruction &ins) {
  auto n = [&](int64_t id) { return count(buf(id).shape); };
  OptimizerArgs a = optimizerArgs(ins);
  float *p = f(ins.in[0]), *m = f(ins.in[2]), *step = f(ins.in[3]), *norm = f(ins.in[4]);
  DPtr g = fp(ins.in[1]);
  __nv_bfloat16 *copy = updateCopy(ins, 2);
  int64_t cnt = n(ins.in[0]);
  // Grid-stride over at most 1024 blocks: each block works out the step's
  // scalars (in double) once.
  unsigned blocks = unsigned(std::min<int64_t>((cnt / 4 + kThreads - 1) / kThreads + 1, 1024));
  return [=](cudaStream_t s) { sgdKernel<<<blocks, kThreads, 0, s>>>(p, g, m, copy, step, norm, cnt, a); };
}

Launch CudaBackendImpl::buildStepIncrement(const Instruction &ins) {
  float *step = f(ins.in[0]);
  return [=](cudaStream_t s) { stepKernel<<<1, 1, 0, s>>>(step); };
}

void CudaBackendImpl::addOptimizerBuilders(BuilderTable &table) {
  table["step_increment"] = &CudaBackendImpl::buildStepIncrement;
  table["global_norm"] = &CudaBackendImpl::buildGlobalNorm;
  table["adamw"] = [](CudaBackendImpl &b, const Instruction &ins) { return b.buildAdamw({&ins}); };
  table["sgd"] = &CudaBackendImpl::buildSgd;
}

} // namespace loom::rt::cuda
