//===- AccumulateInProducts.cpp - Gradient sums in their products' C -------===//
//
// Two passes that have a weight gradient's product write its f32 form
// itself. loom-reduce-from-products (foldIntoBuckets, below): a
// data-parallel bucket's f32 gradient, reduced in place, instead of a bf16
// result the bucket widens (on two H200s GPT-2 350M dp2 43.6-44.5 ms a
// step against 44.4-44.6, GPT 1.3B 135.0-136.0 against 137.5-138.7).
//
// loom-accumulate-in-products: a microbatched step adds each microbatch's
// weight gradient to the parameter's f32 sum (loom-pipeline-schedule):
//
//   matmul(x, dy) -> g, gb  {epilogue = "bgrad"}   (bf16 g: the product, rounded)
//   ...
//   add(acc, g) -> acc                            (f32 sum += g)
//
// which writes g once and reads it back, with the sum, in another launch.
// When the product is g's only writer and the add its only reader, the
// product adds into the sum itself, as its C input with beta = 1 (as
// Megatron-LM's gradient-accumulation fusion does):
//
//   matmul(x, dy, acc) -> acc, gb  {epilogue = "bgrad_residual"}
//
// The first microbatch's gradient is cast into the sum rather than added:
// that product writes the sum directly. A product without an epilogue
// becomes "residual"; one whose bias gradient comes out of the same call
// ("bgrad") keeps it, widened to f32 where only the add into its own f32
// sum reads it (cuBLASLt writes the bias gradient in the result's type). The sum now also keeps the product's bits beyond
// bf16's, so the step's values change by bf16 rounding; the order of the
// additions into each sum does not.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"

#include <algorithm>

namespace mlir::loom {
#define GEN_PASS_DEF_ACCUMULATEINPRODUCTS
#define GEN_PASS_DEF_REDUCEFROMPRODUCTS
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

std::string epilogueOf(const rt::Instruction &ins) {
  if (!ins.attrs.is_object())
    return "";
  auto it = ins.attrs.find("epilogue");
  return it != ins.attrs.end() && it->is_string() ? it->get<std::string>() : "";
}

/// An add that sums into an f32 buffer in place (its sum, its other
/// input), or the cast that writes the first microbatch's gradient into the
/// f32 sum (`first`: the sum, its input).
bool accumulation(const rt::RankProgram &r, const rt::Instruction &ins, int64_t &acc, int64_t &g, bool &first) {
  first = ins.op == "cast" && ins.in.size() == 1 && ins.out.size() == 1;
  if (first) {
    acc = ins.out[0], g = ins.in[0];
    return r.buffers[acc].dtype == LOOM_F32 && r.buffers[acc].viewOf < 0 && g != acc;
  }
  if (ins.op != "add" || ins.in.size() != 2 || ins.out.size() != 1)
    return false;
  acc = ins.out[0];
  if (ins.in[0] == acc)
    g = ins.in[1];
  else if (ins.in[1] == acc)
    g = ins.in[0];
  else
    return false;
  return r.buffers[acc].dtype == LOOM_F32 && r.buffers[acc].viewOf < 0 && g != acc;
}

/// Who touches each storage in one program, counted once before the folds:
/// a fold only ever removes the product's own result and its add, whose
/// storages no other fold looks at.
struct Uses {
  std::vector<int64_t> root;                  // buffer id -> its storage
  std::vector<int64_t> reads, writes;         // instructions reading / writing each storage
  std::vector<size_t> reader, writer;         // the last of them (the only one where the count is 1)
  std::vector<bool> elsewhere;                // touched by another program of the rank
  std::vector<std::vector<int64_t>> views;    // storage -> the buffers that are it or view it

  Uses(const rt::RankProgram &r, const std::vector<rt::Instruction> &list) {
    size_t n = r.buffers.size();
    root.resize(n), reads.assign(n, 0), writes.assign(n, 0), reader.assign(n, 0), writer.assign(n, 0);
    elsewhere.assign(n, false), views.resize(n);
    for (size_t b = 0; b < n; ++b)
      root[b] = rt::storageOf(r, int64_t(b)), views[root[b]].push_back(int64_t(b));
    for (size_t i = 0; i < list.size(); ++i)
      count(list[i], i);
    for (const auto &[name, other] : r.programs)
      if (&other != &list)
        for (const rt::Instruction &ins : other) {
          for (int64_t id : ins.in)
            elsewhere[root[id]] = true;
          for (int64_t id : ins.out)
            elsewhere[root[id]] = true;
        }
  }
  void count(const rt::Instruction &ins, size_t at) {
    std::set<int64_t> in, out;
    for (int64_t id : ins.in)
      in.insert(root[id]);
    for (int64_t id : ins.out)
      out.insert(root[id]);
    for (int64_t s : in)
      ++reads[s], reader[s] = at;
    for (int64_t s : out)
      ++writes[s], writer[s] = at;
  }
  /// Read and written by one instruction each, here and in no other program.
  bool once(int64_t s) const { return reads[s] == 1 && writes[s] == 1 && !elsewhere[s]; }
};

bool touchesBetween(const Uses &u, const std::vector<rt::Instruction> &list, const std::vector<bool> &dead,
                    size_t from, size_t to, int64_t s) {
  for (size_t j = from; j < to; ++j) {
    if (dead[j])
      continue;
    for (int64_t id : list[j].in)
      if (u.root[id] == s)
        return true;
    for (int64_t id : list[j].out)
      if (u.root[id] == s)
        return true;
  }
  return false;
}

/// Whether `mm` is a product both folds can redirect: a matmul of two 2-D
/// operands whose first result is `g`, with no epilogue or only its bias
/// gradient ("bgrad", then its second result).
bool foldableProduct(const rt::RankProgram &r, const rt::Instruction &mm, int64_t g) {
  std::string epilogue = epilogueOf(mm);
  return mm.op == "matmul" && !mm.out.empty() && mm.out[0] == g && (epilogue == "" || epilogue == "bgrad") &&
         mm.in.size() == 2 && r.buffers[mm.in[0]].shape.size() == 2 && r.buffers[mm.in[1]].shape.size() == 2;
}

/// A storage and its views in f32 (cuBLASLt writes a bias gradient in the
/// product's result type).
void widenToF32(rt::RankProgram &r, const std::vector<int64_t> &views) {
  for (int64_t b : views)
    if (rt::Buffer &buf = r.buffers[b]; buf.dtype != LOOM_F32) {
      buf.dtype = LOOM_F32;
      buf.bytes = rt::numElements(buf.shape).value_or(0) * 4;
    }
}

/// Folds the program's accumulations into their products; returns how many.
int64_t fold(rt::RankProgram &r, std::vector<rt::Instruction> &list, const std::set<int64_t> &kept) {
  Uses u(r, list);
  std::vector<bool> dead(list.size(), false); // the folded adds and casts, erased at the end
  int64_t folded = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    int64_t acc = -1, g = -1;
    bool first = false;
    if (!accumulation(r, list[i], acc, g, first))
      continue;
    const rt::Buffer &gb = r.buffers[g], &sum = r.buffers[acc];
    if (gb.viewOf >= 0 || kept.count(g) || gb.shape != sum.shape || gb.shape.size() != 2)
      continue;
    // g's one writer, before the add: a 2-D product with no epilogue or its
    // bias gradient; the add its one reader.
    if (!u.once(g) || u.writer[g] >= i)
      continue;
    size_t w = u.writer[g];
    rt::Instruction &mm = list[w];
    if (!foldableProduct(r, mm, g))
      continue;
    std::string epilogue = epilogueOf(mm);
    // Nothing between the product and the add may see the sum change early.
    if (touchesBetween(u, list, dead, w, i, acc))
      continue;
    if (epilogue == "bgrad") {
      // The bias gradient comes out in the sum's type: only where the add
      // into its own f32 sum is all that reads it (perhaps through a
      // reshape: a view of the same storage).
      int64_t bias = mm.out[1], biasAcc = -1, other = -1;
      bool cast = false;
      if (r.buffers[bias].viewOf >= 0 || kept.count(bias) || !u.once(bias) ||
          !accumulation(r, list[u.reader[bias]], biasAcc, other, cast) || u.root[other] != bias)
        continue;
      widenToF32(r, u.views[bias]);
    }
    mm.out[0] = acc;
    if (!first) { // added into the sum; the first microbatch's product writes it
      mm.in.push_back(acc);
      mm.attrs["epilogue"] = epilogue.empty() ? "residual" : "bgrad_residual";
    }
    dead[i] = true;
    ++folded;
  }
  size_t live = 0;
  for (size_t i = 0; i < list.size(); ++i)
    if (!dead[i]) {
      if (live != i)
        list[live] = std::move(list[i]);
      ++live;
    }
  list.resize(live);
  return folded;
}

/// Folds the f32 gradients of the program's data-parallel buckets into
/// their products: an all-reduce that widens a bf16 gradient into its f32
/// result (all_reduce [.., g, ..] -> [.., acc, ..]), where g is a 2-D
/// product's result read by nothing else, gets acc written by the product
/// itself and reduces it in place, with no widening pass over the bucket.
/// A bias gradient from the same call ("bgrad") is widened to f32 where the
/// bucket is all that reads it (it is then copied into its own f32 result
/// as the bucket packs it). Returns how many.
int64_t foldIntoBuckets(rt::RankProgram &r, std::vector<rt::Instruction> &list, const std::set<int64_t> &kept) {
  Uses u(r, list);
  int64_t folded = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    rt::Instruction &bucket = list[i];
    if (bucket.op != "all_reduce" || bucket.in.size() != bucket.out.size() || !bucket.attrs.is_object() ||
        bucket.attrs.value("group", std::string()) != "dp" || bucket.attrs.value("wire", std::string("f32")) != "f32")
      continue;
    for (size_t k = 0; k < bucket.in.size(); ++k) {
      int64_t g = bucket.in[k], acc = bucket.out[k];
      const rt::Buffer &gb = r.buffers[g], &sum = r.buffers[acc];
      if (g == acc || gb.dtype != LOOM_BF16 || sum.dtype != LOOM_F32 || gb.viewOf >= 0 || sum.viewOf >= 0 ||
          kept.count(g) || gb.shape != sum.shape || gb.shape.size() != 2 ||
          std::count(bucket.in.begin(), bucket.in.end(), g) != 1)
        continue;
      // g's one writer, before the bucket: a 2-D product with no epilogue
      // or its bias gradient; the bucket its one reader; acc touched by
      // nothing from the product to the bucket (nor by the bucket twice).
      if (!u.once(g) || u.writer[g] >= i || u.reads[u.root[acc]] != 0 || u.writes[u.root[acc]] != 1)
        continue;
      size_t w = u.writer[g];
      rt::Instruction &mm = list[w];
      if (!foldableProduct(r, mm, g) || r.buffers[mm.in[0]].dtype != LOOM_BF16 ||
          r.buffers[mm.in[1]].dtype != LOOM_BF16)
        continue;
      if (epilogueOf(mm) == "bgrad") {
        // cuBLASLt writes the bias gradient in the result's type: widened
        // where the bucket alone reads it, through whole views (a slice's
        // offset would change with the element size).
        if (mm.out.size() != 2)
          continue;
        int64_t bias = mm.out[1];
        int64_t root = u.root[bias];
        if (kept.count(bias) || !u.once(root) || u.reader[root] != i ||
            std::any_of(u.views[root].begin(), u.views[root].end(),
                        [&](int64_t b) { return r.buffers[b].viewOffset != 0; }))
          continue;
        widenToF32(r, u.views[root]);
      }
      mm.out[0] = acc;
      bucket.in[k] = acc;
      ++folded;
    }
  }
  return folded;
}

/// Runs `foldProgram` over each step program of every rank (the backward's
/// and the step's; not prepare's or update's).
LogicalResult foldEachProgram(ModuleOp module, StringRef pass,
                              int64_t (*foldProgram)(rt::RankProgram &, std::vector<rt::Instruction> &,
                                                     const std::set<int64_t> &)) {
  return updateEachRank(module, pass, [&](StepRank &rank) {
    rt::RankProgram &r = rank.program;
    std::set<int64_t> kept = keptBuffers(r);
    for (auto &[name, list] : r.programs)
      if (name != "prepare" && name != "update")
        foldProgram(r, list, kept);
  });
}

struct AccumulateInProductsPass : mlir::loom::impl::AccumulateInProductsBase<AccumulateInProductsPass> {
  void runOnOperation() override {
    if (failed(foldEachProgram(getOperation(), getArgument(), fold)))
      signalPassFailure();
  }
};

struct ReduceFromProductsPass : mlir::loom::impl::ReduceFromProductsBase<ReduceFromProductsPass> {
  void runOnOperation() override {
    if (failed(foldEachProgram(getOperation(), getArgument(), foldIntoBuckets)))
      signalPassFailure();
  }
};

} // namespace
