//===- ZeroGatherCopies.cpp - ZeRO-1 gathers the bf16 weights -------------===//
//
// The loom-zero-gather-copies pass. ZeRO-1 as loom-optimizer-update builds
// it takes each rank's slice of every f32 master weight, updates it, and
// all-gathers the f32 slices back into whole masters on every rank; the next
// forward then casts each master to bf16. Mixed-precision training reads
// only the bf16 copies, so this pass moves the gather to them (DeepSpeed's
// ZeRO-1 and -2 do the same: the fp32 partitions stay partitioned):
//
// - each rank keeps its slice of the master (`<name>.master`, role cache:
//   kept across steps, never saved) and AdamW updates it in place;
// - the forward (or a pipelined step) starts by all-gathering the slices
//   into the bf16 copies, half the bytes of the f32 gather, in buckets on
//   the communication stream, each waited for just before the first
//   instruction that reads one of its weights, so the gathers overlap the
//   forward's first layers; the weights' casts are gone;
// - a `prepare` program takes the slices from the masters (the runtime runs
//   it whenever weights are written: initialisation, weights files,
//   checkpoints), and a `gather_parameters` program all-gathers the f32
//   slices into whole masters (the runtime runs it before masters are read:
//   checkpoints and weight files).
//
// A weight qualifies where everything outside the update reads it through
// casts to bf16; the rest (norm scales read in f32, say) keep the f32
// gather in the update.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"

namespace mlir::loom {
#define GEN_PASS_DEF_ZEROGATHERCOPIES
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

struct Weight {
  int64_t master = -1, slice = -1, copy = -1; // the f32 parameter, its slice, its bf16 copy
  int64_t firstRead = -1;                     // in the consumer program, after the casts are gone
};

int64_t gatherCopies(rt::RankProgram &r, int64_t bucketBytes) {
  auto up = r.programs.find("update");
  if (up == r.programs.end() || r.programs.count("prepare") || r.programs.count("gather_parameters"))
    return 0;
  std::vector<rt::Instruction> &update = up->second;
  // ZeRO-1's gather: slices -> whole parameters, without an axis.
  size_t gatherAt = update.size();
  for (size_t i = 0; i < update.size(); ++i)
    if (update[i].op == "all_gather" && !update[i].attrs.contains("axis"))
      gatherAt = i;
  if (gatherAt == update.size())
    return 0;
  std::string group = update[gatherAt].attrs.value("group", std::string("dp"));
  std::set<int64_t> params, viewed = viewedBuffers(r), outputs;
  for (const rt::Parameter &p : r.params)
    params.insert(p.buffer);
  for (const rt::NamedBuffer &nb : r.outputs)
    outputs.insert(nb.buffer);
  auto root = [&](int64_t id) { return rt::storageOf(r, id); };
  auto [readers, writers] = storageUses(r);
  std::map<int64_t, size_t> shardOf; // slice -> its shard_of in the update
  for (size_t i = 0; i < update.size(); ++i)
    if (update[i].op == "shard_of" && update[i].in.size() == 1 && update[i].out.size() == 1)
      shardOf[update[i].out[0]] = i;

  // The weights whose every read outside the update is a cast to bf16, in
  // one program (the forward, or a pipelined step).
  std::string consumer = r.programs.count("step") ? "step" : "forward";
  if (!r.programs.count(consumer))
    return 0;
  std::vector<Weight> weights;
  std::map<std::string, std::vector<bool>> dropped;
  for (const auto &[name, list] : r.programs)
    dropped[name].assign(list.size(), false);
  const rt::Instruction &gather = update[gatherAt];
  std::vector<bool> moved(gather.in.size(), false);
  for (size_t k = 0; k < gather.in.size() && k < gather.out.size(); ++k) {
    int64_t slice = gather.in[k], master = gather.out[k];
    auto s = shardOf.find(slice);
    if (!params.count(master) || viewed.count(master) || r.buffers[master].dtype != LOOM_F32 ||
        r.buffers[master].viewOf >= 0 || s == shardOf.end() || update[s->second].in[0] != master)
      continue;
    // Only this gather may write the master (else its slice would drift from it).
    bool onlyGathered = true;
    for (const InstructionSite &u : writers[master])
      onlyGathered &= u.program == "update" && u.index == gatherAt;
    if (!onlyGathered)
      continue;
    std::vector<InstructionSite> casts;
    bool ok = true;
    for (const InstructionSite &u : readers[master]) {
      if (u.program == "update" && u.index == s->second)
        continue;
      const rt::Instruction &ins = r.programs[u.program][u.index];
      int64_t out = ins.out.empty() ? -1 : ins.out[0];
      ok &= u.program == consumer && ins.op == "cast" && ins.in.size() == 1 && ins.in[0] == master &&
            ins.out.size() == 1 && r.buffers[out].dtype == LOOM_BF16 && r.buffers[out].viewOf < 0 &&
            !outputs.count(out) && writers[out].size() == 1;
      casts.push_back(u);
    }
    if (!ok || casts.empty())
      continue;
    Weight w{master, slice, r.programs[consumer][casts[0].index].out[0], -1};
    for (const InstructionSite &u : casts) {
      dropped[u.program][u.index] = true;
      int64_t other = r.programs[u.program][u.index].out[0];
      if (other != w.copy)
        renameBuffer(r, other, w.copy);
    }
    dropped["update"][s->second] = true;
    moved[k] = true;
    weights.push_back(w);
  }
  if (weights.empty())
    return 0;

  // prepare: the slices from the masters; gather_parameters: the masters
  // from the slices. The update keeps the f32 gather of what did not move.
  std::vector<rt::Instruction> prepare, gatherMasters;
  rt::Instruction masters{"all_gather", {}, {}, json{{"group", group}}}, rest = gather;
  rest.in.clear(), rest.out.clear();
  for (size_t k = 0; k < gather.in.size(); ++k) {
    rt::Instruction &to = moved[k] ? masters : rest;
    to.in.push_back(gather.in[k]);
    to.out.push_back(gather.out[k]);
  }
  for (const Weight &w : weights) {
    prepare.push_back(update[shardOf[w.slice]]);
    rt::Buffer &slice = r.buffers[w.slice];
    slice.role = rt::BufferRole::Cache;
    slice.name = r.buffers[w.master].name + ".master";
  }
  // In buckets: one all_gather of every master stages them all in one
  // workspace (GPT 1.3B: 7.8 GB on each of two GPUs).
  std::vector<int64_t> masterBytes;
  for (int64_t id : masters.out)
    masterBytes.push_back(r.buffers[id].bytes);
  for (auto [begin, end] : bucketRuns(masterBytes, bucketBytes))
    gatherMasters.push_back({"all_gather", {masters.in.begin() + begin, masters.in.begin() + end},
                             {masters.out.begin() + begin, masters.out.begin() + end}, masters.attrs});
  if (rest.in.empty())
    dropped["update"][gatherAt] = true;
  else
    update[gatherAt] = rest;
  for (auto &[name, list] : r.programs)
    eraseMarked(list, dropped[name]);

  // Buckets in the order the consumer first reads the copies, each waited
  // for just before that read.
  std::vector<rt::Instruction> &body = r.programs[consumer];
  std::map<int64_t, size_t> copyAt;
  for (size_t i = 0; i < weights.size(); ++i)
    copyAt[weights[i].copy] = i;
  for (size_t i = 0; i < body.size(); ++i)
    for (int64_t id : body[i].in)
      if (auto it = copyAt.find(root(id)); it != copyAt.end() && weights[it->second].firstRead < 0)
        weights[it->second].firstRead = int64_t(i);
  std::stable_sort(weights.begin(), weights.end(), [&](const Weight &a, const Weight &b) {
    auto key = [&](const Weight &w) { return w.firstRead < 0 ? int64_t(body.size()) : w.firstRead; };
    return key(a) < key(b);
  });
  int64_t event = -1;
  for (const auto &[name, list] : r.programs)
    for (const rt::Instruction &ins : list)
      if (ins.attrs.is_object() && ins.attrs.contains("event") && ins.attrs["event"].is_number_integer())
        event = std::max(event, ins.attrs["event"].get<int64_t>());
  std::vector<rt::Instruction> front;
  std::map<size_t, std::vector<rt::Instruction>> waitsBefore; // body index -> waits
  std::vector<int64_t> copyBytes;
  for (const Weight &w : weights)
    copyBytes.push_back(r.buffers[w.copy].bytes);
  for (auto [first, end] : bucketRuns(copyBytes, bucketBytes)) {
    rt::Instruction bucket{"all_gather", {}, {}, json{{"group", group}, {"async", true}, {"event", ++event}}};
    for (size_t i = first; i < end; ++i)
      bucket.in.push_back(weights[i].slice), bucket.out.push_back(weights[i].copy);
    front.push_back(bucket);
    int64_t at = weights[first].firstRead;
    // Before the product whose result that reader takes (a bias, say), so
    // the wait does not stand between them and block the GEMM's epilogue.
    if (at > 0 && body[at - 1].op == "matmul" && !body[at - 1].out.empty())
      for (int64_t id : body[at].in)
        if (root(id) == root(body[at - 1].out[0])) {
          --at;
          break;
        }
    waitsBefore[at < 0 ? body.size() : size_t(at)].push_back({"event_wait", {}, {}, json{{"event", event}}});
  }
  std::vector<rt::Instruction> out = front;
  for (size_t i = 0; i <= body.size(); ++i) {
    if (auto it = waitsBefore.find(i); it != waitsBefore.end())
      out.insert(out.end(), it->second.begin(), it->second.end());
    if (i < body.size())
      out.push_back(std::move(body[i]));
  }
  body = std::move(out);
  r.programs["prepare"] = std::move(prepare);
  r.programs["gather_parameters"] = std::move(gatherMasters);
  return int64_t(weights.size());
}

struct ZeroGatherCopiesPass : mlir::loom::impl::ZeroGatherCopiesBase<ZeroGatherCopiesPass> {
  void runOnOperation() override {
    FailureOr<BundleOptions> o = getCompileOptions(getOperation());
    if (failed(o))
      return signalPassFailure();
    int64_t bucketBytes = o->bucketBytes;
    auto rewrite = [&](StepRank &rank) { gatherCopies(rank.program, bucketBytes); };
    if (failed(updateEachRank(getOperation(), getArgument(), rewrite)))
      signalPassFailure();
  }
};

} // namespace
