//===- Autodiff.cpp - Reverse mode over the lowered forward pass ----------===//
//
// The loom-autodiff pass: the backward program of a training step, built by
// each op's gradient rule (DifferentiableOpInterface) over buffers.
//
//===----------------------------------------------------------------------===//

#include "dialects/loom/IR/GradientBuilder.h"
#include "dialects/loom/IR/LoomOps.h"
#include "passes/Passes.h"
#include "passes/StepState.h"

namespace mlir::loom {
#define GEN_PASS_DEF_AUTODIFF
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

/// One forward entry as lowering left it: the loom op (a block's op once
/// per layer), its buffers and its layer ("layer.3." or "").
struct Record {
  Operation *op;
  std::vector<int64_t> in, out;
  std::string layer;
};

/// Reverse mode over the lowered forward ops: each op's gradient rule
/// (DifferentiableOpInterface) builds its operands' gradients as backward
/// instructions over buffers.
class Autodiff : public GradientBuilder {
public:
  /// `chunkOf` gives each forward record's pipeline chunk (all 0 without
  /// pipelining): backward instructions are tagged with their record's
  /// chunk, and a parameter used in several chunks gets one gradient per chunk.
  Autodiff(rt::RankProgram &rank, const std::vector<Record> &records, MLIRContext *ctx,
           std::vector<int64_t> chunkOf = {})
      : records(records), rank(rank), ctx(ctx), chunkOf(std::move(chunkOf)) {
    for (const rt::Parameter &p : rank.params)
      isParam.insert(p.buffer);
  }

  LogicalResult run(int64_t loss) {
    // What needs a gradient: parameters and everything computed from them.
    for (const rt::Parameter &p : rank.params)
      needs.insert(p.buffer);
    for (const auto &rec : records) {
      bool any = false;
      for (int64_t id : rec.in)
        any |= needs.count(id) > 0;
      if (any)
        for (int64_t id : rec.out)
          if (isFloat(id))
            needs.insert(id);
    }
    if (!needs.count(loss))
      return emitError(UnknownLoc::get(ctx)) << "the loss does not depend on any parameter";
    chunk = chunkOf.empty() ? 0 : chunkOf.back();
    grads[loss] = emitRaw("fill", {}, {like(loss, "grad.loss")}, {{"value", lossScale}}).front();
    for (auto it = records.rbegin(); it != records.rend(); ++it) {
      current = &*it;
      chunk = chunkOf.empty() ? 0 : chunkOf[records.rend() - it - 1];
      bool hasGrad = false;
      for (int64_t id : current->out)
        hasGrad |= grads.count(id) > 0;
      if (!hasGrad)
        continue;
      auto rule = dyn_cast<DifferentiableOpInterface>(current->op);
      if (!rule)
        return current->op->emitError() << "has no gradient rule, so the loss cannot be "
                                           "differentiated through it";
      if (failed(rule.buildGradient(*this)) || failed(status))
        return failure();
    }
    for (rt::Parameter &p : rank.params)
      for (auto &[key, g] : paramGrads)
        if (key.first == p.buffer && (p.grad < 0 || key.second == 0))
          p.grad = g;
    return success();
  }

  std::vector<rt::Instruction> backward;
  std::vector<int64_t> backwardChunk; // per backward instruction
  /// Gradient of each parameter buffer per chunk that uses it.
  std::map<std::pair<int64_t, int64_t>, int64_t> paramGrads;
  /// Value of the loss gradient's seed: 1, or 1/m when m microbatches'
  /// gradients are summed.
  double lossScale = 1.0;

  // GradientBuilder.
  Handle operand(unsigned i) override { return current->in.at(i); }
  Handle result(unsigned i) override { return current->out.at(i); }
  Handle resultGrad(unsigned i) override {
    auto it = grads.find(current->out.at(i));
    return it == grads.end() ? -1 : it->second;
  }
  bool needsGrad(unsigned i) override { return i < current->in.size() && needs.count(current->in[i]); }
  void addGrad(unsigned i, Handle g) override {
    int64_t target = current->in.at(i);
    g = reduceTo(g, rank.buffers[target].shape);
    // Parameters keep one gradient per chunk, so no chunk reads another's.
    if (isParam.count(target)) {
      auto key = std::make_pair(target, chunk);
      auto it = paramGrads.find(key);
      if (it == paramGrads.end())
        paramGrads[key] = g;
      else
        it->second = emitRaw("add", {it->second, g}, {like(it->second, gradName("sum"))}, {}).front();
      return;
    }
    auto it = grads.find(target);
    if (it == grads.end())
      grads[target] = g;
    else
      it->second = emitRaw("add", {it->second, g}, {like(it->second, gradName("sum"))}, {}).front();
  }
  SmallVector<int64_t> shapeOf(Handle h) override {
    return SmallVector<int64_t>(rank.buffers[h].shape.begin(), rank.buffers[h].shape.end());
  }
  Type elementTypeOf(Handle h) override { return elementType(ctx, rank.buffers[h].dtype); }
  SmallVector<Handle> emit(StringRef op, ArrayRef<Handle> inputs, ArrayRef<Handle> likes,
                           ArrayRef<NamedAttribute> attrs) override {
    std::vector<int64_t> outs;
    for (Handle l : likes)
      outs.push_back(like(l, gradName(op.str())));
    std::vector<int64_t> made = emitRaw(op, inputs, outs, toJson(attrs));
    return SmallVector<Handle>(made.begin(), made.end());
  }
  Handle emitShaped(StringRef op, ArrayRef<Handle> inputs, ArrayRef<int64_t> shape,
                    ArrayRef<NamedAttribute> attrs) override {
    int64_t out = raw(rank.buffers[inputs.front()].dtype, {shape.begin(), shape.end()}, gradName(op.str()));
    return emitRaw(op, inputs, {out}, toJson(attrs)).front();
  }
  Handle view(Handle h, ArrayRef<int64_t> shape) override {
    const rt::Buffer src = rank.buffers[h];
    int64_t id = raw(src.dtype, {shape.begin(), shape.end()}, src.name + ".view");
    if (rank.buffers[id].bytes != src.bytes) {
      status = emitError(UnknownLoc::get(ctx)) << "internal error: a gradient view changes the size";
      return h;
    }
    rank.buffers[id].viewOf = root(h);
    return id;
  }
  MLIRContext *getContext() override { return ctx; }

private:
  /// Gradient buffers carry their layer's prefix ("layer.3.grad.matmul").
  std::string gradName(const std::string &op) const {
    return (current ? current->layer : std::string()) + "grad." + op;
  }
  bool isFloat(int64_t id) const {
    loom_dtype_t t = rank.buffers[id].dtype;
    return t == LOOM_F32 || t == LOOM_F64 || t == LOOM_BF16 || t == LOOM_F16;
  }
  int64_t raw(loom_dtype_t dtype, std::vector<int64_t> shape, const std::string &name) {
    rt::Buffer b;
    b.id = static_cast<int64_t>(rank.buffers.size());
    b.name = name;
    b.dtype = dtype;
    b.shape = std::move(shape);
    b.bytes = rt::numElements(b.shape).value_or(0) * int64_t(rt::dtypeSize(dtype));
    rank.buffers.push_back(b);
    return b.id;
  }
  int64_t like(int64_t h, const std::string &name) {
    return raw(rank.buffers[h].dtype, rank.buffers[h].shape, name);
  }
  json toJson(ArrayRef<NamedAttribute> attrs) {
    json out = json::object();
    for (NamedAttribute a : attrs) {
      FailureOr<json> v = instructionAttr(current->op, a);
      if (failed(v)) {
        status = failure();
        continue;
      }
      out[a.getName().getValue().str()] = *v;
    }
    return out;
  }
  std::vector<int64_t> emitRaw(StringRef op, ArrayRef<Handle> inputs, std::vector<int64_t> outs,
                               json attrs) {
    rt::Instruction ins;
    ins.op = op.str();
    ins.in.assign(inputs.begin(), inputs.end());
    ins.out = outs;
    ins.attrs = std::move(attrs);
    // loom-recompute finds each layer's gradients by this note.
    if (current && !current->layer.empty())
      ins.attrs["loom.layer"] = current->layer;
    backward.push_back(std::move(ins));
    backwardChunk.push_back(chunk);
    return outs;
  }

  /// Sums a gradient over the dimensions its operand was broadcast along.
  Handle reduceTo(Handle g, const std::vector<int64_t> &target) {
    const std::vector<int64_t> &shape = rank.buffers[g].shape;
    if (shape == target)
      return g;
    size_t lead = shape.size() - target.size();
    std::vector<int64_t> axes, kept(shape);
    for (size_t d = 0; d < shape.size(); ++d)
      if (d < lead || (target[d - lead] == 1 && shape[d] != 1)) {
        axes.push_back(static_cast<int64_t>(d));
        kept[d] = 1;
      }
    int64_t summed = raw(rank.buffers[g].dtype, kept, gradName("reduce"));
    emitRaw("reduce_sum", {g}, {summed}, {{"axes", axes}, {"keepdim", true}});
    return view(summed, SmallVector<int64_t>(target.begin(), target.end()));
  }

  int64_t root(int64_t id) const { return rt::storageOf(rank, id); }

  const std::vector<Record> &records;
  rt::RankProgram &rank;
  MLIRContext *ctx;
  const Record *current = nullptr;
  std::map<int64_t, int64_t> grads;
  std::set<int64_t> needs;
  LogicalResult status = success();
  std::vector<int64_t> chunkOf;
  std::set<int64_t> isParam;
  int64_t chunk = 0;
};

/// The op a forward entry came from (its "loom.source" note).
Operation *sourceOp(ModuleOp module, const json &note) {
  if (!note.is_array() || note.size() != 2 || !note[0].is_string() || !note[1].is_number_integer())
    return nullptr;
  Operation *parent = SymbolTable::lookupSymbolIn(module, note[0].get<std::string>());
  if (!parent || parent->getNumRegions() == 0 || parent->getRegion(0).empty())
    return nullptr;
  int64_t index = note[1].get<int64_t>();
  for (Operation &op : parent->getRegion(0).front())
    if (index-- == 0)
      return &op;
  return nullptr;
}

struct AutodiffPass : mlir::loom::impl::AutodiffBase<AutodiffPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<BundleOptions> options = getCompileOptions(module);
    if (failed(options))
      return signalPassFailure();
    bool pipelined = options->pipelineParallel > 1 || options->microbatches > 1;
    auto differentiate = [&](Step &step) -> LogicalResult {
      if (step.ranks.size() != 1 || step.ranks[0].program.outputs.size() != 1)
        return module.emitError() << "loom-autodiff differentiates the one lowered rank of a "
                                     "training step, before loom-distribute-ranks";
      StepRank &sr = step.ranks[0];
      rt::RankProgram &rank = sr.program;
      std::vector<Record> records;
      std::vector<rt::Instruction> forward;
      std::vector<int64_t> chunkOf, forwardChunk;
      for (rt::Instruction &entry : rank.programs["forward"]) {
        Operation *op = sourceOp(module, entry.attrs.value("loom.source", json()));
        if (!op)
          return module.emitError() << "forward entry '" << entry.op
                                    << "' names no op of the model (loom-lower-to-step notes "
                                       "each entry's source when it lowers a training step)";
        bool view = entry.attrs.value("loom.view", false);
        int64_t chunk = entry.attrs.value("loom.chunk", int64_t(0));
        records.push_back({op, entry.in, entry.out, entry.attrs.value("loom.layer", std::string())});
        if (pipelined)
          chunkOf.push_back(chunk);
        if (view)
          continue;
        // The layer note stays for loom-recompute.
        for (const char *note : {"loom.source", "loom.chunk"})
          entry.attrs.erase(note);
        forward.push_back(std::move(entry));
        forwardChunk.push_back(chunk);
      }
      Autodiff autodiff(rank, records, &getContext(), chunkOf);
      autodiff.lossScale = 1.0 / double(options->microbatches);
      if (failed(autodiff.run(rank.outputs[0].buffer)))
        return failure();
      // The pipeline schedule reads each instruction's chunk.
      if (pipelined) {
        for (size_t i = 0; i < forward.size(); ++i)
          forward[i].attrs["loom.chunk"] = forwardChunk[i];
        for (size_t i = 0; i < autodiff.backward.size(); ++i)
          autodiff.backward[i].attrs["loom.chunk"] = autodiff.backwardChunk[i];
      }
      rank.programs["forward"] = std::move(forward);
      rank.programs["backward"] = std::move(autodiff.backward);
      sr.paramGrads = autodiff.paramGrads;
      return success();
    };
    if (failed(updateStep(module, getArgument(), differentiate)))
      return signalPassFailure();
    eraseModel(module);
  }
};

} // namespace
