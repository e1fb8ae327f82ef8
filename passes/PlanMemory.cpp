//===- PlanMemory.cpp - One arena per rank, packed by lifetime ------------===//
//
// The loom-plan-memory pass.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"
#include "loom/rt/Checked.h"
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
} // namespace

LogicalResult mlir::loom::planMemory(rt::RankProgram &rank, const std::vector<std::string> &programNames) {
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
  // Persistent buffers first, in id order. Sizes are below 2^51 bytes each
  // (LowerToStep's limit), but thousands of them can still pass int64.
  std::optional<int64_t> offset = 0;
  std::vector<int64_t> activations;
  for (rt::Buffer &b : rank.buffers) {
    if (b.viewOf >= 0)
      continue;
    if (b.role == rt::BufferRole::Activation) {
      activations.push_back(b.id);
      continue;
    }
    std::optional<int64_t> size = rt::checkedAlignUp(b.bytes, kAlignment);
    offset = size ? rt::checkedAdd(*offset, *size) : std::nullopt;
    if (!offset)
      return failure();
    b.offset = *offset - *size;
  }
  int64_t base = *offset;
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
    std::optional<int64_t> aligned = rt::checkedAlignUp(rank.buffers[id].bytes, kAlignment);
    if (!aligned)
      return failure();
    int64_t size = *aligned;
    std::vector<std::pair<int64_t, int64_t>> busy;
    for (const Placed &p : placed)
      if (!(p.last < first[id] || last[id] < p.first))
        busy.push_back({p.begin, p.end});
    std::sort(busy.begin(), busy.end());
    int64_t at = 0;
    for (auto [b, e] : busy) {
      if (std::optional<int64_t> end = rt::checkedAdd(at, size); end && *end <= b)
        break;
      at = std::max(at, e);
    }
    std::optional<int64_t> end = rt::checkedAdd(at, size);
    if (!end || !rt::checkedAdd(base, *end))
      return failure();
    placed.push_back({at, *end, first[id], last[id]});
    rank.buffers[id].offset = base + at;
    peak = std::max(peak, *end);
  }
  for (rt::Buffer &b : rank.buffers)
    if (b.viewOf >= 0)
      b.offset = rank.buffers[root(b.id)].offset;
  rank.peakActivationBytes = peak;
  rank.arenaBytes = base + peak;
  return success();
}

namespace {

struct PlanMemoryPass : mlir::loom::impl::PlanMemoryBase<PlanMemoryPass> {
  void runOnOperation() override {
    auto rewrite = [&](Step &step) -> LogicalResult {
      for (StepRank &sr : step.ranks) {
        // The training programs run in this order; any others (a serving
        // bundle's step programs, which run one at a time) follow.
        std::vector<std::string> order = {"forward", "step", "backward", "update"};
        for (const auto &[name, _] : sr.program.programs)
          if (std::find(order.begin(), order.end(), name) == order.end())
            order.push_back(name);
        if (failed(planMemory(sr.program, order)))
          return getOperation().emitError()
                 << "rank " << sr.program.rank << " needs an arena of more than 2^63 bytes";
      }
      return success();
    };
    if (failed(updateStep(getOperation(), getArgument(), rewrite)))
      return signalPassFailure();
  }
};

} // namespace
