//===- PipelineSplit.cpp - Forward units into pipeline chunks -------------===//
//
// The loom-pipeline-split pass: which pipeline chunk each forward entry of a
// training step belongs to.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"
#include <numeric>

namespace mlir::loom {
#define GEN_PASS_DEF_PIPELINESPLIT
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

/// Units of pipelining in program order: what comes before the first layer,
/// each layer (a block application), what sits between layers, and what
/// follows the last; returns each record's unit.
std::vector<int64_t> unitsOf(const std::vector<std::string> &layers, int64_t &count) {
  std::vector<int64_t> unit(layers.size(), 0);
  count = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (i > 0 && layers[i] != layers[i - 1])
      ++count;
    unit[i] = count;
  }
  count = layers.empty() ? 0 : count + 1;
  return unit;
}

struct PipelineSplitPass : mlir::loom::impl::PipelineSplitBase<PipelineSplitPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<BundleOptions> options = getCompileOptions(module);
    if (failed(options))
      return signalPassFailure();
    int64_t pp = options->pipelineParallel, m = options->microbatches;
    if (pp <= 1 && m <= 1)
      return; // one stage, one microbatch: nothing to split
    int64_t chunks = pp * options->virtualStages;
    auto split = [&](Step &step) -> LogicalResult {
      if (step.ranks.size() != 1)
        return module.emitError() << "loom-pipeline-split runs on the one lowered rank, before "
                                     "loom-distribute-ranks";
      std::vector<rt::Instruction> &forward = step.ranks[0].program.programs["forward"];
      std::vector<std::string> layers;
      for (const rt::Instruction &entry : forward)
        layers.push_back(entry.attrs.value("loom.layer", std::string()));
      int64_t units = 0;
      std::vector<int64_t> unit = unitsOf(layers, units);
      std::vector<int64_t> perChunk = options->chunkUnits;
      if (perChunk.empty()) {
        if (units < chunks)
          return module.emitError()
                 << "pp x vpp = " << chunks << " pipeline chunks, but the model has only " << units
                 << " units to split (what precedes the first layer, each layer, what follows the "
                    "last); use fewer stages";
        for (int64_t c = 0; c < chunks; ++c)
          perChunk.push_back((c + 1) * units / chunks - c * units / chunks);
      }
      if (int64_t(perChunk.size()) != chunks ||
          std::accumulate(perChunk.begin(), perChunk.end(), int64_t(0)) != units ||
          std::any_of(perChunk.begin(), perChunk.end(), [](int64_t n) { return n < 1; }))
        return module.emitError() << "the plan's stages do not cover the model's " << units
                                  << " units in " << chunks << " non-empty chunks";
      std::vector<int64_t> chunkOfUnit;
      for (int64_t c = 0; c < chunks; ++c)
        chunkOfUnit.insert(chunkOfUnit.end(), perChunk[c], c);
      for (size_t i = 0; i < forward.size(); ++i)
        forward[i].attrs["loom.chunk"] = chunkOfUnit[unit[i]];
      return success();
    };
    if (failed(updateStep(module, getArgument(), split)))
      return signalPassFailure();
  }
};

} // namespace
