//===- Fusion.h - Fuse elementwise chains and generate their GPU code -*- C++ -*-===//
//
// Consecutive elementwise instructions of one shape (bias adds, GELU,
// residual adds, the gradient kernels of activations, ...) become one
// "fused" instruction: its attributes describe the chain as steps over
// values, which the CPU backend evaluates, and name a kernel whose PTX the
// compiler generates through MLIR's gpu dialect (gpu -> NVVM -> PTX, no CUDA
// toolkit needed). Values the chain computes that nothing outside it reads
// are never written to memory.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_BUNDLE_FUSION_H
#define LOOM_COMPILER_BUNDLE_FUSION_H

#include "runtime/src/Bundle.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Support/LogicalResult.h"

#include <string>

namespace mlir::loom {

/// Fuses the elementwise chains of every program of `rank`; returns how many
/// instructions were removed. Fused instructions are named "fused_<n>"
/// (their "kernel" attribute), numbered from `firstKernel`.
int64_t fuseElementwise(::loom::rt::RankProgram &rank, int64_t &nextKernel);

/// PTX (sm_90a) with one entry per fused instruction of every rank,
/// generated through MLIR's gpu and NVVM dialects; "" when nothing was
/// fused. Fails with a message in `error`.
FailureOr<std::string> fusedKernelsPtx(const std::vector<::loom::rt::RankProgram> &ranks,
                                       std::string &error);

} // namespace mlir::loom

#endif
