//===- ModelSummary.h - Parameters, FLOPs and ops of a model ----*- C++ -*-===//
#ifndef LOOM_COMPILER_MODELSUMMARY_H
#define LOOM_COMPILER_MODELSUMMARY_H

#include "mlir/IR/BuiltinOps.h"
#include "llvm/Support/raw_ostream.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace mlir::loom {

/// One `loom.repeat` of the forward pass, as the planner will see it.
struct RepeatSummary {
  std::string block;
  int64_t count = 0;
  int64_t paramsPerLayer = 0;
  double flopsPerLayer = 0; // forward, per example
};

/// What `loomc verify` reports. FLOPs count the dense work (matmul,
/// attention scores and values, convolution) as 2 per multiply-add, for one
/// example; attention counts the full S x S score matrix even when causal,
/// as Megatron-LM and the scaling-law papers do.
struct ModelSummary {
  int64_t numParams = 0;
  int64_t numParamTensors = 0;
  std::map<std::string, int64_t> paramsByDtype;
  double forwardFlops = 0;
  /// Tokens per example when the first input is a [batch, seq] id tensor, else 0.
  int64_t tokensPerExample = 0;
  std::vector<RepeatSummary> repeats;
  /// Op counts of one forward pass (a block applied N times counts N times).
  std::map<std::string, int64_t> opCounts;
  std::vector<std::string> entryPoints;

  double trainingFlops() const { return 3 * forwardFlops; }
  void print(llvm::raw_ostream &os) const;
};

/// Summarises a verified module. The module is cloned and its batch
/// specialised to 1, so the input is left untouched. Emits an error at the
/// module and fails when it has no `@forward` entry point.
FailureOr<ModelSummary> summarizeModel(ModuleOp module);

/// Dense FLOPs of one op with static shapes (0 for ops that do no dense work).
double denseFlops(Operation *op);

/// 124439808 -> "124,439,808".
std::string withThousands(int64_t value);

} // namespace mlir::loom

#endif
