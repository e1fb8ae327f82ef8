//===- PipelineSchedule.cpp - Per-rank step programs in schedule order ----===//
//
// The loom-pipeline-schedule pass: each rank's "step" program, the schedule's
// microbatch tasks for the chunks it holds with send/recv between stages.
// Under ZB-H1 each chunk's backward is split in two tasks: the input
// gradient (B), what the previous chunk waits for, and the weight gradient
// (W), which the schedule defers.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"
#include "compiler/planner/PipelineSchedule.h"

namespace mlir::loom {
#define GEN_PASS_DEF_PIPELINESCHEDULE
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace planner = ::loom::planner;

namespace {

/// The loss, the gradient program and what pipelining needs to know about
/// each instruction, shared by every rank before it takes its part.
struct Lowered {
  rt::RankProgram base;
  std::vector<rt::Instruction> forward, backward;
  std::vector<int64_t> forwardChunk, backwardChunk;
  /// Task of each backward instruction: 1 (B) or, split under ZB-H1, 2 (W).
  std::vector<int> backwardPass;
  std::map<std::pair<int64_t, int64_t>, int64_t> paramGrads; // (param buffer, chunk) -> grad
  int64_t loss = -1, chunks = 1;
};

/// Builds one rank's "step" program: the schedule's microbatch tasks for the
/// chunks this rank holds, each task's instructions on per-microbatch copies
/// of the activations, recv before a task of what other stages produced and
/// send after it of what they need, parameter gradients summed over
/// microbatches and the loss averaged over them.
class PipelineRank {
public:
  PipelineRank(const Lowered &l, rt::RankProgram &r, const Grid &grid, int64_t vpp, int64_t m,
               planner::Schedule schedule)
      : l(l), r(r), grid(grid), vpp(vpp), m(m), schedule(schedule) {}

  void build() {
    int64_t g = r.rank, stage = grid.ppOf(g);
    // Producers: the chunk and pass (forward 0, backward 1) that write each root.
    for (size_t i = 0; i < l.forward.size(); ++i)
      for (int64_t id : l.forward[i].out)
        producer.try_emplace(root(id), std::make_pair(l.forwardChunk[i], 0));
    for (size_t i = 0; i < l.backward.size(); ++i)
      for (int64_t id : l.backward[i].out)
        producer.try_emplace(root(id), std::make_pair(l.backwardChunk[i], l.backwardPass[i]));
    // Which roots each task (chunk, pass) reads that another chunk produced.
    for (size_t i = 0; i < l.forward.size(); ++i)
      noteNeeds(l.forward[i], l.forwardChunk[i], 0);
    for (size_t i = 0; i < l.backward.size(); ++i)
      noteNeeds(l.backward[i], l.backwardChunk[i], l.backwardPass[i]);
    // Full-batch inputs; the lowered ones (one microbatch) become per-task slices.
    for (rt::NamedBuffer &in : r.inputs) {
      rt::Buffer full = r.buffers[in.buffer];
      full.id = static_cast<int64_t>(r.buffers.size());
      full.shape[0] *= m;
      full.bytes *= m;
      full.role = rt::BufferRole::Input;
      r.buffers[in.buffer].role = rt::BufferRole::Activation;
      microInput[in.buffer] = full.id;
      r.buffers.push_back(full);
      in.buffer = full.id;
    }
    // The loss: summed over microbatches on the last stage, then averaged.
    rt::Buffer lossSum = r.buffers[l.loss];
    lossSum.id = static_cast<int64_t>(r.buffers.size());
    lossSum.name = "loss";
    lossSum.role = rt::BufferRole::Output;
    r.buffers[l.loss].role = rt::BufferRole::Activation;
    r.buffers.push_back(lossSum);
    r.outputs = {{"loss", lossSum.id, 0}};
    step.push_back({"fill", {}, {lossSum.id}, json{{"value", 0.0}}});
    // One gradient accumulator per parameter this rank's chunks use.
    std::set<int64_t> mine;
    for (int64_t j = 0; j < vpp; ++j)
      mine.insert(j * grid.pp + stage);
    for (auto &[key, grad] : l.paramGrads)
      if (mine.count(key.second) && !accumulator.count(key.first)) {
        rt::Buffer acc = r.buffers[key.first];
        acc.id = static_cast<int64_t>(r.buffers.size());
        acc.name = acc.name + ".grad";
        acc.role = rt::BufferRole::Activation;
        r.buffers.push_back(acc);
        accumulator[key.first] = acc.id;
        step.push_back({"fill", {}, {acc.id}, json{{"value", 0.0}}});
      }
    for (rt::Parameter &p : r.params)
      p.grad = accumulator.count(p.buffer) ? accumulator[p.buffer] : -1;

    for (const planner::PipelineTask &task :
         planner::stageOrder(schedule, grid.pp, m, vpp, stage)) {
      int64_t chunk = task.chunk * grid.pp + stage, k = task.microbatch;
      int pass = task.kind == planner::TaskKind::Forward  ? 0
                 : task.kind == planner::TaskKind::Backward ? 1
                                                            : 2;
      receive(chunk, pass, k);
      size_t taskStart = step.size();
      const auto &list = pass ? l.backward : l.forward;
      const auto &chunkOf = pass ? l.backwardChunk : l.forwardChunk;
      for (size_t i = 0; i < list.size(); ++i) {
        if (chunkOf[i] != chunk || (pass && l.backwardPass[i] != pass))
          continue;
        rt::Instruction ins = list[i];
        for (int64_t &id : ins.in)
          id = input(id, k);
        for (int64_t &id : ins.out)
          id = copy(id, k);
        step.push_back(std::move(ins));
      }
      if (pass == 0 && producer.count(root(l.loss)) && producer[root(l.loss)].first == chunk)
        step.push_back({"add", {lossSum.id, copy(l.loss, k)}, {lossSum.id}, json::object()});
      // Each gradient is added to its sum soon after the task's last write
      // of it (in runs, below), so that the last microbatch's sums are
      // finished (and their data-parallel buckets can go out) while the rest
      // of its backward runs, not all at its end; the order of the adds into
      // one sum, and so the sums, are the same.
      if (pass == (schedule == planner::Schedule::ZeroBubbleH1 ? 2 : 1)) {
        std::vector<std::pair<size_t, rt::Instruction>> adds; // (after step[i], the add)
        for (auto &[key, grad] : l.paramGrads) {
          if (key.second != chunk)
            continue;
          int64_t g = copy(grad, k), storage = rt::storageOf(r, g);
          size_t at = step.size() - 1; // the task's end where nothing in it writes the gradient
          for (size_t i = step.size(); i-- > taskStart;) {
            bool writes = false;
            for (int64_t id : step[i].out)
              writes |= rt::storageOf(r, id) == storage;
            if (writes) {
              at = i;
              break;
            }
          }
          adds.push_back({at, {"add", {accumulator[key.first], g}, {accumulator[key.first]}, json::object()}});
        }
        std::stable_sort(adds.begin(), adds.end(), [](const auto &a, const auto &b) { return a.first < b.first; });
        // The adds go in runs of about kAccumulateRun bytes of sums, each
        // after the last write of its last gradient: a run is one launch on
        // the GPU (GPT-2 350M: a layer's dozen sums), where an add a tensor
        // paid a launch each, most of them for biases and norms.
        constexpr int64_t kAccumulateRun = 32 << 20;
        std::vector<rt::Instruction> merged(step.begin(), step.begin() + taskStart), pending;
        int64_t pendingBytes = 0;
        auto flush = [&] {
          for (rt::Instruction &add : pending)
            merged.push_back(std::move(add));
          pending.clear(), pendingBytes = 0;
        };
        size_t next = 0;
        for (size_t i = taskStart; i < step.size(); ++i) {
          merged.push_back(std::move(step[i]));
          for (; next < adds.size() && adds[next].first == i; ++next) {
            pendingBytes += r.buffers[adds[next].second.out[0]].bytes;
            pending.push_back(std::move(adds[next].second));
          }
          if (pendingBytes >= kAccumulateRun)
            flush();
        }
        for (; next < adds.size(); ++next)
          pending.push_back(std::move(adds[next].second));
        flush();
        step = std::move(merged);
      }
      sendAfter(chunk, pass, k);
    }
    if (producer[root(l.loss)].first % grid.pp == stage && m > 1)
      step.push_back({"scale", {lossSum.id}, {lossSum.id}, json{{"factor", 1.0 / double(m)}}});
    r.programs.clear();
    r.programs["step"] = std::move(step);
    lossBuffer = lossSum.id;
  }

  int64_t lossBuffer = -1;
  /// Stage holding the loss.
  int64_t lossStage() { return producer[root(l.loss)].first % grid.pp; }

private:
  int64_t root(int64_t id) const { return rt::storageOf(l.base, id); }
  void noteNeeds(const rt::Instruction &ins, int64_t chunk, int pass) {
    for (int64_t id : ins.in) {
      int64_t rt = root(id);
      auto it = producer.find(rt);
      if (it != producer.end() && it->second.first != chunk)
        needs[{chunk, pass}].insert(rt);
    }
  }
  /// This microbatch's copy of an activation (parameters and state are shared).
  int64_t copy(int64_t id, int64_t k) {
    if (isFloatRole(r.buffers[id]))
      return id;
    auto [it, inserted] = copies.try_emplace({id, k}, -1);
    if (!inserted)
      return it->second;
    rt::Buffer b = r.buffers[id];
    b.id = static_cast<int64_t>(r.buffers.size());
    b.name += "@" + std::to_string(k);
    b.role = rt::BufferRole::Activation;
    r.buffers.push_back(b);
    copies[{id, k}] = b.id;
    if (b.viewOf >= 0) {
      int64_t of = copy(b.viewOf, k);
      r.buffers[b.id].viewOf = of;
    }
    return b.id;
  }
  /// An operand: inputs are sliced out of the full batch the first time a
  /// task of this microbatch reads them.
  int64_t input(int64_t id, int64_t k) {
    int64_t rt = root(id);
    if (auto it = microInput.find(rt); it != microInput.end() && !sliced.count({rt, k})) {
      sliced.insert({rt, k});
      int64_t rows = r.buffers[rt].shape[0];
      step.push_back({"slice", {it->second}, {copy(rt, k)},
                      json{{"axis", 0}, {"start", k * rows}, {"size", rows}}});
    }
    return copy(id, k);
  }
  int64_t rankOfChunk(int64_t chunk) const {
    return grid.rankOf(grid.dpOf(r.rank), grid.tpOf(r.rank), chunk % grid.pp);
  }
  int64_t tag(int64_t rt, int64_t k) const { return rt * m + k; }

  void receive(int64_t chunk, int pass, int64_t k) {
    auto it = needs.find({chunk, pass});
    if (it == needs.end())
      return;
    for (int64_t rt : it->second) {
      int64_t from = rankOfChunk(producer[rt].first);
      if (from == r.rank || !received.insert({rt, k}).second)
        continue;
      step.push_back({"recv", {}, {copy(rt, k)}, json{{"peer", from}, {"tag", tag(rt, k)}}});
    }
  }
  void sendAfter(int64_t chunk, int pass, int64_t k) {
    // Every other rank whose tasks read what this task produced gets it once.
    std::map<int64_t, std::set<int64_t>> to; // root -> ranks
    for (auto &[task, roots] : needs)
      for (int64_t rt : roots)
        if (producer[rt] == std::make_pair(chunk, pass)) {
          int64_t dest = rankOfChunk(task.first);
          if (dest != r.rank)
            to[rt].insert(dest);
        }
    for (auto &[rt, ranks] : to)
      for (int64_t dest : ranks)
        step.push_back({"send", {copy(rt, k)}, {}, json{{"peer", dest}, {"tag", tag(rt, k)}}});
  }

  const Lowered &l;
  rt::RankProgram &r;
  const Grid &grid;
  int64_t vpp, m;
  planner::Schedule schedule;
  std::vector<rt::Instruction> step;
  std::map<int64_t, std::pair<int64_t, int>> producer;
  std::map<std::pair<int64_t, int>, std::set<int64_t>> needs;
  std::map<std::pair<int64_t, int64_t>, int64_t> copies;
  std::map<int64_t, int64_t> microInput, accumulator;
  std::set<std::pair<int64_t, int64_t>> sliced, received;
};

/// ZB-H1's split of each chunk's backward: B is what the gradients another
/// chunk reads depend on (every writer of every root a B instruction reads),
/// W the rest (the weight gradients). A W instruction that a later B
/// instruction would overwrite the operands or results of stays in B, so
/// that running W after B keeps every read and write in program order.
std::vector<int> splitBackward(const rt::RankProgram &base, const std::vector<rt::Instruction> &list,
                               const std::vector<int64_t> &chunkOf) {
  auto root = [&](int64_t id) { return rt::storageOf(base, id); };
  std::map<int64_t, std::vector<size_t>> writers; // root -> backward instructions
  for (size_t i = 0; i < list.size(); ++i)
    for (int64_t id : list[i].out)
      writers[root(id)].push_back(i);
  std::vector<int> pass(list.size(), 2);
  std::vector<size_t> work;
  auto toB = [&](size_t i) {
    if (pass[i] == 2)
      pass[i] = 1, work.push_back(i);
  };
  for (size_t i = 0; i < list.size(); ++i)
    for (int64_t id : list[i].in)
      if (auto it = writers.find(root(id)); it != writers.end())
        for (size_t w : it->second)
          if (chunkOf[w] != chunkOf[i])
            toB(w);
  for (bool changed = true; changed;) {
    while (!work.empty()) {
      size_t i = work.back();
      work.pop_back();
      for (int64_t id : list[i].in)
        if (auto it = writers.find(root(id)); it != writers.end())
          for (size_t w : it->second)
            if (chunkOf[w] == chunkOf[i])
              toB(w);
    }
    // Last B writer of each root; a W instruction before it that touches
    // the root must not move past it.
    std::map<int64_t, size_t> lastB;
    for (size_t i = 0; i < list.size(); ++i)
      if (pass[i] == 1)
        for (int64_t id : list[i].out)
          lastB[root(id)] = i;
    changed = false;
    for (size_t i = 0; i < list.size(); ++i) {
      if (pass[i] != 2)
        continue;
      bool hazard = false;
      for (const auto *ids : {&list[i].in, &list[i].out})
        for (int64_t id : *ids)
          if (auto it = lastB.find(root(id)); it != lastB.end() && it->second > i)
            hazard = true;
      if (hazard)
        toB(i), changed = true;
    }
  }
  return pass;
}

/// Splits a program's instructions from their chunk notes.
void takeChunks(std::vector<rt::Instruction> &list, std::vector<int64_t> &chunks) {
  for (rt::Instruction &ins : list) {
    chunks.push_back(ins.attrs.value("loom.chunk", int64_t(0)));
    ins.attrs.erase("loom.chunk");
  }
}

struct PipelineSchedulePass : mlir::loom::impl::PipelineScheduleBase<PipelineSchedulePass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<BundleOptions> o = getCompileOptions(module);
    if (failed(o))
      return signalPassFailure();
    int64_t pp = o->pipelineParallel, vpp = o->virtualStages, m = o->microbatches;
    if (pp <= 1 && m <= 1)
      return; // forward and backward stay as they are
    planner::Schedule schedule;
    if (!planner::parseSchedule(o->schedule, schedule)) {
      module.emitError() << "unknown schedule '" << o->schedule << "'; use " << planner::scheduleChoices();
      return signalPassFailure();
    }
    Grid grid{o->dataParallel, o->tensorParallel, pp};
    auto build = [&](Step &step) -> LogicalResult {
      for (StepRank &sr : step.ranks) {
        rt::RankProgram &r = sr.program;
        if (r.outputs.size() != 1 || !r.programs.count("backward"))
          return module.emitError() << "loom-pipeline-schedule needs the training step's forward "
                                       "and backward programs (run loom-autodiff first)";
        Lowered l;
        l.forward = std::move(r.programs["forward"]);
        l.backward = std::move(r.programs["backward"]);
        takeChunks(l.forward, l.forwardChunk);
        takeChunks(l.backward, l.backwardChunk);
        l.base = r;
        l.backwardPass = schedule == planner::Schedule::ZeroBubbleH1
                             ? splitBackward(l.base, l.backward, l.backwardChunk)
                             : std::vector<int>(l.backward.size(), 1);
        l.paramGrads = sr.paramGrads;
        l.loss = r.outputs[0].buffer;
        l.chunks = pp * vpp;
        PipelineRank builder(l, r, grid, vpp, m, schedule);
        builder.build();
        sr.lossStage = builder.lossStage();
      }
      return success();
    };
    if (failed(updateStep(module, getArgument(), build)))
      return signalPassFailure();
  }
};

} // namespace
