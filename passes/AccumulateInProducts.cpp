//===- AccumulateInProducts.cpp - Gradient sums in their products' C -------===//
//
// The loom-accumulate-in-products pass. A microbatched step adds each
// microbatch's weight gradient to the parameter's f32 sum
// (loom-pipeline-schedule):
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
// becomes "residual"; one whose bias gradient
// comes out of the same call ("bgrad") keeps it, widened to f32 where only
// the add into its own f32 sum reads it (cuBLASLt writes the bias gradient
// in the result's type). The sum now also keeps the product's bits beyond
// bf16's, so the step's values change by bf16 rounding; the order of the
// additions into each sum does not.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"

namespace mlir::loom {
#define GEN_PASS_DEF_ACCUMULATEINPRODUCTS
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

/// How many instructions of `list` read and write storage `s`, and the last
/// writer before `before`.
struct Touches {
  int64_t reads = 0, writes = 0;
};

Touches touches(const rt::RankProgram &r, const std::vector<rt::Instruction> &list, int64_t s) {
  Touches t;
  for (const rt::Instruction &ins : list) {
    bool reads = false, writes = false;
    for (int64_t id : ins.in)
      reads |= rt::storageOf(r, id) == s;
    for (int64_t id : ins.out)
      writes |= rt::storageOf(r, id) == s;
    t.reads += reads, t.writes += writes;
  }
  return t;
}

bool touchesBetween(const rt::RankProgram &r, const std::vector<rt::Instruction> &list, size_t from, size_t to,
                    int64_t s) {
  for (size_t j = from; j < to; ++j) {
    for (int64_t id : list[j].in)
      if (rt::storageOf(r, id) == s)
        return true;
    for (int64_t id : list[j].out)
      if (rt::storageOf(r, id) == s)
        return true;
  }
  return false;
}

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

/// Whether a program other than `list` reads or writes storage `s`.
bool usedElsewhere(const rt::RankProgram &r, const std::vector<rt::Instruction> &list, int64_t s) {
  for (const auto &[name, other] : r.programs)
    if (&other != &list) {
      Touches t = touches(r, other, s);
      if (t.reads || t.writes)
        return true;
    }
  return false;
}

/// Folds the program's accumulations into their products; returns how many.
int64_t fold(rt::RankProgram &r, std::vector<rt::Instruction> &list, const std::set<int64_t> &kept) {
  int64_t folded = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    int64_t acc = -1, g = -1;
    bool first = false;
    if (!accumulation(r, list[i], acc, g, first))
      continue;
    const rt::Buffer &gb = r.buffers[g], &sum = r.buffers[acc];
    if (gb.viewOf >= 0 || kept.count(g) || gb.shape != sum.shape || gb.shape.size() != 2)
      continue;
    // g's one writer, before the add: a 2-D product with no epilogue or its bias gradient.
    size_t w = list.size();
    for (size_t j = i; j-- > 0;) {
      bool writes = false;
      for (int64_t id : list[j].out)
        writes |= rt::storageOf(r, id) == g;
      if (writes) {
        w = j;
        break;
      }
    }
    if (w == list.size())
      continue;
    rt::Instruction &mm = list[w];
    std::string epilogue = epilogueOf(mm);
    if (mm.op != "matmul" || mm.out.empty() || mm.out[0] != g || (epilogue != "" && epilogue != "bgrad") ||
        mm.in.size() != 2 || r.buffers[mm.in[0]].shape.size() != 2 || r.buffers[mm.in[1]].shape.size() != 2)
      continue;
    Touches t = touches(r, list, g);
    if (t.writes != 1 || t.reads != 1 || usedElsewhere(r, list, g))
      continue;
    // Nothing between the product and the add may see the sum change early.
    if (touchesBetween(r, list, w, i, acc))
      continue;
    if (epilogue == "bgrad") {
      // The bias gradient comes out in the sum's type: only where the add
      // into its own f32 sum is all that reads it.
      // (The add may read it through a reshape: a view of the same storage.)
      int64_t bias = mm.out[1];
      if (r.buffers[bias].viewOf >= 0 || kept.count(bias))
        continue;
      Touches tb = touches(r, list, bias);
      bool summed = tb.writes == 1 && tb.reads == 1 && !usedElsewhere(r, list, bias);
      if (summed) {
        summed = false;
        for (const rt::Instruction &ins : list) {
          int64_t biasAcc = -1, other = -1;
          bool cast = false;
          if (accumulation(r, ins, biasAcc, other, cast) && rt::storageOf(r, other) == bias)
            summed = true;
        }
      }
      if (!summed)
        continue;
      for (rt::Buffer &b : r.buffers) // the storage and its views
        if (b.dtype != LOOM_F32 && (b.id == bias || rt::storageOf(r, b.id) == bias)) {
          b.dtype = LOOM_F32;
          b.bytes = rt::numElements(b.shape).value_or(0) * 4;
        }
    }
    mm.out[0] = acc;
    if (!first) { // added into the sum; the first microbatch's product writes it
      mm.in.push_back(acc);
      mm.attrs["epilogue"] = epilogue.empty() ? "residual" : "bgrad_residual";
    }
    list.erase(list.begin() + std::ptrdiff_t(i));
    --i;
    ++folded;
  }
  return folded;
}

struct AccumulateInProductsPass : mlir::loom::impl::AccumulateInProductsBase<AccumulateInProductsPass> {
  void runOnOperation() override {
    auto rewrite = [&](StepRank &rank) {
      rt::RankProgram &r = rank.program;
      std::set<int64_t> kept = keptBuffers(r);
      for (auto &[name, list] : r.programs)
        if (name != "prepare" && name != "update")
          fold(r, list, kept);
    };
    if (failed(updateEachRank(getOperation(), getArgument(), rewrite)))
      signalPassFailure();
  }
};

} // namespace
