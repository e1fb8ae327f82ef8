//===- CpuNorms.cpp - Reductions and normalisation ------------------------===//
//
// Sums, maxima and means over axes, softmax, and the layer, RMS and batch
// norms; their gradients are in CpuGradients.cpp.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cpu/CpuKernels.h"
#include "runtime/src/Elementwise.h"

#include <algorithm>
#include <cmath>

namespace loom::rt::cpu {

namespace {

enum class Reduce { Sum, Max, Mean };

template <Reduce R> Kernel buildReduce(const Ctx &c) {
  c.arity(1, 1);
  const Buffer &x = c.in(0), &o = c.out();
  c.needF32(x), c.needF32(o);
  std::vector<bool> reduced(x.shape.size(), false);
  for (int64_t a : c.attrInts("axes"))
    reduced[c.axis(a, x.shape.size())] = true;
  // Output strides seen from the input's index space (0 on reduced axes).
  Shape kept;
  for (size_t d = 0; d < x.shape.size(); ++d)
    if (!reduced[d])
      kept.push_back(x.shape[d]);
  if (count(kept) != count(o.shape))
    c.bad(cat("result ", shapeStr(o.shape), " does not match reducing ", shapeStr(x.shape)));
  std::vector<int64_t> keptStrides = stridesOf(kept), st(x.shape.size(), 0);
  for (size_t d = 0, kd = 0; d < x.shape.size(); ++d)
    if (!reduced[d])
      st[d] = keptStrides[kd++];
  std::vector<int64_t> unit = stridesOf(x.shape);
  float *px = c.f32(x), *po = c.f32(o);
  int64_t nOut = count(o.shape), nIn = count(x.shape);
  Shape shape = x.shape;
  double per = nOut ? double(nIn) / double(nOut) : 1;
  // Leading axes reduced, trailing kept (a bias gradient): output columns
  // over the threads, each summing its rows in the order below.
  size_t lead = 0;
  while (lead < reduced.size() && reduced[lead])
    ++lead;
  if (std::find(reduced.begin() + lead, reduced.end(), true) == reduced.end() && nOut > 0) {
    int64_t rows = nIn / nOut;
    ThreadPool *pool = &c.pool;
    return [=] {
      pool->parallelFor(nOut, double(rows), [&](int64_t j0, int64_t j1) {
        std::fill(po + j0, po + j1, R == Reduce::Max ? -INFINITY : 0.0f);
        for (int64_t r = 0; r < rows; ++r) {
          const float *xr = px + r * nOut;
          for (int64_t j = j0; j < j1; ++j)
            po[j] = R == Reduce::Max ? std::max(po[j], xr[j]) : po[j] + xr[j];
        }
        if (R == Reduce::Mean)
          for (int64_t j = j0; j < j1; ++j)
            po[j] = static_cast<float>(po[j] / per);
      });
    };
  }
  return [=] {
    std::fill(po, po + nOut, R == Reduce::Max ? -INFINITY : 0.0f);
    forEachBroadcast(shape, unit, st, [&](int64_t, int64_t ix, int64_t io) {
      if (R == Reduce::Max)
        po[io] = std::max(po[io], px[ix]);
      else
        po[io] += px[ix];
    });
    if (R == Reduce::Mean)
      for (int64_t i = 0; i < nOut; ++i)
        po[i] = static_cast<float>(po[i] / per);
  };
}


Kernel buildSoftmax(const Ctx &c) {
  c.arity(1, 1);
  c.needF32(c.in(0)), c.needF32(c.out());
  c.sameShape(c.in(0), c.out());
  int64_t axis = c.axis(c.attrInt("axis", -1), c.in(0).shape.size());
  int64_t outer, len, inner;
  splitAt(c.in(0).shape, axis, outer, len, inner);
  float *x = c.f32(c.in(0)), *y = c.f32(c.out());
  return [=] {
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t i = 0; i < inner; ++i) {
        const float *xs = x + o * len * inner + i;
        float *ys = y + o * len * inner + i;
        float mx = -INFINITY;
        for (int64_t j = 0; j < len; ++j)
          mx = std::max(mx, xs[j * inner]);
        double sum = 0;
        for (int64_t j = 0; j < len; ++j)
          sum += std::exp(xs[j * inner] - mx);
        for (int64_t j = 0; j < len; ++j)
          ys[j * inner] = static_cast<float>(std::exp(xs[j * inner] - mx) / sum);
      }
  };
}

Kernel buildNorm(const Ctx &c, bool rms) {
  c.arity(rms ? 2 : 3, 1);
  const Buffer &x = c.in(0);
  for (size_t i = 0; i < c.ins.in.size(); ++i)
    c.needF32(c.in(i));
  c.needF32(c.out());
  c.sameShape(x, c.out());
  if (x.shape.empty())
    c.bad("input must have rank >= 1");
  int64_t h = x.shape.back(), rows = count(x.shape) / std::max<int64_t>(h, 1);
  for (size_t i = 1; i < c.ins.in.size(); ++i)
    if (c.in(i).shape != Shape{h})
      c.bad(cat("parameter '", c.in(i).name, "' must be [", h, "]"));
  float eps = static_cast<float>(c.attrFloat("eps"));
  float *px = c.f32(x), *g = c.f32(c.in(1)), *b = rms ? nullptr : c.f32(c.in(2)), *py = c.f32(c.out());
  ThreadPool *pool = &c.pool;
  return [=] {
    pool->parallelFor(rows, double(4 * h), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float *xr = px + r * h;
        float *yr = py + r * h;
        double mean = rms ? 0.0 : sumInterleaved(h, [&](int64_t j) { return double(xr[j]); }) / h;
        double var = sumInterleaved(h, [&](int64_t j) { return (xr[j] - mean) * (xr[j] - mean); }) / h;
        float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
        for (int64_t j = 0; j < h; ++j)
          yr[j] = (xr[j] - static_cast<float>(mean)) * inv * g[j] + (b ? b[j] : 0.0f);
      }
    });
  };
}
Kernel buildLayerNorm(const Ctx &c) { return buildNorm(c, false); }
Kernel buildRMSNorm(const Ctx &c) { return buildNorm(c, true); }

Kernel buildBatchNorm(const Ctx &c) {
  c.arity(3, 1);
  const Buffer &x = c.in(0);
  for (size_t i = 0; i < 3; ++i)
    c.needF32(c.in(i));
  c.needF32(c.out());
  c.sameShape(x, c.out());
  BatchNormLayout l = batchNormLayout(c, x.shape);
  int64_t n = l.n, ch = l.ch, inner = l.inner;
  if (c.in(1).shape != Shape{ch} || c.in(2).shape != Shape{ch})
    c.bad(cat("gamma and beta must be [", ch, "]"));
  float eps = static_cast<float>(c.attrFloat("eps"));
  bool relu = batchNormRelu(c);
  float *px = c.f32(x), *g = c.f32(c.in(1)), *b = c.f32(c.in(2)), *py = c.f32(c.out());
  ThreadPool *pool = &c.pool;
  return [=] {
    pool->parallelFor(ch, double(n * inner), [&](int64_t c0, int64_t c1) {
      for (int64_t cc = c0; cc < c1; ++cc) {
        double mean = 0, var = 0;
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < inner; ++j)
            mean += px[l.at(i, cc, j)];
        mean /= double(n * inner);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < inner; ++j) {
            double d = px[l.at(i, cc, j)] - mean;
            var += d * d;
          }
        var /= double(n * inner);
        float inv = static_cast<float>(1.0 / std::sqrt(var + eps)), m = static_cast<float>(mean);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < inner; ++j) {
            int64_t at = l.at(i, cc, j);
            float v = (px[at] - m) * inv * g[cc] + b[cc];
            py[at] = relu ? ew::relu(v) : v;
          }
      }
    });
  };
}

} // namespace

void registerNormBuilders(BuilderTable &table) {
  table.insert({
      {"reduce_sum", buildReduce<Reduce::Sum>},
      {"reduce_max", buildReduce<Reduce::Max>},
      {"reduce_mean", buildReduce<Reduce::Mean>},
      {"softmax", buildSoftmax},
      {"layernorm", buildLayerNorm},
      {"rmsnorm", buildRMSNorm},
      {"batchnorm", buildBatchNorm},
  });
}

} // namespace loom::rt::cpu
