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

double elements(Value v) {
  auto t = dyn_cast<RankedTensorType>(v.getType());
  return t && t.hasStaticShape() ? static_cast<double>(t.getNumElements()) : 0;
}

/// How each value is laid out over the tensor-parallel ranks.
using Layouts = DenseMap<Value, TpState>;

/// Accumulates one layer's numbers while walking its ops. What tensor
/// parallelism does to each op (which parameters split, what is
/// all-reduced, what tp must divide) is the op's TensorParallelOpInterface
/// rule, the one loom-partition-tp applies; an op with no rule for its
/// inputs' layout leaves the layer unsplittable.
class LayerBuilder {
public:
  explicit LayerBuilder(std::string name) { layer.name = std::move(name); }

  void visit(Operation &op, Layouts &split) {
    auto isParam = [](Value v) { return v.getDefiningOp<GetOp>() != nullptr; };
    auto countParam = [&](Value v, bool sharded) {
      auto get = v.getDefiningOp<GetOp>();
      if (!get || !counted.insert(get.getName().str()).second)
        return;
      layer.params += elements(v);
      layer.paramTensors += 1;
      if (sharded)
        layer.shardedParams += elements(v);
    };
    double flops = denseFlops(&op);
    layer.flops += flops;
    if (!isa<GetOp, ReshapeOp, GradAllReduceOp>(op)) // views and parameter reads launch nothing
      layer.instructions += 1;

    TpRule rule;
    if (isa<Conv2DOp>(op)) { // convolutions are not split: no tensor parallelism for the layer
      noRule = true;
    } else {
      SmallVector<TpState> operands;
      for (Value v : op.getOperands())
        operands.push_back(split.lookup(v));
      auto paramType = [](Value v) {
        auto get = v.getDefiningOp<GetOp>();
        return get ? dyn_cast<RankedTensorType>(get.getType()) : RankedTensorType();
      };
      FailureOr<TpRule> found = tensorParallelRule(&op, {operands, paramType, /*tp=*/0, false});
      if (succeeded(found))
        rule = std::move(*found);
      else
        noRule = true;
    }
    for (const TpShard &shard : rule.shards) {
      Value param = op.getOperand(shard.operand);
      divisor = std::gcd(divisor, cast<RankedTensorType>(param.getType()).getDimSize(shard.axis) /
                                      shard.blocks);
      countParam(param, true);
    }
    for (int64_t d : rule.mustDivide)
      divisor = std::gcd(divisor, d);
    if (rule.reduceAfter)
      ++layer.tpAllReduces;
    for (Value v : op.getOperands())
      countParam(v, false);
    for (auto [i, r] : llvm::enumerate(op.getResults()))
      split[r] = i < rule.results.size() ? rule.results[i] : TpState{};

    if (auto mm = dyn_cast<MatmulOp>(op)) {
      auto wt = cast<RankedTensorType>(mm.getRhs().getType());
      if (isParam(mm.getRhs()) && wt.getRank() == 2) {
        layer.shardedFlops += flops;
        if (rule.entersRegion && mm.getTransposeB()) // vocabulary-parallel head
          layer.lossBytes = elements(mm.getResult()) * 4; // logits kept in fp32 for the loss
      }
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
      return;
    }
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

  LogicalResult walk(Region &region, Layouts &split, int depth = 0) {
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
        Layouts inner;
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
          split[r] = TpState{};
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
  Layouts split;
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
