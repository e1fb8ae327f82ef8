//===- PlannerModel.cpp - The planner's view of a model -------------------===//

#include "compiler/PlannerModel.h"
#include "compiler/BackwardReads.h"
#include "compiler/ModelSummary.h"
#include "dialects/loom/IR/LoomOps.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "passes/Passes.h"

#include <map>
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
      if (!get || !params.try_emplace(get.getName().str(), elements(v), sharded).second)
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
    gathered = rule.entersRegion ? op.getOperand(0) : Value();
    keepForBackward(op, split);

    if (auto mm = dyn_cast<MatmulOp>(op)) {
      auto wt = cast<RankedTensorType>(mm.getRhs().getType());
      if (isParam(mm.getRhs()) && wt.getRank() == 2)
        layer.shardedFlops += flops;
      layer.matmuls += 1;
      return;
    }
    if (auto attn = dyn_cast<AttentionOp>(op)) {
      layer.attentionFlops += flops;
      layer.shardedFlops += flops;
      layer.isTransformer = true;
      auto q = cast<RankedTensorType>(attn.getQ().getType());
      layer.seq = static_cast<double>(q.getDimSize(1));
      layer.heads = static_cast<double>(attn.getNumHeads());
      layer.kvWidth = static_cast<double>(cast<RankedTensorType>(attn.getK().getType()).getShape().back());
      divisor = std::gcd(divisor, attn.getNumHeads());
      divisor = std::gcd(divisor, attn.getKvHeads());
      return;
    }
    if (!isa<GetOp, ParamOp, ReshapeOp>(op)) {
      // Work on whole activations only: every tp rank repeats it.
      bool replicated = true;
      for (Value v : op.getOperands())
        replicated &= !split.lookup(v).split;
      for (Value r : op.getResults())
        replicated &= !split.lookup(r).split;
      traffic(op, replicated);
    }
  }

  void setBoundary(Value out, Value in) {
    layer.boundaryBytes = 2 * elements(out); // 16-bit activations between layers
    layer.hidden = 0;
    if (auto t = dyn_cast<RankedTensorType>(out.getType()))
      if (t.getRank() >= 1)
        layer.hidden = static_cast<double>(t.getShape().back());
    layer.checkpointElements = in ? elements(in) : 0;
  }

  pl::LayerSpec finish() {
    countDeferredGradients();
    layer.largestGradBesideLoss = 0;
    layer.largestGradBesideLossSharded = false;
    // The logits usually come back from a call (@forward's result), so the
    // gradient left out is one of the logits' size, made in this layer.
    bool left = false;
    for (const GradSize &g : gradSizes) {
      if (!left && lossLogits > 0 && g.elements == lossLogits) {
        left = true;
        continue;
      }
      if (g.elements > layer.largestGradBesideLoss) {
        layer.largestGradBesideLoss = g.elements;
        layer.largestGradBesideLossSharded = g.sharded;
      }
    }
    if (!left) {
      layer.largestGradBesideLoss = layer.largestGradElements;
      layer.largestGradBesideLossSharded = layer.largestGradSharded;
    }
    layer.tpDivisor = noRule || divisor == 0 ? 1 : divisor;
    return layer;
  }
  bool empty() const { return layer.flops == 0 && layer.params == 0 && layer.keptElements == 0; }
  /// Parameters read: elements, and whether tensor parallelism splits them here.
  const std::map<std::string, std::pair<double, bool>> &parameters() const { return params; }

private:
  void traffic(Operation &op, bool replicated) {
    double moved = 0;
    for (Value v : op.getOperands())
      moved += elements(v);
    for (Value r : op.getResults())
      moved += elements(r);
    layer.memoryTraffic += 2 * moved;
    if (replicated)
      layer.replicatedTraffic += 2 * moved;
  }

  /// What the op's gradient rule reads stays from the forward to the
  /// backward: an activation once per storage (a reshape is a view of its
  /// operand), a parameter as its working copy. ZB-H1's deferred weight
  /// gradients keep what they read, forward values and result gradients.
  void keepForBackward(Operation &op, const Layouts &split) {
    BackwardReadSet reads = backwardReads(&op);
    auto storage = [](Value v) {
      while (auto reshape = v.getDefiningOp<ReshapeOp>())
        v = reshape.getX();
      return v;
    };
    if (reads.largestGrad > 0 && op.getNumResults() > 0)
      gradSizes.push_back({reads.largestGrad, split.lookup(op.getResult(0)).split});
    if (reads.largestGrad > layer.largestGradElements) {
      layer.largestGradElements = reads.largestGrad;
      layer.largestGradSharded = op.getNumResults() > 0 && split.lookup(op.getResult(0)).split;
    }
    // The logits' gradient, which loom-fuse-loss-gradient writes over the
    // logits (kept for the loss's own gradient anyway).
    if (auto ce = dyn_cast<CrossEntropyOp>(op))
      lossLogits = elements(ce->getOperand(0));
    auto add = [&](DenseSet<Value> &seen, Value v, double &all, double &sharded) {
      if (!seen.insert(v).second)
        return;
      all += elements(v);
      if (split.lookup(v).split)
        sharded += elements(v);
    };
    for (Value v : reads.values) {
      if (auto get = v.getDefiningOp<GetOp>()) {
        auto it = params.find(get.getName().str());
        if (it == params.end() || !copied.insert(it->first).second)
          continue;
        layer.backwardReadParams += it->second.first;
        if (it->second.second)
          layer.backwardReadShardedParams += it->second.first;
        continue;
      }
      Value s = storage(v);
      bool fresh = !kept.contains(s);
      add(kept, s, layer.keptElements, layer.keptShardedElements);
      if (fresh && gathered && s == storage(gathered) && !split.lookup(s).split)
        layer.keptGatheredElements += elements(s);
    }
    for (Value v : reads.weightGradValues)
      if (!v.getDefiningOp<GetOp>())
        add(deferred, storage(v), layer.deferredElements, layer.deferredShardedElements);
    for (Value r : op.getResults())
      resultSplit[r] = split.lookup(r).split;
    for (Value v : reads.weightGradOf)
      gradientsRead.insert(v);
    for (auto [operand, result] : reads.sameGradient)
      sameGradient[operand] = result;
  }

  /// The result gradients that the weight-gradient products read, each
  /// buffer once: an add hands its result's gradient on to its operands.
  void countDeferredGradients() {
    DenseSet<Value> counted;
    for (Value v : gradientsRead) {
      for (auto it = sameGradient.find(v); it != sameGradient.end(); it = sameGradient.find(v))
        v = it->second;
      if (!counted.insert(v).second)
        continue;
      layer.deferredElements += elements(v);
      if (resultSplit.lookup(v))
        layer.deferredShardedElements += elements(v);
    }
  }

  pl::LayerSpec layer;
  struct GradSize {
    double elements; // of the gradient of an op's result
    bool sharded;
  };
  std::vector<GradSize> gradSizes;
  double lossLogits = 0; // elements of the loss's logits; 0 without a loss
  std::map<std::string, std::pair<double, bool>> params;
  std::set<std::string> copied;
  DenseSet<Value> kept, deferred;
  SetVector<Value> gradientsRead;
  DenseMap<Value, Value> sameGradient;
  DenseMap<Value, bool> resultSplit;
  int64_t divisor = 0;
  bool noRule = false;
  Value gathered; // the replicated input the op being visited enters a tp region with
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
      outside.push_back({layers.size(), pending.parameters()});
      layers.push_back(spec);
    }
    pending = LayerBuilder("pending");
  }

  void finishHead() {
    if (!pending.empty()) {
      pending.setBoundary(lastValue, Value());
      pl::LayerSpec spec = pending.finish();
      spec.name = "head";
      outside.push_back({layers.size(), pending.parameters()});
      layers.push_back(spec);
    }
  }

  /// Marks the parameters that more than one layer reads (a tied embedding
  /// and LM head). Only layers outside loom.repeat can share: each
  /// application of a block has parameters of its own.
  void markTiedParameters() {
    std::map<std::string, int> readers;
    for (const auto &[index, params] : outside)
      for (const auto &[name, info] : params)
        ++readers[name];
    for (const auto &[index, params] : outside)
      for (const auto &[name, info] : params)
        if (readers[name] > 1)
          layers[index].tied.push_back({name, info.first, info.second});
  }

  std::vector<pl::LayerSpec> layers;

private:
  ModuleOp module;
  LayerBuilder pending{"pending"};
  /// The layers outside loom.repeat, with the parameters each reads.
  std::vector<std::pair<size_t, std::map<std::string, std::pair<double, bool>>>> outside;
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
  builder.markTiedParameters();

  pl::ModelSpec spec;
  spec.name = name.str();
  spec.layers = std::move(builder.layers);
  spec.tokensPerExample = summary->tokensPerExample > 0 ? summary->tokensPerExample : 1;
  spec.totalParams = static_cast<double>(summary->numParams);
  spec.trainingFlopsPerExample = summary->trainingFlops();
  return spec;
}
