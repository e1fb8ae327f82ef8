//===- LoomRtDialect.cpp - The lowered step -------------------------------===//

#include "dialects/loomrt/IR/LoomRtDialect.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/OpImplementation.h"

using namespace mlir;
using namespace mlir::loomrt;

#include "dialects/loomrt/IR/LoomRtDialect.cpp.inc"

void LoomRtDialect::initialize() {
  addOperations<
#define GET_OP_LIST
#include "dialects/loomrt/IR/LoomRtOps.cpp.inc"
      >();
}

#define GET_OP_CLASSES
#include "dialects/loomrt/IR/LoomRtOps.cpp.inc"
