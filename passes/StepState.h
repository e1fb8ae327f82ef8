//===- StepState.h - The lowered step as passes read and write it -*- C++ -*-===//
//
// The compile stages after lowering are passes over the `loomrt` dialect.
// Each reads the module's loomrt.bundle into the runtime's own structures
// (rt::RankProgram: buffers, bindings, instruction lists), transforms them,
// and writes the bundle back, so that every stage's output is IR that
// loom-opt prints and lit checks, and serialisation writes what the last
// pass left. The options every stage reads (batch, precision, the parallel
// plan) are attributes on the module: `loom.options` and `loom.plan`.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_PASSES_STEPSTATE_H
#define LOOM_PASSES_STEPSTATE_H

#include "loom/rt/Bundle.h"
#include "mlir/IR/BuiltinOps.h"

#include <map>
#include <set>
#include <string>
#include <vector>

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

/// A serving bundle (loomc compile --serve): step programs over a paged
/// key/value cache instead of the forward pass (loom-serve-programs).
struct ServeOptions {
  bool enabled = false;
  int64_t maxBatch = 8;     // sequences decoding at once
  int64_t maxSeq = 0;       // prompt + generated tokens per sequence; 0: the model's sequence
  int64_t blockSize = 16;   // tokens per cache block
  int64_t kvBlocks = 0;     // cache blocks; 0: enough for max_batch sequences of max_seq
  int64_t prefillChunk = 0; // most tokens per step; 0: min(max_seq, 512)
  /// The prepared bf16 weights of the products: "nk" ([out, in], each
  /// output's weights contiguous, as decoding reads them) or "kn" (the
  /// model's own [in, out]).
  std::string weightLayout = "nk";
};

struct BundleOptions {
  int64_t batch = 1;
  uint64_t seed = 0;
  std::string modelName = "model";
  std::string weightsFile; // load instead of initialising, when set
  bool noWeights = false;  // write no weights file: the runtime initialises from the seed
  /// Copied into the bundle and named by the manifest's "tokenizer":
  /// tokenizer.json (BPE) or a SentencePiece .model; "" for none.
  std::string tokenizerFile;
  bool train = false;      // lower @loss with backward and update programs
  bool bf16 = false;       // bf16 activations, f32 master parameters (loom-mixed-precision)
  /// Convolutions, batch norms and pooling in NHWC (loom-nhwc-layout);
  /// loomc compile's default for --target cuda.
  bool nhwc = false;
  /// Data-parallel ranks: each runs batch / dataParallel examples, and the
  /// update starts by averaging gradients (and the loss) over the ranks.
  int64_t dataParallel = 1;
  /// ZeRO-1: optimizer state partitioned over the data-parallel ranks.
  bool zero1 = false;
  /// ZeRO-2 (with zero1): the gradients too. Each rank keeps only its slice
  /// of a gradient once its bucket is reduce-scattered; the whole one's
  /// memory is free again for the rest of the backward. One microbatch.
  bool zero2 = false;
  /// ZeRO-3 (with zero2): the parameters too. Each rank holds its slice of
  /// every parameter (ParamShard::zeroParts); the forward and the backward
  /// all-gather the weights a bucket at a time, one bucket ahead of their
  /// first use, and drop them after their last. One microbatch, one stage.
  bool zero3 = false;
  /// Mixed precision: the data-parallel all-reduces average bf16 gradients
  /// as bf16 on the wire (half the bytes; one more rounding of each mean)
  /// before widening them into their f32 copies; f32 by default.
  bool gradReduceBf16 = false;
  /// Mixed precision: the products write bf16 weight gradients (no
  /// loom-reduce-from-products) and the buckets widen them into f32 means:
  /// where the CUDA runtime reduces a two-rank group over peer memory, the
  /// bf16 halves cross and are summed in f32 (loomc --grad-reduce wide, the
  /// default there for a two-rank group within a node).
  bool gradReduceWide = false;
  /// Megatron tensor parallelism over this many ranks (loom-partition-tp).
  int64_t tensorParallel = 1;
  /// Training with tp > 1: the tokens between the tensor-parallel layers
  /// split over the tp ranks (loom-sequence-parallel).
  bool sequenceParallel = false;
  /// Training with tp > 1: tensor-parallel products cut by rows so that their
  /// collectives run beside them (loom-split-tensor-reduce, and with
  /// sequence parallelism loom-overlap-tensor-gather). Off by default until
  /// two GPUs measure what they hide; alone on one GPU they cost 0.3-0.8 ms
  /// a step of GPT-2 350M's tp2 rank.
  bool tpOverlap = false;
  /// Pipeline stages, virtual stages per rank (interleaved 1F1B) and
  /// microbatches per step; the schedule is gpipe, 1f1b, interleaved or zb-h1.
  int64_t pipelineParallel = 1, virtualStages = 1, microbatches = 1;
  std::string schedule = "1f1b";
  /// Units (embedding, each layer, head) per pipeline chunk, in chunk order
  /// (chunk c runs on stage c % pp); empty: split them evenly.
  std::vector<int64_t> chunkUnits;
  /// Data-parallel gradient all-reduces go in buckets of about this many
  /// bytes, each issued right after the last instruction that finishes one
  /// of its gradients, so that communication overlaps the rest of backward;
  /// ZeRO's gathers go in buckets of the same size. 0: gradientBucketBytes
  /// and gatherBucketBytes choose.
  int64_t bucketBytes = 0;
  /// Fuse chains of elementwise instructions into generated kernels (PTX in
  /// the bundle's kernels.ptx; the CPU backend evaluates their description).
  bool fuse = false;
  /// Recorded in the manifest: the plan this bundle was compiled for.
  nlohmann::json plan = nlohmann::json::object();
  TrainOptions training;
  ServeOptions serve;
  /// Optional rewrites the pipeline leaves out (loomc compile --skip-pass),
  /// by pass argument; not recorded on the module.
  std::set<std::string> skipPasses;
};

/// Writes `options` onto the module as `loom.options` (batch, seed,
/// precision, fusion, the training step's hyper-parameters) and `loom.plan`
/// (the parallel degrees, schedule, stages, buckets, and the plan recorded
/// in the manifest). The weights file and --no-weights are serialisation's,
/// not the passes', and stay out.
void setCompileOptions(ModuleOp module, const BundleOptions &options);
/// Reads them back; defaults where the module has none. Fails with a
/// diagnostic on a malformed attribute.
FailureOr<BundleOptions> getCompileOptions(ModuleOp module);

/// One rank as the passes see it: what the bundle holds, and what passes
/// leave for later ones.
struct StepRank {
  ::loom::rt::RankProgram program;
  /// The pipeline stage whose last chunk computes the loss (set by
  /// loom-pipeline-schedule; -1 before, or without pipelining).
  int64_t lossStage = -1;
  /// (parameter buffer, pipeline chunk) -> the gradient that chunk computes.
  std::map<std::pair<int64_t, int64_t>, int64_t> paramGrads;
  /// ZeRO-1: parameter buffer -> the gradient slice this rank updates.
  std::map<int64_t, int64_t> zeroShards;
  /// Parameter buffer -> the group over which its gradient is summed: each
  /// rank computed it from its own part of the tokens (sequence
  /// parallelism's norms and biases; loom-data-parallel sums them).
  std::map<int64_t, std::string> partialGrads;
};

struct Step {
  ::loom::rt::Manifest manifest; // every field but `ranks`
  std::vector<StepRank> ranks;
};

/// Reads the module's loomrt.bundle; fails (naming `pass`) where there is none.
FailureOr<Step> readStep(ModuleOp module, StringRef pass);
/// Replaces the module's loomrt.bundle with `step` (or adds one).
void writeStep(ModuleOp module, const Step &step);
/// Reads the step, runs `fn` on it and writes it back; what a step pass's
/// runOnOperation does. Fails where reading or `fn` fails.
LogicalResult updateStep(ModuleOp module, StringRef pass, function_ref<LogicalResult(Step &)> fn);

/// updateStep for a pass that rewrites each rank on its own, in rank order.
LogicalResult updateEachRank(ModuleOp module, StringRef pass, function_ref<void(StepRank &)> fn);
/// For the rewrites that move `group`'s collectives onto the communication
/// stream: runs `fn` over each step program (not "prepare" or "update") of
/// every rank with no async collectives of other groups (data-parallel
/// buckets, ZeRO's gathers: the stream runs its work in order, so a moved
/// collective would wait behind them), with the rank's next free event,
/// which `fn` advances as it records events.
LogicalResult updateGroupPrograms(
    ModuleOp module, StringRef pass, const std::string &group,
    function_ref<void(::loom::rt::RankProgram &, std::vector<::loom::rt::Instruction> &, int64_t &)> fn);

/// The manifest the bundle writes: the ranks' programs without the notes
/// passes leave for each other.
::loom::rt::Manifest toManifest(const Step &step);

//===----------------------------------------------------------------------===//
// What the step passes share
//===----------------------------------------------------------------------===//

/// Where global rank g sits in the dp x tp x pp grid (tp fastest, then dp,
/// then pp, as Megatron-LM numbers ranks), and the groups it belongs to.
struct Grid {
  int64_t dp, tp, pp;
  int64_t size() const { return dp * tp * pp; }
  int64_t rankOf(int64_t d, int64_t t, int64_t p) const { return (p * dp + d) * tp + t; }
  int64_t dpOf(int64_t g) const { return (g / tp) % dp; }
  int64_t tpOf(int64_t g) const { return g % tp; }
  int64_t ppOf(int64_t g) const { return g / (dp * tp); }
  /// Fills the rank's coordinates and its dp, tp, pp, mp and all groups.
  void describe(::loom::rt::RankProgram &r) const;
};

/// Buffers a rewrite must leave as they are: the rank's outputs and the
/// parameters' gradients (the C API and the update read them).
std::set<int64_t> keptBuffers(const ::loom::rt::RankProgram &r);
/// Buffers some other buffer is a view of.
std::set<int64_t> viewedBuffers(const ::loom::rt::RankProgram &r);
/// Whether the instruction's boolean attribute `name` is set (false when
/// absent or not a boolean).
bool flagAttr(const ::loom::rt::Instruction &ins, const char *name);
/// Whether the instruction talks to other ranks or waits for a collective
/// (a collective, a send or receive, the clipping norm, the
/// vocabulary-parallel loss, an event wait): a collective moved or placed
/// on the communication stream passes none of these, since every rank's
/// stream must issue its collectives in the same order.
bool ordersCollectives(const ::loom::rt::Instruction &ins);
/// One past the largest event any instruction of the rank records or waits
/// for: the next async collective's event.
int64_t nextEvent(const ::loom::rt::RankProgram &r);
/// Whether some program of the rank has an async collective of a group other
/// than `group` (data-parallel buckets, ZeRO's gathers): the communication
/// stream runs them in order, so a collective of `group` moved there would
/// wait behind them.
bool asyncBesides(const ::loom::rt::RankProgram &r, const std::string &group);
/// An instruction of a rank: its program and its place there.
struct InstructionSite {
  std::string program;
  size_t index;
};
/// Where each storage is read and written (a view's reads and writes count
/// as its root's), over every program of the rank.
struct StorageUses {
  std::map<int64_t, std::vector<InstructionSite>> readers, writers;
};
StorageUses storageUses(const ::loom::rt::RankProgram &r);
/// Every place buffer `from` is named (instructions of every program,
/// views of it) names `to` instead.
void renameBuffer(::loom::rt::RankProgram &r, int64_t from, int64_t to);
/// Removes the instructions `drop` marks, keeping the order of the rest.
void eraseMarked(std::vector<::loom::rt::Instruction> &list, const std::vector<bool> &drop);
/// Consecutive runs of tensors of `bytes` each, as collectives take them in
/// buckets: a run closes once it holds `bucketBytes` or more (and at the
/// end). [begin, end) index pairs, in order.
std::vector<std::pair<size_t, size_t>> bucketRuns(const std::vector<int64_t> &bytes, int64_t bucketBytes);
/// The gradient buckets' size: `requested` where it is set (--bucket-mb),
/// else a sixth of a rank's `gradientBytes` between 25 and 256 MiB, or 25
/// MiB where the buckets bound memory (ZeRO-2 and -3, `memoryBound`).
int64_t gradientBucketBytes(int64_t requested, int64_t gradientBytes, bool memoryBound);
/// ZeRO's gathers' buckets: `requested` where it is set, else 25 MiB.
int64_t gatherBucketBytes(int64_t requested);
/// An all_gather of slices into wholes (`in` and `out` paired) as several,
/// in order, each of about `bucketBytes` of wholes with the same
/// attributes: the runtime stages a gather's wholes in a workspace of its
/// own. None for an empty gather.
std::vector<::loom::rt::Instruction> gatherInBuckets(const ::loom::rt::RankProgram &r,
                                                     const ::loom::rt::Instruction &gather, int64_t bucketBytes);
/// The pipeline stages that compute each parameter's gradient (several for
/// a tied embedding), from autodiff's per-chunk gradients.
std::map<int64_t, std::set<int64_t>> paramStages(const StepRank &rank, int64_t pp);
/// Parameters and optimizer state: shared by every microbatch, never copied.
bool isFloatRole(const ::loom::rt::Buffer &b);

/// Drops the buffers and parameters a rank's programs never touch (another
/// pipeline stage's layers, what a rewrite replaced) and renumbers the rest
/// densely (loom-compact-ranks).
void compactRank(::loom::rt::RankProgram &rank);

/// A buffer's element type as MLIR's, and back (none for other types).
Type elementType(MLIRContext *ctx, ::loom_dtype_t dtype);
std::optional<::loom_dtype_t> dtypeOf(Type type);

/// JSON values as MLIR attributes and back, losslessly for what the
/// compiler writes: integers (i64), doubles (f64), booleans, strings, arrays
/// (of integers: dense i64 arrays), objects (dictionaries).
Attribute jsonToAttr(MLIRContext *ctx, const nlohmann::json &value);
FailureOr<nlohmann::json> attrToJson(Attribute attr);
/// An op's attribute as an instruction attribute: numbers, booleans,
/// strings and i64 arrays; anything else is an error at `op`.
FailureOr<nlohmann::json> instructionAttr(Operation *op, NamedAttribute attr);

/// Erases the model's functions, parameters and blocks, leaving the step.
void eraseModel(ModuleOp module);

} // namespace mlir::loom

#endif
