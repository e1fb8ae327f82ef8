//===- MixedPrecision.cpp - bf16 compute, f32 master parameters -----------===//

#include "dialects/loom/IR/LoomOps.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "llvm/ADT/SetVector.h"
#include "mlir/IR/Builders.h"
#include "passes/Passes.h"

namespace mlir::loom {
#define GEN_PASS_DEF_MIXEDPRECISION
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;

static Type toBf16(Type type) {
  auto t = dyn_cast<RankedTensorType>(type);
  if (!t || !t.getElementType().isF32())
    return type;
  return RankedTensorType::get(t.getShape(), BFloat16Type::get(type.getContext()));
}

/// Casts an f32 value to bf16 right after it is defined and moves its uses,
/// except calls: entry points keep their f32 arguments and cast them inside.
static void castAfter(OpBuilder &b, Value v, Location loc) {
  if (!cast<RankedTensorType>(v.getType()).getElementType().isF32())
    return;
  auto castOp = b.create<CastOp>(loc, toBf16(v.getType()), v);
  v.replaceUsesWithIf(castOp.getResult(), [&](OpOperand &use) {
    return use.getOwner() != castOp && !isa<func::CallOp>(use.getOwner());
  });
  if (castOp.getResult().use_empty())
    castOp.erase();
}

/// Rewrites one function-like body; `bf16Args` turns its tensor arguments
/// into bf16 (blocks), otherwise they stay f32 and are cast on entry.
static LogicalResult convertBody(FunctionOpInterface fn, bool bf16Args) {
  Block &entry = fn.getFunctionBody().front();
  OpBuilder b(fn.getContext());
  SmallVector<Type> inputs;
  for (BlockArgument arg : entry.getArguments()) {
    if (bf16Args) {
      arg.setType(toBf16(arg.getType()));
    } else if (isa<RankedTensorType>(arg.getType())) {
      b.setInsertionPointToStart(&entry);
      castAfter(b, arg, arg.getLoc());
    }
    inputs.push_back(arg.getType());
  }
  SmallVector<GetOp> gets(fn.getFunctionBody().getOps<GetOp>());
  for (GetOp get : gets) {
    // A parameter read in several places (tied embeddings: the lookup and the
    // output projection) gets a cast before each reader, so a pipeline stage
    // casts its own replica instead of receiving another stage's bf16 copy
    // (and sending its gradient back) every microbatch.
    SetVector<Operation *> readers;
    for (OpOperand &use : get.getResult().getUses())
      if (!isa<func::CallOp>(use.getOwner()))
        readers.insert(use.getOwner());
    if (readers.size() > 1 && get.getType().getElementType().isF32()) {
      for (Operation *reader : readers) {
        b.setInsertionPoint(reader);
        auto castOp = b.create<CastOp>(get.getLoc(), toBf16(get.getType()), get.getResult());
        for (OpOperand &operand : reader->getOpOperands())
          if (operand.get() == get.getResult())
            operand.set(castOp.getResult());
      }
      continue;
    }
    b.setInsertionPointAfter(get);
    castAfter(b, get.getResult(), get.getLoc());
  }
  if (failed(refreshResultTypes(fn.getFunctionBody())))
    return failure();
  SmallVector<Type> results(entry.getTerminator()->getOperandTypes());
  fn.setType(FunctionType::get(fn.getContext(), inputs, results));
  return success();
}

LogicalResult mlir::loom::applyMixedPrecision(ModuleOp module) {
  return forEachFunction(module, [](FunctionOpInterface fn) {
    return convertBody(fn, /*bf16Args=*/isa<BlockOp>(fn));
  });
}

namespace mlir::loom {
namespace {
struct MixedPrecisionPass : public impl::MixedPrecisionBase<MixedPrecisionPass> {
  void runOnOperation() override {
    if (failed(applyMixedPrecision(getOperation())))
      signalPassFailure();
  }
};
} // namespace
} // namespace mlir::loom
