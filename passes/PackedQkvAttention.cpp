//===- PackedQkvAttention.cpp - bf16 attention reads q|k|v in place -------===//
//
// The loom-packed-qkv-attention pass.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"


namespace mlir::loom {
#define GEN_PASS_DEF_PACKEDQKVATTENTION
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

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

struct PackedQkvAttentionPass : mlir::loom::impl::PackedQkvAttentionBase<PackedQkvAttentionPass> {
  void runOnOperation() override {
    auto rewrite = [&](StepRank &rank) {
      attentionReadsPackedQkv(rank.program, "forward", "backward");
      attentionReadsPackedQkv(rank.program, "step", "step");
    };
    if (failed(updateEachRank(getOperation(), getArgument(), rewrite)))
      signalPassFailure();
  }
};

} // namespace
