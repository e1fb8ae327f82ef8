//===- Passes.td - Loom passes ----------------------------*- tablegen -*-===//
#ifndef LOOM_PASSES_TD
#define LOOM_PASSES_TD

include "mlir/Pass/PassBase.td"

def SpecializeBatch : Pass<"loom-specialize-batch", "::mlir::ModuleOp"> {
  let summary = "Gives the dynamic batch dimension a concrete size";
  let description = [{
    Models leave the batch dimension dynamic (`tensor<?x1024xi32>`). This
    pass replaces every dynamic dimension in the signatures of `func.func`
    and `loom.block` operations with `batch`, then re-infers the type of
    every value so the whole module has static shapes.
  }];
  let options = [
    Option<"batch", "batch", "int64_t", /*default=*/"1", "Batch size (>= 1)">
  ];
}

def MixedPrecision : Pass<"loom-mixed-precision", "::mlir::ModuleOp"> {
  let summary = "Computes in bf16 while parameters stay f32 masters";
  let description = [{
    Every read of an f32 parameter (and every f32 entry argument) is cast to
    bf16 where it is read; activations, their gradients and block signatures
    become bf16. Parameters, their gradients and optimizer state stay f32
    (the casts' gradients convert back), and the loss stays f32 because
    loom.cross_entropy accumulates and returns f32.
  }];
}

#endif // LOOM_PASSES_TD
