//===- ModelSummaryTest.cpp - Parameter and FLOP counts of the zoo --------===//
//
// The parameter counts are the published ones (GPT-2 124M with tied
// embeddings, ResNet-50 as torchvision counts it, TinyLlama 1.1B); the
// training FLOPs are checked against 6N + 12 L h s per token.
//
//===----------------------------------------------------------------------===//

#include "compiler/ModelSummary.h"
#include "compiler/PlannerModel.h"
#include "dialects/loom/IR/LoomDialect.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"

#include <gtest/gtest.h>

using namespace mlir;

namespace {
class ModelSummaryTest : public ::testing::Test {
protected:
  ModelSummaryTest() { context.loadDialect<mlir::loom::LoomDialect, func::FuncDialect>(); }

  mlir::loom::ModelSummary summarize(const std::string &file) {
    std::string path = std::string(LOOM_MODELS_DIR) + "/" + file;
    module = parseSourceFile<ModuleOp>(path, &context);
    EXPECT_TRUE(module) << "cannot parse " << path;
    if (!module)
      return {};
    FailureOr<mlir::loom::ModelSummary> summary = mlir::loom::summarizeModel(*module);
    EXPECT_TRUE(succeeded(summary));
    return succeeded(summary) ? *summary : mlir::loom::ModelSummary();
  }

  /// 6N + 12 L h s: training FLOPs per token of a GPT (Kaplan et al.; Megatron-LM).
  static double gptTrainingFlopsPerToken(double n, double l, double h, double s) {
    return 6 * n + 12 * l * h * s;
  }

  MLIRContext context;
  OwningOpRef<ModuleOp> module;
};
} // namespace

TEST_F(ModelSummaryTest, Gpt2Small) {
  mlir::loom::ModelSummary s = summarize("gpt2-124m.mlir");
  EXPECT_EQ(s.numParams, 124439808);
  EXPECT_EQ(s.tokensPerExample, 1024);
  ASSERT_EQ(s.repeats.size(), 1u);
  EXPECT_EQ(s.repeats[0].count, 12);
  EXPECT_EQ(s.repeats[0].paramsPerLayer, 12 * 768 * 768 + 13 * 768);
  double perToken = s.trainingFlops() / s.tokensPerExample;
  double formula = gptTrainingFlopsPerToken(124439808, 12, 768, 1024);
  // The count leaves out position embeddings, biases and norms (no matmul).
  EXPECT_NEAR(perToken / formula, 1.0, 0.01) << perToken << " vs " << formula;
  // Exact: 3 x (24 h^2 + 4 s h per layer + 2 h V for the head).
  EXPECT_DOUBLE_EQ(perToken, 3.0 * (12 * (24.0 * 768 * 768 + 4.0 * 1024 * 768) + 2.0 * 768 * 50257));
  EXPECT_EQ(s.opCounts["attention"], 12);
  EXPECT_EQ(s.opCounts["matmul"], 49);
}

TEST_F(ModelSummaryTest, Gpt2Medium) {
  mlir::loom::ModelSummary s = summarize("gpt2-350m.mlir");
  EXPECT_EQ(s.numParams, 354871296);
  double perToken = s.trainingFlops() / s.tokensPerExample;
  double formula = gptTrainingFlopsPerToken(354871296, 24, 1024, 1024);
  EXPECT_NEAR(perToken / formula, 1.0, 0.01) << perToken << " vs " << formula;
}

TEST_F(ModelSummaryTest, LlamaStyle) {
  mlir::loom::ModelSummary s = summarize("llama-1.1b.mlir");
  EXPECT_EQ(s.numParams, 1100048384); // TinyLlama-1.1B
  EXPECT_EQ(s.opCounts["rotary"], 44);
  EXPECT_EQ(s.opCounts["rmsnorm"], 45);
}

TEST_F(ModelSummaryTest, BertBase) {
  mlir::loom::ModelSummary s = summarize("bert-base.mlir");
  int64_t h = 768, v = 30522, f = 3072;
  int64_t layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h;
  int64_t embeddings = v * h + 512 * h + 2 * h;
  int64_t head = h * h + h + 2 * h + v;
  EXPECT_EQ(s.numParams, embeddings + 12 * layer + head);
}

TEST_F(ModelSummaryTest, ResNet50) {
  mlir::loom::ModelSummary s = summarize("resnet50.mlir");
  EXPECT_EQ(s.numParams, 25557032); // torchvision's count, BatchNorm affine included
  EXPECT_EQ(s.opCounts["conv2d"], 53);
  // About 4.1 G multiply-adds per 224x224 image.
  EXPECT_NEAR(s.forwardFlops / 2e9, 4.09, 0.05);
  EXPECT_EQ(s.tokensPerExample, 0);
}

TEST_F(ModelSummaryTest, Mlp) {
  mlir::loom::ModelSummary s = summarize("mlp.mlir");
  EXPECT_EQ(s.numParams, 784 * 256 + 256 + 2 * (256 * 256 + 256) + 256 * 10 + 10);
  EXPECT_DOUBLE_EQ(s.forwardFlops, 2.0 * (784 * 256 + 2 * 256 * 256 + 256 * 10));
}

TEST_F(ModelSummaryTest, NeedsForward) {
  std::string diagnostics;
  ScopedDiagnosticHandler handler(&context, [&](Diagnostic &d) {
    diagnostics += d.str();
    return success();
  });
  module = parseSourceString<ModuleOp>(
      "func.func @other(%x: tensor<2xf32>) -> tensor<2xf32> { return %x : tensor<2xf32> }",
      &context);
  ASSERT_TRUE(module);
  EXPECT_TRUE(failed(mlir::loom::summarizeModel(*module)));
  EXPECT_NE(diagnostics.find("no @forward"), std::string::npos) << diagnostics;
}

TEST(WithThousands, Groups) {
  EXPECT_EQ(mlir::loom::withThousands(0), "0");
  EXPECT_EQ(mlir::loom::withThousands(999), "999");
  EXPECT_EQ(mlir::loom::withThousands(124439808), "124,439,808");
  EXPECT_EQ(mlir::loom::withThousands(-1234), "-1,234");
}

// The planner's view takes each op's tensor-parallel rule from the same
// interface loom-partition-tp applies: a GPT layer splits (tp divides the
// heads, two all-reduces), and BERT's masked-LM head, whose layernorm reads
// a column-parallel result, does not (loom-partition-tp refuses it too).
TEST_F(ModelSummaryTest, PlannerViewUsesTheTensorParallelRules) {
  summarize("gpt2-350m.mlir");
  FailureOr<::loom::planner::ModelSpec> gpt = mlir::loom::buildModelSpec(*module, "gpt2-350m");
  ASSERT_TRUE(succeeded(gpt));
  const ::loom::planner::LayerSpec *layer = nullptr;
  for (const auto &l : gpt->layers)
    if (l.name == "layer.0")
      layer = &l;
  ASSERT_NE(layer, nullptr);
  EXPECT_EQ(layer->tpDivisor, 16);
  EXPECT_EQ(layer->tpAllReduces, 2);
  EXPECT_GT(layer->shardedParams, 0.9 * layer->params);

  summarize("bert-tiny.mlir");
  FailureOr<::loom::planner::ModelSpec> bert = mlir::loom::buildModelSpec(*module, "bert-tiny");
  ASSERT_TRUE(succeeded(bert));
  EXPECT_EQ(bert->layers.back().name, "head");
  EXPECT_EQ(bert->layers.back().tpDivisor, 1);
}
