//===- SpecializeBatch.cpp - Give the batch dimension a size --------------===//

#include "dialects/loom/IR/LoomOps.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "passes/Passes.h"

namespace mlir::loom {
#define GEN_PASS_DEF_SPECIALIZEBATCH
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;

static Type withBatch(Type type, int64_t batch) {
  auto tensor = dyn_cast<RankedTensorType>(type);
  if (!tensor || tensor.hasStaticShape())
    return type;
  SmallVector<int64_t> shape(tensor.getShape());
  for (int64_t &d : shape)
    if (ShapedType::isDynamic(d))
      d = batch;
  return RankedTensorType::get(shape, tensor.getElementType());
}

/// Rewrites the argument types of a function-like op, refreshes its body and
/// sets its result types from what its terminator now returns.
static LogicalResult specializeFunction(FunctionOpInterface fn, int64_t batch) {
  Block &entry = fn.getFunctionBody().front();
  SmallVector<Type> inputs;
  for (BlockArgument arg : entry.getArguments()) {
    arg.setType(withBatch(arg.getType(), batch));
    inputs.push_back(arg.getType());
  }
  if (failed(refreshResultTypes(fn.getFunctionBody())))
    return failure();
  Operation *terminator = entry.getTerminator();
  SmallVector<Type> results(terminator->getOperandTypes());
  fn.setType(FunctionType::get(fn.getContext(), inputs, results));
  return success();
}

LogicalResult mlir::loom::specializeBatch(ModuleOp module, int64_t batch) {
  if (batch < 1)
    return module.emitError() << "batch must be at least 1, got " << batch;
  return forEachFunction(module, [&](FunctionOpInterface fn) {
    return specializeFunction(fn, batch);
  });
}

namespace mlir::loom {
namespace {
struct SpecializeBatchPass : public impl::SpecializeBatchBase<SpecializeBatchPass> {
  using SpecializeBatchBase::SpecializeBatchBase;
  void runOnOperation() override {
    if (failed(specializeBatch(getOperation(), batch)))
      signalPassFailure();
  }
};
} // namespace
} // namespace mlir::loom
