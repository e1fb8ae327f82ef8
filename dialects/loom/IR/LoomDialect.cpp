//===- LoomDialect.cpp - The loom dialect ---------------------------------===//

#include "dialects/loom/IR/LoomDialect.h"
#include "dialects/loom/IR/LoomOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/Transforms/InliningUtils.h"

using namespace mlir;
using namespace mlir::loom;

#include "dialects/loom/IR/LoomDialect.cpp.inc"

namespace {
/// Every loom op is a pure function of its operands and reads parameters by
/// symbol, so any of them may be inlined (for example when `@loss` calls
/// `@forward`).
struct LoomInlinerInterface : public DialectInlinerInterface {
  using DialectInlinerInterface::DialectInlinerInterface;
  bool isLegalToInline(Operation *, Operation *, bool) const final { return true; }
  bool isLegalToInline(Region *, Region *, bool, IRMapping &) const final { return true; }
  bool isLegalToInline(Operation *, Region *, bool, IRMapping &) const final { return true; }
};
} // namespace

void LoomDialect::initialize() {
  addOperations<
#define GET_OP_LIST
#include "dialects/loom/IR/LoomOps.cpp.inc"
      >();
  registerAttributes();
  addInterfaces<LoomInlinerInterface>();
}

LogicalResult LoomDialect::verifyOperationAttribute(Operation *op, NamedAttribute attr) {
  StringRef name = attr.getName().getValue();
  if (name == "loom.mesh") {
    if (!isa<MeshAttr>(attr.getValue()))
      return op->emitError() << "'loom.mesh' must be a #loom.mesh attribute, got "
                             << attr.getValue();
    if (!isa<ModuleOp>(op))
      return op->emitError() << "'loom.mesh' belongs on the module";
    return success();
  }
  if (name == "loom.family" || name == "loom.tokenizer") {
    if (!isa<StringAttr>(attr.getValue()) || !isa<ModuleOp>(op))
      return op->emitError() << "'" << name << "' must be a string on the module";
    return success();
  }
  if (name == "loom.sharding") {
    auto sharding = dyn_cast<ShardingAttr>(attr.getValue());
    if (!sharding)
      return op->emitError() << "'loom.sharding' must be a #loom.sharding attribute, got "
                             << attr.getValue();
    RankedTensorType type;
    if (auto param = dyn_cast<ParamOp>(op))
      type = param.getTensorType();
    else if (op->getNumResults() == 1)
      type = dyn_cast<RankedTensorType>(op->getResult(0).getType());
    if (!type)
      return op->emitError()
             << "'loom.sharding' needs an op with one ranked tensor result or a loom.param";
    auto module = op->getParentOfType<ModuleOp>();
    MeshAttr mesh = module ? module->getAttrOfType<MeshAttr>("loom.mesh") : MeshAttr();
    if (!mesh)
      return op->emitError()
             << "'loom.sharding' needs a 'loom.mesh' attribute on the enclosing module";
    return sharding.verifyFor(mesh, type, [&] { return op->emitError(); });
  }
  if (name == "loom.shard") {
    // Written by loom-partition-tp on a parameter whose type is now this
    // rank's part: {axis, parts, blocks, group} of the full tensor.
    auto dict = dyn_cast<DictionaryAttr>(attr.getValue());
    auto param = dyn_cast<ParamOp>(op);
    if (!dict || !param)
      return op->emitError() << "'loom.shard' must be a dictionary on a loom.param";
    auto axis = dict.getAs<IntegerAttr>("axis"), parts = dict.getAs<IntegerAttr>("parts"),
         blocks = dict.getAs<IntegerAttr>("blocks");
    auto group = dict.getAs<StringAttr>("group");
    if (!axis || !parts || !blocks || !group)
      return op->emitError() << "'loom.shard' needs integer axis, parts and blocks and a string group";
    if (axis.getInt() < 0 || axis.getInt() >= param.getTensorType().getRank() ||
        parts.getInt() < 1 || blocks.getInt() < 1 ||
        param.getTensorType().getDimSize(axis.getInt()) % blocks.getInt() != 0)
      return op->emitError() << "'loom.shard' " << dict << " does not fit " << param.getType();
    return success();
  }
  if (name == "loom.partial_grad") {
    // Written by loom-sequence-parallel: each rank of the group computes
    // part of the parameter's gradient (from its own tokens).
    if (!isa<StringAttr>(attr.getValue()) || !isa<ParamOp>(op))
      return op->emitError() << "'loom.partial_grad' must be a group name (a string) on a loom.param";
    return success();
  }
  // The compile options and plan (loom-configure) on the module.
  if (name == "loom.options" || name == "loom.plan") {
    if (!isa<DictionaryAttr>(attr.getValue()) || !isa<ModuleOp>(op))
      return op->emitError() << "'" << name << "' must be a dictionary on the module";
    return success();
  }
  // Notes the step passes leave for each other on loomrt ops.
  if (name == "loom.layer" || name == "loom.chunk" || name == "loom.view" ||
      name == "loom.source" || name == "loom.loss_stage") {
    if (op->getDialect() == getContext()->getLoadedDialect(getNamespace()) || isa<ModuleOp>(op))
      return op->emitError() << "'" << name << "' is a note on the lowered step (loomrt)";
    return success();
  }
  return op->emitError() << "unknown loom attribute '" << name << "'";
}
