//===- SplitTensorReduce.cpp - A row-parallel product's sum in two halves -===//
//
// The loom-split-tensor-reduce pass. In a Megatron-style layer's forward
// (without sequence parallelism) the row-parallel product's partial result
// is all-reduced over the tensor-parallel group, and the residual add
// after it waits for the sum:
//
//   matmul(x, w) -> y
//   all_reduce(y) -> s          {group = "tp"}
//   add(s, bias, residual) ...
//
// The sum of a row needs only that row's products, so the product is cut
// into two halves of its rows, and the first half's all-reduce goes out on
// the communication stream while the second half's product runs:
//
//   matmul(x[first rows], w) -> y[first rows]
//   all_reduce(y[first rows]) -> s[first rows]    {async, event = e1}
//   matmul(x[last rows], w) -> y[last rows]
//   all_reduce(y[last rows]) -> s[last rows]      {async, event = e2}
//   event_wait {event = e1}, event_wait {event = e2}
//   add(s, bias, residual) ...
//
// Every rank cuts at the same rows and issues the two all-reduces in the same
// order. The values are the same: a row's sum is the same sum of the same
// products. (The backward's all-reduces already run beside the weight
// gradients, loom-overlap-tensor-reduce; with sequence parallelism the sum is
// a reduce-scatter of the ranks' tokens, which is not cut.)
//
// Only where the product writes the all-reduce's input right before it and
// can be cut (RowSplit.h), on ranks without async collectives of other
// groups (data-parallel buckets: the same stream, in order).
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/RowSplit.h"
#include "passes/StepState.h"

namespace mlir::loom {
#define GEN_PASS_DEF_SPLITTENSORREDUCE
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

/// Cuts the forward sums of one program; returns how many.
int64_t split(rt::RankProgram &r, std::vector<rt::Instruction> &list, int64_t &nextEventId) {
  constexpr int64_t kHalves = 2;
  RowSplitter rows(r);
  int64_t done = 0;
  for (size_t i = 1; i < list.size(); ++i) {
    const rt::Instruction &reduce = list[i];
    const rt::Instruction &product = list[i - 1];
    if (reduce.op != "all_reduce" || flagAttr(reduce, "async") || reduce.in.size() != 1 || reduce.out.size() != 1 ||
        !reduce.attrs.is_object() || reduce.attrs.value("group", std::string()) != "tp" ||
        reduce.attrs.contains("wire"))
      continue;
    if (product.op != "matmul" || flagAttr(product, "transpose_a") || product.out.size() != 1 ||
        product.in.size() < 2 || !splittableEpilogue(product))
      continue;
    int64_t in = reduce.in[0], out = reduce.out[0], y = product.out[0];
    int64_t root = rt::storageOf(r, y);
    // The all-reduce reads all of what the product wrote; the product reads
    // neither the sum nor its own result.
    if (rt::storageOf(r, in) != root || r.buffers[size_t(in)].bytes != r.buffers[size_t(root)].bytes ||
        r.buffers[size_t(y)].bytes != r.buffers[size_t(root)].bytes)
      continue;
    bool reads = false;
    for (int64_t id : product.in)
      reads |= rt::storageOf(r, id) == root || rt::storageOf(r, id) == rt::storageOf(r, out);
    const rt::Buffer &a = r.buffers[size_t(product.in[0])], &s = r.buffers[size_t(out)];
    const rt::Buffer &x = r.buffers[size_t(in)];
    if (reads || !rows.cuttable(product, kHalves) || a.viewOffset != 0 || x.shape.empty() || s.shape.empty() ||
        x.shape[0] % kHalves || s.shape[0] % kHalves || x.bytes != s.bytes || x.viewOffset != 0 || s.viewOffset != 0)
      continue;
    std::vector<rt::Instruction> replaced;
    std::vector<int64_t> events;
    for (int64_t h = 0; h < kHalves; ++h) {
      replaced.push_back(rows.rows(product, rows.slice(product.in[0], kHalves, h, h + 1), kHalves, h, h + 1));
      rt::Instruction part = reduce;
      // The product's half of its result, or the same rows of the view the sum reads.
      part.in = {in == y ? replaced.back().out[0] : rows.slice(in, kHalves, h, h + 1)};
      part.out = {rows.slice(out, kHalves, h, h + 1)};
      part.attrs["async"] = true;
      part.attrs["event"] = nextEventId;
      events.push_back(nextEventId++);
      replaced.push_back(std::move(part));
    }
    for (int64_t e : events)
      replaced.push_back(rt::Instruction{"event_wait", {}, {}, json{{"event", e}}});
    list.erase(list.begin() + std::ptrdiff_t(i - 1), list.begin() + std::ptrdiff_t(i + 1));
    list.insert(list.begin() + std::ptrdiff_t(i - 1), replaced.begin(), replaced.end());
    i += replaced.size() - 2;
    ++done;
  }
  return done;
}

struct SplitTensorReducePass : mlir::loom::impl::SplitTensorReduceBase<SplitTensorReducePass> {
  void runOnOperation() override {
    auto rewrite = [&](rt::RankProgram &r, std::vector<rt::Instruction> &list, int64_t &event) {
      split(r, list, event);
    };
    if (failed(updateGroupPrograms(getOperation(), getArgument(), "tp", rewrite)))
      signalPassFailure();
  }
};

} // namespace
