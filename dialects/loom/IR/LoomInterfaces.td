//===- LoomInterfaces.td - Interfaces of the loom dialect --*- tablegen -*-===//
#ifndef LOOM_INTERFACES_TD
#define LOOM_INTERFACES_TD

include "mlir/IR/OpBase.td"

def LoomDifferentiableOpInterface : OpInterface<"DifferentiableOpInterface"> {
  let description = [{
    An op that states its gradient (vector-Jacobian product): given the
    gradients of its results, it adds the gradients of its operands through
    a GradientBuilder. The builder decides what a value is (an SSA value, a
    buffer of the runtime's instruction stream) and skips operands that need
    no gradient; the rule only says how gradients are computed.
  }];
  let cppNamespace = "::mlir::loom";
  let methods = [
    InterfaceMethod<"Adds the gradients of this op's operands.",
      "::mlir::LogicalResult", "buildGradient",
      (ins "::mlir::loom::GradientBuilder &":$builder)>,
  ];
}

#endif // LOOM_INTERFACES_TD
