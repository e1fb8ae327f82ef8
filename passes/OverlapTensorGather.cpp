//===- OverlapTensorGather.cpp - A product's rows beside its all-gather ---===//
//
// The loom-overlap-tensor-gather pass. Under sequence parallelism each rank
// holds 1/tp of the tokens between the tensor-parallel layers, and a layer
// starts by all-gathering them for its product (the column-parallel
// product in the forward; the row-parallel product's input gradient in the
// backward):
//
//   all_gather(s) -> g          {group = "tp", axis = 0}
//   matmul(g, w, ...) -> y
//
// The rows of y that come from this rank's own tokens need nothing from
// the other ranks. So the gather goes out on the communication stream,
// the product of the rank's own rows runs beside it (reading s, writing
// their slice of y), and the product of the other ranks' rows waits for it:
//
//   all_gather(s) -> g          {group = "tp", axis = 0, async, event = e}
//   matmul(s, w, ...) -> y[own rows]
//   event_wait {event = e}
//   matmul(g[rows before], w, ...) -> y[rows before]
//   matmul(g[rows after], w, ...) -> y[rows after]
//
// (Megatron-LM's tensor-parallel communication overlap splits its GEMMs the
// same way, by the ranks' chunks.) The slices are views with an offset
// (`view_offset`): each operand that has a row per token (the product's
// input, its results, a residual, GELU's pre-activation) is cut at the same
// rows. The values are the same: each row's product is computed from the
// same operands.
//
// Only where the product is the gather's first reader and reads it as its
// left operand without transposing it (a weight gradient, X^T dY, needs
// every row), on ranks whose programs have no data-parallel buckets (the
// same communication stream, in order: the gather would wait behind them).
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/RowSplit.h"
#include "passes/StepState.h"

namespace mlir::loom {
#define GEN_PASS_DEF_OVERLAPTENSORGATHER
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

/// Splits the products after the tensor-parallel gathers of one program;
/// returns how many.
int64_t overlap(rt::RankProgram &r, std::vector<rt::Instruction> &list, int64_t &nextEventId) {
  auto members = r.groups.find("tp");
  if (members == r.groups.end())
    return 0;
  int64_t parts = int64_t(members->second.size());
  int64_t index = int64_t(std::find(members->second.begin(), members->second.end(), r.rank) - members->second.begin());
  if (parts < 2 || index >= parts)
    return 0;
  RowSplitter split(r);
  int64_t done = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    rt::Instruction &gather = list[i];
    if (gather.op != "all_gather" || flagAttr(gather, "async") || gather.in.size() != 1 || gather.out.size() != 1 ||
        !gather.attrs.is_object() || gather.attrs.value("group", std::string()) != "tp" ||
        gather.attrs.value("axis", int64_t(-1)) != 0)
      continue;
    int64_t s = gather.in[0], g = gather.out[0];
    int64_t sRoot = rt::storageOf(r, s), gRoot = rt::storageOf(r, g);
    // The gather's first reader, with nothing before it touching the
    // gather's operands or talking to another rank.
    size_t j = i + 1;
    bool clear = true;
    for (; j < list.size(); ++j) {
      bool reads = false, touches = false;
      for (int64_t id : list[j].in)
        reads |= rt::storageOf(r, id) == gRoot;
      for (int64_t id : list[j].out)
        touches |= rt::storageOf(r, id) == gRoot || rt::storageOf(r, id) == sRoot;
      if (reads || touches || ordersCollectives(list[j])) {
        clear = !touches && !ordersCollectives(list[j]);
        break;
      }
    }
    if (!clear || j == list.size())
      continue;
    rt::Instruction &product = list[j];
    if (product.op != "matmul" || flagAttr(product, "transpose_a") || product.in.size() < 2 ||
        !splittableEpilogue(product) || rt::storageOf(r, product.in[0]) != gRoot)
      continue;
    // The gather may be read only as the left operand, whole; the results
    // may not be read by the product (a residual added in place).
    bool other = false;
    for (size_t k = 1; k < product.in.size(); ++k)
      other |= rt::storageOf(r, product.in[k]) == gRoot;
    for (int64_t o : product.out)
      for (int64_t in : product.in)
        other |= rt::storageOf(r, o) == rt::storageOf(r, in);
    const rt::Buffer &a = r.buffers[size_t(product.in[0])];
    if (other || a.bytes != r.buffers[size_t(gRoot)].bytes || a.bytes != r.buffers[size_t(s)].bytes * parts ||
        !split.cuttable(product, parts))
      continue;
    int64_t event = nextEventId++;
    gather.attrs["async"] = true;
    gather.attrs["event"] = event;
    std::vector<rt::Instruction> replaced;
    // Own rows first, from the rank's own part (the gather only copies it).
    replaced.push_back(split.rows(product, split.partView(s, product.in[0], parts), parts, index, index + 1));
    replaced.push_back(rt::Instruction{"event_wait", {}, {}, json{{"event", event}}});
    if (index > 0)
      replaced.push_back(split.rows(product, split.slice(product.in[0], parts, 0, index), parts, 0, index));
    if (index + 1 < parts)
      replaced.push_back(
          split.rows(product, split.slice(product.in[0], parts, index + 1, parts), parts, index + 1, parts));
    list.erase(list.begin() + std::ptrdiff_t(j));
    list.insert(list.begin() + std::ptrdiff_t(j), replaced.begin(), replaced.end());
    i = j + replaced.size() - 1;
    ++done;
  }
  return done;
}

struct OverlapTensorGatherPass : mlir::loom::impl::OverlapTensorGatherBase<OverlapTensorGatherPass> {
  void runOnOperation() override {
    auto rewrite = [&](rt::RankProgram &r, std::vector<rt::Instruction> &list, int64_t &event) {
      overlap(r, list, event);
    };
    if (failed(updateGroupPrograms(getOperation(), getArgument(), "tp", rewrite)))
      signalPassFailure();
  }
};

} // namespace
