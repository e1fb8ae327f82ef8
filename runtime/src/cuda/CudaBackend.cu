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

#include <cuda_profiler_api.h>

#include <cstdio>
#include <cstdlib>

namespace loom::rt::cuda {

namespace {
/// Compiled as every kernel of the backend is: its PTX version says whether
/// the kernels' griddepcontrol instructions are there (sm_90 and up).
__global__ void architectureProbeKernel() {}
} // namespace

bool dependentLaunches() {
  static const bool on = [] {
    // On by default: on an H200 (2026-11-27, same call) GPT-2 350M decoding
    // went from 0.967 to 0.909-0.924 ms a token, TinyLlama from 1.200-1.223
    // to 1.192. LOOM_CUDA_PDL=0 turns it off.
    if (envIs("LOOM_CUDA_PDL", "0"))
      return false;
    // The device must launch dependents (compute capability 9), and the
    // kernels must wait for them: built for sm_90 or later, not JIT-compiled
    // from an older architecture's PTX, where waitPrevious() is empty.
    int device = 0, major = 0;
    cudaFuncAttributes probe{};
    return cudaGetDevice(&device) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9 &&
           cudaFuncGetAttributes(&probe, architectureProbeKernel) == cudaSuccess && probe.ptxVersion >= 90;
  }();
  return on;
}

int64_t CudaBackendImpl::deviceBytesInUse() const {
  size_t free = 0, total = 0;
  if (cudaSetDevice(device) != cudaSuccess || cudaMemGetInfo(&free, &total) != cudaSuccess)
    return -1;
  return int64_t(total - free);
}

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
/// hyperparameters but for their weight decays (each tensor carries its
/// own), step counter and gradient norm.
static bool sameAdamw(const Instruction &a, const Instruction &b) {
  auto common = [](nlohmann::json attrs) {
    if (attrs.is_object())
      attrs.erase("weight_decay");
    return attrs;
  };
  return a.op == "adamw" && b.op == "adamw" && a.in.size() == 6 && b.in.size() == 6 && a.in[4] == b.in[4] &&
         a.in[5] == b.in[5] && common(a.attrs) == common(b.attrs);
}

/// SGD updates with one set of hyperparameters, step and norm (a run of them
/// shares one launch).
static bool sameSgd(const Instruction &a, const Instruction &b) {
  return a.op == "sgd" && b.op == "sgd" && a.attrs == b.attrs && a.in.size() == 5 && b.in.size() == 5 &&
         a.in[3] == b.in[3] && a.in[4] == b.in[4];
}

/// A cast between f32 and bf16 (those of a run share one launch).
static bool isFloatCast(const RankProgram &rank, const Instruction &ins) {
  if (ins.op != "cast" || ins.in.size() != 1 || ins.out.size() != 1)
    return false;
  loom_dtype_t a = rank.buffers[ins.in[0]].dtype, b = rank.buffers[ins.out[0]].dtype;
  return a != b && (a == LOOM_F32 || a == LOOM_BF16) && (b == LOOM_F32 || b == LOOM_BF16);
}

/// A gradient accumulation: an f32 sum plus an f32 or bf16 tensor of its
/// size, written over the sum (those of a run share one launch).
static bool isAccumulate(const RankProgram &rank, const Instruction &ins) {
  if (ins.op != "add" || ins.in.size() != 2 || ins.out.size() != 1 || (ins.in[0] == ins.out[0]) == (ins.in[1] == ins.out[0]))
    return false;
  const Buffer &sum = rank.buffers[ins.out[0]], &g = rank.buffers[ins.in[0] == ins.out[0] ? ins.in[1] : ins.in[0]];
  return sum.dtype == LOOM_F32 && (g.dtype == LOOM_F32 || g.dtype == LOOM_BF16) && sum.shape == g.shape &&
         sum.viewOf < 0;
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
  sharedByNccl = world != nullptr && envIs("LOOM_NCCL_REGISTER", "1");
#ifdef LOOM_HAVE_NCCL
  // The tensor-parallel group's communicator; where the rank has none, the
  // data-parallel group's when its programs shard over it (ZeRO's
  // reduce-scatters and gathers: GPT-2 350M ZeRO-1 dp2 on two H200s 45.4 /
  // 45.4 ms a step against 45.9 / 46.5, GPT 1.3B 141.1 against 142.7; plain
  // dp2 was slower with them, 45.5 / 45.1 against 45.0 / 44.5, and keeps
  // cudaMalloc unless LOOM_NCCL_WINDOWS=dp).
  bool sharded = false;
  for (const auto &[name, list] : rank.programs)
    for (const Instruction &ins : list)
      sharded |= isZeroCollective(ins) && collectiveGroup(ins) == "dp";
  for (const char *name : {"tp", "dp"}) {
    auto members = rank.groups.find(name);
    if (!world || !windowsWanted() || windowComm || members == rank.groups.end() || members->second.size() < 2 ||
        (std::string(name) == "dp" && !sharded && !envIs("LOOM_NCCL_WINDOWS", "dp")))
      continue;
    auto g = world->groups.find(std::vector<int>(members->second.begin(), members->second.end()));
    if (g != world->groups.end())
      if (auto c = g->second.find(int(rank.rank)); c != g->second.end())
        windowComm = c->second, windowGroup = name;
  }
  if (windowComm) { // the largest arena any member of the group asks for
    std::vector<uint64_t> size = {bytes};
    agreeOnSizes(size, "the size of its arena");
    bytes = size_t(size[0]);
  }
#endif
  arena = static_cast<char *>(allocShared(bytes, "arena"));
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
  if (timePrograms())
    reportProgramTimes();
  for (auto &[name, g] : graphs)
    destroyProgramTimer(g);
  for (auto &[name, steps] : programs)
    for (Step &step : steps) {
      if (step.start)
        cudaEventDestroy(step.start);
      if (step.end)
        cudaEventDestroy(step.end);
      if (step.communicated)
        cudaEventDestroy(step.communicated);
    }
  dropGraphs();
  for (void *p : allocations)
    cudaFree(p);
  // The shared buffers before the streams: freeing a window synchronises
  // every stream first (a destroyed stream's handle must not be used: it
  // crashed f32 ZeRO-1 and tp2 sp at exit on two H200s, 2026-11-29).
  freeShared(workspace);
  freeShared(commWorkspace);
  freeShared(arena);
  workspace = commWorkspace = nullptr;
  arena = nullptr;
  if (sendStream)
    cudaStreamSynchronize(sendStream), cudaStreamDestroy(sendStream), sendStream = nullptr;
  if (commStream)
    cudaStreamSynchronize(commStream), cudaStreamDestroy(commStream), commStream = nullptr;
  for (auto &[id, e] : commEvents)
    cudaEventDestroy(e);
  for (cudaEvent_t e : readyEvents)
    cudaEventDestroy(e);
  if (legacyStreamDone)
    cudaEventDestroy(legacyStreamDone);
  if (sendsJoined)
    cudaEventDestroy(sendsJoined);
  if (commJoined)
    cudaEventDestroy(commJoined);
  for (Staging &slot : staging) {
    cudaFree(slot.data);
    if (slot.sent)
      cudaEventDestroy(slot.sent), cudaEventDestroy(slot.copied);
  }
  if (kernelsLibrary)
    cudaLibraryUnload(kernelsLibrary);
  cudaFree(argmaxOut);
  cudaFree(l2Flush);
  cudaFree(errorWord);
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
void CudaBackendImpl::uploadBeforeRun(const Buffer &b, const void *src) {
  // From pageable memory the copy has left `src` when cudaMemcpyAsync
  // returns (it is staged), and the stream orders it before the next
  // program: nothing to wait for. From page-locked memory the copy reads
  // `src` later: wait for it.
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, src) != cudaSuccess) {
    cudaGetLastError();
    attributes.type = cudaMemoryTypeHost;
  }
  if (attributes.type != cudaMemoryTypeUnregistered)
    return upload(b, src);
  LOOM_CUDA_CHECK(cudaSetDevice(device));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(ptr(b), src, b.bytes, cudaMemcpyHostToDevice, stream));
}
void CudaBackendImpl::download(const Buffer &b, void *dst) const {
  LOOM_CUDA_CHECK(cudaSetDevice(device));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, const_cast<CudaBackendImpl *>(this)->ptr(b), b.bytes,
                                  cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void CudaBackendImpl::uploadFromDevice(const Buffer &b, const void *src, int srcDevice) {
  if (srcDevice != device)
    fail(LOOM_INVALID_ARGUMENT, "input '", b.name, "' comes from the memory of CUDA device ", srcDevice,
         " but this session runs on CUDA device ", device, "; move it to device ", device, " first");
  LOOM_CUDA_CHECK(cudaSetDevice(device));
  // A pointer that is not this GPU's memory fails here, not inside the copy.
  cudaPointerAttributes attributes{};
  cudaError_t e = cudaPointerGetAttributes(&attributes, src);
  if (e != cudaSuccess) {
    cudaGetLastError(); // clear it: the error is the caller's, not the device's
    fail(LOOM_INVALID_ARGUMENT, "input '", b.name, "': the address is not CUDA memory (",
         cudaGetErrorString(e), ")");
  }
  bool deviceMemory = attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
  if (!deviceMemory || attributes.device != device)
    fail(LOOM_INVALID_ARGUMENT, "input '", b.name, "': the address is not memory of CUDA device ", device,
         deviceMemory ? cat(" (it is device ", attributes.device, "'s)") : std::string(" (it is host memory)"));
  // The producer's work reached the legacy default stream (DLPack's stream
  // 1); this rank's stream, which does not block on it, waits for it there.
  if (!legacyStreamDone)
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&legacyStreamDone, cudaEventDisableTiming));
  LOOM_CUDA_CHECK(cudaEventRecord(legacyStreamDone, cudaStreamLegacy));
  LOOM_CUDA_CHECK(cudaStreamWaitEvent(stream, legacyStreamDone, 0));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(ptr(b), src, b.bytes, cudaMemcpyDeviceToDevice, stream));
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
  buildJoinsComm = false;
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
    // A run [i, end) in one launch: the first step launches it, the others
    // keep their places (their names in errors and profiles) and launch
    // nothing.
    auto together = [&](size_t end, Launch launch, const std::string &op, double flops = 0) {
      steps.push_back({where, op, flops, std::move(launch), nullptr, nullptr});
      for (size_t k = i + 1; k < end; ++k)
        steps.push_back({cat("instruction ", program, "[", k, "] '", instrs[k].op, "'"), instrs[k].op, 0,
                         [](cudaStream_t) {}, nullptr, nullptr});
      i = end - 1;
    };
    auto runOf = [&](size_t most, auto same) { // the end of the run from i of instructions like instrs[i]
      size_t j = i + 1;
      while (j < instrs.size() && j - i < most && same(instrs[j]))
        ++j;
      return j;
    };
    auto productFlops = [&](size_t begin, size_t end) { // of the products in [begin, end)
      double flops = 0;
      for (size_t k = begin; k < end; ++k)
        flops += instrs[k].op == "matmul" ? denseFlops(instrs[k]) : 0;
      return flops;
    };
    const size_t unbounded = instrs.size();
    if (isFloatCast(rank, instrs[i]) && i + 1 < instrs.size() && isFloatCast(rank, instrs[i + 1])) {
      size_t end = runOf(unbounded, [&](const Instruction &x) { return isFloatCast(rank, x); });
      together(end, buildCasts(instrs, i, end), label);
      continue;
    }
    // LOOM_CUDA_ACCUMULATE_RUNS=0: a launch an add, to measure the runs.
    static const bool accumulateRuns = !envIs("LOOM_CUDA_ACCUMULATE_RUNS", "0");
    if (accumulateRuns && isAccumulate(rank, instrs[i]) && i + 1 < instrs.size() && isAccumulate(rank, instrs[i + 1])) {
      // A run's sums are distinct and no add reads another's sum: the
      // chunks of one launch run in any order.
      std::set<int64_t> sums, reads;
      size_t end = i;
      while (end < instrs.size() && isAccumulate(rank, instrs[end])) {
        const Instruction &x = instrs[end];
        int64_t sum = storageOf(rank, x.out[0]), g = storageOf(rank, x.in[0] == x.out[0] ? x.in[1] : x.in[0]);
        if (sums.count(sum) || sums.count(g) || reads.count(sum))
          break;
        sums.insert(sum), reads.insert(g);
        ++end;
      }
      if (end - i >= 2) {
        together(end, buildAccumulates(instrs, i, end), label);
        continue;
      }
    }
    if (i + 1 < instrs.size() && slicesTogether(instrs[i], instrs[i + 1])) { // q, k and v of one product
      size_t end = runOf(8, [&](const Instruction &x) { return slicesTogether(instrs[i], x); });
      together(end, buildSlices(instrs, i, end), label);
      continue;
    }
    if (i + 1 < instrs.size() && shardsTogether(instrs[i], instrs[i + 1])) { // ZeRO-1's shards, packed (opt-in)
      size_t end = runOf(unbounded, [&](const Instruction &x) { return shardsTogether(instrs[i], x); });
      together(end, buildShardsOf(instrs, i, end), label);
      continue;
    }
    if (rotaryCacheTogether(instrs, i)) { // a decoding layer's rotary embeddings and cache write
      together(i + 3, buildRotaryCache(instrs, i), label);
      continue;
    }
    // Decoding's products: a run of them (of one input, or a product and
    // its slices) in one launch, with the norm before them where only they
    // read it. Layer norms: on an H200 this took GPT-2 350M from 1.00 to
    // 0.97-1.00 ms a token. RMS norms fold in one pass (their statistics
    // summed beside the products); folded with a first pass over x in every
    // block, as layer norms are, they cost TinyLlama 0.1 ms a token.
    // LOOM_CUDA_GEMV_NORM=0 keeps every norm apart, =layer folds layer norms only.
    if (instrs[i].op == "layernorm" || instrs[i].op == "rmsnorm") {
      const char *env = std::getenv("LOOM_CUDA_GEMV_NORM");
      std::string mode = env ? env : "";
      size_t end = decodeGroupEnd(instrs, i + 1, /*normFolded=*/true);
      if (mode != "0" && (instrs[i].op == "layernorm" || mode != "layer") && end > i + 1 &&
          normFeedsProducts(instrs, i, end)) {
        together(end, buildDecodeGroup(instrs, i + 1, end, &instrs[i]), instrs[i].op + "+" + instrs[i + 1].op,
                 productFlops(i + 1, end));
        continue;
      }
    }
    if (size_t end = decodeGroupEnd(instrs, i); end > i) {
      together(end, buildDecodeGroup(instrs, i, end, nullptr), label, productFlops(i, end));
      continue;
    }
    if (instrs[i].op == "adamw") { // a run of updates with one set of hyperparameters: one launch
      // The compiler's generated kernel updates the run that names it
      // (its weight decays may differ); ours, a run of equal attributes.
      bool gen = generatedAdamw(instrs[i]);
      auto kernelOf = [](const Instruction &ins) {
        return ins.attrs.is_object() ? ins.attrs.value("kernel", std::string()) : std::string();
      };
      auto runEnd = [&] {
        return runOf(unbounded, [&](const Instruction &x) {
          return gen ? x.op == "adamw" && kernelOf(x) == kernelOf(instrs[i]) : sameAdamw(instrs[i], x);
        });
      };
      size_t end = runEnd();
      // Ours where a gradient of the run is deferred (the pair is read).
      for (size_t k = i; gen && k < end; ++k)
        if (instrs[k].in.size() == 6 && deferredOf(instrs[k].in[1]))
          gen = false, end = runEnd();
      std::vector<const Instruction *> group;
      for (size_t k = i; k < end; ++k)
        group.push_back(&instrs[k]);
      together(end, gen ? buildGeneratedAdamw(group) : buildAdamw(group), label);
      continue;
    }
    if (i + 1 < instrs.size() && sameSgd(instrs[i], instrs[i + 1])) { // a run of SGD updates: one launch
      size_t end = runOf(unbounded, [&](const Instruction &x) { return sameSgd(instrs[i], x); });
      std::vector<const Instruction *> group;
      for (size_t k = i; k < end; ++k)
        group.push_back(&instrs[k]);
      together(end, buildSgdRun(group), label);
      continue;
    }
    buildCapturable = true, buildReplayable = nullptr, buildReplayed = nullptr;
    buildTraceStream = nullptr, buildTrack = "compute";
    steps.push_back({where, label, denseFlops(instrs[i]), build(instrs[i]), nullptr, nullptr});
    steps.back().traceStream = buildTraceStream;
    steps.back().track = buildTrack;
    if (world && communicates(instrs[i].op))
      LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&steps.back().communicated, cudaEventDisableTiming));
    steps.back().capturable = buildCapturable;
    steps.back().replayable = std::move(buildReplayable);
    steps.back().replayed = std::move(buildReplayed);
  }
  // A last step joining another stream back into the compute stream (its
  // event recorded there), so that a capture of the program is whole.
  auto join = [&](cudaEvent_t &joined, cudaStream_t other, const char *what) {
    if (!joined)
      LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&joined, cudaEventDisableTiming));
    cudaEvent_t e = joined;
    steps.push_back({cat(program, ": the join of its ", what), "join", 0, [e, other](cudaStream_t s) {
                       LOOM_CUDA_CHECK(cudaEventRecord(e, other));
                       LOOM_CUDA_CHECK(cudaStreamWaitEvent(s, e, 0));
                     },
                     nullptr, nullptr});
  };
  // Async collectives waited for by a later program: they belong to this
  // program's graph. (run() waits for every stream at a program's end
  // anyway: the join adds no wait.)
  if (buildJoinsComm)
    join(commJoined, commStream, "collectives");
  // Captured sends (unless LOOM_CUDA_GRAPHS_P2P=0).
  if (p2pGraphs() && std::any_of(instrs.begin(), instrs.end(), [](const Instruction &x) { return x.op == "send"; }))
    join(sendsJoined, sendStream, "sends");
#ifdef LOOM_HAVE_NCCL
  // Windows are registered together: every member of the group grows a
  // workspace when any of them needs more (a rank's shard can ask for
  // another size than its peers').
  if (windowComm) {
    std::vector<uint64_t> sizes = {commWorkspaceBytes, workspaceBytes};
    agreeOnSizes(sizes, cat("the workspaces of program '", program, "'"));
    commWorkspaceBytes = size_t(sizes[0]), workspaceBytes = size_t(sizes[1]);
  }
#endif
  if (commWorkspaceBytes > commWorkspaceAllocated) {
    dropGraphs(); // they hold the old workspace's address
    LOOM_CUDA_CHECK(cudaStreamSynchronize(commStream));
    freeShared(commWorkspace);
    commWorkspace = nullptr, commWorkspaceAllocated = 0;
    commWorkspace = static_cast<char *>(allocShared(commWorkspaceBytes, "communication workspace"));
    commWorkspaceAllocated = commWorkspaceBytes;
  }
  if (workspaceBytes > workspaceAllocated) {
    dropGraphs(); // they hold the old workspace's address
    freeShared(workspace);
    workspace = nullptr, workspaceAllocated = 0;
    workspace = static_cast<char *>(allocShared(workspaceBytes, "workspace"));
    workspaceAllocated = workspaceBytes;
  }
  Graph &graph = graphs[program];
  if (graph.exec)
    cudaGraphExecDestroy(graph.exec);
  destroyProgramTimer(graph);
  graph = Graph{};
  graph.capturable = std::all_of(steps.begin(), steps.end(), [](const Step &s) { return s.capturable; });
  for (size_t i = 0; i < steps.size(); ++i)
    if (steps[i].replayable || steps[i].replayed)
      graph.hooks.push_back(i);
  programs[program] = std::move(steps);
  // The L2 flush buffer (twice the cache) only served timing the products.
  cudaFree(l2Flush);
  l2Flush = nullptr;
}

namespace {
/// LOOM_CUDA_PROFILE_RUN=PROGRAM:N brackets the N-th run (from 1) of PROGRAM
/// with cudaProfilerStart/Stop, so `ncu --profile-from-start off` (or nsys's
/// `--capture-range=cudaProfilerApi`) sees one step and not the preparation's
/// timings: e.g. `serve.1:20` is a serving bundle's 20th one-token step.
bool profileThisRun(const std::string &program, int run) {
  static const std::pair<std::string, int> wanted = [] {
    const char *env = std::getenv("LOOM_CUDA_PROFILE_RUN");
    std::string text = env ? env : "";
    size_t colon = text.rfind(':');
    if (colon == std::string::npos)
      return std::pair<std::string, int>(text, 1);
    return std::pair<std::string, int>(text.substr(0, colon), std::atoi(text.c_str() + colon + 1));
  }();
  return !wanted.first.empty() && wanted.first == program && wanted.second == run;
}
} // namespace

bool CudaBackendImpl::timePrograms() {
  static const bool on = [] {
    return envIs("LOOM_CUDA_PROGRAM_TIMES", "1");
  }();
  return on;
}

void CudaBackendImpl::startProgramTimer(Graph &g) {
  if (!timePrograms())
    return;
  g.hostStart = std::chrono::steady_clock::now();
  if (!g.began)
    LOOM_CUDA_CHECK(cudaEventCreate(&g.began)), LOOM_CUDA_CHECK(cudaEventCreate(&g.ended));
  LOOM_CUDA_CHECK(cudaEventRecord(g.began, stream));
}

void CudaBackendImpl::stopProgramTimer(Graph &g, bool streamsDone) {
  if (!timePrograms())
    return;
  if (!streamsDone) { // the program is launched: its end on the compute stream
    LOOM_CUDA_CHECK(cudaEventRecord(g.ended, stream));
    return;
  }
  auto now = std::chrono::steady_clock::now();
  if (g.runs > 3) {
    float ms = 0;
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, g.began, g.ended));
    g.gpuMs += ms;
    g.hostMs += std::chrono::duration<double, std::milli>(now - g.hostStart).count();
    if (lastRunEnd != std::chrono::steady_clock::time_point{})
      g.gapMs += std::chrono::duration<double, std::milli>(g.hostStart - lastRunEnd).count();
    ++g.timed;
  }
  lastRunEnd = now;
}

void CudaBackendImpl::destroyProgramTimer(Graph &g) {
  if (g.began)
    cudaEventDestroy(g.began), cudaEventDestroy(g.ended), g.began = g.ended = nullptr;
}

void CudaBackendImpl::reportProgramTimes() const {
  for (const auto &[name, g] : graphs)
    if (g.timed > 0)
      std::fprintf(stderr,
                   "loom: rank %lld program %s: %.3f ms on the GPU, %.3f ms from run() to its streams' end, "
                   "%.3f ms since the previous program's end (mean of %d runs after the first 3)\n",
                   (long long)rank.rank, name.c_str(), g.gpuMs / g.timed, g.hostMs / g.timed, g.gapMs / g.timed,
                   g.timed);
}

void CudaBackendImpl::run(const std::string &program) {
  LOOM_CUDA_CHECK(cudaSetDevice(device));
  auto &steps = programs.at(program);
  Graph &g = graphs[program];
  startProgramTimer(g);
  bool profilerRange = profileThisRun(program, ++g.runs);
  if (profilerRange)
    LOOM_CUDA_CHECK(cudaProfilerStart());
  // A trace keeps graphs only under LOOM_CUDA_TRACE_GRAPHS=1: its events are
  // then nodes of the graph, and the timeline is the one replays run.
  bool graphable = graphsWanted() && !profiling && (!tracing || traceGraphs()) && !g.disabled && g.capturable;
  if (tracing) { // the streams are idle (the last run synchronised them): the base is now
    if (!traceBase)
      LOOM_CUDA_CHECK(cudaEventCreate(&traceBase));
    traceBaseHost = traceClock();
    LOOM_CUDA_CHECK(cudaEventRecord(traceBase, stream));
  }
  bool done = false;
  if (graphable && g.exec) {
    // Each step's host state is checked as the replay will find it: the
    // steps before it have had their effect (an attention's backward reads
    // what its forward saved earlier in the same program, as a microbatched
    // step's do). Checked all at once after the launch instead, such a
    // program failed every check, ran eagerly and was captured again on
    // alternate runs (GPT-2 350M with two microbatches on one H200: 55.7 ms
    // a step against 40.6 with one). A failed check leaves only effects
    // that the eager run of the same steps has too.
    bool replayable = true;
    for (size_t i : g.hooks) {
      if (steps[i].replayable && !steps[i].replayable()) {
        replayable = false;
        break;
      }
      if (steps[i].replayed)
        steps[i].replayed();
    }
    if (replayable) {
      LOOM_CUDA_CHECK(cudaGraphLaunch(g.exec, stream));
      done = true;
    } else { // host state differs from the capture's: run eagerly, capture again next time
      cudaGraphExecDestroy(g.exec), g.exec = nullptr;
      g.eagerRuns = 0;
    }
  } else if (graphable && g.eagerRuns > 0) {
    done = captureAndLaunch(program, steps, g);
  }
  if (!done) {
    launchEager(steps);
    ++g.eagerRuns;
  }
  stopProgramTimer(g, /*streamsDone=*/false);
  waitForStreams(program, steps);
  stopProgramTimer(g, /*streamsDone=*/true);
  if (profilerRange) {
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
    LOOM_CUDA_CHECK(cudaProfilerStop());
  }
  if (world && world->aborted)
    fail(LOOM_INVALID_ARGUMENT, program, ": stopped with every rank: ", world->abortReason());
  if (profiling)
    for (Step &step : steps) {
      float ms = 0;
      LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, step.start, step.end));
      OpTime &t = times[step.op];
      t.seconds += ms / 1e3;
      t.count += 1;
      t.flops += step.flops;
    }
  if (tracing) {
    // Work on another stream starts when its inputs are ready on the compute
    // stream, or when that stream finishes what it had before (streams run
    // in order), whichever is later.
    std::map<std::string, double> free;
    for (Step &step : steps) {
      float at = 0, to = 0;
      LOOM_CUDA_CHECK(cudaEventElapsedTime(&at, traceBase, step.start));
      LOOM_CUDA_CHECK(cudaEventElapsedTime(&to, traceBase, step.end));
      double start = at, end = std::max(at, to);
      if (step.traceStream) {
        start = std::min(end, std::max(start, free[step.track]));
        free[step.track] = end;
      }
      addTrace({opOfLabel(step.what), step.track, step.what, traceBaseHost + start / 1e3, (end - start) / 1e3});
    }
  }
  long long err[3];
  LOOM_CUDA_CHECK(cudaMemcpy(err, errorWord, sizeof(err), cudaMemcpyDeviceToHost));
  if (err[0]) {
    LOOM_CUDA_CHECK(cudaMemset(errorWord, 0, sizeof(err)));
    const char *what = err[0] == 1   ? "token id "
                       : err[0] == 2 ? "target class "
                       : err[0] == 3 ? "cache slot "
                       : err[0] == 4 ? "position "
                                     : "block table entry ";
    fail(LOOM_INVALID_ARGUMENT, program, ": ", what, err[2], " at position ", err[1],
         err[0] <= 2 ? " is outside the table it indexes" : " is outside the key/value cache");
  }
}

Launch CudaBackendImpl::build(const Instruction &ins) {
  const std::string &op = ins.op;
  // Norms, softmaxes and the loss the compiler generated a kernel for;
  // LOOM_CUDA_GENERATED=0 runs ours instead (softmax has no other).
  // (A generated kernel's name is a string; pooling's "kernel" is its window.)
  // LOOM_CUDA_NORM_GRAD=ours (or two-pass) runs our norm gradients only.
  static const bool ourNormGrads = envIs("LOOM_CUDA_NORM_GRAD", "ours") || envIs("LOOM_CUDA_NORM_GRAD", "two-pass");
  bool normGrad = op == "layernorm_grad" || op == "rmsnorm_grad";
  // (A vocabulary split over ranks runs its kernels around its all-reduces: buildCommunication.)
  if (op != "fused" && ins.attrs.is_object() && ins.attrs.contains("kernel") &&
      ins.attrs["kernel"].is_string() && kernelsLibrary && !ins.attrs.contains("vocab_group") &&
      (generatedKernelsOn() || op == "softmax") && !(normGrad && ourNormGrads))
    return op.rfind("cross_entropy", 0) == 0 ? buildCrossEntropyKernel(ins)
           : normGrad                        ? buildNormGradKernel(ins)
                                             : buildRowKernel(ins);
  const BuilderTable &table = builders();
  if (auto it = table.find(op); it != table.end())
    return it->second(*this, ins);
  fail(LOOM_UNSUPPORTED, where, ": the CUDA backend has no kernel for '", op,
       "' yet (softmax in a bundle compiled without --fuse runs on --backend cpu)");
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
    addServeBuilders(t);
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
