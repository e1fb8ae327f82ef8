//===- loomc.cpp - The Loom compiler driver -------------------------------===//
//
// loomc verify MODEL.mlir     parse, verify and summarise a model
// loomc models FAMILY ...     write a model file of a family and size
//
//===----------------------------------------------------------------------===//

#include "compiler/ModelSummary.h"
#include "compiler/ModelZoo.h"
#include "compiler/import/HfCheckpoint.h"
#include "compiler/NestingLimit.h"
#include "compiler/tools/LoomcInspect.h"
#include "compiler/Pipeline.h"
#include "compiler/PlannerModel.h"
#include "compiler/planner/PlanFile.h"
#include "loom/rt/Bundle.h"
#include "compiler/bundle/BundleWriter.h"
#include "compiler/planner/Cluster.h"
#include "compiler/planner/PlanFile.h"
#include "compiler/planner/ServePlanner.h"
#include "dialects/loom/IR/LoomDialect.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "loom/rt/Safetensors.h"
#include "mlir/Support/FileUtilities.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/SourceMgr.h"
#include "llvm/Support/ToolOutputFile.h"
#include "llvm/Support/WithColor.h"

using namespace mlir;
namespace cl = llvm::cl;

namespace {
cl::OptionCategory zooCategory("Model size options");

cl::SubCommand verifyCmd("verify", "Parse and verify a model file and print a summary: "
                                   "parameters, FLOPs per example and per token, ops by kind");
cl::opt<std::string> verifyInput(cl::Positional, cl::desc("<model.mlir>"), cl::Required,
                                 cl::sub(verifyCmd));

cl::SubCommand modelsCmd("models", "Write a model file of a family and size "
                                   "(gpt, llama, bert, mlp, resnet); unset sizes take the "
                                   "family's defaults");
cl::opt<std::string> family(cl::Positional, cl::desc("<gpt|llama|bert|mlp|resnet>"),
                            cl::Required, cl::sub(modelsCmd));
cl::opt<int64_t> layers("layers", cl::desc("Number of layers (gpt 12, llama 22, bert 12, mlp 2)"),
                        cl::init(0), cl::sub(modelsCmd), cl::cat(zooCategory));
cl::opt<int64_t> hidden("hidden", cl::desc("Hidden width (gpt 768, llama 2048, bert 768, mlp 256)"),
                        cl::init(0), cl::sub(modelsCmd), cl::cat(zooCategory));
cl::opt<int64_t> heads("heads", cl::desc("Attention heads (gpt 12, llama 32, bert 12)"),
                       cl::init(0), cl::sub(modelsCmd), cl::cat(zooCategory));
cl::opt<int64_t> kvHeads("kv-heads", cl::desc("Key/value heads for grouped-query attention (llama 4)"),
                         cl::init(0), cl::sub(modelsCmd), cl::cat(zooCategory));
cl::opt<int64_t> ffn("ffn", cl::desc("Feed-forward width (default 4 x hidden; llama 5632)"),
                     cl::init(0), cl::sub(modelsCmd), cl::cat(zooCategory));
cl::opt<int64_t> vocab("vocab", cl::desc("Vocabulary size (gpt 50257, llama 32000, bert 30522)"),
                       cl::init(0), cl::sub(modelsCmd), cl::cat(zooCategory));
cl::opt<int64_t> seq("seq", cl::desc("Sequence length (gpt 1024, llama 2048, bert 512)"),
                     cl::init(0), cl::sub(modelsCmd), cl::cat(zooCategory));
cl::opt<int64_t> inputs("inputs", cl::desc("Input features of an mlp (784)"), cl::init(0),
                        cl::sub(modelsCmd), cl::cat(zooCategory));
cl::opt<int64_t> classes("classes", cl::desc("Output classes of an mlp (10) or resnet (1000)"),
                         cl::init(0), cl::sub(modelsCmd), cl::cat(zooCategory));
cl::opt<int64_t> image("image", cl::desc("Image height and width of a resnet (224)"),
                       cl::init(0), cl::sub(modelsCmd), cl::cat(zooCategory));
cl::opt<std::string> dtype("dtype", cl::desc("Element type of parameters and activations: "
                                             "f32, bf16, f16 or f64"),
                           cl::init("f32"), cl::sub(modelsCmd), cl::cat(zooCategory));
cl::opt<std::string> modelOutput("o", cl::desc("Output file (default: standard output)"),
                                 cl::value_desc("file"), cl::init("-"), cl::sub(modelsCmd));

cl::SubCommand compileCmd("compile", "Compile a model into a bundle that loom-run and the "
                                     "C API execute");
cl::opt<std::string> compileInput(cl::Positional, cl::desc("<model.mlir>"), cl::Required,
                                  cl::sub(compileCmd));
cl::opt<std::string> compileOutput("o", cl::desc("Bundle directory to write (OUT.loom)"),
                                   cl::value_desc("dir"), cl::Required, cl::sub(compileCmd));
cl::opt<std::string> compileCluster("cluster", cl::desc("Cluster preset or JSON file (cpu:1)"),
                                    cl::init("cpu:1"), cl::sub(compileCmd));
cl::opt<std::string> compileForce("force", cl::desc("Fix parts of the parallel plan, as for "
                                                  "loomc plan (dp=,tp=,pp=,vpp=,mb=,schedule=,"
                                                  "zero=,recompute=,sp=); the planner chooses the rest"),
                                  cl::init(""), cl::sub(compileCmd));
cl::opt<std::string> compilePlan("plan", cl::desc("Compile for this plan (loomc plan --json) "
                                                "instead of planning"),
                                 cl::value_desc("plan.json"), cl::init(""), cl::sub(compileCmd));
cl::opt<std::string> compileTarget("target", cl::desc("cpu (the default), or cuda: NVIDIA GPUs (sm_90a), "
                                                      "which means --fuse and, unless --precision says "
                                                      "otherwise, --precision bf16 (every bundle runs on "
                                                      "either backend)"),
                                   cl::init("cpu"), cl::sub(compileCmd));
cl::opt<std::string> compileLayout("layout", cl::desc("Convolutions, batch norms and pooling in nchw, or "
                                                      "nhwc (channels last, for tensor cores: the default "
                                                      "with --target cuda)"),
                                   cl::init(""), cl::sub(compileCmd));
cl::opt<bool> compileInfer("infer", cl::desc("Compile the forward pass (the default)"),
                           cl::sub(compileCmd));
cl::opt<bool> compileTrain("train", cl::desc("Compile a training step of @loss: forward, "
                                            "backward and optimizer update"),
                           cl::sub(compileCmd));
cl::OptionCategory trainCategory("Training options (with --train)");
cl::opt<std::string> trainOptimizer("optimizer", cl::desc("adamw, sgd (with momentum), or none "
                                                          "(gradients only)"),
                                    cl::init("adamw"), cl::sub(compileCmd), cl::cat(trainCategory));
cl::opt<double> trainLr("lr", cl::desc("Peak learning rate"), cl::init(3e-4), cl::sub(compileCmd),
                        cl::cat(trainCategory));
cl::opt<double> trainMinLr("min-lr", cl::desc("Learning rate at the end of the cosine decay"),
                           cl::init(0.0), cl::sub(compileCmd), cl::cat(trainCategory));
cl::opt<int64_t> trainWarmup("warmup", cl::desc("Linear warm-up steps"), cl::init(0),
                             cl::sub(compileCmd), cl::cat(trainCategory));
cl::opt<int64_t> trainTotal("total-steps", cl::desc("Steps of the cosine decay after warm-up "
                                                    "(0: constant rate)"),
                            cl::init(0), cl::sub(compileCmd), cl::cat(trainCategory));
cl::opt<double> trainBeta1("beta1", cl::desc("AdamW beta1"), cl::init(0.9), cl::sub(compileCmd),
                           cl::cat(trainCategory));
cl::opt<double> trainBeta2("beta2", cl::desc("AdamW beta2"), cl::init(0.95), cl::sub(compileCmd),
                           cl::cat(trainCategory));
cl::opt<double> trainEps("eps", cl::desc("AdamW epsilon"), cl::init(1e-8), cl::sub(compileCmd),
                         cl::cat(trainCategory));
cl::opt<double> trainDecay("weight-decay", cl::desc("Decoupled weight decay on matrices (not on "
                                                    "biases and norms)"),
                           cl::init(0.1), cl::sub(compileCmd), cl::cat(trainCategory));
cl::opt<double> trainMomentum("momentum", cl::desc("SGD momentum"), cl::init(0.9),
                              cl::sub(compileCmd), cl::cat(trainCategory));
cl::list<std::string> trainRecompute("recompute",
                                     cl::desc("Recompute these layers' activations in backward "
                                              "instead of keeping them: all, a block name "
                                              "(layer) or one application (layer.3)"),
                                     cl::CommaSeparated, cl::sub(compileCmd), cl::cat(trainCategory));
cl::opt<double> trainClip("clip", cl::desc("Clip the global gradient norm to this (0: off)"),
                          cl::init(1.0), cl::sub(compileCmd), cl::cat(trainCategory));
cl::opt<std::string> trainGradReduce("grad-reduce",
                                     cl::desc("Data-parallel gradient all-reduce, with --precision bf16: "
                                              "auto (the default: wide for a two-rank data-parallel group "
                                              "within a node under --target cuda, else f32); f32 (the "
                                              "products write f32 weight gradients, reduced in f32); wide "
                                              "(bf16 weight gradients summed into f32 means: over peer "
                                              "memory their bf16 halves cross, elsewhere they are widened "
                                              "first); or bf16 (averaged as bf16 on the wire, half the "
                                              "bytes and one more rounding, then widened)"),
                                     cl::init("auto"), cl::sub(compileCmd), cl::cat(trainCategory));
cl::opt<bool> trainTpOverlap("tp-overlap",
                            cl::desc("Tensor parallelism: cut the forward's row-parallel products into two "
                                     "halves of their rows so the first half's all-reduce runs beside "
                                     "the second half's product, and with sequence parallelism run each "
                                     "product's own rows beside the gather of the others' "
                                     "(loom-split-tensor-reduce, loom-overlap-tensor-gather). The same "
                                     "values; off by default until measured on two GPUs"),
                            cl::init(false), cl::sub(compileCmd), cl::cat(trainCategory));
cl::opt<double> trainBucketMb("bucket-mb",
                              cl::desc("Data-parallel gradients go out in buckets of about this many MiB "
                                       "(of the gradients as they are made), each as soon as its last "
                                       "gradient is, beside the rest of the backward; ZeRO's gathers use "
                                       "the same size. 0 (the default): a sixth of a rank's gradients, "
                                       "from 25 to 256 MiB (25 under ZeRO-2 and -3, and for the gathers)"),
                              cl::init(0.0), cl::sub(compileCmd), cl::cat(trainCategory));
cl::opt<int64_t> compileBatch("batch", cl::desc("Batch size the dynamic batch dimension takes"),
                              cl::init(1), cl::sub(compileCmd));
cl::opt<uint64_t> compileSeed("seed", cl::desc("Seed for initialising parameters"), cl::init(0),
                              cl::sub(compileCmd));
cl::opt<std::string> compilePrecision("precision",
                                      cl::desc("f32 (default), or bf16: bf16 activations and "
                                               "compute with f32 master parameters, optimizer "
                                               "state and loss"),
                                      cl::init("f32"), cl::sub(compileCmd));
cl::opt<bool> compileFuse("fuse",
                          cl::desc("Fuse chains of elementwise instructions into kernels generated "
                                   "through MLIR's gpu dialect (PTX in OUT.loom/kernels.ptx)"),
                          cl::sub(compileCmd));
cl::list<std::string> compileSkipPass("skip-pass",
                                      cl::desc("Leave out an optional rewrite of the pipeline, to measure what it "
                                               "does (loom-fuse-loss-gradient, loom-update-copies, "
                                               "loom-packed-qkv-attention, loom-join-slice-gradients)"),
                                      cl::CommaSeparated, cl::value_desc("pass"), cl::sub(compileCmd));
cl::opt<bool> compileNoWeights("no-weights",
                               cl::desc("Write no weights file; the runtime initialises the "
                                        "parameters from --seed when it loads the bundle"),
                               cl::sub(compileCmd));
cl::opt<std::string> compileWeights("weights",
                                    cl::desc("Load parameters from a safetensors file instead "
                                             "of initialising them"),
                                    cl::value_desc("file"), cl::sub(compileCmd));

cl::OptionCategory serveCategory("Serving options (with --serve)");
cl::opt<bool> compileServe("serve", cl::desc("Compile a decoder for serving: step programs over a paged "
                                             "key/value cache, for continuous batching (loom-run "
                                             "--generate, loom-serve, the C API's loom_server_*)"),
                           cl::sub(compileCmd));
cl::opt<std::string> serveObjective(
    "objective",
    cl::desc("With --serve on several GPUs: the planner picks the tensor-parallel degree for the "
             "shortest decoding step at batch 1 (latency) or the most tokens/s per GPU at --max-batch "
             "(throughput), and prints its predictions"),
    cl::init(""), cl::sub(compileCmd), cl::cat(serveCategory));
cl::opt<int64_t> serveMaxBatch("max-batch", cl::desc("Sequences decoding at once (default 8)"), cl::init(8),
                               cl::sub(compileCmd), cl::cat(serveCategory));
cl::opt<int64_t> serveMaxSeq("max-seq", cl::desc("Tokens per sequence, prompt and answer (default: the "
                                                 "model's sequence length)"),
                             cl::init(0), cl::sub(compileCmd), cl::cat(serveCategory));
cl::opt<int64_t> serveBlockSize("block-size", cl::desc("Tokens per key/value cache block (default 16)"),
                                cl::init(16), cl::sub(compileCmd), cl::cat(serveCategory));
cl::opt<int64_t> serveKvBlocks("kv-blocks", cl::desc("Key/value cache blocks (default: enough for "
                                                     "--max-batch sequences of --max-seq tokens)"),
                               cl::init(0), cl::sub(compileCmd), cl::cat(serveCategory));
cl::opt<int64_t> servePrefillChunk("prefill-chunk", cl::desc("Most tokens one step runs: prompts longer "
                                                             "than this are split so that decoding "
                                                             "sequences keep going (default: "
                                                             "min(max-seq, 512))"),
                                   cl::init(0), cl::sub(compileCmd), cl::cat(serveCategory));
cl::opt<std::string> serveWeightLayout(
    "weight-layout",
    cl::desc("Layout of the prepared bf16 weight matrices: nk ([out, in], each output's weights "
             "contiguous, as decoding reads them; the default) or kn (the model's [in, out])"),
    cl::init("nk"), cl::sub(compileCmd), cl::cat(serveCategory));
cl::opt<std::string> compileTokenizer("tokenizer",
                                      cl::desc("Copy this tokenizer (tokenizer.json or a "
                                               "SentencePiece .model) into the bundle (default: "
                                               "the model's loom.tokenizer, if it names one)"),
                                      cl::value_desc("file"), cl::sub(compileCmd));

cl::SubCommand importCmd("import", "Read a Hugging Face checkpoint (GPT2LMHeadModel, "
                                   "LlamaForCausalLM): write its model file, its weights under "
                                   "Loom's names and its tokenizer");
cl::opt<std::string> importDir(cl::Positional, cl::desc("<checkpoint directory>"), cl::Required,
                               cl::sub(importCmd));
cl::opt<std::string> importOutput("o", cl::desc("Model file to write (default: the directory's "
                                                "name with .mlir)"),
                                  cl::value_desc("MODEL.mlir"), cl::sub(importCmd));
cl::opt<std::string> importWeights("weights", cl::desc("Weights file to write (default: the model "
                                                       "file with .safetensors)"),
                                   cl::value_desc("file"), cl::sub(importCmd));
cl::opt<std::string> importDtype("dtype", cl::desc("Parameter type: f32 or bf16"),
                                 cl::init("f32"), cl::sub(importCmd));
cl::opt<int64_t> importSeq("seq", cl::desc("Sequence length of the model (default: the "
                                           "checkpoint's positions)"),
                           cl::init(0), cl::sub(importCmd));

cl::opt<bool> importNoTokenizer("no-tokenizer", cl::desc("Leave the checkpoint's tokenizer out"),
                                cl::sub(importCmd));

cl::SubCommand exportCmd("export", "Write a bundle's (or a checkpoint's) weights as a Hugging "
                                   "Face checkpoint that transformers loads");
cl::opt<std::string> exportInput(cl::Positional, cl::desc("<bundle | checkpoint.safetensors>"),
                                 cl::Required, cl::sub(exportCmd));
cl::opt<std::string> exportBundle("bundle", cl::desc("The bundle a checkpoint was trained with "
                                                     "(its model's shape and constants)"),
                                  cl::value_desc("dir"), cl::sub(exportCmd));
cl::opt<std::string> exportTo("to", cl::desc("Directory to write config.json, model.safetensors "
                                             "and the tokenizer to"),
                              cl::value_desc("dir"), cl::Required, cl::sub(exportCmd));

cl::SubCommand planCmd("plan", "Choose how to parallelise a model on a cluster, predict its step "
                               "time and memory, and explain the choice");
cl::opt<std::string> planInput(cl::Positional, cl::desc("<model.mlir>"), cl::Required,
                               cl::sub(planCmd));
cl::opt<std::string> planCluster("cluster", cl::desc("Cluster preset (h100:8, h100:8x4, "
                                                     "a100-80g:8x16, cpu:4) or JSON file"),
                                 cl::Required, cl::sub(planCmd));
cl::opt<int64_t> planBatch("batch", cl::desc("Global batch in examples (sequences) per step"),
                           cl::init(0), cl::sub(planCmd));
cl::opt<std::string> planForce("force", cl::desc("Fix parts of the plan: dp=,tp=,pp=,vpp=,mb=,"
                                                 "mbs=,schedule=gpipe|1f1b|interleaved|zb-h1,"
                                                 "recompute=none|selective|full,zero=0|1|2|3,"
                                                 "sp=0|1 (sequence parallelism, with tp > 1)"),
                               cl::init(""), cl::sub(planCmd));
cl::opt<std::string> planJson("json", cl::desc("Write the plan as JSON (for loomc inspect and "
                                               "loomc compile --plan)"),
                              cl::value_desc("file"), cl::init(""), cl::sub(planCmd));
cl::opt<std::string> planProfile("profile", cl::desc("Calibration profile written by loom-run "
                                                     "--profile"),
                                 cl::value_desc("file"), cl::init(""), cl::sub(planCmd));
cl::opt<std::string> planProfileModel(
    "profile-model",
    cl::desc("The model file the --profile measured, where it is not the one planned: the step "
             "calibration runs on it (default: models/<its name>.mlir or beside MODEL.mlir, where one exists)"),
    cl::value_desc("file"), cl::init(""), cl::sub(planCmd));
cl::opt<std::string> planPrecision("precision",
                                   cl::desc("The training step's precision, as for loomc compile: bf16 (the "
                                            "default; f32 master parameters) or f32; sets the memory "
                                            "predicted, not the step time (--profile calibrates that)"),
                                   cl::init("bf16"), cl::sub(planCmd));
cl::opt<std::string> planGradReduce("grad-reduce",
                                    cl::desc("Price the data-parallel gradient all-reduce as loomc compile "
                                             "--grad-reduce runs it: auto or wide (the default: a two-rank "
                                             "group in a node sends its bf16 gradients once and the update "
                                             "sums them), f32 (f32 gradients all-reduced) or bf16 (bf16 "
                                             "means, with --precision bf16)"),
                                    cl::init("auto"), cl::sub(planCmd));
cl::opt<bool> planMaterialized("materialized-attention",
                               cl::desc("Model attention that writes its scores to memory (no "
                                        "flash attention), as Megatron-LM did in 2021"),
                               cl::sub(planCmd));

cl::SubCommand inspectCmd("inspect", "Show a plan (PLAN.json from loomc plan --json) or a "
                                     "bundle (OUT.loom); draw a plan's pipeline schedule as SVG");
cl::opt<std::string> inspectInput(cl::Positional, cl::desc("<plan.json | out.loom>"), cl::Required,
                                  cl::sub(inspectCmd));
cl::opt<std::string> inspectSvg("svg", cl::desc("Write the pipeline schedule and memory per "
                                                "device as an SVG picture"),
                                cl::value_desc("file"), cl::init(""), cl::sub(inspectCmd));

int fail(const llvm::Twine &message) {
  llvm::WithColor::error(llvm::errs(), "loomc") << message << "\n";
  return 1;
}

void loadDialects(MLIRContext &context) {
  context.loadDialect<mlir::loom::LoomDialect, func::FuncDialect>();
}

/// A model file, parsed and verified, its diagnostics printed as file:line:col.
/// Diagnostics about no place in it (the output directory, a weights file)
/// have an unknown location and print as the tool's own errors. Members are
/// destroyed in reverse: the module and handlers before their context.
struct ModelFile {
  llvm::SourceMgr sourceMgr;
  MLIRContext context;
  std::unique_ptr<SourceMgrDiagnosticHandler> diagnostics;
  std::unique_ptr<ScopedDiagnosticHandler> unlocated;
  OwningOpRef<ModuleOp> module;
};

LogicalResult printUnlocated(Diagnostic &d) {
  if (!isa<UnknownLoc>(d.getLocation()))
    return failure(); // the source manager's handler prints it at its line
  llvm::raw_ostream &os = d.getSeverity() == DiagnosticSeverity::Error
                              ? llvm::WithColor::error(llvm::errs(), "loomc")
                          : d.getSeverity() == DiagnosticSeverity::Warning
                              ? llvm::WithColor::warning(llvm::errs(), "loomc")
                              : llvm::WithColor::note(llvm::errs(), "loomc");
  os << d << "\n";
  for (const Diagnostic &note : d.getNotes())
    llvm::WithColor::note(llvm::errs(), "loomc") << note << "\n";
  return success();
}

/// Null (with the error printed) when the file cannot be read or does not verify.
std::unique_ptr<ModelFile> parseModelFile(const std::string &path) {
  std::string message;
  auto file = openInputFile(path, &message);
  if (!file) {
    llvm::WithColor::error(llvm::errs(), "loomc") << "cannot read '" << path << "': " << message << "\n";
    return nullptr;
  }
  auto model = std::make_unique<ModelFile>();
  unsigned buffer = model->sourceMgr.AddNewSourceBuffer(std::move(file), llvm::SMLoc());
  if (failed(mlir::loom::checkNesting(model->sourceMgr, buffer)))
    return nullptr;
  loadDialects(model->context);
  model->diagnostics = std::make_unique<SourceMgrDiagnosticHandler>(model->sourceMgr, &model->context);
  model->unlocated = std::make_unique<ScopedDiagnosticHandler>(&model->context, printUnlocated);
  // An error is one located line, not the line and the whole module printed
  // after it ("see current operation").
  model->context.printOpOnDiagnostic(false);
  model->module = parseSourceFile<ModuleOp>(model->sourceMgr, &model->context);
  return model->module ? std::move(model) : nullptr;
}

/// --grad-reduce's value (compile and plan): "bf16" sets `bf16`; false for
/// anything but auto, f32, wide or bf16.
bool parseGradReduce(const std::string &value, bool &bf16) {
  bf16 = value == "bf16";
  return bf16 || value == "f32" || value == "wide" || value == "auto";
}

/// The first training option out of its range, named; "" when all are fine.
/// Infinities and NaNs (`--lr inf`, `--lr 1e400`) are out of every range.
std::string checkTrainingOptions() {
  struct Range {
    const cl::opt<double> &option;
    bool zeroAllowed, belowOne; // else: above 0, finite
  };
  for (const Range &r : {Range{trainLr, false, false}, Range{trainMinLr, true, false},
                         Range{trainBeta1, true, true}, Range{trainBeta2, true, true},
                         Range{trainEps, false, false}, Range{trainDecay, true, false},
                         Range{trainMomentum, true, true}, Range{trainClip, true, false}}) {
    double v = r.option;
    if ((r.zeroAllowed ? v >= 0 : v > 0) && (r.belowOne ? v < 1 : std::isfinite(v)))
      continue;
    std::string range = r.belowOne      ? "at least 0 and below 1"
                        : r.zeroAllowed ? "a finite number of at least 0"
                                        : "a finite number above 0";
    std::ostringstream got;
    got << v;
    return ("--" + r.option.ArgStr + " must be " + range + ", got " + got.str()).str();
  }
  if (trainWarmup < 0 || trainTotal < 0)
    return (trainWarmup < 0 ? "--warmup" : "--total-steps") + std::string(" must be at least 0, got ") +
           std::to_string(trainWarmup < 0 ? trainWarmup : trainTotal);
  return "";
}

int runVerify() {
  auto model = parseModelFile(verifyInput);
  if (!model)
    return 1;
  OwningOpRef<ModuleOp> &module = model->module;
  FailureOr<mlir::loom::ModelSummary> summary = mlir::loom::summarizeModel(*module);
  if (failed(summary))
    return 1;
  llvm::outs() << verifyInput << ": ok\n";
  summary->print(llvm::outs());
  return 0;
}

int runCompile() {
  if (compileTrain && compileInfer)
    return fail("--train and --infer are exclusive");
  if (compileServe && (compileTrain || compileInfer))
    return fail("--serve compiles serving programs: leave out --train and --infer");
  if (!compileServe)
    for (auto *o : {&serveMaxBatch, &serveMaxSeq, &serveBlockSize, &serveKvBlocks, &servePrefillChunk})
      if (o->getNumOccurrences())
        return fail("--" + o->ArgStr.str() + " applies to serving bundles (--serve)");
  if (!compileServe && serveWeightLayout.getNumOccurrences())
    return fail("--weight-layout applies to serving bundles (--serve)");
  if (serveWeightLayout != "nk" && serveWeightLayout != "kn")
    return fail("--weight-layout must be nk or kn, got '" + serveWeightLayout + "'");
  if (!compileServe && serveObjective.getNumOccurrences())
    return fail("--objective applies to serving bundles (--serve); training plans minimise the step time");
  if (compileServe) {
    if (serveMaxBatch < 1 || serveMaxBatch > 65536)
      return fail("--max-batch must be in [1, 65536]");
    if (serveBlockSize < 1 || serveBlockSize > 4096)
      return fail("--block-size must be in [1, 4096]");
    if (serveMaxSeq < 0 || serveKvBlocks < 0 || servePrefillChunk < 0 || serveMaxSeq > (1 << 24) ||
        servePrefillChunk > (1 << 20) || serveKvBlocks > (1 << 30))
      return fail("--max-seq (at most 2^24), --kv-blocks (2^30) and --prefill-chunk (2^20) must be >= 0");
    if (compileBatch.getNumOccurrences())
      return fail("--batch does not apply to serving bundles: --max-batch sets the sequences at once");
  }
  if (trainOptimizer != "adamw" && trainOptimizer != "sgd" && trainOptimizer != "none")
    return fail("--optimizer must be adamw, sgd or none, got '" + trainOptimizer + "'");
  if (std::string problem = checkTrainingOptions(); !problem.empty())
    return fail(problem);
  if (compileTarget != "cpu" && compileTarget != "cuda")
    return fail("--target must be cpu or cuda (NVIDIA Hopper, sm_90a), got '" + compileTarget + "'");
  bool cuda = compileTarget == "cuda";
  ::loom::planner::Cluster cluster;
  std::string error;
  if (!::loom::planner::parseCluster(compileCluster, cluster, error))
    return fail(error);
  ::loom::planner::Constraints force;
  if (!::loom::planner::parseConstraints(compileForce, force, error))
    return fail(error);
  if (!compilePlan.empty() && !compileForce.empty())
    return fail("give --plan or --force, not both");
  if (force.sp.value_or(false) && !compileTrain)
    return fail("--force sp=1: sequence parallelism splits a training step's tokens; add --train");
  if (compileBatch < 1)
    return fail("--batch must be at least 1");
  ::loom::planner::Precision precision;
  if (!::loom::planner::parsePrecision(compilePrecision, precision))
    return fail("--precision must be f32 or bf16, got '" + compilePrecision + "'");
  if (cuda && compilePrecision.getNumOccurrences() == 0)
    precision = ::loom::planner::Precision::Bf16;
  if (trainTpOverlap && !compileTrain)
    return fail("--tp-overlap cuts a training step's tensor-parallel products; add --train");
  bool gradReduceBf16 = false;
  if (!parseGradReduce(trainGradReduce, gradReduceBf16))
    return fail("--grad-reduce must be auto, f32, wide or bf16, got '" + trainGradReduce + "'");
  if ((gradReduceBf16 || trainGradReduce == "wide") &&
      (!compileTrain || precision != ::loom::planner::Precision::Bf16))
    return fail("--grad-reduce " + trainGradReduce +
                (gradReduceBf16 ? " averages bf16 gradients" : " sums bf16 gradients into f32") +
                ": it needs --train and --precision bf16 (or --target cuda)");

  auto model = parseModelFile(compileInput);
  if (!model)
    return 1;
  OwningOpRef<ModuleOp> &module = model->module;

  // The plan: read from --plan, or searched with --force's parts fixed. One
  // device needs no search.
  nlohmann::json plan = nlohmann::json::object();
  // Inference and serving plans: tensor parallelism over `devices` only.
  auto tensorParallelOnly = [&](int64_t devices, int64_t tp) {
    return nlohmann::json{{"format", "loom-plan"}, {"devices", devices}, {"batch", int64_t(compileBatch)},
                          {"dp", 1}, {"tp", tp}, {"pp", 1}, {"vpp", 1}, {"microbatches", 1}};
  };
  if (!compilePlan.empty()) {
    auto spec = mlir::loom::buildModelSpec(*module, llvm::sys::path::stem(compileInput));
    if (failed(spec))
      return 1;
    if (!::loom::planner::readPlanFile(compilePlan, *spec, plan, error))
      return fail(error);
    if (plan.value("devices", int64_t(0)) != cluster.numDevices())
      return fail(compilePlan + " is a plan for " + std::to_string(plan.value("devices", int64_t(0))) +
                  " devices but --cluster " + compileCluster + " has " +
                  std::to_string(cluster.numDevices()));
    if (plan.value("batch", int64_t(0)) != compileBatch)
      return fail(compilePlan + " is a plan for batch " + std::to_string(plan.value("batch", int64_t(0))) +
                  "; compile with --batch " + std::to_string(plan.value("batch", int64_t(0))));
  } else if (compileServe && !serveObjective.empty() && !force.tp) {
    if (force.dp || force.pp)
      return fail("serving bundles split over tensor parallelism only: leave dp and pp out of --force");
    auto spec = mlir::loom::buildModelSpec(*module, llvm::sys::path::stem(compileInput));
    if (failed(spec))
      return 1;
    int64_t seq = 0;
    for (const auto &l : spec->layers)
      seq = std::max<int64_t>(seq, int64_t(l.seq));
    ::loom::planner::ServePlan sp = ::loom::planner::planServing(
        *spec, cluster, serveMaxBatch, serveMaxSeq > 0 ? int64_t(serveMaxSeq) : seq, serveObjective);
    if (!sp.found)
      return fail(sp.error);
    llvm::outs() << ::loom::planner::describeServePlan(sp, cluster) << "\n";
    plan = tensorParallelOnly(sp.tp, sp.tp);
  } else if (!compileTrain && (cluster.numDevices() > 1 || !compileForce.empty())) {
    // Inference splits over tensor parallelism only; the planner's costs are a training step's.
    if (!force.tp || *force.tp != cluster.numDevices() || force.dp.value_or(1) != 1 ||
        force.pp.value_or(1) != 1)
      return fail("inference bundles split over tensor parallelism: give --force tp=" +
                  std::to_string(cluster.numDevices()) + " for --cluster " + compileCluster +
                  (compileServe ? std::string(", or let the planner choose with --objective latency|throughput")
                                : std::string()) +
                  " (data and pipeline parallelism apply to training bundles, --train)");
    plan = tensorParallelOnly(cluster.numDevices(), *force.tp);
  } else if (cluster.numDevices() > 1 || !compileForce.empty()) {
    auto spec = mlir::loom::buildModelSpec(*module, llvm::sys::path::stem(compileInput));
    if (failed(spec))
      return 1;
    ::loom::planner::CostOptions costs;
    costs.precision = precision; // the memory predicted is the bundle's
    costs.gradReduceBf16 = gradReduceBf16;
    // The CUDA runtime's deferred sums need the bf16 gradients of --grad-reduce wide (auto: --target cuda).
    costs.peerDeferredSums = trainGradReduce == "wide" || (trainGradReduce == "auto" && cuda);
    costs.lossGradientInPlace = compileFuse || cuda;
    costs.accumulateInProducts = compileFuse || cuda; // loom-accumulate-in-products runs with --fuse
    ::loom::planner::Planner planner(*spec, cluster, costs);
    ::loom::planner::PlanResult result = planner.search(compileBatch, force);
    if (!result.found)
      return fail(result.error);
    plan = ::loom::planner::planToJson(result.best, *spec, cluster, compileBatch);
  }
  auto degree = [&](const char *key) { return plan.value(key, int64_t(1)); };
  int64_t dp = degree("dp"), tp = degree("tp"), pp = degree("pp");

  mlir::loom::BundleOptions options;
  options.batch = compileBatch;
  options.seed = compileSeed;
  options.weightsFile = compileWeights;
  options.train = compileTrain;
  options.bf16 = precision == ::loom::planner::Precision::Bf16;
  options.noWeights = compileNoWeights;
  options.fuse = compileFuse || cuda;
  for (const std::string &name : compileSkipPass) {
    if (!mlir::loom::isSkippablePass(name))
      return fail("--skip-pass " + name + ": only optional rewrites can be left out (" +
                  mlir::loom::skippablePasses() + ")");
    options.skipPasses.insert(name);
  }
  if (!compileLayout.empty() && compileLayout != "nchw" && compileLayout != "nhwc")
    return fail("--layout must be nchw or nhwc, got '" + compileLayout + "'");
  options.nhwc = compileLayout.empty() ? cuda : compileLayout == "nhwc";
  options.dataParallel = dp;
  options.tensorParallel = tp;
  options.pipelineParallel = pp;
  options.virtualStages = degree("vpp");
  options.microbatches = degree("microbatches");
  options.schedule = plan.value("schedule", std::string("1f1b"));
  // A forced zero=1 must hold (and fails on one replica); the planner's
  // choice only applies where there are replicas to share the state.
  options.zero1 = force.zero ? *force.zero >= 1 : degree("zero") >= 1 && dp > 1;
  int64_t zeroStage = force.zero ? *force.zero : degree("zero");
  options.zero2 = options.zero1 && zeroStage >= 2;
  options.zero3 = options.zero1 && zeroStage == 3;
  options.gradReduceBf16 = gradReduceBf16;
  // auto: wide where the CUDA runtime reduces over peer memory (a two-rank
  // data-parallel group in one process, which a group within a node is
  // under loom-run's default of one thread a GPU; ZeRO reduces slices, not
  // buckets). Two H200s, GPT-2 350M dp2: 42.2-42.6 ms a step against
  // 42.5-42.9 with f32 products (2026-11-30).
  bool oneNode = cluster.devicesPerNode >= dp * tp * pp;
  options.gradReduceWide =
      trainGradReduce == "wide" || (trainGradReduce == "auto" && cuda && compileTrain && options.bf16 && dp == 2 &&
                                    !options.zero1 && oneNode);
  if (!(trainBucketMb >= 0 && trainBucketMb <= 65536))
    return fail("--bucket-mb must be from 0 (the default: chosen from the gradients' size) to 65536 (MiB), got " +
                std::to_string(trainBucketMb));
  options.bucketBytes = trainBucketMb > 0 ? std::max<int64_t>(1, int64_t(trainBucketMb * 1048576.0)) : 0;
  options.sequenceParallel = compileTrain && tp > 1 && plan.value("sequence_parallel", false);
  options.tpOverlap = trainTpOverlap;
  options.plan = plan;
  if (pp > 1)
    options.chunkUnits = ::loom::planner::planChunkUnits(plan);
  if (plan.value("recompute", std::string("none")) == "full")
    options.training.recompute.insert("all");
  options.training.optimizer = trainOptimizer;
  options.training.lr = trainLr, options.training.minLr = trainMinLr;
  options.training.warmup = trainWarmup, options.training.totalSteps = trainTotal;
  options.training.beta1 = trainBeta1, options.training.beta2 = trainBeta2;
  options.training.eps = trainEps, options.training.weightDecay = trainDecay;
  options.training.momentum = trainMomentum, options.training.clip = trainClip;
  options.training.recompute.insert(trainRecompute.begin(), trainRecompute.end());
  options.serve.enabled = compileServe;
  options.serve.maxBatch = serveMaxBatch, options.serve.maxSeq = serveMaxSeq;
  options.serve.blockSize = serveBlockSize, options.serve.kvBlocks = serveKvBlocks;
  options.serve.prefillChunk = servePrefillChunk;
  options.serve.weightLayout = serveWeightLayout;
  llvm::StringRef stem = llvm::sys::path::stem(compileInput);
  options.modelName = stem.str();
  options.tokenizerFile = compileTokenizer;
  if (auto named = (*module)->getAttrOfType<StringAttr>("loom.tokenizer");
      named && compileTokenizer.empty()) { // a file beside the model
    llvm::SmallString<256> path(llvm::sys::path::parent_path(compileInput));
    llvm::sys::path::append(path, named.getValue());
    options.tokenizerFile = path.str().str();
  }
  ::loom::rt::Manifest manifest;
  if (failed(mlir::loom::writeBundle(*module, options, compileOutput, &manifest)))
    return 1;
  const auto &rank = manifest.ranks.front();
  size_t instructions = 0;
  for (const auto &[name, program] : rank.programs)
    instructions += program.size();
  int64_t paramBytes = 0;
  for (const auto &p : rank.params)
    paramBytes += rank.buffers[p.buffer].bytes;
  if (manifest.ranks.size() > 1)
    llvm::outs() << "plan: dp " << dp << " x tp " << tp << " x pp " << pp
                 << (options.virtualStages > 1 ? " x vpp " + std::to_string(options.virtualStages) : "")
                 << ", " << options.microbatches << " microbatch(es), schedule " << options.schedule
                 << (options.zero3 ? ", ZeRO-3" : options.zero2 ? ", ZeRO-2" : options.zero1 ? ", ZeRO-1" : "")
                 << (options.sequenceParallel ? ", sequence parallel" : "") << "; " << manifest.ranks.size()
                 << " ranks (rank 0 below)\n";
  llvm::outs() << "wrote " << compileOutput << ": " << instructions << " instructions, "
               << rank.params.size() << " parameter tensors ("
               << llvm::format("%.1f", paramBytes / 1048576.0) << " MiB), peak activation memory "
               << llvm::format("%.1f", rank.peakActivationBytes / 1048576.0)
               << " MiB, arena " << llvm::format("%.1f", rank.arenaBytes / 1048576.0)
               << " MiB (batch " << compileBatch << (compileTrain ? ", training step" : "") << ")\n";
  if (manifest.serve.enabled()) {
    const ::loom::rt::ServeConfig &sv = manifest.serve;
    int64_t cacheBytes = 0;
    for (const auto &b : rank.buffers)
      if (b.role == ::loom::rt::BufferRole::Cache && b.name.find("_cache") != std::string::npos)
        cacheBytes += b.bytes;
    llvm::outs() << "serving: " << sv.programs.size() << " step programs of " << sv.programs.front().tokens
                 << " to " << sv.programs.back().tokens << " tokens; key/value cache of " << sv.numBlocks
                 << " blocks of " << sv.blockSize << " tokens ("
                 << llvm::format("%.1f", cacheBytes / 1048576.0) << " MiB); max batch " << sv.maxBatch
                 << ", max sequence " << sv.maxSeq << "\n";
  }
  // What the compiler's rewrites did to rank 0, read back from its programs.
  int64_t packed = 0, epilogues = 0, fused = 0, rowKernels = 0, normGrads = 0, bf16Grads = 0, lossGrads = 0, tpOverlapped = 0;
  int64_t summedInProducts = 0, gathersOverlapped = 0, reducesInHalves = 0;
  std::map<std::string, int64_t> epilogueKinds;
  std::set<std::string> adamKernels;
  // f32 results of products of bf16 operands (loom-reduce-from-products
  // and the microbatches' first products write them), and how many of them
  // a data-parallel bucket reduces in place.
  std::set<int64_t> f32Products;
  int64_t reducedFromProducts = 0, gatheredRows = 0;
  for (const auto &[name, program] : rank.programs)
    for (const auto &ins : program)
      if (ins.op == "matmul" && !ins.in.empty() && !ins.out.empty() &&
          rank.buffers[ins.in[0]].dtype == LOOM_BF16 && rank.buffers[ins.out[0]].dtype == LOOM_F32)
        f32Products.insert(ins.out[0]);
  for (const auto &[name, program] : rank.programs)
    for (const auto &ins : program) {
      packed += ins.op == "attention" && ins.attrs.contains("packed");
      if (ins.op == "matmul" && ins.attrs.contains("epilogue"))
        ++epilogues, ++epilogueKinds[ins.attrs.value("epilogue", std::string("?"))];
      fused += ins.op == "fused";
      if (ins.op == "all_reduce" && ins.attrs.is_object() && ins.attrs.value("group", std::string()) == "dp")
        for (size_t k = 0; k < ins.in.size() && k < ins.out.size(); ++k)
          reducedFromProducts += ins.in[k] == ins.out[k] && f32Products.count(ins.in[k]);
      summedInProducts += ins.op == "matmul" && !ins.in.empty() && !ins.out.empty() && ins.in.back() == ins.out[0];
      lossGrads += ins.op == "cross_entropy" && ins.out.size() == 2;
      gatheredRows += name == "update" && ins.op == "embedding_grad";
      // A layer's reduction beside the weight gradients: x -> y of one dtype
      // (sequence parallelism's gradient-sum buckets, async too, reduce in
      // place or widen).
      bool layerReduce = (ins.op == "reduce_scatter" && ins.attrs.is_object() && ins.attrs.contains("axis")) ||
                         (ins.op == "all_reduce" && ins.in.size() == 1 && ins.out.size() == 1 &&
                          ins.in[0] != ins.out[0] && rank.buffers[ins.in[0]].dtype == rank.buffers[ins.out[0]].dtype);
      // A half of a row-parallel product's sum (loom-split-tensor-reduce): a
      // slice of the product's result.
      bool half = ins.op == "all_reduce" && ins.in.size() == 1 &&
                  rank.buffers[ins.in[0]].bytes < rank.buffers[::loom::rt::storageOf(rank, ins.in[0])].bytes;
      bool asyncTp = ins.attrs.is_object() && ins.attrs.value("async", false) &&
                     ins.attrs.value("group", std::string()) == "tp";
      tpOverlapped += layerReduce && asyncTp && !half;
      reducesInHalves += half && asyncTp && rank.buffers[ins.in[0]].viewOffset == 0;
      gathersOverlapped += ins.op == "all_gather" && ins.attrs.is_object() && ins.attrs.value("async", false) &&
                           ins.attrs.value("group", std::string()) == "tp" && ins.attrs.contains("axis");
      bool generated = ins.op != "fused" && ins.attrs.is_object() && ins.attrs.contains("kernel");
      bool normGrad = ins.op == "layernorm_grad" || ins.op == "rmsnorm_grad";
      rowKernels += generated && ins.op != "adamw" && !normGrad;
      normGrads += generated && normGrad;
      if (generated && ins.op == "adamw")
        adamKernels.insert(ins.attrs.value("kernel", std::string()));
    }
  for (const auto &p : rank.params)
    bf16Grads += p.grad >= 0 && rank.buffers[p.grad].dtype == LOOM_BF16;
  std::vector<std::string> notes;
  if (packed)
    notes.push_back(std::to_string(packed) + " attention(s) read q|k|v in place");
  if (bf16Grads)
    notes.push_back(std::to_string(bf16Grads) + " of " + std::to_string(rank.params.size()) +
                    " gradients reach the optimizer in bf16");
  if (epilogues) {
    std::string kinds;
    for (const auto &[kind, n] : epilogueKinds)
      kinds += (kinds.empty() ? "" : ", ") + std::to_string(n) + " " + kind;
    notes.push_back(std::to_string(epilogues) + " GEMM epilogue(s) (" + kinds + ")");
  }
  if (fused)
    notes.push_back(std::to_string(fused) + " generated kernel(s)");
  if (rowKernels)
    notes.push_back(std::to_string(rowKernels) + " row kernel(s) generated (norms, softmax, cross-entropy)");
  if (normGrads)
    notes.push_back(std::to_string(normGrads) + " norm gradient(s) generated");
  if (lossGrads)
    notes.push_back(std::to_string(lossGrads) + " loss(es) write their gradient over the logits");
  if (tpOverlapped)
    notes.push_back(std::to_string(tpOverlapped) + " tensor-parallel reduction(s) beside the weight gradients");
  if (reducesInHalves)
    notes.push_back(std::to_string(reducesInHalves) + " tensor-parallel sum(s) in two halves beside their product");
  if (gathersOverlapped)
    notes.push_back(std::to_string(gathersOverlapped) + " tensor-parallel gather(s) beside their product's own rows");
  if (summedInProducts)
    notes.push_back(std::to_string(summedInProducts) + " microbatch gradient(s) added into their sums by their products");
  if (reducedFromProducts)
    notes.push_back(std::to_string(reducedFromProducts) +
                    " weight gradient(s) written in f32 by their products and reduced in place");
  if (options.gradReduceWide) {
    int64_t widened = 0; // bf16 gradients a data-parallel bucket sums into f32 means
    for (const auto &[name, program] : rank.programs)
      for (const auto &ins : program)
        if (ins.op == "all_reduce" && ins.attrs.is_object() && ins.attrs.value("group", std::string("dp")) == "dp")
          for (size_t k = 0; k < ins.in.size() && k < ins.out.size(); ++k)
            widened += rank.buffers[ins.in[k]].dtype == LOOM_BF16 && rank.buffers[ins.out[k]].dtype == LOOM_F32;
    notes.push_back(std::to_string(widened) + " bf16 gradient(s) summed into f32 means (--grad-reduce wide: "
                    "as bf16 over peer memory)");
  }
  if (gatheredRows)
    notes.push_back(std::to_string(gatheredRows) +
                    " embedding gradient(s) from the replicas' gathered rows, not reduced whole");
  if (!adamKernels.empty())
    notes.push_back("AdamW in " + std::to_string(adamKernels.size()) + " generated kernel(s)");
  if (!notes.empty()) {
    llvm::outs() << "rewrites: ";
    for (size_t i = 0; i < notes.size(); ++i)
      llvm::outs() << (i ? ", " : "") << notes[i];
    llvm::outs() << "\n";
  }
  return 0;
}

int runPlan() {
  if (planBatch < 0)
    return fail("--batch must be positive (or 0: 8 examples per device), got " +
                std::to_string(planBatch));
  ::loom::planner::Cluster cluster;
  std::string error;
  if (!::loom::planner::parseCluster(planCluster, cluster, error))
    return fail(error);
  ::loom::planner::Constraints constraints;
  if (!::loom::planner::parseConstraints(planForce, constraints, error))
    return fail(error);
  ::loom::planner::CostOptions costs;
  costs.materializedAttention = planMaterialized;
  // GPUs run the CUDA target's fused step, whose loss writes its gradient
  // over the logits; a CPU cluster's bundles are compiled without --fuse.
  costs.lossGradientInPlace = cluster.device.name != "cpu";
  costs.accumulateInProducts = cluster.device.name != "cpu";
  if (!::loom::planner::parsePrecision(planPrecision, costs.precision))
    return fail("--precision must be f32 or bf16, got '" + planPrecision + "'");
  if (!parseGradReduce(planGradReduce, costs.gradReduceBf16))
    return fail("--grad-reduce must be auto, f32, wide or bf16, got '" + planGradReduce + "'");
  costs.peerDeferredSums = planGradReduce != "f32" && cluster.device.name != "cpu";
  if (costs.gradReduceBf16 && costs.precision != ::loom::planner::Precision::Bf16)
    return fail("--grad-reduce bf16 averages bf16 gradients: it needs --precision bf16");
  if (!planProfile.empty() && !::loom::planner::loadProfile(planProfile, costs, cluster, error))
    return fail(error);

  auto model = parseModelFile(planInput);
  if (!model)
    return 1;
  OwningOpRef<ModuleOp> &module = model->module;
  auto spec = mlir::loom::buildModelSpec(*module, llvm::sys::path::stem(planInput));
  if (failed(spec))
    return 1;
  // The profiled model's own spec, where the profile measured another model.
  if (!costs.profileModel.empty() && costs.profileModel != spec->name) {
    std::string path = planProfileModel;
    if (path.empty())
      for (llvm::SmallString<256> candidate : {llvm::SmallString<256>("models"),
                                               llvm::SmallString<256>(llvm::sys::path::parent_path(planInput))}) {
        llvm::sys::path::append(candidate, costs.profileModel + ".mlir");
        if (llvm::sys::fs::exists(candidate)) {
          path = std::string(candidate);
          break;
        }
      }
    if (!path.empty()) {
      auto profiled = parseModelFile(path);
      if (!profiled)
        return 1;
      auto profiledSpec = mlir::loom::buildModelSpec(*profiled->module, llvm::sys::path::stem(path));
      if (failed(profiledSpec))
        return 1;
      if (profiledSpec->name != costs.profileModel)
        return fail("--profile-model " + path + " is " + profiledSpec->name + " but " + planProfile + " measured " +
                    costs.profileModel);
      costs.profileSpec = std::make_shared<::loom::planner::ModelSpec>(std::move(*profiledSpec));
    }
  } else if (!planProfileModel.empty()) {
    llvm::errs() << "loomc plan: note: --profile-model is not needed: the profile measured this model\n";
  }
  int64_t batch = planBatch > 0 ? planBatch : 8 * cluster.numDevices();
  ::loom::planner::Planner planner(*spec, cluster, costs);
  ::loom::planner::PlanResult result = planner.search(batch, constraints);
  if (!result.found)
    return fail(result.error);
  llvm::outs() << ::loom::planner::explainPlan(result, *spec, cluster, batch);
  const std::string &calibration = planner.costs().calibration;
  if (!calibration.empty())
    llvm::outs() << "  calibrated       " << calibration << "\n";
  if (!planJson.empty()) {
    nlohmann::json doc = ::loom::planner::planToJson(result.best, *spec, cluster, batch);
    if (!calibration.empty())
      doc["calibration"] = calibration;
    // What compile --plan checks the model against besides its name and
    // layers (kept out of planToJson: --force plans go into the manifest).
    doc["model_parameters"] = static_cast<int64_t>(spec->totalParams);
    nlohmann::json alternatives = nlohmann::json::array();
    for (const auto &alt : result.alternatives)
      alternatives.push_back({{"plan", alt.shortName()},
                              {"feasible", alt.feasible},
                              {"reason", alt.reason},
                              {"step_ms", alt.stepTime * 1e3}});
    doc["rejected"] = alternatives;
    std::string text = doc.dump(1);
    try {
      ::loom::rt::writeFileAtomically(planJson, text.data(), text.size());
    } catch (const std::exception &e) {
      return fail(e.what());
    }
    llvm::outs() << "wrote " << planJson << "\n";
  }
  return 0;
}

int runInspect() {
  if (llvm::sys::fs::is_directory(inspectInput))
    return ::loom::tools::inspectBundle(inspectInput);
  return ::loom::tools::inspectPlan(inspectInput, inspectSvg);
}

int runModels() {
  mlir::loom::ModelConfig config;
  config.family = family;
  config.layers = layers, config.hidden = hidden, config.heads = heads;
  config.kvHeads = kvHeads, config.ffn = ffn, config.vocab = vocab, config.seq = seq;
  config.inputs = inputs, config.classes = classes, config.image = image;
  config.dtype = dtype;
  std::string error = mlir::loom::applyDefaults(config), text;
  if (!error.empty() || !mlir::loom::writeModel(config, text, error))
    return fail(error);

  // Never write a file that does not verify.
  MLIRContext context;
  loadDialects(context);
  std::string diagnostics;
  {
    llvm::raw_string_ostream os(diagnostics);
    ScopedDiagnosticHandler handler(&context, [&](Diagnostic &d) {
      os << d.getLocation() << ": " << d << "\n";
      return success();
    });
    if (!parseSourceString<ModuleOp>(text, &context))
      return fail("internal error: the generated model does not verify:\n" + diagnostics);
  }

  std::string message;
  auto out = openOutputFile(modelOutput, &message);
  if (!out)
    return fail("cannot write '" + modelOutput + "': " + message);
  out->os() << text;
  out->keep();
  return 0;
}
int runImport() {
  mlir::loom::ImportOptions options;
  options.dir = importDir;
  while (options.dir.size() > 1 && options.dir.back() == '/')
    options.dir.pop_back();
  options.modelPath = importOutput.empty()
                          ? llvm::sys::path::filename(options.dir).str() + ".mlir"
                          : std::string(importOutput);
  llvm::SmallString<256> weights(options.modelPath);
  llvm::sys::path::replace_extension(weights, ".safetensors");
  options.weightsPath = importWeights.empty() ? weights.str().str() : std::string(importWeights);
  options.dtype = importDtype;
  options.seq = importSeq;
  options.tokenizer = !importNoTokenizer;
  mlir::loom::ImportResult r = mlir::loom::importHfCheckpoint(options);
  const mlir::loom::ModelConfig &c = r.config;
  llvm::outs() << "imported " << options.dir << " (" << r.architecture << "): " << c.layers
               << " layers, hidden " << c.hidden << ", " << c.heads << " heads"
               << (c.family == "llama" ? " (" + std::to_string(c.kvHeads) + " key/value)" : "")
               << ", vocabulary " << c.vocab << ", sequence " << c.seq << "\n"
               << "wrote " << options.modelPath << " and " << options.weightsPath << " ("
               << r.tensors << " tensors, " << llvm::format("%.1f", r.bytes / 1048576.0) << " MiB "
               << c.dtype << ")";
  if (!r.tokenizerPath.empty())
    llvm::outs() << "; tokenizer " << r.tokenizerPath;
  llvm::outs() << "\n";
  return 0;
}

int runExport() {
  mlir::loom::ExportOptions options;
  options.outDir = exportTo;
  if (llvm::sys::fs::is_directory(exportInput)) {
    if (!exportBundle.empty())
      return fail("--bundle is for exporting a checkpoint file; " + exportInput + " is a bundle");
    options.bundleDir = exportInput;
  } else {
    if (exportBundle.empty())
      return fail(exportInput + " is a checkpoint: give the bundle it was trained with, "
                  "--bundle DIR (its model's heads and constants)");
    options.bundleDir = exportBundle;
    options.weightsPath = exportInput;
  }
  mlir::loom::ModelConfig c = mlir::loom::exportHfCheckpoint(options);
  llvm::outs() << "wrote " << exportTo << ": config.json ("
               << (c.family == "gpt" ? "GPT2LMHeadModel" : "LlamaForCausalLM") << ", " << c.layers
               << " layers) and model.safetensors (" << c.dtype << ")\n";
  return 0;
}
} // namespace

int main(int argc, char **argv) {
  llvm::InitLLVM init(argc, argv);
  cl::HideUnrelatedOptions({&zooCategory, &trainCategory, &cl::getGeneralCategory()});
  // LLVM registers hundreds of its own options (codegen, AMDGPU, ...) at the
  // top level, where loomc has none: `loomc --help` lists the subcommands
  // only, and each subcommand's --help its own options.
  for (auto &[name, option] : cl::getRegisteredOptions(cl::SubCommand::getTopLevel()))
    if (!name.starts_with("help") && name != "version")
      option->setHiddenFlag(cl::ReallyHidden);
  cl::ParseCommandLineOptions(
      argc, argv,
      "Loom: compile neural networks written in the loom dialect and plan them over GPUs.\n\n"
      "  loomc verify MODEL.mlir\n"
      "  loomc plan MODEL.mlir --cluster C [--batch B] [--force dp=2,tp=2,...] [--json F]\n"
      "  loomc inspect PLAN.json|OUT.loom [--svg F]\n"
      "  loomc compile MODEL.mlir [--train] [--batch N] [--seed S] [--weights F] -o OUT.loom\n"
      "  loomc models gpt|llama|bert|mlp|resnet [--layers L --hidden H ...] [-o MODEL.mlir]\n"
      "  loomc import HF_DIR [-o MODEL.mlir] [--weights F] [--dtype f32|bf16] [--seq S]\n"
      "  loomc export BUNDLE|CHECKPOINT [--bundle B] --to HF_DIR\n\n"
      "Run 'loomc SUBCOMMAND --help' for the options of each.\n");
  // Every failure is an error message and exit 1; an exception that got
  // this far (a library's, or a bug) must not end in std::terminate.
  try {
    if (verifyCmd)
      return runVerify();
    if (modelsCmd)
      return runModels();
    if (compileCmd)
      return runCompile();
    if (planCmd)
      return runPlan();
    if (inspectCmd)
      return runInspect();
    if (importCmd)
      return runImport();
    if (exportCmd)
      return runExport();
  } catch (const std::exception &e) {
    return fail(e.what());
  } catch (...) {
    return fail("an exception that is not a std::exception");
  }
  cl::PrintHelpMessage(false, true);
  return 1;
}
