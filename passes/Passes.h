//===- Passes.h - Loom passes -----------------------------------*- C++ -*-===//
#ifndef LOOM_PASSES_PASSES_H
#define LOOM_PASSES_PASSES_H

#include "mlir/IR/BuiltinOps.h"
#include "mlir/Interfaces/FunctionInterfaces.h"
#include "mlir/Pass/Pass.h"

namespace mlir::loom {

struct BundleOptions;

/// loom-configure with the defaults (or the module's own options), and with
/// `options` (what loomc compile and the loom-compile pipeline create).
std::unique_ptr<Pass> createConfigurePass();
std::unique_ptr<Pass> createConfigurePass(const BundleOptions &options);

#define GEN_PASS_DECL
#include "passes/Passes.h.inc"

/// Re-infers the result types of the ops in `region`, in order, after the
/// types of its arguments changed. Ops with an explicit result type
/// (reshape, broadcast, cast) get their dynamic dimensions resolved from
/// their input; calls and repeats take the callee's signature.
LogicalResult refreshResultTypes(Region &region);
/// refreshResultTypes over a function-like body, then its type from its
/// arguments and what it returns.
LogicalResult refreshFunction(FunctionOpInterface fn);

/// Calls `fn` on every loom.block, then on every func.func with its callees
/// before it (signature rewrites then see their callees' new types).
LogicalResult forEachFunction(ModuleOp module,
                              function_ref<LogicalResult(FunctionOpInterface)> fn);

/// Specialises the dynamic batch of every entry point and block to `batch`.
LogicalResult specializeBatch(ModuleOp module, int64_t batch);

/// bf16 compute with f32 master parameters (the loom-mixed-precision pass).
LogicalResult applyMixedPrecision(ModuleOp module);

/// Rewrites `module` (static shapes) into the program of one of `tp`
/// tensor-parallel ranks (the loom-partition-tp pass). With `gatherOutputs`
/// (inference), split results of @forward are all-gathered whole.
LogicalResult partitionTensorParallel(ModuleOp module, int64_t tp, bool gatherOutputs = false);

/// Megatron's sequence parallelism on a tensor-parallel training module
/// (the loom-sequence-parallel pass).
LogicalResult applySequenceParallel(ModuleOp module);

#define GEN_PASS_REGISTRATION
#include "passes/Passes.h.inc"

} // namespace mlir::loom

#endif
