//===- Recompute.cpp - Activation recomputation ---------------------------===//
//
// The loom-recompute pass: the layers the plan recomputes run their forward
// instructions again, into new buffers, right before their gradients, and
// their gradients read those copies, so the forward pass's activations of
// those layers die early instead of living through backward.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"

#include <map>
#include <set>

namespace mlir::loom {
#define GEN_PASS_DEF_RECOMPUTE
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

std::string layerOf(const rt::Instruction &ins) {
  return ins.attrs.value("loom.layer", std::string());
}

/// Whether `--recompute` asks for this layer: "all", the application
/// ("layer.3" for the note "layer.3.") or its block ("layer": every
/// application of @layer).
bool wanted(const std::set<std::string> &recompute, const std::string &layer) {
  if (recompute.count("all"))
    return true;
  std::string name = layer.substr(0, layer.size() - 1);
  return recompute.count(name) || recompute.count(name.substr(0, name.rfind('.')));
}

/// Every name `--recompute` accepts for these layers, and a line that
/// lists them (blocks with how many applications) for an error message.
std::set<std::string> accepted(const std::set<std::string> &layers, std::string &list) {
  std::set<std::string> names{"all"};
  std::map<std::string, int64_t> blocks;
  for (const std::string &layer : layers) {
    std::string name = layer.substr(0, layer.size() - 1);
    names.insert(name);
    std::string block = name.substr(0, name.rfind('.'));
    names.insert(block);
    if (block != name)
      ++blocks[block];
  }
  list = "'all'";
  for (const auto &[block, n] : blocks)
    list += ", '" + block + "' or one of its applications '" + block + ".0' to '" + block + "." +
            std::to_string(n - 1) + "'";
  return names;
}

/// Rewrites one rank: each recomputed layer's forward instructions are
/// copied, into new buffers, before the first backward instruction of that
/// layer; from there on, backward reads the copies (and views of them).
class Rematerializer {
public:
  explicit Rematerializer(rt::RankProgram &rank) : rank(rank) {}

  void run(const std::set<std::string> &recompute) {
    std::vector<rt::Instruction> &forward = rank.programs["forward"];
    std::vector<rt::Instruction> &backward = rank.programs["backward"];
    std::map<std::string, std::vector<size_t>> members; // layer -> forward instructions
    for (size_t i = 0; i < forward.size(); ++i) {
      std::string layer = layerOf(forward[i]);
      if (!layer.empty() && wanted(recompute, layer))
        members[layer].push_back(i);
    }
    std::vector<rt::Instruction> out;
    std::set<std::string> done;
    for (rt::Instruction &ins : backward) {
      std::string layer = layerOf(ins);
      if (members.count(layer) && done.insert(layer).second)
        for (size_t i : members[layer])
          out.push_back(copyOf(forward[i]));
      for (int64_t &id : ins.in)
        id = fresh(id);
      out.push_back(std::move(ins));
    }
    backward = std::move(out);
  }

private:
  int64_t newBuffer(const rt::Buffer &like, int64_t viewOf) {
    rt::Buffer b;
    b.id = static_cast<int64_t>(rank.buffers.size());
    b.name = like.name + ".recomputed";
    b.dtype = like.dtype;
    b.shape = like.shape;
    b.bytes = rt::numElements(b.shape).value_or(0) * int64_t(rt::dtypeSize(b.dtype));
    b.viewOf = viewOf;
    rank.buffers.push_back(std::move(b));
    return rank.buffers.back().id;
  }

  /// The buffer to read for `id` from here on: its recomputed copy, a view
  /// of the copy of its storage, or itself.
  int64_t fresh(int64_t id) {
    if (auto it = remap.find(id); it != remap.end())
      return it->second;
    int64_t root = rt::storageOf(rank, id);
    auto copy = remap.find(root);
    if (root == id || copy == remap.end())
      return id;
    int64_t view = newBuffer(rank.buffers[id], copy->second);
    remap[id] = view;
    return view;
  }

  rt::Instruction copyOf(const rt::Instruction &original) {
    rt::Instruction ins = original;
    ins.attrs.erase("loom.layer");
    for (int64_t &id : ins.in)
      id = fresh(id);
    for (int64_t &id : ins.out) {
      int64_t copy = newBuffer(rank.buffers[id], -1);
      remap[id] = copy;
      id = copy;
    }
    return ins;
  }

  rt::RankProgram &rank;
  std::map<int64_t, int64_t> remap; // forward buffer -> what backward reads instead
};

struct RecomputePass : mlir::loom::impl::RecomputeBase<RecomputePass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<BundleOptions> options = getCompileOptions(module);
    if (failed(options))
      return signalPassFailure();
    const std::set<std::string> &recompute = options->training.recompute;
    auto rewrite = [&](Step &step) -> LogicalResult {
      for (StepRank &sr : step.ranks) {
        rt::RankProgram &rank = sr.program;
        if (!recompute.empty() && rank.programs.count("backward")) {
          std::set<std::string> layers;
          for (const rt::Instruction &ins : rank.programs["forward"])
            if (!layerOf(ins).empty())
              layers.insert(layerOf(ins));
          std::string list;
          std::set<std::string> names = accepted(layers, list);
          for (const std::string &r : recompute)
            if (!names.count(r))
              return module.emitError() << "--recompute names '" << r
                                        << "', which is no layer of this model; use " << list;
          Rematerializer(rank).run(recompute);
        }
        // The layer notes have served.
        for (auto &[name, list] : rank.programs)
          for (rt::Instruction &ins : list)
            ins.attrs.erase("loom.layer");
      }
      return success();
    };
    if (failed(updateStep(module, getArgument(), rewrite)))
      signalPassFailure();
  }
};

} // namespace
