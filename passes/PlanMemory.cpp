//===- PlanMemory.cpp - One arena per rank, packed by lifetime ------------===//
//
// The loom-plan-memory pass.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"
#include <algorithm>
#include <climits>

namespace mlir::loom {
#define GEN_PASS_DEF_PLANMEMORY
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {
constexpr int64_t kAlignment = 64;
int64_t alignUp(int64_t v) { return (v + kAlignment - 1) / kAlignment * kAlignment; }
} // namespace

void mlir::loom::planMemory(rt::RankProgram &rank, const std::vector<std::string> &programNames) {
  std::vector<rt::Instruction> program; // all programs in execution order
  for (const std::string &name : programNames)
    if (auto it = rank.programs.find(name); it != rank.programs.end())
      program.insert(program.end(), it->second.begin(), it->second.end());
  auto root = [&](int64_t id) { return rt::storageOf(rank, id); };
  size_t n = rank.buffers.size();
  std::vector<int64_t> first(n, INT64_MAX), last(n, -1);
  for (size_t i = 0; i < program.size(); ++i) {
    for (int64_t id : program[i].out) {
      int64_t r = root(id);
      first[r] = std::min<int64_t>(first[r], i);
      last[r] = std::max<int64_t>(last[r], i);
    }
    for (int64_t id : program[i].in) {
      int64_t r = root(id);
      first[r] = std::min<int64_t>(first[r], i);
      last[r] = std::max<int64_t>(last[r], i);
    }
  }
  // Parameter gradients stay readable after the step (the C API and the
  // optimizer read them), so they live to the end.
  for (const rt::Parameter &p : rank.params)
    if (p.grad >= 0) {
      int64_t r = root(p.grad);
      last[r] = static_cast<int64_t>(program.size());
      first[r] = std::min<int64_t>(first[r], last[r]);
    }
  // Persistent buffers first, in id order.
  int64_t offset = 0;
  std::vector<int64_t> activations;
  for (rt::Buffer &b : rank.buffers) {
    if (b.viewOf >= 0)
      continue;
    if (b.role == rt::BufferRole::Activation) {
      activations.push_back(b.id);
      continue;
    }
    b.offset = offset;
    offset += alignUp(b.bytes);
  }
  int64_t base = offset;
  // Greedy by size: each activation takes the lowest offset that does not
  // overlap a placed activation whose lifetime intersects its own.
  std::stable_sort(activations.begin(), activations.end(), [&](int64_t a, int64_t b) {
    return rank.buffers[a].bytes > rank.buffers[b].bytes;
  });
  struct Placed {
    int64_t begin, end, first, last;
  };
  std::vector<Placed> placed;
  int64_t peak = 0;
  for (int64_t id : activations) {
    int64_t size = alignUp(rank.buffers[id].bytes);
    std::vector<std::pair<int64_t, int64_t>> busy;
    for (const Placed &p : placed)
      if (!(p.last < first[id] || last[id] < p.first))
        busy.push_back({p.begin, p.end});
    std::sort(busy.begin(), busy.end());
    int64_t at = 0;
    for (auto [b, e] : busy) {
      if (at + size <= b)
        break;
      at = std::max(at, e);
    }
    placed.push_back({at, at + size, first[id], last[id]});
    rank.buffers[id].offset = base + at;
    peak = std::max(peak, at + size);
  }
  for (rt::Buffer &b : rank.buffers)
    if (b.viewOf >= 0)
      b.offset = rank.buffers[root(b.id)].offset;
  rank.peakActivationBytes = peak;
  rank.arenaBytes = base + peak;
}

namespace {

struct PlanMemoryPass : mlir::loom::impl::PlanMemoryBase<PlanMemoryPass> {
  void runOnOperation() override {
    auto rewrite = [&](Step &step) -> LogicalResult {
      for (StepRank &sr : step.ranks) {
        planMemory(sr.program, {"forward", "step", "backward", "update"});
      }
      return success();
    };
    if (failed(updateStep(getOperation(), getArgument(), rewrite)))
      return signalPassFailure();
  }
};

} // namespace
