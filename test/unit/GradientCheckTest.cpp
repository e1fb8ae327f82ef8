//===- GradientCheckTest.cpp - Analytic gradients vs finite differences ---===//
//
// For each differentiable op and for whole tiny models: compile a training
// bundle without an optimizer, run forward and backward on the CPU backend,
// and compare sampled gradient entries with central finite differences of
// the f32 loss, |analytic - numeric| <= 2e-2 * |numeric| + 2e-3 * scale,
// where scale is the largest gradient magnitude of that parameter.
//
//===----------------------------------------------------------------------===//

#include "compiler/bundle/BundleWriter.h"
#include "dialects/loom/IR/LoomDialect.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "runtime/src/Session.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

using namespace mlir;
namespace rt = ::loom::rt;

namespace {

struct IntInput {
  int64_t limit;
};

class GradientCheck : public ::testing::Test {
protected:
  GradientCheck() { context.loadDialect<mlir::loom::LoomDialect, func::FuncDialect>(); }

  /// Checks every parameter of `text` (@loss); int inputs get ids below their limit.
  /// With `nhwc`, compiled with loom-nhwc-layout (convolution networks channels last).
  void check(const std::string &text, int64_t batch = 1, int samples = 12, bool nhwc = false) {
    auto module = parseSourceString<ModuleOp>(text, &context);
    ASSERT_TRUE(module) << text;
    std::string dir = ::testing::TempDir() + "/loom-grad-" + std::to_string(::getpid()) + "-" +
                      ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir);
    mlir::loom::BundleOptions options;
    options.batch = batch;
    options.seed = 5;
    options.train = true;
    options.training.optimizer = "none";
    options.nhwc = nhwc;
    ASSERT_TRUE(succeeded(mlir::loom::writeBundle(*module, options, dir)));
    rt::Session s(dir, {});
    const rt::RankProgram &r = s.rank();
    std::mt19937 rng(3);
    for (const rt::NamedBuffer &in : r.inputs) {
      const rt::Buffer &b = r.buffers[in.buffer];
      int64_t n = rt::numElements(b.shape).value_or(0);
      std::vector<int32_t> ids(n);
      std::vector<float> values(n);
      for (auto &v : ids)
        v = static_cast<int32_t>(rng() % uint32_t(in.limit > 0 ? in.limit : 2));
      for (auto &v : values)
        v = std::normal_distribution<float>()(rng);
      if (b.dtype == LOOM_I32)
        s.bindInput(in.name, ids.data(), ids.size() * 4);
      else
        s.bindInput(in.name, values.data(), values.size() * 4);
    }
    // Nudge parameters off special values (ones, zeros) so every path is exercised.
    for (const rt::Parameter &p : r.params) {
      float *w = reinterpret_cast<float *>(s.data(r.buffers[p.buffer]));
      int64_t n = r.buffers[p.buffer].bytes / 4;
      for (int64_t i = 0; i < n; ++i)
        w[i] += 0.3f * std::normal_distribution<float>()(rng);
    }
    s.runProgram("forward");
    s.runProgram("backward");
    // Copy every gradient first: the forward runs below reuse activation memory.
    std::vector<std::vector<float>> grads;
    for (const rt::Parameter &p : r.params) {
      ASSERT_GE(p.grad, 0) << "no gradient for " << p.name;
      const float *g = reinterpret_cast<const float *>(s.data(r.buffers[p.grad]));
      grads.emplace_back(g, g + r.buffers[p.grad].bytes / 4);
    }
    int checked = 0;
    for (size_t pi = 0; pi < r.params.size(); ++pi) {
      const rt::Parameter &p = r.params[pi];
      const rt::Buffer &pb = r.buffers[p.buffer];
      int64_t n = pb.bytes / 4;
      const std::vector<float> &grad = grads[pi];
      float scale = 0;
      for (float g : grad)
        scale = std::max(scale, std::abs(g));
      float *w = reinterpret_cast<float *>(s.data(pb));
      for (int k = 0; k < samples && k < n; ++k) {
        int64_t i = k == 0 ? 0 : rng() % n;
        float saved = w[i], h = 1e-2f * std::max(1.0f, std::abs(saved));
        w[i] = saved + h;
        s.runProgram("forward");
        double up = s.loss();
        w[i] = saved - h;
        s.runProgram("forward");
        double down = s.loss();
        w[i] = saved;
        double numeric = (up - down) / (2.0 * h);
        EXPECT_NEAR(grad[i], numeric, 2e-2 * std::abs(numeric) + 2e-3 * scale + 1e-6)
            << p.name << "[" << i << "]";
        ++checked;
      }
    }
    EXPECT_GT(checked, 0);
    std::filesystem::remove_all(dir);
  }

  /// A module whose @loss reduces sum(y * r), with y computed by `body` from parameters.
  std::string single(const std::string &params, const std::string &body, const std::string &yType,
                     int rank, const std::string &args = "") {
    std::string axes;
    for (int i = 0; i < rank; ++i)
      axes += (i ? ", " : "") + std::to_string(i);
    return "module {\n" + params + "  loom.param @r : " + yType + " init <normal(1.0)>\n" +
           "  func.func @forward(" + args + ") -> tensor<f32> { %z = loom.get @r : " + yType +
           "\n    %l = loom.reduce_sum %z {axes = array<i64: " + axes + ">} : " + yType +
           "\n    return %l : tensor<f32> }\n" + "  func.func @loss(" + args +
           ") -> tensor<f32> {\n" + body + "    %r = loom.get @r : " + yType +
           "\n    %p = loom.mul %y, %r : " + yType + ", " + yType +
           "\n    %l = loom.reduce_sum %p {axes = array<i64: " + axes + ">} : " + yType +
           "\n    return %l : tensor<f32>\n  }\n}\n";
  }

  MLIRContext context;
};

const char *kA = "  loom.param @a : tensor<2x3x4xf32> init <normal(1.0)>\n";
const char *kB = "  loom.param @b : tensor<4xf32> init <normal(1.0)>\n";
const char *kGetA = "    %a = loom.get @a : tensor<2x3x4xf32>\n";
const char *kGetB = "    %b = loom.get @b : tensor<4xf32>\n";
const char *kT = "tensor<2x3x4xf32>";

TEST_F(GradientCheck, BinaryOpsWithBroadcasting) {
  for (const char *op : {"add", "sub", "mul", "div"})
    check(single(std::string(kA) + kB,
                 std::string(kGetA) + kGetB + "    %y = loom." + op + " %a, %b : " + kT +
                     ", tensor<4xf32>\n",
                 kT, 3));
}

TEST_F(GradientCheck, UnaryOps) {
  for (const char *op : {"gelu", "gelu {approximate}", "relu", "silu", "exp", "tanh", "neg",
                         "scale {factor = 2.5 : f64}"}) {
    std::string name(op), attrs;
    if (auto sp = name.find(' '); sp != std::string::npos)
      attrs = name.substr(sp), name = name.substr(0, sp);
    check(single(kA, std::string(kGetA) + "    %y = loom." + name + " %a" + attrs + " : " + kT + "\n",
                 kT, 3));
  }
  // rsqrt needs positive inputs.
  check(single("  loom.param @a : tensor<2x3x4xf32> init <constant(2.0)>\n",
               std::string(kGetA) + "    %q = loom.mul %a, %a : " + kT + ", " + kT +
                   "\n    %y = loom.rsqrt %q : " + kT + "\n",
               kT, 3));
}

TEST_F(GradientCheck, Matmul) {
  std::string w = "  loom.param @w : tensor<4x5xf32> init <normal(1.0)>\n";
  check(single(std::string(kA) + w,
               std::string(kGetA) + "    %w = loom.get @w : tensor<4x5xf32>\n"
               "    %y = loom.matmul %a, %w : " + kT + ", tensor<4x5xf32>\n",
               "tensor<2x3x5xf32>", 3));
  std::string wt = "  loom.param @w : tensor<5x4xf32> init <normal(1.0)>\n";
  check(single(std::string(kA) + wt,
               std::string(kGetA) + "    %w = loom.get @w : tensor<5x4xf32>\n"
               "    %y = loom.matmul %a, %w {transpose_b} : " + kT + ", tensor<5x4xf32>\n",
               "tensor<2x3x5xf32>", 3));
  // Batched, both operands parameters, transposed lhs.
  std::string c = "  loom.param @c : tensor<2x3x5xf32> init <normal(1.0)>\n";
  check(single(std::string(kA) + c,
               std::string(kGetA) + "    %c = loom.get @c : tensor<2x3x5xf32>\n"
               "    %y = loom.matmul %a, %c {transpose_a} : " + kT + ", tensor<2x3x5xf32>\n",
               "tensor<2x4x5xf32>", 3));
}

TEST_F(GradientCheck, ReductionsAndSoftmax) {
  check(single(kA, std::string(kGetA) + "    %y = loom.reduce_sum %a {axes = array<i64: 1>} : " + kT + "\n",
               "tensor<2x4xf32>", 2));
  check(single(kA, std::string(kGetA) + "    %y = loom.reduce_mean %a {axes = array<i64: 0, 2>, keepdim} : " + kT + "\n",
               "tensor<1x3x1xf32>", 3));
  check(single(kA, std::string(kGetA) + "    %y = loom.reduce_max %a {axes = array<i64: 2>} : " + kT + "\n",
               "tensor<2x3xf32>", 2));
  check(single(kA, std::string(kGetA) + "    %y = loom.softmax %a {axis = 1} : " + kT + "\n", kT, 3));
}

TEST_F(GradientCheck, Normalisation) {
  std::string g = "  loom.param @g : tensor<4xf32> init <ones>\n  loom.param @be : tensor<4xf32> init <zeros>\n";
  std::string gets = "    %g = loom.get @g : tensor<4xf32>\n    %be = loom.get @be : tensor<4xf32>\n";
  check(single(kA + g, std::string(kGetA) + gets + "    %y = loom.layernorm %a, %g, %be : " + kT +
                           ", tensor<4xf32>, tensor<4xf32>\n",
               kT, 3));
  check(single(std::string(kA) + "  loom.param @g : tensor<4xf32> init <ones>\n",
               std::string(kGetA) + "    %g = loom.get @g : tensor<4xf32>\n" +
                   "    %y = loom.rmsnorm %a, %g : " + kT + ", tensor<4xf32>\n",
               kT, 3));
  std::string c = "  loom.param @x : tensor<3x2x2x2xf32> init <normal(1.0)>\n"
                  "  loom.param @g : tensor<2xf32> init <ones>\n  loom.param @be : tensor<2xf32> init <zeros>\n";
  check(single(c, "    %x = loom.get @x : tensor<3x2x2x2xf32>\n    %g = loom.get @g : tensor<2xf32>\n"
                  "    %be = loom.get @be : tensor<2xf32>\n"
                  "    %y = loom.batchnorm %x, %g, %be : tensor<3x2x2x2xf32>, tensor<2xf32>, tensor<2xf32>\n",
               "tensor<3x2x2x2xf32>", 4));
}

TEST_F(GradientCheck, TransformerPieces) {
  // Embedding with repeated ids (gradients accumulate), then rotary.
  std::string p = "  loom.param @t : tensor<10x8xf32> init <normal(1.0)>\n";
  check(single(p, "    %t = loom.get @t : tensor<10x8xf32>\n"
                  "    %e = loom.embedding %t, %ids : tensor<10x8xf32>, tensor<2x6xi32>\n"
                  "    %y = loom.rotary %e {num_heads = 2} : tensor<2x6x8xf32>\n",
               "tensor<2x6x8xf32>", 3, "%ids: tensor<2x6xi32>"));
  // Causal grouped-query attention: 4 query heads, 2 key/value heads.
  std::string qkv = "  loom.param @q : tensor<2x5x8xf32> init <normal(1.0)>\n"
                    "  loom.param @k : tensor<2x5x4xf32> init <normal(1.0)>\n"
                    "  loom.param @v : tensor<2x5x4xf32> init <normal(1.0)>\n";
  std::string gets = "    %q = loom.get @q : tensor<2x5x8xf32>\n    %k = loom.get @k : tensor<2x5x4xf32>\n"
                     "    %v = loom.get @v : tensor<2x5x4xf32>\n";
  check(single(qkv, gets + "    %y = loom.attention %q, %k, %v {causal, num_heads = 4, num_kv_heads = 2} : "
                           "tensor<2x5x8xf32>, tensor<2x5x4xf32>, tensor<2x5x4xf32>\n",
               "tensor<2x5x8xf32>", 3));
}

TEST_F(GradientCheck, CrossEntropy) {
  std::string text = "module {\n  loom.param @l : tensor<3x4x7xf32> init <normal(1.0)>\n"
                     "  func.func @forward(%t: tensor<3x4xi32>) -> tensor<f32> {\n"
                     "    %l = loom.get @l : tensor<3x4x7xf32>\n"
                     "    %c = loom.cross_entropy %l, %t : tensor<3x4x7xf32>, tensor<3x4xi32>\n"
                     "    return %c : tensor<f32> }\n"
                     "  func.func @loss(%t: tensor<3x4xi32>) -> tensor<f32> {\n"
                     "    %c = call @forward(%t) : (tensor<3x4xi32>) -> tensor<f32>\n"
                     "    return %c : tensor<f32> }\n}\n";
  check(text);
}

TEST_F(GradientCheck, ShapeOps) {
  check(single(kA, std::string(kGetA) + "    %y = loom.reshape %a : " + kT + " -> tensor<6x4xf32>\n",
               "tensor<6x4xf32>", 2));
  check(single(kA, std::string(kGetA) + "    %y = loom.transpose %a {permutation = array<i64: 2, 0, 1>} : " + kT + "\n",
               "tensor<4x2x3xf32>", 3));
  check(single(kA, std::string(kGetA) + "    %y = loom.slice %a {axis = 2, start = 1, size = 2} : " + kT + "\n",
               "tensor<2x3x2xf32>", 3));
  check(single(kA, std::string(kGetA) + "    %y = loom.concat %a, %a {axis = 1} : " + kT + ", " + kT + "\n",
               "tensor<2x6x4xf32>", 3));
  check(single(kB, std::string(kGetB) + "    %y = loom.broadcast %b : tensor<4xf32> -> tensor<3x4xf32>\n",
               "tensor<3x4xf32>", 2));
  check(single(kA, std::string(kGetA) + "    %c = loom.cast %a : " + kT + " -> tensor<2x3x4xf64>\n"
                   "    %y = loom.cast %c : tensor<2x3x4xf64> -> " + kT + "\n",
               kT, 3));
}

TEST_F(GradientCheck, Convolutions) {
  std::string p = "  loom.param @x : tensor<2x3x6x6xf32> init <normal(1.0)>\n"
                  "  loom.param @w : tensor<4x3x3x3xf32> init <normal(0.5)>\n";
  std::string gets = "    %x = loom.get @x : tensor<2x3x6x6xf32>\n    %w = loom.get @w : tensor<4x3x3x3xf32>\n";
  check(single(p, gets + "    %y = loom.conv2d %x, %w {padding = 1, stride = 2} : tensor<2x3x6x6xf32>, tensor<4x3x3x3xf32>\n",
               "tensor<2x4x3x3xf32>", 4));
  std::string x = "  loom.param @x : tensor<2x3x6x6xf32> init <normal(1.0)>\n";
  check(single(x, "    %x = loom.get @x : tensor<2x3x6x6xf32>\n"
                  "    %y = loom.max_pool2d %x {kernel = 3, padding = 1, stride = 2} : tensor<2x3x6x6xf32>\n",
               "tensor<2x3x3x3xf32>", 4));
  check(single(x, "    %x = loom.get @x : tensor<2x3x6x6xf32>\n"
                  "    %y = loom.avg_pool2d %x {kernel = 2, stride = 2} : tensor<2x3x6x6xf32>\n",
               "tensor<2x3x3x3xf32>", 4));
}

// conv -> batch norm -> relu -> pooling, in NCHW and compiled channels last
// (loom-nhwc-layout): the NHWC kernels' gradients, and those of the layout
// conversions (the image's, the filter's, the result's), are right too.
TEST_F(GradientCheck, ConvolutionNetworkNchwAndNhwc) {
  std::string p = "  loom.param @x : tensor<2x3x6x6xf32> init <normal(1.0)>\n"
                  "  loom.param @w : tensor<4x3x3x3xf32> init <normal(0.5)>\n"
                  "  loom.param @g : tensor<4xf32> init <normal(1.0)>\n"
                  "  loom.param @b : tensor<4xf32> init <normal(1.0)>\n";
  std::string net = "    %x = loom.get @x : tensor<2x3x6x6xf32>\n    %w = loom.get @w : tensor<4x3x3x3xf32>\n"
                    "    %g = loom.get @g : tensor<4xf32>\n    %b = loom.get @b : tensor<4xf32>\n"
                    "    %c = loom.conv2d %x, %w {padding = 1} : tensor<2x3x6x6xf32>, tensor<4x3x3x3xf32>\n"
                    "    %n = loom.batchnorm %c, %g, %b : tensor<2x4x6x6xf32>, tensor<4xf32>, tensor<4xf32>\n"
                    "    %a = loom.relu %n : tensor<2x4x6x6xf32>\n";
  for (bool nhwc : {false, true}) {
    SCOPED_TRACE(nhwc ? "nhwc" : "nchw");
    check(single(p, net + "    %y = loom.max_pool2d %a {kernel = 3, padding = 1, stride = 2} : tensor<2x4x6x6xf32>\n",
                 "tensor<2x4x3x3xf32>", 4),
          1, 12, nhwc);
    check(single(p, net + "    %y = loom.avg_pool2d %a {kernel = 2, stride = 2} : tensor<2x4x6x6xf32>\n",
                 "tensor<2x4x3x3xf32>", 4),
          1, 12, nhwc);
  }
}

TEST_F(GradientCheck, WholeTinyModels) {
  for (const char *file : {"gpt-tiny.mlir", "llama-tiny.mlir", "bert-tiny.mlir", "mlp.mlir"}) {
    SCOPED_TRACE(file);
    std::ifstream in(std::string(LOOM_MODELS_DIR) + "/" + file);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    check(text, 2, 3);
  }
}

} // namespace

namespace {
/// Recomputing a layer's activations in backward gives the same gradients,
/// bit for bit, with less activation memory.
TEST(Recompute, SameGradientsLessMemory) {
  MLIRContext context;
  context.loadDialect<mlir::loom::LoomDialect, func::FuncDialect>();
  auto module = parseSourceFile<ModuleOp>(std::string(LOOM_MODELS_DIR) + "/gpt-tiny.mlir", &context);
  ASSERT_TRUE(module);
  std::vector<std::vector<std::vector<float>>> grads;
  std::vector<int64_t> peaks;
  std::vector<float> losses;
  for (const char *mode : {"", "all", "layer.1"}) {
    std::string dir = ::testing::TempDir() + "/loom-recompute-" + std::to_string(::getpid()) + mode;
    std::filesystem::remove_all(dir);
    mlir::loom::BundleOptions options;
    options.batch = 4;
    options.train = true;
    options.training.optimizer = "none";
    if (*mode)
      options.training.recompute.insert(mode);
    ASSERT_TRUE(succeeded(mlir::loom::writeBundle(*module, options, dir)));
    rt::Session s(dir, {});
    std::vector<int32_t> tokens(4 * 32);
    for (size_t i = 0; i < tokens.size(); ++i)
      tokens[i] = static_cast<int32_t>((i * 7) % 256);
    s.bindInput("tokens", tokens.data(), tokens.size() * 4);
    s.bindInput("targets", tokens.data(), tokens.size() * 4);
    s.runProgram("forward");
    s.runProgram("backward");
    losses.push_back(s.loss());
    grads.emplace_back();
    for (const rt::Parameter &p : s.rank().params) {
      std::vector<char> bytes = s.read(s.rank().buffers[p.grad]);
      const float *g = reinterpret_cast<const float *>(bytes.data());
      grads.back().emplace_back(g, g + bytes.size() / 4);
    }
    peaks.push_back(s.rank().peakActivationBytes);
    std::filesystem::remove_all(dir);
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(grads[0], grads[1]) << "recomputing every layer changed the gradients";
  EXPECT_EQ(grads[0], grads[2]) << "recomputing layer.1 changed the gradients";
  EXPECT_LT(peaks[1], peaks[0]);
  EXPECT_LE(peaks[2], peaks[0]);
  std::printf("peak activation memory: %lld bytes kept, %lld recomputing all layers, %lld "
              "recomputing layer.1\n",
              (long long)peaks[0], (long long)peaks[1], (long long)peaks[2]);
}
} // namespace

namespace {
/// bf16 mixed precision: activations bf16; parameters, their gradients, the
/// optimizer state and the loss f32; gradients close to the f32 ones.
TEST(MixedPrecision, Bf16ComputeF32Masters) {
  MLIRContext context;
  context.loadDialect<mlir::loom::LoomDialect, func::FuncDialect>();
  auto module = parseSourceFile<ModuleOp>(std::string(LOOM_MODELS_DIR) + "/gpt-tiny.mlir", &context);
  ASSERT_TRUE(module);
  std::vector<std::vector<float>> grads[2];
  float losses[2];
  for (int bf16 = 0; bf16 < 2; ++bf16) {
    std::string dir = ::testing::TempDir() + "/loom-mp-" + std::to_string(::getpid()) + std::to_string(bf16);
    std::filesystem::remove_all(dir);
    mlir::loom::BundleOptions options;
    options.batch = 4;
    options.train = true;
    options.bf16 = bf16;
    ASSERT_TRUE(succeeded(mlir::loom::writeBundle(*module, options, dir)));
    rt::Session s(dir, {});
    const rt::RankProgram &r = s.rank();
    if (bf16) {
      bool anyBf16 = false;
      for (const rt::Buffer &b : r.buffers)
        anyBf16 |= b.dtype == LOOM_BF16;
      EXPECT_TRUE(anyBf16) << "no bf16 activations";
      for (const rt::Parameter &p : r.params) {
        EXPECT_EQ(r.buffers[p.buffer].dtype, LOOM_F32) << p.name;
        // Gradients stay bf16 (the optimizer widens them exactly itself),
        // except the tied embedding's: its two reads' gradients add in f32.
        EXPECT_EQ(r.buffers[p.grad].dtype, p.name == "wte" ? LOOM_F32 : LOOM_BF16) << p.name;
      }
      for (const rt::NamedBuffer &st : r.state)
        EXPECT_EQ(r.buffers[st.buffer].dtype, LOOM_F32) << st.name;
      EXPECT_EQ(r.buffers[r.outputs[0].buffer].dtype, LOOM_F32);
    }
    std::vector<int32_t> tokens(4 * 32);
    for (size_t i = 0; i < tokens.size(); ++i)
      tokens[i] = static_cast<int32_t>((i * 11) % 256);
    s.bindInput("tokens", tokens.data(), tokens.size() * 4);
    s.bindInput("targets", tokens.data(), tokens.size() * 4);
    s.runProgram("forward");
    s.runProgram("backward");
    losses[bf16] = s.loss();
    for (const rt::Parameter &p : r.params) {
      std::vector<char> bytes = s.read(r.buffers[p.grad]);
      std::vector<float> g;
      if (r.buffers[p.grad].dtype == LOOM_BF16)
        for (size_t i = 0; i < bytes.size() / 2; ++i)
          g.push_back(rt::bf16ToFloat(reinterpret_cast<const uint16_t *>(bytes.data())[i]));
      else
        g.assign(reinterpret_cast<const float *>(bytes.data()), reinterpret_cast<const float *>(bytes.data()) + bytes.size() / 4);
      grads[bf16].push_back(std::move(g));
    }
    std::filesystem::remove_all(dir);
  }
  EXPECT_NEAR(losses[1] / losses[0], 1.0, 1e-2);
  // Over all parameters together: some gradients are ~0 in exact arithmetic
  // (the key bias: softmax ignores a shift shared by all keys), so a
  // per-parameter relative error would compare rounding noise with noise.
  double diff = 0, ref = 0;
  for (size_t i = 0; i < grads[0].size(); ++i)
    for (size_t j = 0; j < grads[0][i].size(); ++j) {
      diff += std::pow(grads[1][i][j] - grads[0][i][j], 2);
      ref += std::pow(grads[0][i][j], 2);
    }
  double rel = std::sqrt(diff / ref);
  std::printf("bf16 vs f32 gradients: relative L2 error %.3g over all parameters\n", rel);
  EXPECT_LT(rel, 3e-2);
}
} // namespace
