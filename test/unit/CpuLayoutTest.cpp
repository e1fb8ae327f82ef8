//===- CpuLayoutTest.cpp - The CPU backend's NHWC forms against NCHW ------===//
//
// Every CNN instruction that takes `layout = "nhwc"` (convolution and both
// its gradients, max and average pooling and their gradients, batch norm and
// its gradient, alone and with a fused ReLU) runs on the CPU backend once
// NCHW and once NHWC, on the same random values laid out each way; the NHWC
// results, transposed back, must equal the NCHW ones bit for bit (the
// kernels keep their summation order across layouts). The CPU backend is
// the reference the GPU's NHWC kernels are checked against
// (CudaConvTest.cpp), so its NHWC forms are checked here without a GPU.
//
//===----------------------------------------------------------------------===//

#include "test/unit/SingleInstruction.h"

#include <gtest/gtest.h>

#include <random>

using namespace loom::rt;
using loom::rt::test::Operands;
using loom::rt::test::runOnCpu;

namespace {

/// [N, C, H, W] values stored NHWC (rank-4 operands; others as they are).
std::vector<float> toNhwc(const std::vector<float> &v, const Shape &s) {
  if (s.size() != 4)
    return v;
  std::vector<float> out(v.size());
  for (int64_t n = 0; n < s[0]; ++n)
    for (int64_t c = 0; c < s[1]; ++c)
      for (int64_t h = 0; h < s[2]; ++h)
        for (int64_t w = 0; w < s[3]; ++w)
          out[((n * s[2] + h) * s[3] + w) * s[1] + c] = v[((n * s[1] + c) * s[2] + h) * s[3] + w];
  return out;
}

Shape nhwcShape(const Shape &s) { return s.size() == 4 ? Shape{s[0], s[2], s[3], s[1]} : s; }

/// `op` NCHW (shapes as given) against `op` NHWC: every output equal.
void expectSameInBothLayouts(const std::string &op, const Operands &nchw, nlohmann::json attrs) {
  SCOPED_TRACE(op + " " + attrs.dump());
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<std::vector<float>> in, inNhwc;
  Operands nhwc;
  for (const Shape &s : nchw.in) {
    in.emplace_back(numElements(s).value());
    for (float &v : in.back())
      v = dist(rng);
    inNhwc.push_back(toNhwc(in.back(), s));
    nhwc.in.push_back(nhwcShape(s));
  }
  for (const Shape &s : nchw.out)
    nhwc.out.push_back(nhwcShape(s));
  auto want = runOnCpu(op, nchw, attrs, in);
  attrs["layout"] = "nhwc";
  auto got = runOnCpu(op, nhwc, attrs, inNhwc);
  for (size_t i = 0; i < want.size(); ++i) {
    std::vector<float> expected = toNhwc(want[i], nchw.out[i]);
    ASSERT_EQ(got[i].size(), expected.size());
    for (size_t k = 0; k < expected.size(); ++k)
      ASSERT_EQ(got[i][k], expected[k]) << "output " << i << " element " << k;
  }
}

} // namespace

TEST(CpuLayout, ConvolutionsNhwcMatchNchw) {
  struct Case {
    Shape x, w;
    int64_t stride, pad, groups;
  };
  for (const Case &c : {Case{{2, 8, 6, 6}, {16, 8, 1, 1}, 1, 0, 1}, Case{{2, 8, 10, 10}, {16, 8, 3, 3}, 2, 1, 1},
                        Case{{2, 3, 20, 20}, {8, 3, 7, 7}, 2, 3, 1}, Case{{2, 8, 6, 6}, {8, 4, 3, 3}, 1, 1, 2}}) {
    int64_t ho = (c.x[2] + 2 * c.pad - c.w[2]) / c.stride + 1, wo = (c.x[3] + 2 * c.pad - c.w[3]) / c.stride + 1;
    Shape y{c.x[0], c.w[0], ho, wo};
    nlohmann::json attrs = {{"stride", c.stride}, {"padding", c.pad}, {"groups", c.groups}};
    expectSameInBothLayouts("conv2d", {{c.x, c.w}, {y}}, attrs);
    expectSameInBothLayouts("conv2d_grad_input", {{y, c.w}, {c.x}}, attrs);
    expectSameInBothLayouts("conv2d_grad_filter", {{c.x, y}, {c.w}}, attrs);
  }
}

TEST(CpuLayout, PoolingNhwcMatchesNchw) {
  Shape x{2, 4, 9, 9}, y{2, 4, 5, 5};
  nlohmann::json attrs = {{"kernel", 3}, {"stride", 2}, {"padding", 1}};
  expectSameInBothLayouts("max_pool2d", {{x}, {y}}, attrs);
  expectSameInBothLayouts("max_pool2d_grad", {{x, y}, {x}}, attrs);
  expectSameInBothLayouts("avg_pool2d", {{x}, {y}}, attrs);
  expectSameInBothLayouts("avg_pool2d_grad", {{y}, {x}}, attrs);
}

TEST(CpuLayout, BatchNormNhwcMatchesNchw) {
  for (const Shape &x : {Shape{4, 6, 5, 5}, Shape{3, 5, 1, 1}}) {
    Shape c{x[1]};
    for (nlohmann::json attrs : {nlohmann::json{{"eps", 1e-5}}, nlohmann::json{{"eps", 1e-5}, {"activation", "relu"}}}) {
      bool relu = attrs.contains("activation");
      expectSameInBothLayouts("batchnorm", {{x, c, c}, {x}}, attrs);
      Operands grad{{x, c, x}, {x, c, c}};
      if (relu)
        grad.in.push_back(x);
      expectSameInBothLayouts("batchnorm_grad", grad, attrs);
    }
  }
}
