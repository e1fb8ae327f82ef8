//===- loomc.cpp - The Loom compiler driver -------------------------------===//
//
// loomc verify MODEL.mlir     parse, verify and summarise a model
// loomc models FAMILY ...     write a model file of a family and size
//
//===----------------------------------------------------------------------===//

#include "compiler/ModelSummary.h"
#include "compiler/ModelZoo.h"
#include "dialects/loom/IR/LoomDialect.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Support/FileUtilities.h"
#include "llvm/Support/CommandLine.h"
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

int fail(const llvm::Twine &message) {
  llvm::WithColor::error(llvm::errs(), "loomc") << message << "\n";
  return 1;
}

void loadDialects(MLIRContext &context) {
  context.loadDialect<loom::LoomDialect, func::FuncDialect>();
}

int runVerify() {
  std::string message;
  auto file = openInputFile(verifyInput, &message);
  if (!file)
    return fail("cannot read '" + verifyInput + "': " + message);
  llvm::SourceMgr sourceMgr;
  sourceMgr.AddNewSourceBuffer(std::move(file), llvm::SMLoc());
  MLIRContext context;
  loadDialects(context);
  SourceMgrDiagnosticHandler diagnostics(sourceMgr, &context);
  OwningOpRef<ModuleOp> module = parseSourceFile<ModuleOp>(sourceMgr, &context);
  if (!module)
    return 1;
  FailureOr<loom::ModelSummary> summary = loom::summarizeModel(*module);
  if (failed(summary))
    return 1;
  llvm::outs() << verifyInput << ": ok\n";
  summary->print(llvm::outs());
  return 0;
}

int runModels() {
  loom::ModelConfig config;
  config.family = family;
  config.layers = layers, config.hidden = hidden, config.heads = heads;
  config.kvHeads = kvHeads, config.ffn = ffn, config.vocab = vocab, config.seq = seq;
  config.inputs = inputs, config.classes = classes, config.image = image;
  config.dtype = dtype;
  std::string error = loom::applyDefaults(config), text;
  if (!error.empty() || !loom::writeModel(config, text, error))
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
} // namespace

int main(int argc, char **argv) {
  llvm::InitLLVM init(argc, argv);
  cl::HideUnrelatedOptions({&zooCategory, &cl::getGeneralCategory()});
  cl::ParseCommandLineOptions(
      argc, argv,
      "Loom: compile neural networks written in the loom dialect and plan them over GPUs.\n\n"
      "  loomc verify MODEL.mlir\n"
      "  loomc models gpt|llama|bert|mlp|resnet [--layers L --hidden H ...] [-o MODEL.mlir]\n\n"
      "Run 'loomc SUBCOMMAND --help' for the options of each.\n");
  if (verifyCmd)
    return runVerify();
  if (modelsCmd)
    return runModels();
  cl::PrintHelpMessage(false, true);
  return 1;
}
