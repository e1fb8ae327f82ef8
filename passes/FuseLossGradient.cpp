//===- FuseLossGradient.cpp - The loss writes its own gradient ------------===//
//
// The loom-fuse-loss-gradient pass. A training step computes the
// cross-entropy loss at the forward's end and its gradient at the
// backward's start, each from the logits:
//
//   cross_entropy(logits, targets) -> loss
//   fill(1/m) -> dloss                 (m microbatches)
//   cross_entropy_grad(logits, targets, dloss) -> dlogits
//
// Both find each row's maximum and sum of exponentials, so the logits are
// read three times (GPT-2 350M at batch 8: 824 MB each) and the gradient
// needs memory of its own beside them. Where the gradient's seed is that
// constant and nothing but the loss and its gradient reads the logits, the
// loss writes the gradient too, into the logits' own memory:
//
//   cross_entropy(logits, targets) -> loss, logits   {grad_scale = 1/m}
//
// and the gradient's readers read the logits' buffer. The kernels read
// each row once, then overwrite it (the CPU, the CUDA runtime); the loss
// and the gradient are the values the two instructions computed, bit for
// bit on the CPU. The logits' gradient no longer has memory of its own: the
// peak is one logits tensor lower where it fell there.
//
// A vocabulary split over tensor-parallel ranks (`vocab_group`) combines
// its statistics through collectives, then writes each rank's part of the
// gradient from them (the same statistics the gradient instruction
// computed again: bit for bit on the CPU); a tp2 rank of GPT-2 350M at
// batch 16 keeps no 412 MB gradient of its half of the logits.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"

namespace mlir::loom {
#define GEN_PASS_DEF_FUSELOSSGRADIENT
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

/// Programs in the order a training step runs them (loom-plan-memory's).
int programOrder(const std::string &name) {
  if (name == "forward")
    return 0;
  if (name == "step")
    return 1;
  if (name == "backward")
    return 2;
  return -1;
}

bool before(const InstructionSite &a, const InstructionSite &b) {
  int pa = programOrder(a.program), pb = programOrder(b.program);
  return pa >= 0 && pb >= 0 && (pa < pb || (pa == pb && a.index < b.index));
}

bool hasAttr(const rt::Instruction &ins, const char *name) {
  return ins.attrs.is_object() && ins.attrs.contains(name);
}

int64_t fuseLossGradients(rt::RankProgram &r) {
  auto [readers, writers] = storageUses(r);
  std::set<int64_t> kept = keptBuffers(r), viewed = viewedBuffers(r), outputs;
  for (const rt::NamedBuffer &nb : r.outputs)
    outputs.insert(nb.buffer);
  std::map<std::string, std::vector<bool>> dropped;
  for (const auto &[name, list] : r.programs)
    dropped[name].assign(list.size(), false);
  std::vector<std::pair<int64_t, int64_t>> renames; // the gradient's buffer -> the logits'
  int64_t fused = 0;
  for (auto &[name, list] : r.programs) {
    if (programOrder(name) < 0)
      continue;
    for (size_t i = 0; i < list.size(); ++i) {
      rt::Instruction &loss = list[i];
      if (loss.op != "cross_entropy" || loss.in.size() != 2 || loss.out.size() != 1)
        continue;
      int64_t logits = loss.in[0], targets = loss.in[1];
      int64_t root = rt::storageOf(r, logits);
      if (outputs.count(logits) || kept.count(logits) || outputs.count(root) || kept.count(root))
        continue;
      // Exactly two readers of the logits' storage: this loss and one gradient after it.
      const std::vector<InstructionSite> &reads = readers[root];
      if (reads.size() != 2)
        continue;
      InstructionSite here{name, i};
      const InstructionSite &other = reads[0].program == name && reads[0].index == i ? reads[1] : reads[0];
      if (!before(here, other))
        continue;
      rt::Instruction &grad = r.programs[other.program][other.index];
      if (grad.op != "cross_entropy_grad" || grad.in.size() != 3 || grad.out.size() != 1 ||
          grad.in[0] != logits || grad.in[1] != targets || hasAttr(grad, "vocab_group") != hasAttr(loss, "vocab_group") ||
          (hasAttr(loss, "vocab_group") && grad.attrs["vocab_group"] != loss.attrs["vocab_group"]))
        continue;
      // Nothing writes the logits or the targets between the two.
      auto writtenBetween = [&](int64_t id) {
        for (const InstructionSite &w : writers[rt::storageOf(r, id)])
          if (before(here, w) && before(w, other))
            return true;
        return false;
      };
      if (writtenBetween(logits) || writtenBetween(targets))
        continue;
      // The seed: one fill of a constant, before the gradient.
      int64_t seed = grad.in[2];
      const std::vector<InstructionSite> &seedWrites = writers[rt::storageOf(r, seed)];
      if (seedWrites.size() != 1 || r.buffers[seed].viewOf >= 0 || viewed.count(seed) || outputs.count(seed) ||
          kept.count(seed))
        continue;
      const InstructionSite &fillSite = seedWrites[0];
      const rt::Instruction &fill = r.programs[fillSite.program][fillSite.index];
      if (fill.op != "fill" || !hasAttr(fill, "value") || !fill.attrs["value"].is_number() ||
          r.buffers[seed].dtype != LOOM_F32 || rt::numElements(r.buffers[seed].shape) != 1)
        continue;
      // The gradient takes the logits' place: same type, its own storage,
      // not kept for anyone outside the step.
      int64_t dlogits = grad.out[0];
      const rt::Buffer &lb = r.buffers[logits], &gb = r.buffers[dlogits];
      if (gb.viewOf >= 0 || gb.dtype != lb.dtype || gb.shape != lb.shape || outputs.count(dlogits) ||
          kept.count(dlogits) || writers[dlogits].size() != 1)
        continue;
      loss.out.push_back(logits);
      loss.attrs = loss.attrs.is_object() ? loss.attrs : json::object();
      loss.attrs["grad_scale"] = fill.attrs["value"];
      dropped[other.program][other.index] = true;
      if (readers[seed].size() == 1)
        dropped[fillSite.program][fillSite.index] = true;
      renames.push_back({dlogits, logits});
      ++fused;
    }
  }
  if (!fused)
    return 0;
  for (auto &[name, list] : r.programs)
    eraseMarked(list, dropped[name]);
  for (auto [from, to] : renames)
    renameBuffer(r, from, to);
  return fused;
}

struct FuseLossGradientPass : mlir::loom::impl::FuseLossGradientBase<FuseLossGradientPass> {
  void runOnOperation() override {
    auto rewrite = [&](StepRank &rank) { fuseLossGradients(rank.program); };
    if (failed(updateEachRank(getOperation(), getArgument(), rewrite)))
      signalPassFailure();
  }
};

} // namespace
