//===- DistributeRanks.cpp - One rank per device of the plan --------------===//
//
// The loom-distribute-ranks pass: the lowered rank copied to every rank of the
// dp x tp x pp grid, with its coordinates, groups and shard indices.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"


namespace mlir::loom {
#define GEN_PASS_DEF_DISTRIBUTERANKS
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

struct DistributeRanksPass : mlir::loom::impl::DistributeRanksBase<DistributeRanksPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<BundleOptions> options = getCompileOptions(module);
    if (failed(options))
      return signalPassFailure();
    // Inference bundles split over tensor parallelism only.
    Grid grid = options->train ? Grid{options->dataParallel, options->tensorParallel,
                                      options->pipelineParallel}
                               : Grid{1, options->tensorParallel, 1};
    auto distribute = [&](Step &step) -> LogicalResult {
      if (step.ranks.size() != 1)
        return module.emitError() << "loom-distribute-ranks copies one lowered rank; the step "
                                     "has " << step.ranks.size();
      StepRank lowered = std::move(step.ranks[0]);
      step.ranks.clear();
      for (int64_t g = 0; g < grid.size(); ++g) {
        StepRank r = lowered;
        r.program.rank = g;
        if (grid.size() > 1)
          grid.describe(r.program);
        for (rt::Parameter &p : r.program.params)
          if (p.shard.axis >= 0)
            p.shard.index = grid.tpOf(g);
        step.ranks.push_back(std::move(r));
      }
      return success();
    };
    if (failed(updateStep(module, getArgument(), distribute)))
      return signalPassFailure();
  }
};

} // namespace
