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
struct State {
  bool split = false;
  int64_t blocks = 1;
};

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
    if (failed(forEachFunction(module, [&](FunctionOpInterface fn) { return refresh(fn); })))
      return failure();
    return verify(module);
  }

private:
  static int64_t lastDim(Value v) { return cast<RankedTensorType>(v.getType()).getShape().back(); }

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

  /// How many equal blocks the columns of a column-parallel result fall
  /// into: a fused projection read through equal slices (q|k|v) has one
  /// block per slice, so each rank keeps its heads of every block.
  int64_t blocksOf(Value result) {
    int64_t n = lastDim(result);
    Value v = result;
    if (v.hasOneUse())
      if (auto add = dyn_cast<AddOp>(*v.getUsers().begin()))
        if (paramOf(add.getLhs() == v ? add.getRhs() : add.getLhs()))
          v = add.getResult();
    int64_t size = 0;
    for (Operation *user : v.getUsers()) {
      auto slice = dyn_cast<SliceOp>(user);
      int64_t rank = cast<RankedTensorType>(v.getType()).getRank();
      if (!slice || slice.getAxis() != rank - 1 || (size && slice.getSize() != size))
        return 1;
      size = slice.getSize();
    }
    return size > 0 && size < n && n % size == 0 ? n / size : 1;
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

    if (auto mm = dyn_cast<MatmulOp>(op)) {
      ParamOp w = paramOf(mm.getRhs());
      if (!w || w.getTensorType().getRank() != 2 || paramOf(mm.getLhs()) || mm.getTransposeA())
        return replicated(op);
      State x = st(mm.getLhs());
      bool tb = mm.getTransposeB();
      if (!x.split) { // column-parallel
        int64_t blocks = blocksOf(mm.getResult());
        if (failed(shardParam(&op, w, {tb ? 0 : 1, blocks})))
          return failure();
        enter.insert(mm);
        state[mm.getResult()] = {true, blocks};
      } else { // row-parallel: partial sums, then all-reduce
        if (failed(shardParam(&op, w, {tb ? 1 : 0, x.blocks})))
          return failure();
        reduceAfter.push_back(&op);
      }
      return success();
    }
    if (isa<AddOp, SubOp, MulOp, DivOp>(op)) {
      Value a = op.getOperand(0), b = op.getOperand(1);
      if (!st(a).split && !st(b).split)
        return replicated(op);
      if (st(a).split && st(b).split && st(a).blocks == st(b).blocks &&
          a.getType() == b.getType()) {
        state[op.getResult(0)] = st(a);
        return success();
      }
      Value s = st(a).split ? a : b, other = st(a).split ? b : a;
      ParamOp bias = paramOf(other);
      if (bias && bias.getTensorType().getRank() == 1 &&
          bias.getTensorType().getDimSize(0) == lastDim(s)) {
        if (failed(shardParam(&op, bias, {0, st(s).blocks})))
          return failure();
        state[op.getResult(0)] = st(s);
        return success();
      }
      return op.emitError() << "combines an input split over tp with a replicated one ("
                            << other.getType() << "); tensor parallelism has no rule for this";
    }
    if (isa<GeluOp, ReluOp, SiluOp, ExpOp, TanhOp, RsqrtOp, NegOp, ScaleOp, CastOp>(op)) {
      state[op.getResult(0)] = st(op.getOperand(0));
      return success();
    }
    if (auto slice = dyn_cast<SliceOp>(op)) {
      State x = st(slice.getX());
      int64_t rank = cast<RankedTensorType>(slice.getX().getType()).getRank();
      if (!x.split || (slice.getAxis() != rank - 1 && slice.getAxis() != -1)) {
        state[slice.getResult()] = x;
        return success();
      }
      int64_t block = lastDim(slice.getX()) / x.blocks;
      if (slice.getSize() != block || slice.getStart() % block != 0)
        return op.emitError() << "slices [" << slice.getStart() << ", "
                              << slice.getStart() + slice.getSize()
                              << ") of a tensor split over tp in blocks of " << block
                              << "; only whole blocks can be taken";
      slices.push_back(slice);
      state[slice.getResult()] = {true, 1};
      return success();
    }
    if (auto attn = dyn_cast<AttentionOp>(op)) {
      bool q = st(attn.getQ()).split, k = st(attn.getK()).split, v = st(attn.getV()).split;
      if (!q && !k && !v)
        return replicated(op);
      if (!(q && k && v))
        return op.emitError() << "needs q, k and v all split by heads or all replicated";
      if (attn.getNumHeads() % tp || attn.getKvHeads() % tp)
        return op.emitError() << "has " << attn.getNumHeads() << " heads and " << attn.getKvHeads()
                              << " key/value heads; tp = " << tp << " must divide both";
      heads.push_back(&op);
      state[attn.getResult()] = {true, 1};
      return success();
    }
    if (auto rot = dyn_cast<RotaryOp>(op)) {
      if (!st(rot.getX()).split)
        return replicated(op);
      if (rot.getNumHeads() % tp)
        return op.emitError() << "has " << rot.getNumHeads() << " heads; tp = " << tp
                              << " must divide them";
      heads.push_back(&op);
      state[rot.getResult()] = st(rot.getX());
      return success();
    }
    if (auto emb = dyn_cast<EmbeddingOp>(op)) {
      ParamOp table = paramOf(emb.getTable());
      if (!table || st(emb.getIds()).split)
        return replicated(op);
      if (failed(shardParam(&op, table, {0, 1})))
        return failure();
      vocab.push_back(&op);
      reduceAfter.push_back(&op);
      return success();
    }
    if (auto ce = dyn_cast<CrossEntropyOp>(op)) {
      State l = st(ce.getLogits());
      if (!l.split)
        return replicated(op);
      if (l.blocks != 1)
        return op.emitError() << "reads logits split in blocks; only a contiguous vocabulary split "
                                 "is supported";
      vocab.push_back(&op);
      return success();
    }
    return replicated(op);
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

  static LogicalResult refresh(FunctionOpInterface fn) {
    Block &entry = fn.getFunctionBody().front();
    if (failed(refreshResultTypes(fn.getFunctionBody())))
      return failure();
    SmallVector<Type> results(entry.getTerminator()->getOperandTypes());
    fn.setType(FunctionType::get(fn.getContext(), entry.getArgumentTypes(), results));
    return success();
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
