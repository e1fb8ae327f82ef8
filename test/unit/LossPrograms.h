//===- LossPrograms.h - The loss and its gradient, apart or fused -*- C++ -*-===//
//
// What CpuLossTest.cpp and CudaLossTest.cpp share: the cross-entropy loss
// and its gradient as a training step has them (cross_entropy; fill of the
// seed; cross_entropy_grad) and as loom-fuse-loss-gradient leaves them (one
// cross_entropy that writes the gradient over the logits), run on a backend
// over the same logits and targets.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_TEST_UNIT_LOSSPROGRAMS_H
#define LOOM_TEST_UNIT_LOSSPROGRAMS_H

#include "loom/rt/Error.h"
#include "test/unit/SingleInstruction.h"

#include <functional>
#include <memory>
#include <random>

namespace loom::rt::test {

struct LossResult {
  float loss = 0;
  std::vector<float> grad; // the logits' gradient, widened
};

/// Runs the loss over `rows` rows of `vocab` logits (dtype `dt`, uniform in
/// [-4, 4) from `seed`) and targets (the last row's is `badTarget` where that
/// is set), fused or apart, seed `scale`, on the backend `make` returns.
/// `vocabGroup`: as the vocabulary-parallel loss over a group of one rank
/// (its kernels around the all-reduces, which a group of one skips).
inline LossResult runLoss(bool fused, int64_t rows, int64_t vocab, loom_dtype_t dt, float scale,
                          const std::function<std::unique_ptr<Backend>(const RankProgram &)> &make,
                          uint32_t seed = 3, int64_t badTarget = 0, bool vocabGroup = false) {
  ProgramBuilder p;
  int64_t logits = p.add({rows, vocab}, dt, "logits"), targets = p.add({rows}, LOOM_I32, "targets");
  int64_t loss = p.add({}, LOOM_F32, "loss");
  std::vector<Instruction> program;
  int64_t grad = logits;
  nlohmann::json attrs = nlohmann::json::object();
  if (vocabGroup)
    attrs["vocab_group"] = "tp";
  if (fused) {
    attrs["grad_scale"] = scale;
    program.push_back({"cross_entropy", {logits, targets}, {loss, logits}, attrs});
  } else {
    int64_t dloss = p.add({1}, LOOM_F32, "dloss");
    grad = p.add({rows, vocab}, dt, "dlogits");
    program.push_back({"cross_entropy", {logits, targets}, {loss}, attrs});
    program.push_back({"fill", {}, {dloss}, {{"value", scale}}});
    program.push_back({"cross_entropy_grad", {logits, targets, dloss}, {grad}, attrs});
  }
  RankProgram r = p.finish(program);
  if (vocabGroup)
    r.groups["tp"] = {0};
  std::unique_ptr<Backend> be = make(r);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  std::vector<char> bytes = floatBytes(r.buffers[logits], [&](int64_t) { return dist(rng); });
  be->upload(r.buffers[logits], bytes.data());
  std::vector<int32_t> t(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i)
    t[size_t(i)] = int32_t(rng() % uint32_t(vocab));
  if (badTarget != 0)
    t.back() = int32_t(badTarget);
  be->upload(r.buffers[targets], t.data());
  be->prepare("forward", program);
  be->run("forward");
  LossResult out;
  be->download(r.buffers[loss], &out.loss);
  out.grad = downloadFloats(*be, r.buffers[grad]);
  return out;
}

} // namespace loom::rt::test

#endif
