//===- ModelSummary.cpp - Parameters, FLOPs and ops of a model ------------===//

#include "compiler/ModelSummary.h"
#include "dialects/loom/IR/LoomOps.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "passes/Passes.h"
#include "llvm/ADT/MapVector.h"
#include "llvm/Support/Format.h"

using namespace mlir;
using namespace mlir::loom;

std::string mlir::loom::withThousands(int64_t value) {
  std::string digits = std::to_string(value < 0 ? -value : value);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0)
      out += ',';
    out += digits[i];
  }
  return value < 0 ? "-" + out : out;
}

static double product(ArrayRef<int64_t> dims) {
  double p = 1;
  for (int64_t d : dims)
    p *= static_cast<double>(d);
  return p;
}

double mlir::loom::denseFlops(Operation *op) {
  if (auto mm = dyn_cast<MatmulOp>(op)) {
    auto lhs = cast<RankedTensorType>(mm.getLhs().getType());
    int64_t k = lhs.getDimSize(mm.getTransposeA() ? lhs.getRank() - 2 : lhs.getRank() - 1);
    auto out = cast<RankedTensorType>(mm.getResult().getType());
    return 2.0 * product(out.getShape()) * static_cast<double>(k);
  }
  if (auto attn = dyn_cast<AttentionOp>(op)) {
    auto q = cast<RankedTensorType>(attn.getQ().getType());
    auto k = cast<RankedTensorType>(attn.getK().getType());
    // Q K^T and P V: 2 * (2 * S * Skv * width) per example.
    return 4.0 * product(q.getShape()) * static_cast<double>(k.getDimSize(1));
  }
  if (auto conv = dyn_cast<Conv2DOp>(op)) {
    auto w = cast<RankedTensorType>(conv.getFilter().getType());
    auto out = cast<RankedTensorType>(conv.getResult().getType());
    return 2.0 * product(out.getShape()) * product(w.getShape().drop_front());
  }
  return 0;
}

namespace {
struct RegionStats {
  double flops = 0;
  std::map<std::string, int64_t> ops;
};

class Summarizer {
public:
  Summarizer(ModuleOp module) : module(module) {}

  /// Dense FLOPs and op counts of a region, following calls and repeats.
  FailureOr<RegionStats> statsOf(Region &region, int depth = 0) {
    RegionStats stats;
    if (depth > 32) {
      region.getParentOp()->emitError() << "calls nest more than 32 deep (recursive model?)";
      return failure();
    }
    for (Operation &op : region.getOps()) {
      if (op.hasTrait<OpTrait::IsTerminator>() || isa<ParamOp, GetOp>(op))
        continue;
      if (auto repeat = dyn_cast<RepeatOp>(op)) {
        BlockOp block = repeat.lookupBlock();
        auto inner = statsOf(block.getBody(), depth + 1);
        if (failed(inner))
          return failure();
        stats.flops += repeat.getCount() * inner->flops;
        for (auto &[name, n] : inner->ops)
          stats.ops[name] += repeat.getCount() * n;
        continue;
      }
      if (auto call = dyn_cast<func::CallOp>(op)) {
        auto callee = module.lookupSymbol<func::FuncOp>(call.getCallee());
        if (!callee || callee.isExternal()) {
          call.emitError() << "calls @" << call.getCallee() << ", which has no body";
          return failure();
        }
        auto inner = statsOf(callee.getBody(), depth + 1);
        if (failed(inner))
          return failure();
        stats.flops += inner->flops;
        for (auto &[name, n] : inner->ops)
          stats.ops[name] += n;
        continue;
      }
      stats.flops += denseFlops(&op);
      stats.ops[op.getName().stripDialect().str()] += 1;
    }
    return stats;
  }

private:
  ModuleOp module;
};

int64_t countParams(Region &region, ModelSummary &summary, int64_t instances) {
  int64_t total = 0;
  for (auto param : region.getOps<ParamOp>()) {
    RankedTensorType type = param.getTensorType();
    int64_t n = type.getNumElements() * instances;
    total += n;
    summary.numParamTensors += instances;
    std::string dtype;
    llvm::raw_string_ostream os(dtype);
    os << type.getElementType();
    summary.paramsByDtype[os.str()] += n;
  }
  return total;
}
} // namespace

FailureOr<ModelSummary> mlir::loom::summarizeModel(ModuleOp original) {
  OwningOpRef<ModuleOp> module(original.clone());
  if (failed(specializeBatch(*module, 1)))
    return failure();

  ModelSummary summary;
  auto forward = module->lookupSymbol<func::FuncOp>("forward");
  if (!forward || forward.isExternal())
    return original.emitError()
           << "model has no @forward function; every model needs a func.func @forward";
  for (auto fn : module->getOps<func::FuncOp>()) {
    std::string sig;
    llvm::raw_string_ostream os(sig);
    os << "@" << fn.getSymName();
    summary.entryPoints.push_back(os.str());
  }

  // Parameters: module-level once; a block's once per application. A block
  // applied by several repeats shares layers 0..count-1 between them.
  summary.numParams = countParams(module->getBodyRegion(), summary, 1);
  llvm::MapVector<StringRef, int64_t> layersOfBlock; // in program order
  module->walk([&](RepeatOp repeat) {
    int64_t &layers = layersOfBlock[repeat.getBlock()];
    layers = std::max(layers, static_cast<int64_t>(repeat.getCount()));
  });

  Summarizer summarizer(*module);
  for (auto &[name, layers] : layersOfBlock) {
    auto block = module->lookupSymbol<BlockOp>(name);
    ModelSummary scratch;
    RepeatSummary repeat;
    repeat.block = name.str();
    repeat.count = layers;
    repeat.paramsPerLayer = countParams(block.getBody(), scratch, 1);
    auto stats = summarizer.statsOf(block.getBody());
    if (failed(stats))
      return failure();
    repeat.flopsPerLayer = stats->flops;
    summary.repeats.push_back(repeat);
    summary.numParams += countParams(block.getBody(), summary, layers);
  }

  auto stats = summarizer.statsOf(forward.getBody());
  if (failed(stats))
    return failure();
  summary.forwardFlops = stats->flops;
  summary.opCounts = stats->ops;

  ArrayRef<Type> inputs = forward.getFunctionType().getInputs();
  if (!inputs.empty())
    if (auto ids = dyn_cast<RankedTensorType>(inputs.front()))
      if (ids.getRank() == 2 && isa<IntegerType>(ids.getElementType()))
        summary.tokensPerExample = ids.getDimSize(1);
  return summary;
}

static std::string humanCount(double value, StringRef unit) {
  const char *prefixes[] = {"", "K", "M", "G", "T", "P", "E"};
  int i = 0;
  while (value >= 1000 && i < 6) {
    value /= 1000;
    ++i;
  }
  std::string out;
  llvm::raw_string_ostream os(out);
  os << llvm::format("%.2f ", value) << prefixes[i] << unit;
  return os.str();
}

void ModelSummary::print(llvm::raw_ostream &os) const {
  os << "  entry points   ";
  llvm::interleaveComma(entryPoints, os);
  os << "\n  parameters     " << withThousands(numParams) << " ("
     << humanCount(static_cast<double>(numParams), "") << ") in " << numParamTensors
     << " tensors:";
  for (auto &[dtype, n] : paramsByDtype)
    os << " " << dtype << " " << withThousands(n);
  os << "\n";
  for (const RepeatSummary &r : repeats)
    os << "  layers         " << r.count << " x @" << r.block << ", "
       << withThousands(r.paramsPerLayer) << " parameters and "
       << humanCount(r.flopsPerLayer, "FLOP") << " forward per example each\n";
  os << "  FLOPs          forward " << humanCount(forwardFlops, "FLOP")
     << " per example, training (3x forward) " << humanCount(trainingFlops(), "FLOP")
     << " per example\n";
  if (tokensPerExample > 0)
    os << "                 forward " << humanCount(forwardFlops / tokensPerExample, "FLOP")
       << " per token, training " << humanCount(trainingFlops() / tokensPerExample, "FLOP")
       << " per token (" << withThousands(static_cast<int64_t>(trainingFlops() / tokensPerExample))
       << ")\n";
  os << "  ops            ";
  bool first = true;
  for (auto &[name, n] : opCounts) {
    os << (first ? "" : ", ") << name << " " << n;
    first = false;
  }
  os << " (one forward pass)\n";
}
