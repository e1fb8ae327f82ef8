//===- CpuCommunication.cpp - Collectives and point-to-point transfers ----===//
//
// All-reduce (of one buffer or a bucket), ZeRO-1's reduce-scatter, shard and
// all-gather, broadcast, send and receive, over the Communicator; an "async"
// collective goes to the communication stream (AsyncComm) and event_wait
// joins it.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cpu/CpuKernels.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace loom::rt::cpu {

namespace {

/// Reduces a buffer over a group: out = reduction of every member's in. A
/// bucket of several buffers (gradients, reduced in place) travels as one
/// message.
Kernel buildAllReduce(const Ctx &c) {
  if (c.ins.in.empty() || c.ins.in.size() != c.ins.out.size())
    c.bad("expects as many outputs as inputs (at least one)");
  Communicator *comm = needComm(c);
  std::vector<int> group = groupOf(c, attrString(c, "group", "dp"));
  std::string kind = attrString(c, "reduction", "sum");
  if (kind != "sum" && kind != "mean" && kind != "max")
    c.bad("reduction must be sum, mean or max, got '" + kind + "'");
  Reduction op = kind == "sum" ? Reduction::Sum : kind == "mean" ? Reduction::Mean : Reduction::Max;
  int64_t rank = c.rank.rank;
  // One buffer, synchronously; an async one (a bucket of one, which may
  // widen a bf16 gradient into its f32 mean) goes the bucket's way, on the
  // communication thread: never beside an earlier bucket still in flight.
  bool bf16InPlace = c.ins.in.size() == 1 && c.ins.in[0] == c.ins.out[0] && c.in(0).dtype == LOOM_BF16;
  if (c.ins.in.size() == 1 && !(c.attrFlag("async") && c.async) && !bf16InPlace) {
    c.needF32(c.in(0)), c.needF32(c.out());
    c.sameShape(c.in(0), c.out());
    float *in = c.f32(c.in(0)), *out = c.f32(c.out());
    int64_t n = count(c.in(0).shape);
    return [=] {
      if (in != out)
        std::copy(in, in + n, out);
      comm->allReduce(static_cast<int>(rank), group, out, n, op);
    };
  }
  // A bucket reduces f32 or bf16 tensors in place, or bf16 ones into f32
  // outputs (the gradients' casts folded into their all-reduce; the backend
  // has already widened a bf16 input into the collective's own f32 copy).
  // "wire" = "bf16" (loomc compile --grad-reduce bf16): a bf16 input's mean
  // is rounded to bf16, as averaging it in bf16 leaves it, then widened; a
  // bf16 tensor reduced in place holds its mean rounded to bf16 alike.
  std::string wire = attrString(c, "wire", "f32");
  if (wire != "f32" && wire != "bf16")
    c.bad("wire must be f32 or bf16, got '" + wire + "'");
  // (input, output, count, whether the mean is rounded to bf16, and the
  // bf16 storage of a tensor reduced in place, which the reduction writes
  // itself: an async one's results are not narrowed after it returns).
  std::vector<std::tuple<const float *, float *, int64_t, bool, uint16_t *>> parts;
  int64_t total = 0;
  for (size_t i = 0; i < c.ins.in.size(); ++i) {
    const Buffer &in = c.in(i), &out = c.out(i);
    bool inPlace = c.ins.in[i] == c.ins.out[i];
    if (inPlace) {
      if (in.dtype != LOOM_F32 && in.dtype != LOOM_BF16)
        c.bad("reduces f32 or bf16 tensors; tensor " + std::to_string(i) + " is " + dtypeName(in.dtype));
    } else if (bool intoF32 = out.dtype == LOOM_F32 && (in.dtype == LOOM_F32 || in.dtype == LOOM_BF16);
               !intoF32 && !(out.dtype == LOOM_BF16 && in.dtype == LOOM_BF16)) {
      c.bad("reduces f32 or bf16 tensors into f32 ones, or bf16 into bf16; tensor " + std::to_string(i) + " is " +
            dtypeName(in.dtype) + " into " + dtypeName(out.dtype));
    } else {
      c.sameShape(in, out);
    }
    // A bf16 result (reduced in place, or bf16 into bf16: a tensor-parallel
    // sum overlapped with compute, loom-overlap-tensor-reduce) is rounded and
    // stored as the sync path's.
    bool bf16Out = out.dtype == LOOM_BF16;
    bool roundsToBf16 = in.dtype == LOOM_BF16 && (wire == "bf16" || bf16Out);
    uint16_t *storage = bf16Out ? c.ptr<uint16_t>(out) : nullptr;
    parts.push_back({c.f32(in), c.f32(out), count(in.shape), roundsToBf16, storage});
    total += count(in.shape);
  }
  auto reduce = [=] {
    std::vector<float> bucket(static_cast<size_t>(total));
    float *p = bucket.data();
    for (auto [in, out, n, bf16, storage] : parts)
      p = std::copy(in, in + n, p);
    comm->allReduce(static_cast<int>(rank), group, bucket.data(), total, op);
    p = bucket.data();
    for (auto [in, out, n, bf16, storage] : parts) {
      if (bf16)
        for (int64_t j = 0; j < n; ++j)
          out[j] = bf16ToFloat(floatToBf16(p[j]));
      else
        std::copy(p, p + n, out);
      if (storage)
        for (int64_t j = 0; j < n; ++j)
          storage[j] = floatToBf16(out[j]);
      p += n;
    }
  };
  // "async": the bucket goes out on the communication thread while the
  // program goes on; a later event_wait joins it. Its buffers are final
  // gradients that nothing writes before then.
  if (c.attrFlag("async") && c.async) {
    AsyncComm *async = c.async;
    int64_t event = c.attrInt("event", -1);
    std::string label = c.where;
    return [=] { async->submit(reduce, event, label); };
  }
  return reduce;
}

/// This rank's index in a group and the group's size.
std::pair<int64_t, int64_t> placeIn(const Ctx &c, const std::vector<int> &group) {
  int64_t index = std::find(group.begin(), group.end(), int(c.rank.rank)) - group.begin();
  return {index, int64_t(group.size())};
}

/// A ZeRO-1 slice of a tensor of n elements over `parts` ranks has ceil(n / parts).
void checkSlice(const Ctx &c, int64_t k, int64_t n, int64_t parts) {
  if (k != (n + parts - 1) / parts)
    c.bad(cat("a slice of ", k, " elements does not fit ", n, " over ", parts, " ranks, which needs ",
              (n + parts - 1) / parts));
}

/// A tensor split into the group's parts along `axis` (sequence parallelism's
/// reduce-scatter and all-gather): the whole has `parts` times the part's
/// extent there, and each part is `outer` runs of `inner` elements.
struct AxisParts {
  Communicator *comm;
  std::vector<int> group;
  int64_t index, parts, axis, outer = 1, inner = 1;
};
AxisParts axisParts(const Ctx &c, const Shape &whole, const Shape &part, const char *what, bool ints = false) {
  c.arity(1, 1);
  bool integer = ints && (c.in(0).dtype == LOOM_I32 || c.in(0).dtype == LOOM_I64);
  if (integer && c.out().dtype != c.in(0).dtype)
    c.bad("the gathered ids must keep their dtype");
  if (!integer)
    c.needF32(c.in(0)), c.needF32(c.out());
  AxisParts a{needComm(c), groupOf(c, attrString(c, "group", "tp")), 0, 0, 0};
  std::tie(a.index, a.parts) = placeIn(c, a.group);
  a.axis = c.axis(c.attrInt("axis"), whole.size());
  Shape want = whole;
  want[size_t(a.axis)] /= a.parts;
  if (part.size() != whole.size() || whole[size_t(a.axis)] % a.parts != 0 || part != want)
    c.bad(cat(what, " ", shapeStr(whole), " over ", a.parts, " ranks along axis ", a.axis, " needs ", a.parts,
              " equal parts", whole[size_t(a.axis)] % a.parts ? "" : cat(" of ", shapeStr(want)), ", not ",
              shapeStr(part)));
  for (int64_t d = 0; d < a.axis; ++d)
    a.outer *= part[size_t(d)];
  for (size_t d = size_t(a.axis); d < part.size(); ++d)
    a.inner *= part[d];
  return a;
}

/// ZeRO-1: the mean over the group of each gradient (n elements, padded with
/// zeros to parts x k), of which this rank keeps slice `index` of k =
/// ceil(n / parts) elements. On one process the exchange is an all-reduce.
Kernel buildReduceScatter(const Ctx &c) {
  if (c.ins.attrs.contains("axis")) { // x -> this rank's part of the sum (sequence parallelism)
    auto [comm, group, index, parts, axis, outer, inner] =
        axisParts(c, c.in(0).shape, c.out().shape, "scattering");
    (void)axis;
    std::string kind = attrString(c, "reduction", "sum");
    if (kind != "sum" && kind != "mean")
      c.bad("reduction must be sum or mean, got '" + kind + "'");
    Reduction op = kind == "sum" ? Reduction::Sum : Reduction::Mean;
    float *src = c.f32(c.in(0)), *dst = c.f32(c.out());
    int64_t rank = c.rank.rank, total = count(c.in(0).shape), at = index, n = parts;
    Communicator *to = comm;
    std::vector<int> members = group;
    int64_t runs = outer, run = inner;
    return [=] {
      std::vector<float> whole(src, src + total);
      to->allReduce(int(rank), members, whole.data(), total, op);
      for (int64_t o = 0; o < runs; ++o)
        std::copy(whole.begin() + (o * n + at) * run, whole.begin() + (o * n + at + 1) * run, dst + o * run);
    };
  }
  if (c.ins.in.empty() || c.ins.in.size() != c.ins.out.size())
    c.bad("expects one slice per gradient");
  Communicator *comm = needComm(c);
  std::vector<int> group = groupOf(c, attrString(c, "group", "dp"));
  auto [index, parts] = placeIn(c, group);
  struct Part {
    float *in, *out;
    int64_t n, k;
  };
  std::vector<Part> list;
  for (size_t i = 0; i < c.ins.in.size(); ++i) {
    c.needF32(c.in(i)), c.needF32(c.out(i));
    int64_t n = count(c.in(i).shape), k = count(c.out(i).shape);
    checkSlice(c, k, n, parts);
    list.push_back({c.f32(c.in(i)), c.f32(c.out(i)), n, k});
  }
  int64_t rank = c.rank.rank, at = index;
  Reduction op = attrString(c, "reduction", "mean") == "sum" ? Reduction::Sum : Reduction::Mean;
  auto work = [=] {
    for (const Part &p : list) {
      std::vector<float> padded(static_cast<size_t>(p.k * parts), 0.0f);
      std::copy(p.in, p.in + p.n, padded.begin());
      comm->allReduce(int(rank), group, padded.data(), int64_t(padded.size()), op);
      std::copy(padded.begin() + at * p.k, padded.begin() + (at + 1) * p.k, p.out);
    }
  };
  if (c.attrFlag("async") && c.async) {
    AsyncComm *async = c.async;
    int64_t event = c.attrInt("event", -1);
    std::string label = c.where;
    return [=] { async->submit(work, event, label); };
  }
  return work;
}

/// The rank's slice of a parameter (zero-padded), as reduce_scatter cuts it.
Kernel buildShardOf(const Ctx &c) {
  c.arity(1, 1);
  c.needF32(c.in(0)), c.needF32(c.out());
  std::vector<int> group = groupOf(c, attrString(c, "group", "dp"));
  auto [index, parts] = placeIn(c, group);
  int64_t n = count(c.in(0).shape), k = count(c.out().shape);
  checkSlice(c, k, n, parts);
  float *in = c.f32(c.in(0)), *out = c.f32(c.out());
  int64_t begin = index * k;
  return [=] {
    for (int64_t j = 0; j < k; ++j)
      out[j] = begin + j < n ? in[begin + j] : 0.0f;
  };
}

/// Every rank's slices put back into the whole parameters (pairs of
/// slice and whole, one collective for all of them).
Kernel buildAllGather(const Ctx &c) {
  if (c.ins.attrs.contains("axis")) { // parts along an axis, concatenated in group order
    auto [comm, group, index, parts, axis, outer, inner] =
        axisParts(c, c.out().shape, c.in(0).shape, "gathering", /*ints=*/true);
    (void)axis;
    if (c.in(0).dtype == LOOM_I32 || c.in(0).dtype == LOOM_I64) {
      // Token ids (loom-gather-embedding-rows), exchanged as floats: exact
      // below 2^24, which every vocabulary is.
      IndexReader read{c.arena + c.in(0).offset, c.in(0).dtype == LOOM_I64};
      char *dst = c.arena + c.out().offset;
      bool wide = c.in(0).dtype == LOOM_I64;
      int64_t rank = c.rank.rank, total = count(c.out().shape), at = index, n = parts;
      Communicator *to = comm;
      std::vector<int> members = group;
      int64_t runs = outer, run = inner;
      std::string where = c.where, name = c.in(0).name;
      return [=] {
        std::vector<float> whole(static_cast<size_t>(total), 0.0f);
        for (int64_t o = 0; o < runs; ++o)
          for (int64_t j = 0; j < run; ++j) {
            int64_t id = read(o * run + j);
            if (id <= -(int64_t(1) << 24) || id >= (int64_t(1) << 24))
              fail(LOOM_INVALID_ARGUMENT, where, ": id ", id, " in '", name,
                   "' is beyond the 2^24 that gathering ids on CPU ranks carries exactly");
            whole[size_t((o * n + at) * run + j)] = float(id);
          }
        to->allReduce(int(rank), members, whole.data(), total, Reduction::Sum);
        for (int64_t i = 0; i < total; ++i) {
          int64_t id = int64_t(std::llround(whole[size_t(i)]));
          if (wide)
            reinterpret_cast<int64_t *>(dst)[i] = id;
          else
            reinterpret_cast<int32_t *>(dst)[i] = int32_t(id);
        }
      };
    }
    float *src = c.f32(c.in(0)), *dst = c.f32(c.out());
    int64_t rank = c.rank.rank, total = count(c.out().shape), at = index, n = parts;
    Communicator *to = comm;
    std::vector<int> members = group;
    int64_t runs = outer, run = inner;
    return [=] {
      std::vector<float> whole(static_cast<size_t>(total), 0.0f);
      for (int64_t o = 0; o < runs; ++o)
        std::copy(src + o * run, src + (o + 1) * run, whole.begin() + (o * n + at) * run);
      to->allReduce(int(rank), members, whole.data(), total, Reduction::Sum);
      std::copy(whole.begin(), whole.end(), dst);
    };
  }
  if (c.ins.in.empty() || c.ins.in.size() != c.ins.out.size())
    c.bad("expects one whole tensor per slice");
  Communicator *comm = needComm(c);
  std::vector<int> group = groupOf(c, attrString(c, "group", "dp"));
  auto [index, parts] = placeIn(c, group);
  struct Part {
    float *in, *out;
    int64_t k, n;
  };
  std::vector<Part> list;
  int64_t total = 0;
  for (size_t i = 0; i < c.ins.in.size(); ++i) {
    c.needF32(c.in(i)), c.needF32(c.out(i));
    int64_t k = count(c.in(i).shape), n = count(c.out(i).shape);
    checkSlice(c, k, n, parts);
    list.push_back({c.f32(c.in(i)), c.f32(c.out(i)), k, n});
    total += k * parts;
  }
  int64_t rank = c.rank.rank, at = index;
  return [=] {
    std::vector<float> whole(static_cast<size_t>(total), 0.0f);
    int64_t offset = 0;
    for (const Part &p : list) {
      std::copy(p.in, p.in + p.k, whole.begin() + offset + at * p.k);
      offset += p.k * parts;
    }
    comm->allReduce(int(rank), group, whole.data(), total, Reduction::Sum);
    offset = 0;
    for (const Part &p : list) {
      std::copy(whole.begin() + offset, whole.begin() + offset + p.n, p.out);
      offset += p.k * parts;
    }
  };
}

/// Waits until event `event` of the communication stream has happened: the
/// async collective that records it, and every one before it, is done.
Kernel buildEventWait(const Ctx &c) {
  c.arity(0, 0);
  AsyncComm *async = c.async;
  int64_t event = c.attrInt("event");
  return [=] {
    if (async)
      async->wait(event);
  };
}

/// Copies the buffer of member `root` (an index into the group) to every member.
Kernel buildBroadcast1(const Ctx &c) {
  c.arity(1, 1);
  if (c.ins.in[0] != c.ins.out[0])
    c.bad("broadcasts into its buffer in place");
  c.needF32(c.in(0));
  Communicator *comm = needComm(c);
  std::vector<int> group = groupOf(c, attrString(c, "group", "dp"));
  int64_t root = c.attrInt("root");
  if (root < 0 || root >= int64_t(group.size()))
    c.bad(cat("root ", root, " is not a member of the group of ", group.size()));
  int rootRank = group[root];
  float *data = c.f32(c.in(0));
  int64_t n = count(c.in(0).shape), rank = c.rank.rank;
  return [=] { comm->broadcast(static_cast<int>(rank), group, rootRank, data, n); };
}

int64_t peerOf(const Ctx &c) {
  int64_t peer = c.attrInt("peer");
  if (peer < 0 || peer == c.rank.rank)
    c.bad(cat("peer ", peer, " is not another rank"));
  return peer;
}

/// Sends a buffer to rank `peer` (pipeline activations and their gradients).
Kernel buildSend(const Ctx &c) {
  c.arity(1, 0);
  Communicator *comm = needComm(c);
  int64_t peer = peerOf(c), rank = c.rank.rank, bytes = c.in(0).bytes, tag = c.attrInt("tag", 0);
  const char *data = c.ptr<char>(c.in(0));
  return [=] { comm->send(int(rank), int(peer), tag, data, bytes); };
}

Kernel buildRecv(const Ctx &c) {
  c.arity(0, 1);
  Communicator *comm = needComm(c);
  int64_t peer = peerOf(c), rank = c.rank.rank, bytes = c.out().bytes, tag = c.attrInt("tag", 0);
  char *data = c.ptr<char>(c.out());
  return [=] { comm->recv(int(rank), int(peer), tag, data, bytes); };
}

} // namespace

void registerCommunicationBuilders(BuilderTable &table) {
  table.insert({
      {"all_reduce", buildAllReduce},
      {"broadcast_from", buildBroadcast1},
      {"send", buildSend},
      {"event_wait", buildEventWait},
      {"reduce_scatter", buildReduceScatter},
      {"all_gather", buildAllGather},
      {"shard_of", buildShardOf},
      {"recv", buildRecv},
  });
}

} // namespace loom::rt::cpu
