//===- CpuConv.cpp - Convolution and pooling ------------------------------===//
//
// Grouped 2-D convolution (accumulated in double, one task per image and
// output channel) and max / average pooling, NCHW or NHWC (`layout`); their
// gradients are in CpuGradients.cpp.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cpu/CpuKernels.h"

#include <algorithm>
#include <cmath>

namespace loom::rt::cpu {

namespace {

Kernel buildConv2D(const Ctx &c) {
  c.arity(2, 1);
  const Buffer &x = c.in(0), &w = c.in(1), &o = c.out();
  c.needF32(x), c.needF32(w), c.needF32(o);
  int64_t stride = c.attrInt("stride", 1), pad = c.attrInt("padding", 0), groups = c.attrInt("groups", 1);
  bool nhwc = channelsLast(c);
  if (x.shape.size() != 4 || w.shape.size() != 4 || o.shape.size() != 4 || stride < 1 || pad < 0 || groups < 1)
    c.bad("inconsistent conv2d shapes or attributes");
  ImageLayout xl = imageLayout(x.shape, nhwc), wl = imageLayout(w.shape, nhwc);
  if (xl.c != wl.c * groups || wl.n % groups)
    c.bad("inconsistent conv2d shapes or attributes");
  int64_t N = xl.n, H = xl.h, W = xl.w;
  int64_t O = wl.n, Cg = wl.c, KH = wl.h, KW = wl.w;
  int64_t Ho = (H + 2 * pad - KH) / stride + 1, Wo = (W + 2 * pad - KW) / stride + 1;
  Shape expected = imageShape(N, O, Ho, Wo, nhwc);
  if (o.shape != expected)
    c.bad(cat("result must be ", shapeStr(expected)));
  ImageLayout ol = imageLayout(o.shape, nhwc);
  float *px = c.f32(x), *pw = c.f32(w), *po = c.f32(o);
  int64_t Og = O / groups;
  ThreadPool *pool = &c.pool;
  return [=] {
    pool->parallelFor(N * O, double(Ho * Wo * Cg * KH * KW), [&](int64_t begin, int64_t end) {
      std::vector<double> acc(Ho * Wo);
      for (int64_t t = begin; t < end; ++t) {
        int64_t n = t / O, oc = t % O, g = oc / Og;
        std::fill(acc.begin(), acc.end(), 0.0);
        double *out = acc.data();
        for (int64_t ci = 0; ci < Cg; ++ci) {
          const float *in = px + xl.at(n, g * Cg + ci, 0, 0);
          for (int64_t kh = 0; kh < KH; ++kh)
            for (int64_t kw = 0; kw < KW; ++kw) {
              float wv = pw[wl.at(oc, ci, kh, kw)];
              for (int64_t oh = 0; oh < Ho; ++oh) {
                int64_t ih = oh * stride - pad + kh;
                if (ih < 0 || ih >= H)
                  continue;
                for (int64_t ow = 0; ow < Wo; ++ow) {
                  int64_t iw = ow * stride - pad + kw;
                  if (iw >= 0 && iw < W)
                    out[oh * Wo + ow] += double(wv) * in[ih * xl.sh + iw * xl.sw];
                }
              }
            }
        }
        for (int64_t oh = 0; oh < Ho; ++oh)
          for (int64_t ow = 0; ow < Wo; ++ow)
            po[ol.at(n, oc, oh, ow)] = static_cast<float>(acc[oh * Wo + ow]);
      }
    });
  };
}

template <bool Max> Kernel buildPool(const Ctx &c) {
  c.arity(1, 1);
  const Buffer &x = c.in(0), &o = c.out();
  c.needF32(x), c.needF32(o);
  int64_t k = c.attrInt("kernel"), stride = c.attrInt("stride", 1), pad = c.attrInt("padding", 0);
  bool nhwc = channelsLast(c);
  if (x.shape.size() != 4 || k < 1 || stride < 1 || pad < 0)
    c.bad("inconsistent pooling shapes or attributes");
  ImageLayout xl = imageLayout(x.shape, nhwc);
  int64_t N = xl.n, C = xl.c, H = xl.h, W = xl.w;
  int64_t Ho = (H + 2 * pad - k) / stride + 1, Wo = (W + 2 * pad - k) / stride + 1;
  Shape expected = imageShape(N, C, Ho, Wo, nhwc);
  if (o.shape != expected)
    c.bad(cat("result must be ", shapeStr(expected)));
  ImageLayout ol = imageLayout(o.shape, nhwc);
  float *px = c.f32(x), *po = c.f32(o);
  return [=] {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t ch = 0; ch < C; ++ch)
        for (int64_t oh = 0; oh < Ho; ++oh)
          for (int64_t ow = 0; ow < Wo; ++ow) {
            float acc = Max ? -INFINITY : 0.0f;
            for (int64_t kh = 0; kh < k; ++kh)
              for (int64_t kw = 0; kw < k; ++kw) {
                int64_t ih = oh * stride - pad + kh, iw = ow * stride - pad + kw;
                if (ih < 0 || ih >= H || iw < 0 || iw >= W)
                  continue;
                float v = px[xl.at(n, ch, ih, iw)];
                acc = Max ? std::max(acc, v) : acc + v;
              }
            // Average pooling counts the padding, as PyTorch does by default.
            po[ol.at(n, ch, oh, ow)] = Max ? acc : acc / float(k * k);
          }
  };
}

} // namespace

void registerConvBuilders(BuilderTable &table) {
  table.insert({
      {"conv2d", buildConv2D},
      {"max_pool2d", buildPool<true>},
      {"avg_pool2d", buildPool<false>},
  });
}

} // namespace loom::rt::cpu
