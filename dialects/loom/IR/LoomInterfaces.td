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

def LoomTensorParallelOpInterface : OpInterface<"TensorParallelOpInterface"> {
  let description = [{
    An op with a Megatron-style tensor-parallel rule: given how its operands
    are laid out over the tensor-parallel ranks (whole, or split along the
    last dimension in blocks), how its results are, which parameters it
    splits and along which axis, and what collectives follow (TpRule,
    dialects/loom/IR/TensorParallel.h). loom-partition-tp rewrites by these
    rules and the planner prices them; ops without one take their operands
    whole.
  }];
  let cppNamespace = "::mlir::loom";
  let methods = [
    InterfaceMethod<"The rule for these operand layouts; failure when there is none.",
      "::mlir::FailureOr<::mlir::loom::TpRule>", "tensorParallelRule",
      (ins "const ::mlir::loom::TpQuery &":$query)>,
  ];
}

#endif // LOOM_INTERFACES_TD
