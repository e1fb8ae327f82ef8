//===- Pipeline.cpp - The loom-compile pass pipeline ----------------------===//

#include "compiler/Pipeline.h"
#include "passes/Passes.h"
#include "mlir/Pass/PassRegistry.h"

#include <algorithm>

using namespace mlir;
using namespace mlir::loom;

namespace {
const char *const kSkippable[] = {"loom-fuse-loss-gradient", "loom-update-copies", "loom-packed-qkv-attention",
                                  "loom-join-slice-gradients", "loom-overlap-tensor-reduce",
                                  "loom-overlap-tensor-gather", "loom-split-tensor-reduce",
                                  "loom-accumulate-in-products", "loom-reduce-from-products",
                                  "loom-gather-embedding-rows"};
} // namespace

bool mlir::loom::isSkippablePass(StringRef name) {
  return std::find(std::begin(kSkippable), std::end(kSkippable), name) != std::end(kSkippable);
}

std::string mlir::loom::skippablePasses() {
  std::string list;
  for (const char *name : kSkippable)
    list += (list.empty() ? "" : ", ") + std::string(name);
  return list;
}

void mlir::loom::buildCompilePipeline(OpPassManager &pm, const BundleOptions &o, StringRef until) {
  bool stopped = false;
  auto add = [&](std::unique_ptr<Pass> pass) {
    if (stopped)
      return;
    if (o.skipPasses.count(pass->getArgument().str()) && isSkippablePass(pass->getArgument()))
      return;
    stopped = !until.empty() && pass->getArgument() == until;
    pm.addPass(std::move(pass));
  };
  int64_t dp = o.dataParallel, tp = o.tensorParallel, pp = o.pipelineParallel;
  int64_t m = o.microbatches;
  bool pipelined = pp > 1 || m > 1;
  add(createConfigurePass(o));
  // loom-configure checks the degrees first; these only have to be defined.
  SpecializeBatchOptions batch;
  batch.batch = o.serve.enabled ? 1 : std::max<int64_t>(1, o.batch / std::max<int64_t>(1, dp * m));
  add(createSpecializeBatch(batch));
  // Partition first: its rules match parameters read directly, and the
  // mixed-precision casts then go after each rank's own shards.
  PartitionTensorParallelOptions partition;
  partition.tp = std::max<int64_t>(1, tp);
  partition.gatherOutputs = !o.train;
  add(createPartitionTensorParallel(partition));
  if (o.train && tp > 1 && o.sequenceParallel)
    add(createSequenceParallel());
  if (o.bf16)
    add(createMixedPrecision());
  if (o.nhwc)
    add(createNhwcLayout());
  add(createLowerToStep());
  if (o.serve.enabled)
    add(createServePrograms());
  if (o.train) {
    add(createPipelineSplit());
    add(createAutodiff());
    add(createRecompute());
  }
  add(createDistributeRanks());
  if (o.train) {
    add(createPipelineSchedule());
    add(createDataParallel());
    add(createOptimizerUpdate());
    add(createJoinSliceGradients());
    add(createPackedQkvAttention());
    add(createBf16StepCasts());
    if (o.zero1 && (o.bf16 || o.zero3))
      add(createZeroGatherCopies());
    if (o.bf16)
      add(createUpdateCopies());
  }
  if (o.fuse && o.train)
    add(createFuseLossGradient());
  if (o.fuse)
    add(createFuseElementwise());
  if (o.fuse && o.train && pipelined)
    add(createAccumulateInProducts());
  if (o.fuse && o.train && o.bf16 && dp > 1 && !o.gradReduceWide)
    add(createReduceFromProducts());
  if (o.train && dp > 1 && !pipelined && !o.zero2 && !o.zero3) // ZeRO-1: into each rank's slice
    add(createGatherEmbeddingRows());
  if (o.train && tp > 1)
    add(createOverlapTensorReduce());
  if (o.train && tp > 1 && o.sequenceParallel && o.tpOverlap)
    add(createOverlapTensorGather());
  if (o.train && tp > 1 && o.tpOverlap)
    add(createSplitTensorReduce());
  if (o.train && (pipelined || dp * tp * pp > 1))
    add(createCompactRanks());
  add(createPlanMemory());
}

namespace {

struct CompilePipelineOptions : public PassPipelineOptions<CompilePipelineOptions> {
  Option<int64_t> batch{*this, "batch", llvm::cl::desc("Global batch"), llvm::cl::init(1)};
  Option<bool> train{*this, "train", llvm::cl::desc("The training step of @loss"),
                     llvm::cl::init(false)};
  Option<std::string> precision{*this, "precision", llvm::cl::desc("f32 or bf16"),
                                llvm::cl::init("f32")};
  Option<std::string> layout{*this, "layout",
                             llvm::cl::desc("nchw, or nhwc: convolutions channels-last"),
                             llvm::cl::init("nchw")};
  Option<bool> fuse{*this, "fuse", llvm::cl::desc("Fused kernels and GEMM epilogues"),
                    llvm::cl::init(false)};
  Option<std::string> optimizer{*this, "optimizer", llvm::cl::desc("adamw, sgd or none"),
                                llvm::cl::init("adamw")};
  Option<int64_t> dp{*this, "dp", llvm::cl::desc("Data-parallel degree"), llvm::cl::init(1)};
  Option<int64_t> tp{*this, "tp", llvm::cl::desc("Tensor-parallel degree"), llvm::cl::init(1)};
  Option<int64_t> pp{*this, "pp", llvm::cl::desc("Pipeline stages"), llvm::cl::init(1)};
  Option<int64_t> vpp{*this, "vpp", llvm::cl::desc("Virtual stages per rank"), llvm::cl::init(1)};
  Option<int64_t> mb{*this, "mb", llvm::cl::desc("Microbatches per step"), llvm::cl::init(1)};
  Option<std::string> schedule{*this, "schedule", llvm::cl::desc("gpipe, 1f1b, interleaved or zb-h1"),
                               llvm::cl::init("1f1b")};
  Option<int64_t> zero{*this, "zero", llvm::cl::desc("ZeRO stage (0, 1, 2 or 3)"), llvm::cl::init(0)};
  Option<bool> sp{*this, "sp", llvm::cl::desc("Sequence parallelism (tp > 1, training)"), llvm::cl::init(false)};
  Option<bool> tpOverlap{*this, "tp-overlap",
                         llvm::cl::desc("Tensor-parallel products cut by rows beside their collectives"),
                         llvm::cl::init(false)};
  Option<int64_t> seed{*this, "seed", llvm::cl::desc("Initialisation seed"), llvm::cl::init(0)};
  Option<bool> serve{*this, "serve", llvm::cl::desc("Serving step programs over a paged KV cache"),
                     llvm::cl::init(false)};
  Option<int64_t> maxBatch{*this, "max-batch", llvm::cl::desc("Serving: sequences at once"),
                           llvm::cl::init(8)};
  Option<int64_t> maxSeq{*this, "max-seq", llvm::cl::desc("Serving: tokens per sequence (0: the model's)"),
                         llvm::cl::init(0)};
  Option<int64_t> blockSize{*this, "block-size", llvm::cl::desc("Serving: tokens per cache block"),
                            llvm::cl::init(16)};
  Option<int64_t> kvBlocks{*this, "kv-blocks", llvm::cl::desc("Serving: cache blocks (0: full)"),
                           llvm::cl::init(0)};
  Option<int64_t> prefillChunk{*this, "prefill-chunk",
                               llvm::cl::desc("Serving: most tokens per step (0: min(max-seq, 512))"),
                               llvm::cl::init(0)};
  Option<std::string> weightLayout{*this, "weight-layout",
                               llvm::cl::desc("Serving: prepared weights nk ([out, in]) or kn"),
                               llvm::cl::init("nk")};
  Option<std::string> until{*this, "until",
                            llvm::cl::desc("Stop after the pass of this argument (loom-autodiff, ...)"),
                            llvm::cl::init("")};
};

} // namespace

void mlir::loom::registerCompilePipeline() {
  PassPipelineRegistration<CompilePipelineOptions>(
      "loom-compile",
      "Every compile stage of a model, from loom ops to the lowered step a bundle holds",
      [](OpPassManager &pm, const CompilePipelineOptions &p) {
        BundleOptions o;
        o.batch = p.batch;
        o.train = p.train;
        o.bf16 = p.precision == "bf16";
        o.fuse = p.fuse;
        o.nhwc = p.layout == "nhwc";
        o.training.optimizer = p.optimizer;
        o.dataParallel = p.dp, o.tensorParallel = p.tp, o.pipelineParallel = p.pp;
        o.virtualStages = p.vpp, o.microbatches = p.mb;
        o.schedule = p.schedule;
        o.zero1 = p.zero >= 1;
        o.zero2 = p.zero >= 2;
        o.zero3 = p.zero == 3;
        o.sequenceParallel = p.sp;
        o.tpOverlap = p.tpOverlap;
        o.seed = p.seed;
        o.serve.enabled = p.serve;
        o.serve.maxBatch = p.maxBatch, o.serve.maxSeq = p.maxSeq, o.serve.blockSize = p.blockSize;
        o.serve.kvBlocks = p.kvBlocks, o.serve.prefillChunk = p.prefillChunk;
        o.serve.weightLayout = p.weightLayout;
        buildCompilePipeline(pm, o, p.until);
      });
}
