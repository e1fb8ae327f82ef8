//===- CompactRanks.cpp - Drop what a rank never touches ------------------===//
//
// The loom-compact-ranks pass: each rank keeps the buffers and parameters its
// programs use (a pipeline stage drops the other stages' layers), renumbered.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"


namespace mlir::loom {
#define GEN_PASS_DEF_COMPACTRANKS
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

void mlir::loom::compactRank(rt::RankProgram &r) {
  std::vector<bool> used(r.buffers.size(), false);
  auto mark = [&](int64_t id) {
    for (; id >= 0; id = r.buffers[id].viewOf)
      used[id] = true;
  };
  std::set<int64_t> touched;
  for (auto &[name, list] : r.programs)
    for (const rt::Instruction &ins : list) {
      for (int64_t id : ins.in)
        mark(id), touched.insert(id);
      for (int64_t id : ins.out)
        mark(id), touched.insert(id);
    }
  std::vector<rt::Parameter> params;
  for (rt::Parameter &p : r.params)
    if (touched.count(p.buffer))
      params.push_back(p);
  r.params = std::move(params);
  for (const rt::NamedBuffer &nb : r.inputs)
    mark(nb.buffer);
  for (const rt::NamedBuffer &nb : r.outputs)
    mark(nb.buffer);
  for (const rt::NamedBuffer &nb : r.state)
    mark(nb.buffer);
  std::vector<int64_t> to(r.buffers.size(), -1);
  std::vector<rt::Buffer> kept;
  for (size_t i = 0; i < r.buffers.size(); ++i)
    if (used[i]) {
      to[i] = static_cast<int64_t>(kept.size());
      kept.push_back(r.buffers[i]);
      kept.back().id = to[i];
    }
  for (rt::Buffer &b : kept)
    if (b.viewOf >= 0)
      b.viewOf = to[b.viewOf];
  r.buffers = std::move(kept);
  for (auto &[name, list] : r.programs)
    for (rt::Instruction &ins : list) {
      for (int64_t &id : ins.in)
        id = to[id];
      for (int64_t &id : ins.out)
        id = to[id];
    }
  for (rt::Parameter &p : r.params) {
    p.buffer = to[p.buffer];
    if (p.grad >= 0)
      p.grad = to[p.grad];
  }
  for (auto *list : {&r.inputs, &r.outputs, &r.state})
    for (rt::NamedBuffer &nb : *list)
      nb.buffer = to[nb.buffer];
}

namespace {

struct CompactRanksPass : mlir::loom::impl::CompactRanksBase<CompactRanksPass> {
  void runOnOperation() override {
    auto rewrite = [&](StepRank &rank) {
      compactRank(rank.program);
    };
    if (failed(updateEachRank(getOperation(), getArgument(), rewrite)))
      signalPassFailure();
  }
};

} // namespace
