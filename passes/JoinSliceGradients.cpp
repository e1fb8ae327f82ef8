//===- JoinSliceGradients.cpp - Sliced operands' gradients as one concat ---===//
//
// The loom-join-slice-gradients pass.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"
#include <algorithm>
#include <functional>

namespace mlir::loom {
#define GEN_PASS_DEF_JOINSLICEGRADIENTS
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

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

struct JoinSliceGradientsPass : mlir::loom::impl::JoinSliceGradientsBase<JoinSliceGradientsPass> {
  void runOnOperation() override {
    auto rewrite = [&](StepRank &rank) {
      joinSliceGradients(rank.program);
    };
    if (failed(updateEachRank(getOperation(), getArgument(), rewrite)))
      signalPassFailure();
  }
};

} // namespace
