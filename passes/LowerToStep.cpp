//===- LowerToStep.cpp - The model's ops as runtime instructions ----------===//
//
// The loom-lower-to-step pass: @forward (or @loss) as one rank's program of
// runtime instructions over buffers, the first stage of the lowered step.
//
//===----------------------------------------------------------------------===//

#include "dialects/loom/IR/LoomOps.h"
#include "dialects/loomrt/IR/LoomRtDialect.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "passes/Passes.h"
#include "passes/StepState.h"

#include "llvm/Support/MemoryBuffer.h"

#include <map>
#include <optional>

namespace mlir::loom {
#define GEN_PASS_DEF_LOWERTOSTEP
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

/// Reads "%tokens" back from the model's source text at a value's location,
/// so that bundle inputs and outputs carry the names the model file gives
/// them. An op's location is its name; its result is the "%name =" before it.
class SourceNames {
public:
  std::string nameOf(Value value) {
    auto loc = dyn_cast<FileLineColLoc>(value.getLoc());
    if (!loc)
      return "";
    const llvm::MemoryBuffer *buffer = bufferFor(loc.getFilename().str());
    if (!buffer)
      return "";
    const char *begin = buffer->getBufferStart(), *end = buffer->getBufferEnd(), *p = begin;
    for (unsigned line = 1; line < loc.getLine() && p < end; ++p)
      if (*p == '\n')
        ++line;
    p += loc.getColumn() - 1;
    if (p >= end)
      return "";
    auto isName = [](char c) { return isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.'; };
    if (*p != '%') {
      const char *q = p;
      while (q > begin && q[-1] == ' ')
        --q;
      if (q == begin || q[-1] != '=')
        return "";
      --q;
      while (q > begin && q[-1] == ' ')
        --q;
      const char *nameEnd = q;
      while (q > begin && isName(q[-1]))
        --q;
      if (q == begin || q[-1] != '%' || q == nameEnd)
        return "";
      p = q - 1;
    }
    std::string name;
    for (++p; p < end && isName(*p); ++p)
      name += *p;
    if (name.empty() || isdigit(static_cast<unsigned char>(name[0])))
      return "";
    return name;
  }

private:
  const llvm::MemoryBuffer *bufferFor(const std::string &file) {
    auto it = buffers.find(file);
    if (it == buffers.end()) {
      auto buf = llvm::MemoryBuffer::getFile(file);
      it = buffers.emplace(file, buf ? std::move(*buf) : nullptr).first;
    }
    return it->second.get();
  }
  std::map<std::string, std::unique_ptr<llvm::MemoryBuffer>> buffers;
};


class Lowerer {
public:
  /// With `notes` (training), every forward entry notes its layer and
  /// source op, and reshapes stay as view records, for autodiff.
  Lowerer(ModuleOp module, bool notes) : module(module), notes(notes) {}

  FailureOr<rt::RankProgram> run(func::FuncOp forward) {
    rank.device = "cpu";
    DenseMap<Value, int64_t> values;
    for (auto [i, arg] : llvm::enumerate(forward.getArguments())) {
      std::string name = names.nameOf(arg);
      if (name.empty())
        name = "input" + std::to_string(i);
      FailureOr<int64_t> id = newBuffer(arg.getType(), name, rt::BufferRole::Input, arg.getLoc());
      if (failed(id))
        return failure();
      values[arg] = *id;
      rank.inputs.push_back({name, *id, 0});
    }
    if (failed(lowerRegion(forward.getBody(), values, "", 0)))
      return failure();
    auto ret = cast<func::ReturnOp>(forward.getBody().front().getTerminator());
    for (auto [i, v] : llvm::enumerate(ret.getOperands())) {
      int64_t id = values.lookup(v);
      std::string name = names.nameOf(v);
      if (name.empty())
        name = "output" + std::to_string(i);
      int64_t root = rootOf(id);
      if (rank.buffers[root].role == rt::BufferRole::Activation)
        rank.buffers[root].role = rt::BufferRole::Output;
      rank.buffers[id].role = rank.buffers[root].role;
      rank.outputs.push_back({name, id, 0});
    }
    for (rt::NamedBuffer &in : rank.inputs)
      if (auto it = indexLimits.find(in.buffer); it != indexLimits.end())
        in.limit = it->second;
    rank.programs["forward"] = std::move(program);
    return std::move(rank);
  }

  /// Parameter buffer -> the group its gradient is summed over (loom.partial_grad).
  const std::map<int64_t, std::string> &partialGrads() const { return partial; }

private:
  int64_t rootOf(int64_t id) const { return rt::storageOf(rank, id); }

  FailureOr<int64_t> newBuffer(Type type, const std::string &name, rt::BufferRole role,
                               Location loc) {
    auto tensor = dyn_cast<RankedTensorType>(type);
    if (!tensor || !tensor.hasStaticShape())
      return emitError(loc) << "cannot lower " << type << ": buffers need static shapes";
    std::optional<loom_dtype_t> dtype = dtypeOf(tensor.getElementType());
    if (!dtype)
      return emitError(loc) << "cannot lower element type " << tensor.getElementType();
    rt::Buffer b;
    b.id = static_cast<int64_t>(rank.buffers.size());
    b.name = name;
    b.dtype = *dtype;
    b.shape.assign(tensor.getShape().begin(), tensor.getShape().end());
    std::optional<int64_t> count = rt::numElements(b.shape);
    if (!count)
      return emitError(loc) << "cannot lower " << type << ": a buffer holds at most 2^48 elements";
    b.bytes = *count * static_cast<int64_t>(rt::dtypeSize(*dtype));
    b.role = role;
    rank.buffers.push_back(b);
    return b.id;
  }

  FailureOr<int64_t> paramBuffer(GetOp get, const std::string &prefix) {
    ParamOp param = get.lookupParam();
    if (!param)
      return get.emitError() << "reads a missing parameter";
    bool perLayer = isa<BlockOp>(param->getParentOp());
    std::string name = (perLayer ? prefix : "") + param.getSymName().str();
    if (auto it = params.find(name); it != params.end())
      return it->second;
    FailureOr<int64_t> id = newBuffer(param.getType(), name, rt::BufferRole::Param, param.getLoc());
    if (failed(id))
      return failure();
    InitAttr init = param.getInit();
    rt::Parameter p{name, *id,
                    rt::ParamInit{stringifyInitKind(init.getKind()).str(),
                                  init.getScale().convertToDouble()}};
    if (auto shard = param->getAttrOfType<DictionaryAttr>("loom.shard")) {
      // This rank's part of a tensor-parallel split; the index is the rank's.
      p.shard.axis = shard.getAs<IntegerAttr>("axis").getInt();
      p.shard.parts = shard.getAs<IntegerAttr>("parts").getInt();
      p.shard.blocks = shard.getAs<IntegerAttr>("blocks").getInt();
      p.shard.fullShape = rank.buffers[*id].shape;
      p.shard.fullShape[p.shard.axis] *= p.shard.parts;
    }
    if (auto group = param->getAttrOfType<StringAttr>("loom.partial_grad"))
      partial[*id] = group.str(); // sequence parallelism: summed over the group
    rank.params.push_back(p);
    params[name] = *id;
    return *id;
  }

  LogicalResult lowerRegion(Region &region, DenseMap<Value, int64_t> &values,
                            const std::string &prefix, int depth) {
    if (depth > 32)
      return region.getParentOp()->emitError() << "calls nest more than 32 deep";
    for (Operation &op : region.getOps()) {
      if (isa<ParamOp, func::ReturnOp, YieldOp>(op))
        continue;
      if (auto get = dyn_cast<GetOp>(op)) {
        FailureOr<int64_t> id = paramBuffer(get, prefix);
        if (failed(id))
          return failure();
        values[get.getResult()] = *id;
        continue;
      }
      if (auto repeat = dyn_cast<RepeatOp>(op)) {
        BlockOp block = repeat.lookupBlock();
        SmallVector<int64_t> carried;
        for (Value v : repeat.getInputs())
          carried.push_back(values.lookup(v));
        for (int64_t layer = 0; layer < repeat.getCount(); ++layer) {
          DenseMap<Value, int64_t> inner;
          for (auto [arg, id] : llvm::zip(block.getArguments(), carried))
            inner[arg] = id;
          std::string layerPrefix =
              prefix + block.getSymName().str() + "." + std::to_string(layer) + ".";
          if (failed(lowerRegion(block.getBody(), inner, layerPrefix, depth + 1)))
            return failure();
          auto yield = cast<YieldOp>(block.getBody().front().getTerminator());
          carried.clear();
          for (Value v : yield.getValues())
            carried.push_back(inner.lookup(v));
        }
        for (auto [res, id] : llvm::zip(repeat.getResults(), carried))
          values[res] = id;
        continue;
      }
      if (auto call = dyn_cast<func::CallOp>(op)) {
        auto callee = module.lookupSymbol<func::FuncOp>(call.getCallee());
        if (!callee || callee.isExternal())
          return call.emitError() << "calls @" << call.getCallee() << ", which has no body";
        DenseMap<Value, int64_t> inner;
        for (auto [arg, v] : llvm::zip(callee.getArguments(), call.getOperands()))
          inner[arg] = values.lookup(v);
        if (failed(lowerRegion(callee.getBody(), inner, prefix, depth + 1)))
          return failure();
        auto ret = cast<func::ReturnOp>(callee.getBody().front().getTerminator());
        for (auto [res, v] : llvm::zip(call.getResults(), ret.getOperands()))
          values[res] = inner.lookup(v);
        continue;
      }
      if (op.getDialect() != module->getContext()->getLoadedDialect<LoomDialect>())
        return op.emitError() << "cannot lower '" << op.getName() << "' into a bundle";
      if (failed(lowerOp(op, values, prefix)))
        return failure();
    }
    return success();
  }

private:
  LogicalResult lowerOp(Operation &op, DenseMap<Value, int64_t> &values,
                        const std::string &prefix) {
    std::string opName = op.getName().stripDialect().str();
    std::string resultName = prefix + opName + "." + std::to_string(counter++);
    if (isa<ReshapeOp, GradAllReduceOp>(op)) { // views: no instruction
      int64_t in = values.lookup(op.getOperand(0));
      FailureOr<int64_t> id = newBuffer(op.getResult(0).getType(), resultName,
                                        rt::BufferRole::Activation, op.getLoc());
      if (failed(id))
        return failure();
      rank.buffers[*id].viewOf = rootOf(in);
      values[op.getResult(0)] = *id;
      if (notes) {
        rt::Instruction view{opName, {in}, {*id}, noteOf(op, prefix)};
        view.attrs["loom.view"] = true;
        program.push_back(std::move(view));
      }
      return success();
    }
    rt::Instruction ins;
    ins.op = opName;
    for (Value v : op.getOperands())
      ins.in.push_back(values.lookup(v));
    for (Value r : op.getResults()) {
      FailureOr<int64_t> id =
          newBuffer(r.getType(), resultName, rt::BufferRole::Activation, op.getLoc());
      if (failed(id))
        return failure();
      values[r] = *id;
      ins.out.push_back(*id);
    }
    for (NamedAttribute attr : op.getAttrDictionary()) {
      if (attr.getName().getValue().starts_with("loom."))
        continue; // shardings and other annotations are not instruction attributes
      FailureOr<json> value = instructionAttr(&op, attr);
      if (failed(value))
        return failure();
      ins.attrs[attr.getName().getValue().str()] = *value;
    }
    // Inputs that index something get a limit, checked and used for synthetic data.
    // A vocabulary split over tensor-parallel ranks counts whole.
    int64_t parts = 1;
    if (auto mesh = module->getAttrOfType<MeshAttr>("loom.mesh"))
      parts = mesh.getAxisSize("tp").value_or(1);
    if (auto emb = dyn_cast<EmbeddingOp>(op))
      indexLimits[rootOf(ins.in[1])] =
          emb.getTable().getType().getDimSize(0) * (emb.getVocabGroup() ? parts : 1);
    if (auto ce = dyn_cast<CrossEntropyOp>(op))
      indexLimits[rootOf(ins.in[1])] = cast<RankedTensorType>(ce.getLogits().getType()).getShape().back() *
                                       (ce.getVocabGroup() ? parts : 1);
    if (notes)
      ins.attrs.update(noteOf(op, prefix));
    program.push_back(std::move(ins));
    return success();
  }

  /// The notes autodiff reads: the layer ("layer.3." or "") and the op the
  /// entry came from, as its parent's symbol and its index there.
  json noteOf(Operation &op, const std::string &layer) {
    Operation *parent = op.getParentOp();
    auto [it, inserted] = indexOf.try_emplace(&op, 0);
    if (inserted) {
      int64_t i = 0;
      for (Operation &sibling : *op.getBlock())
        indexOf[&sibling] = i++;
    }
    json note = {{"loom.source", json::array({SymbolTable::getSymbolName(parent).str(), indexOf[&op]})}};
    if (!layer.empty())
      note["loom.layer"] = layer;
    return note;
  }

  ModuleOp module;
  bool notes;
  DenseMap<Operation *, int64_t> indexOf;
  rt::RankProgram rank;
  std::vector<rt::Instruction> program;
  std::map<std::string, int64_t> params;
  std::map<int64_t, int64_t> indexLimits;
  std::map<int64_t, std::string> partial;
  SourceNames names;
  int64_t counter = 0;
};


} // namespace

/// The model's functions, parameters and blocks: what lowering leaves behind.
void mlir::loom::eraseModel(ModuleOp module) {
  for (Operation &op : llvm::make_early_inc_range(module.getBody()->getOperations()))
    if (!isa<loomrt::BundleOp>(op))
      op.erase();
}

namespace {

struct LowerToStepPass : mlir::loom::impl::LowerToStepBase<LowerToStepPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<BundleOptions> options = getCompileOptions(module);
    if (failed(options))
      return signalPassFailure();
    const char *entryName = options->train ? "loss" : "forward";
    auto entry = module.lookupSymbol<func::FuncOp>(entryName);
    if (!entry || entry.isExternal()) {
      module.emitError() << "model has no @" << entryName << " function to compile"
                         << (options->train ? " (training differentiates @loss, which "
                                              "returns a scalar loss)"
                                            : "");
      return signalPassFailure();
    }
    Lowerer lowerer(module, /*notes=*/options->train);
    FailureOr<rt::RankProgram> rank = lowerer.run(entry);
    if (failed(rank))
      return signalPassFailure();
    if (options->train &&
        (rank->outputs.size() != 1 || !rank->buffers[rank->outputs[0].buffer].shape.empty())) {
      entry.emitError() << "@loss must return one scalar loss";
      return signalPassFailure();
    }
    Step step;
    step.manifest.model = options->modelName;
    step.manifest.mode = options->train ? "train" : "infer";
    step.manifest.batch = options->batch;
    step.manifest.seed = options->seed;
    step.manifest.plan = options->plan;
    step.ranks.push_back({std::move(*rank)});
    step.ranks.back().partialGrads = lowerer.partialGrads();
    if (!options->train)
      eraseModel(module);
    writeStep(module, step);
  }
};

} // namespace
