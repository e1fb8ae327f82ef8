//===- CudnnConv.h - cuDNN's convolutions and their gradients ---*- C++ -*-===//
//
// 2-D convolutions (forward, input gradient, filter gradient) through
// cuDNN's convolution API on NCHW or NHWC tensors, f32 or bf16 (f32
// accumulation).
// The fastest of cuDNN's algorithms is chosen once per shape, pass and
// device and kept for the process: cudnnFind*AlgorithmEx's candidates and,
// for bf16, the engines of frontend graphs (cuDNN's newer ones) are timed by
// fastestCandidate, the fastest kept. Host code only,
// compiled apart from the CUDA sources: the backend (CudaConv.cu) asks
// build() and launches what it returns.
//
//===----------------------------------------------------------------------===//

#ifndef LOOM_RUNTIME_CUDA_CUDNNCONV_H
#define LOOM_RUNTIME_CUDA_CUDNNCONV_H

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

struct cudnnContext; // cudnnHandle_t, without cudnn.h

namespace loom::rt::cudnn {

/// x [n, c, h, w] * filter [o, c / groups, kh, kw] -> y [n, o, ho, wo]; with
/// nhwc the tensors are stored channels last: x [n, h, w, c], filter
/// [o, kh, kw, c / groups], y [n, ho, wo, o] (the sizes are named the same).
struct ConvGeometry {
  int64_t n = 0, c = 0, h = 0, w = 0, o = 0, kh = 0, kw = 0, ho = 0, wo = 0;
  int64_t stride = 1, pad = 0, groups = 1;
  bool bf16 = false; // every operand bf16 (else f32)
  bool tf32 = true;  // f32 operands: whether TF32 tensor cores may run the products
  bool nhwc = false; // channels last (CUDNN_TENSOR_NHWC), what tensor cores read best
};

/// What a convolution computes, and its operands (a, b) -> out:
/// Forward (x, filter) -> y; GradInput (dy, filter) -> dx; GradFilter (x, dy) -> dfilter.
enum class ConvPass { Forward, GradInput, GradFilter };

class Convolution {
public:
  virtual ~Convolution() = default;
  virtual size_t workspaceBytes() const = 0;
  /// Writes `out` (overwritten, not accumulated). Returns "" or what failed.
  virtual std::string run(const void *a, const void *b, void *out, void *workspace, cudaStream_t stream) const = 0;
};

/// Whether this build has cuDNN (cudnn.h and libcudnn).
bool convolutionCompiledIn();

/// The convolution of `g` for `pass` on the current device, its algorithm
/// timed on operands a and b (read only: results go to a scratch buffer);
/// null with the reason in `why` when this build has no cuDNN or cuDNN has
/// no algorithm for it.
std::unique_ptr<Convolution> buildConvolution(const ConvGeometry &g, ConvPass pass, const void *a, const void *b,
                                              std::string &why);

/// The convolution as a cuDNN frontend graph (CudnnConvGraph.cpp): its
/// engines built and timed on a and b, the fastest kept, its time in `ms`;
/// null with the reason in `why` (no frontend in this build, no engine, a
/// grouped convolution). buildConvolution weighs it against the legacy
/// API's choice for bf16 convolutions.
/// A frontend graph's engine: its index among the heuristics' plans and
/// the engine's name (which the index must still name to be used again).
struct EngineChoice {
  int64_t plan = -1;
  std::string engine;
};

/// With `choice.plan` >= 0 on entry, only that engine is built (no timing;
/// null with the reason when the index no longer names `choice.engine`);
/// otherwise every engine is timed and `choice` says which won.
std::unique_ptr<Convolution> buildGraphConvolution(const ConvGeometry &g, ConvPass pass, const void *a,
                                                   const void *b, float &ms, std::string &why,
                                                   EngineChoice &choice);

/// The cuDNN frontend's version (CUDNN_FRONTEND_VERSION), 0 without it: part
/// of what a kept choice depends on.
int frontendVersion();

/// How long `launch` takes on the current device's default stream, in ms:
/// one run to warm up, then the fastest of `rounds` rounds' means of `runs`
/// runs each. Negative when a launch (false) or the timing failed.
float timeRuns(const std::function<bool()> &launch, int rounds, int runs);

/// The fastest of `count` candidates (launch(i) runs the i-th), its time in
/// `ms`; -1 when none ran. Each is timed by two runs after a warm-up run, as
/// the frontend's autotune times them, and those within 1.5x of the fastest
/// (six at most) again over three rounds of up to five runs: one
/// run of a kernel of tens of microseconds is noise of the size of the
/// differences between engines (ResNet-50's step on one H200 moved 8.4-8.8 ms
/// from one process to the next), and timing every engine that way made a
/// batch of 128 take 150 s to start.
int fastestCandidate(int count, const std::function<bool(int)> &launch, float &ms);

/// One cuDNN handle per device, made on first use (a handle is bound to the
/// device current when it is made) and kept for the process; null with the
/// reason in `why`. Shared with CudnnAttention.cpp; each user sets its
/// stream before each call.
cudnnContext *handleForCurrentDevice(std::string &why);

} // namespace loom::rt::cudnn

#endif
