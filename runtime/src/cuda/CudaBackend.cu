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
