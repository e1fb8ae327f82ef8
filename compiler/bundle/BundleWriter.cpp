//===- BundleWriter.cpp - Lower a model to a runnable bundle --------------===//

#include "compiler/bundle/BundleWriter.h"
#include "dialects/loom/IR/GradientBuilder.h"
#include "dialects/loom/IR/LoomOps.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "compiler/bundle/Fusion.h"
#include "compiler/planner/PipelineSchedule.h"
#include "passes/Passes.h"
#include "runtime/src/Error.h"
#include "runtime/src/Init.h"
#include "runtime/src/Safetensors.h"

#include "llvm/Support/MemoryBuffer.h"

#include <algorithm>
#include <sys/stat.h>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <numeric>
#include <set>

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
namespace planner = ::loom::planner;
using json = nlohmann::json;

namespace {

std::optional<loom_dtype_t> dtypeOf(Type t) {
  if (t.isF32())
    return LOOM_F32;
  if (t.isF64())
    return LOOM_F64;
  if (t.isBF16())
    return LOOM_BF16;
  if (t.isF16())
    return LOOM_F16;
  if (t.isInteger(32))
    return LOOM_I32;
  if (t.isInteger(64))
    return LOOM_I64;
  return std::nullopt;
}

FailureOr<json> attrToJson(Operation *op, NamedAttribute attr) {
  Attribute a = attr.getValue();
  if (auto i = dyn_cast<IntegerAttr>(a))
    return json(i.getValue().getSExtValue());
  if (auto f = dyn_cast<FloatAttr>(a))
    return json(f.getValueAsDouble());
  if (isa<UnitAttr>(a))
    return json(true);
  if (auto b = dyn_cast<BoolAttr>(a))
    return json(b.getValue());
  if (auto s = dyn_cast<StringAttr>(a))
    return json(s.getValue().str());
  if (auto arr = dyn_cast<DenseI64ArrayAttr>(a))
    return json(std::vector<int64_t>(arr.asArrayRef().begin(), arr.asArrayRef().end()));
  return op->emitError() << "cannot lower attribute '" << attr.getName().getValue() << "' ("
                         << a << ") into a bundle instruction";
}

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
  Lowerer(ModuleOp module, const BundleOptions &options) : module(module), options(options) {}

  FailureOr<rt::RankProgram> run(func::FuncOp forward, bool keepProgram = false) {
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
    if (!keepProgram) {
      rank.programs["forward"] = std::move(program);
      return std::move(rank);
    }
    return rank;
  }

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
    b.bytes = tensor.getNumElements() * static_cast<int64_t>(rt::dtypeSize(*dtype));
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

public:
  /// One lowered op instance (a block's ops once per layer), for autodiff.
  struct OpRecord {
    Operation *op;
    std::vector<int64_t> in, out;
    std::string layer;   // "layer.3." for ops of a block application, "" otherwise
    int64_t instr = -1;  // its instruction in the forward program (-1: a view)
  };
  std::vector<OpRecord> records;
  rt::RankProgram &rankProgram() { return rank; }
  std::vector<rt::Instruction> &forwardProgram() { return program; }
  int64_t root(int64_t id) const { return rootOf(id); }
  FailureOr<int64_t> makeBuffer(Type type, const std::string &name, rt::BufferRole role,
                                Location loc) {
    return newBuffer(type, name, role, loc);
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
      records.push_back({&op, {in}, {*id}, prefix, -1});
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
      FailureOr<json> value = attrToJson(&op, attr);
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
    records.push_back({&op, ins.in, ins.out, prefix, static_cast<int64_t>(program.size())});
    program.push_back(std::move(ins));
    return success();
  }

  ModuleOp module;
  const BundleOptions &options;
  rt::RankProgram rank;
  std::vector<rt::Instruction> program;
  std::map<std::string, int64_t> params;
  std::map<int64_t, int64_t> indexLimits;
  SourceNames names;
  int64_t counter = 0;
};


/// Reverse mode over the lowered forward ops: each op's gradient rule
/// (DifferentiableOpInterface) builds its operands' gradients as backward
/// instructions over buffers.
class Autodiff : public GradientBuilder {
public:
  /// `chunkOf` gives each forward record's pipeline chunk (all 0 without
  /// pipelining): backward instructions are tagged with their record's
  /// chunk, and a parameter used in several chunks gets one gradient per chunk.
  Autodiff(Lowerer &lowerer, MLIRContext *ctx, const std::set<std::string> &recompute,
           std::vector<int64_t> chunkOf = {})
      : lowerer(lowerer), rank(lowerer.rankProgram()), ctx(ctx), recompute(recompute),
        chunkOf(std::move(chunkOf)) {
    for (const rt::Parameter &p : rank.params)
      isParam.insert(p.buffer);
  }

  LogicalResult run(int64_t loss) {
    // What needs a gradient: parameters and everything computed from them.
    for (const rt::Parameter &p : rank.params)
      needs.insert(p.buffer);
    for (const auto &rec : lowerer.records) {
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
    for (auto it = lowerer.records.rbegin(); it != lowerer.records.rend(); ++it) {
      current = &*it;
      chunk = chunkOf.empty() ? 0 : chunkOf[lowerer.records.rend() - it - 1];
      if (!current->layer.empty() && wantsRecompute(current->layer) &&
          !recomputed.count(current->layer))
        recomputeLayer(current->layer);
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

  // GradientBuilder. Values of a recomputed layer read its recomputed copies.
  Handle operand(unsigned i) override { return fresh(current->in.at(i)); }
  Handle result(unsigned i) override { return fresh(current->out.at(i)); }
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
  Type elementTypeOf(Handle h) override {
    switch (rank.buffers[h].dtype) {
    case LOOM_F64: return Float64Type::get(ctx);
    case LOOM_BF16: return BFloat16Type::get(ctx);
    case LOOM_F16: return Float16Type::get(ctx);
    case LOOM_I32: return IntegerType::get(ctx, 32);
    case LOOM_I64: return IntegerType::get(ctx, 64);
    default: return Float32Type::get(ctx);
    }
  }
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
    rank.buffers[id].viewOf = lowerer.root(h);
    return id;
  }
  MLIRContext *getContext() override { return ctx; }

private:
  bool wantsRecompute(const std::string &layer) const {
    if (recompute.count("all"))
      return true;
    // "layer.3." matches "layer.3" and "layer" (every application of @layer).
    std::string name = layer.substr(0, layer.size() - 1);
    return recompute.count(name) || recompute.count(name.substr(0, name.rfind('.')));
  }
  Handle fresh(int64_t id) const {
    auto it = remap.find(id);
    return it == remap.end() ? id : it->second;
  }
  /// Emits the layer's forward instructions again, into new buffers, just
  /// before its gradients: its activations need not live through the rest of
  /// the forward pass and backward.
  void recomputeLayer(const std::string &layer) {
    recomputed.insert(layer);
    const std::vector<rt::Instruction> &forward = lowerer.forwardProgram();
    for (const auto &rec : lowerer.records) {
      if (rec.layer != layer)
        continue;
      if (rec.instr < 0) { // a reshape: a view of the recomputed input
        const rt::Buffer src = rank.buffers[rec.out[0]];
        int64_t id = raw(src.dtype, src.shape, src.name + ".recomputed");
        rank.buffers[id].viewOf = lowerer.root(fresh(rec.in[0]));
        remap[rec.out[0]] = id;
        continue;
      }
      rt::Instruction ins = forward[rec.instr];
      for (int64_t &id : ins.in)
        id = fresh(id);
      for (int64_t &id : ins.out) {
        int64_t copy = like(id, rank.buffers[id].name + ".recomputed");
        remap[id] = copy;
        id = copy;
      }
      backward.push_back(std::move(ins));
      backwardChunk.push_back(chunk);
    }
  }

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
      FailureOr<json> v = attrToJson(current ? current->op : nullptr, a);
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

  Lowerer &lowerer;
  rt::RankProgram &rank;
  MLIRContext *ctx;
  const Lowerer::OpRecord *current = nullptr;
  std::map<int64_t, int64_t> grads;
  std::set<int64_t> needs;
  std::set<std::string> recompute, recomputed;
  std::map<int64_t, int64_t> remap; // forward buffer -> its recomputed copy
  LogicalResult status = success();
  std::vector<int64_t> chunkOf;
  std::set<int64_t> isParam;
  int64_t chunk = 0;
};

/// The update program: step counter, global gradient norm, and one in-place
/// optimizer instruction per parameter with its state buffers.
/// `prefix` (gradient reductions) runs first. The global gradient norm
/// counts the parameters marked in `normCounts` (each element of a split or
/// replicated model counted once) and sums over `normGroup` when set.
///
/// With ZeRO-1 (`zeroShards` maps parameter buffers to the gradient shards
/// that reduce_scatter produced), each rank updates its 1/dp slice of every
/// such parameter, keeping optimizer state for that slice only, and
/// all_gather puts the updated slices back together on every rank.
void buildUpdate(rt::RankProgram &rank, const TrainOptions &t, std::vector<rt::Instruction> prefix,
                 const std::vector<bool> &normCounts, const std::string &normGroup,
                 const std::map<int64_t, int64_t> &zeroShards = {}) {
  auto state = [&](const std::string &name, const std::vector<int64_t> &shape) {
    rt::Buffer b;
    b.id = static_cast<int64_t>(rank.buffers.size());
    b.name = name;
    b.shape = shape;
    b.bytes = rt::numElements(shape).value_or(0) * 4;
    b.role = rt::BufferRole::State;
    rank.buffers.push_back(b);
    rank.state.push_back({name, b.id, 0});
    return b.id;
  };
  std::vector<rt::Instruction> update = std::move(prefix);
  if (t.optimizer == "none") {
    if (!update.empty())
      rank.programs["update"] = std::move(update);
    return;
  }
  int64_t step = state("step", {});
  update.push_back({"step_increment", {step}, {step}, json::object()});
  auto gradOf = [&](const rt::Parameter &p) {
    auto it = zeroShards.find(p.buffer);
    return it == zeroShards.end() ? p.grad : it->second;
  };
  std::vector<int64_t> allGrads, skip;
  for (size_t i = 0; i < rank.params.size(); ++i)
    if (rank.params[i].grad >= 0) {
      if (i < normCounts.size() && !normCounts[i])
        skip.push_back(static_cast<int64_t>(allGrads.size()));
      allGrads.push_back(gradOf(rank.params[i]));
    }
  rt::Buffer norm;
  norm.id = static_cast<int64_t>(rank.buffers.size());
  norm.name = "grad_norm";
  norm.bytes = 4;
  rank.buffers.push_back(norm);
  json normAttrs = json::object();
  if (!normGroup.empty())
    normAttrs["group"] = normGroup;
  if (!skip.empty())
    normAttrs["skip"] = skip;
  update.push_back({"global_norm", allGrads, {norm.id}, normAttrs});
  std::vector<int64_t> gatherIn, gatherOut;
  for (size_t index = 0; index < rank.params.size(); ++index) {
    const rt::Parameter &p = rank.params[index];
    if (p.grad < 0)
      continue;
    const std::vector<int64_t> &shape = rank.buffers[p.buffer].shape;
    json attrs = {{"lr", t.lr},        {"min_lr", t.minLr},   {"clip", t.clip},
                  {"warmup", double(t.warmup)}, {"total_steps", double(t.totalSteps)},
                  {"weight_decay", shape.size() >= 2 ? t.weightDecay : 0.0}};
    int64_t param = p.buffer, grad = p.grad;
    std::vector<int64_t> stateShape = shape;
    if (auto it = zeroShards.find(p.buffer); it != zeroShards.end()) {
      // This rank's slice of the parameter: taken, updated, gathered back.
      grad = it->second;
      stateShape = rank.buffers[grad].shape;
      rt::Buffer slice = rank.buffers[grad];
      slice.id = static_cast<int64_t>(rank.buffers.size());
      slice.name = p.name + ".shard";
      slice.role = rt::BufferRole::Activation;
      rank.buffers.push_back(slice);
      update.push_back({"shard_of", {p.buffer}, {slice.id}, json{{"group", "dp"}}});
      gatherIn.push_back(slice.id), gatherOut.push_back(p.buffer);
      param = slice.id;
    }
    if (t.optimizer == "adamw") {
      int64_t m = state(p.name + ".adam_m", stateShape), v = state(p.name + ".adam_v", stateShape);
      attrs["beta1"] = t.beta1, attrs["beta2"] = t.beta2, attrs["eps"] = t.eps;
      update.push_back({"adamw", {param, grad, m, v, step, norm.id}, {param, m, v}, attrs});
    } else {
      int64_t m = state(p.name + ".momentum", stateShape);
      attrs["momentum"] = t.momentum;
      update.push_back({"sgd", {param, grad, m, step, norm.id}, {param, m}, attrs});
    }
  }
  if (!gatherIn.empty()) // every updated slice back to every rank, as one collective
    update.push_back({"all_gather", gatherIn, gatherOut, json{{"group", "dp"}}});
  rank.programs["update"] = std::move(update);
}

} // namespace

namespace {
constexpr int64_t kAlignment = 64;
int64_t alignUp(int64_t v) { return (v + kAlignment - 1) / kAlignment * kAlignment; }

/// Buffers a rewrite must leave as they are: the rank's outputs and the
/// parameters' gradients (the C API and the update read them).
std::set<int64_t> keptBuffers(const rt::RankProgram &r) {
  std::set<int64_t> kept;
  for (const rt::NamedBuffer &nb : r.outputs)
    kept.insert(nb.buffer);
  for (const rt::Parameter &p : r.params)
    if (p.grad >= 0)
      kept.insert(p.grad);
  return kept;
}

/// Buffers some other buffer is a view of.
std::set<int64_t> viewedBuffers(const rt::RankProgram &r) {
  std::set<int64_t> viewed;
  for (const rt::Buffer &b : r.buffers)
    if (b.viewOf >= 0)
      viewed.insert(b.viewOf);
  return viewed;
}

/// Removes the instructions `drop` marks, keeping the order of the rest.
void eraseMarked(std::vector<rt::Instruction> &list, const std::vector<bool> &drop) {
  std::vector<rt::Instruction> kept;
  for (size_t i = 0; i < list.size(); ++i)
    if (!drop[i])
      kept.push_back(std::move(list[i]));
  list = std::move(kept);
}

} // namespace

void mlir::loom::planMemory(rt::RankProgram &rank, const std::vector<std::string> &programNames) {
  std::vector<rt::Instruction> program; // all programs in execution order
  for (const std::string &name : programNames)
    if (auto it = rank.programs.find(name); it != rank.programs.end())
      program.insert(program.end(), it->second.begin(), it->second.end());
  auto root = [&](int64_t id) { return rt::storageOf(rank, id); };
  size_t n = rank.buffers.size();
  std::vector<int64_t> first(n, INT64_MAX), last(n, -1);
  for (size_t i = 0; i < program.size(); ++i) {
    for (int64_t id : program[i].out) {
      int64_t r = root(id);
      first[r] = std::min<int64_t>(first[r], i);
      last[r] = std::max<int64_t>(last[r], i);
    }
    for (int64_t id : program[i].in) {
      int64_t r = root(id);
      first[r] = std::min<int64_t>(first[r], i);
      last[r] = std::max<int64_t>(last[r], i);
    }
  }
  // Parameter gradients stay readable after the step (the C API and the
  // optimizer read them), so they live to the end.
  for (const rt::Parameter &p : rank.params)
    if (p.grad >= 0) {
      int64_t r = root(p.grad);
      last[r] = static_cast<int64_t>(program.size());
      first[r] = std::min<int64_t>(first[r], last[r]);
    }
  // Persistent buffers first, in id order.
  int64_t offset = 0;
  std::vector<int64_t> activations;
  for (rt::Buffer &b : rank.buffers) {
    if (b.viewOf >= 0)
      continue;
    if (b.role == rt::BufferRole::Activation) {
      activations.push_back(b.id);
      continue;
    }
    b.offset = offset;
    offset += alignUp(b.bytes);
  }
  int64_t base = offset;
  // Greedy by size: each activation takes the lowest offset that does not
  // overlap a placed activation whose lifetime intersects its own.
  std::stable_sort(activations.begin(), activations.end(), [&](int64_t a, int64_t b) {
    return rank.buffers[a].bytes > rank.buffers[b].bytes;
  });
  struct Placed {
    int64_t begin, end, first, last;
  };
  std::vector<Placed> placed;
  int64_t peak = 0;
  for (int64_t id : activations) {
    int64_t size = alignUp(rank.buffers[id].bytes);
    std::vector<std::pair<int64_t, int64_t>> busy;
    for (const Placed &p : placed)
      if (!(p.last < first[id] || last[id] < p.first))
        busy.push_back({p.begin, p.end});
    std::sort(busy.begin(), busy.end());
    int64_t at = 0;
    for (auto [b, e] : busy) {
      if (at + size <= b)
        break;
      at = std::max(at, e);
    }
    placed.push_back({at, at + size, first[id], last[id]});
    rank.buffers[id].offset = base + at;
    peak = std::max(peak, at + size);
  }
  for (rt::Buffer &b : rank.buffers)
    if (b.viewOf >= 0)
      b.offset = rank.buffers[root(b.id)].offset;
  rank.peakActivationBytes = peak;
  rank.arenaBytes = base + peak;
}

namespace {

/// Where global rank g sits in the dp x tp x pp grid (tp fastest, then dp,
/// then pp, as Megatron-LM numbers ranks), and the groups it belongs to.
struct Grid {
  int64_t dp, tp, pp;
  int64_t size() const { return dp * tp * pp; }
  int64_t rankOf(int64_t d, int64_t t, int64_t p) const { return (p * dp + d) * tp + t; }
  int64_t dpOf(int64_t g) const { return (g / tp) % dp; }
  int64_t tpOf(int64_t g) const { return g % tp; }
  int64_t ppOf(int64_t g) const { return g / (dp * tp); }

  void describe(rt::RankProgram &r) const {
    int64_t g = r.rank, d = dpOf(g), t = tpOf(g), p = ppOf(g);
    r.coords = {{"dp", d}, {"tp", t}, {"pp", p}};
    std::vector<int64_t> dpG, tpG, ppG, mpG;
    for (int64_t i = 0; i < dp; ++i)
      dpG.push_back(rankOf(i, t, p));
    for (int64_t i = 0; i < tp; ++i)
      tpG.push_back(rankOf(d, i, p));
    for (int64_t i = 0; i < pp; ++i)
      ppG.push_back(rankOf(d, t, i));
    for (int64_t i = 0; i < pp; ++i) // every rank of this data-parallel replica
      for (int64_t j = 0; j < tp; ++j)
        mpG.push_back(rankOf(d, j, i));
    std::vector<int64_t> allG;
    for (int64_t i = 0; i < size(); ++i)
      allG.push_back(i);
    r.groups = {{"dp", dpG}, {"tp", tpG}, {"pp", ppG}, {"mp", mpG}, {"all", allG}};
  }
};

/// The loss, the gradient program and what pipelining needs to know about
/// each instruction, shared by every rank before it takes its part.
struct Lowered {
  rt::RankProgram base;
  std::vector<rt::Instruction> forward, backward;
  std::vector<int64_t> forwardChunk, backwardChunk;
  std::map<std::pair<int64_t, int64_t>, int64_t> paramGrads; // (param buffer, chunk) -> grad
  int64_t loss = -1, chunks = 1;
};

bool isFloatRole(const rt::Buffer &b) {
  return b.role == rt::BufferRole::Param || b.role == rt::BufferRole::State;
}

/// Builds one rank's "step" program: the schedule's microbatch tasks for the
/// chunks this rank holds, each task's instructions on per-microbatch copies
/// of the activations, recv before a task of what other stages produced and
/// send after it of what they need, parameter gradients summed over
/// microbatches and the loss averaged over them.
class PipelineRank {
public:
  PipelineRank(const Lowered &l, rt::RankProgram &r, const Grid &grid, int64_t vpp, int64_t m,
               planner::Schedule schedule)
      : l(l), r(r), grid(grid), vpp(vpp), m(m), schedule(schedule) {}

  void build() {
    int64_t g = r.rank, stage = grid.ppOf(g);
    // Producers: the chunk and pass (forward 0, backward 1) that write each root.
    for (size_t i = 0; i < l.forward.size(); ++i)
      for (int64_t id : l.forward[i].out)
        producer.try_emplace(root(id), std::make_pair(l.forwardChunk[i], 0));
    for (size_t i = 0; i < l.backward.size(); ++i)
      for (int64_t id : l.backward[i].out)
        producer.try_emplace(root(id), std::make_pair(l.backwardChunk[i], 1));
    // Which roots each task (chunk, pass) reads that another chunk produced.
    for (int pass = 0; pass < 2; ++pass) {
      const auto &list = pass ? l.backward : l.forward;
      const auto &chunkOf = pass ? l.backwardChunk : l.forwardChunk;
      for (size_t i = 0; i < list.size(); ++i)
        for (int64_t id : list[i].in) {
          int64_t rt = root(id);
          auto it = producer.find(rt);
          if (it != producer.end() && it->second.first != chunkOf[i])
            needs[{chunkOf[i], pass}].insert(rt);
        }
    }
    // Full-batch inputs; the lowered ones (one microbatch) become per-task slices.
    for (rt::NamedBuffer &in : r.inputs) {
      rt::Buffer full = r.buffers[in.buffer];
      full.id = static_cast<int64_t>(r.buffers.size());
      full.shape[0] *= m;
      full.bytes *= m;
      full.role = rt::BufferRole::Input;
      r.buffers[in.buffer].role = rt::BufferRole::Activation;
      microInput[in.buffer] = full.id;
      r.buffers.push_back(full);
      in.buffer = full.id;
    }
    // The loss: summed over microbatches on the last stage, then averaged.
    rt::Buffer lossSum = r.buffers[l.loss];
    lossSum.id = static_cast<int64_t>(r.buffers.size());
    lossSum.name = "loss";
    lossSum.role = rt::BufferRole::Output;
    r.buffers[l.loss].role = rt::BufferRole::Activation;
    r.buffers.push_back(lossSum);
    r.outputs = {{"loss", lossSum.id, 0}};
    step.push_back({"fill", {}, {lossSum.id}, json{{"value", 0.0}}});
    // One gradient accumulator per parameter this rank's chunks use.
    std::set<int64_t> mine;
    for (int64_t j = 0; j < vpp; ++j)
      mine.insert(j * grid.pp + stage);
    for (auto &[key, grad] : l.paramGrads)
      if (mine.count(key.second) && !accumulator.count(key.first)) {
        rt::Buffer acc = r.buffers[key.first];
        acc.id = static_cast<int64_t>(r.buffers.size());
        acc.name = acc.name + ".grad";
        acc.role = rt::BufferRole::Activation;
        r.buffers.push_back(acc);
        accumulator[key.first] = acc.id;
        step.push_back({"fill", {}, {acc.id}, json{{"value", 0.0}}});
      }
    for (rt::Parameter &p : r.params)
      p.grad = accumulator.count(p.buffer) ? accumulator[p.buffer] : -1;

    for (const planner::PipelineTask &task :
         planner::stageOrder(schedule, grid.pp, m, vpp, stage)) {
      int64_t chunk = task.chunk * grid.pp + stage, k = task.microbatch;
      int pass = task.forward ? 0 : 1;
      receive(chunk, pass, k);
      const auto &list = pass ? l.backward : l.forward;
      const auto &chunkOf = pass ? l.backwardChunk : l.forwardChunk;
      for (size_t i = 0; i < list.size(); ++i) {
        if (chunkOf[i] != chunk)
          continue;
        rt::Instruction ins = list[i];
        for (int64_t &id : ins.in)
          id = input(id, k);
        for (int64_t &id : ins.out)
          id = copy(id, k);
        step.push_back(std::move(ins));
      }
      if (pass == 0 && producer.count(root(l.loss)) && producer[root(l.loss)].first == chunk)
        step.push_back({"add", {lossSum.id, copy(l.loss, k)}, {lossSum.id}, json::object()});
      if (pass == 1)
        for (auto &[key, grad] : l.paramGrads)
          if (key.second == chunk)
            step.push_back({"add", {accumulator[key.first], copy(grad, k)},
                            {accumulator[key.first]}, json::object()});
      sendAfter(chunk, pass, k);
    }
    if (producer[root(l.loss)].first % grid.pp == stage && m > 1)
      step.push_back({"scale", {lossSum.id}, {lossSum.id}, json{{"factor", 1.0 / double(m)}}});
    r.programs.clear();
    r.programs["step"] = std::move(step);
    lossBuffer = lossSum.id;
  }

  int64_t lossBuffer = -1;
  /// Stage holding the loss.
  int64_t lossStage() { return producer[root(l.loss)].first % grid.pp; }

private:
  int64_t root(int64_t id) const { return rt::storageOf(l.base, id); }
  /// This microbatch's copy of an activation (parameters and state are shared).
  int64_t copy(int64_t id, int64_t k) {
    if (isFloatRole(r.buffers[id]))
      return id;
    auto [it, inserted] = copies.try_emplace({id, k}, -1);
    if (!inserted)
      return it->second;
    rt::Buffer b = r.buffers[id];
    b.id = static_cast<int64_t>(r.buffers.size());
    b.name += "@" + std::to_string(k);
    b.role = rt::BufferRole::Activation;
    r.buffers.push_back(b);
    copies[{id, k}] = b.id;
    if (b.viewOf >= 0) {
      int64_t of = copy(b.viewOf, k);
      r.buffers[b.id].viewOf = of;
    }
    return b.id;
  }
  /// An operand: inputs are sliced out of the full batch the first time a
  /// task of this microbatch reads them.
  int64_t input(int64_t id, int64_t k) {
    int64_t rt = root(id);
    if (auto it = microInput.find(rt); it != microInput.end() && !sliced.count({rt, k})) {
      sliced.insert({rt, k});
      int64_t rows = r.buffers[rt].shape[0];
      step.push_back({"slice", {it->second}, {copy(rt, k)},
                      json{{"axis", 0}, {"start", k * rows}, {"size", rows}}});
    }
    return copy(id, k);
  }
  int64_t rankOfChunk(int64_t chunk) const {
    return grid.rankOf(grid.dpOf(r.rank), grid.tpOf(r.rank), chunk % grid.pp);
  }
  int64_t tag(int64_t rt, int64_t k) const { return rt * m + k; }

  void receive(int64_t chunk, int pass, int64_t k) {
    auto it = needs.find({chunk, pass});
    if (it == needs.end())
      return;
    for (int64_t rt : it->second) {
      int64_t from = rankOfChunk(producer[rt].first);
      if (from == r.rank || !received.insert({rt, k}).second)
        continue;
      step.push_back({"recv", {}, {copy(rt, k)}, json{{"peer", from}, {"tag", tag(rt, k)}}});
    }
  }
  void sendAfter(int64_t chunk, int pass, int64_t k) {
    // Every other rank whose tasks read what this task produced gets it once.
    std::map<int64_t, std::set<int64_t>> to; // root -> ranks
    for (auto &[task, roots] : needs)
      for (int64_t rt : roots)
        if (producer[rt] == std::make_pair(chunk, pass)) {
          int64_t dest = rankOfChunk(task.first);
          if (dest != r.rank)
            to[rt].insert(dest);
        }
    for (auto &[rt, ranks] : to)
      for (int64_t dest : ranks)
        step.push_back({"send", {copy(rt, k)}, {}, json{{"peer", dest}, {"tag", tag(rt, k)}}});
  }

  const Lowered &l;
  rt::RankProgram &r;
  const Grid &grid;
  int64_t vpp, m;
  planner::Schedule schedule;
  std::vector<rt::Instruction> step;
  std::map<int64_t, std::pair<int64_t, int>> producer;
  std::map<std::pair<int64_t, int>, std::set<int64_t>> needs;
  std::map<std::pair<int64_t, int64_t>, int64_t> copies;
  std::map<int64_t, int64_t> microInput, accumulator;
  std::set<std::pair<int64_t, int64_t>> sliced, received;
};

/// Inserts the data-parallel all-reduces of `grads` into `program`: grads
/// ordered by when they are finished (the last instruction writing them),
/// packed into buckets of about `bucketBytes`, each bucket issued right
/// after its last gradient is done.
/// Returns the last event recorded (-1 when no bucket).
int64_t placeGradientBuckets(rt::RankProgram &r, std::vector<rt::Instruction> &program,
                             const std::vector<int64_t> &grads, int64_t bucketBytes,
                             const std::map<int64_t, int64_t> &shards = {}) {
  int64_t lastEvent = -1;
  auto root = [&](int64_t id) { return rt::storageOf(r, id); };
  std::map<int64_t, int64_t> lastWrite; // root -> instruction index
  for (size_t i = 0; i < program.size(); ++i)
    for (int64_t id : program[i].out)
      lastWrite[root(id)] = static_cast<int64_t>(i);
  std::vector<std::pair<int64_t, int64_t>> ready; // (index, grad)
  for (int64_t g : grads)
    ready.push_back({lastWrite.count(root(g)) ? lastWrite[root(g)] : -1, g});
  std::stable_sort(ready.begin(), ready.end());
  std::map<int64_t, std::vector<rt::Instruction>> after; // index -> buckets issued after it
  std::vector<int64_t> bucket;
  int64_t bytes = 0;
  for (size_t i = 0; i < ready.size(); ++i) {
    bucket.push_back(ready[i].second);
    bytes += r.buffers[ready[i].second].bytes;
    if (bytes >= bucketBytes || i + 1 == ready.size()) {
      // On the communication stream; each bucket records event `lastEvent`.
      json attrs = {{"reduction", "mean"}, {"group", "dp"}, {"async", true}, {"event", ++lastEvent}};
      if (shards.empty()) {
        after[ready[i].first].push_back({"all_reduce", bucket, bucket, attrs});
      } else { // ZeRO-1: each rank keeps the mean of its slice of every gradient
        std::vector<int64_t> outs;
        for (int64_t g : bucket)
          outs.push_back(shards.at(g));
        after[ready[i].first].push_back({"reduce_scatter", bucket, outs, attrs});
      }
      bucket.clear();
      bytes = 0;
    }
  }
  std::vector<rt::Instruction> out;
  if (auto it = after.find(-1); it != after.end())
    out.insert(out.end(), it->second.begin(), it->second.end());
  for (size_t i = 0; i < program.size(); ++i) {
    out.push_back(std::move(program[i]));
    if (auto it = after.find(static_cast<int64_t>(i)); it != after.end())
      out.insert(out.end(), it->second.begin(), it->second.end());
  }
  program = std::move(out);
  return lastEvent;
}

/// The gradient of an operand that was sliced into parts along one axis
/// (q|k|v) arrives as one slice_grad per part (zeros outside the part) and
/// adds summing them. Where the parts tile the axis exactly, a concat of the
/// parts' gradients computes the same sum: one write instead of zero-filling
/// and adding full-size tensors.
int64_t joinSliceGradients(rt::RankProgram &r) {
  std::map<int64_t, int64_t> reads;
  for (const auto &[name, list] : r.programs)
    for (const rt::Instruction &ins : list)
      for (int64_t id : ins.in)
        ++reads[id];
  std::set<int64_t> kept = keptBuffers(r);
  auto privateValue = [&](int64_t id) {
    return reads[id] == 1 && !kept.count(id) && r.buffers[id].viewOf < 0;
  };
  int64_t joined = 0;
  for (auto &[name, list] : r.programs) {
    std::map<int64_t, size_t> producer;
    for (size_t i = 0; i < list.size(); ++i)
      for (int64_t id : list[i].out)
        producer[id] = i;
    std::vector<bool> dropped(list.size(), false);
    for (size_t i = list.size(); i-- > 0;) {
      const rt::Instruction &root = list[i];
      if (dropped[i] || root.op != "add" || root.in.size() != 2 || root.out.size() != 1)
        continue;
      const rt::Buffer &whole = r.buffers[root.out[0]];
      struct Part {
        int64_t start, size, source;
      };
      std::vector<Part> parts;
      std::vector<size_t> used = {i};
      int64_t axis = -1;
      bool ok = true;
      std::function<void(int64_t)> collect = [&](int64_t id) {
        auto at = producer.find(id);
        if (!ok || at == producer.end() || at->second >= i || !privateValue(id)) {
          ok = false;
          return;
        }
        const rt::Instruction &ins = list[at->second];
        used.push_back(at->second);
        if (ins.op == "add" && ins.in.size() == 2) {
          collect(ins.in[0]);
          collect(ins.in[1]);
          return;
        }
        const rt::Buffer &out = r.buffers[id];
        if (ins.op != "slice_grad" || out.shape != whole.shape || out.dtype != whole.dtype) {
          ok = false;
          return;
        }
        int64_t a = ins.attrs.value("axis", int64_t(0)), rank = int64_t(whole.shape.size());
        a = a < 0 ? a + rank : a;
        if (axis >= 0 && a != axis)
          ok = false;
        axis = a;
        parts.push_back({ins.attrs.value("start", int64_t(0)), r.buffers[ins.in[0]].shape[a], ins.in[0]});
      };
      collect(root.in[0]);
      collect(root.in[1]);
      if (!ok || axis < 0 || parts.size() < 2)
        continue;
      std::sort(parts.begin(), parts.end(), [](const Part &x, const Part &y) { return x.start < y.start; });
      int64_t next = 0;
      for (const Part &p : parts)
        ok &= p.start == next, next += p.size;
      if (!ok || next != whole.shape[axis])
        continue;
      rt::Instruction concat{"concat", {}, root.out, json{{"axis", axis}}};
      for (const Part &p : parts)
        concat.in.push_back(p.source);
      for (size_t u : used)
        dropped[u] = true;
      dropped[i] = false;
      list[i] = std::move(concat);
      ++joined;
    }
    eraseMarked(list, dropped);
  }
  return joined;
}

/// A fused q|k|v projection feeds attention through three slices, and the
/// gradients come back through a concat of dq, dk and dv. Where the slices
/// are read by nothing else, attention reads the columns of the projection
/// in place (attrs "packed": the starts) and its gradient writes the
/// concat's result directly: no copies of q, k, v or of their gradients.
/// bf16 only (the GPU's flash kernels take row strides; f32 keeps slices).
int64_t attentionReadsPackedQkv(rt::RankProgram &r, const std::string &forwardName,
                                const std::string &backwardName) {
  auto fwdIt = r.programs.find(forwardName);
  if (fwdIt == r.programs.end())
    return 0;
  std::vector<rt::Instruction> &forward = fwdIt->second;
  std::vector<rt::Instruction> *backward =
      r.programs.count(backwardName) ? &r.programs[backwardName] : nullptr;
  bool oneList = backward == &forward; // a pipelined step holds both passes
  std::map<int64_t, std::vector<std::pair<std::string, size_t>>> readers;
  for (const auto &[name, list] : r.programs)
    for (size_t i = 0; i < list.size(); ++i)
      for (int64_t id : list[i].in)
        readers[id].push_back({name, i});
  std::set<int64_t> viewed = viewedBuffers(r), kept = keptBuffers(r);
  auto privateTo = [&](int64_t id, std::initializer_list<std::pair<std::string, size_t>> allowed) {
    if (viewed.count(id) || kept.count(id) || r.buffers[id].viewOf >= 0)
      return false;
    for (const auto &reader : readers[id])
      if (std::find(allowed.begin(), allowed.end(), reader) == allowed.end())
        return false;
    return true;
  };
  std::map<int64_t, size_t> producer;
  for (size_t i = 0; i < forward.size(); ++i)
    for (int64_t id : forward[i].out)
      producer[id] = i;
  std::vector<bool> dropForward(forward.size(), false), dropBackward(backward ? backward->size() : 0, false);
  std::vector<bool> &dropGrad = oneList ? dropForward : dropBackward;
  int64_t packed = 0;
  for (size_t a = 0; a < forward.size(); ++a) {
    rt::Instruction &attn = forward[a];
    if (attn.op != "attention" || attn.in.size() != 3 || attn.out.size() != 1 || attn.attrs.contains("packed"))
      continue;
    int64_t source = -1;
    std::vector<int64_t> starts;
    std::vector<size_t> slices;
    for (int64_t id : attn.in) {
      auto it = producer.find(id);
      if (it == producer.end())
        break;
      const rt::Instruction &sl = forward[it->second];
      const rt::Buffer &x = r.buffers[sl.in.empty() ? 0 : sl.in[0]];
      int64_t axis = sl.attrs.value("axis", int64_t(-1));
      if (sl.op != "slice" || sl.in.size() != 1 || x.shape.size() != 3 || (axis != 2 && axis != -1) ||
          (source >= 0 && sl.in[0] != source))
        break;
      source = sl.in[0];
      starts.push_back(sl.attrs.value("start", int64_t(-1)));
      slices.push_back(it->second);
    }
    if (starts.size() != 3 || r.buffers[source].dtype != LOOM_BF16)
      continue;
    const rt::Buffer &x = r.buffers[source];
    int64_t W = x.shape[2], wq = r.buffers[attn.in[0]].shape[2], wk = r.buffers[attn.in[1]].shape[2];
    if (W % 8 || wq % 8 || wk % 8 || starts[0] != 0 || starts[1] != wq || starts[2] != wq + wk || W != wq + 2 * wk ||
        r.buffers[attn.in[0]].shape[1] != x.shape[1] || r.buffers[attn.in[1]].shape[1] != x.shape[1])
      continue;
    // The backward's attention_grad of the same operands, and the concat of its results.
    std::optional<size_t> g, cat;
    if (backward)
      for (size_t i = 0; i < backward->size(); ++i) {
        const rt::Instruction &ins = (*backward)[i];
        if (ins.op == "attention_grad" && ins.in.size() == 4 && ins.out.size() == 3 &&
            std::equal(attn.in.begin(), attn.in.end(), ins.in.begin()) && !ins.attrs.contains("packed"))
          g = i;
      }
    std::pair<std::string, size_t> here{forwardName, a};
    bool ok = true;
    for (int64_t id : attn.in)
      ok &= g ? privateTo(id, {here, {backwardName, *g}}) : privateTo(id, {here});
    if (!ok)
      continue;
    if (g) {
      const rt::Instruction &grad = (*backward)[*g];
      for (size_t i = 0; i < backward->size() && !cat; ++i) {
        const rt::Instruction &ins = (*backward)[i];
        if (ins.op == "concat" && ins.out.size() == 1 && ins.in == grad.out &&
            (ins.attrs.value("axis", int64_t(-1)) == 2 || ins.attrs.value("axis", int64_t(-1)) == -1) &&
            r.buffers[ins.out[0]].shape == x.shape && r.buffers[ins.out[0]].dtype == LOOM_BF16)
          cat = i;
      }
      if (!cat)
        continue;
      for (int64_t id : grad.out)
        ok &= privateTo(id, {{backwardName, *cat}});
      if (!ok)
        continue;
      rt::Instruction &gi = (*backward)[*g];
      gi.in = {source, gi.in[3]};
      gi.out = {(*backward)[*cat].out[0]};
      gi.attrs["packed"] = starts;
      dropGrad[*cat] = true;
    }
    attn.in = {source};
    attn.attrs["packed"] = starts;
    for (size_t sl : slices)
      dropForward[sl] = true;
    ++packed;
  }
  eraseMarked(forward, dropForward);
  if (backward && !oneList)
    eraseMarked(*backward, dropBackward);
  return packed;
}

/// Mixed precision leaves each parameter's gradient in bf16 and casts it to
/// f32 for the optimizer. Where that f32 copy is read only by the update
/// (the clipping norm and the optimizer: no all-reduce, no accumulation over
/// microbatches), they read the bf16 gradient instead: the widening is exact,
/// so the update is the same, without a cast per parameter per step or the
/// f32 copies' memory.
int64_t optimizerReadsBf16Gradients(rt::RankProgram &r) {
  if (!r.programs.count("backward") || !r.programs.count("update"))
    return 0;
  auto root = [&](int64_t id) { return rt::storageOf(r, id); };
  // By storage: a view's reads and writes count as its root's.
  std::map<int64_t, std::vector<std::pair<std::string, size_t>>> readers, writers;
  for (const auto &[name, list] : r.programs)
    for (size_t i = 0; i < list.size(); ++i) {
      for (int64_t id : list[i].in)
        readers[root(id)].push_back({name, i});
      for (int64_t id : list[i].out)
        writers[root(id)].push_back({name, i});
    }
  std::set<int64_t> outputs;
  for (const rt::NamedBuffer &nb : r.outputs)
    outputs.insert(nb.buffer);
  std::vector<rt::Instruction> &backward = r.programs["backward"];
  std::vector<bool> dropped(backward.size(), false);
  int64_t changed = 0;
  for (rt::Parameter &p : r.params) {
    int64_t g = p.grad;
    if (g < 0 || r.buffers[g].dtype != LOOM_F32 || r.buffers[g].viewOf >= 0 || outputs.count(g) ||
        writers[g].size() != 1 || writers[g][0].first != "backward")
      continue;
    size_t at = writers[g][0].second;
    const rt::Instruction &cast = backward[at];
    if (cast.op != "cast" || cast.in.size() != 1)
      continue;
    int64_t source = cast.in[0], storage = root(source);
    if (r.buffers[source].dtype != LOOM_BF16 || outputs.count(storage) || readers[storage].size() != 1 ||
        writers[storage].size() != 1 || writers[storage][0].first != "backward")
      continue;
    bool onlyUpdate = !readers[g].empty();
    for (auto [name, i] : readers[g]) {
      const std::string &op = r.programs[name][i].op;
      onlyUpdate &= name == "update" && (op == "global_norm" || op == "adamw" || op == "sgd");
    }
    if (!onlyUpdate)
      continue;
    for (auto [name, i] : readers[g])
      for (int64_t &id : r.programs[name][i].in)
        if (id == g)
          id = source;
    dropped[at] = true;
    p.grad = source;
    ++changed;
  }
  eraseMarked(backward, dropped);
  return changed;
}

/// Gradients reach f32 sums through a bf16 -> f32 cast and an add (the tied
/// embedding's two contributions; every weight's gradient added into its
/// accumulator once per microbatch). The add reads the bf16 value itself
/// instead (both backends widen it exactly and add in f32): the same sums
/// without a cast kernel and an f32 copy per gradient.
int64_t addsReadBf16Gradients(rt::RankProgram &r) {
  auto root = [&](int64_t id) { return rt::storageOf(r, id); };
  std::map<int64_t, int64_t> reads, writes; // writes by storage (a view's are its root's)
  for (const auto &[name, list] : r.programs)
    for (const rt::Instruction &ins : list) {
      for (int64_t id : ins.in)
        ++reads[id];
      for (int64_t id : ins.out)
        ++writes[root(id)];
    }
  std::set<int64_t> kept = keptBuffers(r), viewed = viewedBuffers(r);
  int64_t changed = 0;
  for (auto &[name, list] : r.programs) {
    std::map<int64_t, size_t> castOf; // f32 result -> its cast
    for (size_t i = 0; i < list.size(); ++i) {
      const rt::Instruction &ins = list[i];
      if (ins.op == "cast" && ins.in.size() == 1 && ins.out.size() == 1 &&
          r.buffers[ins.in[0]].dtype == LOOM_BF16 && r.buffers[ins.out[0]].dtype == LOOM_F32)
        castOf[ins.out[0]] = i;
    }
    std::vector<bool> dropped(list.size(), false);
    for (rt::Instruction &ins : list) {
      if (ins.op != "add" || ins.in.size() != 2 || ins.out.size() != 1 ||
          r.buffers[ins.out[0]].dtype != LOOM_F32)
        continue;
      for (int64_t &id : ins.in) {
        auto it = castOf.find(id);
        if (it == castOf.end() || dropped[it->second] || reads[id] != 1 || writes[id] != 1 || kept.count(id) ||
            viewed.count(id) || r.buffers[id].viewOf >= 0 || r.buffers[id].shape != r.buffers[ins.out[0]].shape)
          continue;
        int64_t source = list[it->second].in[0];
        if (writes[root(source)] != 1)
          continue;
        id = source;
        dropped[it->second] = true;
        ++changed;
      }
    }
    eraseMarked(list, dropped);
  }
  return changed;
}

/// A pipelined step runs every microbatch's forward, each casting the same
/// weights to bf16 again. The weights do not change within the step, so the
/// first cast of each serves every microbatch (their bf16 copies then live
/// the whole step, as one microbatch's do).
int64_t castWeightsOncePerStep(rt::RankProgram &r) {
  auto it = r.programs.find("step");
  if (it == r.programs.end())
    return 0;
  std::set<int64_t> params;
  for (const rt::Parameter &p : r.params)
    params.insert(p.buffer);
  std::map<std::pair<int64_t, int>, int64_t> first; // (weight, dtype) -> its first cast's result
  std::map<int64_t, int64_t> rename;
  std::vector<rt::Instruction> kept;
  for (rt::Instruction &ins : it->second) {
    for (int64_t &id : ins.in)
      if (auto to = rename.find(id); to != rename.end())
        id = to->second;
    if (ins.op == "cast" && ins.in.size() == 1 && ins.out.size() == 1 && params.count(ins.in[0]) &&
        r.buffers[ins.out[0]].viewOf < 0) {
      auto [at, inserted] = first.try_emplace({ins.in[0], int(r.buffers[ins.out[0]].dtype)}, ins.out[0]);
      if (!inserted) {
        rename[ins.out[0]] = at->second;
        continue;
      }
    }
    kept.push_back(std::move(ins));
  }
  for (rt::Buffer &b : r.buffers) // views of a dropped copy view the kept one
    if (b.viewOf >= 0)
      if (auto to = rename.find(b.viewOf); to != rename.end())
        b.viewOf = to->second;
  for (auto &[name, list] : r.programs) // other programs (update) read the kept copy
    if (name != "step")
      for (rt::Instruction &ins : list)
        for (int64_t &id : ins.in)
          if (auto to = rename.find(id); to != rename.end())
            id = to->second;
  int64_t dropped = int64_t(it->second.size() - kept.size());
  it->second = std::move(kept);
  return dropped;
}

/// Training bundles cast each f32 master weight to bf16 where the forward
/// first uses it. The casts move to the start of the forward, next to each
/// other, where the runtime converts them all in one launch. Memory stays
/// as it was: the matrices' bf16 copies are kept for the backward anyway,
/// and the rest (biases, norm shifts, tables read once at the start) are
/// small or first read at the start.
int64_t hoistParameterCasts(rt::RankProgram &r) {
  if (!r.programs.count("forward") || !r.programs.count("backward"))
    return 0;
  std::set<int64_t> params;
  for (const rt::Parameter &p : r.params)
    params.insert(p.buffer);
  std::vector<rt::Instruction> &forward = r.programs["forward"], front, rest;
  for (rt::Instruction &ins : forward) {
    bool hoist = ins.op == "cast" && ins.in.size() == 1 && ins.out.size() == 1 && params.count(ins.in[0]);
    (hoist ? front : rest).push_back(std::move(ins));
  }
  int64_t moved = int64_t(front.size());
  front.insert(front.end(), std::make_move_iterator(rest.begin()), std::make_move_iterator(rest.end()));
  forward = std::move(front);
  return moved;
}

/// Drops the buffers and parameters a rank's programs never touch (other
/// stages' layers) and renumbers the rest densely.
void compactRank(rt::RankProgram &r) {
  std::vector<bool> used(r.buffers.size(), false);
  auto mark = [&](int64_t id) {
    for (; id >= 0; id = r.buffers[id].viewOf)
      used[id] = true;
  };
  std::set<int64_t> touched;
  for (auto &[name, list] : r.programs)
    for (const rt::Instruction &ins : list) {
      for (int64_t id : ins.in)
        mark(id), touched.insert(id);
      for (int64_t id : ins.out)
        mark(id), touched.insert(id);
    }
  std::vector<rt::Parameter> params;
  for (rt::Parameter &p : r.params)
    if (touched.count(p.buffer))
      params.push_back(p);
  r.params = std::move(params);
  for (const rt::NamedBuffer &nb : r.inputs)
    mark(nb.buffer);
  for (const rt::NamedBuffer &nb : r.outputs)
    mark(nb.buffer);
  for (const rt::NamedBuffer &nb : r.state)
    mark(nb.buffer);
  std::vector<int64_t> to(r.buffers.size(), -1);
  std::vector<rt::Buffer> kept;
  for (size_t i = 0; i < r.buffers.size(); ++i)
    if (used[i]) {
      to[i] = static_cast<int64_t>(kept.size());
      kept.push_back(r.buffers[i]);
      kept.back().id = to[i];
    }
  for (rt::Buffer &b : kept)
    if (b.viewOf >= 0)
      b.viewOf = to[b.viewOf];
  r.buffers = std::move(kept);
  for (auto &[name, list] : r.programs)
    for (rt::Instruction &ins : list) {
      for (int64_t &id : ins.in)
        id = to[id];
      for (int64_t &id : ins.out)
        id = to[id];
    }
  for (rt::Parameter &p : r.params) {
    p.buffer = to[p.buffer];
    if (p.grad >= 0)
      p.grad = to[p.grad];
  }
  for (auto *list : {&r.inputs, &r.outputs, &r.state})
    for (rt::NamedBuffer &nb : *list)
      nb.buffer = to[nb.buffer];
}

/// Units of pipelining in program order: what comes before the first layer,
/// each layer (a block application), what sits between layers, and what
/// follows the last; returns each record's unit.
std::vector<int64_t> unitsOf(const std::vector<std::string> &layers, int64_t &count) {
  std::vector<int64_t> unit(layers.size(), 0);
  count = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (i > 0 && layers[i] != layers[i - 1])
      ++count;
    unit[i] = count;
  }
  count = layers.empty() ? 0 : count + 1;
  return unit;
}

} // namespace

FailureOr<rt::Manifest> mlir::loom::lowerForward(ModuleOp original, const BundleOptions &options) {
  OwningOpRef<ModuleOp> module(original.clone());
  int64_t dp = options.dataParallel, tp = options.tensorParallel, pp = options.pipelineParallel;
  int64_t vpp = options.virtualStages, m = options.microbatches;
  if (dp < 1 || tp < 1 || pp < 1 || vpp < 1 || m < 1)
    return original.emitError() << "parallel degrees and the microbatch count must be at least 1";
  if (options.batch % (dp * m) != 0)
    return original.emitError() << "the batch (" << options.batch << ") must divide evenly over "
                                << dp << " data-parallel ranks x " << m << " microbatches";
  if (!options.train && (dp > 1 || pp > 1 || m > 1))
    return original.emitError() << "inference bundles split over tensor parallelism only (tp); "
                                   "data and pipeline parallelism apply to training bundles (--train)";
  planner::Schedule schedule;
  if (!planner::parseSchedule(options.schedule, schedule))
    return original.emitError() << "unknown schedule '" << options.schedule
                                << "'; use gpipe, 1f1b or interleaved";
  if ((vpp > 1) != (schedule == planner::Schedule::Interleaved && pp > 1))
    return original.emitError() << "interleaved 1F1B needs pp > 1 and vpp > 1 (and vpp > 1 "
                                   "needs the interleaved schedule); got pp = "
                                << pp << ", vpp = " << vpp << ", schedule " << options.schedule;
  if (schedule == planner::Schedule::Interleaved && m % pp != 0)
    return original.emitError() << "interleaved 1F1B needs the microbatch count (" << m
                                << ") to be a multiple of pp (" << pp << ")";
  if (options.zero1 && (dp < 2 || options.training.optimizer == "none"))
    return original.emitError() << "ZeRO-1 partitions optimizer state over data-parallel "
                                   "ranks: it needs dp >= 2 and an optimizer";
  if (failed(specializeBatch(*module, options.batch / (dp * m))))
    return failure();
  // Partition first: its rules match parameters read directly, and the
  // mixed-precision casts then go after each rank's own shards.
  if (failed(partitionTensorParallel(*module, tp, /*gatherOutputs=*/!options.train)))
    return failure();
  if (options.bf16 && failed(applyMixedPrecision(*module)))
    return failure();
  const char *entryName = options.train ? "loss" : "forward";
  auto entry = module->lookupSymbol<func::FuncOp>(entryName);
  if (!entry || entry.isExternal())
    return original.emitError() << "model has no @" << entryName << " function to compile"
                                << (options.train ? " (training differentiates @loss, which "
                                                    "returns a scalar loss)"
                                                  : "");
  Lowerer lowerer(*module, options);
  FailureOr<rt::RankProgram> rank = lowerer.run(entry, /*keepProgram=*/options.train);
  if (failed(rank))
    return failure();

  rt::Manifest manifest;
  manifest.model = options.modelName;
  manifest.mode = options.train ? "train" : "infer";
  manifest.batch = options.batch;
  manifest.seed = options.seed;
  manifest.plan = options.plan;
  int64_t nextKernel = 0;
  if (!options.train) { // one rank, or the tensor-parallel ranks of one replica
    Grid grid{1, tp, 1};
    for (int64_t g = 0; g < tp; ++g) {
      rt::RankProgram r = *rank;
      r.rank = g;
      if (tp > 1)
        grid.describe(r);
      for (rt::Parameter &p : r.params)
        if (p.shard.axis >= 0)
          p.shard.index = g;
      if (options.fuse)
        fuseElementwise(r, nextKernel);
      planMemory(r, {"forward"});
      manifest.ranks.push_back(std::move(r));
    }
    return manifest;
  }
  if (rank->outputs.size() != 1 || !rank->buffers[rank->outputs[0].buffer].shape.empty())
    return entry.emitError() << "@loss must return one scalar loss";

  // Pipeline chunks: units (embedding, layers, head) split over pp x vpp chunks.
  bool pipelined = pp > 1 || m > 1;
  int64_t chunks = pp * vpp;
  std::vector<int64_t> chunkOf;
  if (pipelined) {
    std::vector<std::string> layers;
    for (const auto &rec : lowerer.records)
      layers.push_back(rec.layer);
    int64_t units = 0;
    std::vector<int64_t> unit = unitsOf(layers, units);
    std::vector<int64_t> perChunk = options.chunkUnits;
    if (perChunk.empty()) {
      if (units < chunks)
        return original.emitError()
               << "pp x vpp = " << chunks << " pipeline chunks, but the model has only " << units
               << " units to split (what precedes the first layer, each layer, what follows the "
                  "last); use fewer stages";
      for (int64_t c = 0; c < chunks; ++c)
        perChunk.push_back((c + 1) * units / chunks - c * units / chunks);
    }
    if (int64_t(perChunk.size()) != chunks ||
        std::accumulate(perChunk.begin(), perChunk.end(), int64_t(0)) != units ||
        std::any_of(perChunk.begin(), perChunk.end(), [](int64_t n) { return n < 1; }))
      return original.emitError() << "the plan's stages do not cover the model's " << units
                                  << " units in " << chunks << " non-empty chunks";
    std::vector<int64_t> chunkOfUnit;
    for (int64_t c = 0; c < chunks; ++c)
      chunkOfUnit.insert(chunkOfUnit.end(), perChunk[c], c);
    for (int64_t u : unit)
      chunkOf.push_back(chunkOfUnit[u]);
  }
  Autodiff autodiff(lowerer, module->getContext(), options.training.recompute, chunkOf);
  autodiff.lossScale = 1.0 / double(m);
  if (failed(autodiff.run(rank->outputs[0].buffer)))
    return failure();

  Lowered l;
  l.base = lowerer.rankProgram(); // parameters now carry their gradients
  l.forward = std::move(lowerer.forwardProgram());
  l.backward = std::move(autodiff.backward);
  l.backwardChunk = std::move(autodiff.backwardChunk);
  l.paramGrads = autodiff.paramGrads;
  l.loss = l.base.outputs[0].buffer;
  l.chunks = chunks;
  for (const auto &rec : lowerer.records)
    if (rec.instr >= 0)
      l.forwardChunk.push_back(chunkOf.empty() ? 0 : chunkOf[&rec - lowerer.records.data()]);

  Grid grid{dp, tp, pp};
  for (int64_t g = 0; g < grid.size(); ++g) {
    rt::RankProgram r = l.base;
    r.rank = g;
    if (grid.size() > 1)
      grid.describe(r);
    for (rt::Parameter &p : r.params)
      if (p.shard.axis >= 0)
        p.shard.index = grid.tpOf(g);
    int64_t stage = grid.ppOf(g);
    int64_t lossStage = pp - 1;
    if (pipelined) {
      PipelineRank builder(l, r, grid, vpp, m, schedule);
      builder.build();
      lossStage = builder.lossStage();
    } else {
      r.programs["forward"] = l.forward;
      r.programs["backward"] = l.backward;
    }
    // Gradient reductions before the update: a parameter held by several
    // stages (tied embeddings) sums its gradients over them, then every
    // gradient and the loss are averaged over the data-parallel replicas.
    std::vector<rt::Instruction> reduce;
    std::vector<bool> normCounts;
    std::map<int64_t, std::set<int64_t>> stagesOf; // param buffer -> stages using it
    for (auto &[key, grad] : l.paramGrads)
      stagesOf[key.first].insert(key.second % pp);
    for (const rt::Parameter &p : r.params) {
      const std::set<int64_t> &stages = stagesOf[p.buffer];
      bool counted = (p.shard.axis >= 0 || grid.tpOf(g) == 0) &&
                     (stages.empty() || *stages.begin() == stage);
      normCounts.push_back(counted);
      if (p.grad < 0 || stages.size() < 2)
        continue;
      std::string name = "stages";
      std::vector<int64_t> members;
      for (int64_t s : stages) {
        name += "." + std::to_string(s);
        members.push_back(grid.rankOf(grid.dpOf(g), grid.tpOf(g), s));
      }
      r.groups[name] = members;
      reduce.push_back({"all_reduce", {p.grad}, {p.grad}, json{{"reduction", "sum"}, {"group", name}}});
    }
    std::map<int64_t, int64_t> zeroShards; // parameter buffer -> its gradient slice
    int64_t lastBucketEvent = -1;
    if (dp > 1) {
      // ZeRO-1: a slice of ceil(n / dp) elements of every gradient per rank.
      std::map<int64_t, int64_t> shardOfGrad;
      if (options.zero1)
        for (const rt::Parameter &p : r.params)
          if (p.grad >= 0) {
            rt::Buffer slice;
            slice.id = static_cast<int64_t>(r.buffers.size());
            slice.name = p.name + ".grad_shard";
            int64_t n = rt::numElements(r.buffers[p.grad].shape).value_or(0);
            slice.shape = {(n + dp - 1) / dp};
            slice.bytes = slice.shape[0] * 4;
            r.buffers.push_back(slice);
            zeroShards[p.buffer] = slice.id;
            shardOfGrad[p.grad] = slice.id;
          }
      // Gradients held by one stage are averaged over the replicas as soon
      // as backward finishes them; shared ones after their stages' sum.
      std::vector<int64_t> early;
      for (const rt::Parameter &p : r.params) {
        if (p.grad < 0)
          continue;
        if (stagesOf[p.buffer].size() < 2)
          early.push_back(p.grad);
        else if (options.zero1)
          reduce.push_back({"reduce_scatter", {p.grad}, {shardOfGrad[p.grad]},
                            json{{"reduction", "mean"}, {"group", "dp"}}});
        else
          reduce.push_back({"all_reduce", {p.grad}, {p.grad}, json{{"reduction", "mean"}, {"group", "dp"}}});
      }
      lastBucketEvent = placeGradientBuckets(r, r.programs[pipelined ? "step" : "backward"], early,
                                             options.bucketBytes, shardOfGrad);
      if (stage == lossStage)
        reduce.push_back({"all_reduce", {r.outputs[0].buffer}, {r.outputs[0].buffer},
                          json{{"reduction", "mean"}, {"group", "dp"}}});
    }
    if (pp > 1) // every rank reports the loss
      reduce.push_back({"broadcast_from", {r.outputs[0].buffer}, {r.outputs[0].buffer},
                        json{{"root", lossStage}, {"group", "pp"}}});
    if (lastBucketEvent >= 0) // the buckets issued during backward are done before anything reads them
      reduce.insert(reduce.begin(), rt::Instruction{"event_wait", {}, {}, json{{"event", lastBucketEvent}}});
    // The clipping norm sums over the ranks that hold distinct parts: the
    // model-parallel ranks, and with ZeRO-1 the gradient slices of every replica.
    std::string normGroup = options.zero1 ? "all" : tp * pp > 1 ? "mp" : "";
    buildUpdate(r, options.training, std::move(reduce), normCounts, normGroup, zeroShards);
    joinSliceGradients(r);
    attentionReadsPackedQkv(r, "forward", "backward");
    attentionReadsPackedQkv(r, "step", "step");
    castWeightsOncePerStep(r);
    optimizerReadsBf16Gradients(r);
    addsReadBf16Gradients(r);
    hoistParameterCasts(r);
    if (options.fuse)
      fuseElementwise(r, nextKernel);
    if (pipelined || grid.size() > 1)
      compactRank(r);
    planMemory(r, {"forward", "step", "backward", "update"});
    manifest.ranks.push_back(std::move(r));
  }
  return manifest;
}

LogicalResult mlir::loom::writeBundle(ModuleOp module, const BundleOptions &options,
                                      const std::string &dir, rt::Manifest *out) {
  FailureOr<rt::Manifest> manifest = lowerForward(module, options);
  if (failed(manifest))
    return failure();
  try {
    std::vector<std::vector<char>> storage;
    std::vector<rt::SafetensorsTensorRef> refs;
    std::optional<rt::SafetensorsFile> given;
    if (!options.weightsFile.empty())
      given = rt::readSafetensors(options.weightsFile);
    // The weights file holds every parameter whole, as one device has it;
    // each rank takes its own parameters, or its part of a split one.
    std::vector<std::pair<rt::Parameter, rt::Buffer>> all;
    std::set<std::string> seen;
    for (const rt::RankProgram &rank : manifest->ranks)
      for (const rt::Parameter &p : rank.params)
        if (seen.insert(p.name).second) {
          rt::Buffer b = rank.buffers[p.buffer];
          if (p.shard.axis >= 0) {
            b.shape = p.shard.fullShape;
            b.bytes *= p.shard.parts;
          }
          all.push_back({p, b});
        }
    storage.reserve(all.size());
    for (const auto &[p, b] : all) {
      if (options.noWeights)
        break;
      storage.emplace_back(static_cast<size_t>(b.bytes));
      char *dst = storage.back().data();
      if (given) {
        auto it = given->tensors.find(p.name);
        if (it == given->tensors.end())
          return module.emitError() << options.weightsFile << ": parameter '" << p.name
                                    << "' is missing";
        if (it->second.dtype != b.dtype || it->second.shape != b.shape)
          return module.emitError()
                 << options.weightsFile << ": parameter '" << p.name << "' is "
                 << rt::dtypeName(it->second.dtype) << rt::shapeStr(it->second.shape)
                 << " but the model declares " << rt::dtypeName(b.dtype) << rt::shapeStr(b.shape);
        std::memcpy(dst, given->data.data() + it->second.offset, b.bytes);
      } else {
        rt::initialiseInto(p.init, b, options.seed, p.name, dst);
      }
      refs.push_back({p.name, b.dtype, b.shape, dst, static_cast<size_t>(b.bytes)});
    }
    if (options.fuse) { // one PTX module with every rank's fused kernels
      std::string error;
      FailureOr<std::string> ptx = fusedKernelsPtx(manifest->ranks, error);
      if (failed(ptx))
        return emitError(module.getLoc()) << error;
      if (!ptx->empty()) {
        manifest->kernels = "kernels.ptx";
        ::mkdir(dir.c_str(), 0755);
        rt::writeFileAtomically(dir + "/kernels.ptx", ptx->data(), ptx->size());
      }
    }
    if (options.noWeights) {
      manifest->weights = ""; // the runtime initialises from the seed
      rt::writeManifest(*manifest, dir);
    } else {
      rt::writeManifest(*manifest, dir);
      rt::writeSafetensors(dir + "/" + manifest->weights, refs,
                           {{"model", options.modelName}, {"seed", std::to_string(options.seed)}});
    }
  } catch (const rt::Error &e) {
    return module.emitError() << e.what();
  }
  if (out)
    *out = std::move(*manifest);
  return success();
}
