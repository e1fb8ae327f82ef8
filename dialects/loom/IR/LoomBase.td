//===- LoomBase.td - The loom dialect ---------------------*- tablegen -*-===//
#ifndef LOOM_BASE_TD
#define LOOM_BASE_TD

include "mlir/IR/OpBase.td"
include "mlir/IR/AttrTypeBase.td"

def Loom_Dialect : Dialect {
  let name = "loom";
  let summary = "Neural-network graphs for compilation and parallel planning";
  let description = [{
    The `loom` dialect describes a neural network as a graph of tensor
    operations over builtin ranked tensors (`f32`, `bf16`, `f16`, `f64`, and
    `i32`/`i64` for indices). Parameters are module-level symbols
    (`loom.param`) read with `loom.get`; a repeated block such as a
    transformer layer is written once as a `loom.block` and applied with
    `loom.repeat`, each application owning its own copy of the block's
    parameters. Entry points are `func.func` operations: `@forward` returns
    the model's outputs and `@loss` (for training) returns a scalar loss.

    Every op verifies its operands and reports the concrete shapes at fault.
    Most ops infer their result type; a dimension left dynamic (`?`, usually
    the batch) stays dynamic until `loomc` specialises it.
  }];
  let cppNamespace = "::mlir::loom";
  let dependentDialects = ["::mlir::func::FuncDialect"];
  let useDefaultAttributePrinterParser = 1;
  let hasOperationAttrVerify = 1;
  let extraClassDeclaration = [{
    void registerAttributes();
  }];
}

class Loom_Op<string mnemonic, list<Trait> traits = []>
    : Op<Loom_Dialect, mnemonic, traits>;

// Element types that carry activations and parameters.
def Loom_FloatTensor : RankedTensorOf<[F64, F32, BF16, F16]>;
// Token ids, labels and other indices.
def Loom_IndexTensor : RankedTensorOf<[I32, I64]>;

#endif // LOOM_BASE_TD
