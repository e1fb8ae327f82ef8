//===- BackwardReads.cpp - What an op's gradient reads --------------------===//

#include "compiler/BackwardReads.h"
#include "dialects/loom/IR/LoomOps.h"
#include "mlir/IR/Diagnostics.h"

using namespace mlir;
using namespace mlir::loom;

namespace {

bool isFloat(Value v) {
  auto t = dyn_cast<RankedTensorType>(v.getType());
  return t && isa<FloatType>(t.getElementType());
}

/// Handles are the op's operands, its results, their gradients, then what
/// the rule emits. Each remembers the forward value it is (or views), the
/// result whose gradient it is, and the operation that made it.
class Recorder final : public GradientBuilder {
public:
  explicit Recorder(Operation *op) : op(op) {
    for (Value v : op->getOperands())
      make(v, v, -1);
    for (Value r : op->getResults())
      make(r, r, -1);
    for (auto [i, r] : llvm::enumerate(op->getResults()))
      make(r, Value(), int(i));
  }

  BackwardReadSet finish() {
    for (const Made &m : made)
      if (m.weight && !m.other)
        for (Handle h : m.inputs) {
          if (handles[h].forward && isFloat(handles[h].forward))
            out.weightGradValues.insert(handles[h].forward);
          else if (handles[h].gradOf >= 0)
            out.weightGradOf.insert(op->getResult(handles[h].gradOf));
        }
    for (Value r : op->getResults())
      if (isFloat(r) && !r.getDefiningOp<GetOp>())
        out.largestGrad = std::max(out.largestGrad, double(cast<ShapedType>(r.getType()).getNumElements()));
    return std::move(out);
  }

  Handle operand(unsigned i) override { return i; }
  Handle result(unsigned i) override { return op->getNumOperands() + i; }
  Handle resultGrad(unsigned i) override {
    return isFloat(op->getResult(i)) ? op->getNumOperands() + op->getNumResults() + i : -1;
  }
  bool needsGrad(unsigned i) override { return i < op->getNumOperands() && isFloat(op->getOperand(i)); }
  void addGrad(unsigned i, Handle g) override {
    bool param = i < op->getNumOperands() && op->getOperand(i).getDefiningOp<GetOp>();
    const Entry &e = handles[g];
    if (e.made >= 0)
      (param ? made[e.made].weight : made[e.made].other) = true;
    else if (param && e.gradOf >= 0) // a bias: its gradient sums the result's
      out.weightGradOf.insert(op->getResult(e.gradOf));
    else if (e.gradOf >= 0 && e.shape == handles[i].shape && op->getOperand(i).hasOneUse())
      out.sameGradient.push_back({op->getOperand(i), op->getResult(e.gradOf)});
  }
  SmallVector<int64_t> shapeOf(Handle h) override { return handles[h].shape; }
  Type elementTypeOf(Handle h) override { return handles[h].type; }
  SmallVector<Handle> emit(StringRef, ArrayRef<Handle> inputs, ArrayRef<Handle> likes,
                           ArrayRef<NamedAttribute>) override {
    int64_t by = read(inputs);
    SmallVector<Handle> results;
    for (Handle like : likes)
      results.push_back(make(SmallVector<int64_t>(handles[like].shape), handles[like].type, {}, -1, by));
    return results;
  }
  Handle emitShaped(StringRef, ArrayRef<Handle> inputs, ArrayRef<int64_t> shape,
                    ArrayRef<NamedAttribute>) override {
    int64_t by = read(inputs);
    return make(SmallVector<int64_t>(shape), handles[inputs.front()].type, {}, -1, by);
  }
  Handle view(Handle h, ArrayRef<int64_t> shape) override {
    Entry e = handles[h];
    return make(SmallVector<int64_t>(shape), e.type, e.forward, e.gradOf, e.made);
  }
  MLIRContext *getContext() override { return op->getContext(); }

private:
  struct Entry {
    SmallVector<int64_t> shape;
    Type type;
    Value forward;     // the forward value it is
    int gradOf = -1;   // the result whose gradient it is
    int64_t made = -1; // the emitted operation that made it
  };
  /// An emitted operation: a weight-gradient product when its results only
  /// become parameter gradients.
  struct Made {
    SmallVector<Handle> inputs;
    bool weight = false, other = false;
  };

  Handle make(Value v, Value forward, int gradOf) {
    auto t = cast<ShapedType>(v.getType());
    return make(SmallVector<int64_t>(t.getShape()), t.getElementType(), forward, gradOf, -1);
  }
  Handle make(SmallVector<int64_t> shape, Type type, Value forward, int gradOf, int64_t by) {
    handles.push_back({std::move(shape), type, forward, gradOf, by});
    return static_cast<Handle>(handles.size() - 1);
  }
  int64_t read(ArrayRef<Handle> inputs) {
    for (Handle h : inputs) {
      if (h < 0)
        continue;
      if (handles[h].forward && isFloat(handles[h].forward)) // not token ids: inputs
        out.values.insert(handles[h].forward);
      if (handles[h].made >= 0) // read by another step of the rule: not only a parameter's
        made[handles[h].made].other = true;
    }
    made.push_back({SmallVector<Handle>(inputs), false, false});
    return static_cast<int64_t>(made.size() - 1);
  }

  Operation *op;
  std::vector<Entry> handles;
  std::vector<Made> made;
  BackwardReadSet out;
};

} // namespace

BackwardReadSet mlir::loom::backwardReads(Operation *op) {
  auto rule = dyn_cast<DifferentiableOpInterface>(op);
  if (!rule)
    return {};
  Recorder recorder(op);
  // A rule with no gradient for this op says so as a diagnostic; whether the
  // model trains is for compile to say, not the planner.
  ScopedDiagnosticHandler quiet(op->getContext(), [](Diagnostic &) { return success(); });
  if (failed(rule.buildGradient(recorder)))
    return {};
  return recorder.finish();
}
