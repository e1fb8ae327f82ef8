//===- Pipeline.h - The loom-compile pass pipeline --------------*- C++ -*-===//
//
// Every compile stage is a pass; this puts them in order for a bundle's
// options. `loomc compile` runs it and writes the lowered step that it
// leaves; `loom-opt --loom-compile` runs it on a model file, and with
// `--mlir-print-ir-after-all` shows each stage's IR.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_PIPELINE_H
#define LOOM_COMPILER_PIPELINE_H

#include "passes/StepState.h"
#include "mlir/Pass/PassManager.h"

namespace mlir::loom {

/// Adds the stages `options` needs: configure, batch specialisation,
/// tensor-parallel partitioning, mixed precision, the NHWC layout, lowering
/// to the step, and for training the pipeline split, autodiff, the
/// schedule, data parallelism, the optimizer update and the step rewrites;
/// then fusion, compaction and memory planning. With `until`, stops after
/// the pass of that argument (for tests that check one stage's input).
void buildCompilePipeline(OpPassManager &pm, const BundleOptions &options, StringRef until = "");

/// Whether `name` is an optional rewrite that BundleOptions::skipPasses may
/// leave out (the bundle stays valid without it), and the list of them.
bool isSkippablePass(StringRef name);
std::string skippablePasses();

/// Registers `loom-compile` (with its options) for loom-opt.
void registerCompilePipeline();

} // namespace mlir::loom

#endif
