//===- NhwcLayout.cpp - Channels-last layout for convolution networks -----===//
//
// Tensor cores read convolutions best with the channels innermost (NHWC), so
// for a convolution network this pass runs every convolution, batch norm and
// pooling in NHWC (`layout = "nhwc"`, NHWC tensor types, OHWI filters), with
// `loom.transpose` conversions put around each and then moved and cancelled:
// elementwise ops take the layout of their operands, repeated blocks pass
// their images in NHWC, a transpose of a transpose cancels, and a reduction
// over the spatial axes (the global average pool) reads NHWC directly. What
// is left converts the input image once, and each filter where it is read.
// Gradients follow from the rewritten ops' own rules in loom-autodiff.
//
//===----------------------------------------------------------------------===//

#include "dialects/loom/IR/LoomOps.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/PatternMatch.h"
#include "mlir/Transforms/GreedyPatternRewriteDriver.h"
#include "passes/Passes.h"

namespace mlir::loom {
#define GEN_PASS_DEF_NHWCLAYOUT
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;

namespace {

// Result dimension i of a transpose is input dimension permutation[i].
constexpr int64_t kToNhwc[] = {0, 2, 3, 1}; // NCHW -> NHWC, OIHW -> OHWI
constexpr int64_t kToNchw[] = {0, 3, 1, 2}; // NHWC -> NCHW

bool isImage(Type type) {
  auto tensor = dyn_cast<RankedTensorType>(type);
  return tensor && tensor.getRank() == 4;
}

RankedTensorType permuted(Type type, ArrayRef<int64_t> perm) {
  auto tensor = cast<RankedTensorType>(type);
  SmallVector<int64_t> shape;
  for (int64_t p : perm)
    shape.push_back(tensor.getDimSize(p));
  return RankedTensorType::get(shape, tensor.getElementType());
}

Value transposed(OpBuilder &b, Location loc, Value x, ArrayRef<int64_t> perm) {
  return b.create<TransposeOp>(loc, permuted(x.getType(), perm), x, b.getDenseI64ArrayAttr(perm));
}

/// Rewrites a convolution, batch norm or pooling op on NCHW images into its
/// NHWC form between conversions, which the patterns below then cancel.
void convertToNhwc(Operation *op) {
  OpBuilder b(op);
  Location loc = op->getLoc();
  Value x = transposed(b, loc, op->getOperand(0), kToNhwc);
  Value filter = isa<Conv2DOp>(op) ? transposed(b, loc, op->getOperand(1), kToNhwc) : Value();
  Operation *nhwc = b.clone(*op);
  nhwc->setOperand(0, x);
  if (filter)
    nhwc->setOperand(1, filter);
  nhwc->setAttr("layout", b.getStringAttr("nhwc"));
  nhwc->getResult(0).setType(permuted(op->getResult(0).getType(), kToNhwc));
  op->getResult(0).replaceAllUsesWith(transposed(b, loc, nhwc->getResult(0), kToNchw));
  op->erase();
}

bool isLaidOut(Operation *op) {
  if (op->hasAttr("layout"))
    return false;
  if (isa<Conv2DOp, MaxPool2DOp, AvgPool2DOp>(op))
    return true;
  return isa<BatchNormOp>(op) && isImage(op->getOperand(0).getType());
}

/// A block's images pass in NHWC: its 4-D arguments and results change type,
/// with conversions inside (at entry and before the yield) and around every
/// loom.repeat of it.
void convertSignature(BlockOp block, ModuleOp module) {
  Block &entry = block.getBody().front();
  OpBuilder b = OpBuilder::atBlockBegin(&entry);
  SmallVector<Type> inputs;
  for (BlockArgument arg : entry.getArguments()) {
    if (isImage(arg.getType())) {
      Type nchw = arg.getType();
      arg.setType(permuted(nchw, kToNhwc));
      auto back = b.create<TransposeOp>(block.getLoc(), nchw, arg, b.getDenseI64ArrayAttr(kToNchw));
      arg.replaceAllUsesExcept(back, back.getOperation());
    }
    inputs.push_back(arg.getType());
  }
  Operation *yield = entry.getTerminator();
  b.setInsertionPoint(yield);
  for (OpOperand &result : yield->getOpOperands())
    if (isImage(result.get().getType()))
      result.set(transposed(b, yield->getLoc(), result.get(), kToNhwc));
  block.setFunctionType(FunctionType::get(block.getContext(), inputs, SmallVector<Type>(yield->getOperandTypes())));

  module.walk([&](RepeatOp repeat) {
    if (repeat.getBlock() != block.getSymName())
      return;
    OpBuilder rb(repeat);
    for (OpOperand &in : repeat->getOpOperands())
      if (isImage(in.get().getType()))
        in.set(transposed(rb, repeat.getLoc(), in.get(), kToNhwc));
    rb.setInsertionPointAfter(repeat);
    for (OpResult r : repeat->getResults()) {
      if (!isImage(r.getType()))
        continue;
      r.setType(permuted(r.getType(), kToNhwc));
      Value back = transposed(rb, repeat.getLoc(), r, kToNchw);
      r.replaceAllUsesExcept(back, back.getDefiningOp());
    }
  });
}

/// transpose(transpose(x, p), q) is x when the two undo each other, else one
/// transpose.
struct FoldTransposes : OpRewritePattern<TransposeOp> {
  using OpRewritePattern::OpRewritePattern;
  LogicalResult matchAndRewrite(TransposeOp op, PatternRewriter &rewriter) const override {
    auto inner = op.getX().getDefiningOp<TransposeOp>();
    if (!inner)
      return failure();
    ArrayRef<int64_t> p = inner.getPermutation(), q = op.getPermutation();
    SmallVector<int64_t> composed;
    bool identity = true;
    for (size_t i = 0; i < q.size(); ++i) {
      composed.push_back(p[q[i]]);
      identity &= composed.back() == int64_t(i);
    }
    if (identity)
      rewriter.replaceOp(op, inner.getX());
    else
      rewriter.replaceOpWithNewOp<TransposeOp>(op, op.getType(), inner.getX(),
                                               rewriter.getDenseI64ArrayAttr(composed));
    return success();
  }
};

/// An elementwise op whose image operands are all the same conversion of
/// same-shaped values runs on those values, converting its result instead:
/// conversions move down to where a layout-aware op cancels them.
struct SinkTransposeThroughElementwise : RewritePattern {
  SinkTransposeThroughElementwise(MLIRContext *ctx)
      : RewritePattern(MatchAnyOpTypeTag(), /*benefit=*/1, ctx) {}
  LogicalResult matchAndRewrite(Operation *op, PatternRewriter &rewriter) const override {
    if (!isa<AddOp, SubOp, MulOp, DivOp, ReluOp, GeluOp, SiluOp, ExpOp, TanhOp, RsqrtOp, NegOp, ScaleOp,
             CastOp>(op) ||
        op->getNumResults() != 1)
      return failure();
    Type resultType = op->getResult(0).getType();
    if (!isImage(resultType))
      return failure();
    SmallVector<Value> sources;
    ArrayRef<int64_t> perm;
    for (Value operand : op->getOperands()) {
      auto t = operand.getDefiningOp<TransposeOp>();
      // Broadcasting operands would need their own conversion: leave those.
      if (!t || cast<RankedTensorType>(operand.getType()).getShape() !=
                    cast<RankedTensorType>(resultType).getShape())
        return failure();
      if (!perm.empty() && t.getPermutation() != perm)
        return failure();
      perm = t.getPermutation();
      sources.push_back(t.getX());
    }
    Operation *moved = rewriter.clone(*op);
    moved->setOperands(sources);
    moved->getResult(0).setType(permuted(resultType, inversePermutation(perm)));
    rewriter.replaceOp(op, transposed(rewriter, op->getLoc(), moved->getResult(0), perm));
    return success();
  }

  static SmallVector<int64_t> inversePermutation(ArrayRef<int64_t> perm) {
    SmallVector<int64_t> inverse(perm.size());
    for (size_t i = 0; i < perm.size(); ++i)
      inverse[perm[i]] = int64_t(i);
    return inverse;
  }
};

/// A reduction without keepdim whose kept dimensions stay in order under
/// the transpose (the global average pool over H and W) reads the
/// transpose's input, reducing the corresponding axes.
template <typename ReduceOp> struct ReduceThroughTranspose : OpRewritePattern<ReduceOp> {
  using OpRewritePattern<ReduceOp>::OpRewritePattern;
  LogicalResult matchAndRewrite(ReduceOp op, PatternRewriter &rewriter) const override {
    auto t = op.getX().template getDefiningOp<TransposeOp>();
    if (!t || op.getKeepdim())
      return failure();
    ArrayRef<int64_t> perm = t.getPermutation();
    int64_t rank = int64_t(perm.size());
    SmallVector<bool> reduced(rank, false);
    for (int64_t a : op.getAxes()) {
      if (a < -rank || a >= rank)
        return failure();
      reduced[a < 0 ? a + rank : a] = true;
    }
    SmallVector<int64_t> axes;
    int64_t lastKept = -1;
    for (int64_t i = 0; i < rank; ++i) {
      if (reduced[i]) {
        axes.push_back(perm[i]);
        continue;
      }
      if (perm[i] < lastKept)
        return failure();
      lastKept = perm[i];
    }
    llvm::sort(axes);
    rewriter.modifyOpInPlace(op, [&] {
      op.getXMutable().assign(t.getX());
      op.setAxes(axes);
    });
    return success();
  }
};

struct NhwcLayoutPass : mlir::loom::impl::NhwcLayoutBase<NhwcLayoutPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    bool convolutions = false;
    module.walk([&](Conv2DOp) { convolutions = true; });
    if (!convolutions)
      return;
    for (BlockOp block : module.getOps<BlockOp>()) {
      bool hasConv = false;
      block.walk([&](Conv2DOp) { hasConv = true; });
      if (hasConv)
        convertSignature(block, module);
    }
    SmallVector<Operation *> ops;
    module.walk([&](Operation *op) {
      if (isLaidOut(op))
        ops.push_back(op);
    });
    for (Operation *op : ops)
      convertToNhwc(op);

    RewritePatternSet patterns(&getContext());
    patterns.add<FoldTransposes, SinkTransposeThroughElementwise, ReduceThroughTranspose<ReduceMeanOp>,
                 ReduceThroughTranspose<ReduceSumOp>>(&getContext());
    if (failed(applyPatternsAndFoldGreedily(module, std::move(patterns))))
      return signalPassFailure();
  }
};

} // namespace
