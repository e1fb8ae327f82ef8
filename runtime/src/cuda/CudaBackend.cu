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
                             int64_t d, double theta, float sign) {
  GRID_LOOP(p, pairs) {
    int64_t at = p * 2, pos = (at / w) % s, i = (at % d) / 2;
    float angle = sign * pos * static_cast<float>(pow(theta, -2.0 * i / d));
    float cs = cosf(angle), sn = sinf(angle), x0 = x[at], x1 = x[at + 1];
    y.st(at, x0 * cs - x1 * sn);
    y.st(at + 1, x0 * sn + x1 * cs);
  }
}

//===--- Vectorised elementwise kernels -----------------------------------===//
// 16-byte loads and stores (8 bf16 or 4 f32 per thread) and 32-bit index
// arithmetic, for operands of one dtype whose sizes and addresses allow it
// (the host checks); the general kernels above handle everything else.

template <typename T> __device__ inline float toF(T v);
template <> __device__ inline float toF(float v) { return v; }
template <> __device__ inline float toF(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ inline T fromF(float v);
template <> __device__ inline float fromF(float v) { return v; }
template <> __device__ inline __nv_bfloat16 fromF(float v) { return __float2bfloat16_rn(v); }
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
  return [=](cudaStream_t s) { rotaryKernel<<<blocksFor(pairs), kThreads, 0, s>>>(px, y, pairs, sLen, w, d, theta, sign); };
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

namespace loom::rt::cuda {
namespace {

/// out[i] = in[base + offset(i)]: slices, transposes, broadcasts (E: an
/// unsigned integer as wide as an element).
template <typename E> __global__ void gatherKernel(const E *in, E *out, int64_t n, int64_t base, Strided s) {
  GRID_LOOP(i, n) {
    int64_t oa, ob;
    offsets(s, i, oa, ob);
    out[i] = in[base + oa];
  }
}

/// Rows [start, start + vocab) of a vocabulary of `full` ids live here (the
/// whole table unless tensor parallelism splits it): other ids give zeros.
__global__ void embeddingKernel(DPtr table, const void *ids, bool wide, DPtr y, int64_t n,
                                int64_t h, int64_t vocab, long long *err, int64_t start, int64_t full) {
  GRID_LOOP(i, n * h) {
    int64_t t = i / h, id = readIndex(ids, wide, t);
    if (id < 0 || id >= full) {
      raise(err, 1, t, id);
      continue;
    }
    int64_t row = id - start;
    y.st(i, row >= 0 && row < vocab ? table[row * h + i % h] : 0.0f);
  }
}

__global__ void embeddingGradKernel(const void *ids, bool wide, DPtr dy, float *dt, int64_t n,
                                    int64_t h, int64_t vocab, long long *err, int64_t start, int64_t full) {
  GRID_LOOP(i, n * h) {
    int64_t t = i / h, id = readIndex(ids, wide, t);
    if (id < 0 || id >= full) {
      raise(err, 1, t, id);
      continue;
    }
    int64_t row = id - start;
    if (row >= 0 && row < vocab)
      atomicAdd(&dt[row * h + i % h], dy[i]);
  }
}

} // namespace

Launch CudaBackendImpl::buildSliceOrConcat(const Instruction &ins) {
  const std::string &op = ins.op;
  const Buffer &x = buf(ins.in[0]), &o = buf(ins.out[0]);
  const Buffer &whole = op == "slice" ? x : o;
  int64_t axis = axisOf(ins, "axis", whole.shape.size(), 0);
  int64_t outer = 1, inner = dtypeSize(whole.dtype);
  for (int64_t d = 0; d < axis; ++d)
    outer *= whole.shape[d];
  for (size_t d = axis + 1; d < whole.shape.size(); ++d)
    inner *= whole.shape[d];
  int64_t dim = whole.shape[axis], pitch = dim * inner;
  char *po = ptr(o);
  if (op == "slice") {
    int64_t start = static_cast<int64_t>(num(ins, "start", 0)), width = o.shape[axis] * inner;
    char *pi = ptr(x) + start * inner;
    return [=](cudaStream_t s) {
      LOOM_CUDA_CHECK(cudaMemcpy2DAsync(po, width, pi, pitch, width, outer, cudaMemcpyDeviceToDevice, s));
    };
  }
  std::vector<std::tuple<char *, int64_t, int64_t>> parts; // source, first byte of a row, width
  int64_t offset = op == "slice_grad" ? static_cast<int64_t>(num(ins, "start", 0)) : 0;
  for (int64_t id : ins.in) {
    const Buffer &part = buf(id);
    if (part.dtype != o.dtype)
      fail(LOOM_INVALID_BUNDLE, where, ": joins ", dtypeName(part.dtype), " into ", dtypeName(o.dtype));
    parts.push_back({ptr(part), offset * inner, part.shape[axis] * inner});
    offset += part.shape[axis];
  }
  // A slice's gradient is zero outside the slice: clear only that.
  int64_t start = std::get<1>(parts.front()), end = start + std::get<2>(parts.front());
  bool grad = op == "slice_grad";
  return [=](cudaStream_t s) {
    if (grad && start > 0)
      LOOM_CUDA_CHECK(cudaMemset2DAsync(po, pitch, 0, start, outer, s));
    if (grad && end < pitch)
      LOOM_CUDA_CHECK(cudaMemset2DAsync(po + end, pitch, 0, pitch - end, outer, s));
    for (auto [src, at, width] : parts)
      LOOM_CUDA_CHECK(cudaMemcpy2DAsync(po + at, pitch, src, width, width, outer, cudaMemcpyDeviceToDevice, s));
  };
}

Launch CudaBackendImpl::buildTransposeOrBroadcast(const Instruction &ins) {
  const std::string &op = ins.op;
  const Buffer &x = buf(ins.in[0]), &o = buf(ins.out[0]);
  std::vector<int64_t> st;
  int64_t base = 0;
  if (op == "transpose") {
    std::vector<int64_t> in = stridesOf(x.shape);
    for (auto &p : ins.attrs.at("permutation"))
      st.push_back(in[p.get<int64_t>()]);
  } else {
    st = broadcastTo(x.shape, o.shape);
  }
  Strided sd = strided(o.shape, st);
  char *pi = ptr(x), *po = ptr(o);
  int64_t cnt = count(o.shape);
  int64_t size = dtypeSize(x.dtype);
  return [=](cudaStream_t s) {
    if (size == 2)
      gatherKernel<<<blocksFor(cnt), kThreads, 0, s>>>(reinterpret_cast<uint16_t *>(pi), reinterpret_cast<uint16_t *>(po), cnt, base, sd);
    else if (size == 4)
      gatherKernel<<<blocksFor(cnt), kThreads, 0, s>>>(reinterpret_cast<uint32_t *>(pi), reinterpret_cast<uint32_t *>(po), cnt, base, sd);
    else
      gatherKernel<<<blocksFor(cnt), kThreads, 0, s>>>(reinterpret_cast<uint64_t *>(pi), reinterpret_cast<uint64_t *>(po), cnt, base, sd);
  };
}

Launch CudaBackendImpl::buildEmbedding(const Instruction &ins) {
  const std::string &op = ins.op;
  bool grad = op == "embedding_grad";
  const Buffer &table = grad ? buf(ins.out[0]) : buf(ins.in[0]), &ids = grad ? buf(ins.in[0]) : buf(ins.in[1]);
  int64_t vocab = table.shape[0], h = table.shape[1], cnt = count(ids.shape);
  bool wide = ids.dtype == LOOM_I64;
  void *pid = ptr(ids);
  long long *err = errorWord;
  int64_t parts = 1, start = startOf(ins, vocab, parts), full = vocab * parts;
  if (!grad) {
    DPtr pt = fp(ins.in[0]), y = fp(ins.out[0]);
    return [=](cudaStream_t s) { embeddingKernel<<<blocksFor(cnt * h), kThreads, 0, s>>>(pt, pid, wide, y, cnt, h, vocab, err, start, full); };
  }
  // Accumulates in f32 (in the workspace for a bf16 table), rounding once.
  DPtr dy = fp(ins.in[1]), dt = fp(ins.out[0]);
  if (dt.bf)
    reserve(size_t(vocab * h) * sizeof(float));
  return [=](cudaStream_t s) {
    float *acc = dt.bf ? reinterpret_cast<float *>(workspace) : static_cast<float *>(dt.p);
    LOOM_CUDA_CHECK(cudaMemsetAsync(acc, 0, vocab * h * sizeof(float), s));
    embeddingGradKernel<<<blocksFor(cnt * h), kThreads, 0, s>>>(pid, wide, dy, acc, cnt, h, vocab, err, start, full);
    if (dt.bf)
      castKernel<<<blocksFor(vocab * h), kThreads, 0, s>>>(DPtr{acc, false}, dt, vocab * h);
  };
}

void CudaBackendImpl::addLayoutBuilders(BuilderTable &table) {
  for (const char *op : {"slice", "slice_grad", "concat"})
    table[op] = &CudaBackendImpl::buildSliceOrConcat;
  for (const char *op : {"transpose", "broadcast"})
    table[op] = &CudaBackendImpl::buildTransposeOrBroadcast;
  for (const char *op : {"embedding", "embedding_grad"})
    table[op] = &CudaBackendImpl::buildEmbedding;
}

} // namespace loom::rt::cuda

namespace loom::rt::cuda {
namespace {

/// Column sums of a [rows, cols] matrix in two deterministic passes: each
/// block sums a chunk of rows for 32 columns into `partial[chunk][col]`.
__global__ void columnPartialKernel(DPtr x, const float *mean, const float *rstd,
                                    DPtr dy, float *partial, float *partialB, int64_t rows,
                                    int64_t cols, int64_t rowsPerChunk) {
  __shared__ float tile[8][33], tileB[8][33];
  int64_t col = blockIdx.x * 32 + threadIdx.x, chunk = blockIdx.y;
  int64_t r0 = chunk * rowsPerChunk, r1 = min(rows, r0 + rowsPerChunk);
  float acc = 0, accB = 0;
  if (col < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      if (dy) { // norm parameter gradients: sum dy * xhat and dy
        float d = dy[r * cols + col];
        acc += d * (x[r * cols + col] - mean[r]) * rstd[r];
        accB += d;
      } else {
        acc += x[r * cols + col];
      }
    }
  tile[threadIdx.y][threadIdx.x] = acc;
  tileB[threadIdx.y][threadIdx.x] = accB;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float s = 0, sb = 0;
    for (int k = 0; k < 8; ++k)
      s += tile[k][threadIdx.x], sb += tileB[k][threadIdx.x];
    partial[chunk * cols + col] = s;
    if (partialB)
      partialB[chunk * cols + col] = sb;
  }
}
__global__ void columnFinishKernel(const float *partial, DPtr out, int64_t chunks, int64_t cols, float scale) {
  GRID_LOOP(c, cols) {
    float s = 0;
    for (int64_t k = 0; k < chunks; ++k)
      s += partial[k * cols + c];
    out.st(c, s * scale);
  }
}

/// One thread per output: sums (or maxes) the reduced subspace. `s` maps the
/// kept index to the input offset in .a; `r` walks the reduced dims in .a.
__global__ void reduceKernel(int op, DPtr x, DPtr y, int64_t nOut, Strided s, Strided r,
                             int64_t nRed, float scale) {
  GRID_LOOP(o, nOut) {
    int64_t base, unused;
    offsets(s, o, base, unused);
    float acc = op == 1 ? -INFINITY : 0.0f;
    for (int64_t k = 0; k < nRed; ++k) {
      int64_t off, u2;
      offsets(r, k, off, u2);
      float v = x[base + off];
      acc = op == 1 ? fmaxf(acc, v) : acc + v;
    }
    y.st(o, op == 1 ? acc : acc * scale);
  }
}

/// LayerNorm / RMSNorm over rows of h; saves mean and 1/std per row.
__global__ void normKernel(DPtr x, DPtr g, DPtr b, DPtr y, int64_t h, float eps, bool rms, float *meanOut,
                           float *rstdOut) {
  __shared__ float shared[32];
  int64_t row = blockIdx.x;
  DPtr xr = x + row * h;
  float sum = 0;
  if (!rms)
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
      sum += xr[j];
  float mean = rms ? 0.0f : blockSum(sum, shared) / h;
  float sq = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    sq += (xr[j] - mean) * (xr[j] - mean);
  float rstd = rsqrtf(blockSum(sq, shared) / h + eps);
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    y.st(row * h + j, (xr[j] - mean) * rstd * g[j] + (b.p ? b[j] : 0.0f));
  if (threadIdx.x == 0 && meanOut) {
    meanOut[row] = mean;
    rstdOut[row] = rstd;
  }
}

__global__ void normGradDxKernel(DPtr x, DPtr g, DPtr dy, DPtr dx, int64_t h, float eps, bool rms,
                                 float *meanOut, float *rstdOut) {
  __shared__ float shared[32];
  int64_t row = blockIdx.x;
  DPtr xr = x + row * h, dyr = dy + row * h;
  float sum = 0;
  if (!rms)
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
      sum += xr[j];
  float mean = rms ? 0.0f : blockSum(sum, shared) / h;
  float sq = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    sq += (xr[j] - mean) * (xr[j] - mean);
  float rstd = rsqrtf(blockSum(sq, shared) / h + eps);
  float sd = 0, sdx = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    float d = dyr[j] * g[j];
    sd += d;
    sdx += d * (xr[j] - mean) * rstd;
  }
  sd = blockSum(sd, shared);
  sdx = blockSum(sdx, shared);
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    float xh = (xr[j] - mean) * rstd, d = dyr[j] * g[j];
    dx.st(row * h + j, rstd * (d - (rms ? 0.0f : sd / h) - xh * sdx / h));
  }
  if (threadIdx.x == 0) {
    meanOut[row] = mean;
    rstdOut[row] = rstd;
  }
}

//===--- Normalisation by warps -------------------------------------------===//
// A warp per row, two adjacent elements per lane access, reductions by
// shuffles only (rows of a multiple of 64 elements; blocks of 8 rows).
/// Mean (0 for RMSNorm) and 1/std of row `xr`, for every lane.
__device__ inline void rowMoments(DPtr xr, int h, bool rms, float eps, float &mean, float &rstd) {
  int lane = threadIdx.x % 32;
  float sum = 0;
  if (!rms)
    for (int j = 2 * lane; j < h; j += 64) {
      float2 v = ld2(xr, j);
      sum += v.x + v.y;
    }
  mean = rms ? 0.0f : warpSum(sum) / h;
  float sq = 0;
  for (int j = 2 * lane; j < h; j += 64) {
    float2 v = ld2(xr, j);
    sq += (v.x - mean) * (v.x - mean) + (v.y - mean) * (v.y - mean);
  }
  rstd = rsqrtf(warpSum(sq) / h + eps);
}
__global__ void normRowsKernel(DPtr x, DPtr g, DPtr b, DPtr y, int64_t rows, int h, float eps, bool rms) {
  int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= rows)
    return;
  DPtr xr = x + row * h, yr = y + row * h;
  float mean, rstd;
  rowMoments(xr, h, rms, eps, mean, rstd);
  for (int j = 2 * (threadIdx.x % 32); j < h; j += 64) {
    float2 v = ld2(xr, j), gg = ld2(g, j), bb = b.p ? ld2(b, j) : make_float2(0, 0);
    st2(yr, j, (v.x - mean) * rstd * gg.x + bb.x, (v.y - mean) * rstd * gg.y + bb.y);
  }
}
__global__ void normGradRowsKernel(DPtr x, DPtr g, DPtr dy, DPtr dx, int64_t rows, int h, float eps, bool rms,
                                   float *meanOut, float *rstdOut) {
  int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= rows)
    return;
  int lane = threadIdx.x % 32;
  DPtr xr = x + row * h, dyr = dy + row * h, dxr = dx + row * h;
  float mean, rstd;
  rowMoments(xr, h, rms, eps, mean, rstd);
  float sd = 0, sdx = 0;
  for (int j = 2 * lane; j < h; j += 64) {
    float2 v = ld2(xr, j), d = ld2(dyr, j), gg = ld2(g, j);
    sd += d.x * gg.x + d.y * gg.y;
    sdx += d.x * gg.x * (v.x - mean) * rstd + d.y * gg.y * (v.y - mean) * rstd;
  }
  sd = warpSum(sd), sdx = warpSum(sdx);
  for (int j = 2 * lane; j < h; j += 64) {
    float2 v = ld2(xr, j), d = ld2(dyr, j), gg = ld2(g, j);
    float a = rstd * (d.x * gg.x - (rms ? 0.0f : sd / h) - (v.x - mean) * rstd * sdx / h);
    float c = rstd * (d.y * gg.y - (rms ? 0.0f : sd / h) - (v.y - mean) * rstd * sdx / h);
    st2(dxr, j, a, c);
  }
  if (lane == 0) {
    meanOut[row] = mean;
    rstdOut[row] = rstd;
  }
}
/// columnPartialKernel with two adjacent columns per thread (64 per block).
__global__ void columnPartial2Kernel(DPtr x, const float *mean, const float *rstd, DPtr dy, float *partial,
                                     float *partialB, int64_t rows, int64_t cols, int64_t rowsPerChunk) {
  __shared__ float2 tile[8][33], tileB[8][33];
  int64_t col = blockIdx.x * 64 + threadIdx.x * 2, chunk = blockIdx.y;
  int64_t r0 = chunk * rowsPerChunk, r1 = min(rows, r0 + rowsPerChunk);
  float2 acc = make_float2(0, 0), accB = make_float2(0, 0);
  if (col < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      if (dy) {
        float2 d = ld2(dy, r * cols + col), v = ld2(x, r * cols + col);
        acc.x += d.x * (v.x - mean[r]) * rstd[r];
        acc.y += d.y * (v.y - mean[r]) * rstd[r];
        accB.x += d.x;
        accB.y += d.y;
      } else {
        float2 v = ld2(x, r * cols + col);
        acc.x += v.x;
        acc.y += v.y;
      }
    }
  tile[threadIdx.y][threadIdx.x] = acc;
  tileB[threadIdx.y][threadIdx.x] = accB;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float2 sum = make_float2(0, 0), sumB = make_float2(0, 0);
    for (int k = 0; k < 8; ++k) {
      sum.x += tile[k][threadIdx.x].x, sum.y += tile[k][threadIdx.x].y;
      sumB.x += tileB[k][threadIdx.x].x, sumB.y += tileB[k][threadIdx.x].y;
    }
    partial[chunk * cols + col] = sum.x;
    partial[chunk * cols + col + 1] = sum.y;
    if (partialB) {
      partialB[chunk * cols + col] = sumB.x;
      partialB[chunk * cols + col + 1] = sumB.y;
    }
  }
}

//===--- bf16 rows and columns with 16-byte accesses ----------------------===//
// Eight bf16 per access. Norms keep a warp's row in registers (h = 256 P,
// P <= MaxP) so x is read once; column sums give each thread eight columns.
/// Mean (0 for RMSNorm) and 1/std of a warp's row held in registers.
template <int MaxP>
__device__ inline void registerRowMoments(const float (&v)[MaxP][8], int P, int h, bool rms, float eps, float &mean,
                                          float &rstd) {
  float sum = 0, sq = 0;
#pragma unroll
  for (int k = 0; k < MaxP; ++k)
    if (k < P)
#pragma unroll
      for (int e = 0; e < 8; ++e)
        sum += v[k][e];
  mean = rms ? 0.0f : warpSum(sum) / h;
#pragma unroll
  for (int k = 0; k < MaxP; ++k)
    if (k < P)
#pragma unroll
      for (int e = 0; e < 8; ++e)
        sq += (v[k][e] - mean) * (v[k][e] - mean);
  rstd = rsqrtf(warpSum(sq) / h + eps);
}

template <int MaxP>
__global__ void __launch_bounds__(256) normRowsBf16Kernel(const bf16 *x, DPtr g, DPtr b, bf16 *y, int64_t rows,
                                                          int P, float eps, bool rms) {
  int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= rows)
    return;
  int lane = threadIdx.x % 32, h = 256 * P;
  const bf16 *xr = x + row * h;
  float v[MaxP][8];
#pragma unroll
  for (int k = 0; k < MaxP; ++k)
    if (k < P) {
      Pack<bf16> pk = load(xr + (k * 32 + lane) * 8);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        v[k][e] = __bfloat162float(pk.v[e]);
    }
  float mean, rstd;
  registerRowMoments<MaxP>(v, P, h, rms, eps, mean, rstd);
#pragma unroll
  for (int k = 0; k < MaxP; ++k)
    if (k < P) {
      int64_t j = (k * 32 + lane) * 8;
      float gg[8], bb[8] = {0, 0, 0, 0, 0, 0, 0, 0}, o[8];
      load8(g, j, gg);
      if (b)
        load8(b, j, bb);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        o[e] = (v[k][e] - mean) * rstd * gg[e] + bb[e];
      store8(y + row * h + j, o);
    }
}

template <int MaxP>
__global__ void __launch_bounds__(256) normGradRowsBf16Kernel(const bf16 *x, DPtr g, const bf16 *dy, bf16 *dx,
                                                              int64_t rows, int P, float eps, bool rms,
                                                              float *meanOut, float *rstdOut,
                                                              const bf16 *res = nullptr) {
  int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= rows)
    return;
  int lane = threadIdx.x % 32, h = 256 * P;
  float v[MaxP][8], d[MaxP][8];
#pragma unroll
  for (int k = 0; k < MaxP; ++k)
    if (k < P) {
      int64_t j = row * h + (k * 32 + lane) * 8;
      Pack<bf16> px = load(x + j), pd = load(dy + j);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        v[k][e] = __bfloat162float(px.v[e]), d[k][e] = __bfloat162float(pd.v[e]);
    }
  float mean, rstd, sd = 0, sdx = 0;
  registerRowMoments<MaxP>(v, P, h, rms, eps, mean, rstd);
#pragma unroll
  for (int k = 0; k < MaxP; ++k)
    if (k < P) {
      float gg[8];
      load8(g, (k * 32 + lane) * 8, gg);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        v[k][e] = (v[k][e] - mean) * rstd; // x-hat from here on
        d[k][e] *= gg[e];                  // dy * gamma
        sd += d[k][e], sdx += d[k][e] * v[k][e];
      }
    }
  sd = rms ? 0.0f : warpSum(sd) / h, sdx = warpSum(sdx) / h;
#pragma unroll
  for (int k = 0; k < MaxP; ++k)
    if (k < P) {
      float o[8];
#pragma unroll
      for (int e = 0; e < 8; ++e)
        o[e] = rstd * (d[k][e] - sd - v[k][e] * sdx);
      if (res) { // the residual stream's gradient (possibly dx itself: each lane reads its own elements first)
        Pack<bf16> pr = load(res + row * h + (k * 32 + lane) * 8);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          o[e] += __bfloat162float(pr.v[e]);
      }
      store8(dx + row * h + (k * 32 + lane) * 8, o);
    }
  if (lane == 0) {
    meanOut[row] = mean;
    rstdOut[row] = rstd;
  }
}

/// Per-chunk column sums of bf16 x (or, with dy, of dy * x-hat and dy: norm
/// parameter gradients), eight columns per thread; blocks of 32 x 8 threads
/// cover 256 columns.
__global__ void __launch_bounds__(256) columnPartial8Kernel(const bf16 *x, const float *mean, const float *rstd,
                                                            const bf16 *dy, float *partial, float *partialB,
                                                            int64_t rows, int64_t cols, int64_t rowsPerChunk) {
  __shared__ float tile[8][256], tileB[8][256];
  int64_t col = (int64_t(blockIdx.x) * 32 + threadIdx.x) * 8, chunk = blockIdx.y;
  int64_t r0 = chunk * rowsPerChunk, r1 = min(rows, r0 + rowsPerChunk);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, accB[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (col < cols)
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      Pack<bf16> pv = load(x + r * cols + col);
      if (dy) {
        Pack<bf16> pd = load(dy + r * cols + col);
        float m = mean[r], rs = rstd[r];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float dd = __bfloat162float(pd.v[e]);
          acc[e] += dd * (__bfloat162float(pv.v[e]) - m) * rs;
          accB[e] += dd;
        }
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e)
          acc[e] += __bfloat162float(pv.v[e]);
      }
    }
#pragma unroll
  for (int e = 0; e < 8; ++e)
    tile[threadIdx.y][threadIdx.x * 8 + e] = acc[e], tileB[threadIdx.y][threadIdx.x * 8 + e] = accB[e];
  __syncthreads();
  int t = threadIdx.y * 32 + threadIdx.x; // one column of the block's 256 per thread
  int64_t c = int64_t(blockIdx.x) * 256 + t;
  if (c < cols) {
    float sum = 0, sumB = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k)
      sum += tile[k][t], sumB += tileB[k][t];
    partial[chunk * cols + c] = sum;
    if (partialB)
      partialB[chunk * cols + c] = sumB;
  }
}

} // namespace

bool CudaBackendImpl::bf16Rows(const Instruction &ins, int64_t h) {
  if (h % 256 != 0 || h > 2048)
    return false;
  for (int64_t id : ins.in) {
    const Buffer &b = buf(id);
    if (reinterpret_cast<uintptr_t>(ptr(b)) % 16 != 0 || (b.dtype != LOOM_BF16 && b.dtype != LOOM_F32))
      return false;
  }
  for (int64_t id : ins.out)
    if (reinterpret_cast<uintptr_t>(ptr(buf(id))) % 16 != 0)
      return false;
  return isBf16(buf(ins.in[0])) && isBf16(buf(ins.out[0])) &&
         (ins.op.find("_grad") == std::string::npos || isBf16(buf(ins.in[2])));
}

Launch CudaBackendImpl::buildReduce(const Instruction &ins) {
  const std::string &op = ins.op;
  const Buffer &x = buf(ins.in[0]);
  std::vector<bool> reduced(x.shape.size(), false);
  for (auto &a : ins.attrs.at("axes"))
    reduced[a.get<int64_t>() < 0 ? a.get<int64_t>() + x.shape.size() : a.get<int64_t>()] = true;
  std::vector<int64_t> unit = stridesOf(x.shape), keptShape, keptStride, redShape, redStride;
  for (size_t d = 0; d < x.shape.size(); ++d)
    (reduced[d] ? redShape : keptShape).push_back(x.shape[d]), (reduced[d] ? redStride : keptStride).push_back(unit[d]);
  size_t lead = 0;
  while (lead < reduced.size() && reduced[lead])
    ++lead;
  bool leadingOnly = op != "reduce_max" && lead > 0 &&
                     std::none_of(reduced.begin() + lead, reduced.end(), [](bool r) { return r; });
  if (leadingOnly) { // sums over rows, per column (bias gradients): two deterministic passes
    int64_t rows = count(redShape), cols = count(keptShape);
    int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(rows / 64, 512)), per = (rows + chunks - 1) / chunks;
    float scale = op == "reduce_mean" ? 1.0f / float(rows) : 1.0f;
    DPtr px = fp(ins.in[0]), py = fp(ins.out[0]);
    bool vec8 = px.bf && cols % 8 == 0 && reinterpret_cast<uintptr_t>(px.p) % 16 == 0;
    reserve(size_t(chunks * cols) * sizeof(float));
    return [=](cudaStream_t s) {
      float *partial = reinterpret_cast<float *>(workspace);
      if (vec8) {
        dim3 grid(unsigned((cols + 255) / 256), unsigned(chunks)), block(32, 8);
        columnPartial8Kernel<<<grid, block, 0, s>>>(static_cast<const bf16 *>(px.p), nullptr, nullptr, nullptr,
                                                    partial, nullptr, rows, cols, per);
      } else if (cols % 2 == 0) {
        dim3 grid(unsigned((cols + 63) / 64), unsigned(chunks)), block(32, 8);
        columnPartial2Kernel<<<grid, block, 0, s>>>(px, nullptr, nullptr, DPtr{}, partial, nullptr, rows, cols, per);
      } else {
        dim3 grid(unsigned((cols + 31) / 32), unsigned(chunks)), block(32, 8);
        columnPartialKernel<<<grid, block, 0, s>>>(px, nullptr, nullptr, DPtr{}, partial, nullptr, rows, cols, per);
      }
      columnFinishKernel<<<blocksFor(cols), kThreads, 0, s>>>(partial, py, chunks, cols, scale);
    };
  }
  if (keptShape.empty())
    keptShape = {1}, keptStride = {0};
  Strided ks = strided(keptShape, keptStride), rs = strided(redShape, redStride);
  int64_t nOut = count(keptShape), nRed = count(redShape);
  int code = op == "reduce_max" ? 1 : 0;
  float scale = op == "reduce_mean" ? 1.0f / float(nRed) : 1.0f;
  DPtr px = fp(ins.in[0]), py = fp(ins.out[0]);
  return [=](cudaStream_t s) { reduceKernel<<<blocksFor(nOut), kThreads, 0, s>>>(code, px, py, nOut, ks, rs, nRed, scale); };
}

Launch CudaBackendImpl::buildNorm(const Instruction &ins) {
  const std::string &op = ins.op;
  bool rms = op == "rmsnorm";
  const Buffer &x = buf(ins.in[0]);
  int64_t h = x.shape.back(), rows = count(x.shape) / h;
  float eps = static_cast<float>(num(ins, "eps", 1e-5));
  DPtr px = fp(ins.in[0]), g = fp(ins.in[1]), b = rms ? DPtr{} : fp(ins.in[2]), y = fp(ins.out[0]);
  if (int P = int(h / 256); bf16Rows(ins, h)) {
    const bf16 *xb = static_cast<const bf16 *>(px.p);
    bf16 *yb = static_cast<bf16 *>(y.p);
    unsigned blocks = unsigned((rows + 7) / 8);
    if (P <= 4)
      return [=](cudaStream_t s) { normRowsBf16Kernel<4><<<blocks, 256, 0, s>>>(xb, g, b, yb, rows, P, eps, rms); };
    return [=](cudaStream_t s) { normRowsBf16Kernel<8><<<blocks, 256, 0, s>>>(xb, g, b, yb, rows, P, eps, rms); };
  }
  if (h % 64 == 0 && h < (1 << 30))
    return [=](cudaStream_t s) {
      normRowsKernel<<<unsigned((rows + 7) / 8), 256, 0, s>>>(px, g, b, y, rows, int(h), eps, rms);
    };
  return [=](cudaStream_t s) { normKernel<<<int(rows), kThreads, 0, s>>>(px, g, b, y, h, eps, rms, nullptr, nullptr); };
}

Launch CudaBackendImpl::buildNormGrad(const Instruction &ins) {
  const std::string &op = ins.op;
  bool rms = op == "rmsnorm_grad";
  const Buffer &x = buf(ins.in[0]);
  int64_t h = x.shape.back(), rows = count(x.shape) / h;
  float eps = static_cast<float>(num(ins, "eps", 1e-5));
  DPtr px = fp(ins.in[0]), g = fp(ins.in[1]), dy = fp(ins.in[2]), dx = fp(ins.out[0]), dg = fp(ins.out[1]);
  DPtr db = rms ? DPtr{} : fp(ins.out[2]);
  // A fourth input: the residual stream's gradient, added to dx. The
  // register-row kernel adds it in place; the others write dx to the
  // workspace first (the residual may be dx's own buffer).
  DPtr res = ins.in.size() == 4 ? fp(ins.in[3]) : DPtr{};
  int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(rows / 64, 512)), per = (rows + chunks - 1) / chunks;
  bool fast = bf16Rows(ins, h) && (!res.p || (res.bf && reinterpret_cast<uintptr_t>(res.p) % 16 == 0));
  int64_t stats = (2 * rows + 2 * chunks * h) * int64_t(sizeof(float));
  stats = (stats + 255) / 256 * 256;
  reserve(stats + (res.p && !fast ? rows * h * int64_t(dx.bf ? 2 : 4) : 0));
  return [=](cudaStream_t s) {
    float *mean = reinterpret_cast<float *>(workspace), *rstd = mean + rows;
    float *partial = rstd + rows, *partialB = partial + chunks * h;
    DPtr out = res.p && !fast ? DPtr{static_cast<char *>(workspace) + stats, dx.bf} : dx;
    if (fast) {
      int P = int(h / 256);
      const bf16 *xb = static_cast<const bf16 *>(px.p), *dyb = static_cast<const bf16 *>(dy.p);
      const bf16 *rb = static_cast<const bf16 *>(res.p);
      bf16 *dxb = static_cast<bf16 *>(dx.p);
      if (P <= 4)
        normGradRowsBf16Kernel<4><<<unsigned((rows + 7) / 8), 256, 0, s>>>(xb, g, dyb, dxb, rows, P, eps, rms, mean,
                                                                           rstd, rb);
      else
        normGradRowsBf16Kernel<8><<<unsigned((rows + 7) / 8), 256, 0, s>>>(xb, g, dyb, dxb, rows, P, eps, rms, mean,
                                                                           rstd, rb);
      dim3 grid(unsigned((h + 255) / 256), unsigned(chunks)), block(32, 8);
      columnPartial8Kernel<<<grid, block, 0, s>>>(xb, mean, rstd, dyb, partial, partialB, rows, h, per);
    } else if (h % 64 == 0) {
      normGradRowsKernel<<<unsigned((rows + 7) / 8), 256, 0, s>>>(px, g, dy, out, rows, int(h), eps, rms, mean, rstd);
      dim3 grid(unsigned((h + 63) / 64), unsigned(chunks)), block(32, 8);
      columnPartial2Kernel<<<grid, block, 0, s>>>(px, mean, rstd, dy, partial, partialB, rows, h, per);
    } else {
      normGradDxKernel<<<int(rows), kThreads, 0, s>>>(px, g, dy, out, h, eps, rms, mean, rstd);
      dim3 grid(unsigned((h + 31) / 32), unsigned(chunks)), block(32, 8);
      columnPartialKernel<<<grid, block, 0, s>>>(px, mean, rstd, dy, partial, partialB, rows, h, per);
    }
    if (res.p && !fast)
      binaryContiguousKernel<<<blocksFor(rows * h), kThreads, 0, s>>>(kAdd, out, res, dx, rows * h, rows * h, rows * h);
    columnFinishKernel<<<blocksFor(h), kThreads, 0, s>>>(partial, dg, chunks, h, 1.0f);
    if (db)
      columnFinishKernel<<<blocksFor(h), kThreads, 0, s>>>(partialB, db, chunks, h, 1.0f);
  };
}

void CudaBackendImpl::addNormBuilders(BuilderTable &table) {
  for (const char *op : {"reduce_sum", "reduce_mean", "reduce_max"})
    table[op] = &CudaBackendImpl::buildReduce;
  for (const char *op : {"layernorm", "rmsnorm"})
    table[op] = &CudaBackendImpl::buildNorm;
  for (const char *op : {"layernorm_grad", "rmsnorm_grad"})
    table[op] = &CudaBackendImpl::buildNormGrad;
}

} // namespace loom::rt::cuda

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
