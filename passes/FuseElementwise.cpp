//===- FuseElementwise.cpp - Fused kernels and GEMM epilogues -------------===//
//
// The loom-fuse-elementwise pass (the rewrites are in passes/Fusion.cpp).
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"
#include "passes/Fusion.h"

namespace mlir::loom {
#define GEN_PASS_DEF_FUSEELEMENTWISE
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

struct FuseElementwisePass : mlir::loom::impl::FuseElementwiseBase<FuseElementwisePass> {
  void runOnOperation() override {
    int64_t nextKernel = 0; // numbered across ranks, in rank order
    auto rewrite = [&](StepRank &rank) {
      fuseElementwise(rank.program, nextKernel);
    };
    if (failed(updateEachRank(getOperation(), getArgument(), rewrite)))
      signalPassFailure();
  }
};

} // namespace
