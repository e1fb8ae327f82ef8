//===- StepState.cpp - The lowered step as passes read and write it -------===//

#include "passes/StepState.h"
#include "dialects/loomrt/IR/LoomRtDialect.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinTypes.h"

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

//===----------------------------------------------------------------------===//
// JSON <-> attributes
//===----------------------------------------------------------------------===//

Attribute mlir::loom::jsonToAttr(MLIRContext *ctx, const json &v) {
  Builder b(ctx);
  switch (v.type()) {
  case json::value_t::boolean:
    return b.getBoolAttr(v.get<bool>());
  case json::value_t::number_integer:
    return b.getI64IntegerAttr(v.get<int64_t>());
  case json::value_t::number_unsigned:
    return b.getI64IntegerAttr(static_cast<int64_t>(v.get<uint64_t>()));
  case json::value_t::number_float:
    return b.getF64FloatAttr(v.get<double>());
  case json::value_t::string:
    return b.getStringAttr(v.get<std::string>());
  case json::value_t::array: {
    bool integers = std::all_of(v.begin(), v.end(), [](const json &e) {
      return e.is_number_integer();
    });
    if (integers) {
      SmallVector<int64_t> values;
      for (const json &e : v)
        values.push_back(e.is_number_unsigned() ? int64_t(e.get<uint64_t>()) : e.get<int64_t>());
      return b.getDenseI64ArrayAttr(values);
    }
    SmallVector<Attribute> items;
    for (const json &e : v)
      items.push_back(jsonToAttr(ctx, e));
    return b.getArrayAttr(items);
  }
  case json::value_t::object: {
    SmallVector<NamedAttribute> items;
    for (auto it = v.begin(); it != v.end(); ++it)
      items.push_back(b.getNamedAttr(it.key(), jsonToAttr(ctx, it.value())));
    return b.getDictionaryAttr(items);
  }
  default: // null, binary: the compiler writes neither
    return UnitAttr::get(ctx);
  }
}

FailureOr<json> mlir::loom::attrToJson(Attribute a) {
  if (auto b = dyn_cast<BoolAttr>(a)) // an i1 IntegerAttr: before the integers
    return json(b.getValue());
  if (auto i = dyn_cast<IntegerAttr>(a))
    return json(i.getValue().getSExtValue());
  if (auto f = dyn_cast<FloatAttr>(a))
    return json(f.getValueAsDouble());
  if (isa<UnitAttr>(a))
    return json(true);
  if (auto s = dyn_cast<StringAttr>(a))
    return json(s.getValue().str());
  if (auto arr = dyn_cast<DenseI64ArrayAttr>(a))
    return json(std::vector<int64_t>(arr.asArrayRef().begin(), arr.asArrayRef().end()));
  if (auto arr = dyn_cast<ArrayAttr>(a)) {
    json out = json::array();
    for (Attribute e : arr) {
      FailureOr<json> v = attrToJson(e);
      if (failed(v))
        return failure();
      out.push_back(std::move(*v));
    }
    return out;
  }
  if (auto dict = dyn_cast<DictionaryAttr>(a)) {
    json out = json::object();
    for (NamedAttribute n : dict) {
      FailureOr<json> v = attrToJson(n.getValue());
      if (failed(v))
        return failure();
      out[n.getName().getValue().str()] = std::move(*v);
    }
    return out;
  }
  return failure();
}

FailureOr<json> mlir::loom::instructionAttr(Operation *op, NamedAttribute attr) {
  Attribute a = attr.getValue();
  if (isa<IntegerAttr, FloatAttr, UnitAttr, BoolAttr, StringAttr, DenseI64ArrayAttr>(a))
    return attrToJson(a);
  return op->emitError() << "cannot lower attribute '" << attr.getName().getValue() << "' ("
                         << a << ") into a bundle instruction";
}

Type mlir::loom::elementType(MLIRContext *ctx, loom_dtype_t t) {
  switch (t) {
  case LOOM_F64: return Float64Type::get(ctx);
  case LOOM_BF16: return BFloat16Type::get(ctx);
  case LOOM_F16: return Float16Type::get(ctx);
  case LOOM_I32: return IntegerType::get(ctx, 32);
  case LOOM_I64: return IntegerType::get(ctx, 64);
  default: return Float32Type::get(ctx);
  }
}

std::optional<loom_dtype_t> mlir::loom::dtypeOf(Type t) {
  if (t.isF32()) return LOOM_F32;
  if (t.isF64()) return LOOM_F64;
  if (t.isBF16()) return LOOM_BF16;
  if (t.isF16()) return LOOM_F16;
  if (t.isInteger(32)) return LOOM_I32;
  if (t.isInteger(64)) return LOOM_I64;
  return std::nullopt;
}

//===----------------------------------------------------------------------===//
// Compile options on the module
//===----------------------------------------------------------------------===//

void mlir::loom::setCompileOptions(ModuleOp module, const BundleOptions &o) {
  const TrainOptions &t = o.training;
  json options = {{"batch", o.batch},
                  {"seed", o.seed},
                  {"model", o.modelName},
                  {"train", o.train},
                  {"bf16", o.bf16},
                  {"fuse", o.fuse},
                  {"optimizer", t.optimizer},
                  {"lr", t.lr},
                  {"min_lr", t.minLr},
                  {"beta1", t.beta1},
                  {"beta2", t.beta2},
                  {"eps", t.eps},
                  {"weight_decay", t.weightDecay},
                  {"momentum", t.momentum},
                  {"clip", t.clip},
                  {"warmup", t.warmup},
                  {"total_steps", t.totalSteps}};
  json plan = {{"dp", o.dataParallel},
               {"tp", o.tensorParallel},
               {"pp", o.pipelineParallel},
               {"vpp", o.virtualStages},
               {"microbatches", o.microbatches},
               {"schedule", o.schedule},
               {"zero", o.zero3 ? 3 : o.zero2 ? 2 : o.zero1 ? 1 : 0},
               {"stages", o.chunkUnits},
               {"bucket_bytes", o.bucketBytes},
               {"recompute", std::vector<std::string>(t.recompute.begin(), t.recompute.end())},
               {"record", o.plan}};
  if (o.gradReduceBf16) // recorded only when set: other bundles stay as they were
    plan["grad_reduce"] = "bf16";
  else if (o.gradReduceWide)
    plan["grad_reduce"] = "wide";
  if (o.sequenceParallel)
    plan["sequence_parallel"] = true;
  if (o.serve.enabled)
    options["serve"] = {{"max_batch", o.serve.maxBatch},   {"max_seq", o.serve.maxSeq},
                        {"block_size", o.serve.blockSize}, {"kv_blocks", o.serve.kvBlocks},
                        {"prefill_chunk", o.serve.prefillChunk}, {"weight_layout", o.serve.weightLayout}};
  MLIRContext *ctx = module.getContext();
  module->setAttr("loom.options", jsonToAttr(ctx, options));
  module->setAttr("loom.plan", jsonToAttr(ctx, plan));
}

FailureOr<BundleOptions> mlir::loom::getCompileOptions(ModuleOp module) {
  BundleOptions o;
  json options = json::object(), plan = json::object();
  for (auto [name, into] : {std::pair<const char *, json *>{"loom.options", &options},
                            std::pair<const char *, json *>{"loom.plan", &plan}}) {
    Attribute a = module->getAttr(name);
    if (!a)
      continue;
    FailureOr<json> v = failure();
    if (isa<DictionaryAttr>(a))
      v = attrToJson(a);
    if (failed(v))
      return module.emitError() << "'" << name << "' must be a dictionary of numbers, strings "
                                   "and arrays, got " << a;
    *into = std::move(*v);
  }
  try {
    TrainOptions &t = o.training;
    o.batch = options.value("batch", o.batch);
    o.seed = options.value("seed", o.seed);
    o.modelName = options.value("model", o.modelName);
    o.train = options.value("train", o.train);
    o.bf16 = options.value("bf16", o.bf16);
    o.fuse = options.value("fuse", o.fuse);
    t.optimizer = options.value("optimizer", t.optimizer);
    t.lr = options.value("lr", t.lr);
    t.minLr = options.value("min_lr", t.minLr);
    t.beta1 = options.value("beta1", t.beta1);
    t.beta2 = options.value("beta2", t.beta2);
    t.eps = options.value("eps", t.eps);
    t.weightDecay = options.value("weight_decay", t.weightDecay);
    t.momentum = options.value("momentum", t.momentum);
    t.clip = options.value("clip", t.clip);
    t.warmup = options.value("warmup", t.warmup);
    t.totalSteps = options.value("total_steps", t.totalSteps);
    if (options.contains("serve")) {
      const json &sv = options["serve"];
      ServeOptions &so = o.serve;
      so.enabled = true;
      so.maxBatch = sv.value("max_batch", so.maxBatch);
      so.maxSeq = sv.value("max_seq", so.maxSeq);
      so.blockSize = sv.value("block_size", so.blockSize);
      so.kvBlocks = sv.value("kv_blocks", so.kvBlocks);
      so.prefillChunk = sv.value("prefill_chunk", so.prefillChunk);
      so.weightLayout = sv.value("weight_layout", so.weightLayout);
    }
    o.dataParallel = plan.value("dp", o.dataParallel);
    o.tensorParallel = plan.value("tp", o.tensorParallel);
    o.pipelineParallel = plan.value("pp", o.pipelineParallel);
    o.virtualStages = plan.value("vpp", o.virtualStages);
    o.microbatches = plan.value("microbatches", o.microbatches);
    o.schedule = plan.value("schedule", o.schedule);
    int zero = plan.value("zero", 0);
    if (zero < 0 || zero > 3)
      return module.emitError() << "'loom.plan' has zero " << zero << "; expected 0, 1, 2 or 3";
    o.zero1 = zero >= 1;
    o.zero2 = zero >= 2;
    o.zero3 = zero == 3;
    std::string reduce = plan.value("grad_reduce", std::string("f32"));
    if (reduce != "f32" && reduce != "bf16" && reduce != "wide")
      return module.emitError() << "'loom.plan' has grad_reduce '" << reduce << "'; expected f32, wide or bf16";
    o.gradReduceBf16 = reduce == "bf16";
    o.gradReduceWide = reduce == "wide";
    o.sequenceParallel = plan.value("sequence_parallel", false);
    if (plan.contains("stages"))
      o.chunkUnits = plan["stages"].get<std::vector<int64_t>>();
    o.bucketBytes = plan.value("bucket_bytes", o.bucketBytes);
    if (plan.contains("recompute"))
      for (const json &r : plan["recompute"])
        t.recompute.insert(r.get<std::string>());
    o.plan = plan.value("record", json::object());
  } catch (const json::exception &e) {
    return module.emitError() << "malformed 'loom.options' or 'loom.plan': " << e.what();
  }
  return o;
}

//===----------------------------------------------------------------------===//
// The loomrt.bundle <-> Step
//===----------------------------------------------------------------------===//

namespace {

std::optional<rt::BufferRole> roleOf(StringRef s) {
  for (rt::BufferRole r : {rt::BufferRole::Input, rt::BufferRole::Output, rt::BufferRole::Param,
                           rt::BufferRole::Activation, rt::BufferRole::State, rt::BufferRole::Cache})
    if (s == rt::roleName(r))
      return r;
  return std::nullopt;
}

std::vector<int64_t> toVector(ArrayRef<int64_t> a) { return std::vector<int64_t>(a.begin(), a.end()); }

} // namespace

namespace {

FailureOr<rt::Instruction> readInstr(loomrt::InstrOp ins) {
  rt::Instruction i;
  i.op = ins.getOp().str();
  i.in = toVector(ins.getIns());
  i.out = toVector(ins.getOuts());
  FailureOr<json> attrs = attrToJson(ins->getDiscardableAttrDictionary());
  if (failed(attrs))
    return ins.emitError() << "has an attribute that is not JSON";
  i.attrs = std::move(*attrs);
  return i;
}

/// A fused region as the runtime's `fused` instruction: its steps (op,
/// attributes, and args indexing the inputs then the earlier steps) and the
/// values it stores (`results`).
FailureOr<rt::Instruction> readFused(loomrt::FusedOp fused) {
  rt::Instruction i;
  i.op = "fused";
  i.in = toVector(fused.getIns());
  i.out = toVector(fused.getOuts());
  FailureOr<json> attrs = attrToJson(fused->getDiscardableAttrDictionary());
  if (failed(attrs))
    return fused.emitError() << "has an attribute that is not JSON";
  i.attrs = std::move(*attrs);
  Block &body = fused.getBody().front();
  llvm::DenseMap<Value, int64_t> index;
  for (BlockArgument arg : body.getArguments())
    index[arg] = arg.getArgNumber();
  json steps = json::array();
  for (auto step : body.getOps<loomrt::StepOp>()) {
    FailureOr<json> s = attrToJson(step->getDiscardableAttrDictionary());
    if (failed(s))
      return step.emitError() << "has an attribute that is not JSON";
    (*s)["op"] = step.getOp().str();
    json args = json::array();
    for (Value v : step.getArgs())
      args.push_back(index.at(v));
    (*s)["args"] = std::move(args);
    index[step.getResult()] = static_cast<int64_t>(body.getNumArguments() + steps.size());
    steps.push_back(std::move(*s));
  }
  json results = json::array();
  for (Value v : cast<loomrt::YieldOp>(body.getTerminator()).getValues())
    results.push_back(index.at(v));
  i.attrs["steps"] = std::move(steps);
  i.attrs["results"] = std::move(results);
  return i;
}

/// Writes a `fused` instruction as a loomrt.fused region; false (and
/// nothing written) where its steps are not a well-formed chain.
bool writeFused(OpBuilder &b, Location loc, const rt::RankProgram &r, const rt::Instruction &i) {
  MLIRContext *ctx = b.getContext();
  if (!i.attrs.is_object() || !i.attrs.contains("steps") || !i.attrs.contains("results") ||
      !i.attrs["steps"].is_array() || !i.attrs["results"].is_array() ||
      i.attrs["results"].size() != i.out.size())
    return false;
  for (int64_t id : i.in)
    if (id < 0 || id >= static_cast<int64_t>(r.buffers.size()))
      return false;
  // Check the chain before building anything.
  size_t values = i.in.size();
  for (const json &step : i.attrs["steps"]) {
    if (!step.is_object() || !step.contains("op") || !step["op"].is_string() ||
        !step.contains("args") || !step["args"].is_array())
      return false;
    for (const json &a : step["args"])
      if (!a.is_number_integer() || a.get<int64_t>() < 0 || a.get<size_t>() >= values)
        return false;
    ++values;
  }
  for (const json &v : i.attrs["results"])
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<size_t>() >= values)
      return false;
  json rest = i.attrs;
  rest.erase("steps");
  rest.erase("results");
  OpBuilder::InsertionGuard guard(b);
  auto fused = b.create<loomrt::FusedOp>(loc, i.in, i.out);
  if (!rest.empty())
    fused->setDiscardableAttrs(cast<DictionaryAttr>(jsonToAttr(ctx, rest)));
  Block *body = new Block();
  fused.getBody().push_back(body);
  SmallVector<Value> value;
  for (int64_t id : i.in)
    value.push_back(body->addArgument(elementType(ctx, r.buffers[id].dtype), loc));
  b.setInsertionPointToEnd(body);
  for (const json &step : i.attrs["steps"]) {
    SmallVector<Value> args;
    for (const json &a : step["args"])
      args.push_back(value[a.get<size_t>()]);
    auto op = b.create<loomrt::StepOp>(loc, b.getF32Type(), step["op"].get<std::string>(), args);
    json attrs = step;
    attrs.erase("op");
    attrs.erase("args");
    if (!attrs.empty())
      op->setDiscardableAttrs(cast<DictionaryAttr>(jsonToAttr(ctx, attrs)));
    value.push_back(op.getResult());
  }
  SmallVector<Value> yielded;
  for (const json &v : i.attrs["results"])
    yielded.push_back(value[v.get<size_t>()]);
  b.create<loomrt::YieldOp>(loc, yielded);
  return true;
}

} // namespace

FailureOr<Step> mlir::loom::readStep(ModuleOp module, StringRef pass) {
  loomrt::BundleOp bundle;
  for (auto b : module.getOps<loomrt::BundleOp>())
    bundle = b;
  if (!bundle)
    return module.emitError() << pass << " runs on the lowered step (a loomrt.bundle); run "
                                         "loom-lower-to-step first";
  Step step;
  rt::Manifest &m = step.manifest;
  m.model = bundle.getModel().str();
  m.mode = bundle.getMode().str();
  m.batch = bundle.getBatch();
  m.seed = static_cast<uint64_t>(bundle.getSeed());
  m.weights = bundle.getWeights().str();
  m.kernels = bundle.getKernels().str();
  FailureOr<json> plan = attrToJson(bundle.getPlan());
  if (failed(plan))
    return bundle.emitError() << "the plan holds an attribute that is not JSON";
  m.plan = std::move(*plan);
  for (auto rankOp : bundle.getBody().getOps<loomrt::RankOp>()) {
    StepRank sr;
    rt::RankProgram &r = sr.program;
    if (auto stage = rankOp->getAttrOfType<IntegerAttr>("loom.loss_stage"))
      sr.lossStage = stage.getInt();
    r.rank = rankOp.getRank();
    r.device = rankOp.getDevice().str();
    r.arenaBytes = rankOp.getArenaBytes();
    r.peakActivationBytes = rankOp.getPeakBytes();
    for (NamedAttribute c : rankOp.getCoords())
      if (auto i = dyn_cast<IntegerAttr>(c.getValue()))
        r.coords[c.getName().str()] = i.getInt();
    for (Operation &op : rankOp.getBody().front()) {
      if (auto b = dyn_cast<loomrt::BufferOp>(op)) {
        rt::Buffer buf;
        buf.id = b.getId();
        buf.name = b.getName().str();
        auto type = dyn_cast<RankedTensorType>(b.getType());
        std::optional<loom_dtype_t> dt = type ? dtypeOf(type.getElementType()) : std::nullopt;
        std::optional<rt::BufferRole> role = roleOf(b.getRole());
        if (!dt || !role || buf.id != int64_t(r.buffers.size()))
          return b.emitError() << "malformed buffer (ids in order from 0, a ranked tensor of "
                                  "f32/f64/bf16/f16/i32/i64, a known role)";
        buf.dtype = *dt;
        buf.shape = toVector(type.getShape());
        buf.role = *role;
        buf.offset = b.getOffset();
        buf.bytes = b.getBytes() ? int64_t(*b.getBytes())
                                 : type.getNumElements() * int64_t(rt::dtypeSize(*dt));
        buf.viewOf = b.getViewOf();
        buf.viewOffset = int64_t(b.getViewOffset());
        r.buffers.push_back(std::move(buf));
      } else if (auto p = dyn_cast<loomrt::ParamOp>(op)) {
        rt::Parameter param;
        param.name = p.getName().str();
        param.buffer = p.getBuffer();
        param.init = {p.getInit().str(), p.getScale().convertToDouble()};
        param.grad = p.getGrad();
        param.shard.axis = p.getShardAxis();
        param.shard.parts = p.getShardParts();
        param.shard.index = p.getShardIndex();
        param.shard.blocks = p.getShardBlocks();
        param.shard.fullShape = toVector(p.getFullShape());
        param.shard.zeroParts = p.getZeroParts();
        param.shard.zeroIndex = p.getZeroIndex();
        r.params.push_back(std::move(param));
      } else if (auto in = dyn_cast<loomrt::InputOp>(op)) {
        r.inputs.push_back({in.getName().str(), int64_t(in.getBuffer()), int64_t(in.getLimit())});
      } else if (auto out = dyn_cast<loomrt::OutputOp>(op)) {
        r.outputs.push_back({out.getName().str(), int64_t(out.getBuffer()), int64_t(out.getLimit())});
      } else if (auto st = dyn_cast<loomrt::StateOp>(op)) {
        r.state.push_back({st.getName().str(), int64_t(st.getBuffer()), int64_t(st.getLimit())});
      } else if (auto g = dyn_cast<loomrt::GroupOp>(op)) {
        r.groups[g.getName().str()] = toVector(g.getMembers());
      } else if (auto pg = dyn_cast<loomrt::ParamGradOp>(op)) {
        sr.paramGrads[{pg.getParam(), pg.getChunk()}] = pg.getGrad();
      } else if (auto z = dyn_cast<loomrt::ZeroShardOp>(op)) {
        sr.zeroShards[z.getParam()] = z.getShard();
      } else if (auto pg = dyn_cast<loomrt::PartialGradOp>(op)) {
        sr.partialGrads[pg.getParam()] = pg.getGroup().str();
      } else if (auto prog = dyn_cast<loomrt::ProgramOp>(op)) {
        std::vector<rt::Instruction> &list = r.programs[prog.getName().str()];
        for (Operation &o : prog.getBody().front()) {
          FailureOr<rt::Instruction> i = failure();
          if (auto ins = dyn_cast<loomrt::InstrOp>(o))
            i = readInstr(ins);
          else if (auto fused = dyn_cast<loomrt::FusedOp>(o))
            i = readFused(fused);
          else
            return o.emitError() << "is not an instruction of a loomrt.program";
          if (failed(i))
            return failure();
          list.push_back(std::move(*i));
        }
      }
    }
    step.ranks.push_back(std::move(sr));
  }
  if (auto serve = bundle->getAttrOfType<DictionaryAttr>("serve")) {
    FailureOr<json> doc = attrToJson(serve);
    if (failed(doc))
      return bundle.emitError() << "the serve attribute is not JSON";
    try {
      m.serve = rt::parseServeConfig(*doc, toManifest(step), "loomrt.bundle");
    } catch (const std::exception &e) {
      return bundle.emitError() << e.what();
    }
  }
  return step;
}

void mlir::loom::writeStep(ModuleOp module, const Step &step) {
  MLIRContext *ctx = module.getContext();
  ctx->getOrLoadDialect<loomrt::LoomRtDialect>();
  for (auto b : llvm::make_early_inc_range(module.getOps<loomrt::BundleOp>()))
    b.erase();
  OpBuilder b = OpBuilder::atBlockEnd(module.getBody());
  Location loc = module.getLoc();
  const rt::Manifest &m = step.manifest;
  auto bundle = b.create<loomrt::BundleOp>(
      loc, m.model, m.mode, m.batch, static_cast<int64_t>(m.seed), m.weights, m.kernels,
      cast<DictionaryAttr>(jsonToAttr(ctx, m.plan.is_object() ? m.plan : json::object())));
  if (m.serve.enabled())
    bundle->setAttr("serve", jsonToAttr(ctx, rt::toJson(m.serve)));
  Block *body = new Block();
  bundle.getBody().push_back(body);
  for (const StepRank &sr : step.ranks) {
    const rt::RankProgram &r = sr.program;
    b.setInsertionPointToEnd(body);
    SmallVector<NamedAttribute> coords;
    for (auto &[k, v] : r.coords)
      coords.push_back(b.getNamedAttr(k, b.getI64IntegerAttr(v)));
    auto rank = b.create<loomrt::RankOp>(loc, r.rank, r.device, r.arenaBytes,
                                         r.peakActivationBytes, b.getDictionaryAttr(coords));
    if (sr.lossStage >= 0)
      rank->setAttr("loom.loss_stage", b.getI64IntegerAttr(sr.lossStage));
    Block *rb = new Block();
    rank.getBody().push_back(rb);
    b.setInsertionPointToEnd(rb);
    for (auto &[name, members] : r.groups)
      b.create<loomrt::GroupOp>(loc, name, members);
    for (const rt::Buffer &buf : r.buffers) {
      auto type = RankedTensorType::get(buf.shape, elementType(ctx, buf.dtype));
      int64_t natural = type.getNumElements() * int64_t(rt::dtypeSize(buf.dtype));
      auto op = b.create<loomrt::BufferOp>(loc, buf.id, buf.name, type, rt::roleName(buf.role),
                                           buf.offset, IntegerAttr(), buf.viewOf, buf.viewOffset);
      if (buf.bytes != natural)
        op.setBytes(buf.bytes);
    }
    for (const rt::Parameter &p : r.params) {
      auto op = b.create<loomrt::ParamOp>(loc, p.name, p.buffer, p.init.kind, APFloat(p.init.scale), p.grad,
                                          p.shard.axis, p.shard.parts, p.shard.index, p.shard.blocks,
                                          p.shard.fullShape, 1, 0);
      if (p.shard.zeroParts > 1) // ZeRO-3's chunk; the attributes are left out otherwise
        op.setZeroParts(p.shard.zeroParts), op.setZeroIndex(p.shard.zeroIndex);
    }
    for (const rt::NamedBuffer &nb : r.inputs)
      b.create<loomrt::InputOp>(loc, nb.name, nb.buffer, nb.limit);
    for (const rt::NamedBuffer &nb : r.outputs)
      b.create<loomrt::OutputOp>(loc, nb.name, nb.buffer, nb.limit);
    for (const rt::NamedBuffer &nb : r.state)
      b.create<loomrt::StateOp>(loc, nb.name, nb.buffer, nb.limit);
    for (auto &[key, grad] : sr.paramGrads)
      b.create<loomrt::ParamGradOp>(loc, key.first, key.second, grad);
    for (auto &[param, shard] : sr.zeroShards)
      b.create<loomrt::ZeroShardOp>(loc, param, shard);
    for (auto &[param, group] : sr.partialGrads)
      b.create<loomrt::PartialGradOp>(loc, param, group);
    for (auto &[name, list] : r.programs) {
      b.setInsertionPointToEnd(rb);
      auto prog = b.create<loomrt::ProgramOp>(loc, name);
      Block *pb = new Block();
      prog.getBody().push_back(pb);
      b.setInsertionPointToEnd(pb);
      for (const rt::Instruction &i : list) {
        if (i.op == "fused" && writeFused(b, loc, r, i))
          continue;
        auto ins = b.create<loomrt::InstrOp>(loc, i.op, i.in, i.out);
        if (i.attrs.is_object() && !i.attrs.empty())
          ins->setDiscardableAttrs(cast<DictionaryAttr>(jsonToAttr(ctx, i.attrs)));
      }
    }
  }
}

LogicalResult mlir::loom::updateStep(ModuleOp module, StringRef pass,
                                     function_ref<LogicalResult(Step &)> fn) {
  FailureOr<Step> step = readStep(module, pass);
  if (failed(step) || failed(fn(*step)))
    return failure();
  writeStep(module, *step);
  return success();
}

LogicalResult mlir::loom::updateEachRank(ModuleOp module, StringRef pass,
                                         function_ref<void(StepRank &)> fn) {
  return updateStep(module, pass, [&](Step &step) {
    for (StepRank &rank : step.ranks)
      fn(rank);
    return success();
  });
}

LogicalResult mlir::loom::updateGroupPrograms(
    ModuleOp module, StringRef pass, const std::string &group,
    function_ref<void(rt::RankProgram &, std::vector<rt::Instruction> &, int64_t &)> fn) {
  return updateEachRank(module, pass, [&](StepRank &rank) {
    rt::RankProgram &r = rank.program;
    if (asyncBesides(r, group))
      return;
    int64_t event = nextEvent(r);
    for (auto &[name, list] : r.programs)
      if (name != "prepare" && name != "update")
        fn(r, list, event);
  });
}

rt::Manifest mlir::loom::toManifest(const Step &step) {
  rt::Manifest m = step.manifest;
  m.ranks.clear();
  for (const StepRank &sr : step.ranks) {
    m.ranks.push_back(sr.program);
    for (auto &[name, list] : m.ranks.back().programs)
      for (rt::Instruction &ins : list)
        for (const char *note : {"loom.chunk", "loom.layer", "loom.view", "loom.source"})
          ins.attrs.erase(note);
  }
  return m;
}

//===----------------------------------------------------------------------===//
// What the step passes share
//===----------------------------------------------------------------------===//

void Grid::describe(rt::RankProgram &r) const {
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

std::set<int64_t> mlir::loom::keptBuffers(const rt::RankProgram &r) {
  std::set<int64_t> kept;
  for (const rt::NamedBuffer &nb : r.outputs)
    kept.insert(nb.buffer);
  for (const rt::Parameter &p : r.params)
    if (p.grad >= 0)
      kept.insert(p.grad);
  return kept;
}

bool mlir::loom::ordersCollectives(const rt::Instruction &ins) {
  static const std::set<std::string> ops = {"all_reduce", "reduce_scatter", "all_gather", "send",     "recv",
                                            "broadcast_from", "global_norm", "event_wait"};
  return ops.count(ins.op) || (ins.attrs.is_object() && ins.attrs.contains("vocab_group"));
}

bool mlir::loom::asyncBesides(const rt::RankProgram &r, const std::string &group) {
  for (const auto &[name, list] : r.programs)
    for (const rt::Instruction &ins : list)
      if (flagAttr(ins, "async") && !(ins.attrs.is_object() && ins.attrs.value("group", std::string()) == group))
        return true;
  return false;
}

int64_t mlir::loom::nextEvent(const rt::RankProgram &r) {
  int64_t next = 0;
  for (const auto &[name, list] : r.programs)
    for (const rt::Instruction &ins : list)
      if (ins.attrs.is_object() && ins.attrs.contains("event") && ins.attrs["event"].is_number_integer())
        next = std::max(next, ins.attrs["event"].get<int64_t>() + 1);
  return next;
}

bool mlir::loom::flagAttr(const rt::Instruction &ins, const char *name) {
  if (!ins.attrs.is_object())
    return false;
  auto it = ins.attrs.find(name);
  return it != ins.attrs.end() && it->is_boolean() && it->get<bool>();
}

std::set<int64_t> mlir::loom::viewedBuffers(const rt::RankProgram &r) {
  std::set<int64_t> viewed;
  for (const rt::Buffer &b : r.buffers)
    if (b.viewOf >= 0)
      viewed.insert(b.viewOf);
  return viewed;
}

std::vector<std::pair<size_t, size_t>> mlir::loom::bucketRuns(const std::vector<int64_t> &bytes, int64_t bucketBytes) {
  std::vector<std::pair<size_t, size_t>> runs;
  int64_t held = 0;
  size_t begin = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    held += bytes[i];
    if (held >= bucketBytes || i + 1 == bytes.size()) {
      runs.push_back({begin, i + 1});
      begin = i + 1, held = 0;
    }
  }
  return runs;
}

int64_t mlir::loom::gradientBucketBytes(int64_t requested, int64_t gradientBytes, bool memoryBound) {
  // Fewer, larger buckets leave fewer NCCL kernels beside the backward's
  // products: GPT-2 350M dp2 on two H200s (2026-11-29, 0.71 GB of bf16
  // gradients a rank) took 45.4 / 46.1 ms a step in 25 MiB buckets, 45.3 /
  // 45.8 in 50, 44.7 / 45.1 in 100 and 45.1 / 44.7 in 200 (46.2 in 12, 46.1
  // in 6). ResNet-50's 25M parameters keep 25 MiB, and several buckets.
  constexpr int64_t kMin = int64_t(25) << 20, kMax = int64_t(256) << 20;
  if (requested > 0)
    return requested;
  if (memoryBound)
    return kMin;
  return std::clamp(gradientBytes / 6, kMin, kMax);
}

int64_t mlir::loom::gatherBucketBytes(int64_t requested) { return requested > 0 ? requested : int64_t(25) << 20; }

StorageUses mlir::loom::storageUses(const rt::RankProgram &r) {
  StorageUses uses;
  for (const auto &[name, list] : r.programs)
    for (size_t i = 0; i < list.size(); ++i) {
      for (int64_t id : list[i].in)
        uses.readers[rt::storageOf(r, id)].push_back({name, i});
      for (int64_t id : list[i].out)
        uses.writers[rt::storageOf(r, id)].push_back({name, i});
    }
  return uses;
}

void mlir::loom::renameBuffer(rt::RankProgram &r, int64_t from, int64_t to) {
  for (auto &[name, list] : r.programs)
    for (rt::Instruction &ins : list) {
      for (int64_t &id : ins.in)
        id = id == from ? to : id;
      for (int64_t &id : ins.out)
        id = id == from ? to : id;
    }
  for (rt::Buffer &b : r.buffers)
    if (b.viewOf == from)
      b.viewOf = to;
}

std::vector<rt::Instruction> mlir::loom::gatherInBuckets(const rt::RankProgram &r, const rt::Instruction &gather,
                                                       int64_t bucketBytes) {
  std::vector<int64_t> bytes;
  for (int64_t id : gather.out)
    bytes.push_back(r.buffers[size_t(id)].bytes);
  std::vector<rt::Instruction> buckets;
  for (auto [begin, end] : bucketRuns(bytes, bucketBytes))
    buckets.push_back({gather.op, {gather.in.begin() + begin, gather.in.begin() + end},
                       {gather.out.begin() + begin, gather.out.begin() + end}, gather.attrs});
  return buckets;
}

void mlir::loom::eraseMarked(std::vector<rt::Instruction> &list, const std::vector<bool> &drop) {
  std::vector<rt::Instruction> kept;
  for (size_t i = 0; i < list.size(); ++i)
    if (!drop[i])
      kept.push_back(std::move(list[i]));
  list = std::move(kept);
}

std::map<int64_t, std::set<int64_t>> mlir::loom::paramStages(const StepRank &rank, int64_t pp) {
  std::map<int64_t, std::set<int64_t>> stages;
  for (auto &[key, grad] : rank.paramGrads)
    stages[key.first].insert(key.second % pp);
  return stages;
}

bool mlir::loom::isFloatRole(const rt::Buffer &b) {
  return b.role == rt::BufferRole::Param || b.role == rt::BufferRole::State;
}
