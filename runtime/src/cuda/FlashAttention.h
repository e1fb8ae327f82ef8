//===- FlashAttention.h - Fused bf16 attention on tensor cores -*- C++ -*-===//
//
// Scaled dot-product attention that never writes the S x T scores to memory:
// each block keeps a tile of queries (forward) or keys (backward) on chip and
// streams the other side through shared memory, with the softmax computed
// online (FlashAttention-2's algorithm). Operands are bf16 in [B, S, H*D]
// layout (a head's D columns side by side, as the loom dialect lays them
// out); products run on bf16 tensor cores (mma.sync m16n8k16) accumulating
// in f32; grouped-query attention (H a multiple of the K/V heads) is native.
//
//===----------------------------------------------------------------------===//

#ifndef LOOM_RUNTIME_CUDA_FLASHATTENTION_H
#define LOOM_RUNTIME_CUDA_FLASHATTENTION_H

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace loom::rt::flash {

struct Params {
  const void *q = nullptr, *k = nullptr, *v = nullptr; // bf16 [B,S,H*D], [B,T,KV*D] x2
  int64_t batch = 0, s = 0, t = 0, heads = 0, kvHeads = 0, headDim = 0;
  bool causal = false; // query i sees keys j <= i + (T - S)
  float scale = 1.0f;
  // Row strides in elements where operands are columns of a wider tensor
  // (q|k|v packed side by side); 0 means dense (H*D, KV*D). O and dO are dense.
  int64_t ldq = 0, ldk = 0; // Q; K and V
  int64_t lddq = 0, lddk = 0; // the backward's dQ; dK and dV
};

/// Head dimensions with a kernel (16, 32, 64, 128).
bool supported(int64_t headDim);

/// O (bf16, Q's layout) and, when `lse` is given, each row's log-sum-exp of
/// the scaled scores in base 2 (f32 [B*H, S]).
cudaError_t forward(const Params &p, void *o, float *lse, cudaStream_t stream);

/// Workspace bytes `backward` needs.
size_t backwardWorkspace(const Params &p);

/// dQ, dK, dV (bf16, their operands' layouts) from dO. Given the forward's
/// O and `lse` (unchanged since), uses them; otherwise recomputes both first.
cudaError_t backward(const Params &p, const void *dO, void *dQ, void *dK, void *dV, void *workspace,
                     cudaStream_t stream, const void *o = nullptr, const float *lse = nullptr);

} // namespace loom::rt::flash

#endif
