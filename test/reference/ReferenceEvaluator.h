//===- ReferenceEvaluator.h - Op-by-op evaluation of loom IR ----*- C++ -*-===//
//
// The independent reference the runtime is checked against: it walks the
// model's IR directly (not the bundle), in double precision, with the most
// direct loops, sharing no code with the runtime's kernels.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_TEST_REFERENCE_REFERENCEEVALUATOR_H
#define LOOM_TEST_REFERENCE_REFERENCEEVALUATOR_H

#include "mlir/IR/BuiltinOps.h"

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace loom::reference {

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<double> data;
};

/// Parameter values by bundle name ("wte", "layer.0.ln1.g").
using ParamLookup = std::function<Tensor(const std::string &name)>;

/// Evaluates @forward of a batch-specialised module on `inputs` (in argument
/// order) and returns its results. Fails (returns false) on an op it does
/// not know, with the op's name in `error`.
bool evaluateForward(mlir::ModuleOp module, const std::vector<Tensor> &inputs,
                     const ParamLookup &params, std::vector<Tensor> &outputs, std::string &error);

} // namespace loom::reference

#endif
