//===- Fusion.h - Fuse elementwise chains into generated kernels -*- C++ -*-===//
//
// Chains of elementwise instructions of one shape (bias adds, GELU,
// residual adds, the gradient kernels of activations, ...) become one
// "fused" instruction: its attributes describe the chain as steps over
// values, which the CPU backend evaluates, and name a kernel whose PTX the
// compiler generates through MLIR's gpu dialect (gpu -> NVVM -> PTX, no CUDA
// toolkit needed, compiler/bundle/KernelGen.h). Values the chain computes that nothing outside it reads
// are never written to memory. Norms, softmax, the cross-entropy loss and its
// gradient, and runs of AdamW updates keep their instructions but name
// generated kernels too, which the CUDA backend runs instead of its own.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_PASSES_FUSION_H
#define LOOM_PASSES_FUSION_H

#include "loom/rt/Bundle.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Support/LogicalResult.h"

#include <string>

namespace mlir::loom {

/// Fuses the elementwise chains of every program of `rank`, folds GEMM
/// epilogues, and names generated kernels for the reductions and AdamW;
/// returns how many instructions were removed. Kernels are named "fused_<n>",
/// "row_<n>", "ce_<n>" and "adam_<n>" (the "kernel" attribute), numbered
/// from `nextKernel`, which advances.
int64_t fuseElementwise(::loom::rt::RankProgram &rank, int64_t &nextKernel);

} // namespace mlir::loom

#endif
