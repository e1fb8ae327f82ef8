//===- loom-opt.cpp - mlir-opt with the loom dialect and passes -----------===//

#include "compiler/NestingLimit.h"
#include "compiler/Pipeline.h"
#include "dialects/loom/IR/LoomDialect.h"
#include "dialects/loomrt/IR/LoomRtDialect.h"
#include "mlir/Dialect/Func/Extensions/InlinerExtension.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Support/FileUtilities.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "mlir/Transforms/Passes.h"
#include "passes/Passes.h"
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/ToolOutputFile.h"

int main(int argc, char **argv) {
  llvm::InitLLVM init(argc, argv);
  mlir::DialectRegistry registry;
  registry.insert<mlir::loom::LoomDialect, mlir::loomrt::LoomRtDialect, mlir::func::FuncDialect>();
  mlir::func::registerInlinerExtension(registry);
  mlir::loom::registerLoomPasses();
  mlir::loom::registerCompilePipeline();
  mlir::registerTransformsPasses();
  auto [inputFile, outputFile] =
      mlir::registerAndParseCLIOptions(argc, argv, "Loom optimizer driver\n", registry);
  mlir::MlirOptMainConfig config = mlir::MlirOptMainConfig::createFromCLOptions();
  if (config.shouldShowDialects())
    return mlir::asMainReturnCode(mlir::MlirOptMain(argc, argv, inputFile, outputFile, registry));

  // What MlirOptMain does with the file, after the nesting check that keeps
  // its parser on the stack.
  std::string message;
  std::unique_ptr<llvm::MemoryBuffer> input = mlir::openInputFile(inputFile, &message);
  if (!input) {
    llvm::errs() << message << "\n";
    return 1;
  }
  {
    llvm::SourceMgr sourceMgr; // a view of `input` for the error's location
    unsigned buffer = sourceMgr.AddNewSourceBuffer(
        llvm::MemoryBuffer::getMemBuffer(input->getMemBufferRef(), /*RequiresNullTerminator=*/false),
        llvm::SMLoc());
    if (mlir::failed(mlir::loom::checkNesting(sourceMgr, buffer)))
      return 1;
  }
  std::unique_ptr<llvm::ToolOutputFile> output = mlir::openOutputFile(outputFile, &message);
  if (!output) {
    llvm::errs() << message << "\n";
    return 1;
  }
  if (mlir::failed(mlir::MlirOptMain(output->os(), std::move(input), registry, config)))
    return 1;
  output->keep();
  return 0;
}
