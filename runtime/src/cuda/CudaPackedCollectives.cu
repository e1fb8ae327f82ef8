//===- CudaPackedCollectives.cu - Buckets and ZeRO-1 slices as one span ---===//
//
// The collectives that pack many tensors into one message: a data-parallel
// bucket's all-reduce (small tensors end to end, bf16 gradients widened into
// their f32 means, or averaged as bf16 with "wire": "bf16"), and ZeRO-1's
// reduce-scatter, all-gather and shard_of over a bucket's slices. Each packs
// with one kernel over a table of the tensors (PackedTensor), calls NCCL
// once, and unpacks with one more.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"

#include <algorithm>
#include <cstdlib>

namespace loom::rt::cuda {

namespace {

__device__ inline int tensorOf(const PackedTensor *t, int count, int64_t j) { // offsets ascend
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (t[mid].offset <= j)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

/// packed[p][span]: part p of every tensor, zero past a tensor's end.
__global__ void packPartsKernel(const PackedTensor *t, int count, int64_t span, int64_t parts, float *packed) {
  GRID_LOOP(i, parts * span) {
    int64_t p = i / span, j = i % span;
    const PackedTensor &x = t[tensorOf(t, count, j)];
    int64_t at = p * x.k + (j - x.offset);
    packed[i] = at >= x.n       ? 0.0f
                : x.bf16Whole ? __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(x.whole)[at])
                              : x.whole[at];
  }
}

/// Each tensor's shard from this rank's span.
__global__ void unpackShardsKernel(const PackedTensor *t, int count, int64_t span, const float *mine) {
  GRID_LOOP(j, span) {
    const PackedTensor &x = t[tensorOf(t, count, j)];
    x.shard[j - x.offset] = mine[j];
  }
}

/// Each whole tensor from every rank's span (gathered[p][span]), of type T
/// (f32 masters, or bf16 copies: `whole` then holds a bf16 tensor's address).
template <typename T>
__global__ void unpackWholesKernel(const PackedTensor *t, int count, int64_t span, int64_t parts, const T *gathered) {
  GRID_LOOP(i, parts * span) {
    int64_t p = i / span, j = i % span;
    const PackedTensor &x = t[tensorOf(t, count, j)];
    int64_t at = p * x.k + (j - x.offset);
    if (at < x.n)
      reinterpret_cast<T *>(x.whole)[at] = gathered[i];
  }
}

/// shard_of over a run of tensors: each shard its part `index` of its tensor.
__global__ void shardsOfKernel(const PackedTensor *t, int count, int64_t span, int64_t index) {
  GRID_LOOP(j, span) {
    const PackedTensor &x = t[tensorOf(t, count, j)];
    int64_t at = index * x.k + (j - x.offset);
    x.shard[j - x.offset] = at < x.n ? x.whole[at] : 0.0f;
  }
}

/// This rank's span from each tensor's shard, rounded to T (f32, or bf16
/// as a cast rounds: the gather of mixed-precision ZeRO-1's bf16 copies).
template <typename T> __device__ inline T packedAs(float v);
template <> __device__ inline float packedAs(float v) { return v; }
template <> __device__ inline __nv_bfloat16 packedAs(float v) { return __float2bfloat16_rn(v); }
/// As unpackWholesKernel, a block row per (part, tensor) segment: each a
/// contiguous copy, without a search for its tensor per element.
template <typename T>
__global__ void unpackWholeSegmentsKernel(const PackedTensor *t, int count, int64_t span, const T *gathered) {
  int64_t p = blockIdx.y / count;
  const PackedTensor &x = t[blockIdx.y % count];
  int64_t begin = p * x.k, len = min(x.k, x.n - begin);
  const T *src = gathered + p * span + x.offset;
  T *dst = reinterpret_cast<T *>(x.whole) + begin;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < len; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

/// As packShardsKernel, a block row per tensor.
template <typename T> __global__ void packShardSegmentsKernel(const PackedTensor *t, T *mine) {
  const PackedTensor &x = t[blockIdx.y];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < x.k; i += int64_t(gridDim.x) * blockDim.x)
    mine[x.offset + i] = packedAs<T>(x.shard[i]);
}

template <typename T> __global__ void packShardsKernel(const PackedTensor *t, int count, int64_t span, T *mine) {
  GRID_LOOP(j, span) {
    const PackedTensor &x = t[tensorOf(t, count, j)];
    mine[j] = packedAs<T>(x.shard[j - x.offset]);
  }
}

/// A bucket's tensors as f32, a bf16 one widened: end to end into `packed`
/// (its small tensors, one message), or where `packed` is null each into its
/// own f32 output (its large ones, reduced there in place).
__global__ void widenBucketKernel(const PackedTensor *t, int count, int64_t span, float *packed) {
  GRID_LOOP(j, span) {
    const PackedTensor &x = t[tensorOf(t, count, j)];
    int64_t at = j - x.offset;
    float v = x.bf16Whole ? __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(x.whole)[at]) : x.whole[at];
    (packed ? packed[j] : x.shard[at]) = v;
  }
}

/// --grad-reduce bf16: a bucket's small bf16 gradients into one bf16 span
/// (`whole` holds each tensor's bf16 address).
__global__ void packBf16Kernel(const PackedTensor *t, int count, int64_t span, __nv_bfloat16 *packed) {
  GRID_LOOP(j, span) {
    const PackedTensor &x = t[tensorOf(t, count, j)];
    packed[j] = reinterpret_cast<const __nv_bfloat16 *>(x.whole)[j - x.offset];
  }
}

/// The bf16 means, widened into each tensor's f32 output (`shard`); the
/// span may have gaps between tensors (alignment), which are skipped.
__global__ void widenBf16MeansKernel(const PackedTensor *t, int count, int64_t span, const __nv_bfloat16 *means) {
  GRID_LOOP(j, span) {
    const PackedTensor &x = t[tensorOf(t, count, j)];
    if (j - x.offset < x.n)
      x.shard[j - x.offset] = __bfloat162float(means[j]);
  }
}

// The same copies by segments: a block row per tensor (or per part and
// tensor), each a contiguous copy, without a search for its tensor per
// element over the whole span. Grid stride along each row.
#define SEGMENT_LOOP(i, n) for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

__device__ inline float wholeAt(const PackedTensor &x, int64_t at) {
  return x.bf16Whole ? __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(x.whole)[at]) : x.whole[at];
}

/// Element `at` of a whole as T: f32 (a bf16 whole widened), or bf16 as it is.
template <typename T> __device__ inline T partAt(const PackedTensor &x, int64_t at);
template <> __device__ inline float partAt(const PackedTensor &x, int64_t at) { return wholeAt(x, at); }
template <> __device__ inline __nv_bfloat16 partAt(const PackedTensor &x, int64_t at) {
  return reinterpret_cast<const __nv_bfloat16 *>(x.whole)[at];
}

/// As packPartsKernel: row y is part y / count of tensor y % count, at
/// packed[p * stride + offset]; T bf16 keeps bf16 gradients bf16.
template <typename T>
__global__ void packPartSegmentsKernel(const PackedTensor *t, int count, int64_t stride, T *packed) {
  int64_t p = blockIdx.y / count;
  const PackedTensor &x = t[blockIdx.y % count];
  T *dst = packed + p * stride + x.offset;
  SEGMENT_LOOP(i, x.k) {
    int64_t at = p * x.k + i;
    dst[i] = at < x.n ? partAt<T>(x, at) : T(0.0f);
  }
}

/// Each tensor's f32 shard: the sum over ranks, in rank order, of this
/// rank's own part (packed[self]) and the parts the others sent
/// (received[q]), times `scale`. Alone (ranks 1) the shard is its own part.
__global__ void sumShardSegmentsKernel(const PackedTensor *t, const __nv_bfloat16 *packed,
                                       const __nv_bfloat16 *received, int64_t stride, int64_t ranks, int64_t self,
                                       float scale) {
  const PackedTensor &x = t[blockIdx.y];
  SEGMENT_LOOP(i, x.k) {
    int64_t at = x.offset + i;
    float sum = 0.0f;
    if (ranks == 1)
      sum = __bfloat162float(packed[self * stride + at]);
    else
      for (int64_t q = 0; q < ranks; ++q)
        sum += __bfloat162float(q == self ? packed[self * stride + at] : received[q * stride + at]);
    x.shard[i] = sum * scale;
  }
}

/// How many elements of x's whole part `part` holds: k, fewer for the
/// last part of a tensor that does not divide evenly, none past its end.
__host__ __device__ inline int64_t partLength(const PackedTensor &x, int64_t part) {
  int64_t left = x.n - part * x.k;
  return left <= 0 ? 0 : left < x.k ? left : x.k;
}

/// Two ranks over peer memory: each tensor's f32 shard from this rank's
/// own part of its gradient, read in place, and the peer's part of it,
/// pushed into this rank's scratch (`theirs`, `slot` bytes an element from
/// the tensor's offset): added in rank order as sumShardSegmentsKernel adds
/// (the same bits), zero past the gradient's end, times `scale`. Gradients
/// are bf16 where `allBf16` or their entry says so, else f32.
__global__ void sumPeerPartsKernel(const PackedTensor *t, const char *theirs, int slot, bool allBf16, int64_t self,
                                   float scale) {
  const PackedTensor &x = t[blockIdx.y];
  bool bf = allBf16 || x.bf16Whole;
  int64_t begin = self * x.k, len = partLength(x, self);
  const char *from = theirs + x.offset * slot;
  SEGMENT_LOOP(i, x.k) {
    float sum = 0.0f;
    if (i < len) {
      float mine = bf ? __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(x.whole)[begin + i]) : x.whole[begin + i];
      float peer = bf ? __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(from)[i])
                      : reinterpret_cast<const float *>(from)[i];
      sum += self == 0 ? mine : peer;
      sum += self == 0 ? peer : mine;
    }
    x.shard[i] = sum * scale;
  }
}

/// Two ranks over peer memory: each whole's own part (part `self`) from
/// this rank's shard, rounded to T as packShardSegmentsKernel rounds.
template <typename T> __global__ void shardsIntoWholesKernel(const PackedTensor *t, int64_t self) {
  const PackedTensor &x = t[blockIdx.y];
  int64_t begin = self * x.k, len = partLength(x, self);
  T *dst = reinterpret_cast<T *>(x.whole) + begin;
  SEGMENT_LOOP(i, len) dst[i] = packedAs<T>(x.shard[i]);
}

/// As unpackShardsKernel.
__global__ void unpackShardSegmentsKernel(const PackedTensor *t, const float *mine) {
  const PackedTensor &x = t[blockIdx.y];
  SEGMENT_LOOP(i, x.k) x.shard[i] = mine[x.offset + i];
}

/// As widenBucketKernel.
__global__ void widenSegmentsKernel(const PackedTensor *t, float *packed) {
  const PackedTensor &x = t[blockIdx.y];
  float *dst = packed ? packed + x.offset : x.shard;
  SEGMENT_LOOP(i, x.n) dst[i] = wholeAt(x, i);
}

/// As packBf16Kernel.
__global__ void packBf16SegmentsKernel(const PackedTensor *t, __nv_bfloat16 *packed) {
  const PackedTensor &x = t[blockIdx.y];
  const auto *src = reinterpret_cast<const __nv_bfloat16 *>(x.whole);
  SEGMENT_LOOP(i, x.n) packed[x.offset + i] = src[i];
}

/// As widenBf16MeansKernel.
__global__ void widenBf16MeansSegmentsKernel(const PackedTensor *t, const __nv_bfloat16 *means) {
  const PackedTensor &x = t[blockIdx.y];
  SEGMENT_LOOP(i, x.n) x.shard[i] = __bfloat162float(means[x.offset + i]);
}

} // namespace

/// Whether the packing kernels copy by segments (the default), and their
/// grid: rows of blocks, each row striding over up to `longest` elements.
/// LOOM_CUDA_PACK_SEGMENTS=0 (or the older LOOM_CUDA_ZERO_SEGMENTS=0) keeps
/// the kernels that search for each element's tensor, to compare.
static bool packBySegments(int64_t rows) {
  // Read as each collective is prepared, not once, so that a test can
  // compare both kernels in one process.
  bool on = !envIs("LOOM_CUDA_PACK_SEGMENTS", "0") && !envIs("LOOM_CUDA_ZERO_SEGMENTS", "0");
  return on && rows >= 1 && rows <= 65535;
}
static dim3 segmentGrid(int64_t longest, int64_t rows) {
  return dim3(unsigned(std::max<int64_t>(1, std::min<int64_t>((longest + 4 * kThreads - 1) / (4 * kThreads), 1024))),
              unsigned(std::max<int64_t>(1, rows)));
}
/// The most elements a tensor of [first, last) holds: a segment row's length.
static int64_t longestOf(const PackedTensor *first, const PackedTensor *last) {
  int64_t longest = 0;
  for (; first != last; ++first)
    longest = std::max(longest, first->n);
  return longest;
}

bool CudaBackendImpl::bucketPacked() {
  return !envIs("LOOM_CUDA_BUCKET_PACKED", "0");
}

int64_t bucketPackBelow() {
  // A bucket's small tensors (under LOOM_CUDA_BUCKET_PACK_BELOW bytes as
  // f32, 1 MiB by default) go as one packed message instead of one NCCL
  // call each: a ResNet bucket holds up to a hundred tensors, most of them a
  // batch norm's few hundred floats, and each call of a group pays its own
  // latency.
  static const int64_t packBelow = [] {
    const char *e = std::getenv("LOOM_CUDA_BUCKET_PACK_BELOW");
    return e ? std::max<int64_t>(0, std::atoll(e)) : int64_t(1) << 20;
  }();
  return !envIs("LOOM_CUDA_BUCKET_PACKED", "0") ? packBelow : 0; // CudaBackendImpl::bucketPacked()
}

const DeferredPart *CudaBackendImpl::deferredOf(int64_t out) {
#ifdef LOOM_HAVE_NCCL
  if (!deferredKnown) {
    deferredKnown = true;
    const PeerLink *link = peerLinkOf("dp", /*async=*/true);
    std::vector<DeferredPart> parts = link && link->deferredBytes ? deferredParts(rank) : std::vector<DeferredPart>{};
    if (!parts.empty() && deferredBytes(parts) != link->deferredBytes) // both ranks' barriers must match
      fail(LOOM_INTERNAL, "rank ", rank.rank, "'s deferred bucket sums need ", deferredBytes(parts),
           " bytes but its link holds ", link->deferredBytes, "; LOOM_CUDA_PEER_DEFER=0 sums in the all-reduce");
    if (!parts.empty()) {
      deferredLink = link;
      for (const DeferredPart &d : parts)
        deferred[d.out] = d;
    }
  }
  auto it = deferred.find(out);
  return it == deferred.end() ? nullptr : &it->second;
#else
  (void)out;
  return nullptr;
#endif
}

bool CudaBackendImpl::zeroPacked() {
  // The default since 2 H200s (2026-11-27): GPT-2 350M bf16 ZeRO-1 dp2 39.2
  // ms a step packed against 40.2 per tensor, losses within 1.1e-4 of one
  // GPU (per tensor 3.3e-4). LOOM_CUDA_ZERO_PACKED=0 goes back.
  return !envIs("LOOM_CUDA_ZERO_PACKED", "0");
}

bool CudaBackendImpl::shardsTogether(const Instruction &a, const Instruction &b) {
  return zeroPacked() && a.op == "shard_of" && b.op == "shard_of" && a.in.size() == 1 && b.in.size() == 1 &&
         a.out.size() == 1 && b.out.size() == 1 &&
         a.attrs.value("group", std::string("dp")) == b.attrs.value("group", std::string("dp")) &&
         buf(a.in[0]).dtype == LOOM_F32 && buf(b.in[0]).dtype == LOOM_F32 && buf(a.out[0]).dtype == LOOM_F32 &&
         buf(b.out[0]).dtype == LOOM_F32;
}

const PackedTensor *CudaBackendImpl::packedTensors(const std::vector<int64_t> &wholes,
                                                   const std::vector<int64_t> &shards, int64_t parts, int64_t &span,
                                                   bool bf16Wholes, bool eitherWholes, std::vector<PackedTensor> *host) {
  if (wholes.size() != shards.size())
    fail(LOOM_INVALID_BUNDLE, where, ": ", wholes.size(), " tensors but ", shards.size(), " shards");
  std::vector<PackedTensor> list;
  span = 0;
  for (size_t i = 0; i < wholes.size(); ++i) {
    int64_t whole = wholes[i], shard = shards[i];
    int64_t n = count(buf(whole).shape), k = count(buf(shard).shape);
    if (k * parts < n)
      fail(LOOM_INVALID_BUNDLE, where, ": shard ", i, " holds ", k, " elements; ", parts, " of them cannot hold ", n);
    if (bf16Wholes && buf(whole).dtype != LOOM_BF16)
      fail(LOOM_INVALID_BUNDLE, where, ": gathers into f32 and bf16 tensors at once; one dtype per all_gather");
    // A reduce-scatter's bf16 gradient (loom-bf16-step-casts), widened as it is packed.
    bool bf = bf16Wholes || (eitherWholes && buf(whole).dtype == LOOM_BF16);
    float *w = bf ? reinterpret_cast<float *>(ptr(buf(whole))) : f(whole);
    list.push_back({w, f(shard), n, k, span, int32_t(eitherWholes && bf)});
    span += k;
  }
  if (host)
    *host = list;
  return deviceArray(list);
}

Launch CudaBackendImpl::buildShardsOf(const std::vector<Instruction> &instrs, size_t begin, size_t end) {
  auto [self, parts] = placeIn(instrs[begin].attrs.value("group", std::string("dp")));
  int64_t index = self; // a plain variable: lambdas capture it (C++17)
  std::vector<int64_t> wholes, shards;
  for (size_t i = begin; i < end; ++i)
    wholes.push_back(instrs[i].in[0]), shards.push_back(instrs[i].out[0]);
  int64_t span = 0;
  const PackedTensor *table = packedTensors(wholes, shards, parts, span);
  int count = int(wholes.size());
  return [=](cudaStream_t s) {
    shardsOfKernel<<<blocksFor(span), kThreads, 0, s>>>(table, count, span, index);
  };
}

#ifdef LOOM_HAVE_NCCL
// ZeRO-1's collectives over a bucket as one NCCL call each: every tensor's
// parts packed so that rank p's parts of all of them are one contiguous
// span (two kernel launches around the call, instead of a copy, a fill and
// an NCCL call per tensor). The reduce-scatter runs on the communication
// stream when the bundle marks it async (its event_wait comes before the
// update reads the shards), in the communication stream's own workspace.

Launch CudaBackendImpl::inCommWorkspace(const Instruction &ins, Launch run) {
  if (asyncCollective(ins))
    return onCommStream(ins, run);
  // On the compute stream, after what the communication stream has in
  // flight (its workspace is the communication stream's).
  cudaEvent_t ready = nullptr;
  LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  readyEvents.push_back(ready);
  cudaStream_t cs = commStream;
  buildCapturable = false; // it waits for an event of a stream outside any capture
  return [=](cudaStream_t s) {
    LOOM_CUDA_CHECK(cudaEventRecord(ready, cs));
    LOOM_CUDA_CHECK(cudaStreamWaitEvent(s, ready, 0));
    run(s);
  };
}

bool CudaBackendImpl::wideSums() {
  // The default since two H200s (2026-11-29): GPT-2 350M's ZeRO-1 dp2 46.0 /
  // 46.2 ms a step against 46.6 / 46.4 with NCCL's f32 reduce-scatter (ZeRO-2
  // 46.1 against 46.4, ZeRO-3 47.0 against 47.5), tiny GPT's ZeRO-1/2/3
  // losses bit for bit the same. Read as each collective is prepared, so
  // that a test can compare both.
  return !envIs("LOOM_CUDA_WIDE_SUMS", "0");
}

Launch CudaBackendImpl::buildPackedReduceScatter(const Instruction &ins, int64_t index, int64_t parts,
                                                 ncclComm_t comm) {
  // The bf16 gradients take the wide sums, the f32 ones (a tied embedding's
  // sum) NCCL's f32 reduce-scatter, one after the other.
  if (!wideSums() || ins.in.size() != ins.out.size()) // (packedTensors names a size mismatch)
    return inCommWorkspace(ins, widenedScatterRun(ins, index, parts, comm));
  Instruction bf16s = ins, f32s = ins;
  bf16s.in.clear(), bf16s.out.clear(), f32s.in.clear(), f32s.out.clear();
  for (size_t i = 0; i < ins.in.size(); ++i) {
    Instruction &part = buf(ins.in[i]).dtype == LOOM_BF16 ? bf16s : f32s;
    part.in.push_back(ins.in[i]), part.out.push_back(ins.out[i]);
  }
  if (bf16s.in.empty())
    return inCommWorkspace(ins, widenedScatterRun(ins, index, parts, comm));
  Launch wide = wideSumScatterRun(bf16s, index, parts, comm);
  if (f32s.in.empty())
    return inCommWorkspace(ins, wide);
  Launch rest = widenedScatterRun(f32s, index, parts, comm);
  return inCommWorkspace(ins, [wide, rest](cudaStream_t s) { wide(s), rest(s); });
}

/// The pieces of `list`'s wholes that part `part` holds (each tensor's
/// elements [part * k, ...), at most k; 2 bytes an element where `allBf16`
/// or the entry says bf16, else 4), each to `slot` bytes an element from
/// its tensor's offset in the peer's scratch.
static std::vector<PeerPiece> partPieces(const std::vector<PackedTensor> &list, int64_t part, bool allBf16,
                                         size_t slot) {
  std::vector<PeerPiece> pieces;
  for (const PackedTensor &x : list) {
    size_t width = allBf16 || x.bf16Whole ? 2 : 4;
    int64_t begin = part * x.k, len = partLength(x, part);
    if (len > 0)
      pieces.push_back({size_t(x.offset) * slot, reinterpret_cast<const char *>(x.whole) + size_t(begin) * width,
                        size_t(len) * width});
  }
  return pieces;
}

/// A two-rank reduce-scatter over peer memory, without packing: each
/// gradient's part for the peer pushed by the copy engines straight from
/// the gradient, then every shard summed from this rank's own part, read in
/// place, and the peer's (sumPeerPartsKernel).
static Launch peerScatterRun(const PackedTensor *table, const std::vector<PackedTensor> &list, int64_t self,
                             float scale, bool allBf16, const PeerLink *link, const volatile int *abort, dim3 grid) {
  size_t slot = allBf16 ? 2 : 4;
  std::vector<PeerPiece> pieces = partPieces(list, 1 - self, allBf16, slot);
  return [=](cudaStream_t s) {
    peerExchange(*link, abort, pieces, s);
    sumPeerPartsKernel<<<grid, kThreads, 0, s>>>(table, link->scratch, int(slot), allBf16, self, scale);
    peerReleased(*link, s);
  };
}

Launch CudaBackendImpl::widenedScatterRun(const Instruction &ins, int64_t index, int64_t parts, ncclComm_t comm) {
  bool mean = ins.attrs.value("reduction", std::string("mean")) == "mean";
  int64_t span = 0;
  // gradients (f32, or bf16 widened as they are packed), their shards
  std::vector<PackedTensor> list;
  const PackedTensor *table = packedTensors(ins.in, ins.out, parts, span, false, /*eitherWholes=*/true, &list);
  int count = int(ins.in.size());
  int64_t self = index, longest = 0;
  for (int64_t id : ins.out)
    longest = std::max(longest, numElements(buf(id).shape).value_or(0));
  bool segments = packBySegments(parts * count);
  dim3 packGrid = segmentGrid(longest, parts * count), unpackGrid = segmentGrid(longest, count);
  // Two ranks over peer memory (by segments only): no packing, nothing in the workspace.
  if (const PeerLink *link = segments ? exchangeLinkOf(ins, parts, size_t(span) * sizeof(float), comm) : nullptr)
    return peerScatterRun(table, list, self, mean ? 0.5f : 1.0f, /*allBf16=*/false, link, world->peerAbort,
                          unpackGrid);
  commWorkspaceBytes = std::max(commWorkspaceBytes, size_t((parts + 1) * span) * sizeof(float));
  auto run = [this, table, count, span, parts, self, comm, mean, segments, packGrid, unpackGrid](cudaStream_t s) {
    float *packed = reinterpret_cast<float *>(commWorkspace), *mine = packed + parts * span;
    if (segments)
      packPartSegmentsKernel<<<packGrid, kThreads, 0, s>>>(table, count, span, packed);
    else
      packPartsKernel<<<blocksFor(parts * span), kThreads, 0, s>>>(table, count, span, parts, packed);
    if (comm)
      LOOM_NCCL_CHECK(ncclReduceScatter(packed, mine, size_t(span), ncclFloat32, mean ? ncclAvg : ncclSum, comm, s));
    else
      LOOM_CUDA_CHECK(cudaMemcpyAsync(mine, packed + self * span, span * sizeof(float), cudaMemcpyDeviceToDevice, s));
    if (segments)
      unpackShardSegmentsKernel<<<unpackGrid, kThreads, 0, s>>>(table, mine);
    else
      unpackShardsKernel<<<blocksFor(span), kThreads, 0, s>>>(table, count, span, mine);
  };
  return run;
}

/// Sends each peer q its part packed[q] and receives its part of this
/// rank's into received[q] (bf16, `span` elements each, one NCCL group).
static void exchangeParts(const __nv_bfloat16 *packed, __nv_bfloat16 *received, int64_t stride, int64_t span,
                          int64_t parts, int64_t self, ncclComm_t comm, cudaStream_t s) {
  LOOM_NCCL_CHECK(ncclGroupStart());
  for (int64_t q = 0; q < parts; ++q)
    if (q != self) {
      LOOM_NCCL_CHECK(ncclSend(packed + q * stride, size_t(span), ncclBfloat16, int(q), comm, s));
      LOOM_NCCL_CHECK(ncclRecv(received + q * stride, size_t(span), ncclBfloat16, int(q), comm, s));
    }
  LOOM_NCCL_CHECK(ncclGroupEnd());
}

Launch CudaBackendImpl::wideSumScatterRun(const Instruction &ins, int64_t index, int64_t parts, ncclComm_t comm) {
  bool mean = ins.attrs.value("reduction", std::string("mean")) == "mean";
  int64_t span = 0;
  std::vector<PackedTensor> list;
  const PackedTensor *table = packedTensors(ins.in, ins.out, parts, span, /*bf16Wholes=*/true, false, &list);
  int count = int(ins.in.size());
  int64_t self = index, longest = 0;
  for (int64_t id : ins.out)
    longest = std::max(longest, numElements(buf(id).shape).value_or(0));
  dim3 packGrid = segmentGrid(longest, parts * count), sumGrid = segmentGrid(longest, count);
  // Alone (LOOM_MEASURE_ONE_RANK) a rank's slice is its own part, as the f32 path's copy.
  int64_t ranks = comm ? parts : 1;
  float scale = mean && comm ? 1.0f / float(parts) : 1.0f;
  // Two ranks over peer memory: no packing, nothing in the workspace; the
  // same sums, in the same order, as NCCL's way.
  if (const PeerLink *link = exchangeLinkOf(ins, parts, size_t(span) * sizeof(__nv_bfloat16), comm))
    return peerScatterRun(table, list, self, scale, /*allBf16=*/true, link, world->peerAbort, sumGrid);
  // Each rank's part starts 128 bytes apart (where NCCL's vector paths want
  // it): packed[parts][stride] bf16, then received[parts][stride] bf16.
  int64_t stride = (span + 63) / 64 * 64;
  commWorkspaceBytes = std::max(commWorkspaceBytes, size_t(2 * parts * stride) * sizeof(__nv_bfloat16));
  auto run = [this, table, count, span, stride, parts, self, ranks, scale, comm, packGrid, sumGrid](cudaStream_t s) {
    auto *packed = reinterpret_cast<__nv_bfloat16 *>(commWorkspace), *received = packed + parts * stride;
    packPartSegmentsKernel<<<packGrid, kThreads, 0, s>>>(table, count, stride, packed);
    if (comm)
      exchangeParts(packed, received, stride, span, parts, self, comm, s);
    sumShardSegmentsKernel<<<sumGrid, kThreads, 0, s>>>(table, packed, received, stride, ranks, self, scale);
  };
  return run;
}

Launch CudaBackendImpl::buildPackedAllReduce(const Instruction &ins, ncclRedOp_t red, ncclComm_t comm) {
  // Small tensors packed into one message (bucketPackBelow). Large tensors
  // are reduced in place, as before, without the copies in and out (bf16
  // ones first widened into their f32 outputs).
  int64_t below = bucketPackBelow();
  if (ins.attrs.value("wire", std::string("f32")) == "bf16")
    return buildBf16WireAllReduce(ins, red, comm, below);
  std::vector<PackedTensor> small, widened;
  std::vector<std::pair<float *, int64_t>> large; // reduced in place
  int64_t span = 0, wideSpan = 0;
  bool async = asyncCollective(ins);
  const PeerLink *link = comm ? peerLinkOf(collectiveGroup(ins), async) : nullptr;
  // Over peer memory a large bf16 gradient crosses the link as bf16 and
  // is summed into its f32 output (peerAllReduce's wide parts), unless
  // LOOM_CUDA_PEER_WIDE=0: no widening pass, and fewer bytes through HBM.
  bool wideOverPeers = link && !envIs("LOOM_CUDA_PEER_WIDE", "0");
  std::vector<PeerPart> wide;
  std::vector<PeerCopy> locals, pushes; // deferred parts
  // prepare()'s CPU validation has checked the operands: as many outputs as
  // inputs, each output f32 of its input's shape, each input f32 or bf16.
  for (size_t i = 0; i < ins.in.size(); ++i) {
    const Buffer &in = buf(ins.in[i]);
    int64_t n = count(in.shape);
    PackedTensor t{reinterpret_cast<float *>(ptr(in)), f(ins.out[i]), n, n, 0};
    t.bf16Whole = in.dtype == LOOM_BF16;
    // The update sums a deferred output (DeferredPart: deferredParts chose
    // it by this bucket's rules); this bucket only pushes its gradient.
    if (const DeferredPart *d = deferredOf(ins.out[i])) {
      if (!comm || !wideOverPeers)
        fail(LOOM_INTERNAL, where, ": output ", i, " is summed by the update, but this bucket would sum it itself "
             "(the environment changed since the GPUs were linked?); LOOM_CUDA_PEER_DEFER=0 sums in the all-reduce");
      size_t bytes = size_t(n) * 2;
      locals.push_back({t.shard, ptr(in), bytes});
      pushes.push_back({deferredLink->peer->deferred + d->at, ptr(in), bytes});
      continue;
    }
    if (n * int64_t(sizeof(float)) < below) {
      t.offset = span, span += n;
      small.push_back(t);
      continue;
    }
    if (t.bf16Whole && wideOverPeers && n * 2 >= peerMinBytes()) {
      wide.push_back({ptr(in), n, true, reinterpret_cast<char *>(t.shard)});
      continue;
    }
    if (t.bf16Whole || t.whole != t.shard) {
      t.offset = wideSpan, wideSpan += n;
      widened.push_back(t);
    }
    large.push_back({t.shard, n});
  }
  const PackedTensor *smallTable = small.empty() ? nullptr : deviceArray(small);
  const PackedTensor *wideTable = widened.empty() ? nullptr : deviceArray(widened);
  int smallCount = int(small.size()), wideCount = int(widened.size());
  bool smallSegments = packBySegments(smallCount), wideSegments = packBySegments(wideCount);
  dim3 smallGrid = segmentGrid(longestOf(small.data(), small.data() + small.size()), smallCount),
       wideGrid = segmentGrid(longestOf(widened.data(), widened.data() + widened.size()), wideCount);
  size_t bytes = size_t(span) * sizeof(float);
  reserveFor(async, bytes); // on the communication stream it has that stream's own workspace
  const PeerLink *deferTo = pushes.empty() ? nullptr : deferredLink;
  auto run = [=](cudaStream_t s) {
    if (deferTo)
      peerDeferredPush(*deferTo, world->peerAbort, locals, pushes, s);
    float *packed = reinterpret_cast<float *>(async ? commWorkspace : workspace);
    if (wideCount && wideSegments)
      widenSegmentsKernel<<<wideGrid, kThreads, 0, s>>>(wideTable, nullptr);
    else if (wideCount)
      widenBucketKernel<<<blocksFor(wideSpan), kThreads, 0, s>>>(wideTable, wideCount, wideSpan, nullptr);
    if (smallCount && smallSegments)
      widenSegmentsKernel<<<smallGrid, kThreads, 0, s>>>(smallTable, packed);
    else if (smallCount)
      widenBucketKernel<<<blocksFor(span), kThreads, 0, s>>>(smallTable, smallCount, span, packed);
    if (comm) {
      std::vector<ReducePart> parts;
      if (smallCount)
        parts.push_back({reinterpret_cast<char *>(packed), span, ncclFloat32});
      for (auto [data, n] : large)
        parts.push_back({reinterpret_cast<char *>(data), n, ncclFloat32});
      allReduceParts(s, comm, link, parts, red, wide);
    }
    if (smallCount && smallSegments)
      unpackShardSegmentsKernel<<<smallGrid, kThreads, 0, s>>>(smallTable, packed);
    else if (smallCount)
      unpackShardsKernel<<<blocksFor(span), kThreads, 0, s>>>(smallTable, smallCount, span, packed);
  };
  return async ? onCommStream(ins, run) : Launch(run);
}

Launch CudaBackendImpl::buildBf16WireAllReduce(const Instruction &ins, ncclRedOp_t red, ncclComm_t comm,
                                               int64_t below) {
  // "wire" = "bf16" (loomc compile --grad-reduce bf16): the bf16 gradients
  // are averaged as bf16, half the bytes NCCL moves, into a bf16 span of the
  // communication workspace (small ones packed into it first, large ones
  // reduced into their place in it), then widened into their f32 outputs.
  // The inputs are left as they were. f32 inputs go the f32 way, in place
  // in their outputs (copied there first where they differ).
  std::vector<PackedTensor> bf16s;
  std::vector<std::tuple<const void *, int64_t, int64_t>> largeBf16; // input, offset in the span, n
  std::vector<std::tuple<const float *, float *, int64_t>> f32s;
  for (size_t i = 0; i < ins.in.size(); ++i) {
    const Buffer &in = buf(ins.in[i]);
    int64_t n = count(in.shape);
    if (in.dtype == LOOM_BF16)
      bf16s.push_back({reinterpret_cast<float *>(ptr(in)), f(ins.out[i]), n, n, 0, 1});
    else
      f32s.push_back({f(ins.in[i]), f(ins.out[i]), n});
  }
  // The small ones first, end to end at the span's start (one message); then
  // each large one at a 128-byte offset, where NCCL's vector paths want it.
  auto small = [&](const PackedTensor &t) { return t.n * int64_t(sizeof(float)) < below; };
  size_t smallCount = size_t(std::stable_partition(bf16s.begin(), bf16s.end(), small) - bf16s.begin());
  int64_t span = 0;
  for (size_t i = 0; i < smallCount; ++i)
    bf16s[i].offset = span, span += bf16s[i].n;
  int64_t smallSpan = span;
  for (size_t i = smallCount; i < bf16s.size(); ++i) {
    span = (span + 63) / 64 * 64;
    bf16s[i].offset = span, span += bf16s[i].n;
    largeBf16.push_back({bf16s[i].whole, bf16s[i].offset, bf16s[i].n});
  }
  const PackedTensor *allTable = bf16s.empty() ? nullptr : deviceArray(bf16s);
  const PackedTensor *smallTable = smallCount ? allTable : nullptr; // the table's first entries
  commWorkspaceBytes = std::max(commWorkspaceBytes, size_t(span) * sizeof(__nv_bfloat16));
  bool async = asyncCollective(ins);
  if (!async)
    fail(LOOM_INVALID_BUNDLE, where, ": a bucket averaged in bf16 (\"wire\": \"bf16\") must be async");
  int allCount = int(bf16s.size());
  bool segments = packBySegments(allCount);
  dim3 smallGrid = segmentGrid(longestOf(bf16s.data(), bf16s.data() + smallCount), int64_t(smallCount)),
       allGrid = segmentGrid(longestOf(bf16s.data(), bf16s.data() + bf16s.size()), allCount);
  auto run = [=](cudaStream_t s) {
    auto *means = reinterpret_cast<__nv_bfloat16 *>(commWorkspace);
    if (smallCount && segments)
      packBf16SegmentsKernel<<<smallGrid, kThreads, 0, s>>>(smallTable, means);
    else if (smallCount)
      packBf16Kernel<<<blocksFor(smallSpan), kThreads, 0, s>>>(smallTable, int(smallCount), smallSpan, means);
    for (auto [in, out, n] : f32s)
      if (in != out)
        LOOM_CUDA_CHECK(cudaMemcpyAsync(out, in, size_t(n) * sizeof(float), cudaMemcpyDeviceToDevice, s));
    if (comm) {
      LOOM_NCCL_CHECK(ncclGroupStart());
      if (smallCount)
        LOOM_NCCL_CHECK(ncclAllReduce(means, means, size_t(smallSpan), ncclBfloat16, red, comm, s));
      for (auto [in, at, n] : largeBf16)
        LOOM_NCCL_CHECK(ncclAllReduce(in, means + at, size_t(n), ncclBfloat16, red, comm, s));
      for (auto [in, out, n] : f32s)
        LOOM_NCCL_CHECK(ncclAllReduce(out, out, size_t(n), ncclFloat32, red, comm, s));
      LOOM_NCCL_CHECK(ncclGroupEnd());
    } else {
      for (auto [in, at, n] : largeBf16)
        LOOM_CUDA_CHECK(cudaMemcpyAsync(means + at, in, size_t(n) * 2, cudaMemcpyDeviceToDevice, s));
    }
    if (allCount && segments)
      widenBf16MeansSegmentsKernel<<<allGrid, kThreads, 0, s>>>(allTable, means);
    else if (allCount)
      widenBf16MeansKernel<<<blocksFor(span), kThreads, 0, s>>>(allTable, allCount, span, means);
  };
  return onCommStream(ins, run);
}

Launch CudaBackendImpl::buildPackedAllGather(const Instruction &ins, int64_t index, int64_t parts, ncclComm_t comm) {
  // f32 slices into f32 wholes (the masters), or into bf16 wholes: the
  // weights' bf16 copies that mixed-precision ZeRO-1 gathers at the start
  // of the forward (loom-zero-gather-copies), half the bytes, rounded as a
  // cast rounds.
  bool bf16 = !ins.out.empty() && buf(ins.out[0]).dtype == LOOM_BF16;
  int64_t span = 0;
  std::vector<PackedTensor> host;
  // the wholes, their updated shards
  const PackedTensor *table = packedTensors(ins.out, ins.in, parts, span, bf16, false, &host);
  int count = int(ins.in.size());
  size_t width = bf16 ? 2 : 4, bytes = size_t((parts + 1) * span) * width;
  bool async = asyncCollective(ins);
  int64_t self = index;
  // LOOM_CUDA_COMM_BLOCKS=N (a measurement): an async gather's packing and
  // unpacking in at most N blocks, so that beside the compute stream they
  // take fewer of its SMs (ZeRO-3 gathers beside every layer).
  static const int commBlocks = [] {
    const char *v = std::getenv("LOOM_CUDA_COMM_BLOCKS");
    return v ? std::max(0, std::atoi(v)) : 0;
  }();
  int cap = async ? commBlocks : 0;
  auto blocks = [cap](int64_t n) { return cap > 0 ? std::min(blocksFor(n), cap) : blocksFor(n); };
  // By segments (a block row per tensor, and per part and tensor), unless
  // LOOM_CUDA_PACK_SEGMENTS=0: each a contiguous copy, instead of a search
  // for its tensor per element over the whole span.
  int64_t longest = 0;
  for (int64_t id : ins.in)
    longest = std::max(longest, numElements(buf(id).shape).value_or(0));
  bool segments = packBySegments(parts * count);
  dim3 packGrid(unsigned(std::max<int64_t>(1, std::min<int64_t>((longest + 4 * kThreads - 1) / (4 * kThreads), 1024))),
                unsigned(count)),
      unpackGrid(packGrid.x, unsigned(parts * count));
  // Two ranks over peer memory (by segments only), without packing: this
  // rank's part of each whole written from its shard (rounded where the
  // whole is bf16; a copy where f32), pushed from there into the peer's
  // scratch by the copy engines, and the peer's parts copied from this
  // rank's scratch into place. Only the rounding uses SMs.
  if (const PeerLink *link = segments ? exchangeLinkOf(ins, parts, size_t(span) * width, comm) : nullptr) {
    const volatile int *abort = world->peerAbort;
    std::vector<PeerPiece> pieces = partPieces(host, self, bf16, width);
    std::vector<PeerCopy> ownCopies, peerCopies;
    for (const PackedTensor &x : host) {
      char *whole = reinterpret_cast<char *>(x.whole);
      int64_t own = partLength(x, self), theirs = partLength(x, 1 - self);
      if (!bf16 && own > 0)
        ownCopies.push_back({whole + size_t(self * x.k) * width, reinterpret_cast<const char *>(x.shard),
                             size_t(own) * width});
      if (theirs > 0)
        peerCopies.push_back({whole + size_t((1 - self) * x.k) * width, link->scratch + size_t(x.offset) * width,
                              size_t(theirs) * width});
    }
    dim3 ownGrid(packGrid.x, unsigned(count));
    Launch run = [=](cudaStream_t s) {
      if (bf16)
        shardsIntoWholesKernel<__nv_bfloat16><<<ownGrid, kThreads, 0, s>>>(table, self);
      copyAll(ownCopies, s);
      peerExchange(*link, abort, pieces, s);
      copyAll(peerCopies, s);
      peerReleased(*link, s);
    };
    return async ? onCommStream(ins, run) : run;
  }
  reserveFor(async, bytes); // on the communication stream it has that stream's own workspace
  auto run = [this, table, count, span, parts, self, comm, bf16, width, async, blocks, segments, packGrid,
              unpackGrid](cudaStream_t s) {
    char *gathered = async ? commWorkspace : workspace;
    char *mine = gathered + size_t(parts * span) * width;
    if (segments && bf16)
      packShardSegmentsKernel<<<packGrid, kThreads, 0, s>>>(table, reinterpret_cast<__nv_bfloat16 *>(mine));
    else if (segments)
      packShardSegmentsKernel<<<packGrid, kThreads, 0, s>>>(table, reinterpret_cast<float *>(mine));
    else if (bf16)
      packShardsKernel<<<blocks(span), kThreads, 0, s>>>(table, count, span, reinterpret_cast<__nv_bfloat16 *>(mine));
    else
      packShardsKernel<<<blocks(span), kThreads, 0, s>>>(table, count, span, reinterpret_cast<float *>(mine));
    if (comm)
      LOOM_NCCL_CHECK(ncclAllGather(mine, gathered, size_t(span), bf16 ? ncclBfloat16 : ncclFloat32, comm, s));
    else
      LOOM_CUDA_CHECK(cudaMemcpyAsync(gathered + size_t(self * span) * width, mine, size_t(span) * width,
                                      cudaMemcpyDeviceToDevice, s));
    if (segments && bf16)
      unpackWholeSegmentsKernel<<<unpackGrid, kThreads, 0, s>>>(table, count, span,
                                                                reinterpret_cast<const __nv_bfloat16 *>(gathered));
    else if (segments)
      unpackWholeSegmentsKernel<<<unpackGrid, kThreads, 0, s>>>(table, count, span,
                                                                reinterpret_cast<const float *>(gathered));
    else if (bf16)
      unpackWholesKernel<<<blocks(parts * span), kThreads, 0, s>>>(table, count, span, parts,
                                                                    reinterpret_cast<const __nv_bfloat16 *>(gathered));
    else
      unpackWholesKernel<<<blocks(parts * span), kThreads, 0, s>>>(table, count, span, parts,
                                                                    reinterpret_cast<const float *>(gathered));
  };
  return async ? onCommStream(ins, run) : Launch(run);
}
#endif

} // namespace loom::rt::cuda
