//===- Configure.cpp - The compile options and plan on the module ---------===//
//
// The loom-configure pass: the first stage of loom-compile, which checks the
// plan against the batch and schedule and records it on the module for every
// later stage to read.
//
//===----------------------------------------------------------------------===//

#include "compiler/planner/PipelineSchedule.h"
#include "passes/Passes.h"
#include "passes/StepState.h"

namespace mlir::loom {
#define GEN_PASS_DEF_CONFIGURE
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace planner = ::loom::planner;

/// Whether `o` is a plan the later stages can carry out; errors at the module.
static LogicalResult checkPlan(ModuleOp module, const BundleOptions &o) {
  int64_t dp = o.dataParallel, tp = o.tensorParallel, pp = o.pipelineParallel;
  int64_t vpp = o.virtualStages, m = o.microbatches;
  if (dp < 1 || tp < 1 || pp < 1 || vpp < 1 || m < 1)
    return module.emitError() << "parallel degrees and the microbatch count must be at least 1";
  if (o.batch % (dp * m) != 0)
    return module.emitError() << "the batch (" << o.batch << ") must divide evenly over " << dp
                              << " data-parallel ranks x " << m << " microbatches";
  if (!o.train && (dp > 1 || pp > 1 || m > 1))
    return module.emitError() << "inference bundles split over tensor parallelism only (tp); "
                                 "data and pipeline parallelism apply to training bundles (--train)";
  if (o.serve.enabled && o.train)
    return module.emitError() << "a bundle serves (--serve) or trains (--train), not both";
  planner::Schedule schedule;
  if (!planner::parseSchedule(o.schedule, schedule))
    return module.emitError() << "unknown schedule '" << o.schedule
                              << "'; use " << planner::scheduleChoices();
  if ((vpp > 1) != (schedule == planner::Schedule::Interleaved && pp > 1))
    return module.emitError() << "interleaved 1F1B needs pp > 1 and vpp > 1 (and vpp > 1 "
                                 "needs the interleaved schedule); got pp = "
                              << pp << ", vpp = " << vpp << ", schedule " << o.schedule;
  if (schedule == planner::Schedule::Interleaved && m % pp != 0)
    return module.emitError() << "interleaved 1F1B needs the microbatch count (" << m
                              << ") to be a multiple of pp (" << pp << ")";
  if (o.zero1 && (dp < 2 || o.training.optimizer == "none"))
    return module.emitError() << "ZeRO-" << (o.zero3 ? 3 : o.zero2 ? 2 : 1) << " partitions optimizer state over data-parallel "
                                 "ranks: it needs dp >= 2 and an optimizer";
  if (o.zero2 && !o.zero1)
    return module.emitError() << "ZeRO-2 shards the gradients beside ZeRO-1's optimizer state: set both";
  if (o.zero3 && !o.zero2)
    return module.emitError() << "ZeRO-3 shards the parameters beside ZeRO-2's gradients and state: set all three";
  if (o.zero2 && m > 1)
    return module.emitError() << "ZeRO-" << (o.zero3 ? 3 : 2) << " frees each gradient once its bucket is "
                              << "reduce-scattered, but with " << m
                              << " microbatches the sums live through the step: use zero=1";
  if (o.zero3 && pp > 1)
    return module.emitError() << "ZeRO-3 gathers each weight for the forward and again for the backward of "
                                 "one stage; with pp = " << pp << " use zero=1 or zero=2";
  return success();
}

namespace {

struct ConfigurePass : mlir::loom::impl::ConfigureBase<ConfigurePass> {
  ConfigurePass() = default;
  explicit ConfigurePass(BundleOptions options) : options(std::move(options)), given(true) {}

  void runOnOperation() override {
    ModuleOp module = getOperation();
    // Run alone, it keeps what the module says (or the defaults).
    FailureOr<BundleOptions> o = given ? FailureOr<BundleOptions>(options) : getCompileOptions(module);
    if (failed(o) || failed(checkPlan(module, *o)))
      return signalPassFailure();
    setCompileOptions(module, *o);
  }

  BundleOptions options;
  bool given = false;
};

} // namespace

std::unique_ptr<Pass> mlir::loom::createConfigurePass() { return std::make_unique<ConfigurePass>(); }
std::unique_ptr<Pass> mlir::loom::createConfigurePass(const BundleOptions &options) {
  return std::make_unique<ConfigurePass>(options);
}
