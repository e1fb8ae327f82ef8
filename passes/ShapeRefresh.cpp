//===- ShapeRefresh.cpp - Re-infer types after a signature changes --------===//

#include "dialects/loom/IR/LoomOps.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "passes/Passes.h"
#include "llvm/ADT/SmallPtrSet.h"

#include <functional>

using namespace mlir;
using namespace mlir::loom;

/// Fills the dynamic dimensions of an explicitly typed result from the
/// operand, for ops whose result has the operand's element count (reshape)
/// or whose shape follows the operand (cast, broadcast).
static FailureOr<RankedTensorType> resolveExplicitResult(Operation *op) {
  auto in = cast<RankedTensorType>(op->getOperand(0).getType());
  auto out = cast<RankedTensorType>(op->getResult(0).getType());
  // Reshape and broadcast keep their operand's element type; a cast sets its own.
  if (!isa<CastOp>(op))
    out = RankedTensorType::get(out.getShape(), in.getElementType());
  if (out.hasStaticShape() || !in.hasStaticShape())
    return out;
  SmallVector<int64_t> shape(out.getShape());
  if (isa<ReshapeOp>(op)) {
    int64_t known = 1;
    for (int64_t d : shape)
      if (!ShapedType::isDynamic(d))
        known *= d;
    if (known == 0 || in.getNumElements() % known != 0)
      return op->emitOpError() << "cannot resolve the dynamic dimension of " << out
                               << " from " << in;
    for (int64_t &d : shape)
      if (ShapedType::isDynamic(d))
        d = in.getNumElements() / known;
  } else {
    // Cast keeps the shape; broadcast keeps the operand's trailing extents.
    int64_t offset = out.getRank() - in.getRank();
    for (int64_t i = 0; i < out.getRank(); ++i)
      if (ShapedType::isDynamic(shape[i]))
        shape[i] = i >= offset ? in.getDimSize(i - offset) : 1;
  }
  return RankedTensorType::get(shape, out.getElementType());
}

LogicalResult mlir::loom::refreshResultTypes(Region &region) {
  auto module = region.getParentOp()->getParentOfType<ModuleOp>();
  WalkResult result = region.walk([&](Operation *op) -> WalkResult {
    SmallVector<Type> types;
    if (auto infer = dyn_cast<InferTypeOpInterface>(op)) {
      if (failed(infer.inferReturnTypes(op->getContext(), op->getLoc(), op->getOperands(),
                                        op->getRawDictionaryAttrs(),
                                        op->getPropertiesStorage(), op->getRegions(), types)))
        return WalkResult::interrupt();
    } else if (isa<ReshapeOp, CastOp, BroadcastOp>(op)) {
      auto type = resolveExplicitResult(op);
      if (failed(type))
        return WalkResult::interrupt();
      types.push_back(*type);
    } else if (isa<GeluOp, ReluOp, SiluOp, ExpOp, TanhOp, RsqrtOp, NegOp, ScaleOp, SoftmaxOp,
                   LayerNormOp, RMSNormOp, BatchNormOp, RotaryOp, AllReduceOp, GradAllReduceOp>(op)) {
      types.push_back(op->getOperand(0).getType());
    } else if (auto repeat = dyn_cast<RepeatOp>(op)) {
      BlockOp block = repeat.lookupBlock();
      if (!block)
        return WalkResult(repeat.emitOpError() << "refers to a missing block");
      llvm::append_range(types, block.getResultTypes());
    } else if (auto call = dyn_cast<func::CallOp>(op)) {
      auto callee = module ? module.lookupSymbol<func::FuncOp>(call.getCallee()) : nullptr;
      if (!callee)
        return WalkResult(call.emitOpError() << "refers to a missing function");
      llvm::append_range(types, callee.getResultTypes());
    } else {
      return WalkResult::advance();
    }
    for (auto [value, type] : llvm::zip(op->getResults(), types))
      value.setType(type);
    return WalkResult::advance();
  });
  return failure(result.wasInterrupted());
}

LogicalResult mlir::loom::refreshFunction(FunctionOpInterface fn) {
  Block &entry = fn.getFunctionBody().front();
  if (failed(refreshResultTypes(fn.getFunctionBody())))
    return failure();
  SmallVector<Type> results(entry.getTerminator()->getOperandTypes());
  fn.setType(FunctionType::get(fn.getContext(), entry.getArgumentTypes(), results));
  return success();
}

LogicalResult mlir::loom::forEachFunction(ModuleOp module,
                                          function_ref<LogicalResult(FunctionOpInterface)> fn) {
  for (BlockOp block : module.getOps<BlockOp>())
    if (failed(fn(block)))
      return failure();
  // Callees before callers, so that calls see their callees' new signatures.
  llvm::SmallPtrSet<Operation *, 8> done;
  std::function<LogicalResult(func::FuncOp)> visit = [&](func::FuncOp f) -> LogicalResult {
    if (!done.insert(f).second || f.isExternal())
      return success();
    WalkResult calls = f.walk([&](func::CallOp call) {
      if (auto callee = module.lookupSymbol<func::FuncOp>(call.getCallee()))
        if (failed(visit(callee)))
          return WalkResult::interrupt();
      return WalkResult::advance();
    });
    if (calls.wasInterrupted())
      return failure();
    return fn(f);
  };
  for (auto f : module.getOps<func::FuncOp>())
    if (failed(visit(f)))
      return failure();
  return success();
}
