//===- OptimizerUpdate.cpp - The update program of a training step --------===//
//
// The loom-optimizer-update pass: step counter, global gradient norm and one
// optimizer instruction per parameter, after the gradient reductions.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"


namespace mlir::loom {
#define GEN_PASS_DEF_OPTIMIZERUPDATE
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

/// The update program: step counter, global gradient norm, and one in-place
/// optimizer instruction per parameter with its state buffers.
/// `prefix` (gradient reductions) runs first. The global gradient norm
/// counts the parameters marked in `normCounts` (each element of a split or
/// replicated model counted once) and sums over `normGroup` when set.
///
/// With ZeRO-1 (`zeroShards` maps parameter buffers to the gradient shards
/// that reduce_scatter produced), each rank updates its 1/dp slice of every
/// such parameter, keeping optimizer state for that slice only, and
/// all_gathers put the updated slices back together on every rank, in
/// buckets of about `bucketBytes` of whole parameters: the runtime stages a
/// gather's wholes in a workspace of its own, so one gather of everything
/// held dp + 1 times the model's f32 bytes (Llama 1.1B: 6.5 GiB on each of
/// two GPUs, beside the arena).
void buildUpdate(rt::RankProgram &rank, const TrainOptions &t, std::vector<rt::Instruction> prefix,
                 const std::vector<bool> &normCounts, const std::string &normGroup,
                 const std::map<int64_t, int64_t> &zeroShards, int64_t bucketBytes) {
  auto state = [&](const std::string &name, const std::vector<int64_t> &shape) {
    rt::Buffer b;
    b.id = static_cast<int64_t>(rank.buffers.size());
    b.name = name;
    b.shape = shape;
    b.bytes = rt::numElements(shape).value_or(0) * 4;
    b.role = rt::BufferRole::State;
    rank.buffers.push_back(b);
    rank.state.push_back({name, b.id, 0});
    return b.id;
  };
  std::vector<rt::Instruction> update = std::move(prefix);
  if (t.optimizer == "none") {
    if (!update.empty())
      rank.programs["update"] = std::move(update);
    return;
  }
  int64_t step = state("step", {});
  update.push_back({"step_increment", {step}, {step}, json::object()});
  auto gradOf = [&](const rt::Parameter &p) {
    auto it = zeroShards.find(p.buffer);
    return it == zeroShards.end() ? p.grad : it->second;
  };
  std::vector<int64_t> allGrads, skip;
  for (size_t i = 0; i < rank.params.size(); ++i)
    if (rank.params[i].grad >= 0) {
      if (i < normCounts.size() && !normCounts[i])
        skip.push_back(static_cast<int64_t>(allGrads.size()));
      allGrads.push_back(gradOf(rank.params[i]));
    }
  rt::Buffer norm;
  norm.id = static_cast<int64_t>(rank.buffers.size());
  norm.name = "grad_norm";
  norm.bytes = 4;
  rank.buffers.push_back(norm);
  json normAttrs = json::object();
  if (!normGroup.empty())
    normAttrs["group"] = normGroup;
  if (!skip.empty())
    normAttrs["skip"] = skip;
  update.push_back({"global_norm", allGrads, {norm.id}, normAttrs});
  // ZeRO-1's slices are taken first, all together, so the updates after
  // them are one run (the CUDA backend launches a run of shard_of, and a
  // run of updates, as one kernel each; interleaved, each was its own).
  std::vector<int64_t> gatherIn, gatherOut;
  std::vector<rt::Instruction> updates;
  for (size_t index = 0; index < rank.params.size(); ++index) {
    const rt::Parameter &p = rank.params[index];
    if (p.grad < 0)
      continue;
    const std::vector<int64_t> &shape = rank.buffers[p.buffer].shape;
    json attrs = {{"lr", t.lr},        {"min_lr", t.minLr},   {"clip", t.clip},
                  {"warmup", double(t.warmup)}, {"total_steps", double(t.totalSteps)},
                  {"weight_decay", shape.size() >= 2 ? t.weightDecay : 0.0}};
    int64_t param = p.buffer, grad = p.grad;
    std::vector<int64_t> stateShape = shape;
    if (auto it = zeroShards.find(p.buffer); it != zeroShards.end()) {
      // This rank's slice of the parameter: taken, updated, gathered back.
      grad = it->second;
      stateShape = rank.buffers[grad].shape;
      rt::Buffer slice = rank.buffers[grad];
      slice.id = static_cast<int64_t>(rank.buffers.size());
      slice.name = p.name + ".shard";
      slice.role = rt::BufferRole::Activation;
      rank.buffers.push_back(slice);
      update.push_back({"shard_of", {p.buffer}, {slice.id}, json{{"group", "dp"}}});
      gatherIn.push_back(slice.id), gatherOut.push_back(p.buffer);
      param = slice.id;
    }
    if (t.optimizer == "adamw") {
      int64_t m = state(p.name + ".adam_m", stateShape), v = state(p.name + ".adam_v", stateShape);
      attrs["beta1"] = t.beta1, attrs["beta2"] = t.beta2, attrs["eps"] = t.eps;
      updates.push_back({"adamw", {param, grad, m, v, step, norm.id}, {param, m, v}, attrs});
    } else {
      int64_t m = state(p.name + ".momentum", stateShape);
      attrs["momentum"] = t.momentum;
      updates.push_back({"sgd", {param, grad, m, step, norm.id}, {param, m}, attrs});
    }
  }
  update.insert(update.end(), updates.begin(), updates.end());
  // Every updated slice back to every rank.
  for (rt::Instruction &bucket :
       gatherInBuckets(rank, {"all_gather", gatherIn, gatherOut, json{{"group", "dp"}}}, bucketBytes))
    update.push_back(std::move(bucket));
  rank.programs["update"] = std::move(update);
}

struct OptimizerUpdatePass : mlir::loom::impl::OptimizerUpdateBase<OptimizerUpdatePass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<BundleOptions> o = getCompileOptions(module);
    if (failed(o))
      return signalPassFailure();
    int64_t tp = o->tensorParallel, pp = o->pipelineParallel;
    Grid grid{o->dataParallel, tp, pp};
    // The clipping norm sums over the ranks that hold distinct parts: the
    // model-parallel ranks, and with ZeRO-1 the gradient slices of every replica.
    std::string normGroup = o->zero1 ? "all" : tp * pp > 1 ? "mp" : "";
    auto update = [&](Step &step) -> LogicalResult {
      for (StepRank &sr : step.ranks) {
        rt::RankProgram &r = sr.program;
        int64_t g = r.rank, stage = grid.ppOf(g);
        std::map<int64_t, std::set<int64_t>> stagesOf = paramStages(sr, pp);
        // Each element of a split or replicated parameter counts once.
        std::vector<bool> normCounts;
        for (const rt::Parameter &p : r.params) {
          const std::set<int64_t> &stages = stagesOf[p.buffer];
          normCounts.push_back((p.shard.axis >= 0 || grid.tpOf(g) == 0) &&
                               (stages.empty() || *stages.begin() == stage));
        }
        std::vector<rt::Instruction> prefix; // the gradient reductions
        if (auto it = r.programs.find("update"); it != r.programs.end()) {
          prefix = std::move(it->second);
          r.programs.erase(it);
        }
        buildUpdate(r, o->training, std::move(prefix), normCounts, normGroup, sr.zeroShards,
                    gatherBucketBytes(o->bucketBytes));
        // Later passes renumber buffers: these notes are spent.
        sr.paramGrads.clear();
        sr.zeroShards.clear();
        sr.partialGrads.clear();
      }
      return success();
    };
    if (failed(updateStep(module, getArgument(), update)))
      return signalPassFailure();
  }
};

} // namespace
