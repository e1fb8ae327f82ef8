//===- CpuLossTest.cpp - The loss with its gradient, on the CPU ------------===//
//
// loom-fuse-loss-gradient's cross_entropy, which overwrites the logits with
// the loss's gradient, against the loss and its gradient as separate
// instructions on the CPU backend: the same loss and gradient bit for bit
// (f32, and bf16 storage computed through f32 copies), for several seeds
// (the microbatch's share), and the same error for a target outside the
// vocabulary.
//
//===----------------------------------------------------------------------===//

#include "test/unit/LossPrograms.h"

#include <gtest/gtest.h>

#include <cstring>

using namespace loom::rt;
using loom::rt::test::LossResult;
using loom::rt::test::ProgramBuilder;
using loom::rt::test::runLoss;

namespace {

std::unique_ptr<Backend> cpu(const RankProgram &r) { return makeCpuBackend(r, 2); }

TEST(CpuLoss, FusedGradientEqualsSeparate) {
  for (loom_dtype_t dt : {LOOM_F32, LOOM_BF16})
    for (float scale : {1.0f, 0.25f})
      for (auto [rows, vocab] : {std::pair<int64_t, int64_t>{37, 1003}, {8, 256}}) {
        SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(vocab) + (dt == LOOM_BF16 ? " bf16" : " f32") +
                     " scale " + std::to_string(scale));
        LossResult apart = runLoss(false, rows, vocab, dt, scale, cpu);
        LossResult fused = runLoss(true, rows, vocab, dt, scale, cpu);
        EXPECT_EQ(std::memcmp(&apart.loss, &fused.loss, sizeof(float)), 0) << apart.loss << " " << fused.loss;
        ASSERT_EQ(apart.grad.size(), fused.grad.size());
        EXPECT_EQ(std::memcmp(apart.grad.data(), fused.grad.data(), apart.grad.size() * sizeof(float)), 0);
        // Each row's gradient sums to zero (softmax minus one-hot), scaled.
        double rowSum = 0;
        for (int64_t j = 0; j < vocab; ++j)
          rowSum += fused.grad[size_t(j)];
        EXPECT_NEAR(rowSum, 0.0, 1e-3 * scale);
        EXPECT_GT(fused.loss, 0.0f);
      }
}

TEST(CpuLoss, VocabularyParallelFusedGradientEqualsSeparate) {
  // The vocabulary-parallel loss (vocab_group, here a group of one) writing
  // its gradient over the logits: the loss and gradient of the two
  // instructions, bit for bit.
  for (loom_dtype_t dt : {LOOM_F32, LOOM_BF16}) {
    SCOPED_TRACE(dt == LOOM_BF16 ? "bf16" : "f32");
    LossResult apart = runLoss(false, 37, 1003, dt, 0.25f, cpu, 3, 0, /*vocabGroup=*/true);
    LossResult fused = runLoss(true, 37, 1003, dt, 0.25f, cpu, 3, 0, /*vocabGroup=*/true);
    EXPECT_EQ(std::memcmp(&apart.loss, &fused.loss, sizeof(float)), 0) << apart.loss << " " << fused.loss;
    ASSERT_EQ(apart.grad.size(), fused.grad.size());
    EXPECT_EQ(std::memcmp(apart.grad.data(), fused.grad.data(), apart.grad.size() * sizeof(float)), 0);
    LossResult whole = runLoss(false, 37, 1003, dt, 0.25f, cpu);
    EXPECT_NEAR(fused.loss, whole.loss, 1e-5 * whole.loss);
  }
}

TEST(CpuLoss, FusedRejectsTargetOutsideVocabulary) {
  try {
    runLoss(true, 4, 64, LOOM_F32, 1.0f, cpu, 3, 64);
    FAIL() << "no error for target 64 of 64 classes";
  } catch (const Error &e) {
    EXPECT_NE(std::string(e.what()).find("target class"), std::string::npos) << e.what();
  }
}

TEST(CpuLoss, FusedNeedsItsLogitsAsSecondOutput) {
  ProgramBuilder p;
  int64_t logits = p.add({2, 8}, LOOM_F32), targets = p.add({2}, LOOM_I32), loss = p.add({}, LOOM_F32),
          other = p.add({2, 8}, LOOM_F32);
  std::vector<Instruction> program = {{"cross_entropy", {logits, targets}, {loss, other}, {{"grad_scale", 1.0}}}};
  RankProgram r = p.finish(program);
  auto be = makeCpuBackend(r, 1);
  try {
    be->prepare("forward", program);
    FAIL() << "accepted a gradient written elsewhere than the logits";
  } catch (const Error &e) {
    EXPECT_NE(std::string(e.what()).find("second output must be its first input"), std::string::npos) << e.what();
  }
}

} // namespace
