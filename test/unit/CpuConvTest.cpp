//===- CpuConvTest.cpp - The CPU's convolutions against direct sums -------===//
//
// The CPU backend computes a convolution and both its gradients as matrix
// products over image patches (im2col, then sgemm). Here each is checked
// against the definition, summed directly in double over every tap, for the
// shapes ResNet has (1x1 with and without stride, 3x3 padded, the 7x7 stride-2
// stem) and a grouped one, in both layouts; and the results must not depend
// on the number of threads (the backend splits the filter gradient's columns
// over them), bit for bit.
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Error.h"
#include "test/unit/SingleInstruction.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

using namespace loom::rt;
using loom::rt::test::Operands;
using loom::rt::test::runOnCpu;

namespace {

struct Conv {
  Shape x, w; // NCHW, OIHW
  int64_t stride, pad, groups;
  int64_t ho() const { return (x[2] + 2 * pad - w[2]) / stride + 1; }
  int64_t wo() const { return (x[3] + 2 * pad - w[3]) / stride + 1; }
  Shape y() const { return {x[0], w[0], ho(), wo()}; }
};

/// Where element (a, b, c, d) of a logically [A, B, C, D] tensor lives when
/// `nhwc` stores it [A, C, D, B].
int64_t at(const Shape &s, bool nhwc, int64_t a, int64_t b, int64_t c, int64_t d) {
  return nhwc ? ((a * s[2] + c) * s[3] + d) * s[1] + b : ((a * s[1] + b) * s[2] + c) * s[3] + d;
}

Shape stored(const Shape &s, bool nhwc) { return nhwc ? Shape{s[0], s[2], s[3], s[1]} : s; }

/// Calls f(n, oc, oh, ow, ci, kh, kw, ih, iw) for every tap of the
/// convolution that falls inside the image (ci within the group of oc).
template <typename F> void forEachTap(const Conv &c, F f) {
  int64_t og = c.w[0] / c.groups, cg = c.w[1];
  for (int64_t n = 0; n < c.x[0]; ++n)
    for (int64_t oc = 0; oc < c.w[0]; ++oc)
      for (int64_t oh = 0; oh < c.ho(); ++oh)
        for (int64_t ow = 0; ow < c.wo(); ++ow)
          for (int64_t ci = 0; ci < cg; ++ci)
            for (int64_t kh = 0; kh < c.w[2]; ++kh)
              for (int64_t kw = 0; kw < c.w[3]; ++kw) {
                int64_t ih = oh * c.stride - c.pad + kh, iw = ow * c.stride - c.pad + kw;
                if (ih >= 0 && ih < c.x[2] && iw >= 0 && iw < c.x[3])
                  f(n, oc, oh, ow, (oc / og) * cg + ci, ci, kh, kw, ih, iw);
              }
}

std::vector<float> random(const Shape &s, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(numElements(s).value());
  for (float &e : v)
    e = dist(rng);
  return v;
}

/// x, w and dy of a convolution, stored in its layout.
struct Values {
  std::vector<float> x, w, dy;
};

/// Random values for convolution `c`, from seeds seed to seed + 2.
Values randomValues(const Conv &c, bool nhwc, unsigned seed) {
  return {random(stored(c.x, nhwc), seed), random(stored(c.w, nhwc), seed + 1), random(stored(c.y(), nhwc), seed + 2)};
}

void expectClose(const std::vector<float> &got, const std::vector<double> &want, const std::string &what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0;
  for (double v : want)
    scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 1e-5 * std::max(scale, 1.0)) << what << " element " << i;
}

/// The three instructions of convolution `c` in `layout`, with `threads`.
struct Results {
  std::vector<float> y, dx, dw;
};

Results runAll(const Conv &c, bool nhwc, const std::vector<float> &x, const std::vector<float> &w,
               const std::vector<float> &dy, int threads) {
  nlohmann::json attrs = {{"stride", c.stride}, {"padding", c.pad}, {"groups", c.groups}};
  if (nhwc)
    attrs["layout"] = "nhwc";
  Shape xs = stored(c.x, nhwc), ws = stored(c.w, nhwc), ys = stored(c.y(), nhwc);
  Results r;
  r.y = runOnCpu("conv2d", Operands{{xs, ws}, {ys}}, attrs, {x, w}, threads)[0];
  r.dx = runOnCpu("conv2d_grad_input", Operands{{ys, ws}, {xs}}, attrs, {dy, w}, threads)[0];
  r.dw = runOnCpu("conv2d_grad_filter", Operands{{xs, ys}, {ws}}, attrs, {x, dy}, threads)[0];
  return r;
}

// Each large enough that the pool splits the filter gradient (over 5e4
// multiply-adds: ThreadPool.cpp runs smaller loops inline).
const Conv kCases[] = {
    {{3, 32, 8, 8}, {24, 32, 1, 1}, 1, 0, 1},  // pointwise: NHWC's patches are the image itself
    {{2, 32, 9, 9}, {48, 32, 1, 1}, 2, 0, 1},  // a downsampling shortcut
    {{2, 12, 8, 8}, {20, 12, 3, 3}, 1, 1, 1},  // 3x3 padded
    {{2, 3, 19, 19}, {8, 3, 7, 7}, 2, 3, 1},   // the stem
    {{4, 16, 9, 9}, {24, 8, 3, 3}, 2, 1, 2},   // grouped, strided
};

} // namespace

TEST(CpuConv, ForwardAndGradientsMatchDirectSums) {
  for (const Conv &c : kCases)
    for (bool nhwc : {false, true}) {
      SCOPED_TRACE(std::string(nhwc ? "nhwc " : "nchw ") + shapeStr(c.x) + " * " + shapeStr(c.w));
      Values v = randomValues(c, nhwc, 1);
      const std::vector<float> &x = v.x, &w = v.w, &dy = v.dy;
      std::vector<double> y(dy.size(), 0.0), dx(x.size(), 0.0), dw(w.size(), 0.0);
      Shape ys = c.y();
      forEachTap(c, [&](int64_t n, int64_t oc, int64_t oh, int64_t ow, int64_t cin, int64_t ci, int64_t kh, int64_t kw,
                        int64_t ih, int64_t iw) {
        int64_t xi = at(c.x, nhwc, n, cin, ih, iw), wi = at(c.w, nhwc, oc, ci, kh, kw), yi = at(ys, nhwc, n, oc, oh, ow);
        y[yi] += double(x[xi]) * w[wi];
        dx[xi] += double(dy[yi]) * w[wi];
        dw[wi] += double(dy[yi]) * x[xi];
      });
      Results r = runAll(c, nhwc, x, w, dy, 2);
      expectClose(r.y, y, "conv2d");
      expectClose(r.dx, dx, "conv2d_grad_input");
      expectClose(r.dw, dw, "conv2d_grad_filter");
    }
}

TEST(CpuConv, ResultsDoNotDependOnTheThreads) {
  for (const Conv &c : kCases)
    for (bool nhwc : {false, true}) {
      SCOPED_TRACE(std::string(nhwc ? "nhwc " : "nchw ") + shapeStr(c.x) + " * " + shapeStr(c.w));
      Values v = randomValues(c, nhwc, 4);
      const std::vector<float> &x = v.x, &w = v.w, &dy = v.dy;
      Results one = runAll(c, nhwc, x, w, dy, 1);
      for (int threads : {2, 3, 7}) {
        Results more = runAll(c, nhwc, x, w, dy, threads);
        EXPECT_EQ(more.y, one.y) << threads << " threads";
        EXPECT_EQ(more.dx, one.dx) << threads << " threads";
        EXPECT_EQ(more.dw, one.dw) << threads << " threads";
      }
    }
}

/// A filter larger than the padded image is an error naming the sizes, not
/// a product over negative extents.
TEST(CpuConv, FilterLargerThanTheImageIsAnError) {
  Operands o{{{1, 2, 3, 3}, {4, 2, 5, 5}}, {{1, 4, 1, 1}}};
  try {
    runOnCpu("conv2d", o, {{"stride", 1}, {"padding", 0}}, {std::vector<float>(18), std::vector<float>(200)});
    FAIL() << "a 5x5 filter over a 3x3 image ran";
  } catch (const Error &e) {
    EXPECT_NE(std::string(e.what()).find("5x5 filter does not fit a 3x3 image"), std::string::npos) << e.what();
  }
}

/// Wide padding makes an image's patch matrix far larger than any buffer
/// (66,049 pixels x 8,192 taps, 2.02 GiB): refused when the kernel is built,
/// naming the sizes, instead of allocated.
TEST(CpuConv, PatchMatrixPastTheLimitIsRefused) {
  Operands o{{{1, 8192, 1, 1}, {1, 8192, 1, 1}}, {{1, 1, 257, 257}}};
  try {
    runOnCpu("conv2d", o, {{"stride", 1}, {"padding", 128}}, {std::vector<float>(8192), std::vector<float>(8192)});
    FAIL() << "a 2 GiB patch matrix was asked for";
  } catch (const Error &e) {
    EXPECT_EQ(e.code, LOOM_UNSUPPORTED);
    EXPECT_NE(std::string(e.what()).find("66049 pixels x 8192 taps"), std::string::npos) << e.what();
  }
}
