//===- DataParallel.cpp - Gradient reductions over stages and replicas ----===//
//
// The loom-data-parallel pass: tied parameters' gradients summed over the
// stages that hold them, every gradient averaged over the data-parallel
// replicas in buckets that overlap backward (ZeRO-1: reduce-scatter), and the
// loss averaged and broadcast.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"


namespace mlir::loom {
#define GEN_PASS_DEF_DATAPARALLEL
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

/// Inserts the data-parallel all-reduces of `grads` into `program`: grads
/// ordered by when they are finished (the last instruction writing them),
/// packed into buckets of about `bucketBytes` (the last one small), each
/// bucket issued right after its last gradient is done.
/// Returns the last event recorded (-1 when no bucket).
int64_t placeGradientBuckets(rt::RankProgram &r, std::vector<rt::Instruction> &program,
                             const std::vector<int64_t> &grads, int64_t bucketBytes,
                             const std::map<int64_t, int64_t> &shards = {}) {
  int64_t lastEvent = -1;
  auto root = [&](int64_t id) { return rt::storageOf(r, id); };
  std::map<int64_t, int64_t> lastWrite; // root -> instruction index
  for (size_t i = 0; i < program.size(); ++i)
    for (int64_t id : program[i].out)
      lastWrite[root(id)] = static_cast<int64_t>(i);
  std::vector<std::pair<int64_t, int64_t>> ready; // (index, grad)
  for (int64_t g : grads)
    ready.push_back({lastWrite.count(root(g)) ? lastWrite[root(g)] : -1, g});
  std::stable_sort(ready.begin(), ready.end());
  std::map<int64_t, std::vector<rt::Instruction>> after; // index -> buckets issued after it
  std::vector<int64_t> sizes;
  for (auto [index, g] : ready)
    sizes.push_back(r.buffers[g].bytes);
  std::vector<std::pair<size_t, size_t>> runs = bucketRuns(sizes, bucketBytes);
  // In a model of several buckets, the last goes out after backward's last
  // instruction, where no compute hides it, and a run goes out when its
  // last gradient is done: the last run is split from its end into buckets
  // of at most a sixteenth of a bucket (or just the last gradient), then an
  // eighth, a quarter and a half, and the rest, so that each goes out while
  // the first layers' backward still runs and what is left after the last
  // instruction is small. (ResNet-50: the last bucket held 96 gradients,
  // 17 MB, most of them ready well before the end. GPT-2 350M, once its
  // embedding's rows were gathered instead: 218 MB of its first four
  // layers went out after the last.)
  // The last two runs are split together: the last is often one late
  // gradient alone (a position embedding's), which left the run before it
  // to go out at the end whole.
  // A gradient of half a bucket or more goes alone and, for all-reduce
  // buckets, leaves its level to the gradients before it: GPT-2 350M's tied
  // embedding (206 MB, last but one) took the sixteenth's level, so its
  // first layer's 50 MB went out after the last instruction whole (and
  // loom-gather-embedding-rows then moves the embedding's own gradient next
  // to its product). dp2 on two H200s, its buckets over peer memory: 42.7-
  // 43.2 ms a step against 43.0-43.7. ZeRO's reduce-scatters (NCCL's
  // kernels, which slow the products beside them) keep the levels as they
  // were: 44.2-44.6 against 44.0-44.1 the other way.
  if (runs.size() > 1) {
    size_t begin = runs[runs.size() - 2].first, end = runs.back().second;
    runs.resize(runs.size() - 2);
    std::vector<std::pair<size_t, size_t>> tail;
    size_t hi = end;
    for (int64_t cap = std::max<int64_t>(1, bucketBytes / 16); hi > begin;) {
      if (cap >= bucketBytes) {
        tail.push_back({begin, hi});
        break;
      }
      size_t lo = hi - 1;
      int64_t sum = sizes[lo];
      while (lo > begin && sum + sizes[lo - 1] <= cap)
        sum += sizes[--lo];
      bool giant = lo + 1 == hi && 2 * sum >= bucketBytes;
      tail.push_back({lo, hi});
      hi = lo;
      if (!giant || !shards.empty())
        cap *= 2;
    }
    runs.insert(runs.end(), tail.rbegin(), tail.rend());
  }
  for (auto [begin, end] : runs) {
    std::vector<int64_t> bucket;
    for (size_t i = begin; i < end; ++i)
      bucket.push_back(ready[i].second);
    // On the communication stream; each bucket records event `lastEvent`.
    json attrs = {{"reduction", "mean"}, {"group", "dp"}, {"async", true}, {"event", ++lastEvent}};
    if (shards.empty()) {
      after[ready[end - 1].first].push_back({"all_reduce", bucket, bucket, attrs});
    } else { // ZeRO-1: each rank keeps the mean of its slice of every gradient
      std::vector<int64_t> outs;
      for (int64_t g : bucket)
        outs.push_back(shards.at(g));
      after[ready[end - 1].first].push_back({"reduce_scatter", bucket, outs, attrs});
    }
  }
  std::vector<rt::Instruction> out;
  if (auto it = after.find(-1); it != after.end())
    out.insert(out.end(), it->second.begin(), it->second.end());
  for (size_t i = 0; i < program.size(); ++i) {
    out.push_back(std::move(program[i]));
    if (auto it = after.find(static_cast<int64_t>(i)); it != after.end())
      out.insert(out.end(), it->second.begin(), it->second.end());
  }
  program = std::move(out);
  return lastEvent;
}

/// Sequence parallelism's gradient sums over `group` (without replicas): one
/// async bucket after the program's last instruction that writes one of
/// them or talks to other ranks, since a collective of the same group must
/// not run beside it, and the backward's are the layers' (in every layer,
/// to its end). The update waits for it. Returns its event.
int64_t placePartialSums(rt::RankProgram &r, std::vector<rt::Instruction> &program, const std::vector<int64_t> &grads,
                         const std::string &group) {
  std::set<int64_t> roots;
  for (int64_t g : grads)
    roots.insert(rt::storageOf(r, g));
  size_t after = 0;
  for (size_t i = 0; i < program.size(); ++i) {
    bool writes = false;
    for (int64_t id : program[i].out)
      writes |= roots.count(rt::storageOf(r, id)) > 0;
    if (writes || ordersCollectives(program[i]))
      after = i + 1;
  }
  int64_t event = nextEvent(r);
  program.insert(program.begin() + std::ptrdiff_t(after),
                 rt::Instruction{"all_reduce", grads, grads,
                                 json{{"reduction", "sum"}, {"group", group}, {"async", true}, {"event", event}}});
  return event;
}

/// ZeRO-2: after each async bucket of the program but the first, a wait for
/// the bucket before it; the last one's wait is the update's.
void waitForEachBucketAtTheNext(std::vector<rt::Instruction> &program) {
  std::vector<rt::Instruction> out;
  int64_t previous = -1;
  for (rt::Instruction &ins : program) {
    bool bucket = ins.op == "reduce_scatter" && flagAttr(ins, "async") && ins.attrs.contains("event");
    int64_t event = bucket ? ins.attrs["event"].get<int64_t>() : -1;
    out.push_back(std::move(ins));
    if (!bucket)
      continue;
    if (previous >= 0)
      out.push_back(rt::Instruction{"event_wait", {}, {}, json{{"event", previous}}});
    previous = event;
  }
  program = std::move(out);
}

struct DataParallelPass : mlir::loom::impl::DataParallelBase<DataParallelPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<BundleOptions> o = getCompileOptions(module);
    if (failed(o))
      return signalPassFailure();
    int64_t dp = o->dataParallel, pp = o->pipelineParallel;
    bool pipelined = pp > 1 || o->microbatches > 1;
    Grid grid{dp, o->tensorParallel, pp};
    auto reduce = [&](Step &step) -> LogicalResult {
      for (StepRank &sr : step.ranks) {
        rt::RankProgram &r = sr.program;
        if (r.outputs.size() != 1)
          return module.emitError() << "loom-data-parallel runs on a training step's ranks";
        int64_t g = r.rank, stage = grid.ppOf(g);
        int64_t lossStage = pipelined ? sr.lossStage : pp - 1;
        std::map<int64_t, std::set<int64_t>> stagesOfParam = paramStages(sr, pp);
        std::vector<rt::Instruction> reduce;
        for (const rt::Parameter &p : r.params) {
          const std::set<int64_t> &stages = stagesOfParam[p.buffer];
          if (p.grad < 0 || stages.size() < 2)
            continue;
          std::string name = "stages";
          std::vector<int64_t> members;
          for (int64_t s : stages) {
            name += "." + std::to_string(s);
            members.push_back(grid.rankOf(grid.dpOf(g), grid.tpOf(g), s));
          }
          r.groups[name] = members;
          reduce.push_back({"all_reduce", {p.grad}, {p.grad}, json{{"reduction", "sum"}, {"group", name}}});
        }
        int64_t lastBucketEvent = -1;
        std::map<int64_t, int64_t> shardOfGrad;
        if (dp > 1) {
          // ZeRO-1: a slice of ceil(n / dp) elements of every gradient per rank.
          if (o->zero1)
            for (const rt::Parameter &p : r.params)
              if (p.grad >= 0) {
                rt::Buffer slice;
                slice.id = static_cast<int64_t>(r.buffers.size());
                slice.name = p.name + ".grad_shard";
                int64_t n = rt::numElements(r.buffers[p.grad].shape).value_or(0);
                slice.shape = {(n + dp - 1) / dp};
                slice.bytes = slice.shape[0] * 4;
                r.buffers.push_back(slice);
                sr.zeroShards[p.buffer] = slice.id;
                shardOfGrad[p.grad] = slice.id;
              }
          // Gradients held by one stage are averaged over the replicas as soon
          // as backward finishes them; shared ones after their stages' sum.
          std::vector<int64_t> early;
          for (const rt::Parameter &p : r.params) {
            if (p.grad < 0)
              continue;
            if (stagesOfParam[p.buffer].size() < 2)
              early.push_back(p.grad);
            else if (o->zero1)
              reduce.push_back({"reduce_scatter", {p.grad}, {shardOfGrad[p.grad]},
                                json{{"reduction", "mean"}, {"group", "dp"}}});
            else
              reduce.push_back({"all_reduce", {p.grad}, {p.grad}, json{{"reduction", "mean"}, {"group", "dp"}}});
          }
          std::vector<rt::Instruction> &program = r.programs[pipelined ? "step" : "backward"];
          int64_t gradientBytes = 0;
          for (int64_t g : early)
            gradientBytes += r.buffers[g].bytes;
          lastBucketEvent = placeGradientBuckets(
              r, program, early, gradientBucketBytes(o->bucketBytes, gradientBytes, o->zero2 || o->zero3), shardOfGrad);
          if (o->zero2) {
            // ZeRO-2: each rank keeps its gradients' slices, not the whole
            // gradients: a bucket's are free once it is reduce-scattered,
            // which the backward waits for as it issues the next one (the
            // memory plan ends their lifetimes there).
            waitForEachBucketAtTheNext(program);
            for (rt::Parameter &p : r.params)
              if (auto it = shardOfGrad.find(p.grad); it != shardOfGrad.end())
                p.grad = it->second;
          }
          if (stage == lossStage)
            reduce.push_back({"all_reduce", {r.outputs[0].buffer}, {r.outputs[0].buffer},
                              json{{"reduction", "mean"}, {"group", "dp"}}});
        }
        // Sequence parallelism: gradients each tensor-parallel rank computed
        // from its own tokens (norms, biases, position embeddings), summed
        // over the group. Without replicas, in buckets beside the backward as
        // the replicas' are (which loom-bf16-step-casts then has read the
        // bf16 gradients); with them, after their mean (of this rank's
        // slice, with ZeRO-1), in one collective: sums and means commute.
        std::map<std::string, std::vector<int64_t>> partialSums;
        for (const rt::Parameter &p : r.params)
          if (auto it = sr.partialGrads.find(p.buffer); p.grad >= 0 && it != sr.partialGrads.end()) {
            if (!r.groups.count(it->second))
              return module.emitError() << "parameter " << p.name << "'s gradient is summed over group '"
                                        << it->second << "', which rank " << g << " does not have";
            if (stagesOfParam[p.buffer].size() > 1)
              return module.emitError() << "parameter " << p.name << " is read by several pipeline stages "
                                        << "and summed over '" << it->second << "' by sequence parallelism; "
                                        << "use sp=0 for this plan";
            auto shard = shardOfGrad.find(p.grad);
            partialSums[it->second].push_back(shard != shardOfGrad.end() ? shard->second : p.grad);
          }
        for (auto &[group, list] : partialSums) {
          if (dp == 1 && lastBucketEvent < 0)
            lastBucketEvent = placePartialSums(r, r.programs[pipelined ? "step" : "backward"], list, group);
          else
            reduce.push_back({"all_reduce", list, list, json{{"reduction", "sum"}, {"group", group}}});
        }
        if (pp > 1) // every rank reports the loss
          reduce.push_back({"broadcast_from", {r.outputs[0].buffer}, {r.outputs[0].buffer},
                            json{{"root", lossStage}, {"group", "pp"}}});
        if (lastBucketEvent >= 0) // the buckets issued during backward are done before anything reads them
          reduce.insert(reduce.begin(), rt::Instruction{"event_wait", {}, {}, json{{"event", lastBucketEvent}}});
        if (!reduce.empty()) // the update program starts with them
          r.programs["update"] = std::move(reduce);
      }
      return success();
    };
    if (failed(updateStep(module, getArgument(), reduce)))
      return signalPassFailure();
  }
};

} // namespace
