//===- CudaBackend.cu - Instruction streams on an NVIDIA GPU --------------===//
//
// One device arena (cudaMalloc); a compute stream, a communication stream
// for the data-parallel gradient buckets (overlapped with the backward,
// joined by event_wait) and a stream for pipeline sends. Matrix products
// through cuBLASLt (f32 on TF32 tensor cores, or bf16) with their bias, GELU
// and bias-gradient epilogues; attention through our flash kernels
// (FlashAttention.cu) on bf16, batched GEMMs around a masked softmax on f32;
// CUDA kernels (16-byte vector loads where they apply) for the rest, and
// each program replayed as a CUDA graph from its second run.
// Instructions are validated by the CPU backend's builders before any kernel
// is set up, so a bundle is checked the same way on every backend. Every
// CUDA and cuBLAS call is checked and becomes an Error naming the call;
// kernels that find bad data (a token id outside the vocabulary) raise a
// device-side flag that the backend turns into an error after the program.
//
// The backend is one class (CudaBackendImpl.h) whose member functions and
// kernels live in files by concern; this one has the device, the programs
// (prepare and run) and the table of instruction builders.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"

#include "runtime/src/Communicator.h"
#include "runtime/src/cpu/CpuBackend.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <set>

namespace loom::rt::cuda {

void checkCuda(cudaError_t e, const char *what, const char *file, int line) {
  if (e != cudaSuccess)
    fail(e == cudaErrorMemoryAllocation ? LOOM_INVALID_ARGUMENT : LOOM_INTERNAL, file, ":", line,
         ": ", what, " failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}
void checkCublas(cublasStatus_t s, const char *what, const char *file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    fail(LOOM_INTERNAL, file, ":", line, ": ", what, " failed: ", cublasGetStatusName(s), ": ",
         cublasGetStatusString(s));
}

std::vector<int64_t> stridesOf(const Shape &s) {
  std::vector<int64_t> st(s.size(), 1);
  for (int i = static_cast<int>(s.size()) - 2; i >= 0; --i)
    st[i] = st[i + 1] * s[i + 1];
  return st;
}

std::vector<int64_t> broadcastTo(const Shape &in, const Shape &out) {
  std::vector<int64_t> inStrides = stridesOf(in), st(out.size(), 0);
  size_t off = out.size() - in.size();
  for (size_t i = 0; i < in.size(); ++i)
    st[off + i] = in[i] == out[off + i] && in[i] != 1 ? inStrides[i] : 0;
  return st;
}

Strided strided(const Shape &shape, const std::vector<int64_t> &a, const std::vector<int64_t> &b) {
  Strided s;
  s.rank = static_cast<int>(shape.size());
  for (int d = 0; d < s.rank; ++d) {
    s.shape[d] = shape[d];
    s.a[d] = a[d];
    s.b[d] = b.empty() ? 0 : b[d];
  }
  return s;
}

namespace {

/// Whether two adamw instructions can share one launch: the same
/// hyperparameters, step counter and gradient norm.
static bool sameAdamw(const Instruction &a, const Instruction &b) {
  return a.op == "adamw" && b.op == "adamw" && a.attrs == b.attrs && a.in.size() == 6 && b.in.size() == 6 &&
         a.in[4] == b.in[4] && a.in[5] == b.in[5];
}

/// A cast between f32 and bf16 (those of a run share one launch).
static bool isFloatCast(const RankProgram &rank, const Instruction &ins) {
  if (ins.op != "cast" || ins.in.size() != 1 || ins.out.size() != 1)
    return false;
  loom_dtype_t a = rank.buffers[ins.in[0]].dtype, b = rank.buffers[ins.out[0]].dtype;
  return a != b && (a == LOOM_F32 || a == LOOM_BF16) && (b == LOOM_F32 || b == LOOM_BF16);
}

} // namespace

CudaBackendImpl::CudaBackendImpl(const RankProgram &rank, int device, NcclWorld *world, const std::string &ptx)
    : rank(rank), device(device), world(world), kernelsPtx(ptx) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0)
    fail(LOOM_UNSUPPORTED, "no usable CUDA device (cudaGetDeviceCount: ",
         e == cudaSuccess ? "0 devices" : cudaGetErrorString(e),
         "); check nvidia-smi and CUDA_VISIBLE_DEVICES, or use --backend cpu");
  if (device < 0 || device >= count)
    fail(LOOM_INVALID_ARGUMENT, "CUDA device ", device, " does not exist (", count, " visible)");
  LOOM_CUDA_CHECK(cudaSetDevice(device));
  LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  LOOM_CUBLAS_CHECK(cublasCreate(&blas));
  // cuBLAS's Hopper kernels want a larger workspace than its default.
  LOOM_CUDA_CHECK(cudaMalloc(&blasWorkspace, kBlasWorkspace));
  LOOM_CUBLAS_CHECK(cublasSetWorkspace(blas, blasWorkspace, kBlasWorkspace));
  LOOM_CUBLAS_CHECK(cublasLtCreate(&lt));
  LOOM_CUBLAS_CHECK(cublasSetStream(blas, stream));
  size_t bytes = std::max<int64_t>(rank.arenaBytes, 256);
  LOOM_CUDA_CHECK(cudaMalloc(&arena, bytes));
  LOOM_CUDA_CHECK(cudaMemsetAsync(arena, 0, bytes, stream));
  LOOM_CUDA_CHECK(cudaMalloc(&errorWord, 3 * sizeof(long long)));
  LOOM_CUDA_CHECK(cudaMemsetAsync(errorWord, 0, 3 * sizeof(long long), stream));
  LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&sendStream, cudaStreamNonBlocking));
  LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&commStream, cudaStreamNonBlocking));
  if (!kernelsPtx.empty()) { // the compiler's generated kernels, JIT-compiled by the driver
    cudaError_t e = cudaLibraryLoadData(&kernelsLibrary, kernelsPtx.c_str(), nullptr, nullptr, 0,
                                        nullptr, nullptr, 0);
    if (e != cudaSuccess)
      fail(LOOM_INVALID_BUNDLE, "kernels.ptx: cudaLibraryLoadData failed: ", cudaGetErrorName(e), ": ",
           cudaGetErrorString(e), " (PTX for a newer GPU or driver than this one?)");
  }
}

CudaBackendImpl::~CudaBackendImpl() {
  // Synchronise, then free in reverse order of creation; errors are ignored here.
  if (stream)
    cudaStreamSynchronize(stream);
  for (auto &[name, steps] : programs)
    for (Step &step : steps)
      if (step.start)
        cudaEventDestroy(step.start), cudaEventDestroy(step.end);
  dropGraphs();
  for (void *p : allocations)
    cudaFree(p);
  if (sendStream)
    cudaStreamSynchronize(sendStream), cudaStreamDestroy(sendStream);
  if (commStream)
    cudaStreamSynchronize(commStream), cudaStreamDestroy(commStream);
  for (auto &[id, e] : commEvents)
    cudaEventDestroy(e);
  for (cudaEvent_t e : readyEvents)
    cudaEventDestroy(e);
  for (Staging &slot : staging) {
    cudaFree(slot.data);
    if (slot.sent)
      cudaEventDestroy(slot.sent), cudaEventDestroy(slot.copied);
  }
  if (kernelsLibrary)
    cudaLibraryUnload(kernelsLibrary);
  cudaFree(workspace);
  cudaFree(errorWord);
  cudaFree(arena);
  gemmPlans.clear();
  if (lt)
    cublasLtDestroy(lt);
  if (blas)
    cublasDestroy(blas);
  cudaFree(blasWorkspace);
  if (stream)
    cudaStreamDestroy(stream);
}

void CudaBackendImpl::upload(const Buffer &b, const void *src) {
  LOOM_CUDA_CHECK(cudaSetDevice(device)); // each rank's thread drives its own GPU
  LOOM_CUDA_CHECK(cudaMemcpyAsync(ptr(b), src, b.bytes, cudaMemcpyHostToDevice, stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
}
void CudaBackendImpl::download(const Buffer &b, void *dst) const {
  LOOM_CUDA_CHECK(cudaSetDevice(device));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, const_cast<CudaBackendImpl *>(this)->ptr(b), b.bytes,
                                  cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void CudaBackendImpl::prepare(const std::string &program, const std::vector<Instruction> &instrs) {
  LOOM_CUDA_CHECK(cudaSetDevice(device)); // GEMM plans are timed on this rank's GPU
  {
    // The CPU builders check every shape and attribute; they never touch memory.
    ThreadPool validationPool(1);
    static char fakeArena[64];
    CpuProgram validated(rank, instrs, fakeArena, validationPool, program, /*allocate=*/false,
                         &validationCommunicator());
  }
  std::vector<Step> steps;
  instructions[program] = instrs;
  for (size_t i = 0; i < instrs.size(); ++i) {
    where = cat("instruction ", program, "[", i, "] '", instrs[i].op, "'");
    building = {program, i};
    // LOOM_PROFILE_SHAPES=1: --profile times matrix products by shape.
    std::string label = instrs[i].op;
    static const bool byShape = std::getenv("LOOM_PROFILE_SHAPES") != nullptr;
    if (byShape && (label == "matmul" || label == "attention" || label == "attention_grad")) {
      for (int64_t id : instrs[i].in)
        label += " " + shapeStr(buf(id).shape);
      if (flag(instrs[i], "transpose_a"))
        label += " Ta";
      if (flag(instrs[i], "transpose_b"))
        label += " Tb";
    }
    if (isFloatCast(rank, instrs[i]) && i + 1 < instrs.size() && isFloatCast(rank, instrs[i + 1])) {
      size_t j = i;
      while (j < instrs.size() && isFloatCast(rank, instrs[j]))
        ++j;
      steps.push_back({where, label, 0, buildCasts(instrs, i, j), nullptr, nullptr});
      for (size_t k = i + 1; k < j; ++k) // converted in the first's launch
        steps.push_back({cat("instruction ", program, "[", k, "] 'cast'"), label, 0, [](cudaStream_t) {},
                         nullptr, nullptr});
      i = j - 1;
      continue;
    }
    if (instrs[i].op == "adamw") { // a run of updates with one set of hyperparameters: one launch
      std::vector<const Instruction *> group{&instrs[i]};
      // The compiler's generated kernel updates the run that names it
      // (its weight decays may differ); ours, a run of equal attributes.
      bool gen = generatedAdamw(instrs[i]);
      auto kernelOf = [](const Instruction &ins) {
        return ins.attrs.is_object() ? ins.attrs.value("kernel", std::string()) : std::string();
      };
      while (i + group.size() < instrs.size() &&
             (gen ? instrs[i + group.size()].op == "adamw" && kernelOf(instrs[i + group.size()]) == kernelOf(instrs[i])
                  : sameAdamw(instrs[i], instrs[i + group.size()])))
        group.push_back(&instrs[i + group.size()]);
      steps.push_back({where, label, 0, gen ? buildGeneratedAdamw(group) : buildAdamw(group), nullptr, nullptr});
      for (size_t k = 1; k < group.size(); ++k) // the rest ran in the first's launch
        steps.push_back({cat("instruction ", program, "[", i + k, "] 'adamw'"), label, 0,
                         [](cudaStream_t) {}, nullptr, nullptr});
      i += group.size() - 1;
      continue;
    }
    buildCapturable = true, buildReplayable = nullptr, buildReplayed = nullptr;
    steps.push_back({where, label, denseFlops(instrs[i]), build(instrs[i]), nullptr, nullptr});
    steps.back().capturable = buildCapturable;
    steps.back().replayable = std::move(buildReplayable);
    steps.back().replayed = std::move(buildReplayed);
  }
  if (workspaceBytes > workspaceAllocated) {
    dropGraphs(); // they hold the old workspace's address
    cudaFree(workspace);
    LOOM_CUDA_CHECK(cudaMalloc(&workspace, workspaceBytes));
    workspaceAllocated = workspaceBytes;
  }
  Graph &graph = graphs[program];
  if (graph.exec)
    cudaGraphExecDestroy(graph.exec);
  graph = Graph{};
  graph.capturable = std::all_of(steps.begin(), steps.end(), [](const Step &s) { return s.capturable; });
  for (size_t i = 0; i < steps.size(); ++i)
    if (steps[i].replayable || steps[i].replayed)
      graph.hooks.push_back(i);
  programs[program] = std::move(steps);
}

void CudaBackendImpl::run(const std::string &program) {
  LOOM_CUDA_CHECK(cudaSetDevice(device));
  auto &steps = programs.at(program);
  Graph &g = graphs[program];
  bool graphable = graphsWanted() && !profiling && !g.disabled && g.capturable;
  bool done = false;
  if (graphable && g.exec) {
    if (std::all_of(g.hooks.begin(), g.hooks.end(),
                    [&](size_t i) { return !steps[i].replayable || steps[i].replayable(); })) {
      LOOM_CUDA_CHECK(cudaGraphLaunch(g.exec, stream));
      for (size_t i : g.hooks)
        if (steps[i].replayed)
          steps[i].replayed();
      done = true;
    } else { // host state differs from the capture's: run eagerly, capture again next time
      cudaGraphExecDestroy(g.exec), g.exec = nullptr;
      g.eagerRuns = 0;
    }
  } else if (graphable && g.eagerRuns > 0) {
    done = captureAndLaunch(steps, g);
  }
  if (!done) {
    launchEager(steps);
    ++g.eagerRuns;
  }
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(sendStream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(commStream));
  if (world && world->aborted)
    fail(LOOM_INVALID_ARGUMENT, program, ": another rank failed and stopped every rank");
  if (profiling)
    for (Step &step : steps) {
      float ms = 0;
      LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, step.start, step.end));
      OpTime &t = times[step.op];
      t.seconds += ms / 1e3;
      t.count += 1;
      t.flops += step.flops;
    }
  long long err[3];
  LOOM_CUDA_CHECK(cudaMemcpy(err, errorWord, sizeof(err), cudaMemcpyDeviceToHost));
  if (err[0]) {
    LOOM_CUDA_CHECK(cudaMemset(errorWord, 0, sizeof(err)));
    fail(LOOM_INVALID_ARGUMENT, program, ": ", err[0] == 1 ? "token id " : "target class ", err[2],
         " at position ", err[1], " is outside the table it indexes");
  }
}

Launch CudaBackendImpl::build(const Instruction &ins) {
  const std::string &op = ins.op;
  // Norms, softmaxes and the loss the compiler generated a kernel for;
  // LOOM_CUDA_GENERATED=0 runs ours instead (softmax has no other).
  if (op != "fused" && ins.attrs.is_object() && ins.attrs.contains("kernel") && kernelsLibrary &&
      (generatedKernelsOn() || op == "softmax"))
    return op.rfind("cross_entropy", 0) == 0 ? buildCrossEntropyKernel(ins) : buildRowKernel(ins);
  const BuilderTable &table = builders();
  if (auto it = table.find(op); it != table.end())
    return it->second(*this, ins);
  fail(LOOM_UNSUPPORTED, where, ": the CUDA backend has no kernel for '", op,
       "' yet (convolution, pooling and batch-norm gradients, and softmax in a bundle compiled without --fuse, run on --backend cpu)");
}

const CudaBackendImpl::BuilderTable &CudaBackendImpl::builders() {
  static const BuilderTable table = [] {
    BuilderTable t;
    addElementwiseBuilders(t);
    addLayoutBuilders(t);
    addNormBuilders(t);
    addGemmBuilders(t);
    addAttentionBuilders(t);
    addLossBuilders(t);
    addOptimizerBuilders(t);
    addConvBuilders(t);
    addGeneratedBuilders(t);
    addCollectiveBuilders(t);
    return t;
  }();
  return table;
}

} // namespace loom::rt::cuda

namespace loom::rt {

std::unique_ptr<Backend> makeCudaBackend(const RankProgram &rank, int device, NcclWorld *world,
                                         const std::string &kernelsPtx) {
  return std::make_unique<cuda::CudaBackendImpl>(rank, device, world, kernelsPtx);
}

} // namespace loom::rt

namespace loom::rt::cuda {

struct OptimizerArgs {
  double lr, minLr, wd, clip, warmup, total, b1, b2, eps, momentum;
};

namespace {

__global__ void stepKernel(float *s) { *s += 1.0f; }

/// f32 <-> bf16 conversions of many tensors in one launch (the parameters'
/// casts at the start of a mixed-precision forward): a block per chunk.
struct CastChunk {
  DPtr in, out;
  int64_t begin, end;
};
__global__ void __launch_bounds__(256) castChunksKernel(const CastChunk *chunks) {
  CastChunk c = chunks[blockIdx.x];
  int64_t begin = c.begin;
  if (((reinterpret_cast<uintptr_t>(c.in.p) | reinterpret_cast<uintptr_t>(c.out.p)) % 16) == 0) {
    int64_t end8 = begin + (c.end - begin) / 8 * 8;
    for (int64_t i = begin + int64_t(threadIdx.x) * 8; i < end8; i += int64_t(blockDim.x) * 8) {
      float v[8];
      load8(c.in, i, v);
      store8(c.out, i, v);
    }
    begin = end8;
  }
  for (int64_t i = begin + threadIdx.x; i < c.end; i += blockDim.x)
    c.out.st(i, c.in[i]);
}

/// Sums of squares over many tensors: each block sums one chunk (16-byte
/// loads where aligned) into its own partial; sumPartialsKernel adds them
/// in a fixed order (deterministic, unlike atomics).
struct SquareChunk {
  DPtr g;
  int64_t begin, end;
};
__global__ void __launch_bounds__(256) sumSquaresChunksKernel(const SquareChunk *chunks, double *partial) {
  __shared__ float shared[32];
  SquareChunk c = chunks[blockIdx.x];
  float s = 0;
  int64_t begin = c.begin;
  int pack = c.g.bf ? 8 : 4;
  if (reinterpret_cast<uintptr_t>(c.g.p) % 16 == 0) {
    int64_t endV = begin + (c.end - begin) / pack * pack;
    for (int64_t i = begin + int64_t(threadIdx.x) * pack; i < endV; i += int64_t(blockDim.x) * pack) {
      float v[8];
      if (c.g.bf) {
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
  for (int64_t i = begin + threadIdx.x; i < c.end; i += blockDim.x)
    s += c.g[i] * c.g[i];
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

/// One AdamW update over many tensors at once (a run of the program's adamw
/// instructions with one set of hyperparameters): each block updates one
/// chunk of one tensor, so a step's hundreds of small biases and norm scales
/// cost one launch, not one each.
struct AdamTensor {
  float *p;
  DPtr g; // f32, or bf16 (mixed precision's gradients, widened exactly here)
  float *m, *v;
  int64_t n;
};
struct AdamChunk {
  int64_t tensor, begin, end; // elements [begin, end) of tensors[tensor]
};
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
                                                   const StepScalars *scalars, float b1, float b2, float eps,
                                                   float wd) {
  const StepScalars s = *scalars;
  // m / c1 / (sqrt(v / c2) + eps) with one division: m / (c1 (sqrt(v) / sqrt(c2) + eps)).
  const float inv1 = 1.0f / s.c1, invSqrt2 = rsqrtf(s.c2);
  auto update = [&](float &pi, float gi, float &mi, float &vi) {
    gi *= s.scale;
    mi = b1 * mi + (1 - b1) * gi;
    vi = b2 * vi + (1 - b2) * gi * gi;
    pi -= s.rate * ((mi * inv1) / (sqrtf(vi) * invSqrt2 + eps) + wd * pi);
  };
  AdamChunk c = chunks[blockIdx.x];
  AdamTensor t = tensors[c.tensor];
  int64_t begin = c.begin;
  bool aligned = ((reinterpret_cast<uintptr_t>(t.p) | reinterpret_cast<uintptr_t>(t.g.p) |
                   reinterpret_cast<uintptr_t>(t.m) | reinterpret_cast<uintptr_t>(t.v)) % 16) == 0;
  if (aligned) { // four at a time with 16-byte accesses (8 for bf16 gradients), then the chunk's tail
    int64_t end4 = begin + (c.end - begin) / 4 * 4;
    float4 *p4 = reinterpret_cast<float4 *>(t.p), *m4 = reinterpret_cast<float4 *>(t.m),
           *v4 = reinterpret_cast<float4 *>(t.v);
    for (int q = int(begin / 4) + threadIdx.x, e = int(end4 / 4); q < e; q += blockDim.x) {
      float4 gq;
      if (t.g.bf) {
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
    }
    begin = end4;
  }
  for (int64_t i = begin + threadIdx.x; i < c.end; i += blockDim.x)
    update(t.p[i], t.g[i], t.m[i], t.v[i]);
}

__global__ void sgdKernel(float *p, DPtr g, float *m, const float *step, const float *norm,
                          int64_t n, OptimizerArgs a) {
  StepScalars s = stepScalars(step, norm, a);
  float momentum = static_cast<float>(a.momentum), wd = static_cast<float>(a.wd);
  GRID_LOOP(i, n) {
    float gi = g[i] * s.scale + wd * p[i];
    m[i] = momentum * m[i] + gi;
    p[i] -= s.rate * m[i];
  }
}

} // namespace

OptimizerArgs CudaBackendImpl::optimizerArgs(const Instruction &ins) {
  return {num(ins, "lr", 1e-3),      num(ins, "min_lr", 0),  num(ins, "weight_decay", 0), num(ins, "clip", 0),
          num(ins, "warmup", 0),     num(ins, "total_steps", 0), num(ins, "beta1", 0.9),
          num(ins, "beta2", 0.999),  num(ins, "eps", 1e-8),  num(ins, "momentum", 0)};
}

/// The casts instrs[begin, end) in one launch (a table of chunks).
Launch CudaBackendImpl::buildCasts(const std::vector<Instruction> &instrs, size_t begin, size_t end) {
  std::vector<CastChunk> chunks;
  for (size_t i = begin; i < end; ++i) {
    int64_t cnt = count(buf(instrs[i].out[0]).shape);
    if (count(buf(instrs[i].in[0]).shape) != cnt)
      fail(LOOM_INVALID_BUNDLE, "instruction [", i, "] 'cast': input and output sizes differ");
    for (int64_t b = 0, step = chunkElements(); b < cnt; b += step)
      chunks.push_back({fp(instrs[i].in[0]), fp(instrs[i].out[0]), b, std::min(cnt, b + step)});
  }
  if (chunks.empty())
    return [](cudaStream_t) {};
  const CastChunk *dc = deviceArray(chunks);
  unsigned blocks = unsigned(chunks.size());
  return [=](cudaStream_t s) { castChunksKernel<<<blocks, 256, 0, s>>>(dc); };
}

/// AdamW over every tensor of `group` in one launch: a table of tensors and
/// of fixed-size chunks, made once here.
Launch CudaBackendImpl::buildAdamw(const std::vector<const Instruction *> &group) {
  const Instruction &first = *group.front();
  OptimizerArgs a = optimizerArgs(first);
  float *step = f(first.in[4]), *norm = f(first.in[5]);
  std::vector<AdamTensor> tensors;
  std::vector<AdamChunk> chunks;
  for (const Instruction *ins : group) {
    int64_t cnt = count(buf(ins->in[0]).shape);
    tensors.push_back({f(ins->in[0]), fp(ins->in[1]), f(ins->in[2]), f(ins->in[3]), cnt});
    for (int64_t b = 0, step = chunkElements(); b < cnt; b += step)
      chunks.push_back({int64_t(tensors.size() - 1), b, std::min(cnt, b + step)});
  }
  if (chunks.empty())
    return [](cudaStream_t) {};
  if (chunks.size() > (size_t(1) << 31) - 1)
    fail(LOOM_UNSUPPORTED, where, ": ", chunks.size(), " AdamW chunks exceed one launch's grid");
  const AdamTensor *dt = deviceArray(tensors);
  const AdamChunk *dc = deviceArray(chunks);
  StepScalars *scalars = deviceArray(std::vector<StepScalars>(1));
  unsigned blocks = unsigned(chunks.size());
  float b1 = float(a.b1), b2 = float(a.b2), eps = float(a.eps), wd = float(a.wd);
  return [=](cudaStream_t s) {
    adamScalarsKernel<<<1, 1, 0, s>>>(step, norm, a, scalars);
    adamwKernel<<<blocks, 256, 0, s>>>(dt, dc, scalars, b1, b2, eps, wd);
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
      for (int64_t b = 0; b < cnt; b += kAdamChunk)
        chunks.push_back({fp(ins.in[i]), b, std::min(cnt, b + kAdamChunk)});
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
  int64_t cnt = n(ins.in[0]);
  // Grid-stride over at most 1024 blocks: each block works out the step's
  // scalars (in double) once.
  unsigned blocks = unsigned(std::min<int64_t>((cnt / 4 + kThreads - 1) / kThreads + 1, 1024));
  return [=](cudaStream_t s) { sgdKernel<<<blocks, kThreads, 0, s>>>(p, g, m, step, norm, cnt, a); };
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

namespace loom::rt::cuda {
namespace {

/// col[n][g][ci, kh, kw][oh, ow] = x[n][g * Cg + ci][oh * stride - pad + kh][ow * stride - pad + kw]
/// (zero outside the image): a convolution becomes one GEMM per image and group.
struct ConvShape {
  int64_t N, C, H, W, groups, Cg, KH, KW, Ho, Wo, stride, pad;
};
__global__ void im2colKernel(const float *x, float *col, ConvShape s) {
  int64_t K = s.Cg * s.KH * s.KW, P = s.Ho * s.Wo, total = s.N * s.groups * K * P;
  GRID_LOOP(i, total) {
    int64_t pos = i % P, k = (i / P) % K, ng = i / (P * K), g = ng % s.groups, n = ng / s.groups;
    int64_t ci = k / (s.KH * s.KW), kh = (k / s.KW) % s.KH, kw = k % s.KW;
    int64_t ih = (pos / s.Wo) * s.stride - s.pad + kh, iw = (pos % s.Wo) * s.stride - s.pad + kw;
    col[i] = ih >= 0 && ih < s.H && iw >= 0 && iw < s.W
                 ? x[((n * s.C + g * s.Cg + ci) * s.H + ih) * s.W + iw]
                 : 0.0f;
  }
}

/// Batch normalisation with the batch's statistics (as the CPU backend):
/// a block per channel, mean then variance over N x inner.
__global__ void batchNormKernel(const float *x, const float *g, const float *b, float *y, int64_t n, int64_t ch,
                                int64_t inner, float eps) {
  __shared__ float shared[32];
  int64_t c = blockIdx.x, count = n * inner;
  auto at = [&](int64_t i) { return ((i / inner) * ch + c) * inner + i % inner; };
  float sum = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x)
    sum += x[at(i)];
  float mean = blockSum(sum, shared) / float(count);
  float sq = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x)
    sq += (x[at(i)] - mean) * (x[at(i)] - mean);
  float inv = rsqrtf(blockSum(sq, shared) / float(count) + eps);
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x)
    y[at(i)] = (x[at(i)] - mean) * inv * g[c] + b[c];
}

/// Max or average pooling (the average counts the padding, as the CPU backend).
__global__ void poolKernel(bool max, const float *x, float *y, int64_t nc, int64_t H, int64_t W, int64_t Ho,
                           int64_t Wo, int64_t k, int64_t stride, int64_t pad) {
  GRID_LOOP(i, nc * Ho * Wo) {
    int64_t ow = i % Wo, oh = (i / Wo) % Ho, plane = i / (Ho * Wo);
    float acc = max ? -INFINITY : 0.0f;
    for (int64_t kh = 0; kh < k; ++kh)
      for (int64_t kw = 0; kw < k; ++kw) {
        int64_t ih = oh * stride - pad + kh, iw = ow * stride - pad + kw;
        if (ih < 0 || ih >= H || iw < 0 || iw >= W)
          continue;
        float v = x[(plane * H + ih) * W + iw];
        acc = max ? fmaxf(acc, v) : acc + v;
      }
    y[i] = max ? acc : acc / float(k * k);
  }
}

} // namespace

/// A convolution as GEMMs: W_g [Og, Cg*KH*KW] x col [Cg*KH*KW, Ho*Wo] per
/// image and group, where col is the image itself for 1x1 stride-1 kernels.
Launch CudaBackendImpl::buildConv2d(const Instruction &ins) {
  const Buffer &x = buf(ins.in[0]), &w = buf(ins.in[1]), &o = buf(ins.out[0]);
  ConvShape c{x.shape[0], x.shape[1], x.shape[2], x.shape[3], int64_t(num(ins, "groups", 1)), w.shape[1],
              w.shape[2], w.shape[3], o.shape[2], o.shape[3], int64_t(num(ins, "stride", 1)),
              int64_t(num(ins, "padding", 0))};
  int64_t O = w.shape[0], Og = O / c.groups, K = c.Cg * c.KH * c.KW, P = c.Ho * c.Wo;
  float *px = f(ins.in[0]), *pw = f(ins.in[1]), *po = f(ins.out[0]);
  bool direct = c.KH == 1 && c.KW == 1 && c.stride == 1 && c.pad == 0; // col == x
  if (!direct)
    reserve(size_t(c.N * c.groups * K * P) * sizeof(float));
  GemmTypes t; // f32 on TF32 tensor cores
  // Offsets (elements) of every (image, group) GEMM's operands.
  std::vector<std::array<int64_t, 3>> offsets;
  int64_t align = 0;
  for (int64_t n = 0; n < c.N; ++n)
    for (int64_t g = 0; g < c.groups; ++g) {
      int64_t a = g * Og * K, b = direct ? (n * c.C + g * c.Cg) * c.H * c.W : (n * c.groups + g) * K * P,
              out = (n * O + g * Og) * P;
      offsets.push_back({a, b, out});
      align |= (a | b | out) * 4;
    }
  // The GEMM plan is timed on the real result buffer and the image (or a
  // workspace-sized stand-in: the workspace is allocated after planning).
  float *colPlan = direct ? px : nullptr;
  if (!direct)
    LOOM_CUDA_CHECK(cudaMalloc(&colPlan, size_t(c.N * c.groups * K * P) * sizeof(float)));
  auto plan = planGemm(t, false, false, Og, P, K, pw, K, colPlan, P, po, P, align ? align : 256);
  if (!direct)
    cudaFree(colPlan);
  return [=](cudaStream_t s) {
    float *col = direct ? px : reinterpret_cast<float *>(workspace);
    if (!direct)
      im2colKernel<<<blocksFor(c.N * c.groups * K * P), kThreads, 0, s>>>(px, col, c);
    for (const auto &off : offsets)
      gemm(*plan, pw + off[0], col + off[1], po + off[2], s);
  };
}

Launch CudaBackendImpl::buildBatchNorm(const Instruction &ins) {
  const Buffer &x = buf(ins.in[0]);
  int64_t n = x.shape[0], ch = x.shape[1], inner = count(x.shape) / std::max<int64_t>(n * ch, 1);
  float eps = static_cast<float>(num(ins, "eps", 1e-5));
  float *px = f(ins.in[0]), *g = f(ins.in[1]), *b = f(ins.in[2]), *y = f(ins.out[0]);
  return [=](cudaStream_t s) { batchNormKernel<<<unsigned(ch), kThreads, 0, s>>>(px, g, b, y, n, ch, inner, eps); };
}

Launch CudaBackendImpl::buildPool(const Instruction &ins) {
  const std::string &op = ins.op;
  const Buffer &x = buf(ins.in[0]), &o = buf(ins.out[0]);
  int64_t k = int64_t(num(ins, "kernel", 1)), stride = int64_t(num(ins, "stride", 1)), pad = int64_t(num(ins, "padding", 0));
  float *px = f(ins.in[0]), *py = f(ins.out[0]);
  int64_t nc = x.shape[0] * x.shape[1], H = x.shape[2], W = x.shape[3], Ho = o.shape[2], Wo = o.shape[3];
  bool max = op == "max_pool2d";
  return [=](cudaStream_t s) {
    poolKernel<<<blocksFor(nc * Ho * Wo), kThreads, 0, s>>>(max, px, py, nc, H, W, Ho, Wo, k, stride, pad);
  };
}

void CudaBackendImpl::addConvBuilders(BuilderTable &table) {
  table["conv2d"] = &CudaBackendImpl::buildConv2d;
  table["batchnorm"] = &CudaBackendImpl::buildBatchNorm;
  for (const char *op : {"max_pool2d", "avg_pool2d"})
    table[op] = &CudaBackendImpl::buildPool;
}

} // namespace loom::rt::cuda

namespace loom::rt::cuda {

bool generatedKernelsOn() {
  static const bool on = [] {
    const char *e = std::getenv("LOOM_CUDA_GENERATED");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

void launchGenerated(cudaKernel_t fn, unsigned grid, unsigned block, std::vector<void *> pointers,
                            cudaStream_t s) {
  std::vector<void *> args;
  for (void *&p : pointers)
    args.push_back(&p);
  LOOM_CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void *>(fn), dim3(grid), dim3(block), args.data(), 0, s));
}

/// The generated kernel an instruction names (attrs "kernel") in kernels.ptx.
cudaKernel_t CudaBackendImpl::generatedKernel(const Instruction &ins) {
  std::string name = ins.attrs.value("kernel", std::string());
  if (!kernelsLibrary)
    fail(LOOM_INVALID_BUNDLE, where, ": the bundle has no kernels.ptx for kernel '", name, "'");
  cudaKernel_t fn = nullptr;
  if (cudaError_t e = cudaLibraryGetKernel(&fn, kernelsLibrary, name.c_str()); e != cudaSuccess)
    fail(LOOM_INVALID_BUNDLE, where, ": kernels.ptx has no kernel '", name, "' (", cudaGetErrorName(e), ")");
  return fn;
}

/// Vector loads and stores need 16-byte aligned tensors (the compiler places
/// every buffer at a multiple of 64 bytes); a bundle that does not is refused.
void CudaBackendImpl::requireVectorAligned(std::initializer_list<const std::vector<int64_t> *> lists, int64_t vector) {
  if (vector > 1)
    for (const std::vector<int64_t> *ids : lists)
      for (int64_t id : *ids)
        if (buf(id).offset % 16)
          fail(LOOM_INVALID_BUNDLE, where, ": buffer '", buf(id).name, "' at offset ", buf(id).offset,
               " is not 16-byte aligned, which the kernel's vector loads need");
}

/// A norm or softmax over rows of the last axis, by the compiler's kernel:
/// a warp per row, `vector` elements per load (parameters: the inputs, then
/// the output).
Launch CudaBackendImpl::buildRowKernel(const Instruction &ins) {
  cudaKernel_t fn = generatedKernel(ins);
  const Buffer &x = buf(ins.in[0]);
  if (x.shape.empty() || ins.out.size() != 1)
    fail(LOOM_INVALID_BUNDLE, where, ": a row kernel needs an input of rank >= 1 and one output");
  int64_t h = x.shape.back(), rows = count(x.shape) / std::max<int64_t>(h, 1);
  const nlohmann::json launch = ins.attrs.value("launch", nlohmann::json::object());
  unsigned block = launch.value("block", 0u), grid = launch.value("grid", 0u);
  int64_t vector = launch.value("vector", int64_t(1));
  if (block != 256 || uint64_t(grid) * 8 < uint64_t(rows) || vector < 1 || h % (32 * vector))
    fail(LOOM_INVALID_BUNDLE, where, ": row kernel launch ", grid, " x ", block, " (vector ", vector,
         ") does not give each of ", rows, " rows of ", h, " a warp");
  requireVectorAligned({&ins.in, &ins.out}, vector);
  std::vector<void *> pointers;
  for (const std::vector<int64_t> *ids : {&ins.in, &ins.out})
    for (int64_t id : *ids)
      pointers.push_back(ptr(buf(id)));
  return [=](cudaStream_t s) { launchGenerated(fn, grid, block, pointers, s); };
}

/// The cross-entropy loss or its gradient by the compiler's kernel (a block
/// per row). The loss kernel writes each row's loss to the workspace, which
/// our mean kernel averages; a bad target raises the error word as ours do.
Launch CudaBackendImpl::buildCrossEntropyKernel(const Instruction &ins) {
  cudaKernel_t fn = generatedKernel(ins);
  bool grad = ins.op == "cross_entropy_grad";
  const Buffer &logits = buf(ins.in[0]);
  if (logits.shape.empty() || ins.in.size() != (grad ? 3u : 2u) || ins.out.size() != 1)
    fail(LOOM_INVALID_BUNDLE, where, ": takes logits, targets", grad ? ", dloss" : "", " and writes one tensor");
  int64_t vocab = logits.shape.back(), rows = count(buf(ins.in[1]).shape);
  const nlohmann::json launch = ins.attrs.value("launch", nlohmann::json::object());
  unsigned block = launch.value("block", 0u), grid = launch.value("grid", 0u);
  int64_t vector = launch.value("vector", int64_t(1));
  if (block != 256 || int64_t(grid) != rows || vector < 1 || vocab % vector || rows * vocab != count(logits.shape))
    fail(LOOM_INVALID_BUNDLE, where, ": cross-entropy kernel launch ", grid, " x ", block, " (vector ", vector,
         ") does not match ", rows, " rows of ", vocab);
  std::vector<int64_t> vectors = {ins.in[0], ins.out[0]}; // logits and their gradient
  requireVectorAligned({&vectors}, vector);
  void *pl = ptr(logits), *pt = ptr(buf(ins.in[1])), *po = ptr(buf(ins.out[0]));
  if (grad) {
    void *pd = ptr(buf(ins.in[2]));
    return [=](cudaStream_t s) { launchGenerated(fn, grid, 256, {pl, pt, pd, po}, s); };
  }
  reserve(rows * sizeof(float));
  long long *err = errorWord;
  float *out = f(ins.out[0]);
  return [=](cudaStream_t s) {
    float *rowLoss = reinterpret_cast<float *>(workspace);
    launchGenerated(fn, grid, 256, {pl, pl, pt, rowLoss, err}, s);
    meanKernel<<<1, 1024, 0, s>>>(rowLoss, rows, out);
  };
}

/// A generated elementwise chain: a thread per `vector` output elements, its
/// parameters the input buffers then the output buffers.
Launch CudaBackendImpl::buildFused(const Instruction &ins) {
  cudaKernel_t fn = generatedKernel(ins);
  std::vector<void *> pointers;
  for (int64_t id : ins.in)
    pointers.push_back(ptr(buf(id)));
  for (int64_t id : ins.out)
    pointers.push_back(ptr(buf(id)));
  // The launch shape the compiler chose: a thread per `vector` output
  // elements (1 in bundles before vectorised kernels).
  int64_t n = count(buf(ins.out[0]).shape), vector = 1;
  unsigned block = kThreads, grid = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  if (auto launch = ins.attrs.find("launch"); launch != ins.attrs.end() && launch->is_object()) {
    block = launch->value("block", unsigned(kThreads));
    grid = launch->value("grid", grid);
    vector = launch->value("vector", int64_t(1));
    if (vector < 1 || vector > 8 || n % vector)
      fail(LOOM_INVALID_BUNDLE, where, ": launch vector ", vector, " does not divide ", n, " elements");
    if (block == 0 || uint64_t(block) * grid * uint64_t(vector) < uint64_t(n))
      fail(LOOM_INVALID_BUNDLE, where, ": launch ", grid, " x ", block, " x ", vector, " does not cover ", n,
           " elements");
  }
  requireVectorAligned({&ins.in, &ins.out}, vector);
  return [=](cudaStream_t s) { launchGenerated(fn, grid, block, pointers, s); };
}

void CudaBackendImpl::addGeneratedBuilders(BuilderTable &table) { table["fused"] = &CudaBackendImpl::buildFused; }

} // namespace loom::rt::cuda

namespace loom::rt {

#ifdef LOOM_HAVE_NCCL
void checkNccl(ncclResult_t r, const char *what, const char *file, int line) {
  if (r != ncclSuccess && r != ncclInProgress)
    fail(r == ncclInvalidUsage || r == ncclInvalidArgument ? LOOM_INVALID_BUNDLE : LOOM_INTERNAL, file,
         ":", line, ": ", what, " failed: ", ncclGetErrorString(r), " (", ncclGetLastError(nullptr),
         "); NCCL_DEBUG=WARN says more");
}
#define LOOM_NCCL_CHECK(expr) checkNccl((expr), #expr, __FILE__, __LINE__)

void NcclWorld::createAll(const std::vector<std::vector<int>> &lists, int self, Communicator *bootstrap,
               std::vector<std::map<int, ncclComm_t> *> targets) {
  std::vector<ncclUniqueId> ids(lists.size());
  for (size_t g = 0; g < lists.size(); ++g) {
    if (self < 0 || self == lists[g][0])
      LOOM_NCCL_CHECK(ncclGetUniqueId(&ids[g]));
    if (self >= 0)
      bootstrap->broadcastBytes(self, lists[g][0], &ids[g], sizeof(ncclUniqueId));
  }
  struct Pending {
    size_t list;
    int member;
    ncclComm_t comm;
  };
  std::vector<Pending> pending;
  for (size_t g = 0; g < lists.size(); ++g)
    for (size_t i = 0; i < lists[g].size(); ++i)
      if (self < 0 || lists[g][i] == self)
        pending.push_back({g, lists[g][i], nullptr});
  LOOM_NCCL_CHECK(ncclGroupStart());
  for (Pending &p : pending) {
    const std::vector<int> &members = lists[p.list];
    int index = int(std::find(members.begin(), members.end(), p.member) - members.begin());
    LOOM_CUDA_CHECK(cudaSetDevice(devices[p.member]));
    LOOM_NCCL_CHECK(ncclCommInitRank(&p.comm, int(members.size()), ids[p.list], index));
  }
  LOOM_NCCL_CHECK(ncclGroupEnd());
  for (Pending &p : pending)
    (*targets[p.list])[p.member] = p.comm;
}
#endif

NcclWorld::~NcclWorld() {
#ifdef LOOM_HAVE_NCCL
  for (auto *table : {&groups})
    for (auto &[m, comms] : *table)
      for (auto &[r, c] : comms)
        aborted ? ncclCommAbort(c) : ncclCommDestroy(c);
  for (auto &[m, comms] : links)
    for (auto &[r, c] : comms)
      aborted ? ncclCommAbort(c) : ncclCommDestroy(c);
#endif
}

std::shared_ptr<NcclWorld> makeNcclWorld(const Manifest &m, const std::vector<int> &devices, int self,
                                         Communicator *bootstrap) {
#ifndef LOOM_HAVE_NCCL
  (void)m, (void)devices, (void)self, (void)bootstrap;
  fail(LOOM_UNSUPPORTED, "this runtime was built without NCCL (nccl.h was not found when it was "
       "configured), so multi-GPU bundles cannot run; install NCCL and rebuild, or use --backend cpu");
#else
  if (devices.size() < m.ranks.size())
    fail(LOOM_INVALID_ARGUMENT, "the bundle has ", m.ranks.size(), " ranks but only ", devices.size(),
         " GPUs are given");
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0)
    fail(LOOM_UNSUPPORTED, "no usable CUDA device for this ", m.ranks.size(), "-rank bundle (cudaGetDeviceCount: ",
         e == cudaSuccess ? "0 devices" : cudaGetErrorString(e),
         "); check nvidia-smi and CUDA_VISIBLE_DEVICES, or run it on CPU ranks with --backend cpu");
  for (size_t r = 0; r < devices.size(); ++r)
    if (int d = devices[r]; (self < 0 || int(r) == self) && (d < 0 || d >= count))
      fail(LOOM_INVALID_ARGUMENT, "the bundle has ", m.ranks.size(), " ranks, one per GPU, but ", count,
           " GPU(s) are visible; run it on a machine with ", m.ranks.size(),
           " GPUs, or compile for fewer ranks");
  auto world = std::make_shared<NcclWorld>();
  world->devices = devices;
  std::set<std::vector<int>> groups;
  std::set<std::pair<int, int>> links;
  for (const RankProgram &r : m.ranks) {
    for (const auto &[name, members] : r.groups)
      if (members.size() > 1)
        groups.insert(std::vector<int>(members.begin(), members.end()));
    for (const auto &[name, list] : r.programs)
      for (const Instruction &ins : list)
        if (ins.op == "send")
          links.insert({int(r.rank), int(ins.attrs.value("peer", int64_t(-1)))});
  }
  // NCCL matches a link's sends and receives in order: both sides must list
  // the same transfers in the same order.
  for (auto [from, to] : links) {
    std::vector<int64_t> sent, received;
    for (const auto &[name, list] : m.ranks[from].programs)
      for (const Instruction &ins : list)
        if (ins.op == "send" && ins.attrs.value("peer", int64_t(-1)) == to)
          sent.push_back(ins.attrs.value("tag", int64_t(0)));
    for (const auto &[name, list] : m.ranks[to].programs)
      for (const Instruction &ins : list)
        if (ins.op == "recv" && ins.attrs.value("peer", int64_t(-1)) == from)
          received.push_back(ins.attrs.value("tag", int64_t(0)));
    if (sent != received)
      fail(LOOM_UNSUPPORTED, "rank ", from, " sends to rank ", to, " in an order that rank ", to,
           " does not receive in (NCCL matches transfers in order); this schedule runs on CPU "
           "ranks only for now: use 1f1b or gpipe on GPUs");
  }
  std::vector<std::vector<int>> lists;
  std::vector<std::map<int, ncclComm_t> *> targets;
  for (const auto &g : groups)
    lists.push_back(g), targets.push_back(&world->groups[g]);
  for (auto [from, to] : links)
    lists.push_back({from, to}), targets.push_back(&world->links[{from, to}]);
  world->createAll(lists, self, bootstrap, targets);
  return world;
#endif
}

void abortNcclWorld(NcclWorld &world) {
  world.aborted = true;
#ifdef LOOM_HAVE_NCCL
  for (auto &[m, comms] : world.groups)
    for (auto &[r, c] : comms)
      ncclCommAbort(c), c = nullptr;
  for (auto &[m, comms] : world.links)
    for (auto &[r, c] : comms)
      ncclCommAbort(c), c = nullptr;
  world.groups.clear();
  world.links.clear();
#endif
}

} // namespace loom::rt

namespace loom::rt::cuda {

namespace {

__global__ void toFloatKernel(const double *acc, float *out) { *out = static_cast<float>(*acc); }
__global__ void sqrtFloatKernel(float *x) { *x = sqrtf(*x); }

} // namespace

cudaEvent_t CudaBackendImpl::commEvent(int64_t id) {
  cudaEvent_t &e = commEvents[id];
  if (!e)
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

Launch CudaBackendImpl::buildEventWait(const Instruction &ins) {
  buildCapturable = false;
  if (!ins.attrs.contains("event") || !ins.attrs["event"].is_number_integer())
    fail(LOOM_INVALID_BUNDLE, where, ": event_wait needs an integer attribute 'event'");
  cudaEvent_t e = commEvent(ins.attrs["event"].get<int64_t>());
  return [=](cudaStream_t s) { LOOM_CUDA_CHECK(cudaStreamWaitEvent(s, e, 0)); };
}

Launch CudaBackendImpl::buildCommunication(const Instruction &ins) {
  buildCapturable = false; // NCCL and the second stream stay outside graphs for now
#ifndef LOOM_HAVE_NCCL
  fail(LOOM_UNSUPPORTED, where, ": this runtime was built without NCCL; use --backend cpu");
#else
  const std::string &op = ins.op;
  auto n = [&](int64_t id) { return count(buf(id).shape); };
  auto n_ = n;
  // The communicator of a named group (null for a group of one).
  auto commOf = [&](const std::string &name) -> ncclComm_t {
    auto g = rank.groups.find(name);
    if (g == rank.groups.end())
      fail(LOOM_INVALID_BUNDLE, where, ": names group '", name, "', which this rank does not have");
    if (g->second.size() < 2)
      return nullptr;
    if (!world)
      fail(LOOM_UNSUPPORTED, where, ": multi-rank bundles need every rank started together (loom-run)");
    return world->groups.at(std::vector<int>(g->second.begin(), g->second.end())).at(int(rank.rank));
  };
  std::string group = ins.attrs.value("group", std::string("dp"));
  if (op == "all_reduce") {
    std::string kind = ins.attrs.value("reduction", std::string("sum"));
    ncclRedOp_t red = kind == "max" ? ncclMax : kind == "mean" ? ncclAvg : ncclSum;
    ncclComm_t comm = commOf(group);
    std::vector<std::tuple<char *, char *, int64_t, ncclDataType_t, int64_t>> parts;
    for (size_t i = 0; i < ins.in.size(); ++i)
      parts.push_back({ptr(fp(ins.in[i])), ptr(fp(ins.out[i])), n(ins.in[i]), ncclType(ins.in[i]), buf(ins.in[i]).bytes});
    auto reduce = [=](cudaStream_t s) {
      for (auto [in, out, cnt, type, bytes] : parts)
        if (in != out)
          LOOM_CUDA_CHECK(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, s));
      if (!comm)
        return;
      LOOM_NCCL_CHECK(ncclGroupStart()); // a bucket goes out as one group
      for (auto [in, out, cnt, type, bytes] : parts)
        LOOM_NCCL_CHECK(ncclAllReduce(out, out, size_t(cnt), type, red, comm, s));
      LOOM_NCCL_CHECK(ncclGroupEnd());
    };
    bool async = flag(ins, "async") && ins.attrs.contains("event") && ins.attrs["event"].is_number_integer();
    if (!async)
      return reduce;
    // On the communication stream, overlapped with the compute that follows:
    // the bundle guarantees nothing touches the bucket until its event_wait.
    cudaEvent_t done = commEvent(ins.attrs["event"].get<int64_t>()), ready;
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    readyEvents.push_back(ready);
    cudaStream_t cs = commStream;
    return [=](cudaStream_t s) {
      LOOM_CUDA_CHECK(cudaEventRecord(ready, s));
      LOOM_CUDA_CHECK(cudaStreamWaitEvent(cs, ready, 0));
      reduce(cs);
      LOOM_CUDA_CHECK(cudaEventRecord(done, cs));
    };
  }
  // ZeRO-1: slice `index` of k = ceil(n / parts) elements of each tensor.
  auto place = [&]() {
    const std::vector<int64_t> &members = rank.groups.at(group);
    int64_t index = std::find(members.begin(), members.end(), rank.rank) - members.begin();
    return std::make_pair(index, int64_t(members.size()));
  };
  if (op == "shard_of") {
    auto [index, parts] = place();
    float *in = f(ins.in[0]), *out = f(ins.out[0]);
    int64_t n = n_(ins.in[0]), k = n_(ins.out[0]), begin = index * k;
    int64_t have = std::max<int64_t>(0, std::min(k, n - begin));
    return [=](cudaStream_t s) {
      if (have > 0)
        LOOM_CUDA_CHECK(cudaMemcpyAsync(out, in + begin, have * sizeof(float), cudaMemcpyDeviceToDevice, s));
      if (have < k)
        LOOM_CUDA_CHECK(cudaMemsetAsync(out + have, 0, (k - have) * sizeof(float), s));
    };
  }
  if (op == "reduce_scatter") {
    auto [index, partCount] = place();
    int64_t parts = partCount; // a plain variable: lambdas capture it (C++17)
    ncclComm_t comm = commOf(group);
    bool mean = ins.attrs.value("reduction", std::string("mean")) == "mean";
    std::vector<std::tuple<float *, float *, int64_t, int64_t>> list;
    size_t widest = 0;
    for (size_t i = 0; i < ins.in.size(); ++i) {
      int64_t n = n_(ins.in[i]), k = n_(ins.out[i]);
      list.push_back({f(ins.in[i]), f(ins.out[i]), n, k});
      widest = std::max<size_t>(widest, size_t(k * parts));
    }
    reserve(widest * sizeof(float));
    int64_t self = index;
    return [=](cudaStream_t s) {
      float *padded = reinterpret_cast<float *>(workspace);
      for (auto [in, out, n, k] : list) { // one at a time through the padded workspace
        LOOM_CUDA_CHECK(cudaMemcpyAsync(padded, in, n * sizeof(float), cudaMemcpyDeviceToDevice, s));
        if (k * parts > n)
          LOOM_CUDA_CHECK(cudaMemsetAsync(padded + n, 0, (k * parts - n) * sizeof(float), s));
        if (comm)
          LOOM_NCCL_CHECK(ncclReduceScatter(padded, out, size_t(k), ncclFloat32, mean ? ncclAvg : ncclSum, comm, s));
        else
          LOOM_CUDA_CHECK(cudaMemcpyAsync(out, padded + self * k, k * sizeof(float), cudaMemcpyDeviceToDevice, s));
      }
    };
  }
  if (op == "all_gather" && ins.attrs.contains("axis")) { // parts along an axis, in group order
    auto [index, parts] = place();
    (void)index;
    ncclComm_t comm = commOf(ins.attrs.value("group", std::string("tp")));
    const Shape &in = buf(ins.in[0]).shape;
    int64_t axis = ins.attrs.at("axis").get<int64_t>();
    axis = axis < 0 ? axis + int64_t(in.size()) : axis;
    int64_t outer = 1, inner = 1;
    for (int64_t d = 0; d < axis; ++d)
      outer *= in[d];
    for (size_t d = axis; d < in.size(); ++d)
      inner *= in[d];
    float *src = f(ins.in[0]), *dst = f(ins.out[0]);
    reserve(size_t(outer * inner * parts) * sizeof(float));
    int64_t count = parts;
    return [=](cudaStream_t s) {
      float *whole = reinterpret_cast<float *>(workspace); // [parts][outer][inner]
      if (comm)
        LOOM_NCCL_CHECK(ncclAllGather(src, whole, size_t(outer * inner), ncclFloat32, comm, s));
      else
        LOOM_CUDA_CHECK(cudaMemcpyAsync(whole, src, outer * inner * sizeof(float), cudaMemcpyDeviceToDevice, s));
      for (int64_t r = 0; r < count; ++r) // into [outer][parts][inner]
        LOOM_CUDA_CHECK(cudaMemcpy2DAsync(dst + r * inner, count * inner * sizeof(float), whole + r * outer * inner,
                                          inner * sizeof(float), inner * sizeof(float), outer,
                                          cudaMemcpyDeviceToDevice, s));
    };
  }
  if (op == "all_gather") { // pairs of slice and whole tensor, gathered as one NCCL group
    auto [index, parts] = place();
    ncclComm_t comm = commOf(group);
    std::vector<std::tuple<float *, float *, int64_t, int64_t, int64_t>> list; // in, out, k, n, offset
    int64_t total = 0;
    for (size_t i = 0; i < ins.in.size(); ++i) {
      int64_t k = n_(ins.in[i]), n = n_(ins.out[i]);
      list.push_back({f(ins.in[i]), f(ins.out[i]), k, n, total});
      total += k * parts;
    }
    reserve(size_t(total) * sizeof(float));
    int64_t self = index;
    return [=](cudaStream_t s) {
      float *whole = reinterpret_cast<float *>(workspace);
      if (comm) {
        LOOM_NCCL_CHECK(ncclGroupStart());
        for (auto [in, out, k, n, offset] : list)
          LOOM_NCCL_CHECK(ncclAllGather(in, whole + offset, size_t(k), ncclFloat32, comm, s));
        LOOM_NCCL_CHECK(ncclGroupEnd());
      } else {
        for (auto [in, out, k, n, offset] : list)
          LOOM_CUDA_CHECK(cudaMemcpyAsync(whole + offset + self * k, in, k * sizeof(float),
                                          cudaMemcpyDeviceToDevice, s));
      }
      for (auto [in, out, k, n, offset] : list)
        LOOM_CUDA_CHECK(cudaMemcpyAsync(out, whole + offset, n * sizeof(float), cudaMemcpyDeviceToDevice, s));
    };
  }
  if (op == "broadcast_from") {
    ncclComm_t comm = commOf(group);
    int root = int(ins.attrs.value("root", int64_t(0)));
    char *x = ptr(fp(ins.in[0]));
    int64_t cnt = n(ins.in[0]);
    ncclDataType_t type = ncclType(ins.in[0]);
    return [=](cudaStream_t s) {
      if (comm)
        LOOM_NCCL_CHECK(ncclBroadcast(x, x, size_t(cnt), type, root, comm, s));
    };
  }
  if (op == "send" || op == "recv") {
    int peer = int(ins.attrs.value("peer", int64_t(-1)));
    int self = int(rank.rank);
    std::pair<int, int> link = op == "send" ? std::make_pair(self, peer) : std::make_pair(peer, self);
    if (!world || !world->links.count(link))
      fail(LOOM_INVALID_BUNDLE, where, ": no transfer link from rank ", link.first, " to ", link.second);
    ncclComm_t comm = world->links.at(link).at(self);
    int other = link.first == self ? 1 : 0; // the peer's index in the 2-rank link (from 0, to 1)
    if (op == "recv") {
      char *dst = ptr(buf(ins.out[0]));
      int64_t bytes = buf(ins.out[0]).bytes;
      return [=](cudaStream_t s) { LOOM_NCCL_CHECK(ncclRecv(dst, size_t(bytes), ncclUint8, other, comm, s)); };
    }
    const char *src = ptr(buf(ins.in[0]));
    int64_t bytes = buf(ins.in[0]).bytes;
    Staging &slot = staging.emplace_back();
    LOOM_CUDA_CHECK(cudaMalloc(&slot.data, std::max<int64_t>(bytes, 1)));
    slot.bytes = bytes;
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&slot.sent, cudaEventDisableTiming));
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&slot.copied, cudaEventDisableTiming));
    Staging *copy = &slot; // a deque's elements stay where they are
    return [=](cudaStream_t s) {
      if (copy->used)
        LOOM_CUDA_CHECK(cudaStreamWaitEvent(s, copy->sent, 0)); // its last send is done
      copy->used = true;
      LOOM_CUDA_CHECK(cudaMemcpyAsync(copy->data, src, bytes, cudaMemcpyDeviceToDevice, s));
      LOOM_CUDA_CHECK(cudaEventRecord(copy->copied, s));
      LOOM_CUDA_CHECK(cudaStreamWaitEvent(sendStream, copy->copied, 0));
      LOOM_NCCL_CHECK(ncclSend(copy->data, size_t(bytes), ncclUint8, other, comm, sendStream));
      LOOM_CUDA_CHECK(cudaEventRecord(copy->sent, sendStream));
    };
  }
  if (op == "global_norm") {
    ncclComm_t comm = commOf(group);
    std::set<int64_t> skip;
    if (ins.attrs.contains("skip"))
      for (auto &v : ins.attrs.at("skip"))
        skip.insert(v.get<int64_t>());
    Launch squares = buildSumOfSquares(ins, skip);
    float *out = f(ins.out[0]);
    return [=](cudaStream_t s) {
      squares(s);
      toFloatKernel<<<1, 1, 0, s>>>(reinterpret_cast<double *>(workspace), out);
      if (comm)
        LOOM_NCCL_CHECK(ncclAllReduce(out, out, 1, ncclFloat32, ncclSum, comm, s));
      sqrtFloatKernel<<<1, 1, 0, s>>>(out);
    };
  }
  // Vocabulary-parallel cross-entropy and its gradient.
  const Buffer &logits = buf(ins.in[0]), &targets = buf(ins.in[1]);
  int64_t v = logits.shape.back(), rows = count(targets.shape), parts = 1;
  int64_t start = startOf(ins, v, parts), full = v * parts;
  ncclComm_t comm = commOf(ins.attrs.at("vocab_group").get<std::string>());
  bool wide = targets.dtype == LOOM_I64;
  void *pt = ptr(targets);
  DPtr pl = fp(ins.in[0]);
  long long *err = errorWord;
  bool grad = op == "cross_entropy_grad";
  float *dl = grad ? f(ins.in[2]) : nullptr;
  DPtr out = fp(ins.out[0]);
  reserve(4 * rows * sizeof(float));
  return [=](cudaStream_t s) {
    float *rowMax = reinterpret_cast<float *>(workspace), *stats = rowMax + rows, *rowLoss = stats + 2 * rows;
    rowMaxKernel<<<int(rows), kThreads, 0, s>>>(pl, rowMax, v);
    if (comm)
      LOOM_NCCL_CHECK(ncclAllReduce(rowMax, rowMax, size_t(rows), ncclFloat32, ncclMax, comm, s));
    rowSumTargetKernel<<<int(rows), kThreads, 0, s>>>(pl, pt, wide, rowMax, stats, rows, v, start, full, err);
    if (comm)
      LOOM_NCCL_CHECK(ncclAllReduce(stats, stats, size_t(2 * rows), ncclFloat32, ncclSum, comm, s));
    if (grad) {
      splitCrossEntropyGradKernel<<<int(rows), kThreads, 0, s>>>(pl, pt, wide, rowMax, stats, dl, out, rows, v, start);
    } else {
      splitLossRowsKernel<<<blocksFor(rows), kThreads, 0, s>>>(rowMax, stats, rowLoss, rows);
      meanKernel<<<1, 1024, 0, s>>>(rowLoss, rows, static_cast<float *>(out.p));
    }
  };
#endif
}

void CudaBackendImpl::addCollectiveBuilders(BuilderTable &table) {
  for (const char *op : {"all_reduce", "broadcast_from", "send", "recv", "reduce_scatter", "all_gather", "shard_of"})
    table[op] = &CudaBackendImpl::buildCommunication;
  table["event_wait"] = &CudaBackendImpl::buildEventWait;
}

} // namespace loom::rt::cuda

namespace loom::rt::cuda {

void CudaBackendImpl::dropGraphs() {
  for (auto &[name, g] : graphs)
    if (g.exec)
      cudaGraphExecDestroy(g.exec), g.exec = nullptr;
}

bool CudaBackendImpl::graphsWanted() {
  static const bool on = [] {
    const char *e = std::getenv("LOOM_CUDA_GRAPHS");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

void CudaBackendImpl::launchEager(std::vector<Step> &steps) {
  for (Step &step : steps) {
    if (profiling) {
      if (!step.start) {
        LOOM_CUDA_CHECK(cudaEventCreate(&step.start));
        LOOM_CUDA_CHECK(cudaEventCreate(&step.end));
      }
      LOOM_CUDA_CHECK(cudaEventRecord(step.start, stream));
    }
    step.launch(stream);
    cudaError_t e = cudaPeekAtLastError();
    if (e != cudaSuccess)
      fail(LOOM_INTERNAL, step.what, ": kernel launch failed: ", cudaGetErrorString(e));
    if (profiling)
      LOOM_CUDA_CHECK(cudaEventRecord(step.end, stream));
  }
}

bool CudaBackendImpl::captureAndLaunch(std::vector<Step> &steps, Graph &g) {
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    cudaGetLastError();
    g.disabled = true;
    return false;
  }
  bool launched = true;
  try {
    for (Step &step : steps)
      step.launch(stream);
  } catch (const Error &) {
    launched = false;
  }
  cudaGraph_t graph = nullptr;
  cudaError_t e = cudaStreamEndCapture(stream, &graph);
  if (launched && e == cudaSuccess && graph && cudaGraphInstantiate(&g.exec, graph, 0) == cudaSuccess &&
      cudaGraphLaunch(g.exec, stream) == cudaSuccess) {
    cudaGraphDestroy(graph);
    return true;
  }
  if (graph)
    cudaGraphDestroy(graph);
  if (g.exec)
    cudaGraphExecDestroy(g.exec), g.exec = nullptr;
  cudaGetLastError(); // the failed capture's error is not the program's
  g.disabled = true;
  return false;
}

} // namespace loom::rt::cuda
