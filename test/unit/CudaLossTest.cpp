//===- CudaLossTest.cpp - The loss with its gradient: CUDA against CPU -----===//
//
// loom-fuse-loss-gradient's cross_entropy (the loss, then its gradient over
// the logits) on the GPU against the CPU backend: bf16 rows that fit in
// shared memory (GPT-2's 50,304 classes, Llama's 32,000, a small one) and
// rows that do not or are not whole vectors (the kernel that reads the row
// twice), f32; and against the GPU's own separate loss and gradient
// kernels. A target outside the vocabulary is an error. Skips where there
// is no GPU.
//
//===----------------------------------------------------------------------===//

#include "test/unit/GpuAgainstCpu.h"
#include "test/unit/LossPrograms.h"

#include <gtest/gtest.h>

#include <cmath>

using namespace loom::rt;
using loom::rt::test::haveGpu;
using loom::rt::test::LossResult;
using loom::rt::test::runLoss;

namespace {

std::unique_ptr<Backend> cpu(const RankProgram &r) { return makeCpuBackend(r, 2); }
std::unique_ptr<Backend> gpu(const RankProgram &r) { return makeCudaBackend(r, 0); }

double relativeL2(const std::vector<float> &got, const std::vector<float> &want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += double(got[i] - want[i]) * (got[i] - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

TEST(CudaLoss, FusedAgainstCpu) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  struct Case {
    int64_t rows, vocab;
    loom_dtype_t dt;
    double tol;
  };
  for (Case c : {Case{256, 50304, LOOM_BF16, 1e-2}, Case{300, 32000, LOOM_BF16, 1e-2}, Case{37, 1000, LOOM_BF16, 1e-2},
                 Case{37, 1003, LOOM_BF16, 1e-2}, Case{64, 50304, LOOM_F32, 1e-5}, Case{5, 120000, LOOM_BF16, 1e-2}})
    for (float scale : {1.0f, 0.5f}) {
      SCOPED_TRACE(std::to_string(c.rows) + " x " + std::to_string(c.vocab) + (c.dt == LOOM_BF16 ? " bf16" : " f32") +
                   " scale " + std::to_string(scale));
      LossResult want = runLoss(true, c.rows, c.vocab, c.dt, scale, cpu);
      LossResult got = runLoss(true, c.rows, c.vocab, c.dt, scale, gpu);
      LossResult apart = runLoss(false, c.rows, c.vocab, c.dt, scale, gpu);
      EXPECT_NEAR(got.loss, want.loss, 1e-5 * std::abs(want.loss));
      EXPECT_LE(relativeL2(got.grad, want.grad), c.tol);
      // The separate GPU kernels compute the same values.
      EXPECT_NEAR(got.loss, apart.loss, 1e-5 * std::abs(want.loss));
      EXPECT_LE(relativeL2(got.grad, apart.grad), c.tol);
    }
}

TEST(CudaLoss, VocabularyParallelKernelsAgainstCpu) {
  // The vocabulary-parallel loss and gradient (row maxima, sums and target
  // logits, then the gradient, around all-reduces a group of one skips):
  // rows of whole 16-byte vectors (GPT-2's 50,304 over two ranks: 25,152;
  // 32,000) and rows that are not (1,003), bf16 and f32.
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  struct Case {
    int64_t rows, vocab;
    loom_dtype_t dt;
    double tol;
  };
  for (Case c : {Case{256, 25152, LOOM_BF16, 1e-2}, Case{300, 32000, LOOM_BF16, 1e-2}, Case{37, 1003, LOOM_BF16, 1e-2},
                 Case{64, 25152, LOOM_F32, 1e-5}, Case{9, 1003, LOOM_F32, 1e-5}}) {
    SCOPED_TRACE(std::to_string(c.rows) + " x " + std::to_string(c.vocab) + (c.dt == LOOM_BF16 ? " bf16" : " f32"));
    LossResult want = runLoss(false, c.rows, c.vocab, c.dt, 0.5f, cpu);
    LossResult got = runLoss(false, c.rows, c.vocab, c.dt, 0.5f, gpu, 3, 0, /*vocabGroup=*/true);
    EXPECT_NEAR(got.loss, want.loss, 1e-5 * std::abs(want.loss));
    EXPECT_LE(relativeL2(got.grad, want.grad), c.tol);
    // The loss writing its gradient over the logits (loom-fuse-loss-gradient).
    LossResult fused = runLoss(true, c.rows, c.vocab, c.dt, 0.5f, gpu, 3, 0, /*vocabGroup=*/true);
    EXPECT_NEAR(fused.loss, want.loss, 1e-5 * std::abs(want.loss));
    EXPECT_LE(relativeL2(fused.grad, want.grad), c.tol);
  }
}

TEST(CudaLoss, FusedRejectsTargetOutsideVocabulary) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  for (int64_t vocab : {50304, 1003}) {
    try {
      runLoss(true, 4, vocab, LOOM_BF16, 1.0f, gpu, 3, vocab + 5);
      ADD_FAILURE() << "no error for target " << vocab + 5 << " of " << vocab << " classes";
    } catch (const Error &e) {
      EXPECT_NE(std::string(e.what()).find("target class"), std::string::npos) << e.what();
    }
  }
}

} // namespace
