//===- BundleWriter.h - Lower a model to a runnable bundle ------*- C++ -*-===//
//
// Turns the forward pass of a verified model into the runtime's instruction
// stream: one typed instruction per loom op (reshapes become views), every
// loom.repeat unrolled with per-layer parameter names ("layer.3.ln1.g"),
// buffers packed into one arena by lifetime, and parameters initialised from
// their initializer attributes with a seed (or loaded from a file). Inputs
// and outputs take their names from the model's source ("%tokens").
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_BUNDLE_BUNDLEWRITER_H
#define LOOM_COMPILER_BUNDLE_BUNDLEWRITER_H

#include "runtime/src/Bundle.h"
#include "mlir/IR/BuiltinOps.h"

#include <functional>
#include <set>
#include <string>

namespace mlir::loom {

/// Hyper-parameters of the training step (loomc compile --train).
struct TrainOptions {
  std::string optimizer = "adamw"; // adamw, sgd, or none (gradients only)
  double lr = 3e-4, minLr = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weightDecay = 0.1; // applied to matrices, not to biases and norms
  double momentum = 0.9;    // sgd
  double clip = 1.0;        // global gradient-norm clipping; 0 turns it off
  int64_t warmup = 0, totalSteps = 0; // linear warm-up, then cosine decay over totalSteps
  /// Layers whose activations are recomputed in backward instead of kept:
  /// "all", a block's name ("layer": every application) or one application
  /// ("layer.3").
  std::set<std::string> recompute;
};

struct BundleOptions {
  int64_t batch = 1;
  uint64_t seed = 0;
  std::string modelName = "model";
  std::string weightsFile; // load instead of initialising, when set
  bool noWeights = false;  // write no weights file: the runtime initialises from the seed
  bool train = false;      // lower @loss with backward and update programs
  bool bf16 = false;       // bf16 activations, f32 master parameters (loom-mixed-precision)
  /// Data-parallel ranks: each runs batch / dataParallel examples, and the
  /// update starts by averaging gradients (and the loss) over the ranks.
  int64_t dataParallel = 1;
  /// ZeRO-1: optimizer state partitioned over the data-parallel ranks.
  bool zero1 = false;
  /// Megatron tensor parallelism over this many ranks (loom-partition-tp).
  int64_t tensorParallel = 1;
  /// Pipeline stages, virtual stages per rank (interleaved 1F1B) and
  /// microbatches per step; the schedule is gpipe, 1f1b or interleaved.
  int64_t pipelineParallel = 1, virtualStages = 1, microbatches = 1;
  std::string schedule = "1f1b";
  /// Units (embedding, each layer, head) per pipeline chunk, in chunk order
  /// (chunk c runs on stage c % pp); empty: split them evenly.
  std::vector<int64_t> chunkUnits;
  /// Data-parallel gradient all-reduces go in buckets of about this many
  /// bytes, each issued right after the last instruction that finishes one
  /// of its gradients, so that communication overlaps the rest of backward.
  int64_t bucketBytes = 25 << 20;
  /// Fuse chains of elementwise instructions into generated kernels (PTX in
  /// the bundle's kernels.ptx; the CPU backend evaluates their description).
  bool fuse = false;
  /// Recorded in the manifest: the plan this bundle was compiled for.
  nlohmann::json plan = nlohmann::json::object();
  TrainOptions training;
};

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

/// Packs the activation buffers of a rank into the arena by lifetime and
/// fills offsets, arena size and peak; persistent buffers (parameters,
/// inputs, outputs) come first. Exposed for tests.
void planMemory(::loom::rt::RankProgram &rank, const std::vector<std::string> &programs);

/// Lowers, initialises or loads the weights, and writes DIR/manifest.json and
/// DIR/weights.safetensors. Errors go to the module's diagnostics.
LogicalResult writeBundle(ModuleOp module, const BundleOptions &options, const std::string &dir,
                          ::loom::rt::Manifest *out = nullptr);

} // namespace mlir::loom

#endif
