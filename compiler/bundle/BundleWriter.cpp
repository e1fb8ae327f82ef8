//===- BundleWriter.cpp - Lower a model to a runnable bundle --------------===//

#include "compiler/bundle/BundleWriter.h"
#include "dialects/loom/IR/LoomOps.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "passes/Passes.h"
#include "runtime/src/Error.h"
#include "runtime/src/Safetensors.h"

#include "llvm/Support/MemoryBuffer.h"

#include <algorithm>
#include <cmath>
#include <map>

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
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

private:
  int64_t rootOf(int64_t id) const {
    while (rank.buffers[id].viewOf >= 0)
      id = rank.buffers[id].viewOf;
    return id;
  }

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
    rank.params.push_back({name, *id,
                           rt::ParamInit{stringifyInitKind(init.getKind()).str(),
                                         init.getScale().convertToDouble()}});
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

  LogicalResult lowerOp(Operation &op, DenseMap<Value, int64_t> &values,
                        const std::string &prefix) {
    std::string opName = op.getName().stripDialect().str();
    std::string resultName = prefix + opName + "." + std::to_string(counter++);
    if (isa<ReshapeOp>(op)) {
      int64_t in = values.lookup(op.getOperand(0));
      FailureOr<int64_t> id = newBuffer(op.getResult(0).getType(), resultName,
                                        rt::BufferRole::Activation, op.getLoc());
      if (failed(id))
        return failure();
      rank.buffers[*id].viewOf = rootOf(in);
      values[op.getResult(0)] = *id;
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
    if (auto emb = dyn_cast<EmbeddingOp>(op))
      indexLimits[rootOf(ins.in[1])] = emb.getTable().getType().getDimSize(0);
    if (auto ce = dyn_cast<CrossEntropyOp>(op))
      indexLimits[rootOf(ins.in[1])] =
          cast<RankedTensorType>(ce.getLogits().getType()).getShape().back();
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

constexpr int64_t kAlignment = 64;
int64_t alignUp(int64_t v) { return (v + kAlignment - 1) / kAlignment * kAlignment; }

/// splitmix64: a small, well-mixed generator; one stream per parameter.
struct SplitMix {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); } // [0, 1)
};

} // namespace

std::vector<float> mlir::loom::initialValues(const rt::ParamInit &init, int64_t count,
                                             uint64_t seed, const std::string &name) {
  std::vector<float> out(static_cast<size_t>(count), 0.0f);
  uint64_t h = 1469598103934665603ull ^ seed; // FNV-1a of the name, mixed with the seed
  for (char c : name)
    h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  SplitMix rng{h};
  if (init.kind == "ones" || init.kind == "constant") {
    std::fill(out.begin(), out.end(), static_cast<float>(init.kind == "ones" ? 1.0 : init.scale));
  } else if (init.kind == "uniform") {
    for (float &v : out)
      v = static_cast<float>((2 * rng.uniform() - 1) * init.scale);
  } else if (init.kind == "normal") {
    for (size_t i = 0; i < out.size(); i += 2) { // Box-Muller, two values per draw
      double u1 = 1.0 - rng.uniform(), u2 = rng.uniform();
      double r = std::sqrt(-2.0 * std::log(u1)) * init.scale;
      out[i] = static_cast<float>(r * std::cos(2 * M_PI * u2));
      if (i + 1 < out.size())
        out[i + 1] = static_cast<float>(r * std::sin(2 * M_PI * u2));
    }
  }
  return out;
}

void mlir::loom::planMemory(rt::RankProgram &rank, const std::string &programName) {
  const std::vector<rt::Instruction> &program = rank.programs[programName];
  auto root = [&](int64_t id) {
    while (rank.buffers[id].viewOf >= 0)
      id = rank.buffers[id].viewOf;
    return id;
  };
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

FailureOr<rt::Manifest> mlir::loom::lowerForward(ModuleOp original, const BundleOptions &options) {
  OwningOpRef<ModuleOp> module(original.clone());
  if (failed(specializeBatch(*module, options.batch)))
    return failure();
  auto forward = module->lookupSymbol<func::FuncOp>("forward");
  if (!forward || forward.isExternal())
    return original.emitError() << "model has no @forward function to compile";
  Lowerer lowerer(*module, options);
  FailureOr<rt::RankProgram> rank = lowerer.run(forward);
  if (failed(rank))
    return failure();
  planMemory(*rank, "forward");
  rt::Manifest m;
  m.model = options.modelName;
  m.mode = "infer";
  m.batch = options.batch;
  m.ranks.push_back(std::move(*rank));
  return m;
}

LogicalResult mlir::loom::writeBundle(ModuleOp module, const BundleOptions &options,
                                      const std::string &dir, rt::Manifest *out) {
  FailureOr<rt::Manifest> manifest = lowerForward(module, options);
  if (failed(manifest))
    return failure();
  const rt::RankProgram &rank = manifest->ranks.front();
  try {
    std::vector<std::vector<char>> storage;
    std::vector<rt::SafetensorsTensorRef> refs;
    std::optional<rt::SafetensorsFile> given;
    if (!options.weightsFile.empty())
      given = rt::readSafetensors(options.weightsFile);
    for (const rt::Parameter &p : rank.params) {
      const rt::Buffer &b = rank.buffers[p.buffer];
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
        int64_t count = rt::numElements(b.shape).value_or(0);
        std::vector<float> values = initialValues(p.init, count, options.seed, p.name);
        for (int64_t i = 0; i < count; ++i) {
          switch (b.dtype) {
          case LOOM_F32: reinterpret_cast<float *>(dst)[i] = values[i]; break;
          case LOOM_F64: reinterpret_cast<double *>(dst)[i] = values[i]; break;
          case LOOM_BF16: reinterpret_cast<uint16_t *>(dst)[i] = rt::floatToBf16(values[i]); break;
          default:
            return module.emitError() << "cannot initialise parameter '" << p.name << "' of type "
                                      << rt::dtypeName(b.dtype);
          }
        }
      }
      refs.push_back({p.name, b.dtype, b.shape, dst, static_cast<size_t>(b.bytes)});
    }
    rt::writeManifest(*manifest, dir);
    rt::writeSafetensors(dir + "/" + manifest->weights, refs,
                         {{"model", options.modelName}, {"seed", std::to_string(options.seed)}});
  } catch (const rt::Error &e) {
    return module.emitError() << e.what();
  }
  if (out)
    *out = std::move(*manifest);
  return success();
}
