//===- PartitionTensorParallel.cpp - Megatron tensor parallelism ----------===//
//
// Rewrites a model into the program of one of `tp` tensor-parallel ranks
// (every rank runs the same program on its own part of the weights):
//
//   - a linear layer (matmul by a 2-D parameter) on a replicated input is
//     column-parallel: its weight (and bias) keep 1/tp of the output
//     columns, and the input enters through loom.grad_all_reduce, whose
//     backward sums the input gradient over the ranks (Megatron's f);
//   - a linear layer on a split input is row-parallel: its weight keeps
//     1/tp of the input rows and loom.all_reduce sums the partial results
//     (Megatron's g);
//   - attention and rotary embedding split by heads (the q/k/v slices of a
//     fused projection become slices of the local part), elementwise ops
//     follow their operands;
//   - the embedding and the output projection split the vocabulary, and the
//     cross-entropy loss works on the local logits (vocab_group).
//
// A transformer layer thus gets exactly two all-reduces forward (after the
// attention and MLP output projections) and two backward. Ops with no rule
// must see replicated inputs; anything else is an error naming the op.
//
//===----------------------------------------------------------------------===//

#include "dialects/loom/IR/LoomOps.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/Verifier.h"
#include "passes/Passes.h"

#include "llvm/ADT/MapVector.h"
#include "llvm/ADT/SetVector.h"

namespace mlir::loom {
#define GEN_PASS_DEF_PARTITIONTENSORPARALLEL
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;

namespace {

/// A value is replicated on every rank, or split along its last dimension
/// (viewed as `blocks` equal blocks, each split in tp parts).
using State = TpState;

struct Shard {
  int64_t axis = 0, blocks = 1;
  bool operator==(const Shard &o) const { return axis == o.axis && blocks == o.blocks; }
};

class Partitioner {
public:
  Partitioner(ModuleOp module, int64_t tp, bool gatherOutputs)
      : module(module), tp(tp), gatherOutputs(gatherOutputs) {}

  LogicalResult run() {
    if (failed(forEachFunction(module, [&](FunctionOpInterface fn) { return analyse(fn); })))
      return failure();
    for (auto &[param, where] : replicatedUse)
      if (shards.count(param))
        return where->emitError() << "uses parameter @" << param.getSymName()
                                  << " whole, but tensor parallelism splits it elsewhere";
    if (shards.empty()) // every rank would compute the whole model: not what tp promises
      return module.emitError() << "tensor parallelism (tp = " << tp
                                << ") found no matrix product of a parameter to split; it "
                                   "splits linear layers that read their weight directly "
                                   "(run it before loom-mixed-precision), or use tp = 1";
    rewrite();
    if (gatherOutputs) // inference: what @forward returns split comes back whole
      if (auto forward = module.lookupSymbol<func::FuncOp>("forward"))
        gatherReturns(forward);
    if (failed(forEachFunction(module, [&](FunctionOpInterface fn) { return refreshFunction(fn); })))
      return failure();
    return verify(module);
  }

private:

  static ParamOp paramOf(Value v) {
    auto get = v.getDefiningOp<GetOp>();
    return get ? get.lookupParam() : ParamOp();
  }

  LogicalResult shardParam(Operation *user, ParamOp param, Shard s) {
    int64_t extent = param.getTensorType().getDimSize(s.axis);
    if (extent % (s.blocks * tp) != 0)
      return user->emitError() << "cannot split @" << param.getSymName() << " ("
                               << param.getType() << ") dimension " << s.axis << " over tp = "
                               << tp << (s.blocks > 1 ? " in each of its " : "")
                               << (s.blocks > 1 ? std::to_string(s.blocks) + " blocks" : "")
                               << "; choose a tp that divides " << extent / s.blocks;
    auto [it, inserted] = shards.try_emplace(param, s);
    if (!inserted && !(it->second == s))
      return user->emitError() << "splits @" << param.getSymName() << " along dimension " << s.axis
                               << ", but another use splits it along " << it->second.axis;
    return success();
  }

  LogicalResult analyse(FunctionOpInterface fn) {
    for (Operation &op : fn.getFunctionBody().getOps())
      if (failed(visit(op)))
        return failure();
    return success();
  }

  LogicalResult visit(Operation &op) {
    auto st = [&](Value v) { return state.lookup(v); };
    auto replicated = [&](Operation &o) -> LogicalResult {
      for (Value v : o.getOperands()) {
        if (st(v).split)
          return o.emitError() << "has no tensor-parallel rule for an input split over tp ("
                               << v.getType() << " holds 1/" << tp
                               << " of its last dimension); use tp = 1 for this model";
        if (ParamOp p = paramOf(v))
          replicatedUse.insert({p, &o});
      }
      return success();
    };
    if (isa<ParamOp, GetOp, func::ReturnOp>(op))
      return success();
    if (isa<AllReduceOp, GradAllReduceOp>(op))
      return op.emitError() << "the model is already partitioned";
    if (auto yield = dyn_cast<YieldOp>(op))
      return replicated(op);
    if (auto call = dyn_cast<func::CallOp>(op)) {
      if (failed(replicated(op)))
        return failure();
      auto callee = module.lookupSymbol<func::FuncOp>(call.getCallee());
      auto ret = cast<func::ReturnOp>(callee.getBody().front().getTerminator());
      for (auto [res, v] : llvm::zip(call.getResults(), ret.getOperands()))
        state[res] = st(v);
      return success();
    }
    if (isa<RepeatOp>(op))
      return replicated(op);

    // Every other op by its rule (TensorParallelOpInterface).
    SmallVector<TpState> operands;
    for (Value v : op.getOperands())
      operands.push_back(st(v));
    auto paramType = [&](Value v) {
      ParamOp p = paramOf(v);
      return p ? p.getTensorType() : RankedTensorType();
    };
    FailureOr<TpRule> rule = tensorParallelRule(&op, {operands, paramType, tp, /*emitErrors=*/true});
    if (failed(rule))
      return failure();
    for (const TpShard &shard : rule->shards)
      if (failed(shardParam(&op, paramOf(op.getOperand(shard.operand)), {shard.axis, shard.blocks})))
        return failure();
    if (rule->readsWhole)
      for (Value v : op.getOperands())
        if (ParamOp p = paramOf(v))
          replicatedUse.insert({p, &op});
    if (rule->entersRegion)
      enter.insert(&op);
    if (rule->reduceAfter)
      reduceAfter.push_back(&op);
    if (rule->splitsHeads)
      heads.push_back(&op);
    if (rule->vocabParallel)
      vocab.push_back(&op);
    if (rule->slicesBlocks)
      slices.push_back(cast<SliceOp>(op));
    for (auto [result, layout] : llvm::zip(op.getResults(), rule->results))
      state[result] = {layout.split, layout.blocks};
    return success();
  }

  void rewrite() {
    MLIRContext *ctx = module.getContext();
    OpBuilder b(ctx);
    StringAttr group = b.getStringAttr("tp");
    // Parameters take their local shapes; every read follows.
    for (auto &[param, s] : shards) {
      SmallVector<int64_t> shape(param.getTensorType().getShape());
      shape[s.axis] /= tp;
      param.setTypeAttr(TypeAttr::get(RankedTensorType::get(shape, param.getTensorType().getElementType())));
      param->setAttr("loom.shard", b.getDictionaryAttr({
                                       b.getNamedAttr("axis", b.getI64IntegerAttr(s.axis)),
                                       b.getNamedAttr("parts", b.getI64IntegerAttr(tp)),
                                       b.getNamedAttr("blocks", b.getI64IntegerAttr(s.blocks)),
                                       b.getNamedAttr("group", group)}));
    }
    module.walk([&](GetOp get) {
      if (ParamOp p = get.lookupParam(); p && shards.count(p))
        get.getResult().setType(p.getType());
    });
    // Replicated inputs of column-parallel layers enter the region once per value.
    DenseMap<Value, Value> entered;
    for (Operation *op : enter) {
      auto mm = cast<MatmulOp>(op);
      Value x = mm.getLhs();
      Value &in = entered[x];
      if (!in) {
        if (Operation *def = x.getDefiningOp())
          b.setInsertionPointAfter(def);
        else
          b.setInsertionPointToStart(cast<BlockArgument>(x).getOwner());
        in = b.create<GradAllReduceOp>(mm.getLoc(), x.getType(), x, group);
      }
      mm->setOperand(0, in);
    }
    for (Operation *op : reduceAfter) {
      b.setInsertionPointAfter(op);
      Value r = op->getResult(0);
      auto reduce = b.create<AllReduceOp>(op->getLoc(), r.getType(), r, group, b.getStringAttr("sum"));
      r.replaceAllUsesExcept(reduce.getResult(), reduce);
    }
    for (SliceOp slice : slices) {
      slice.setStart(slice.getStart() / tp);
      slice.setSize(slice.getSize() / tp);
    }
    for (Operation *op : heads) {
      if (auto attn = dyn_cast<AttentionOp>(op)) {
        int64_t kv = attn.getKvHeads();
        attn.setNumHeads(attn.getNumHeads() / tp);
        if (attn.getNumKvHeads())
          attn.setNumKvHeads(kv / tp);
      } else {
        auto rot = cast<RotaryOp>(op);
        rot.setNumHeads(rot.getNumHeads() / tp);
      }
    }
    for (Operation *op : vocab)
      op->setAttr("vocab_group", group);
    module->setAttr("loom.mesh", MeshAttr::get(ctx, {group}, {tp}));
  }

  void gatherReturns(func::FuncOp fn) {
    auto ret = cast<func::ReturnOp>(fn.getBody().front().getTerminator());
    OpBuilder b(ret);
    for (OpOperand &operand : ret->getOpOperands()) {
      Value v = operand.get();
      if (!state.lookup(v).split)
        continue;
      auto type = cast<RankedTensorType>(v.getType());
      SmallVector<int64_t> shape(type.getShape());
      shape.back() *= tp;
      auto gathered = b.create<AllGatherOp>(v.getLoc(), RankedTensorType::get(shape, type.getElementType()), v,
                                            b.getStringAttr("tp"), b.getI64IntegerAttr(type.getRank() - 1),
                                            b.getI64IntegerAttr(tp));
      operand.set(gathered);
    }
  }

  ModuleOp module;
  int64_t tp;
  bool gatherOutputs;
  DenseMap<Value, State> state;
  llvm::MapVector<ParamOp, Shard> shards;
  llvm::MapVector<ParamOp, Operation *> replicatedUse;
  llvm::SetVector<Operation *> enter;
  SmallVector<Operation *> reduceAfter, heads, vocab;
  SmallVector<SliceOp> slices;
};

} // namespace

LogicalResult mlir::loom::partitionTensorParallel(ModuleOp module, int64_t tp, bool gatherOutputs) {
  if (tp < 1)
    return module.emitError() << "tp must be at least 1, got " << tp;
  if (tp == 1)
    return success();
  for (auto fn : module.getOps<func::FuncOp>())
    for (Type t : fn.getArgumentTypes())
      if (auto tensor = dyn_cast<RankedTensorType>(t); tensor && !tensor.hasStaticShape())
        return fn.emitError() << "specialise the batch (loom-specialize-batch) before "
                                 "partitioning: argument type " << t << " is dynamic";
  return Partitioner(module, tp, gatherOutputs).run();
}

namespace mlir::loom {
namespace {
struct PartitionTensorParallelPass
    : public impl::PartitionTensorParallelBase<PartitionTensorParallelPass> {
  using PartitionTensorParallelBase::PartitionTensorParallelBase;
  void runOnOperation() override {
    if (failed(partitionTensorParallel(getOperation(), tp, gatherOutputs)))
      signalPassFailure();
  }
};
} // namespace
} // namespace mlir::loom
