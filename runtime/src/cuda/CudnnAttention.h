//===- CudnnAttention.h - cuDNN's fused attention for bf16 SDPA -*- C++ -*-===//
//
// Scaled dot-product attention through cuDNN's SDPA graphs (its frontend
// builds them on the backend API; on Hopper the engines are FlashAttention
// kernels on wgmma). Same operands and layouts as our flash kernels
// (flash::Params: bf16 [B, S, H*D], q|k|v read in place from a wider tensor);
// the CUDA backend uses it where this build has cuDNN's frontend and cuDNN
// has an engine for the shape, and our kernels otherwise.
//
//===----------------------------------------------------------------------===//

#ifndef LOOM_RUNTIME_CUDA_CUDNNATTENTION_H
#define LOOM_RUNTIME_CUDA_CUDNNATTENTION_H

#include "runtime/src/cuda/FlashAttention.h"

#include <memory>
#include <string>

namespace loom::rt::cudnn {

/// One attention's forward (with statistics) and, for training, backward.
/// Operand pointers are fixed when it is built; results are passed per call.
class Attention {
public:
  virtual ~Attention() = default;
  /// Workspace bytes the larger of the two needs.
  virtual size_t workspaceBytes() const = 0;
  /// O (dense [B, S, H*D]) and each row's log-sum-exp of the scaled scores
  /// (f32 [B, H, S], natural base: only this class's backward reads it).
  /// Returns "" or what failed.
  virtual std::string forward(void *o, float *stats, void *workspace, cudaStream_t stream) = 0;
  /// dQ, dK, dV (their Params layouts) from dO, with the forward's O and
  /// statistics. Returns "" or what failed.
  virtual std::string backward(const void *o, const float *stats, const void *dO, void *dQ, void *dK, void *dV,
                               void *workspace, cudaStream_t stream) = 0;
};

/// Whether this build has cuDNN's frontend.
bool compiledIn();

/// Builds the forward and, with `backward`, the backward graph for `p` on
/// the current device; null with the reason in `why` when this build has no
/// cuDNN, cuDNN does not load, or it has no engine for these shapes.
/// `deterministic`: a backward engine whose dQ does not depend on the order
/// its blocks finish in (cuDNN's default sums it with atomics).
std::unique_ptr<Attention> build(const flash::Params &p, bool backward, std::string &why,
                                 bool deterministic = false);

} // namespace loom::rt::cudnn

#endif
