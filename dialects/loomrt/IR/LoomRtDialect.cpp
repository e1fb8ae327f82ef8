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

LogicalResult FusedOp::verify() {
  Block &body = getBody().front();
  if (body.getNumArguments() != getIns().size())
    return emitOpError() << "has " << body.getNumArguments() << " block arguments for "
                         << getIns().size() << " inputs";
  auto yield = cast<YieldOp>(body.getTerminator());
  if (yield.getValues().size() != getOuts().size())
    return emitOpError() << "yields " << yield.getValues().size() << " values for "
                         << getOuts().size() << " outputs";
  for (Operation &op : body.without_terminator())
    if (!isa<StepOp>(op))
      return op.emitOpError() << "is not a loomrt.step: a fused body holds only steps";
  return success();
}

/// A step is an elementwise runtime instruction: one output, checked
/// against the runtime's table like loomrt.instr.
LogicalResult StepOp::verify() {
  const ::loom::InstructionInfo *info = ::loom::findInstruction(getOp());
  if (!info)
    return emitOpError() << "'" << getOp()
                         << "' is not a runtime instruction (runtime/include/loom/instructions.def)";
  std::vector<std::string> names;
  for (NamedAttribute attr : (*this)->getDiscardableAttrs())
    names.push_back(attr.getName().str());
  std::string problem = ::loom::checkInstruction(*info, getArgs().size(), 1, names, "loom.");
  if (!problem.empty())
    return emitOpError() << problem;
  return success();
}
