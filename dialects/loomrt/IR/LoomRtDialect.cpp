//===- LoomRtDialect.cpp - The lowered step -------------------------------===//

#include "dialects/loomrt/IR/LoomRtDialect.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/OpImplementation.h"

#include "runtime/include/loom/instructions.h" // the runtime's public instruction table

#include <string>
#include <vector>

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

/// Checks the instruction against the table the runtime validates bundles
/// with (runtime/include/loom/instructions.def), so a pass that writes a
/// malformed step fails here rather than when the bundle is loaded.
LogicalResult InstrOp::verify() {
  Operation *op = getOperation();
  if (op->hasAttr("loom.view"))
    return success(); // a reshape's record between passes, not an instruction
  const ::loom::InstructionInfo *info = ::loom::findInstruction(getOp());
  if (!info)
    return emitOpError() << "'" << getOp()
                         << "' is not a runtime instruction (runtime/include/loom/instructions.def)";
  std::vector<std::string> names;
  for (NamedAttribute attr : op->getDiscardableAttrs())
    names.push_back(attr.getName().str());
  std::string problem = ::loom::checkInstruction(*info, getIns().size(), getOuts().size(), names, "loom.");
  if (!problem.empty())
    return emitOpError() << problem;
  return success();
}
