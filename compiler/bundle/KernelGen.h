//===- KernelGen.h - PTX for the fused instructions ------------*- C++ -*-===//
//
// The fused instructions that loom-fuse-elementwise leaves in a bundle name
// kernels; this generates them through MLIR's gpu and NVVM dialects.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_BUNDLE_KERNELGEN_H
#define LOOM_COMPILER_BUNDLE_KERNELGEN_H

#include "loom/rt/Bundle.h"
#include "mlir/Support/LogicalResult.h"

#include <string>
#include <vector>

namespace mlir::loom {

/// PTX (sm_90a) with one entry per fused instruction of every rank,
/// generated through MLIR's gpu and NVVM dialects; "" when nothing was
/// fused. Fails with a message in `error`.
FailureOr<std::string> fusedKernelsPtx(const std::vector<::loom::rt::RankProgram> &ranks,
                                       std::string &error);

} // namespace mlir::loom

#endif
