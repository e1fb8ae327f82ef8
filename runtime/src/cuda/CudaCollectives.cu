//===- CudaCollectives.cu - NCCL collectives and transfers ------------------===//
//
// The instructions that use the process's NCCL world (NcclWorld.cu):
// all-reduces (overlapped with the backward on the
// communication stream when "async", joined by event_wait), ZeRO-1's
// reduce-scatter and all-gather, broadcasts, pipeline sends (from staging
// copies on their own stream) and receives, and the cross-rank halves of
// global_norm and vocabulary-parallel cross-entropy. The collectives that
// pack a bucket into one message are in CudaPackedCollectives.cu.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"
#include "runtime/src/Communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

namespace loom::rt {

namespace {
/// A shape as runs along `axis`: the elements before it (outer) and the
/// contiguous run from it on (inner).
std::pair<int64_t, int64_t> runsAround(const Shape &shape, int64_t axis) {
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < axis; ++d)
    outer *= shape[size_t(d)];
  for (size_t d = size_t(axis); d < shape.size(); ++d)
    inner *= shape[d];
  return {outer, inner};
}
} // namespace

} // namespace loom::rt

namespace loom::rt::cuda {

namespace {

__global__ void toFloatKernel(const double *acc, float *out) { *out = static_cast<float>(*acc); }
__global__ void sqrtFloatKernel(float *x) { *x = sqrtf(*x); }

} // namespace


std::pair<int64_t, int64_t> CudaBackendImpl::placeIn(const std::string &group) {
  auto g = rank.groups.find(group);
  if (g == rank.groups.end())
    fail(LOOM_INVALID_BUNDLE, where, ": names group '", group, "', which this rank does not have");
  int64_t index = std::find(g->second.begin(), g->second.end(), rank.rank) - g->second.begin();
  if (index == int64_t(g->second.size()))
    fail(LOOM_INVALID_BUNDLE, where, ": group '", group, "' does not hold rank ", rank.rank);
  return {index, int64_t(g->second.size())};
}

#ifdef LOOM_HAVE_NCCL
const PeerLink *CudaBackendImpl::peerLinkOf(const std::string &group, bool async) const {
  if (!async || !world || world->peerLinks.empty())
    return nullptr;
  auto g = rank.groups.find(group);
  if (g == rank.groups.end())
    return nullptr;
  auto links = world->peerLinks.find(std::vector<int>(g->second.begin(), g->second.end()));
  if (links == world->peerLinks.end())
    return nullptr;
  auto mine = links->second.find(int(rank.rank));
  return mine != links->second.end() && mine->second.scratch ? &mine->second : nullptr;
}

const PeerLink *CudaBackendImpl::exchangeLinkOf(const Instruction &ins, int64_t parts, size_t bytes,
                                                ncclComm_t comm) {
  if (!comm || parts != 2 || !peerZero() || int64_t(bytes) < peerMinBytes())
    return nullptr;
  const PeerLink *link = peerLinkOf(collectiveGroup(ins), asyncCollective(ins));
  return link && link->exchanges && bytes <= link->scratchBytes ? link : nullptr;
}

void CudaBackendImpl::allReduceParts(cudaStream_t s, ncclComm_t comm, const PeerLink *link,
                                     const std::vector<ReducePart> &parts, ncclRedOp_t red,
                                     const std::vector<PeerPart> &wide) {
  std::vector<ReducePart> viaNccl;
  std::vector<PeerPart> viaPeer;
  for (const auto &[data, n, type] : parts) {
    if (n <= 0)
      continue;
    bool f32OrBf16 = type == ncclBfloat16 || type == ncclFloat32;
    if (link && f32OrBf16 && n * (type == ncclBfloat16 ? 2 : 4) >= peerMinBytes())
      viaPeer.push_back({data, n, type == ncclBfloat16});
    else
      viaNccl.push_back({data, n, type});
  }
  if (!viaNccl.empty()) {
    LOOM_NCCL_CHECK(ncclGroupStart()); // a bucket goes out as one group
    for (const auto &[data, n, type] : viaNccl)
      LOOM_NCCL_CHECK(ncclAllReduce(data, data, size_t(n), type, red, comm, s));
    LOOM_NCCL_CHECK(ncclGroupEnd());
  }
  viaPeer.insert(viaPeer.end(), wide.begin(), wide.end());
  if (!viaPeer.empty())
    peerAllReduce(*link, world->peerAbort, viaPeer, red == ncclMax ? 2 : red == ncclAvg ? 1 : 0, s);
}
#endif

Launch CudaBackendImpl::onCommStream(const Instruction &ins, Launch work) {
  // Overlapped with the compute that follows: the bundle guarantees nothing
  // touches the operands until the event's event_wait.
  cudaEvent_t done = commEvent(ins.attrs["event"].get<int64_t>()), ready;
  LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  readyEvents.push_back(ready);
  cudaStream_t cs = commStream;
  buildTraceStream = commStream, buildTrack = "communication";
  return [=](cudaStream_t s) {
    LOOM_CUDA_CHECK(cudaEventRecord(ready, s));
    LOOM_CUDA_CHECK(cudaStreamWaitEvent(cs, ready, 0));
    work(cs);
    LOOM_CUDA_CHECK(cudaEventRecord(done, cs));
  };
}

bool CudaBackendImpl::asyncCollective(const Instruction &ins) {
  return flag(ins, "async") && ins.attrs.contains("event") && ins.attrs["event"].is_number_integer();
}

cudaEvent_t CudaBackendImpl::commEvent(int64_t id) {
  cudaEvent_t &e = commEvents[id];
  if (!e)
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

bool CudaBackendImpl::ncclGraphs() {
  // The default since 2 H200s (2026-11-27): GPT-2 350M bf16 dp2 29.7 ms a
  // step against 30.0 eager, tp2 34.4 against 35.6, tp2 decoding 1.49 ms a
  // token against 2.55; training losses as eager's. LOOM_CUDA_GRAPHS_NCCL=0
  // keeps NCCL calls out of graphs.
  return !envIs("LOOM_CUDA_GRAPHS_NCCL", "0");
}

bool CudaBackendImpl::p2pGraphs() {
  // The default since 2 H200s (2026-11-29): GPT-2 350M bf16 pp2 at four
  // microbatches 54.6 ms a step against 57.5 eager (1F1B), 49.6 against 51.9
  // (ZB-H1), 50.0 against 52.2 (interleaved); at eight (ZB-H1) 57.6 against
  // 63.0. LOOM_CUDA_GRAPHS_P2P=0 keeps sends and receives out of graphs.
  return ncclGraphs() && !envIs("LOOM_CUDA_GRAPHS_P2P", "0");
}

bool CudaBackendImpl::eventInProgram(int64_t event, bool recordedBefore) {
  const std::vector<Instruction> &list = instructions.at(building.first);
  size_t here = building.second;
  for (size_t i = 0; i < list.size(); ++i) {
    const Instruction &ins = list[i];
    if (!ins.attrs.is_object() || ins.attrs.value("event", int64_t(-1)) != event)
      continue;
    if (recordedBefore ? i < here && ins.op != "event_wait" : i > here && ins.op == "event_wait")
      return true;
  }
  return false;
}

Launch CudaBackendImpl::buildEventWait(const Instruction &ins) {
  if (!ins.attrs.contains("event") || !ins.attrs["event"].is_number_integer())
    fail(LOOM_INVALID_BUNDLE, where, ": event_wait needs an integer attribute 'event'");
  // An event an earlier program recorded is complete: run() waits for every
  // stream at the end of each program (and that program joined its
  // collectives back), so there is nothing to wait for.
  if (!eventInProgram(ins.attrs["event"].get<int64_t>(), /*recordedBefore=*/true))
    return [](cudaStream_t) {};
  // Recorded by this program: in a graph with it (the capture joins the
  // communication stream back).
  buildCapturable = ncclGraphs();
  cudaEvent_t e = commEvent(ins.attrs["event"].get<int64_t>());
  return [=](cudaStream_t s) { LOOM_CUDA_CHECK(cudaStreamWaitEvent(s, e, 0)); };
}

Launch CudaBackendImpl::buildCommunication(const Instruction &ins) {
  // NCCL calls are captured in graphs unless LOOM_CUDA_GRAPHS_NCCL=0:
  // collectives, an async one only where this program waits for its event
  // (the capture must join the communication stream back), and pipeline
  // sends and receives unless LOOM_CUDA_GRAPHS_P2P=0 (a program with sends
  // ends on their join, so a send's staging copy is free at the next run).
  buildCapturable = ncclGraphs() && ((ins.op != "send" && ins.op != "recv") || p2pGraphs());
  if (buildCapturable && flag(ins, "async")) {
    buildCapturable = asyncCollective(ins);
    // Waited for by a later program: this one ends by joining its
    // collectives back (buildJoinsComm), which keeps its capture whole.
    if (buildCapturable && !eventInProgram(ins.attrs["event"].get<int64_t>(), /*recordedBefore=*/false))
      buildJoinsComm = true;
  }
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
    // loom-run's LOOM_MEASURE_ONE_RANK: one rank alone, every group of one.
    static const bool alone = std::getenv("LOOM_MEASURE_ONE_RANK") != nullptr;
    if (!world && alone)
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
    // LOOM_CUDA_COLLECTIVES=skip, a measurement only: gradient buckets are
    // not exchanged (each rank keeps its own and the ranks' weights drift
    // apart), to time what data parallelism costs besides its transfers.
    static const bool skipBuckets = envIs("LOOM_CUDA_COLLECTIVES", "skip");
    if (skipBuckets && asyncCollective(ins))
      comm = nullptr;
    bool widens = false, f32 = true;
    for (size_t i = 0; i < ins.in.size(); ++i) {
      widens |= buf(ins.in[i]).dtype != buf(ins.out[i]).dtype;
      f32 &= buf(ins.out[i]).dtype == LOOM_F32;
    }
    if (widens || (ins.in.size() > 1 && f32 && bucketPacked()))
      return buildPackedAllReduce(ins, red, comm);
    std::vector<std::tuple<char *, char *, int64_t>> copies; // in, out, bytes where they differ
    std::vector<ReducePart> parts;
    for (size_t i = 0; i < ins.in.size(); ++i) {
      if (ptr(fp(ins.in[i])) != ptr(fp(ins.out[i])))
        copies.push_back({ptr(fp(ins.in[i])), ptr(fp(ins.out[i])), buf(ins.in[i]).bytes});
      parts.push_back({ptr(fp(ins.out[i])), n(ins.in[i]), ncclType(ins.in[i])});
    }
    const PeerLink *link = comm ? peerLinkOf(group, asyncCollective(ins)) : nullptr;
    auto reduce = [=](cudaStream_t s) {
      for (auto [in, out, bytes] : copies)
        LOOM_CUDA_CHECK(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, s));
      if (comm)
        allReduceParts(s, comm, link, parts, red);
    };
    return asyncCollective(ins) ? onCommStream(ins, reduce) : reduce;
  }
  // ZeRO-1: slice `index` of k = ceil(n / parts) elements of each tensor.
  auto place = [&]() { return placeIn(group); };
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
  if (op == "reduce_scatter" && ins.attrs.contains("axis")) { // x -> this rank's part of the sum
    auto [index, parts] = place();
    (void)index;
    ncclComm_t comm = commOf(group);
    const Shape &in = buf(ins.in[0]).shape;
    int64_t axis = ins.attrs.at("axis").get<int64_t>();
    axis = axis < 0 ? axis + int64_t(in.size()) : axis;
    if (axis < 0 || axis >= int64_t(in.size()) || in[axis] % parts != 0)
      fail(LOOM_INVALID_BUNDLE, where, ": reduce_scatter cannot split axis ", axis, " of ", shapeStr(in), " into ",
           parts, " parts");
    if (buf(ins.in[0]).dtype != buf(ins.out[0]).dtype)
      fail(LOOM_INVALID_BUNDLE, where, ": reduce_scatter's input and output differ in dtype");
    Shape want = in;
    want[size_t(axis)] /= parts;
    if (buf(ins.out[0]).shape != want)
      fail(LOOM_INVALID_BUNDLE, where, ": reduce_scatter of ", shapeStr(in), " over ", parts, " ranks writes ",
           shapeStr(want), ", not ", shapeStr(buf(ins.out[0]).shape));
    int64_t outer, inner; // the part's contiguous run per outer index
    std::tie(outer, inner) = runsAround(in, axis);
    inner /= parts;
    bool mean = ins.attrs.value("reduction", std::string("sum")) == "mean";
    char *src = ptr(fp(ins.in[0])), *dst = ptr(fp(ins.out[0]));
    ncclDataType_t type = ncclType(ins.in[0]);
    size_t width = buf(ins.in[0]).dtype == LOOM_BF16 ? 2 : 4;
    // Async (the backward's, beside the weight gradient's product): on the
    // communication stream, packed in its own workspace.
    bool async = asyncCollective(ins);
    if (outer > 1)
      reserveFor(async, size_t(outer * inner * parts) * width);
    int64_t count = parts;
    Launch run = [=](cudaStream_t s) {
      size_t row = size_t(inner) * width, slab = size_t(outer) * row;
      if (!comm) { // a group of one: the whole sum is its part
        LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, slab, cudaMemcpyDeviceToDevice, s));
        return;
      }
      const char *parted = src;
      if (outer > 1) { // [outer][parts][inner] -> [parts][outer][inner]: each rank's part contiguous
        char *packed = static_cast<char *>(async ? commWorkspace : workspace);
        for (int64_t r = 0; r < count; ++r)
          LOOM_CUDA_CHECK(cudaMemcpy2DAsync(packed + r * slab, row, src + r * row, count * row, row, outer,
                                            cudaMemcpyDeviceToDevice, s));
        parted = packed;
      }
      LOOM_NCCL_CHECK(ncclReduceScatter(parted, dst, size_t(outer * inner), type, mean ? ncclAvg : ncclSum, comm, s));
    };
    return async ? onCommStream(ins, run) : run;
  }
  if (op == "reduce_scatter" && zeroPacked()) {
    auto [index, parts] = place();
    return buildPackedReduceScatter(ins, index, parts, commOf(group));
  }
  if (op == "all_gather" && !ins.attrs.contains("axis") && zeroPacked()) {
    auto [index, parts] = place();
    return buildPackedAllGather(ins, index, parts, commOf(group));
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
    if (axis < 0 || axis >= int64_t(in.size()))
      fail(LOOM_INVALID_BUNDLE, where, ": all_gather's axis ", ins.attrs.at("axis").get<int64_t>(),
           " is out of range for ", shapeStr(in));
    Shape want = in;
    want[size_t(axis)] *= parts;
    if (buf(ins.out[0]).shape != want)
      fail(LOOM_INVALID_BUNDLE, where, ": all_gather of ", parts, " parts of ", shapeStr(in), " writes ",
           shapeStr(want), ", not ", shapeStr(buf(ins.out[0]).shape));
    int64_t outer, inner;
    std::tie(outer, inner) = runsAround(in, axis);
    // Moved as elements of their size: f32, bf16 (serving's tensor-parallel
    // logits), i32 or i64 (the token ids of loom-gather-embedding-rows).
    loom_dtype_t dtype = buf(ins.in[0]).dtype;
    if (dtype != buf(ins.out[0]).dtype)
      fail(LOOM_INVALID_BUNDLE, where, ": all_gather's input and output differ in dtype");
    ncclDataType_t type = dtype == LOOM_BF16 ? ncclBfloat16 : dtype == LOOM_F32 ? ncclFloat32
                          : dtype == LOOM_I32 ? ncclInt32 : dtype == LOOM_I64 ? ncclInt64 : ncclNumTypes;
    if (type == ncclNumTypes)
      fail(LOOM_UNSUPPORTED, where, ": all_gather along an axis of a ", dtypeName(dtype), " tensor");
    char *src = arena + buf(ins.in[0]).offset, *dst = arena + buf(ins.out[0]).offset;
    size_t width = size_t(dtypeSize(dtype));
    bool async = asyncCollective(ins); // beside the products that do not need it (loom-overlap-tensor-gather)
    if (outer > 1)
      reserveFor(async, size_t(outer * inner * parts) * width);
    int64_t count = parts;
    Launch run = [=](cudaStream_t s) {
      size_t slab = size_t(outer * inner) * width, row = size_t(inner) * width;
      // Without a communicator (a rank measured alone, LOOM_MEASURE_ONE_RANK)
      // every part is this rank's own: the gathered token ids of
      // loom-gather-embedding-rows stay ids of the table.
      auto copies = [&](char *to) {
        for (int64_t r = 0; r < count; ++r)
          LOOM_CUDA_CHECK(cudaMemcpyAsync(to + r * slab, src, slab, cudaMemcpyDeviceToDevice, s));
      };
      if (outer == 1) { // the parts are contiguous in the result: gathered in place
        if (comm)
          LOOM_NCCL_CHECK(ncclAllGather(src, dst, size_t(inner), type, comm, s));
        else
          copies(dst);
        return;
      }
      char *whole = static_cast<char *>(async ? commWorkspace : workspace); // [parts][outer][inner]
      if (comm)
        LOOM_NCCL_CHECK(ncclAllGather(src, whole, size_t(outer * inner), type, comm, s));
      else
        copies(whole);
      for (int64_t r = 0; r < count; ++r) // into [outer][parts][inner]
        LOOM_CUDA_CHECK(cudaMemcpy2DAsync(dst + r * row, count * row, whole + r * slab, row, row, outer,
                                          cudaMemcpyDeviceToDevice, s));
    };
    return async ? onCommStream(ins, run) : run;
  }
  if (op == "all_gather") { // pairs of slice and whole tensor, gathered as one NCCL group
    for (int64_t id : ins.out)
      if (buf(id).dtype != LOOM_F32)
        fail(LOOM_UNSUPPORTED, where, ": gathers into ", dtypeName(buf(id).dtype), " tensor '", buf(id).name,
             "', which only the packed ZeRO-1 collectives do; unset LOOM_CUDA_ZERO_PACKED=0");
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
    buildTraceStream = sendStream, buildTrack = "send";
    // Captured, the program ends on its sends' join (prepare), so the
    // staging copy's last send is done before the next run copies into it
    // (a wait for an event recorded outside a capture cannot be captured);
    // eager runs still wait, in case a run failed before its end, unless the
    // last send was captured: its graph ended on the join, and CUDA refuses
    // a wait outside a capture for an event recorded in one (an eager run
    // after a replay, as GPT-2 350M's pp2 step made on 2 H200s).
    return [=](cudaStream_t s) {
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      LOOM_CUDA_CHECK(cudaStreamIsCapturing(s, &capturing));
      if (copy->used && !copy->sentInGraph && capturing == cudaStreamCaptureStatusNone)
        LOOM_CUDA_CHECK(cudaStreamWaitEvent(s, copy->sent, 0)); // its last send is done
      copy->used = true;
      copy->sentInGraph = capturing != cudaStreamCaptureStatusNone;
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
  // The loss writing its gradient over the logits (loom-fuse-loss-gradient):
  // loss, then the gradient with the seed grad_scale, from the same statistics.
  bool fused = op == "cross_entropy" && ins.out.size() == 2;
  if (fused && ins.out[1] != ins.in[0])
    fail(LOOM_INVALID_BUNDLE, where, ": writes the loss's gradient over the logits: its second output must be its "
         "first input");
  float seed = fused ? float(ins.attrs.value("grad_scale", 1.0)) : 0.0f;
  float *dl = grad ? f(ins.in[2]) : nullptr;
  DPtr out = fp(ins.out[0]);
  reserve(4 * rows * sizeof(float));
  // Whole 16-byte vectors a row: the logits', and the gradient's (the same
  // dtype and layout), read and written eight values at a time.
  bool vec = v % 8 == 0 && reinterpret_cast<uintptr_t>(pl.p) % 16 == 0 &&
             (!grad || reinterpret_cast<uintptr_t>(out.p) % 16 == 0);
  // The compiler's kernels (KernelGenVocabLoss.cpp) where it wrote them;
  // LOOM_CUDA_GENERATED=0 runs ours.
  bool generated = ins.attrs.contains("kernel") && ins.attrs["kernel"].is_string() && kernelsLibrary &&
                   generatedKernelsOn();
  cudaKernel_t maxFn = nullptr, sumFn = nullptr, gradFn = nullptr;
  if (generated) {
    const nlohmann::json launch = ins.attrs.value("launch", nlohmann::json::object());
    int64_t vector = launch.value("vector", int64_t(1));
    if (launch.value("grid", int64_t(0)) != rows || launch.value("block", 0) != 256 || vector < 1 || v % vector ||
        launch.value("start", int64_t(-1)) != start || launch.value("full", int64_t(-1)) != full)
      fail(LOOM_INVALID_BUNDLE, where, ": the vocabulary-parallel loss's launch ", launch.dump(), " does not match ",
           rows, " rows of ", v, " columns from ", start, " of ", full);
    std::vector<int64_t> vectors = {ins.in[0], ins.out.back()};
    requireVectorAligned({&vectors}, vector);
    maxFn = generatedKernel(ins, "_max"), sumFn = generatedKernel(ins, "_sum");
    if (grad || fused)
      gradFn = generatedKernel(ins, "_grad");
  }
  unsigned grid = unsigned(rows);
  return [=](cudaStream_t s) {
    float *rowMax = reinterpret_cast<float *>(workspace), *stats = rowMax + rows, *rowLoss = stats + 2 * rows;
    if (generated)
      launchGenerated(maxFn, grid, 256, {pl.p, rowMax}, s);
    else
      rowMaxKernel<<<int(rows), kThreads, 0, s>>>(pl, rowMax, v, vec);
    if (comm)
      LOOM_NCCL_CHECK(ncclAllReduce(rowMax, rowMax, size_t(rows), ncclFloat32, ncclMax, comm, s));
    if (generated)
      launchGenerated(sumFn, grid, 256, {pl.p, pl.p, pt, rowMax, stats, err}, s);
    else
      rowSumTargetKernel<<<int(rows), kThreads, 0, s>>>(pl, pt, wide, rowMax, stats, rows, v, start, full, err, vec);
    if (comm)
      LOOM_NCCL_CHECK(ncclAllReduce(stats, stats, size_t(2 * rows), ncclFloat32, ncclSum, comm, s));
    // (softmax - onehot) * (dloss or the seed) / rows into `to`.
    auto gradient = [&](float *dloss, DPtr to) {
      if (!generated)
        splitCrossEntropyGradKernel<<<int(rows), kThreads, 0, s>>>(pl, pt, wide, rowMax, stats, dloss, seed, to, rows,
                                                                   v, start, vec);
      else if (dloss)
        launchGenerated(gradFn, grid, 256, {pl.p, pt, rowMax, stats, dloss, to.p}, s);
      else // the seed is the kernel's constant
        launchGenerated(gradFn, grid, 256, {pl.p, pt, rowMax, stats, to.p}, s);
    };
    if (grad) {
      gradient(dl, out);
      return;
    }
    splitLossRowsKernel<<<blocksFor(rows), kThreads, 0, s>>>(rowMax, stats, rowLoss, rows);
    meanKernel<<<1, 1024, 0, s>>>(rowLoss, rows, static_cast<float *>(out.p));
    if (fused)
      gradient(nullptr, pl);
  };
#endif
}

namespace {
const char *const kCommunicationOps[] = {"all_reduce", "broadcast_from", "send", "recv",
                                         "reduce_scatter", "all_gather", "shard_of"};
} // namespace

void CudaBackendImpl::addCollectiveBuilders(BuilderTable &table) {
  for (const char *op : kCommunicationOps)
    table[op] = &CudaBackendImpl::buildCommunication;
  table["event_wait"] = &CudaBackendImpl::buildEventWait;
}

bool communicates(const std::string &op) {
  // Besides the communication instructions, the norm and the loss of a
  // split model all-reduce over their group.
  for (const char *name : kCommunicationOps)
    if (op == name)
      return true;
  return op == "global_norm" || op == "cross_entropy" || op == "cross_entropy_grad";
}

void CudaBackendImpl::waitForStreams(const std::string &program, std::vector<Step> &steps) {
  cudaStream_t streams[] = {stream, sendStream, commStream};
#ifdef LOOM_HAVE_NCCL
  if (!world) {
#endif
    for (cudaStream_t s : streams)
      LOOM_CUDA_CHECK(cudaStreamSynchronize(s));
    (void)program, (void)steps;
    return;
#ifdef LOOM_HAVE_NCCL
  }
  // The first collective whose work has not finished ("" if none).
  auto pending = [&]() -> std::string {
    for (Step &step : steps)
      if (step.communicated && cudaEventQuery(step.communicated) == cudaErrorNotReady)
        return step.what;
    return "";
  };
  // The streams are polled without sleeping: a sleep of the default timer
  // slack (50 us and more) at each of a step's three program ends showed as
  // 0.1-0.15 ms gaps between programs in ResNet-50 dp2 traces (2 H200s).
  // The checks for failures (a mutex, every communicator) run every 0.5 ms.
  // LOOM_CUDA_WAIT_SLEEP=1: the old way, sleeping 100 us a poll after the
  // first thousand.
  static const bool sleepy = [] {
    return envIs("LOOM_CUDA_WAIT_SLEEP", "1");
  }();
  auto start = std::chrono::steady_clock::now(), lastCheck = start, lastFailureCheck = start;
  std::string lostBefore; // a gone peer, seen at the last check with a collective unfinished
  for (int spins = 0;; ++spins) {
    bool idle = true;
    for (cudaStream_t s : streams) {
      cudaError_t e = cudaStreamQuery(s);
      if (e == cudaErrorNotReady)
        idle = false;
      else
        LOOM_CUDA_CHECK(e);
    }
    if (idle)
      return;
    if (!sleepy) {
      auto now = std::chrono::steady_clock::now();
      if (now - lastFailureCheck < std::chrono::microseconds(500) && !world->aborted) {
        std::this_thread::yield();
        continue;
      }
      lastFailureCheck = now;
    }
    if (world->aborted)
      fail(LOOM_INVALID_ARGUMENT, program, ": stopped with every rank: ", world->abortReason());
    std::string failure;
    {
      std::lock_guard<std::mutex> lock(world->mutex);
      auto check = [&](const auto &table) {
        for (const auto &[members, comms] : table) {
          auto mine = comms.find(int(rank.rank));
          ncclResult_t state = ncclSuccess;
          if (failure.empty() && mine != comms.end() && mine->second &&
              ncclCommGetAsyncError(mine->second, &state) == ncclSuccess && state != ncclSuccess &&
              state != ncclInProgress)
            failure = cat("NCCL reported '", ncclGetErrorString(state), "' (", ncclGetLastError(nullptr), ")");
        }
      };
      if (!world->aborted) {
        check(world->groups);
        check(world->links);
      }
    }
    auto now = std::chrono::steady_clock::now();
    double waited = std::chrono::duration<double>(now - start).count();
    if (failure.empty() && waited > world->timeoutSeconds)
      failure = cat("waited ", world->timeoutSeconds, " s");
    // A peer process that is gone while a collective is unfinished (twice in
    // a row, 200 ms apart: one that just finished the same step and exited
    // is no failure).
    if (failure.empty() && world->bootstrap && now - lastCheck > std::chrono::milliseconds(200)) {
      lastCheck = now;
      std::string lost = world->bootstrap->lostPeers(), what = pending();
      if (!lost.empty() && !what.empty() && lostBefore == lost + what)
        failure = cat("waited while ", lost);
      lostBefore = lost.empty() || what.empty() ? "" : lost + what;
    }
    if (!failure.empty()) {
      std::string what = pending();
      if (what.empty())
        what = cat("the collectives of program '", program, "'");
      std::string message = cat("rank ", rank.rank, " ", failure, " in ", what,
                                "; aborted every NCCL communicator and stopping every rank");
      abortNcclWorld(*world, message); // the kernels waiting on peers return, on every rank of this process
      fail(LOOM_INVALID_ARGUMENT, message);
    }
    if (sleepy && spins > 1000)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
#endif
}

} // namespace loom::rt::cuda
