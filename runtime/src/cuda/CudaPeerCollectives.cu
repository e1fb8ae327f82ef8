//===- CudaPeerCollectives.cu - Two-rank collectives by the copy engines --===//
//
// Where both ranks of a two-rank data-parallel group run in this process
// on GPUs that reach each other's memory, the group's asynchronous
// all-reduces (its gradient buckets) go around NCCL: NCCL's kernels
// hold SMs for as long as the bytes take to cross the link, and a product
// that finds SMs taken waits for a second round on them. On two H200s a
// cuBLASLt product of GPT-2 350M's shapes ran 1.82-1.86x as long beside
// NCCL's all-reduces of 64 MiB as alone, 1.00-1.03x beside copy-engine
// copies to the peer, and 1.11-1.13x beside the all-reduce below
// (bench/contention.cu, 2026-11-30). In the step the gain is smaller, since
// the adds and the copies' HBM traffic still slow the backward's kernels:
// GPT-2 350M dp2 42.8-43.2 ms against NCCL's 43.2-43.8 (three calls,
// eight of nine rounds faster); with the adds 16 bytes a thread, 43.3-43.6
// against 43.9-44.2 on a slower pair (1.88-1.89x one GPU); GPT 1.3B level.
// Buckets averaged in bf16 (loomc --grad-reduce bf16) stay with NCCL: level
// or slower over peers. LOOM_CUDA_PEER_COLLECTIVES=0 leaves every
// all-reduce to NCCL.
//
// A call reduces a list of tensors in place, in waves that fit the scratch:
//
//   1. each rank pushes, for every piece of the wave, the half its peer
//      reduces into the peer's scratch (copy-engine copies over the link);
//   2. a barrier: a one-thread kernel raises a count in the peer's memory
//      and waits for the peer's count in its own (it shares its SM with the
//      products: it holds no shared memory and a warp's registers);
//   3. each rank adds the peer's copy of its halves into its own (short,
//      memory-bound kernels, 16 bytes a thread: sum, mean or max, f32 or
//      bf16 added in f32);
//   4. each rank pushes its reduced halves into the peer's scratch;
//   5. a barrier;
//   6. each rank copies the peer's reduced halves into place.
//
// Both ranks end with the same bits: each half is combined once, on one
// rank, and a + b is b + a. The next wave's pushes wait behind the barrier
// of step 5, which the peer reaches only after its step 3 has read its
// scratch; the next wave's step 4 waits behind its step 2, after the
// peer's step 6. The counts live in device memory, so the same launches
// replay in a CUDA graph. A barrier whose peer never comes spins until the
// world is aborted (the host's timeout in waitForStreams, or another
// rank's failure), which sets a mapped host word every barrier reads.
//
// ZeRO's reduce-scatters and all-gathers over a two-rank group are
// exchanges (peerExchange): each rank pushes what its peer needs (the
// peer's part of every gradient, or its own part of every weight) into the
// peer's scratch, each part a copy-engine copy straight from the tensor (no
// kernel packs them: CudaPackedCollectives.cu), a barrier, and each reads
// the peer's parts from its own scratch as it sums them (reduce-scatter)
// or copies them into place (all-gather). A rank may push only after the
// peer has read what the last collective left there: every exchange ends
// by raising a release count in the peer's memory (peerReleased), and the
// next collective over the link first waits for the peer's count to reach
// its own (the all-reduces too, where a link carries both). GPT-2 350M on
// two H200s (2026-11-30): ZeRO-1 41.4-41.7 ms a step against one GPU's
// 40.1-40.6 and dp2's 42.5-42.7, and 44.5 through NCCL; ZeRO-2 42.4,
// ZeRO-3 42.8. LOOM_CUDA_PEER_ZERO=0 leaves them to NCCL.
//
// A bucket's bf16 gradients that it widens into f32 means (loomc
// --grad-reduce wide, the default for a two-rank group within a node)
// cross as bf16 and are summed in f32 into their outputs, whose reduced
// f32 halves come back: the same bits as widening first, without that pass
// and with half the bytes out. GPT-2 350M dp2 on two H200s: 42.2, 42.6,
// 42.5 ms a step against 42.5, 42.9, 42.8 with the products writing f32
// gradients, and 43.1, 43.3, 42.7 widening first; in a second call 42.6,
// 42.2, 42.2 against 42.3, 42.6, 42.4 (2026-11-30): faster in five rounds
// of six. LOOM_CUDA_PEER_WIDE=0 widens first.
//
// Where nothing but the update reads those f32 means (the global norm and
// AdamW's gradient operand), the update makes them (DeferredPart): the
// bucket copies each rank's bf16 gradient into the first half of its f32
// output's memory and pushes it whole into the peer's deferred region (both
// by the copy engines, between two barriers), and the update reads the
// pair, combining it as the all-reduce would have (the same bits: tiny
// GPT's losses identical with our AdamW both ways). No kernel runs beside
// the backward's, no reduced halves come back, none are copied into place;
// the cost is 2 bytes a parameter of GPU memory. GPT-2 350M dp2 on two
// H200s (2026-11-30, three calls): 42.2, 42.3, 42.3 and 42.5, 42.6, 42.0 ms
// a step against 43.1, 43.0, 42.8 and 43.0, 42.9, 43.0 (14.27 GiB in use
// against 13.71); GPT 1.3B 131.5 against 132.9. LOOM_CUDA_PEER_DEFER=0 sums
// in the all-reduce; a GPU without room for the region beside the arena
// does too.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"

#include <cuda.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <type_traits>

namespace loom::rt::cuda {

namespace {

/// Spins until the count the peer writes at `count` reaches `want`, or the
/// world is aborted (the host then reports why).
__device__ inline void waitForCount(const unsigned *count, unsigned want, const volatile int *abort) {
  for (unsigned spins = 0;; ++spins) {
    unsigned seen;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
    if (int(seen - want) >= 0)
      break;
    if ((spins & 1023) == 0 && *abort)
      break;
    __nanosleep(128);
  }
}

__global__ void peerBarrierKernel(unsigned *counter, const unsigned *mine, unsigned *theirs,
                                  const volatile int *abort) {
  unsigned e = *counter + 1;
  *counter = e;
  // What this stream wrote into the peer's memory before this kernel (its
  // copies are complete: stream order) is visible before the count is.
  __threadfence_system();
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(theirs), "r"(e) : "memory");
  waitForCount(mine, e, abort);
  __threadfence_system();
}

/// ZeRO's exchanges (peerExchange) end by raising `arrived` in the peer's
/// memory once this rank has read its scratch; the next collective over the
/// link waits here, before it writes into the peer's scratch, until the
/// peer has arrived as often as this rank has.
__global__ void peerWaitReleasedKernel(const unsigned *arrived, const unsigned *peerArrived, const volatile int *abort) {
  waitForCount(peerArrived, *arrived, abort);
}

__global__ void peerReleaseKernel(unsigned *arrived, unsigned *theirs) {
  unsigned e = *arrived + 1;
  *arrived = e;
  __threadfence_system();
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(theirs), "r"(e) : "memory");
}

/// mine[i] = op(mine[i], theirs[i]): 0 sum, 1 mean of two, 2 max; 16 bytes
/// a thread (the first `vectors` * 16 bytes, both ends 16-byte aligned),
/// then element by element. Short: it shares the SMs with the products.
template <typename T>
__global__ void peerCombineKernel(T *mine, const T *theirs, int64_t n, int64_t vectors, int op) {
  constexpr int kPer = 16 / sizeof(T);
  GRID_LOOP(v, vectors) {
    uint4 x = reinterpret_cast<const uint4 *>(mine)[v], y = reinterpret_cast<const uint4 *>(theirs)[v];
    T *a = reinterpret_cast<T *>(&x);
    const T *b = reinterpret_cast<const T *>(&y);
#pragma unroll
    for (int j = 0; j < kPer; ++j)
      a[j] = fromF<T>(combinePair(toF(a[j]), toF(b[j]), op));
    reinterpret_cast<uint4 *>(mine)[v] = x;
  }
  GRID_LOOP(i, n - vectors * kPer) {
    int64_t at = vectors * kPer + i;
    mine[at] = fromF<T>(combinePair(toF(mine[at]), toF(theirs[at]), op));
  }
}

template <typename T> void launchCombine(T *mine, const T *theirs, int64_t n, int op, cudaStream_t s) {
  constexpr int kPer = 16 / sizeof(T);
  bool aligned = (reinterpret_cast<uintptr_t>(mine) | reinterpret_cast<uintptr_t>(theirs)) % 16 == 0;
  int64_t vectors = aligned ? n / kPer : 0;
  peerCombineKernel<T><<<blocksFor(std::max<int64_t>(vectors, n - vectors * kPer)), kThreads, 0, s>>>(
      mine, theirs, n, vectors, op);
}

/// out[i] = op(mine[i], theirs[i]) in f32 from bf16 operands (a bf16
/// gradient's f32 sum or mean: the same bits as widening both first); 16
/// bytes of each operand a thread where all three are 16-byte aligned.
__global__ void peerWideCombineKernel(float *out, const __nv_bfloat16 *mine, const __nv_bfloat16 *theirs, int64_t n,
                                      int64_t vectors, int op) {
  GRID_LOOP(v, vectors) {
    uint4 x = reinterpret_cast<const uint4 *>(mine)[v], y = reinterpret_cast<const uint4 *>(theirs)[v];
    const __nv_bfloat16 *a = reinterpret_cast<const __nv_bfloat16 *>(&x), *b = reinterpret_cast<const __nv_bfloat16 *>(&y);
    float4 r[2];
    float *f = reinterpret_cast<float *>(r);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      f[j] = combinePair(toF(a[j]), toF(b[j]), op);
    reinterpret_cast<float4 *>(out)[2 * v] = r[0];
    reinterpret_cast<float4 *>(out)[2 * v + 1] = r[1];
  }
  GRID_LOOP(i, n - vectors * 8) {
    int64_t at = vectors * 8 + i;
    out[at] = combinePair(toF(mine[at]), toF(theirs[at]), op);
  }
}

void launchWideCombine(float *out, const __nv_bfloat16 *mine, const __nv_bfloat16 *theirs, int64_t n, int op,
                       cudaStream_t s) {
  bool aligned = (reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(mine) |
                  reinterpret_cast<uintptr_t>(theirs)) % 16 == 0;
  int64_t vectors = aligned ? n / 8 : 0;
  peerWideCombineKernel<<<blocksFor(std::max<int64_t>(vectors, n - vectors * 8)), kThreads, 0, s>>>(
      out, mine, theirs, n, vectors, op);
}

/// One piece of a wave: `len` elements at `in`, reduced into `out` (the
/// same place, or a bf16 gradient's f32 output); rank 0 reduces the first
/// `h`, rank 1 the rest; both halves sit at `at` in each rank's scratch
/// (the first half of the scratch receives, the second returns).
struct Piece {
  char *in, *out;
  int64_t len, h;
  size_t inWidth, outWidth, at;
};

} // namespace

bool peerCollectives() { return !envIs("LOOM_CUDA_PEER_COLLECTIVES", "0"); }

bool peerZero() { return peerCollectives() && !envIs("LOOM_CUDA_PEER_ZERO", "0"); }

int64_t peerMinBytes() {
  // Below this NCCL's all-reduce is faster (its low-latency protocol against
  // two barriers and three copies): LOOM_CUDA_PEER_BELOW, in bytes.
  static const int64_t below = [] {
    const char *e = std::getenv("LOOM_CUDA_PEER_BELOW");
    return e ? std::max<int64_t>(0, std::atoll(e)) : int64_t(256) << 10;
  }();
  return below;
}

bool peerDefer() { return peerCollectives() && !envIs("LOOM_CUDA_PEER_DEFER", "0") && !envIs("LOOM_CUDA_PEER_WIDE", "0"); }

/// Raises this rank's count in the peer's memory and waits for the peer's.
static void barrier(const PeerLink &link, const volatile int *abort, cudaStream_t s) {
  peerBarrierKernel<<<1, 1, 0, s>>>(link.counter, link.flag, link.peer->flag, abort);
}

void copyAll(const std::vector<PeerCopy> &copies, cudaStream_t s) {
  for (const PeerCopy &c : copies)
    if (c.bytes)
      LOOM_CUDA_CHECK(cudaMemcpyAsync(c.to, c.from, c.bytes, cudaMemcpyDeviceToDevice, s));
}

void peerDeferredPush(const PeerLink &link, const volatile int *abort, const std::vector<PeerCopy> &locals,
                      const std::vector<PeerCopy> &pushes, cudaStream_t s) {
  copyAll(locals, s);
  barrier(link, abort, s);
  copyAll(pushes, s);
  barrier(link, abort, s);
}

static void waitReleased(const PeerLink &link, const volatile int *abort, cudaStream_t s) {
  peerWaitReleasedKernel<<<1, 1, 0, s>>>(link.released, link.peerReleased, abort);
}

void peerReleased(const PeerLink &link, cudaStream_t s) {
  peerReleaseKernel<<<1, 1, 0, s>>>(link.released, link.peer->peerReleased);
}

void peerExchange(const PeerLink &link, const volatile int *abort, const std::vector<PeerPiece> &pieces,
                  cudaStream_t s) {
  for (const PeerPiece &p : pieces)
    if (p.at + p.bytes > link.scratchBytes)
      fail(LOOM_INTERNAL, "peer exchange to bytes ", p.at, "-", p.at + p.bytes, "; the scratch holds ",
           link.scratchBytes);
  waitReleased(link, abort, s); // the peer has read what the last collective left in its scratch
  for (const PeerPiece &p : pieces)
    if (p.bytes)
      LOOM_CUDA_CHECK(cudaMemcpyAsync(link.peer->scratch + p.at, p.from, p.bytes, cudaMemcpyDeviceToDevice, s));
  barrier(link, abort, s);
}

void peerAllReduce(const PeerLink &link, const volatile int *abort, const std::vector<PeerPart> &parts, int op,
                   cudaStream_t s) {
  size_t half = link.scratchBytes / 2;
  // Where ZeRO's exchanges share the link: wait until the peer has read
  // what the last one left in its scratch, and say when this one's reads
  // are done (see peerExchange).
  if (link.exchanges)
    waitReleased(link, abort, s);
  auto align = [](size_t b) { return (b + 255) / 256 * 256; };
  // Pieces of at most half the scratch's half each (64-element halves),
  // sized by the wider of the pushed and the returned elements.
  std::vector<std::vector<Piece>> waves(1);
  size_t used = 0;
  for (const PeerPart &p : parts) {
    size_t inWidth = p.bf16 ? 2 : 4, outWidth = p.out ? 4 : inWidth;
    int64_t most = int64_t(half / outWidth / 64 * 64) * 2 - 128; // elements whose larger half fits
    for (int64_t c = 0; c < p.n; c += most) {
      int64_t len = std::min(most, p.n - c);
      int64_t h = std::min(len, ((len + 1) / 2 + 63) / 64 * 64);
      size_t need = align(size_t(std::max(h, len - h)) * outWidth);
      if (used + need > half)
        waves.emplace_back(), used = 0;
      char *in = p.data + size_t(c) * inWidth;
      waves.back().push_back({in, p.out ? p.out + size_t(c) * outWidth : in, len, h, inWidth, outWidth, used});
      used += need;
    }
  }
  auto copy = [&](char *to, const char *from, size_t bytes) {
    if (bytes)
      LOOM_CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, s));
  };
  bool first = link.index == 0;
  // Where this rank's half of a piece starts, and how long it is; the other's.
  auto mine = [&](const Piece &p) { return std::make_pair(first ? 0 : p.h, first ? p.h : p.len - p.h); };
  auto other = [&](const Piece &p) { return std::make_pair(first ? p.h : 0, first ? p.len - p.h : p.h); };
  for (const std::vector<Piece> &wave : waves) {
    if (wave.empty())
      continue;
    for (const Piece &p : wave) { // 1
      auto [at, n] = other(p);
      copy(link.peer->scratch + p.at, p.in + size_t(at) * p.inWidth, size_t(n) * p.inWidth);
    }
    barrier(link, abort, s); // 2
    for (const Piece &p : wave) { // 3, 4
      auto [at, n] = mine(p);
      if (n == 0)
        continue;
      char *out = p.out + size_t(at) * p.outWidth;
      const char *in = p.in + size_t(at) * p.inWidth, *theirs = link.scratch + p.at;
      if (p.inWidth == 4)
        launchCombine(reinterpret_cast<float *>(out), reinterpret_cast<const float *>(theirs), n, op, s);
      else if (p.outWidth == 2)
        launchCombine(reinterpret_cast<__nv_bfloat16 *>(out), reinterpret_cast<const __nv_bfloat16 *>(theirs), n, op,
                      s);
      else
        launchWideCombine(reinterpret_cast<float *>(out), reinterpret_cast<const __nv_bfloat16 *>(in),
                          reinterpret_cast<const __nv_bfloat16 *>(theirs), n, op, s);
      copy(link.peer->scratch + half + p.at, out, size_t(n) * p.outWidth);
    }
    barrier(link, abort, s); // 5
    for (const Piece &p : wave) { // 6
      auto [at, n] = other(p);
      copy(p.out + size_t(at) * p.outWidth, link.scratch + half + p.at, size_t(n) * p.outWidth);
    }
  }
  if (link.exchanges)
    peerReleased(link, s);
}

} // namespace loom::rt::cuda

namespace loom::rt {

namespace {

// CUDA's virtual memory calls, from the driver through the runtime (the
// runtime library is all the backend links).
struct Vmm {
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemSetAccess) setAccess = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemAddressFree) addressFree = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  bool ok = false;
};

const Vmm &vmm() {
  static const Vmm v = [] {
    Vmm v;
    auto get = [&](const char *name, auto &fn) {
      void *p = nullptr;
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
          q == cudaDriverEntryPointSuccess)
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
      return fn != nullptr;
    };
    v.ok = get("cuMemGetAllocationGranularity", v.granularity) & get("cuMemCreate", v.create) &
           get("cuMemAddressReserve", v.reserve) & get("cuMemMap", v.map) & get("cuMemSetAccess", v.setAccess) &
           get("cuMemUnmap", v.unmap) & get("cuMemAddressFree", v.addressFree) & get("cuMemRelease", v.release);
    return v;
  }();
  return v;
}

void checkCu(CUresult r, const char *what) {
  if (r != CUDA_SUCCESS)
    fail(LOOM_INTERNAL, "peer collectives: ", what, " failed (CUresult ", int(r),
         "); LOOM_CUDA_PEER_COLLECTIVES=0 leaves the all-reduces to NCCL");
}

/// `bytes` on GPU `device`, readable and writable by it and by GPU `peer`.
void allocateShared(PeerLink &l, int device, int peer, size_t bytes) {
  const Vmm &v = vmm();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  size_t grain = 0;
  checkCu(v.granularity(&grain, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity");
  bytes = (bytes + grain - 1) / grain * grain;
  CUmemGenericAllocationHandle handle = 0;
  checkCu(v.create(&handle, bytes, &prop, 0), "cuMemCreate");
  CUdeviceptr p = 0;
  checkCu(v.reserve(&p, bytes, grain, 0, 0), "cuMemAddressReserve");
  checkCu(v.map(p, bytes, 0, handle, 0), "cuMemMap");
  CUmemAccessDesc access[2] = {};
  for (int i = 0; i < 2; ++i) {
    access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[i].location.id = i == 0 ? device : peer;
    access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  checkCu(v.setAccess(p, bytes, access, 2), "cuMemSetAccess");
  l.handle = handle, l.bytes = bytes, l.base = reinterpret_cast<char *>(p);
}

/// Bytes of each end's scratch (LOOM_CUDA_PEER_SCRATCH_MIB, 256 by default):
/// a wave reduces up to half as many bytes of each rank's halves.
size_t peerScratchBytes() {
  const char *e = std::getenv("LOOM_CUDA_PEER_SCRATCH_MIB");
  long long mib = e ? std::atoll(e) : 256;
  if (mib < 2 || mib > 16384)
    fail(LOOM_INVALID_ARGUMENT, "LOOM_CUDA_PEER_SCRATCH_MIB must be from 2 to 16384 (MiB), got '", e, "'");
  return size_t(mib) << 20;
}

} // namespace

/// A deferred part's bytes in the region: its bf16 gradient, 256-byte aligned.
static size_t deferredSpan(int64_t n) { return (size_t(n) * 2 + 255) / 256 * 256; }

std::vector<DeferredPart> deferredParts(const RankProgram &r) {
  std::vector<DeferredPart> parts;
  if (!cuda::peerDefer() || cuda::envIs("LOOM_CUDA_COLLECTIVES", "skip"))
    return parts;
  auto dp = r.groups.find("dp");
  if (dp == r.groups.end() || dp->second.size() != 2)
    return parts;
  // What every instruction does to each storage: the outputs' other users.
  auto storage = [&](int64_t id) {
    return id >= 0 && size_t(id) < r.buffers.size() ? storageOf(r, id) : int64_t(-1);
  };
  std::set<int64_t> viewed, named; // storages with views; inputs, outputs, parameters and state
  for (const Buffer &b : r.buffers)
    if (b.viewOf >= 0)
      viewed.insert(storage(b.id));
  for (const auto *list : {&r.inputs, &r.outputs, &r.state})
    for (const NamedBuffer &nb : *list)
      named.insert(storage(nb.buffer));
  for (const Parameter &p : r.params)
    named.insert(storage(p.buffer));
  std::map<int64_t, bool> onlyUpdates; // storage -> whether every other use is a norm's or AdamW's gradient read
  std::map<int64_t, int> writers;
  for (const auto &[name, list] : r.programs)
    for (const Instruction &ins : list) {
      for (int64_t id : ins.out)
        ++writers[storage(id)];
      for (size_t k = 0; k < ins.in.size(); ++k) {
        int64_t st = storage(ins.in[k]);
        bool update = (ins.op == "global_norm" && !ins.attrs.contains("group") && !ins.attrs.contains("kernel")) ||
                      (ins.op == "adamw" && k == 1 && ins.in.size() == 6);
        auto [it, fresh] = onlyUpdates.emplace(st, update);
        if (!fresh)
          it->second = it->second && update;
      }
    }
  size_t at = 0;
  for (const auto &[name, list] : r.programs)
    for (const Instruction &ins : list) {
      if (ins.op != "all_reduce" || !ins.attrs.is_object())
        continue;
      std::string reduction = ins.attrs.value("reduction", std::string("sum"));
      if (!ins.attrs.value("async", false) || !ins.attrs.contains("event") ||
          !ins.attrs["event"].is_number_integer() || ins.attrs.value("group", std::string("dp")) != "dp" ||
          ins.attrs.value("wire", std::string("f32")) == "bf16" || (reduction != "sum" && reduction != "mean") ||
          ins.in.size() != ins.out.size())
        continue;
      for (size_t i = 0; i < ins.in.size(); ++i) {
        int64_t in = ins.in[i], out = ins.out[i];
        if (storage(in) < 0 || storage(out) != out)
          continue;
        const Buffer &bi = r.buffers[size_t(in)], &bo = r.buffers[size_t(out)];
        auto n = numElements(bi.shape);
        if (!n || numElements(bo.shape) != n || bi.dtype != LOOM_BF16 || bo.dtype != LOOM_F32 ||
            *n * 2 < cuda::peerMinBytes() || *n * 4 < cuda::bucketPackBelow() || viewed.count(out) ||
            named.count(out) || writers[out] != 1 || !onlyUpdates.count(out) || !onlyUpdates[out])
          continue;
        parts.push_back({in, out, *n, at, reduction == "mean" ? 1 : 0});
        at += deferredSpan(*n);
      }
    }
  return parts;
}

size_t deferredBytes(const std::vector<DeferredPart> &parts) {
  return parts.empty() ? 0 : parts.back().at + deferredSpan(parts.back().n);
}

/// Whether rank `r` has a two-rank "dp" bucket that widens a large bf16
/// gradient into its f32 mean (loomc --grad-reduce wide): over peer memory
/// its bf16 halves cross; through NCCL it is widened first.
static bool widensLargeBf16(const RankProgram &r) {
  for (const auto &[name, list] : r.programs)
    for (const Instruction &ins : list) {
      auto g = r.groups.find(collectiveGroup(ins));
      if (ins.op != "all_reduce" || collectiveGroup(ins) != "dp" || g == r.groups.end() || g->second.size() != 2 ||
          ins.attrs.value("wire", std::string("f32")) == "bf16" || ins.in.size() != ins.out.size())
        continue;
      for (size_t i = 0; i < ins.in.size(); ++i) {
        const Buffer &in = r.buffers.at(size_t(ins.in[i]));
        if (in.dtype == LOOM_BF16 && r.buffers.at(size_t(ins.out[i])).dtype == LOOM_F32 && in.bytes >= (1 << 20))
          return true;
      }
    }
  return false;
}

void makePeerLinks(NcclWorld &world, const Manifest &m, int self) {
  using cuda::checkCuda;
  if (self >= 0) {
    // One process a rank (mpirun, Slurm): no peer links, so NCCL reduces
    // the buckets; a bundle compiled for them (wide) widens first.
    if (self == 0 && !m.ranks.empty() && widensLargeBf16(m.ranks.front()))
      std::fprintf(stderr, "loom: note: this bundle's dp2 buckets sum bf16 weight gradients (loomc --grad-reduce "
                           "wide, the default for two ranks in a node), which is faster where both ranks run in "
                           "one process (loom-run's default); in one process a rank, compile with --grad-reduce "
                           "f32 (GPT-2 350M on two H200s: 43.0 ms a step against 43.6)\n");
    return;
  }
  if (!cuda::peerCollectives() || !vmm().ok)
    return;
  // Two-rank "dp" groups with an asynchronous all-reduce, or (unless
  // LOOM_CUDA_PEER_ZERO=0) with ZeRO's asynchronous reduce-scatters and
  // all-gathers: member lists -> whether ZeRO's exchanges use the link.
  std::map<std::vector<int>, bool> wanted;
  for (const RankProgram &r : m.ranks)
    for (const auto &[name, list] : r.programs)
      for (const Instruction &ins : list) {
        // Data parallelism's gradient buckets and ZeRO's slices only: a
        // tensor-parallel all-reduce stands between products, where NCCL's
        // lower latency counts (not measured over peer memory); buckets
        // averaged in bf16 stay with NCCL.
        bool bucket = ins.op == "all_reduce" && ins.attrs.value("wire", std::string("f32")) != "bf16";
        bool zero = isZeroCollective(ins) && cuda::peerZero();
        if ((!bucket && !zero) || !ins.attrs.value("async", false) || !ins.attrs.contains("event") ||
            collectiveGroup(ins) != "dp")
          continue;
        auto g = r.groups.find(collectiveGroup(ins));
        if (g != r.groups.end() && g->second.size() == 2)
          wanted[std::vector<int>(g->second.begin(), g->second.end())] |= zero;
      }
  if (wanted.empty())
    return;
  int current = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&current));
  size_t scratch = peerScratchBytes();
  for (const auto &[members, exchanges] : wanted) {
    int a = world.devices.at(size_t(members[0])), b = world.devices.at(size_t(members[1]));
    int ab = 0, ba = 0;
    if (a == b)
      continue;
    // Both ranks' deferred parts, which must lie alike (the same programs);
    // none where ZeRO's exchanges share the link.
    size_t deferred = 0;
    if (!exchanges) {
      std::vector<const RankProgram *> programs;
      for (int member : members)
        for (const RankProgram &r : m.ranks)
          if (r.rank == member)
            programs.push_back(&r);
      if (programs.size() == 2) {
        std::vector<DeferredPart> first = deferredParts(*programs[0]), second = deferredParts(*programs[1]);
        bool alike = first.size() == second.size();
        for (size_t k = 0; alike && k < first.size(); ++k)
          alike = first[k].n == second[k].n && first[k].at == second[k].at && first[k].op == second[k].op;
        deferred = alike ? deferredBytes(first) : 0;
        // Only where both GPUs have room for it beside the arena and the
        // scratch, with 2 GiB to spare (workspaces, NCCL): otherwise the
        // all-reduce sums the buckets, as before.
        for (int i = 0; deferred && i < 2; ++i) {
          size_t free = 0, total = 0;
          LOOM_CUDA_CHECK(cudaSetDevice(i == 0 ? a : b));
          LOOM_CUDA_CHECK(cudaMemGetInfo(&free, &total));
          size_t need = size_t(std::max<int64_t>(programs[size_t(i)]->arenaBytes, 0)) + scratch + deferred +
                        (size_t(2) << 30);
          if (free < need)
            deferred = 0;
        }
      }
    }
    LOOM_CUDA_CHECK(cudaDeviceCanAccessPeer(&ab, a, b));
    LOOM_CUDA_CHECK(cudaDeviceCanAccessPeer(&ba, b, a));
    if (!ab || !ba)
      continue; // NCCL's all-reduce, as before
    if (!world.peerAbort) {
      int *word = nullptr;
      LOOM_CUDA_CHECK(cudaHostAlloc(&word, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
      *word = 0;
      world.peerAbort = word;
    }
    PeerLink *ends[2];
    for (int i = 0; i < 2; ++i) {
      PeerLink &l = world.peerLinks[members][members[size_t(i)]];
      int device = i == 0 ? a : b, peer = i == 0 ? b : a;
      LOOM_CUDA_CHECK(cudaSetDevice(device));
      // [counter, flag, released, peerReleased], then the scratch at 256
      // bytes, then the deferred region
      allocateShared(l, device, peer, 256 + scratch + deferred);
      LOOM_CUDA_CHECK(cudaMemset(l.base, 0, 256));
      l.counter = reinterpret_cast<unsigned *>(l.base);
      l.flag = l.counter + 1;
      l.released = l.counter + 2;
      l.peerReleased = l.counter + 3;
      l.exchanges = exchanges;
      l.scratch = l.base + 256;
      l.scratchBytes = scratch;
      l.deferred = deferred ? l.scratch + scratch : nullptr;
      l.deferredBytes = deferred;
      l.index = i;
      ends[i] = &l;
    }
    ends[0]->peer = ends[1], ends[1]->peer = ends[0];
  }
  for (int d : world.devices) {
    LOOM_CUDA_CHECK(cudaSetDevice(d));
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
  }
  LOOM_CUDA_CHECK(cudaSetDevice(current));
}

std::string describePeerLinks(const NcclWorld &world) {
  std::string out;
  for (const auto &[members, ranks] : world.peerLinks) {
    out += out.empty() ? "ranks " : ", ranks ";
    out += std::to_string(members[0]) + "-" + std::to_string(members[1]);
    auto end = ranks.find(members[0]);
    if (end != ranks.end() && end->second.exchanges)
      out += " (ZeRO's slices too)";
    if (end != ranks.end() && end->second.deferredBytes)
      out += cat(" (sums in the update: ", (end->second.deferredBytes + (1 << 20) - 1) >> 20, " MiB a rank)");
  }
  return out;
}

void freePeerLinks(NcclWorld &world) {
  const Vmm &v = vmm();
  for (auto &[members, ranks] : world.peerLinks)
    for (auto &[r, l] : ranks) {
      if (l.base) {
        auto p = reinterpret_cast<CUdeviceptr>(l.base);
        v.unmap(p, l.bytes);
        v.addressFree(p, l.bytes);
        v.release(l.handle);
      }
      l = PeerLink{};
    }
  world.peerLinks.clear();
  if (world.peerAbort)
    cudaFreeHost(const_cast<int *>(world.peerAbort));
  world.peerAbort = nullptr;
}

} // namespace loom::rt
