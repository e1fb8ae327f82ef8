//===- BundleWriter.h - Compile a model and write its bundle ----*- C++ -*-===//
//
// Runs the loom-compile pipeline (compiler/Pipeline.h; every stage a pass in
// passes/) on a copy of a verified model and writes the lowered step it
// leaves as a bundle: the manifest, parameters initialised from their
// initializer attributes with a seed (or loaded from a file), and the PTX of
// the generated kernels.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_BUNDLE_BUNDLEWRITER_H
#define LOOM_COMPILER_BUNDLE_BUNDLEWRITER_H

#include "passes/StepState.h"
#include "loom/rt/Bundle.h"
#include "mlir/IR/BuiltinOps.h"

#include <string>

namespace mlir::loom {

/// Lowers @forward of `module` (left untouched) for one CPU rank, or with
/// options.train the training step of @loss: programs "forward" (to the
/// loss), "backward" (reverse mode through each op's gradient rule, no
/// gradient for what needs none) and "update" (clipping and the optimizer,
/// in place). With dp x tp x pp ranks, every rank gets its own program:
/// tensor parallelism partitions the model (loom-partition-tp); pipeline
/// stages or several microbatches turn forward and backward into one
/// "step" program per rank that runs the schedule's order of microbatch
/// tasks, with send/recv between stages and gradients summed over
/// microbatches. Emits diagnostics and fails on what it cannot lower.
FailureOr<::loom::rt::Manifest> lowerForward(ModuleOp module, const BundleOptions &options);

/// Lowers, initialises or loads the weights, and writes DIR/manifest.json and
/// DIR/weights.safetensors. Errors go to the module's diagnostics.
LogicalResult writeBundle(ModuleOp module, const BundleOptions &options, const std::string &dir,
                          ::loom::rt::Manifest *out = nullptr);

} // namespace mlir::loom

#endif
