//===- GradientBuilder.h - What gradient rules build with -------*- C++ -*-===//
//
// The vocabulary of gradient rules. A rule (DifferentiableOpInterface::
// buildGradient) reads the op's forward operands and results and its result
// gradients as opaque handles, emits operations by name with the same
// attributes as the dialect's ops, and hands back operand gradients. The
// builder accumulates gradients of values used more than once and sums a
// gradient over broadcast dimensions down to its operand's shape.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_DIALECTS_LOOM_IR_GRADIENTBUILDER_H
#define LOOM_DIALECTS_LOOM_IR_GRADIENTBUILDER_H

#include "mlir/IR/Attributes.h"
#include "mlir/IR/Types.h"
#include "mlir/Support/LLVM.h"

#include <cstdint>

namespace mlir::loom {

class GradientBuilder {
public:
  using Handle = int64_t;
  virtual ~GradientBuilder() = default;

  virtual Handle operand(unsigned index) = 0;
  virtual Handle result(unsigned index = 0) = 0;
  /// Gradient of a result; -1 when the loss does not depend on it.
  virtual Handle resultGrad(unsigned index = 0) = 0;
  /// Whether the loss needs the gradient of this operand (parameters and
  /// what depends on them); rules skip work for operands that do not.
  virtual bool needsGrad(unsigned index) = 0;
  /// Adds `grad` to the operand's gradient, summed down to its shape.
  virtual void addGrad(unsigned index, Handle grad) = 0;

  virtual SmallVector<int64_t> shapeOf(Handle h) = 0;
  virtual Type elementTypeOf(Handle h) = 0;

  /// Emits `op` (a dialect op's name without "loom.", or a gradient kernel
  /// such as "layernorm_grad") with results shaped like `likes`.
  virtual SmallVector<Handle> emit(StringRef op, ArrayRef<Handle> inputs, ArrayRef<Handle> likes,
                                   ArrayRef<NamedAttribute> attrs = {}) = 0;
  /// The same with explicit result shapes (element type of the first input).
  virtual Handle emitShaped(StringRef op, ArrayRef<Handle> inputs, ArrayRef<int64_t> shape,
                            ArrayRef<NamedAttribute> attrs = {}) = 0;
  /// A reshaped view (no copy).
  virtual Handle view(Handle h, ArrayRef<int64_t> shape) = 0;

  virtual MLIRContext *getContext() = 0;

  Handle emit1(StringRef op, ArrayRef<Handle> inputs, Handle like,
               ArrayRef<NamedAttribute> attrs = {}) {
    return emit(op, inputs, {like}, attrs).front();
  }
};

} // namespace mlir::loom

#endif
