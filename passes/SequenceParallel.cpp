//===- SequenceParallel.cpp - The tokens split between tp regions ---------===//
//
// Megatron-LM's sequence parallelism over loom-partition-tp's output. A
// tensor-parallel layer reads a replicated input (loom.grad_all_reduce) and
// its partial results are summed on every rank (loom.all_reduce); between two
// layers every rank repeats the same residual adds, biases and norms on every
// token. Here the sum becomes a reduce-scatter along the leading (batch)
// axis, so that each rank keeps 1/tp of the tokens, and the entry of the next
// layer an all-gather of them:
//
//   matmul (row-parallel) -> reduce_scatter -> add, layernorm, ... (1/tp of
//   the tokens) -> all_gather -> matmul (column-parallel)
//
// The bytes on the wire are the all-reduce's (a ring all-reduce is a
// reduce-scatter and an all-gather); the work and the activations between
// the layers are divided by tp. Their gradients swap (each is the other's
// rule), and the replicated parameters read there (norm scales, biases,
// position embeddings) get a gradient from each rank's own tokens: they are
// marked `loom.partial_grad = "tp"` for loom-data-parallel to sum.
//
// Splitting the leading axis rather than the sequence keeps each rank's part
// contiguous (NCCL's collectives move contiguous parts) and leaves position
// embeddings whole; per-token ops cannot tell the difference. The leading
// axis is the (micro)batch, which tp must divide.
//
//===----------------------------------------------------------------------===//

#include "dialects/loom/IR/LoomOps.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/Verifier.h"
#include "passes/Passes.h"

#include "llvm/ADT/SetVector.h"

namespace mlir::loom {
#define GEN_PASS_DEF_SEQUENCEPARALLEL
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;

namespace {

class SequenceParallel {
public:
  SequenceParallel(ModuleOp module, int64_t tp) : module(module), tp(tp), b(module.getContext()) {}

  LogicalResult run() {
    SmallVector<AllReduceOp> reduces;
    SmallVector<GradAllReduceOp> entries;
    module.walk([&](AllReduceOp op) {
      if (op.getGroup() == "tp")
        reduces.push_back(op);
    });
    module.walk([&](GradAllReduceOp op) {
      if (op.getGroup() == "tp")
        entries.push_back(op);
    });
    if (reduces.empty())
      return module.emitError() << "sequence parallelism found no tensor-parallel all-reduce to "
                                   "split the tokens after; run loom-partition-tp first";
    for (AllReduceOp r : reduces)
      if (failed(scatter(r)))
        return failure();
    for (GradAllReduceOp e : entries)
      gather(e);
    while (!work.empty()) {
      Value v = work.pop_back_val();
      for (OpOperand &use : llvm::make_early_inc_range(v.getUses()))
        if (failed(follow(use)))
          return failure();
    }
    // A layer's output is its next application's input: what a block
    // returns split, it must take split, and the other way round.
    for (BlockOp block : module.getOps<BlockOp>()) {
      auto yield = cast<YieldOp>(block.getBody().front().getTerminator());
      for (auto [i, arg] : llvm::enumerate(block.getBody().front().getArguments()))
        if (i < yield.getNumOperands() && split.count(arg) != split.count(yield.getOperand(i)))
          return yield.emitError() << "returns operand " << i << (split.count(arg) ? " whole" : " split")
                                   << " but takes it " << (split.count(arg) ? "split" : "whole")
                                   << "; sequence parallelism needs a layer's tokens split throughout";
    }
    for (Operation *op : tokenwise)
      if (failed(checkOperands(op)))
        return failure();
    if (failed(markParameters()))
      return failure();
    if (failed(forEachFunction(module, [&](FunctionOpInterface fn) { return refreshFunction(fn); })))
      return failure();
    return verify(module);
  }

private:
  /// The type holding 1/tp of `type`'s leading dimension.
  FailureOr<RankedTensorType> part(Operation *at, Type t) {
    auto type = dyn_cast<RankedTensorType>(t);
    if (!type || type.getRank() < 2 || type.isDynamicDim(0) || type.getDimSize(0) % tp != 0)
      return at->emitError() << "sequence parallelism splits the tokens along the leading "
                                "(batch) dimension, which tp = "
                             << tp << " must divide; " << t
                             << " does not split: use a (micro)batch that tp divides, or sp=0";
    SmallVector<int64_t> shape(type.getShape());
    shape[0] /= tp;
    return RankedTensorType::get(shape, type.getElementType());
  }

  LogicalResult scatter(AllReduceOp r) {
    if (r.getReduction() != "sum")
      return r.emitError() << "sequence parallelism turns sums over tp into reduce-scatters; this "
                              "all-reduce takes the "
                           << r.getReduction();
    FailureOr<RankedTensorType> type = part(r, r.getType());
    if (failed(type))
      return failure();
    b.setInsertionPoint(r);
    auto rs = b.create<ReduceScatterOp>(r.getLoc(), *type, r.getX(), r.getGroupAttr(),
                                        b.getI64IntegerAttr(0), b.getI64IntegerAttr(tp));
    r.getResult().replaceAllUsesWith(rs.getResult());
    r.erase();
    markSplit(rs.getResult());
    return success();
  }

  void gather(GradAllReduceOp e) {
    b.setInsertionPoint(e);
    auto ag = b.create<AllGatherOp>(e.getLoc(), e.getType(), e.getX(), e.getGroupAttr(),
                                    b.getI64IntegerAttr(0), b.getI64IntegerAttr(tp));
    e.getResult().replaceAllUsesWith(ag.getResult());
    e.erase();
    gathers.insert(ag);
  }

  void markSplit(Value v) {
    if (split.insert(v))
      work.push_back(v);
  }

  /// Where a split value goes: into a gather (whole again), a layer, or an
  /// op that works token by token.
  LogicalResult follow(OpOperand &use) {
    Operation *user = use.getOwner();
    Value v = use.get();
    if (auto ag = dyn_cast<AllGatherOp>(user); ag && gathers.count(ag))
      return success();
    if (auto repeat = dyn_cast<RepeatOp>(user)) {
      BlockOp block = repeat.lookupBlock();
      if (!block)
        return repeat.emitOpError() << "refers to a missing block";
      unsigned i = use.getOperandNumber();
      BlockArgument arg = block.getBody().front().getArgument(i);
      FailureOr<RankedTensorType> type = part(repeat, arg.getType());
      if (failed(type))
        return failure();
      if (!split.count(arg))
        arg.setType(*type);
      markSplit(arg);
      if (i < repeat->getNumResults())
        markSplit(repeat->getResult(i));
      return success();
    }
    if (isa<YieldOp>(user))
      return success(); // checked against the block's arguments at the end
    if (isa<AddOp, SubOp, MulOp, DivOp, GeluOp, ReluOp, SiluOp, ExpOp, TanhOp, RsqrtOp, NegOp, ScaleOp, CastOp,
            LayerNormOp, RMSNormOp>(user)) {
      tokenwise.insert(user); // its other operands are checked once every split is known
      for (Value r : user->getResults())
        markSplit(r);
      return success();
    }
    if (auto reshape = dyn_cast<ReshapeOp>(user)) {
      // Keeps the element order, so a part along the old leading axis is the
      // same part along the new one when tp divides it.
      FailureOr<RankedTensorType> type = part(reshape, reshape.getType());
      if (failed(type))
        return failure();
      reshape.getResult().setType(*type);
      markSplit(reshape.getResult());
      return success();
    }
    return user->emitError() << "reads tokens that sequence parallelism splits over tp (" << v.getType()
                             << ", 1/" << tp << " of them), and has no rule for them; sequence parallelism "
                                "covers residual adds, biases, activations and norms between "
                                "tensor-parallel layers: use sp=0 for this model";
  }

  /// A token-wise op reads split operands, or parameters of lower rank that
  /// broadcast over the tokens (whose gradients become partial).
  LogicalResult checkOperands(Operation *op) {
    int64_t rank = 0;
    for (Value v : op->getOperands())
      if (split.count(v))
        rank = std::max<int64_t>(rank, cast<RankedTensorType>(v.getType()).getRank());
    for (OpOperand &operand : op->getOpOperands()) {
      Value o = operand.get();
      if (split.count(o))
        continue;
      auto type = dyn_cast<RankedTensorType>(o.getType());
      ParamOp p = paramBehind(o);
      if (!type || type.getRank() >= rank || !p)
        return op->emitError() << "reads tokens split by sequence parallelism beside operand "
                               << operand.getOperandNumber() << " (" << o.getType()
                               << "), which is neither split nor a parameter broadcast over the tokens; use sp=0";
      partial.insert(p);
      partialReaders[p].insert(op);
    }
    return success();
  }

  /// The parameter `v` reads, through casts and reshapes; null otherwise.
  static ParamOp paramBehind(Value v) {
    while (Operation *def = v.getDefiningOp()) {
      if (auto get = dyn_cast<GetOp>(def))
        return get.lookupParam();
      if (!isa<CastOp, ReshapeOp, BroadcastOp>(def))
        return {};
      v = def->getOperand(0);
    }
    return {};
  }

  /// A parameter whose gradient comes from split tokens is summed over the
  /// group; one also read whole elsewhere would be counted tp times there.
  LogicalResult markParameters() {
    for (ParamOp p : partial) {
      if (p->hasAttr("loom.shard"))
        return p.emitError() << "is split over tp, but sequence parallelism reads it whole beside "
                                "split tokens";
      for (Operation *user : usersOf(p))
        if (!partialReaders[p].count(user))
          return user->emitError() << "reads @" << p.getSymName()
                                   << " beside whole tokens, which sequence parallelism reads beside "
                                      "split ones; its gradient would be summed over tp twice: use sp=0";
      p->setAttr("loom.partial_grad", b.getStringAttr("tp"));
    }
    return success();
  }

  /// The ops that read parameter `p` (through casts and reshapes).
  SmallVector<Operation *> usersOf(ParamOp p) {
    SmallVector<Operation *> users;
    std::function<void(Value)> visit = [&](Value v) {
      for (Operation *user : v.getUsers()) {
        if (isa<CastOp, ReshapeOp, BroadcastOp>(user))
          visit(user->getResult(0));
        else
          users.push_back(user);
      }
    };
    module.walk([&](GetOp get) {
      if (get.lookupParam() == p)
        visit(get.getResult());
    });
    return users;
  }

  ModuleOp module;
  int64_t tp;
  OpBuilder b;
  llvm::SetVector<Value> split;
  SmallVector<Value> work;
  llvm::SmallPtrSet<Operation *, 16> gathers;
  llvm::SetVector<Operation *> tokenwise;
  llvm::SetVector<ParamOp> partial;
  DenseMap<ParamOp, llvm::SmallPtrSet<Operation *, 4>> partialReaders;
};

} // namespace

LogicalResult mlir::loom::applySequenceParallel(ModuleOp module) {
  auto mesh = module->getAttrOfType<MeshAttr>("loom.mesh");
  std::optional<int64_t> tp = mesh ? mesh.getAxisSize("tp") : std::nullopt;
  if (!tp)
    return module.emitError() << "sequence parallelism needs a tensor-parallel module (loom.mesh with "
                                 "a \"tp\" axis): run loom-partition-tp with tp > 1 first";
  if (*tp == 1)
    return success();
  return SequenceParallel(module, *tp).run();
}

namespace mlir::loom {
namespace {
struct SequenceParallelPass : public impl::SequenceParallelBase<SequenceParallelPass> {
  void runOnOperation() override {
    if (failed(applySequenceParallel(getOperation())))
      signalPassFailure();
  }
};
} // namespace
} // namespace mlir::loom
