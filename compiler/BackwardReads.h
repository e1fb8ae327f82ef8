//===- BackwardReads.h - What an op's gradient reads ------------*- C++ -*-===//
//
// The planner's memory model needs what a training step keeps from the
// forward for the backward. That is whatever the ops' gradient rules read,
// so it runs each rule (DifferentiableOpInterface, the one loom-autodiff
// runs) on a GradientBuilder that builds nothing and only records reads.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_BACKWARDREADS_H
#define LOOM_COMPILER_BACKWARDREADS_H

#include "mlir/IR/Operation.h"
#include "llvm/ADT/SetVector.h"

namespace mlir::loom {

struct BackwardReadSet {
  /// Forward operands and results (floating-point: not token ids, which are
  /// inputs) that the backward reads.
  SetVector<Value> values;
  /// What the weight-gradient products read (those whose results only
  /// become parameter gradients, the W of ZB-H1): forward values, and the
  /// results whose gradients they read.
  SetVector<Value> weightGradValues, weightGradOf;
  /// Operands whose gradient is a result's, passed on unchanged (an add's
  /// to an operand used nowhere else): one buffer. (operand, result)
  SmallVector<std::pair<Value, Value>> sameGradient;
  /// Elements of the largest result gradient the backward holds.
  double largestGrad = 0;
};

/// Runs `op`'s gradient rule; an op without one reads nothing.
BackwardReadSet backwardReads(Operation *op);

} // namespace mlir::loom

#endif
