//===- PlannerModel.cpp - The planner's view of a model -------------------===//

#include "compiler/PlannerModel.h"
#include "compiler/ModelSummary.h"
#include "dialects/loom/IR/LoomOps.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "passes/Passes.h"

#include <numeric>
#include <set>

using namespace mlir;
using namespace mlir::loom;
namespace pl = ::loom::planner;

namespace {

enum class Split { Replicated, Sharded };

double elements(Value v) {
  auto t = dyn_cast<RankedTensorType>(v.getType());
  return t && t.hasStaticShape() ? static_cast<double>(t.getNumElements()) : 0;
}

/// Accumulates one layer's numbers while walking its ops.
class LayerBuilder {
public:
  explicit LayerBuilder(std::string name) { layer.name = std::move(name); }

  void visit(Operation &op, DenseMap<Value, Split> &split) {
    auto state = [&](Value v) { return split.lookup(v); };
    auto isParam = [](Value v) { return v.getDefiningOp<GetOp>() != nullptr; };
    auto countParam = [&](Value v, bool sharded) {
      auto get = v.getDefiningOp<GetOp>();
      if (!get || !counted.insert(get.getName().str()).second)
        return;
      layer.params += elements(v);
      if (sharded)
        layer.shardedParams += elements(v);
    };
    double flops = denseFlops(&op);
    layer.flops += flops;
    if (!isa<GetOp, ReshapeOp, GradAllReduceOp>(op)) // views and parameter reads launch nothing
      layer.instructions += 1;

    if (auto mm = dyn_cast<MatmulOp>(op)) {
      Value x = mm.getLhs(), w = mm.getRhs();
      auto wt = cast<RankedTensorType>(w.getType());
      if (isParam(w) && wt.getRank() == 2) {
        layer.shardedFlops += flops;
        int64_t out = mm.getTransposeB() ? wt.getDimSize(0) : wt.getDimSize(1);
        int64_t in = mm.getTransposeB() ? wt.getDimSize(1) : wt.getDimSize(0);
        if (state(x) == Split::Replicated) { // column-parallel (or vocabulary-parallel head)
          divisor = std::gcd(divisor, out);
          countParam(w, true);
          split[mm.getResult()] = Split::Sharded;
          if (mm.getTransposeB())
            layer.lossBytes = elements(mm.getResult()) * 4; // logits kept in fp32 for the loss
        } else {                              // row-parallel: ends in an all-reduce
          divisor = std::gcd(divisor, in);
          countParam(w, true);
          ++layer.tpAllReduces;
          split[mm.getResult()] = Split::Replicated;
        }
        return;
      }
      split[mm.getResult()] = Split::Replicated; // activation x activation: no rule
      return;
    }
    if (auto emb = dyn_cast<EmbeddingOp>(op)) { // vocabulary-parallel, then all-reduce
      divisor = std::gcd(divisor, cast<RankedTensorType>(emb.getTable().getType()).getDimSize(0));
      countParam(emb.getTable(), true);
      ++layer.tpAllReduces;
      split[emb.getResult()] = Split::Replicated;
      traffic(op);
      return;
    }
    if (auto attn = dyn_cast<AttentionOp>(op)) {
      layer.attentionFlops += flops;
      layer.shardedFlops += flops;
      layer.isTransformer = true;
      auto q = cast<RankedTensorType>(attn.getQ().getType());
      layer.seq = static_cast<double>(q.getDimSize(1));
      layer.heads = static_cast<double>(attn.getNumHeads());
      divisor = std::gcd(divisor, attn.getNumHeads());
      divisor = std::gcd(divisor, attn.getKvHeads());
      bool sharded = state(attn.getQ()) == Split::Sharded;
      split[attn.getResult()] = sharded ? Split::Sharded : Split::Replicated;
      return;
    }
    if (isa<Conv2DOp>(op)) {
      noRule = true;
      for (Value v : op.getOperands())
        countParam(v, false);
      split[op.getResult(0)] = Split::Replicated;
      traffic(op);
      return;
    }
    // Everything else: parameters replicate unless they follow a sharded
    // activation (a bias after a column-parallel linear); the result is
    // sharded if any activation operand is.
    bool anySharded = false;
    for (Value v : op.getOperands())
      anySharded |= !isParam(v) && state(v) == Split::Sharded;
    bool normalises = isa<LayerNormOp, RMSNormOp, BatchNormOp, SoftmaxOp, CrossEntropyOp,
                          ReduceSumOp, ReduceMaxOp, ReduceMeanOp>(op);
    for (Value v : op.getOperands())
      if (isParam(v))
        countParam(v, anySharded && !normalises);
    for (Value r : op.getResults())
      split[r] = anySharded && !normalises ? Split::Sharded : Split::Replicated;
    if (!isa<GetOp, ParamOp, ReshapeOp>(op))
      traffic(op);
  }

  void setBoundary(Value out, Value in) {
    layer.boundaryBytes = 2 * elements(out); // 16-bit activations between layers
    layer.hidden = 0;
    if (auto t = dyn_cast<RankedTensorType>(out.getType()))
      if (t.getRank() >= 1)
        layer.hidden = static_cast<double>(t.getShape().back());
    inputBytes = in ? 2 * elements(in) : 0;
  }

  pl::LayerSpec finish() {
    layer.tpDivisor = noRule || divisor == 0 ? 1 : divisor;
    layer.activationBytes[0] = layer.activationBytes[1] = keptBytes;
    layer.activationBytes[2] = inputBytes > 0 ? inputBytes : keptBytes;
    return layer;
  }
  bool empty() const { return layer.flops == 0 && layer.params == 0 && keptBytes == 0; }

private:
  void traffic(Operation &op) {
    double moved = 0;
    for (Value v : op.getOperands())
      moved += elements(v);
    for (Value r : op.getResults()) {
      moved += elements(r);
      keptBytes += 2 * elements(r);
    }
    layer.memoryTraffic += 2 * moved;
  }

  pl::LayerSpec layer;
  std::set<std::string> counted;
  int64_t divisor = 0;
  bool noRule = false;
  double keptBytes = 0, inputBytes = 0;
};

class SpecBuilder {
public:
  explicit SpecBuilder(ModuleOp module) : module(module) {}

  LogicalResult walk(Region &region, DenseMap<Value, Split> &split, int depth = 0) {
    if (depth > 32)
      return region.getParentOp()->emitError() << "calls nest more than 32 deep";
    for (Operation &op : region.getOps()) {
      if (isa<ParamOp, func::ReturnOp>(op))
        continue;
      if (auto call = dyn_cast<func::CallOp>(op)) {
        auto callee = module.lookupSymbol<func::FuncOp>(call.getCallee());
        if (!callee || callee.isExternal())
          return call.emitError() << "calls @" << call.getCallee() << ", which has no body";
        for (auto [arg, v] : llvm::zip(callee.getArguments(), call.getOperands()))
          split[arg] = split.lookup(v);
        if (failed(walk(callee.getBody(), split, depth + 1)))
          return failure();
        auto ret = cast<func::ReturnOp>(callee.getBody().front().getTerminator());
        for (auto [res, v] : llvm::zip(call.getResults(), ret.getOperands()))
          split[res] = split.lookup(v);
        continue;
      }
      if (auto repeat = dyn_cast<RepeatOp>(op)) {
        flush(repeat.getInputs().empty() ? Value() : repeat.getInputs().front(), Value());
        BlockOp block = repeat.lookupBlock();
        LayerBuilder lb(block.getSymName().str());
        DenseMap<Value, Split> inner;
        for (Operation &bop : block.getBody().getOps())
          if (!isa<ParamOp, YieldOp>(bop))
            lb.visit(bop, inner);
        auto yield = cast<YieldOp>(block.getBody().front().getTerminator());
        lb.setBoundary(yield.getValues().empty() ? Value() : yield.getValues().front(),
                       block.getNumArguments() ? block.getArgument(0) : Value());
        pl::LayerSpec spec = lb.finish();
        for (int64_t i = 0; i < repeat.getCount(); ++i) {
          spec.name = block.getSymName().str() + "." + std::to_string(i);
          layers.push_back(spec);
        }
        for (Value r : repeat.getResults())
          split[r] = Split::Replicated;
        continue;
      }
      pending.visit(op, split);
      lastValue = op.getNumResults() ? op.getResult(0) : lastValue;
    }
    return success();
  }

  void flush(Value boundary, Value input) {
    if (!pending.empty()) {
      pending.setBoundary(boundary ? boundary : lastValue, input);
      pl::LayerSpec spec = pending.finish();
      spec.name = layers.empty() ? "embedding" : "between." + std::to_string(layers.size());
      layers.push_back(spec);
    }
    pending = LayerBuilder("pending");
  }

  void finishHead() {
    if (!pending.empty()) {
      pending.setBoundary(lastValue, Value());
      pl::LayerSpec spec = pending.finish();
      spec.name = "head";
      layers.push_back(spec);
    }
  }

  std::vector<pl::LayerSpec> layers;

private:
  ModuleOp module;
  LayerBuilder pending{"pending"};
  Value lastValue;
};

} // namespace

FailureOr<pl::ModelSpec> mlir::loom::buildModelSpec(ModuleOp original, StringRef name) {
  FailureOr<ModelSummary> summary = summarizeModel(original);
  if (failed(summary))
    return failure();
  OwningOpRef<ModuleOp> module(original.clone());
  if (failed(specializeBatch(*module, 1)))
    return failure();
  auto entry = module->lookupSymbol<func::FuncOp>("loss");
  if (!entry)
    entry = module->lookupSymbol<func::FuncOp>("forward");
  SpecBuilder builder(*module);
  DenseMap<Value, Split> split;
  if (failed(builder.walk(entry.getBody(), split)))
    return failure();
  builder.finishHead();

  pl::ModelSpec spec;
  spec.name = name.str();
  spec.layers = std::move(builder.layers);
  spec.tokensPerExample = summary->tokensPerExample > 0 ? summary->tokensPerExample : 1;
  spec.totalParams = static_cast<double>(summary->numParams);
  spec.trainingFlopsPerExample = summary->trainingFlops();
  return spec;
}
