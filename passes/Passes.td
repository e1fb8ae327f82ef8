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

def PartitionTensorParallel : Pass<"loom-partition-tp", "::mlir::ModuleOp"> {
  let summary = "Rewrites a model into one tensor-parallel rank's program (Megatron rules)";
  let description = [{
    Splits linear layers column- then row-parallel, attention by heads and
    the embedding, output projection and loss by vocabulary, over `tp`
    ranks. Parameters take the shape of one rank's part and record the
    split in `loom.shard`; `loom.grad_all_reduce` marks where replicated
    activations enter a parallel region (its gradient is summed over the
    ranks) and `loom.all_reduce` sums the partial results of row-parallel
    layers and of the vocabulary-parallel embedding. A transformer layer
    gets two all-reduces forward and two backward. Run after
    loom-specialize-batch: partitioning needs static shapes.
  }];
  let options = [
    Option<"tp", "tp", "int64_t", /*default=*/"2", "Tensor-parallel degree (>= 1)">,
    Option<"gatherOutputs", "gather-outputs", "bool", /*default=*/"false",
           "All-gather what @forward returns split (inference bundles)">
  ];
}

#endif // LOOM_PASSES_TD
