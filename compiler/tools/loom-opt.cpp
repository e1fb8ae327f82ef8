//===- loom-opt.cpp - mlir-opt with the loom dialect and passes -----------===//

#include "compiler/Pipeline.h"
#include "dialects/loom/IR/LoomDialect.h"
#include "dialects/loomrt/IR/LoomRtDialect.h"
#include "mlir/Dialect/Func/Extensions/InlinerExtension.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "mlir/Transforms/Passes.h"
#include "passes/Passes.h"

int main(int argc, char **argv) {
  mlir::DialectRegistry registry;
  registry.insert<mlir::loom::LoomDialect, mlir::loomrt::LoomRtDialect, mlir::func::FuncDialect>();
  mlir::func::registerInlinerExtension(registry);
  mlir::loom::registerLoomPasses();
  mlir::loom::registerCompilePipeline();
  mlir::registerTransformsPasses();
  return mlir::asMainReturnCode(
      mlir::MlirOptMain(argc, argv, "Loom optimizer driver\n", registry));
}
