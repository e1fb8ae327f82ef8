//===- ServePrograms.cpp - Step programs over a paged key/value cache -----===//
//
// The loom-serve-programs pass. A serving bundle runs a decoder one step at
// a time over a set of token slots: any mix of prompt chunks and sequences
// that decode one token each, as continuous batching needs. Each token
// carries its position, its cache row and its sequence's block table, so
// attention becomes a write of the step's keys and values into each layer's
// paged cache and an attention of every token over its own sequence's
// cached keys. The forward pass is copied once per step size N (the
// scheduler picks the smallest that holds a step), and the final norm and
// head run on the rows whose logits are sampled only.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"
#include "loom/rt/Checked.h"

#include <algorithm>
#include <map>
#include <set>

namespace mlir::loom {
#define GEN_PASS_DEF_SERVEPROGRAMS
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

/// Ops after the final norm that act on each row on its own, so that the
/// tail can run on the sampled rows only.
bool rowWise(const rt::RankProgram &r, const rt::Instruction &ins) {
  static const std::set<std::string> ops = {"layernorm", "rmsnorm", "matmul", "add",  "sub",  "mul",
                                            "div",       "cast",    "gelu",   "relu", "silu", "tanh",
                                            "exp",       "neg",     "scale",  "softmax"};
  if (ins.op == "all_gather" && ins.in.size() == 1 && ins.attrs.contains("axis")) {
    // A vocabulary-parallel head's logits, gathered along the vocabulary:
    // each row from its own row on every rank.
    int64_t rank = int64_t(r.buffers[ins.in[0]].shape.size()), axis = ins.attrs.value("axis", int64_t(0));
    return axis == rank - 1 || axis == -1;
  }
  return ops.count(ins.op) > 0;
}

/// The step sizes: powers of two up to the chunk, and max_batch itself.
std::vector<int64_t> stepSizes(int64_t maxBatch, int64_t chunk) {
  std::set<int64_t> sizes = {maxBatch, chunk};
  for (int64_t n = 1; n < chunk; n *= 2)
    sizes.insert(n);
  return {sizes.begin(), sizes.end()};
}

class ServeRewriter {
public:
  ServeRewriter(rt::RankProgram &r, const ServeOptions &o) : r(r), o(o) {}

  /// Rewrites the rank; on failure returns the reason.
  std::string run(rt::ServeConfig &cfg) {
    auto fwd = r.programs.find("forward");
    if (fwd == r.programs.end() || r.programs.size() != 1)
      return "serving needs the forward pass only (compile without --train)";
    if (r.inputs.size() != 1 || r.outputs.size() != 1)
      return "serving needs a model with one input (token ids) and one output (logits); this one has " +
             std::to_string(r.inputs.size()) + " and " + std::to_string(r.outputs.size());
    const rt::Buffer &tokens = r.buffers[r.inputs[0].buffer];
    if (tokens.shape.size() != 2 || tokens.shape[0] != 1 ||
        (tokens.dtype != LOOM_I32 && tokens.dtype != LOOM_I64))
      return "serving needs token ids [1, seq] as the input, got '" + tokens.name + "' " +
             rt::shapeStr(tokens.shape);
    seq = tokens.shape[1];
    tokensIn = tokens.id;
    vocabLimit = r.inputs[0].limit;
    const rt::Buffer &logits = r.buffers[r.outputs[0].buffer];
    if (logits.shape.size() != 3 || logits.shape[0] != 1 || logits.shape[1] != seq)
      return "serving needs logits [1, seq, vocab] as the output, got '" + logits.name + "' " +
             rt::shapeStr(logits.shape);
    vocab = logits.shape[2];
    logitsOut = logits.id;

    std::vector<rt::Instruction> forward = std::move(fwd->second);
    r.programs.clear();
    hoistParameterCasts(forward);
    if (o.weightLayout != "nk" && o.weightLayout != "kn")
      return "the weight layout must be nk or kn, got '" + o.weightLayout + "'";
    if (o.weightLayout == "nk")
      transposeWeights(forward);
    if (std::string e = findPattern(forward); !e.empty())
      return e;

    maxSeq = o.maxSeq > 0 ? o.maxSeq : seq;
    if (positionTable > 0 && maxSeq > positionTable)
      return "--max-seq " + std::to_string(maxSeq) + " is longer than the model's " +
             std::to_string(positionTable) + " learned positions";
    if (o.maxBatch < 1 || o.blockSize < 1 || o.maxSeq < 0 || o.kvBlocks < 0 || o.prefillChunk < 0)
      return "--max-batch and --block-size must be at least 1, --max-seq, --kv-blocks and "
             "--prefill-chunk at least 0";
    cfg.blockSize = o.blockSize;
    cfg.maxSeq = maxSeq;
    cfg.maxBatch = o.maxBatch;
    cfg.vocab = vocab;
    cfg.maxBlocksPerSeq = (maxSeq + o.blockSize - 1) / o.blockSize;
    std::optional<int64_t> full = rt::checkedMul(cfg.maxBlocksPerSeq, o.maxBatch);
    if (!full || *full > (int64_t(1) << 31) / o.blockSize)
      return "--max-batch x --max-seq is too large for 32-bit cache rows";
    cfg.numBlocks = o.kvBlocks > 0 ? o.kvBlocks : *full;
    if (cfg.numBlocks > (int64_t(1) << 31) / o.blockSize)
      return "--kv-blocks x --block-size must stay below 2^31 cache rows";
    int64_t chunk = o.prefillChunk > 0 ? o.prefillChunk : std::min<int64_t>(maxSeq, 512);
    chunk = std::max(chunk, o.maxBatch);
    if (std::string e = makeCaches(forward, cfg); !e.empty())
      return e;
    if (!prepare.empty()) {
      r.programs["prepare"] = std::move(prepare);
      cfg.prepare = "prepare";
    }
    r.inputs.clear(), r.outputs.clear();
    for (int64_t n : stepSizes(o.maxBatch, chunk)) {
      rt::ServeProgram p{"serve." + std::to_string(n), n, std::min(n, o.maxBatch)};
      if (std::string e = makeProgram(forward, cfg, p); !e.empty())
        return e;
      cfg.programs.push_back(p);
    }
    compactRank(r);
    return "";
  }

private:
  /// A cast whose input is a parameter runs once, in `prepare`, into a
  /// persistent copy: decoding reads each weight once per token, not three
  /// times (the f32 master, then the copy written and read again).
  void hoistParameterCasts(std::vector<rt::Instruction> &forward) {
    std::vector<bool> drop(forward.size(), false);
    for (size_t i = 0; i < forward.size(); ++i) {
      const rt::Instruction &ins = forward[i];
      if (ins.op != "cast" || ins.in.size() != 1 || ins.out.size() != 1)
        continue;
      const rt::Buffer &src = r.buffers[rt::storageOf(r, ins.in[0])];
      rt::Buffer &dst = r.buffers[ins.out[0]];
      if (src.role != rt::BufferRole::Param || dst.viewOf >= 0 || dst.role != rt::BufferRole::Activation)
        continue;
      dst.role = rt::BufferRole::Cache;
      prepare.push_back(ins);
      drop[i] = true;
    }
    eraseMarked(forward, drop);
  }

  /// The prepared copies that only products read as their right operand
  /// are laid out [N, K] (transposed once, in `prepare`), and the products
  /// read them with transpose_b: decoding then reads each output's weights
  /// as one contiguous row, and the products of one input can run as one
  /// launch over their stacked rows.
  void transposeWeights(std::vector<rt::Instruction> &forward) {
    std::map<int64_t, size_t> prepared; // copy -> its cast in `prepare`
    for (size_t i = 0; i < prepare.size(); ++i)
      prepared[prepare[i].out[0]] = i;
    std::map<int64_t, std::vector<size_t>> products;
    std::set<int64_t> otherwise;
    for (size_t i = 0; i < forward.size(); ++i) {
      const rt::Instruction &ins = forward[i];
      for (size_t k = 0; k < ins.in.size(); ++k) {
        if (!prepared.count(ins.in[k]))
          continue;
        bool plain =
            ins.op == "matmul" && k == 1 && !flagAttr(ins, "transpose_a") && !flagAttr(ins, "transpose_b");
        if (plain)
          products[ins.in[k]].push_back(i);
        else
          otherwise.insert(ins.in[k]);
      }
      for (int64_t id : ins.out)
        otherwise.insert(id);
    }
    for (int64_t id : viewedBuffers(r))
      otherwise.insert(id);
    std::vector<rt::Instruction> ordered;
    std::map<size_t, rt::Instruction> transposes; // after the cast of this index
    for (const auto &[id, readers] : products) {
      if (otherwise.count(id) || r.buffers[id].shape.size() != 2)
        continue;
      rt::Buffer w = r.buffers[id];
      int64_t kn = addBuffer(w.name + ".kn", w.dtype, w.shape, rt::BufferRole::Activation);
      r.buffers[id].shape = {w.shape[1], w.shape[0]};
      size_t at = prepared.at(id);
      prepare[at].out[0] = kn;
      transposes[at] = rt::Instruction{"transpose", {kn}, {id}, json{{"permutation", {1, 0}}}};
      for (size_t i : readers)
        forward[i].attrs["transpose_b"] = true;
    }
    for (size_t i = 0; i < prepare.size(); ++i) {
      ordered.push_back(prepare[i]);
      if (auto t = transposes.find(i); t != transposes.end())
        ordered.push_back(t->second);
    }
    prepare = std::move(ordered);
  }

  bool persistent(int64_t id) const {
    rt::BufferRole role = r.buffers[rt::storageOf(r, id)].role;
    return role == rt::BufferRole::Param || role == rt::BufferRole::Cache;
  }

  /// Finds the attentions, the position table and the final norm.
  std::string findPattern(const std::vector<rt::Instruction> &forward) {
    for (size_t i = 0; i < forward.size(); ++i) {
      const rt::Instruction &ins = forward[i];
      if (ins.op == "attention") {
        if (!ins.attrs.value("causal", false) || ins.attrs.contains("packed") || ins.in.size() != 3)
          return "serving needs causal attention over q, k, v; instruction " + std::to_string(i) +
                 " is not (is this a decoder?)";
      } else if (ins.op == "add" && ins.in.size() == 2) {
        const rt::Buffer &a = r.buffers[ins.in[0]], &b = r.buffers[ins.in[1]];
        for (const rt::Buffer *t : {&a, &b}) {
          const rt::Buffer &x = t == &a ? b : a;
          if (persistent(t->id) && t->shape.size() == 2 && x.shape.size() == 3 && t->shape[0] == seq &&
              t->shape[1] == x.shape[2]) {
            positionAdds.insert(i);
            positionTable = t->shape[0];
          }
        }
      } else if (ins.op == "layernorm" || ins.op == "rmsnorm") {
        finalNorm = static_cast<int64_t>(i);
      }
    }
    if (finalNorm < 0)
      return "serving needs a final norm before the output head";
    // Everything after the final norm must be row-wise and read only the
    // norm's rows (or parameters), so that it can run on sampled rows.
    std::set<int64_t> tail = {rt::storageOf(r, forward[finalNorm].out[0])};
    for (size_t i = finalNorm + 1; i < forward.size(); ++i) {
      const rt::Instruction &ins = forward[i];
      if (!rowWise(r, ins))
        return "serving needs the output head to be row-wise after the final norm; '" + ins.op +
               "' (instruction " + std::to_string(i) + ") is not";
      for (int64_t id : ins.in)
        if (!persistent(id) && !tail.count(rt::storageOf(r, id)))
          return "the output head's instruction " + std::to_string(i) + " ('" + ins.op +
                 "') reads activations from before the final norm";
      for (int64_t id : ins.out)
        tail.insert(rt::storageOf(r, id));
    }
    if (!tail.count(rt::storageOf(r, logitsOut)))
      return "the logits are not computed after the final norm";
    return "";
  }

  /// One key and one value cache per attention: [blocks x block_size, kv width].
  std::string makeCaches(const std::vector<rt::Instruction> &forward, const rt::ServeConfig &cfg) {
    for (size_t i = 0; i < forward.size(); ++i) {
      if (forward[i].op != "attention")
        continue;
      const rt::Buffer &k = r.buffers[forward[i].in[1]];
      const rt::Buffer &v = r.buffers[forward[i].in[2]];
      if (k.shape.size() != 3 || k.shape != v.shape || k.dtype != v.dtype)
        return "attention " + std::to_string(i) + " has keys and values of different shapes";
      std::string base = r.buffers[forward[i].out[0]].name;
      std::pair<int64_t, int64_t> pair;
      for (int which = 0; which < 2; ++which) {
        rt::Buffer c;
        c.id = static_cast<int64_t>(r.buffers.size());
        c.name = base + (which ? ".v_cache" : ".k_cache");
        c.dtype = k.dtype;
        c.shape = {cfg.numBlocks * cfg.blockSize, k.shape[2]};
        std::optional<int64_t> bytes = rt::checkedMul(rt::numElements(c.shape).value_or(-1),
                                                      int64_t(rt::dtypeSize(c.dtype)));
        if (!bytes || *bytes < 0)
          return "the key/value cache of attention " + std::to_string(i) + " would pass 2^63 bytes";
        c.bytes = *bytes;
        c.role = rt::BufferRole::Cache;
        r.buffers.push_back(c);
        (which ? pair.second : pair.first) = c.id;
      }
      caches[i] = pair;
    }
    if (caches.empty())
      return "serving needs attention layers to cache (none in this model)";
    return "";
  }

  int64_t addBuffer(const std::string &name, loom_dtype_t dtype, rt::Shape shape, rt::BufferRole role,
                    int64_t viewOf = -1) {
    rt::Buffer b;
    b.id = static_cast<int64_t>(r.buffers.size());
    b.name = name;
    b.dtype = dtype;
    b.shape = std::move(shape);
    b.bytes = rt::numElements(b.shape).value_or(0) * int64_t(rt::dtypeSize(dtype));
    b.role = role;
    b.viewOf = viewOf;
    r.buffers.push_back(b);
    return b.id;
  }

  /// serve.N: the forward pass over N token slots, its tail over M rows.
  std::string makeProgram(const std::vector<rt::Instruction> &forward, const rt::ServeConfig &cfg,
                          const rt::ServeProgram &p) {
    const std::string &pre = p.name;
    auto input = [&](const std::string &name, rt::Shape shape, int64_t limit) {
      int64_t id = addBuffer(pre + "." + name, LOOM_I32, std::move(shape), rt::BufferRole::Input);
      r.inputs.push_back({pre + "." + name, id, limit});
      return id;
    };
    int64_t tokens = input("tokens", {1, p.tokens}, vocabLimit);
    int64_t positions = input("positions", {1, p.tokens}, maxSeq);
    int64_t slots = input("slots", {p.tokens}, 0);
    int64_t table = input("block_table", {p.tokens, cfg.maxBlocksPerSeq}, cfg.numBlocks);
    int64_t rows = input("rows", {p.rows}, p.tokens);
    if (r.buffers[tokensIn].dtype != LOOM_I32)
      return "serving needs i32 token ids";

    std::map<int64_t, int64_t> map = {{tokensIn, tokens}};
    std::set<int64_t> tailBuffers;
    std::string error;
    // The copy of buffer `id` in this program: [1, S, ...] becomes
    // [1, N, ...] before the final norm and [1, M, ...] from it on.
    std::function<int64_t(int64_t, bool)> copyOf = [&](int64_t id, bool tail) -> int64_t {
      if (persistent(id))
        return id;
      if (auto it = map.find(id); it != map.end())
        return it->second;
      const rt::Buffer &b = r.buffers[id];
      int64_t rowsHere = tail ? p.rows : p.tokens;
      rt::Shape shape = b.shape;
      if (shape.size() >= 2 && shape[0] == 1 && shape[1] == seq)
        shape[1] = rowsHere;
      else if (b.viewOf >= 0 && !shape.empty() && shape[0] == seq)
        shape[0] = rowsHere;
      else if (error.empty())
        error = "buffer '" + b.name + "' " + rt::shapeStr(b.shape) + " is not [1, seq, ...]";
      int64_t view = b.viewOf >= 0 ? copyOf(b.viewOf, tail) : -1;
      bool isLogits = id == logitsOut;
      int64_t copy = addBuffer(isLogits ? pre + ".logits" : pre + "." + b.name, b.dtype, shape,
                               isLogits ? rt::BufferRole::Output : rt::BufferRole::Activation, view);
      if (isLogits)
        r.outputs.push_back({pre + ".logits", copy, 0});
      map[id] = copy;
      return copy;
    };

    std::vector<rt::Instruction> &list = r.programs[p.name];
    for (size_t i = 0; i < forward.size(); ++i) {
      const rt::Instruction &ins = forward[i];
      bool tail = static_cast<int64_t>(i) >= finalNorm;
      rt::Instruction out = ins;
      for (int64_t &id : out.in)
        id = copyOf(id, tail && static_cast<int64_t>(i) > finalNorm);
      if (static_cast<int64_t>(i) == finalNorm) {
        // The rows to sample, gathered from the norm's input [1, N, H].
        int64_t x = out.in[0];
        const rt::Buffer &xb = r.buffers[x];
        int64_t flat = addBuffer(pre + "." + xb.name + ".rows_view", xb.dtype, {p.tokens, xb.shape[2]},
                                 rt::BufferRole::Activation, x);
        int64_t picked = addBuffer(pre + "." + xb.name + ".rows", xb.dtype, {p.rows, xb.shape[2]},
                                   rt::BufferRole::Activation);
        int64_t gathered = addBuffer(pre + "." + xb.name + ".rows_3d", xb.dtype, {1, p.rows, xb.shape[2]},
                                     rt::BufferRole::Activation, picked);
        list.push_back({"embedding", {flat, rows}, {picked}, json::object()});
        out.in[0] = gathered;
      }
      for (int64_t &id : out.out)
        id = copyOf(id, tail);
      if (ins.op == "attention") {
        auto [kc, vc] = caches.at(i);
        int64_t heads = ins.attrs.value("num_heads", int64_t(1));
        json attrs = {{"num_heads", heads},
                      {"num_kv_heads", ins.attrs.value("num_kv_heads", heads)},
                      {"block_size", cfg.blockSize}};
        if (ins.attrs.contains("scale"))
          attrs["scale"] = ins.attrs["scale"];
        list.push_back({"kv_write", {out.in[1], out.in[2], slots}, {kc, vc}, json::object()});
        list.push_back({"paged_attention", {out.in[0], kc, vc, positions, table}, out.out, attrs});
        continue;
      }
      if (positionAdds.count(i)) {
        // x + table[:S] becomes x + table[positions].
        int which = persistent(ins.in[0]) ? 0 : 1;
        int64_t tbl = out.in[which];
        const rt::Buffer &tb = r.buffers[tbl];
        int64_t rowsOf = addBuffer(pre + "." + tb.name + ".at_positions", tb.dtype,
                                   {1, p.tokens, tb.shape[1]}, rt::BufferRole::Activation);
        list.push_back({"embedding", {tbl, positions}, {rowsOf}, json::object()});
        out.in[which] = rowsOf;
      }
      if (ins.op == "rotary")
        out.in.push_back(positions);
      list.push_back(std::move(out));
    }
    return error;
  }

  rt::RankProgram &r;
  const ServeOptions &o;
  int64_t seq = 0, vocab = 0, vocabLimit = 0, maxSeq = 0, tokensIn = -1, logitsOut = -1;
  int64_t finalNorm = -1, positionTable = 0;
  std::set<size_t> positionAdds;
  std::map<size_t, std::pair<int64_t, int64_t>> caches; // attention -> (k cache, v cache)
  std::vector<rt::Instruction> prepare;
};

struct ServeProgramsPass : mlir::loom::impl::ServeProgramsBase<ServeProgramsPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<BundleOptions> options = getCompileOptions(module);
    if (failed(options))
      return signalPassFailure();
    auto rewrite = [&](Step &step) -> LogicalResult {
      if (!options->serve.enabled)
        return success();
      rt::ServeConfig cfg;
      for (StepRank &sr : step.ranks) {
        rt::ServeConfig rankCfg;
        std::string error = ServeRewriter(sr.program, options->serve).run(rankCfg);
        if (!error.empty())
          return module.emitError() << "cannot compile for serving: " << error;
        cfg = rankCfg;
      }
      step.manifest.mode = "serve";
      step.manifest.serve = cfg;
      return success();
    };
    if (failed(updateStep(module, getArgument(), rewrite)))
      signalPassFailure();
  }
};

} // namespace
