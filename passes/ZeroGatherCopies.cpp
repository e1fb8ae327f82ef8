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
// ZeRO-3 (f32 or bf16 steps) goes further, as PyTorch FSDP and DeepSpeed's
// stage 3 do: the slice is the parameter (ParamShard::zeroParts; the whole
// f32 master is gone), and the weights exist whole only around their
// readers. The forward and the backward each all-gather them in buckets in
// the order they first read them, each bucket issued where the bucket
// before it is waited for, so a layer's weights arrive while the layer
// before computes; the backward gathers into copies of its own, so the
// forward's die after their last forward reader. Weights read otherwise
// than through bf16 casts are gathered into f32 buffers that the two
// programs read instead of the parameter.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"

#include <functional>

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
  int64_t master = -1, slice = -1, copy = -1; // the f32 parameter, its slice, what the forward reads
};

/// The all-gathers of `pairs` (slice, copy) into `body` in buckets of about
/// `bucketBytes`, in the order the body first reads the copies, each bucket
/// waited for just before its first read. `oneAhead` (ZeRO-3): each bucket
/// is issued where the one before it is waited for (the first at the start),
/// so a layer's weights arrive while the layer before computes and live
/// only from there to their last read; otherwise all are issued at the start.
void placeGathers(rt::RankProgram &r, std::vector<rt::Instruction> &body,
                  std::vector<std::pair<int64_t, int64_t>> pairs, int64_t bucketBytes, const std::string &group,
                  int64_t &event, bool oneAhead) {
  auto root = [&](int64_t id) { return rt::storageOf(r, id); };
  std::map<int64_t, int64_t> firstRead; // copy -> body index
  for (auto [slice, copy] : pairs)
    firstRead[copy] = int64_t(body.size());
  for (size_t i = body.size(); i-- > 0;)
    for (int64_t id : body[i].in)
      if (auto it = firstRead.find(root(id)); it != firstRead.end())
        it->second = int64_t(i);
  std::stable_sort(pairs.begin(), pairs.end(),
                   [&](const auto &a, const auto &b) { return firstRead[a.second] < firstRead[b.second]; });
  std::map<size_t, std::vector<rt::Instruction>> issuesAt, waitsAt; // body index -> instructions
  std::vector<int64_t> copyBytes;
  for (auto [slice, copy] : pairs)
    copyBytes.push_back(r.buffers[copy].bytes);
  // A bucket's copies share one type (the runtime packs a bucket into one
  // NCCL call): a run that mixes them (f32 norm scales among bf16
  // matrices) goes out as one bucket per type, together.
  size_t previousWait = 0;
  for (auto [first, end] : bucketRuns(copyBytes, bucketBytes)) {
    size_t issueAt = oneAhead ? previousWait : 0, runWait = body.size();
    std::vector<loom_dtype_t> types;
    for (size_t i = first; i < end; ++i)
      if (std::find(types.begin(), types.end(), r.buffers[pairs[i].second].dtype) == types.end())
        types.push_back(r.buffers[pairs[i].second].dtype);
    for (loom_dtype_t type : types) {
      rt::Instruction bucket{"all_gather", {}, {}, nlohmann::json{{"group", group}, {"async", true}, {"event", ++event}}};
      size_t at = body.size();
      for (size_t i = first; i < end; ++i)
        if (r.buffers[pairs[i].second].dtype == type) {
          bucket.in.push_back(pairs[i].first), bucket.out.push_back(pairs[i].second);
          at = std::min(at, size_t(firstRead[pairs[i].second]));
        }
      issuesAt[issueAt].push_back(bucket);
      // Before the product whose result that reader takes (a bias, say), so
      // the wait does not stand between them and block the GEMM's epilogue.
      if (at > 0 && at < body.size() && body[at - 1].op == "matmul" && !body[at - 1].out.empty())
        for (int64_t id : body[at].in)
          if (root(id) == root(body[at - 1].out[0])) {
            --at;
            break;
          }
      waitsAt[at].push_back({"event_wait", {}, {}, nlohmann::json{{"event", event}}});
      runWait = std::min(runWait, at);
    }
    previousWait = runWait;
  }
  std::vector<rt::Instruction> out;
  for (size_t i = 0; i <= body.size(); ++i) {
    for (auto *at : {&issuesAt, &waitsAt})
      if (auto it = at->find(i); it != at->end())
        out.insert(out.end(), it->second.begin(), it->second.end());
    if (i < body.size())
      out.push_back(std::move(body[i]));
  }
  body = std::move(out);
}

/// ZeRO-3: `program` reads its own copy of the weight gathered into `copy`
/// (a new buffer like it, its views cloned onto it). Returns the new copy.
int64_t ownCopy(rt::RankProgram &r, std::vector<rt::Instruction> &program, int64_t copy, const std::string &suffix) {
  std::map<int64_t, int64_t> cloneOf;
  std::function<int64_t(int64_t)> clone = [&](int64_t id) -> int64_t {
    if (auto it = cloneOf.find(id); it != cloneOf.end())
      return it->second;
    rt::Buffer b = r.buffers[size_t(id)];
    b.viewOf = b.viewOf >= 0 ? clone(b.viewOf) : -1;
    b.id = int64_t(r.buffers.size());
    b.name += suffix;
    r.buffers.push_back(b);
    return cloneOf[id] = b.id;
  };
  int64_t own = clone(copy);
  for (rt::Instruction &ins : program)
    for (auto *ids : {&ins.in, &ins.out})
      for (int64_t &id : *ids)
        if (rt::storageOf(r, id) == copy)
          id = clone(id);
  return own;
}

/// Rewrites rank `r`'s ZeRO gathers; returns how many weights moved, or
/// fails with `error` (ZeRO-3, a weight it cannot shard).
FailureOr<int64_t> gatherCopies(rt::RankProgram &r, int64_t bucketBytes, bool zero3, std::string &error) {
  auto up = r.programs.find("update");
  if (up == r.programs.end() || r.programs.count("prepare") || r.programs.count("gather_parameters"))
    return 0;
  std::vector<rt::Instruction> &update = up->second;
  // ZeRO-1's gathers: slices -> whole parameters, without an axis, in
  // buckets (loom-optimizer-update), taken here as one.
  std::vector<size_t> gathers;
  for (size_t i = 0; i < update.size(); ++i)
    if (update[i].op == "all_gather" && !update[i].attrs.contains("axis"))
      gathers.push_back(i);
  if (gathers.empty())
    return 0;
  size_t gatherAt = gathers.front();
  std::string group = update[gatherAt].attrs.value("group", std::string("dp"));
  std::set<int64_t> params, viewed = viewedBuffers(r), outputs;
  for (const rt::Parameter &p : r.params)
    params.insert(p.buffer);
  for (const rt::NamedBuffer &nb : r.outputs)
    outputs.insert(nb.buffer);
  auto [readers, writers] = storageUses(r);
  std::map<int64_t, size_t> shardOf; // slice -> its shard_of in the update
  for (size_t i = 0; i < update.size(); ++i)
    if (update[i].op == "shard_of" && update[i].in.size() == 1 && update[i].out.size() == 1)
      shardOf[update[i].out[0]] = i;

  // The weights whose every read outside the update is a cast to bf16, in
  // one program (the forward, or a pipelined step). ZeRO-3 (forward and
  // backward) gathers the others into f32 buffers the two programs read
  // instead of the parameter.
  std::string consumer = r.programs.count("step") ? "step" : "forward";
  if (!r.programs.count(consumer))
    return 0;
  if (zero3 && (consumer == "step" || !r.programs.count("backward"))) {
    error = "ZeRO-3 gathers the weights for a forward and a backward program; this rank has a pipelined step";
    return failure();
  }
  std::vector<Weight> weights;
  std::map<std::string, std::vector<bool>> dropped;
  for (const auto &[name, list] : r.programs)
    dropped[name].assign(list.size(), false);
  rt::Instruction gather = update[gatherAt];
  for (size_t at : gathers)
    if (at != gatherAt) {
      const rt::Instruction &more = update[at];
      gather.in.insert(gather.in.end(), more.in.begin(), more.in.end());
      gather.out.insert(gather.out.end(), more.out.begin(), more.out.end());
    }
  std::vector<bool> moved(gather.in.size(), false);
  for (size_t k = 0; k < gather.in.size() && k < gather.out.size(); ++k) {
    int64_t slice = gather.in[k], master = gather.out[k];
    auto s = shardOf.find(slice);
    const std::string &name = r.buffers[master].name;
    if (!params.count(master) || r.buffers[master].dtype != LOOM_F32 || r.buffers[master].viewOf >= 0 ||
        s == shardOf.end() || update[s->second].in[0] != master) {
      if (zero3) {
        error = "ZeRO-3 cannot shard '" + name + "': it is not an f32 parameter sliced by shard_of in the update";
        return failure();
      }
      continue;
    }
    // Only this gather may write the master (else its slice would drift from it).
    bool onlyGathered = true;
    for (const InstructionSite &u : writers[master])
      onlyGathered &= u.program == "update" && std::count(gathers.begin(), gathers.end(), u.index) > 0;
    if (!onlyGathered) {
      if (zero3) {
        error = "ZeRO-3 cannot shard '" + name + "': something besides ZeRO's gather writes it";
        return failure();
      }
      continue;
    }
    std::vector<InstructionSite> casts;
    bool ok = !viewed.count(master), direct = true;
    for (const InstructionSite &u : readers[master]) {
      if (u.program == "update" && u.index == s->second)
        continue;
      const rt::Instruction &ins = r.programs[u.program][u.index];
      int64_t out = ins.out.empty() ? -1 : ins.out[0];
      // ZeRO-3 gathers again for the backward, so a recomputed layer's
      // casts there go too.
      ok &= (u.program == consumer || (zero3 && u.program == "backward")) && ins.op == "cast" &&
            ins.in.size() == 1 && ins.in[0] == master &&
            ins.out.size() == 1 && r.buffers[out].dtype == LOOM_BF16 && r.buffers[out].viewOf < 0 &&
            !outputs.count(out) && writers[out].size() == 1;
      direct &= u.program == "forward" || u.program == "backward";
      casts.push_back(u);
    }
    if (ok && !casts.empty()) { // the bf16 copy, gathered instead of cast
      Weight w{master, slice, r.programs[casts[0].program][casts[0].index].out[0]};
      for (const InstructionSite &u : casts) {
        dropped[u.program][u.index] = true;
        int64_t other = r.programs[u.program][u.index].out[0];
        if (other != w.copy)
          renameBuffer(r, other, w.copy);
      }
      dropped["update"][s->second] = true;
      moved[k] = true;
      weights.push_back(w);
    } else if (zero3 && direct) { // read as it is: an f32 buffer gathered for the forward
      rt::Buffer copy = r.buffers[master];
      copy.id = int64_t(r.buffers.size());
      copy.name = name + ".gathered";
      copy.role = rt::BufferRole::Activation;
      r.buffers.push_back(copy);
      for (const char *program : {"forward", "backward"})
        for (rt::Instruction &ins : r.programs[program])
          for (int64_t &id : ins.in)
            id = id == master ? copy.id : id;
      for (rt::Buffer &b : r.buffers)
        b.viewOf = b.viewOf == master ? copy.id : b.viewOf;
      dropped["update"][s->second] = true;
      moved[k] = true;
      weights.push_back({master, slice, copy.id});
    } else if (zero3) {
      error = "ZeRO-3 cannot shard '" + name + "': a program besides the forward, the backward and the "
              "update reads it";
      return failure();
    }
  }
  if (weights.empty())
    return 0;

  // Without ZeRO-3: prepare takes the slices from the masters and
  // gather_parameters the masters from the slices; the update keeps the f32
  // gather of what did not move. With it, the slice is the parameter.
  std::vector<rt::Instruction> prepare, gatherMasters;
  rt::Instruction masters{"all_gather", {}, {}, nlohmann::json{{"group", group}}}, rest = gather;
  rest.in.clear(), rest.out.clear();
  for (size_t k = 0; k < gather.in.size(); ++k) {
    rt::Instruction &to = moved[k] ? masters : rest;
    to.in.push_back(gather.in[k]);
    to.out.push_back(gather.out[k]);
  }
  for (const Weight &w : weights) {
    if (!zero3)
      prepare.push_back(update[shardOf[w.slice]]);
    rt::Buffer &slice = r.buffers[size_t(w.slice)];
    slice.role = zero3 ? rt::BufferRole::Param : rt::BufferRole::Cache;
    slice.name = r.buffers[size_t(w.master)].name + (zero3 ? "" : ".master");
  }
  if (zero3) {
    const std::vector<int64_t> &members = r.groups[group];
    int64_t index = std::find(members.begin(), members.end(), r.rank) - members.begin();
    std::map<int64_t, int64_t> sliceOf;
    for (const Weight &w : weights)
      sliceOf[w.master] = w.slice;
    for (rt::Parameter &p : r.params)
      if (auto it = sliceOf.find(p.buffer); it != sliceOf.end()) {
        rt::Buffer &whole = r.buffers[size_t(p.buffer)];
        if (p.shard.axis < 0)
          p.shard.fullShape = whole.shape;
        p.shard.zeroParts = int64_t(members.size());
        p.shard.zeroIndex = index;
        whole.name += ".whole"; // read by nothing now: loom-compact-ranks drops it
        p.buffer = it->second;
      }
  }
  // In buckets: one all_gather of every master stages them all in one
  // workspace (GPT 1.3B: 7.8 GB on each of two GPUs).
  if (!zero3)
    gatherMasters = gatherInBuckets(r, masters, bucketBytes);
  // The rest go back where the gathers were, in buckets as they came.
  size_t restAt = 0;
  for (size_t i = 0; i < gatherAt; ++i)
    restAt += dropped["update"][i] ? 0 : 1;
  for (size_t at : gathers)
    dropped["update"][at] = true;
  for (auto &[name, list] : r.programs)
    eraseMarked(list, dropped[name]);
  std::vector<rt::Instruction> restBuckets = gatherInBuckets(r, rest, bucketBytes);
  std::vector<rt::Instruction> &updateNow = r.programs["update"];
  updateNow.insert(updateNow.begin() + std::ptrdiff_t(restAt), restBuckets.begin(), restBuckets.end());

  int64_t event = nextEvent(r) - 1;
  std::vector<std::pair<int64_t, int64_t>> pairs;
  for (const Weight &w : weights)
    pairs.push_back({w.slice, w.copy});
  if (!zero3) {
    placeGathers(r, r.programs[consumer], pairs, bucketBytes, group, event, false);
    r.programs["prepare"] = std::move(prepare);
    r.programs["gather_parameters"] = std::move(gatherMasters);
    return int64_t(weights.size());
  }
  // ZeRO-3: the forward's copies and the backward's own, each gathered a
  // bucket ahead of its first read in that program.
  auto [uses, unused] = storageUses(r);
  std::vector<std::pair<int64_t, int64_t>> forward, backward;
  std::set<int64_t> readByBackward;
  for (auto [slice, copy] : pairs)
    for (const InstructionSite &u : uses[copy]) {
      if (u.program == "forward" && (forward.empty() || forward.back().second != copy))
        forward.push_back({slice, copy});
      if (u.program == "backward")
        readByBackward.insert(copy);
    }
  int64_t firstForwardEvent = event + 1;
  std::vector<rt::Instruction> &body = r.programs["forward"];
  placeGathers(r, body, forward, bucketBytes, group, event, true);
  // What the forward reads after it waits for its last bucket (the last
  // layers, a tied head) is still whole when the backward starts, and the
  // backward reads it first: it reads the forward's copies, as FSDP keeps
  // its last layer unsharded after the forward. Gathering them again left
  // the backward's first products waiting (GPT-2 350M's 77 MB head).
  size_t lastWait = 0;
  for (size_t i = 0; i < body.size(); ++i)
    if (body[i].op == "event_wait" && body[i].attrs.value("event", int64_t(-1)) >= firstForwardEvent)
      lastWait = i;
  std::set<int64_t> stillWhole;
  for (size_t i = lastWait + 1; i < body.size(); ++i)
    for (int64_t id : body[i].in)
      stillWhole.insert(rt::storageOf(r, id));
  for (auto [slice, copy] : pairs)
    if (readByBackward.count(copy) && !stillWhole.count(copy))
      backward.push_back({slice, ownCopy(r, r.programs["backward"], copy, ".backward")});
  placeGathers(r, r.programs["backward"], backward, bucketBytes, group, event, true);
  return int64_t(weights.size());
}

struct ZeroGatherCopiesPass : mlir::loom::impl::ZeroGatherCopiesBase<ZeroGatherCopiesPass> {
  void runOnOperation() override {
    FailureOr<BundleOptions> o = getCompileOptions(getOperation());
    if (failed(o))
      return signalPassFailure();
    int64_t bucketBytes = gatherBucketBytes(o->bucketBytes);
    bool zero3 = o->zero3;
    std::string error;
    auto rewrite = [&](StepRank &rank) {
      if (error.empty() && failed(gatherCopies(rank.program, bucketBytes, zero3, error)) && error.empty())
        error = "ZeRO's gathers could not be placed";
    };
    if (failed(updateEachRank(getOperation(), getArgument(), rewrite)))
      return signalPassFailure();
    if (!error.empty()) {
      getOperation().emitError() << error;
      signalPassFailure();
    }
  }
};

} // namespace
