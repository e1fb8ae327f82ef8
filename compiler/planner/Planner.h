//===- Planner.h - Choose and explain a parallel plan -----------*- C++ -*-===//
//
// Plain C++ over a summary of the model (ModelSpec), so the whole search is
// unit-testable without IR. The search enumerates dp x tp x pp (x virtual
// stages), microbatch size and count, schedule, recomputation and ZeRO-1;
// balances layers into stages; predicts step time (compute, communication,
// bubble) and memory per device; and keeps the best rejected alternatives
// with the reason each lost.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_PLANNER_PLANNER_H
#define LOOM_COMPILER_PLANNER_PLANNER_H

#include "compiler/planner/Cluster.h"
#include "compiler/planner/CostModel.h"

#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace loom::planner {

/// A parameter tensor read by more than one layer.
struct TiedParam {
  std::string name;
  double elements = 0;
  bool sharded = false; // split by tensor parallelism in this layer
};

/// One layer as the planner sees it, per example (one sequence), forward.
struct LayerSpec {
  std::string name;
  double params = 0;          // all parameters
  double shardedParams = 0;   // the part tensor parallelism splits
  double flops = 0;           // dense FLOPs
  double shardedFlops = 0;    // the part tensor parallelism splits
  double memoryTraffic = 0;   // bytes moved by non-matmul ops (memory-bound work)
  /// The part of memoryTraffic that tensor parallelism leaves replicated
  /// (ops on whole activations: residual adds, norms, the row-parallel
  /// biases), which every tp rank repeats unless sequence parallelism splits
  /// their tokens.
  double replicatedTraffic = 0;
  double attentionFlops = 0;  // score and value FLOPs (what selective recompute redoes)
  double boundaryBytes = 0;   // the activation passed to the next layer (16-bit)
  int tpAllReduces = 0;       // all-reduces of boundaryBytes per forward with tp > 1
  int64_t tpDivisor = 1;      // tp must divide this for the layer to shard (heads, ...)
  /// Memory as the compiled step holds it, in elements per example at tp =
  /// 1 (the planner multiplies by the precision's width); "sharded": the part
  /// tensor parallelism splits. Kept: the forward values the layer's
  /// gradient rules read, which live from the forward to the backward.
  double keptElements = 0, keptShardedElements = 0;
  /// The replicated part of keptElements that enters a column-parallel
  /// product (a norm's output): sequence parallelism gathers it whole, so it
  /// stays undivided; the rest of the replicated part is split over tp.
  double keptGatheredElements = 0;
  /// What a microbatch whose weight gradients ZB-H1 defers holds until
  /// then: the forward values and result gradients the weight-gradient
  /// products read.
  double deferredElements = 0, deferredShardedElements = 0;
  /// The layer's input, all that full recomputation keeps of it; 0 for layers
  /// outside loom.repeat, which recomputation leaves as they are.
  double checkpointElements = 0;
  /// The largest gradient the layer's backward makes (the logits' for the head).
  double largestGradElements = 0;
  bool largestGradSharded = false;
  /// The same leaving out the logits' gradient, which a fused step writes
  /// over the logits (loom-fuse-loss-gradient); equal where the layer has
  /// no loss.
  double largestGradBesideLoss = 0;
  bool largestGradBesideLossSharded = false;
  /// Parameters whose bf16 copy the backward reads (matrices; not the
  /// embedding table or biases), so the copy lives until then.
  double backwardReadParams = 0, backwardReadShardedParams = 0;
  /// Parameter tensors that another layer reads too (a tied embedding and LM
  /// head): one tensor and one gradient where both layers share a stage.
  std::vector<TiedParam> tied;
  bool isTransformer = false;
  double seq = 0, hidden = 0, heads = 0;
  /// The width of the attention's keys (and values): key/value heads times
  /// the head dimension, below `hidden` under grouped-query attention.
  double kvWidth = 0;
  /// Parameter tensors (ZeRO-1 collects each on its own in today's CUDA runtime).
  double paramTensors = 0;
  /// Instructions (kernel launches) of the layer's forward pass; backward
  /// launches about 1.4 times as many (the gradient rules' kernels).
  double instructions = 0;
  /// Matrix products (loom.matmul) of the forward pass, whose FLOPs are
  /// `flops - attentionFlops`: the mean size they run at sets their
  /// efficiency (CostOptions::matmulHalfRateFlops).
  double matmuls = 0;
};

struct ModelSpec {
  std::string name;
  std::vector<LayerSpec> layers; // in order; the repeated block appears count times
  double tokensPerExample = 1;
  double totalParams = 0;
  /// FLOPs of a training step per example without recomputation (3 x forward).
  double trainingFlopsPerExample = 0;
};

/// Knobs of the cost model. Defaults describe Loom's own runtime (fused
/// flash attention); the Megatron comparison sets materializedAttention.
struct CostOptions {
  double matmulEfficiency = 0.72;   // fraction of peak a large GEMM reaches
  std::string matmulDtype = "bf16"; // whose peak that fraction is of (tf32 for today's CUDA runtime)
  /// Fraction of HBM bandwidth at which the model's memory-bound bytes (each
  /// non-matrix op's operands and results) move; a step calibration can set
  /// it above 1 where the compiler's fusions remove passes that count includes.
  double memoryEfficiency = 0.80;
  double linkEfficiency = 0.80;     // fraction of link bandwidth NCCL collectives reach
  bool materializedAttention = false; // scores written to HBM (no flash attention)
  /// The step's loss writes its gradient over the logits (--fuse, the
  /// CUDA target: loom-fuse-loss-gradient), so the logits' gradient takes no
  /// memory of its own; not where tensor parallelism splits the vocabulary.
  bool lossGradientInPlace = true;
  /// loomc compile --grad-reduce bf16: the data-parallel all-reduce moves
  /// bf16 gradients (2 bytes a parameter) instead of f32 ones.
  bool gradReduceBf16 = false;
  /// Gradient all-reduce in buckets during the last microbatch's backward
  /// (Loom's runtime); false: after it, fully exposed (Megatron-LM 2021).
  bool overlapGradientReduce = true;
  /// ZeRO-1's collectives packed one call a bucket, the reduce-scatter going
  /// out in the backward's buckets (the CUDA runtime's default; measured,
  /// the backward hides none of it, see Planner::evaluate). False: each tensor through a copy and its own
  /// NCCL call, exposed (LOOM_CUDA_ZERO_PACKED=0; `zeroCallSeconds` each
  /// way: 11 us made GPT-2 350M's dp2 ZeRO-1 step on two H200s 57.0 ms, as
  /// issue #18 measured it, against 47.5 without ZeRO-1).
  bool zeroPackedCollectives = true;
  /// Bytes a parameter that packing ZeRO-1's buckets moves around its
  /// collectives (the runtime packs each bucket's slices into one span and
  /// unpacks them after: about 10 around the reduce-scatter, 7 around the
  /// gather); 0 for a runtime whose gradients and weights live in
  /// contiguous buffers (Megatron-LM's).
  double zeroPackBytesPerParam = 17.0;
  double zeroCallSeconds = 11e-6;
  /// ZeRO's reduce-scatter of bf16 gradients sends bf16 and sums in f32
  /// (the CUDA runtime's default since 2026-11-29; LOOM_CUDA_WIDE_SUMS=0
  /// sends them widened to f32): half the bytes on the wire.
  bool zeroWideSums = true;
  /// A two-rank data-parallel group within a node runs its ZeRO
  /// collectives over peer memory (the CUDA runtime's default where both
  /// ranks share a process, runtime/src/cuda/CudaPeerCollectives.cu): the
  /// copy engines push each part, no kernel packs them, and the backward
  /// and forward hide the reduce-scatters and gathers as they hide plain
  /// dp's all-reduces. GPT-2 350M on two H200s (2026-11-30): ZeRO-1 41.6 ms
  /// a step, ZeRO-2 42.4, ZeRO-3 42.8, against dp2's 42.3; through NCCL
  /// ZeRO-1 44.5. False: priced as exposed, packed (NCCL's way).
  bool peerZero = true;
  /// Pipeline sends leave the stage free (Loom's CUDA runtime: a staging
  /// copy, then ncclSend on a stream of their own; only the receiver waits
  /// for the data). False: each send blocks its stage for the transfer
  /// (Megatron-LM 2021's batched send/receive, then a device synchronize).
  /// Only the interleaved schedule's simulation distinguishes the two.
  bool pipelineSendsOverlap = true;
  /// A microbatch's weight gradient goes into its f32 sum through its own
  /// product (loom-accumulate-in-products: C read and written in f32, 6
  /// bytes a weight more than a bf16 result), not in an add after it (8
  /// bytes of sum and 2 of gradient); false: the add (Megatron-LM 2021).
  bool accumulateInProducts = true;
  /// The search weighs ZB-H1 (backward split into input- and weight-gradient
  /// tasks) for pipelined plans; false: only the schedules of Megatron-LM 2021.
  bool zeroBubbleSchedule = true;
  /// GPU memory outside the compiled arena: `runtimeBytes` on every device
  /// (the CUDA context, cuBLAS's workspace, the loaded kernels: 0.87 GiB
  /// for GPT-2 350M on one H200) and `communicatorBytes` for each NCCL
  /// communicator a rank joins (`communicatorsPerRank`): NCCL's buffers for
  /// every channel and protocol, allocated at creation because the runtime
  /// makes every connection then. Fitted to the memory in use on two and
  /// four H200s (issue #18, seventeenth and eighteenth sessions: one GPU
  /// 0.87 GiB beside the arena, a rank in one communicator 1.9-2.5, in three
  /// 3.6-3.9, in five 4.8-6.0).
  double runtimeBytes = 0.9 * (1ull << 30);
  double communicatorBytes = 1.0 * (1ull << 30);
  /// A tensor-parallel group's communicator holds more: the runtime gives it
  /// 64 channels (LOOM_NCCL_TP_CTAS), 0.8 GiB more of buffers than 32 (GPT-2
  /// 350M tp2 sp on two H200s, 2026-11-29: 12.77 GiB in use against 11.96).
  double tpChannelBytes = 0.8 * (1ull << 30);
  /// ZeRO's reduce-scatter of bf16 gradients with wide sums (zeroWideSums)
  /// sends and receives through NCCL's point-to-point buffers, which NCCL
  /// allocates beside its collectives' at the first send: GPT-2 350M ZeRO-1
  /// dp4 on four H200s, 2026-11-29: 13.45 GiB in use, 12.52 without wide
  /// sums, 12.37 with NCCL_MAX_P2P_NCHANNELS=8; the ZeRO-1 plans of GPT-2
  /// 350M and GPT 1.3B held 0.8-1.8 GiB more than dp2 and dp4 beside the arena.
  double zeroPointToPointBytes = 1.0 * (1ull << 30);
  /// A two-rank data-parallel group's gradient buckets, and ZeRO's slices,
  /// go over peer memory where its ranks share a process
  /// (runtime/src/cuda/CudaPeerCollectives.cu): each rank holds a 256 MiB
  /// scratch mapped for both GPUs (GPT-2 350M on two H200s, 2026-11-30: dp2
  /// 13.71 GiB in use against 13.45 without; ZeRO-2 13.94 against 13.69,
  /// ZeRO-3 12.00 against 11.76; ZeRO-1 13.60 against 13.78, since its
  /// reduce-scatters no longer fill NCCL's point-to-point buffers).
  double peerScratchBytes = 0.25 * (1ull << 30);
  /// Where such a group reduces bf16 gradients into f32 means (plain dp2:
  /// no tp or pp, one microbatch, bf16, no ZeRO), the runtime pushes each rank's bf16
  /// gradients whole into the peer's memory and the update sums them
  /// (DeferredPart in runtime/src/cuda/CudaBackendImpl.h): 2 bytes a
  /// parameter more on each rank, tied tensors (summed in f32) aside. GPT-2
  /// 350M dp2 on two H200s, 2026-11-30: 14.27 GiB in use against 13.71,
  /// 42.0-42.6 ms a step against 42.8-43.1. Its gradients cross once, whole,
  /// and nothing comes back (priced as a gather of them: 42.7 ms predicted).
  /// Priced for every such plan, though an SGD update, or --grad-reduce f32,
  /// keeps the all-reduce's sums (ResNet-50: 50 MB over).
  bool peerDeferredSums = true;
  /// The compiled step's element types (loomc compile --precision), for its
  /// memory; the step time's activation width is `activationBytes`.
  Precision precision = Precision::Bf16;
  /// Bytes per activation element moved by memory-bound kernels: 2 for bf16
  /// (the default), 4 when the runtime keeps activations in f32.
  double activationBytes = 2;
  bool tpAcrossNodes = false;
  /// Whether the runtime overlaps collectives with computation (data-parallel
  /// buckets during backward). A runtime profile may say it does not.
  bool overlapCollectives = true;
  /// Of the data-parallel collectives that run beside the backward, the
  /// share the backward hides (1: all of it, up to the backward's length).
  /// NCCL's kernels take SMs and memory bandwidth from the backward's: on
  /// two H200s GPT-2 350M's dp2 step is 7.6 ms longer than one GPU's and
  /// GPT 1.3B's 18.7 ms, against all-reduces of 7.9 and 29.4 ms at the
  /// measured link rate (a profile's "comm_hidden_share").
  double commHiddenShare = 1.0;
  /// Tensor-parallel collectives (a profile's "tp_link_efficiency" and
  /// "link_half_bytes"): the share of the link rate a large one reaches
  /// (0: linkEfficiency), and the message size at which it reaches half of
  /// that (0: every size alike). NCCL's all-gathers and reduce-scatters of
  /// 16, 32 and 64 MiB moved at 0.77, 1.0 and 1.15 times one rate on H200s
  /// (GPT-2 350M and GPT 1.3B under tp2 and tp4, 2026-11-29).
  double tpLinkEfficiency = 0;
  double linkHalfBytes = 0;
  /// Host time per instruction launched (seconds), paid by every microbatch
  /// pass: it dominates when microbatches or tensor parallelism make the
  /// kernels small. 0 unless a runtime profile measured it.
  double launchSeconds = 0;
  /// The runtime replays programs as CUDA graphs (a profile's `cuda_graphs`),
  /// collectives and pipeline sends and receives included: no launch cost.
  /// (Without the profile's flag, each instruction costs `launchSeconds`.)
  bool graphsOnOneDevice = false;
  /// Optional calibration profile (loom-run --profile), overriding the above.
  std::string profile;
  /// GEMMs run below their peak when small: a product of f FLOPs runs at
  /// rate R f / (f + f0), f0 this. Fitted to GPT-2 350M's bf16 GEMMs on an
  /// H200 at three sizes (loom-run --profile at 12.9, 29.9 and 59.7 GFLOP a
  /// product: 432, 571 and 640 TFLOP/s; within 3%). Only a profile's rate
  /// is scaled by it, to the size each plan runs its products at.
  double matmulHalfRateFlops = 8.2e9;
  /// The profile's mean FLOPs a matrix product (its matmul FLOPs over their
  /// count): the size its matmul rate was measured at; 0: no size scaling.
  double profileGemmFlops = 0;
  /// The profiled model, where it is not the one planned (loomc plan
  /// --profile-model): the step calibration runs on it.
  std::shared_ptr<const ModelSpec> profileSpec;
  /// A training step of `profileModel` at `profileBatch` on one device,
  /// measured without per-instruction events (the profile's step_seconds).
  /// Planning that model, the memory efficiency is solved so the prediction
  /// for that configuration equals it (everything not matrix work or
  /// communication: kernels, their gaps, the optimizer); 0: not measured.
  double profileStepSeconds = 0;
  std::string profileModel;
  int64_t profileBatch = 0, profileRanks = 0;
  /// What the calibration did, for the plan's explanation (empty: nothing).
  std::string calibration;
};

/// What --force fixes; unset fields are searched.
struct Constraints {
  std::optional<int64_t> dp, tp, pp, vpp, microbatches, microbatchSize;
  std::optional<Schedule> schedule;
  std::optional<Recompute> recompute;
  std::optional<int> zero;
  /// Sequence parallelism (tp > 1): only where forced, until it is measured.
  std::optional<bool> sp;
};

/// How many NCCL communicators a rank of pipeline stage `stage` joins in a
/// training step of the plan, as the runtime creates them
/// (`loom::rt::communicatorsOf`): one per distinct member list of the groups
/// its collectives name (data-parallel gradients; tensor-parallel
/// activations; the loss broadcast over the pipeline; the clipping norm over
/// the model-parallel ranks, or every rank with ZeRO-1; a tensor shared by
/// the first and last stages) and one per direction to each neighbouring
/// stage. `sharedAcrossStages`: the model ties a tensor of the first stage
/// to one of the last (GPT's embedding and head).
int64_t communicatorsPerRank(int64_t dp, int64_t tp, int64_t pp, int64_t vpp, bool zero1, bool sharedAcrossStages,
                             int64_t stage);

/// "dp=2,tp=2,pp=2,mb=8,schedule=1f1b": false with a message on bad input.
bool parseConstraints(const std::string &text, Constraints &out, std::string &error);
std::string describeConstraints(const Constraints &c);

struct StagePlan {
  int64_t firstLayer = 0, numLayers = 0; // into ModelSpec::layers
  std::vector<std::pair<int64_t, int64_t>> chunks; // [first, count] per virtual stage
  std::string layerRanges() const;                 // "0-6, 14-20"
  double forwardTime = 0, backwardTime = 0; // per microbatch, seconds
  /// The weight-gradient part of backwardTime (ZB-H1's deferred W task).
  double weightGradTime = 0;
  /// Interleaved plans: the same per chunk (virtual stage), in `chunks`
  /// order, which sum to the stage's times and which the schedule's
  /// simulation runs; empty for the other schedules (one chunk a stage).
  std::vector<double> chunkForwardTimes, chunkBackwardTimes, chunkWeightGradTimes;
  /// Per device: weightBytes (parameters and optimizer state, in front of
  /// the arena) + activationBytes (the peak of what the memory plan packs
  /// behind them: activations, gradients, bf16 weight copies) + reserved.
  double memoryBytes = 0;
  double weightBytes = 0, activationBytes = 0;
};

struct Plan {
  int64_t dp = 1, tp = 1, pp = 1, vpp = 1;
  int64_t microbatchSize = 1, microbatches = 1;
  Schedule schedule = Schedule::OneFOneB;
  Recompute recompute = Recompute::None;
  int zero = 0;
  /// Megatron's sequence parallelism: the tokens between the tp regions split
  /// over the tp ranks (loom-sequence-parallel).
  bool sequenceParallel = false;
  std::vector<StagePlan> stages;
  // Predicted step time, split.
  double stepTime = 0, computeTime = 0, communicationTime = 0, bubbleTime = 0;
  double tpCommTime = 0, ppCommTime = 0, dpCommTime = 0, optimizerTime = 0;
  /// One activation's (or its gradient's) send across a stage boundary.
  double ppTransferTime = 0;
  double peakMemoryBytes = 0;
  double tokensPerSecond = 0, mfu = 0, tflopsPerDevice = 0;
  bool feasible = true;
  std::string reason; // why infeasible, or why rejected

  std::string shortName() const;
};

struct PlanResult {
  Plan best;
  std::vector<Plan> alternatives; // best feasible runners-up, then infeasible ones
  int64_t evaluated = 0;
  double searchSeconds = 0;
  bool found = false;
  std::string error; // why nothing is feasible, with the limit and by how much
};

class Planner {
public:
  Planner(ModelSpec model, Cluster cluster, CostOptions options = {});

  /// Searches every plan allowed by `constraints` for global batch `batch`
  /// (examples per step).
  PlanResult search(int64_t batch, const Constraints &constraints = {}) const;
  /// Evaluates one fully specified plan (fields of `plan` set by the caller).
  Plan evaluate(int64_t batch, Plan plan) const;

  const ModelSpec &model() const { return spec; }
  const Cluster &cluster() const { return machines; }
  const CostOptions &costs() const { return options; }

private:
  void calibrateToMeasuredStep();
  ModelSpec spec;
  Cluster machines;
  CostOptions options;
};

/// The plan format planToJson writes (its "version") and readPlanFile reads.
constexpr int64_t kPlanVersion = 1;

nlohmann::json planToJson(const Plan &plan, const ModelSpec &model, const Cluster &cluster,
                          int64_t batch);
/// Human-readable plan: degrees, stage table, time split, alternatives.
std::string explainPlan(const PlanResult &result, const ModelSpec &model, const Cluster &cluster,
                        int64_t batch);

/// Applies a calibration profile: efficiencies given directly
/// {"matmul_efficiency": x, "memory_efficiency": y, "link_efficiency": z}, or
/// measured by `loom-run --profile` {"matmul_flops_per_s": r, "matmul_dtype": d},
/// which sets the matmul efficiency to r over the cluster's peak for d.
bool loadProfile(const std::string &path, CostOptions &options, const Cluster &cluster,
                 std::string &error);

} // namespace loom::planner

#endif
