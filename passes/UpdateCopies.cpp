//===- UpdateCopies.cpp - The optimizer writes the bf16 weight copies -----===//
//
// The loom-update-copies pass. Mixed-precision training keeps f32 master
// weights; the forward (and a recomputing backward) casts each to bf16
// before the products read it, every step: for GPT-2 350M a pass over 1.4
// GB of masters and 0.7 GB of copies. The update has just read and written
// every master, so it writes the bf16 copy too, as a fourth output of
// `adamw` (third of `sgd`), and the casts go:
//
// - each qualifying weight's copies become one buffer (a tied embedding's
//   readers each had their own), role cache: kept across steps, never saved;
// - the casts leave the step's programs; a `prepare` program holds them,
//   which the runtime runs whenever weights are written (initialisation,
//   weights files, checkpoints, Session::write), so the copies are whole
//   before the first step;
// - the update's `adamw` / `sgd` of the master names the copy as its last
//   output, written from the updated master with the cast's rounding
//   (nearest even), so the copies hold the same bits as the casts made.
//
// A weight qualifies where the update's optimizer instruction is the only
// thing that writes it and everything else reads it through casts to bf16
// whose results no other instruction writes. ZeRO-1's masters (gathered by
// loom-zero-gather-copies, or by the update's f32 gather) are written by
// their gathers and do not qualify.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"

namespace mlir::loom {
#define GEN_PASS_DEF_UPDATECOPIES
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;

namespace {

/// Whether `ins` is an in-place optimizer step of its first input with
/// only its own outputs (no copy yet).
bool plainUpdate(const rt::Instruction &ins) {
  if (ins.op == "adamw")
    return ins.in.size() == 6 && ins.out.size() == 3 && ins.out[0] == ins.in[0];
  if (ins.op == "sgd")
    return ins.in.size() == 5 && ins.out.size() == 2 && ins.out[0] == ins.in[0];
  return false;
}

int64_t updateCopies(rt::RankProgram &r) {
  auto up = r.programs.find("update");
  if (up == r.programs.end())
    return 0;
  std::set<int64_t> params, viewed = viewedBuffers(r), outputs;
  for (const rt::Parameter &p : r.params)
    params.insert(p.buffer);
  for (const rt::NamedBuffer &nb : r.outputs)
    outputs.insert(nb.buffer);
  auto [readers, writers] = storageUses(r);
  std::map<std::string, std::vector<bool>> dropped;
  for (const auto &[name, list] : r.programs)
    dropped[name].assign(list.size(), false);
  std::vector<rt::Instruction> prepare;
  int64_t moved = 0;
  std::vector<rt::Instruction> &update = up->second;
  for (size_t u = 0; u < update.size(); ++u) {
    if (!plainUpdate(update[u]))
      continue;
    int64_t master = update[u].in[0];
    const rt::Buffer &mb = r.buffers[master];
    if (!params.count(master) || viewed.count(master) || mb.viewOf >= 0 || mb.dtype != LOOM_F32)
      continue;
    bool onlyUpdated = writers[master].size() == 1;
    if (!onlyUpdated)
      continue;
    std::vector<InstructionSite> casts;
    bool ok = true;
    for (const InstructionSite &s : readers[master]) {
      if (s.program == "update" && s.index == u)
        continue;
      const rt::Instruction &ins = r.programs[s.program][s.index];
      int64_t out = ins.out.size() == 1 ? ins.out[0] : -1;
      ok &= s.program != "update" && s.program != "prepare" && ins.op == "cast" && ins.in.size() == 1 &&
            ins.in[0] == master && out >= 0 && r.buffers[out].dtype == LOOM_BF16 && r.buffers[out].viewOf < 0 &&
            r.buffers[out].shape == mb.shape && !outputs.count(out) && !viewed.count(out) &&
            writers[out].size() == 1;
      casts.push_back(s);
    }
    if (!ok || casts.empty())
      continue;
    int64_t copy = r.programs[casts[0].program][casts[0].index].out[0];
    for (const InstructionSite &s : casts) {
      dropped[s.program][s.index] = true;
      int64_t other = r.programs[s.program][s.index].out[0];
      if (other != copy)
        renameBuffer(r, other, copy);
    }
    rt::Buffer &cb = r.buffers[copy];
    cb.role = rt::BufferRole::Cache;
    cb.name = mb.name + ".bf16";
    prepare.push_back(r.programs[casts[0].program][casts[0].index]); // master -> copy
    update[u].out.push_back(copy);
    ++moved;
  }
  if (!moved)
    return 0;
  for (auto &[name, list] : r.programs)
    eraseMarked(list, dropped[name]);
  std::vector<rt::Instruction> &prep = r.programs["prepare"];
  prep.insert(prep.end(), prepare.begin(), prepare.end());
  return moved;
}

struct UpdateCopiesPass : mlir::loom::impl::UpdateCopiesBase<UpdateCopiesPass> {
  void runOnOperation() override {
    auto rewrite = [&](StepRank &rank) { updateCopies(rank.program); };
    if (failed(updateEachRank(getOperation(), getArgument(), rewrite)))
      signalPassFailure();
  }
};

} // namespace
