//===- NcclWorld.cu - NCCL communicators and the windows registered in them -===//
//
// The process's NCCL world: a communicator per group and per direction of
// each pipeline link, created in one NCCL group within a bounded wait, and
// aborted together when a rank fails; and the CUDA backend's buffers
// allocated as symmetric NCCL windows of its tensor-parallel (or ZeRO
// data-parallel) group, whose sizes the group's members agree on first.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"
#include "runtime/src/Communicator.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <cstdlib>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

namespace loom::rt {

#ifdef LOOM_HAVE_NCCL
void checkNccl(ncclResult_t r, const char *what, const char *file, int line) {
  if (r != ncclSuccess && r != ncclInProgress)
    fail(r == ncclInvalidUsage || r == ncclInvalidArgument ? LOOM_INVALID_BUNDLE : LOOM_INTERNAL, file,
         ":", line, ": ", what, " failed: ", ncclGetErrorString(r), " (", ncclGetLastError(nullptr),
         "); NCCL_DEBUG=WARN says more");
}

/// Runs `work` (NCCL calls that wait for the other members of a group) on a
/// thread of its own, on `device` (-1: left to `work`), and waits for it at
/// most `timeoutSeconds`, or until `bootstrap` says a peer process is gone or
/// `world` is aborted: a peer that never joins (crashed, killed, or running a
/// different bundle) would otherwise block the call forever. Fails naming
/// `what`, with `neverJoined` on a timeout; the thread is left behind then
/// (the process is failing anyway), told so through the flag `work` gets, so
/// that it stops once its blocked call returns.
static void withinTimeout(double timeoutSeconds, Communicator *bootstrap, NcclWorld *world, int device,
                          const std::string &what, const std::string &neverJoined,
                          std::function<void(const std::atomic<bool> &abandoned)> work) {
  struct Shared {
    std::mutex mutex;
    std::condition_variable done;
    bool finished = false;
    std::string error;
    loom_status_code_t code = LOOM_INTERNAL;
    std::atomic<bool> abandoned{false};
  };
  auto shared = std::make_shared<Shared>();
  std::thread([shared, device, work] {
    std::string error;
    loom_status_code_t code = LOOM_INTERNAL;
    try {
      if (device >= 0)
        LOOM_CUDA_CHECK(cudaSetDevice(device));
      work(shared->abandoned);
    } catch (const Error &e) {
      error = e.what(), code = e.code;
    } catch (const std::exception &e) {
      error = e.what();
    }
    std::lock_guard<std::mutex> lock(shared->mutex);
    shared->finished = true;
    shared->error = error;
    shared->code = code;
    shared->done.notify_all();
  }).detach();
  auto start = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(shared->mutex);
  auto giveUp = [&](auto &&...parts) {
    shared->abandoned = true;
    fail(LOOM_INVALID_ARGUMENT, parts...);
  };
  while (!shared->done.wait_for(lock, std::chrono::milliseconds(200), [&] { return shared->finished; })) {
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::string lost = bootstrap ? bootstrap->lostPeers() : "";
    if (!lost.empty())
      giveUp(what, ": ", lost, " before every rank joined; stopping");
    if (world && world->aborted)
      giveUp(what, ": stopped, ", world->abortReason());
    if (waited > timeoutSeconds)
      giveUp(what, " did not finish within ", timeoutSeconds, " s: ", neverJoined, "; --timeout sets the limit");
  }
  if (!shared->error.empty())
    fail(shared->code, what, ": ", shared->error);
}

void NcclWorld::createAll(const std::vector<std::vector<int>> &lists, int self, Communicator *bootstrap,
               std::vector<std::map<int, ncclComm_t> *> targets, const std::vector<std::pair<int, int>> &ctas) {
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
  auto pending = std::make_shared<std::vector<Pending>>();
  for (size_t g = 0; g < lists.size(); ++g)
    for (size_t i = 0; i < lists[g].size(); ++i)
      if (self < 0 || lists[g][i] == self)
        pending->push_back({g, lists[g][i], nullptr});
  std::vector<int> devs = devices;
  withinTimeout(timeoutSeconds, bootstrap, nullptr, -1, "creating the NCCL communicators",
                "a rank never joined (a process that did not start, or runs another bundle?)",
                [pending, lists, ids, devs, ctas](const std::atomic<bool> &) {
                  LOOM_NCCL_CHECK(ncclGroupStart());
                  for (Pending &p : *pending) {
                    const std::vector<int> &members = lists[p.list];
                    int index = int(std::find(members.begin(), members.end(), p.member) - members.begin());
                    LOOM_CUDA_CHECK(cudaSetDevice(devs[p.member]));
                    if (p.list < ctas.size() && ctas[p.list].second > 0) {
                      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
                      config.minCTAs = ctas[p.list].first;
                      config.maxCTAs = ctas[p.list].second;
                      LOOM_NCCL_CHECK(
                          ncclCommInitRankConfig(&p.comm, int(members.size()), ids[p.list], index, &config));
                    } else {
                      LOOM_NCCL_CHECK(ncclCommInitRank(&p.comm, int(members.size()), ids[p.list], index));
                    }
                  }
                  LOOM_NCCL_CHECK(ncclGroupEnd());
                });
  for (Pending &p : *pending)
    (*targets[p.list])[p.member] = p.comm;
}
#endif

NcclWorld::~NcclWorld() {
  freePeerLinks(*this);
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
                                         Communicator *bootstrap, double timeoutSeconds) {
#ifndef LOOM_HAVE_NCCL
  (void)m, (void)devices, (void)self, (void)bootstrap, (void)timeoutSeconds;
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
  world->timeoutSeconds = timeoutSeconds;
  world->bootstrap = bootstrap;
  // Only the groups some instruction names: a rank's "all" group, say, is
  // often named by none, and a communicator costs about 1 GiB of GPU memory
  // with its connections made at creation (below).
  Communicators needed = communicatorsOf(m);
  const std::set<std::vector<int>> &groups = needed.groups;
  const std::set<std::pair<int, int>> &links = needed.links;
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
  // A channel count from the environment (0: NCCL's choice); `fallback` where unset.
  auto channels = [](const char *name, int fallback) {
    const char *v = std::getenv(name);
    if (!v || !*v)
      return fallback;
    char *end = nullptr;
    long n = std::strtol(v, &end, 10);
    if (*end || n < 0 || n > 64)
      fail(LOOM_INVALID_ARGUMENT, name, " must be a channel count from 1 to 64 (0: NCCL's choice), got '", v, "'");
    return int(n);
  };
  // Tensor-parallel groups' collectives stand between two products, with
  // nothing to share the SMs with: 64 channels each (LOOM_NCCL_TP_CTAS=N, 0
  // for NCCL's choice), for 0.8 GiB more of NCCL's buffers. GPT-2 350M tp2
  // sp on two H200s, 2026-11-29: 55.4 ms a step with 64, 56.6-57.2 with 32,
  // 58.9 with 16, 57.6 with NCCL's choice (the whole process's
  // NCCL_MIN_CTAS would slow data-parallel buckets beside the backward).
  int tpCTAs = channels("LOOM_NCCL_TP_CTAS", 64);
  std::set<std::vector<int>> tpLists;
  for (const RankProgram &r : m.ranks)
    if (auto tp = r.groups.find("tp"); tp != r.groups.end() && tp->second.size() > 1)
      tpLists.insert(std::vector<int>(tp->second.begin(), tp->second.end()));
  // ZeRO's groups (a reduce-scatter or all-gather of whole tensors' slices
  // names them): 32 channels each (LOOM_NCCL_ZERO_CTAS=N, 0 for NCCL's
  // choice). The likely reason, not yet seen in a timeline: the weights'
  // gather before the forward is partly exposed, and more channels finish
  // it sooner. GPT-2 350M ZeRO-1 dp2 on two H200s,
  // 2026-11-30: 43.3-43.5 ms a step with 32 against 43.8-43.9 with NCCL's
  // choice (plain dp2 42.6-42.9), 0.09 GiB more of NCCL's buffers; 64: 43.3-
  // 43.8 for 1.28 GiB more. Plain data-parallel buckets gain nothing from
  // more (43.5-43.7 against 43.7-43.9).
  int zeroCTAs = channels("LOOM_NCCL_ZERO_CTAS", 32);
  std::set<std::vector<int>> zeroLists;
  for (const RankProgram &r : m.ranks)
    for (const auto &[name, list] : r.programs)
      for (const Instruction &ins : list)
        if (auto g = r.groups.find(collectiveGroup(ins)); isZeroCollective(ins) && g != r.groups.end() &&
                                                          g->second.size() > 1)
          zeroLists.insert(std::vector<int>(g->second.begin(), g->second.end()));
  std::vector<std::vector<int>> lists;
  std::vector<std::map<int, ncclComm_t> *> targets;
  std::vector<std::pair<int, int>> ctas;
  for (const auto &g : groups) {
    int n = tpLists.count(g) ? tpCTAs : zeroLists.count(g) ? zeroCTAs : 0;
    lists.push_back(g), targets.push_back(&world->groups[g]),
        ctas.push_back(n > 0 ? std::make_pair(n, n) : std::make_pair(0, 0));
  }
  // LOOM_NCCL_LINK_CTAS=N caps the pipeline links' channels: they carry one
  // activation at a time, and each channel holds its own buffers for every
  // protocol (about 1 GiB a communicator at NCCL's default on an H200).
  int linkCTAs = channels("LOOM_NCCL_LINK_CTAS", 0);
  for (auto [from, to] : links)
    lists.push_back({from, to}), targets.push_back(&world->links[{from, to}]),
        ctas.push_back(linkCTAs > 0 ? std::make_pair(1, linkCTAs) : std::make_pair(0, 0));
  // Every connection is made while the communicators are created (NCCL
  // otherwise makes them at a collective's first call, on the host, where a
  // peer whose collectives disagree blocks the call itself, beyond the
  // reach of waitForStreams's timeout: seen with a rank that skipped an
  // all-reduce, 2026-11-27). A user's own NCCL_RUNTIME_CONNECT stays.
  setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0);
  world->createAll(lists, self, bootstrap, targets, ctas);
  makePeerLinks(*world, m, self);
  return world;
#endif
}

void abortNcclWorld(NcclWorld &world, const std::string &reason) {
  std::lock_guard<std::mutex> lock(world.mutex);
  if (world.reason.empty())
    world.reason = reason;
  world.aborted = true;
  if (world.peerAbort)
    *world.peerAbort = 1; // peer barriers waiting on a failed rank return
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

bool CudaBackendImpl::windowsWanted() {
  // The default since two H200s (2026-11-29): GPT-2 350M tp2 sp 50.0 / 50.4
  // ms a step against 55.0 / 55.2 (NCCL's symmetric kernels for the
  // gathers and reduce-scatters), the losses of tiny GPT's tp2 sp within
  // 5.6e-5 of one GPU; ZeRO's gathers too (the CudaBackendImpl constructor
  // picks the group). LOOM_NCCL_WINDOWS=0 goes back to cudaMalloc.
  return !envIs("LOOM_NCCL_WINDOWS", "0");
}

#ifdef LOOM_HAVE_NCCL
void CudaBackendImpl::agreeOnSizes(std::vector<uint64_t> &sizes, const std::string &what) {
  auto agreed = std::make_shared<std::vector<uint64_t>>(sizes);
  ncclComm_t comm = windowComm;
  withinTimeout(world->timeoutSeconds, world->bootstrap, world, device,
                cat("rank ", rank.rank, ": agreeing on ", what, " with group '", windowGroup, "'"),
                cat("a rank of the group never joined (a peer that failed, or one that runs other programs); "
                    "LOOM_NCCL_WINDOWS=0 registers no windows"),
                [agreed, comm](const std::atomic<bool> &) {
                  uint64_t *device = nullptr;
                  cudaStream_t s = nullptr;
                  size_t bytes = agreed->size() * sizeof(uint64_t);
                  LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
                  LOOM_CUDA_CHECK(cudaMalloc(&device, bytes));
                  LOOM_CUDA_CHECK(cudaMemcpyAsync(device, agreed->data(), bytes, cudaMemcpyHostToDevice, s));
                  LOOM_NCCL_CHECK(ncclAllReduce(device, device, agreed->size(), ncclUint64, ncclMax, comm, s));
                  LOOM_CUDA_CHECK(cudaMemcpyAsync(agreed->data(), device, bytes, cudaMemcpyDeviceToHost, s));
                  LOOM_CUDA_CHECK(cudaStreamSynchronize(s));
                  cudaFree(device);
                  cudaStreamDestroy(s);
                });
  sizes = *agreed;
}
#endif

void *CudaBackendImpl::allocShared(size_t bytes, const char *what) {
  void *p = nullptr;
  bytes = std::max<size_t>(bytes, 1);
#ifdef LOOM_HAVE_NCCL
  if (windowComm) {
    // Every member of the group registers a window of the same size: the
    // callers agree on `bytes` first (agreeOnSizes), and the rounding here
    // is the same on every member.
    size_t agreed =
        (bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT * NCCL_WIN_REQUIRED_ALIGNMENT;
    // What the registering thread makes, shared with it: on a timeout it is
    // left behind and must not write into this frame.
    struct Made {
      void *p = nullptr;
      ncclWindow_t win = nullptr;
    };
    auto made = std::make_shared<Made>();
    ncclComm_t comm = windowComm;
    withinTimeout(world->timeoutSeconds, world->bootstrap, world, device,
                  cat("rank ", rank.rank, ": registering its ", what, " (", agreed, " bytes) as an NCCL window of group '",
                      windowGroup, "'"),
                  "a rank of the group never joined (a peer that failed); LOOM_NCCL_WINDOWS=0 registers no windows",
                  [made, comm, agreed](const std::atomic<bool> &abandoned) {
                    ncclResult_t r = ncclMemAlloc(&made->p, agreed);
                    if (r != ncclSuccess)
                      fail(LOOM_UNSUPPORTED, "ncclMemAlloc of ", agreed, " bytes failed (", ncclGetErrorString(r),
                           "); LOOM_NCCL_WINDOWS=0 allocates with cudaMalloc");
                    if (abandoned)
                      return;
                    // A null window where NCCL has no symmetric memory here: a plain buffer then.
                    LOOM_NCCL_CHECK(ncclCommWindowRegister(comm, made->p, agreed, &made->win, NCCL_WIN_COLL_SYMMETRIC));
                  });
    p = made->p;
    if (made->win)
      windows[p] = made->win;
    return p;
  }
  if (sharedByNccl) {
    ncclResult_t r = ncclMemAlloc(&p, bytes);
    if (r != ncclSuccess)
      fail(LOOM_UNSUPPORTED, where, ": ncclMemAlloc of ", bytes, " bytes failed (", ncclGetErrorString(r),
           ") with LOOM_NCCL_REGISTER=1; unset it to allocate with cudaMalloc");
    return p;
  }
#endif
  LOOM_CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}

void CudaBackendImpl::freeShared(void *p) {
  if (!p)
    return;
#ifdef LOOM_HAVE_NCCL
  if (windowComm || sharedByNccl) {
    if (auto w = windows.find(p); w != windows.end()) {
      for (cudaStream_t s : {stream, commStream, sendStream}) // nothing in flight may still use the window
        if (s)
          cudaStreamSynchronize(s);
      // An aborted world's communicators are gone, their windows with them.
      std::lock_guard<std::mutex> lock(world->mutex);
      if (!world->aborted)
        ncclCommWindowDeregister(windowComm, w->second);
      windows.erase(w);
    }
    ncclMemFree(p);
    return;
  }
#endif
  cudaFree(p);
}

} // namespace loom::rt::cuda
