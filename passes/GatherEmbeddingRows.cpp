//===- GatherEmbeddingRows.cpp - Embedding gradients as gathered rows -----===//
//
// The loom-gather-embedding-rows pass. Data parallelism averages every
// gradient over the replicas, an embedding table's too: for GPT-2 350M a
// 206 MB f32 all-reduce of a [vocab, hidden] gradient whose lookup part is
// made by the backward's last instruction, so that nothing hides it. A
// replica's lookup gradient has rows only for its own tokens, though. This
// pass reduces the rest of the table's gradient (a tied table's head
// product, made at the backward's start) in a bucket of its own right after
// that product, and adds the lookup's rows of every replica into the
// reduced sum in the update, from the replicas' token ids and output
// gradients, gathered (16 MB a replica for GPT-2 350M at 8 x 1024 tokens):
//
//   backward: matmul(dlogits, x) -> h ... embedding_grad(ids, dy) -> e
//             add(h, e) -> g;  all_reduce [.., g, ..] (async, mean over dp)
// becomes
//   backward: matmul(dlogits, x) -> g;  all_reduce [g] (async, its own event)
//             ...                        all_reduce [.., ..] (without g)
//   update:   (after the buckets' wait)
//             all_gather(ids) -> ids*;  all_gather(dy) -> dy*   (axis 0, dp)
//             embedding_grad(ids*, dy*) -> g  {accumulate, scale = 1 / dp}
//
// The product writes g in f32 (bf16 operands; as loom-reduce-from-products
// has it), so g = mean(h) + sum(e) / dp as before, summed in another order.
// An untied table (Llama) whose gradient is the lookup's alone leaves its
// bucket the same way and is written, not added to, in the update.
//
// ZeRO-1's buckets reduce-scatter instead: the head's gradient goes into the
// rank's slice in its own bucket, and the update adds the rows of the
// rank's part of the vocabulary into a [vocab / dp, hidden] view of the
// slice (embedding_grad's vocab_group = "dp"; whole rows where dp divides
// the vocabulary). Only where the gathered rows are fewer bytes than the
// table's gradient, without ZeRO-2/3 (their buckets free the gradients as
// they go), and for lookups not split over a vocabulary-parallel group.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"

#include <algorithm>

namespace mlir::loom {
#define GEN_PASS_DEF_GATHEREMBEDDINGROWS
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

/// Readers and writers of each storage across every program of a rank
/// (storageUses), with each buffer's storage.
struct Touches {
  using Table = std::map<int64_t, std::vector<InstructionSite>>;
  std::vector<int64_t> root;
  Table readers, writers;
  Touches(const rt::RankProgram &r) {
    for (size_t b = 0; b < r.buffers.size(); ++b)
      root.push_back(rt::storageOf(r, int64_t(b)));
    StorageUses uses = storageUses(r);
    readers = std::move(uses.readers), writers = std::move(uses.writers);
  }
  /// The instructions of the backward that touch buffer id's storage, if
  /// no program but `also` (or none: "") touches it; nullopt otherwise.
  static std::optional<std::set<size_t>> backward(const Table &table, int64_t s, const std::string &also = "") {
    std::set<size_t> list;
    auto it = table.find(s);
    if (it != table.end())
      for (const InstructionSite &site : it->second) {
        if (site.program == "backward")
          list.insert(site.index);
        else if (site.program != also)
          return std::nullopt;
      }
    return list;
  }
  bool readBy(int64_t id, std::set<size_t> want, const std::string &also = "") const {
    return backward(readers, root[id], also) == std::optional<std::set<size_t>>(want);
  }
  bool writtenBy(int64_t id, std::set<size_t> want) const {
    return backward(writers, root[id]) == std::optional<std::set<size_t>>(want);
  }
};

bool isDpBucket(const rt::Instruction &ins) {
  bool scatter = ins.op == "reduce_scatter" && !(ins.attrs.is_object() && ins.attrs.contains("axis"));
  return (ins.op == "all_reduce" || scatter) && flagAttr(ins, "async") && ins.attrs.is_object() && ins.attrs.contains("event") &&
         ins.attrs["event"].is_number_integer() && ins.attrs.value("group", std::string()) == "dp" &&
         ins.attrs.value("reduction", std::string()) == "mean" && ins.in.size() == ins.out.size();
}

/// One embedding gradient to gather: the lookup's instruction, the table's
/// gradient g, its bucket and place there, and (tied) the product that
/// writes the rest of g and the add that sums the two.
struct Candidate {
  size_t lookup, bucket = 0, slot = 0;
  int64_t g = -1;
  int64_t product = -1, add = -1;
  int64_t shard = -1; // ZeRO-1: the bucket reduce-scatters g into this rank's slice
};

std::optional<Candidate> match(const rt::RankProgram &r, const std::vector<rt::Instruction> &bw, const Touches &t,
                               size_t i, int64_t dp) {
  const rt::Instruction &lk = bw[i];
  if (lk.op != "embedding_grad" || lk.in.size() != 2 || lk.out.size() != 1 ||
      (lk.attrs.is_object() && (lk.attrs.contains("vocab_group") || lk.attrs.contains("accumulate") ||
                                lk.attrs.contains("scale"))))
    return std::nullopt;
  int64_t e = lk.out[0];
  if (r.buffers[e].viewOf >= 0)
    return std::nullopt;
  auto readers = Touches::backward(t.readers, t.root[e]);
  if (!readers || readers->size() != 1)
    return std::nullopt;
  size_t next = *readers->begin();
  Candidate c{i};
  const rt::Instruction &user = bw[next];
  int64_t reduced = e; // what the bucket reads
  if (user.op == "add" && user.in.size() == 2 && user.out.size() == 1 && user.in[0] != user.in[1]) {
    // Tied: g = add(h, e), h a 2-D product's result that the add alone reads.
    int64_t h = user.in[0] == e ? user.in[1] : user.in[0];
    c.g = user.out[0], c.add = int64_t(next), reduced = c.g;
    auto hw = Touches::backward(t.writers, t.root[h]);
    if (!t.writtenBy(e, {i}) || !hw || hw->size() != 1 || !t.readBy(h, {next}) || r.buffers[h].viewOf >= 0 ||
        r.buffers[c.g].viewOf >= 0 || r.buffers[c.g].dtype != LOOM_F32 || r.buffers[h].shape != r.buffers[c.g].shape)
      return std::nullopt;
    size_t w = *hw->begin();
    const rt::Instruction &mm = bw[w];
    if (w >= next || mm.op != "matmul" || mm.out.size() != 1 || mm.out[0] != h || mm.in.size() != 2 ||
        (mm.attrs.is_object() && mm.attrs.contains("epilogue")) || r.buffers[mm.in[0]].shape.size() != 2 ||
        r.buffers[mm.in[1]].shape.size() != 2 || r.buffers[mm.in[0]].dtype != r.buffers[mm.in[1]].dtype ||
        (r.buffers[mm.in[0]].dtype != LOOM_F32 && r.buffers[mm.in[0]].dtype != LOOM_BF16))
      return std::nullopt;
    c.product = int64_t(w);
  }
  // The bucket, the one reader of what it reduces in the backward.
  auto br = Touches::backward(t.readers, t.root[reduced], "update");
  if (!br || br->size() != 1 || r.buffers[reduced].viewOf >= 0)
    return std::nullopt;
  size_t b = *br->begin();
  if (!isDpBucket(bw[b]) || (c.add >= 0 && b <= next) || (c.add < 0 && b != next))
    return std::nullopt;
  const rt::Instruction &bucket = bw[b];
  if (std::count(bucket.in.begin(), bucket.in.end(), reduced) != 1)
    return std::nullopt;
  c.bucket = b, c.slot = size_t(std::find(bucket.in.begin(), bucket.in.end(), reduced) - bucket.in.begin());
  if (bucket.op == "reduce_scatter") {
    // ZeRO-1: g (the add's, or e itself) goes into this rank's slice, whole
    // rows of the table: [vocab / dp, hidden], which the update adds into.
    c.shard = bucket.out[c.slot];
    if (c.add < 0)
      c.g = e;
    const rt::Buffer &gb = r.buffers[c.g], &sb = r.buffers[c.shard];
    if (!t.writtenBy(c.g, c.add >= 0 ? std::set<size_t>{next} : std::set<size_t>{i}) || gb.shape.size() != 2 ||
        gb.shape[0] % dp != 0 || sb.viewOf >= 0 || sb.dtype != LOOM_F32 || sb.shape.size() != 1 ||
        sb.shape[0] * dp != gb.shape[0] * gb.shape[1] || !t.writtenBy(c.shard, {b}))
      return std::nullopt;
  } else if (c.add >= 0) { // g: written by the add and reduced in place
    if (bucket.out[c.slot] != c.g || !t.writtenBy(c.g, {next, b}))
      return std::nullopt;
  } else { // g: the bucket's result, e itself or its f32 widening
    c.g = bucket.out[c.slot];
    if (r.buffers[c.g].viewOf >= 0 || r.buffers[c.g].dtype != LOOM_F32 || r.buffers[c.g].shape != r.buffers[e].shape ||
        !t.writtenBy(c.g, c.g == e ? std::set<size_t>{i, b} : std::set<size_t>{b}) ||
        (c.g != e && !t.writtenBy(e, {i})))
      return std::nullopt;
    if (c.g != e && !t.readBy(c.g, {}, "update"))
      return std::nullopt;
  }
  // g is a parameter's gradient.
  if (std::none_of(r.params.begin(), r.params.end(), [&](const rt::Parameter &p) { return p.grad == c.g; }))
    return std::nullopt;
  return c;
}

/// Rewrites the rank's embedding gradients; returns how many.
int64_t gatherRows(rt::RankProgram &r, int64_t dp) {
  auto bwIt = r.programs.find("backward"), upIt = r.programs.find("update");
  if (bwIt == r.programs.end() || upIt == r.programs.end() || dp < 2)
    return 0;
  std::vector<rt::Instruction> &bw = bwIt->second, &up = upIt->second;
  // Not ZeRO-3's ranks, which gather weights beside the backward.
  for (const rt::Instruction &ins : bw)
    if (ins.op == "all_gather" && flagAttr(ins, "async"))
      return 0;
  int64_t done = 0;
  for (size_t i = 0; i < bw.size(); ++i) {
    if (bw[i].op != "embedding_grad") // the uses are gathered only for a lookup's gradient
      continue;
    Touches t(r);
    std::optional<Candidate> c = match(r, bw, t, i, dp);
    if (!c)
      continue;
    const rt::Instruction &lk = bw[c->lookup];
    int64_t ids = lk.in[0], dy = lk.in[1];
    const rt::Buffer idsB = r.buffers[ids], dyB = r.buffers[dy], gB = r.buffers[c->g]; // copies: buffers grow below
    if (idsB.shape.empty() || dyB.shape.empty() || (idsB.dtype != LOOM_I32 && idsB.dtype != LOOM_I64))
      continue;
    // Fewer bytes gathered than the table's gradient reduced.
    if (dp * (idsB.bytes + dyB.bytes) > gB.bytes)
      continue;
    // ids and dy stay as they are until the update reads them: nothing
    // after the lookup writes them (in the backward or the update).
    bool later = false;
    for (int64_t id : {ids, dy}) {
      auto w = t.writers.find(t.root[id]);
      if (w != t.writers.end())
        for (const InstructionSite &site : w->second)
          later |= site.program == "backward" ? site.index > c->lookup
                                              : site.program != "forward" && site.program != "prepare";
    }
    if (later)
      continue;
    rt::Instruction &bucket = bw[c->bucket];
    bool empties = bucket.in.size() == 1;
    if (empties && c->add < 0 &&
        std::none_of(bw.begin(), bw.begin() + std::ptrdiff_t(c->bucket), [](const rt::Instruction &x) {
          return flagAttr(x, "async") && x.attrs.contains("event");
        }))
      continue; // its waits would have no earlier bucket to wait for instead
    // The gathered copies: [dp * n, ...] of each.
    auto gathered = [&](int64_t of) {
      rt::Buffer b = r.buffers[of];
      b.id = int64_t(r.buffers.size());
      b.name = b.name + ".gathered";
      b.shape[0] *= dp;
      b.bytes *= dp;
      b.viewOf = -1, b.viewOffset = 0, b.role = rt::BufferRole::Activation;
      r.buffers.push_back(b);
      return b.id;
    };
    int64_t idsAll = gathered(ids), dyAll = gathered(dy);
    int64_t g = c->g, target = g; // where the update adds the rows
    json rowsAttrs = {{"scale", 1.0 / double(dp)}};
    if (c->shard >= 0) { // this rank's rows of the table: a view of its slice
      rt::Buffer rows = r.buffers[c->shard];
      rows.id = int64_t(r.buffers.size());
      rows.name += ".rows";
      rows.shape = {gB.shape[0] / dp, gB.shape[1]};
      rows.viewOf = c->shard, rows.viewOffset = 0;
      r.buffers.push_back(rows);
      target = rows.id;
      rowsAttrs["vocab_group"] = "dp";
    }
    std::vector<bool> dead(bw.size(), false);
    std::optional<rt::Instruction> early; // inserted after the product
    rt::Instruction &bk = bw[c->bucket];
    bk.in.erase(bk.in.begin() + std::ptrdiff_t(c->slot));
    bk.out.erase(bk.out.begin() + std::ptrdiff_t(c->slot));
    if (c->add >= 0) {
      // The head's product writes g and reduces it at once, in a bucket of
      // its own; the update adds the rows.
      bw[size_t(c->product)].out[0] = g;
      json attrs = bk.attrs; // its bucket's (the wire's dtype too), with an event of its own
      attrs["event"] = nextEvent(r);
      early = rt::Instruction{bk.op, {g}, {c->shard >= 0 ? c->shard : g}, attrs};
      dead[size_t(c->add)] = true;
      rowsAttrs["accumulate"] = true;
    }
    dead[c->lookup] = true;
    int64_t gone = -1;
    if (empties) {
      gone = bk.attrs["event"].get<int64_t>();
      dead[c->bucket] = true;
    }
    std::vector<rt::Instruction> out;
    size_t mark = 0; // where the emptied bucket was, in `out`
    for (size_t j = 0; j < bw.size(); ++j) {
      if (j == c->bucket)
        mark = out.size();
      if (!dead[j])
        out.push_back(std::move(bw[j]));
      if (early && int64_t(j) == c->product)
        out.push_back(std::move(*early));
    }
    bw = std::move(out);
    if (gone >= 0) {
      // The emptied bucket's waits go to the async collective before it: the
      // communication stream runs them in order.
      int64_t before = -1;
      for (size_t j = 0; j < mark; ++j)
        if (flagAttr(bw[j], "async") && bw[j].attrs.contains("event"))
          before = bw[j].attrs["event"].get<int64_t>();
      for (auto &[name, list] : r.programs)
        for (rt::Instruction &ins : list)
          if (ins.op == "event_wait" && ins.attrs.is_object() && ins.attrs.value("event", int64_t(-1)) == gone)
            ins.attrs["event"] = before;
    }
    // The update: after its leading waits for the buckets.
    size_t where = 0;
    while (where < up.size() && up[where].op == "event_wait")
      ++where;
    std::vector<rt::Instruction> rows = {
        rt::Instruction{"all_gather", {ids}, {idsAll}, json{{"group", "dp"}, {"axis", 0}}},
        rt::Instruction{"all_gather", {dy}, {dyAll}, json{{"group", "dp"}, {"axis", 0}}},
        rt::Instruction{"embedding_grad", {idsAll, dyAll}, {target}, rowsAttrs}};
    up.insert(up.begin() + std::ptrdiff_t(where), rows.begin(), rows.end());
    ++done;
    i = size_t(-1); // the indices moved: look again from the start
  }
  return done;
}

struct GatherEmbeddingRowsPass : mlir::loom::impl::GatherEmbeddingRowsBase<GatherEmbeddingRowsPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<BundleOptions> o = getCompileOptions(module);
    if (failed(o))
      return signalPassFailure();
    int64_t dp = o->dataParallel;
    if (dp < 2 || o->zero2 || o->zero3 || o->pipelineParallel > 1 || o->microbatches > 1)
      return;
    if (failed(updateEachRank(module, getArgument(), [&](StepRank &rank) { gatherRows(rank.program, dp); })))
      signalPassFailure();
  }
};

} // namespace
