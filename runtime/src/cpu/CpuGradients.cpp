//===- CpuGradients.cpp - Gradient kernels (training) ---------------------===//
//
// The backward of the forward kernels in the other files, for training
// bundles: activations, softmax, norms, embedding, attention, cross-entropy,
// slices, max reductions and pooling (the convolution's are in CpuConv.cpp).
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cpu/CpuKernels.h"
#include "runtime/src/Elementwise.h"

#include <algorithm>
#include <cmath>

namespace loom::rt::cpu {

namespace {

Kernel buildFill(const Ctx &c) {
  c.arity(0, 1);
  c.needF32(c.out());
  float v = static_cast<float>(c.attrFloat("value"));
  float *y = c.f32(c.out());
  int64_t n = count(c.out().shape);
  return [=] { std::fill(y, y + n, v); };
}

LOOM_AVX2_CLONES void geluTanhGradRange(const float *__restrict x, const float *__restrict dy, float *__restrict dx,
                                        int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i)
    dx[i] = dy[i] * ew::geluTanhDerivative(x[i]);
}

Kernel buildUnaryGrad(const Ctx &c) {
  c.arity(3, 1);
  for (size_t i = 0; i < 3; ++i)
    c.needF32(c.in(i)), c.sameShape(c.in(i), c.out());
  auto it = c.ins.attrs.find("fn");
  std::string fn = it != c.ins.attrs.end() && it->is_string() ? it->get<std::string>() : "";
  float *x = c.f32(c.in(0)), *y = c.f32(c.in(1)), *dy = c.f32(c.in(2)), *dx = c.f32(c.out());
  int64_t n = count(c.out().shape);
  ew::Fn d = ew::parseFn(fn);
  if (d == ew::Fn::Unknown)
    c.bad("attribute 'fn' must name gelu, gelu_tanh, silu, relu, tanh, exp or rsqrt");
  ThreadPool *pool = &c.pool;
  if (d == ew::Fn::GeluTanh) // its own loop, which the compiler vectorises
    return [=] {
      pool->parallelFor(n, 20.0, [&](int64_t begin, int64_t end) { geluTanhGradRange(x, dy, dx, begin, end); });
    };
  return [=] {
    pool->parallelFor(n, 20.0, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        dx[i] = dy[i] * ew::derivative(d, x[i], y[i]);
    });
  };
}

Kernel buildSoftmaxGrad(const Ctx &c) {
  c.arity(2, 1);
  c.needF32(c.in(0)), c.needF32(c.in(1)), c.needF32(c.out());
  c.sameShape(c.in(0), c.out()), c.sameShape(c.in(1), c.out());
  int64_t axis = c.axis(c.attrInt("axis", -1), c.out().shape.size());
  int64_t outer, len, inner;
  splitAt(c.out().shape, axis, outer, len, inner);
  float *y = c.f32(c.in(0)), *dy = c.f32(c.in(1)), *dx = c.f32(c.out());
  return [=] {
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t i = 0; i < inner; ++i) {
        int64_t base = o * len * inner + i;
        double dot = 0;
        for (int64_t j = 0; j < len; ++j)
          dot += double(y[base + j * inner]) * dy[base + j * inner];
        for (int64_t j = 0; j < len; ++j)
          dx[base + j * inner] = static_cast<float>(y[base + j * inner] * (dy[base + j * inner] - dot));
      }
  };
}

/// layernorm_grad / rmsnorm_grad: (x, gamma, dy[, r]) -> dx, dgamma(, dbeta);
/// with r (the residual stream's gradient, x's shape) dx + r is written.
Kernel buildNormGrad(const Ctx &c, bool rms) {
  c.arity(c.ins.in.size() == 4 ? 4 : 3, rms ? 2 : 3);
  const Buffer &x = c.in(0);
  for (size_t i = 0; i < c.ins.in.size(); ++i)
    c.needF32(c.in(i));
  float *res = nullptr;
  if (c.ins.in.size() == 4) {
    c.sameShape(x, c.in(3));
    const Buffer &r = c.in(3), &o = c.out(0);
    if (r.offset != o.offset && r.offset < o.offset + o.bytes && o.offset < r.offset + r.bytes)
      c.bad("the residual gradient must be the result itself or not overlap it");
    res = c.f32(r);
  }
  for (size_t i = 0; i < c.ins.out.size(); ++i)
    c.needF32(c.out(i));
  c.sameShape(x, c.in(2)), c.sameShape(x, c.out(0));
  int64_t h = x.shape.back(), rows = count(x.shape) / std::max<int64_t>(h, 1);
  if (c.in(1).shape != Shape{h} || c.out(1).shape != Shape{h} || (!rms && c.out(2).shape != Shape{h}))
    c.bad(cat("gamma and its gradients must be [", h, "]"));
  double eps = c.attrFloat("eps");
  float *px = c.f32(x), *g = c.f32(c.in(1)), *dy = c.f32(c.in(2)), *dx = c.f32(c.out(0));
  float *dg = c.f32(c.out(1)), *db = rms ? nullptr : c.f32(c.out(2));
  ThreadPool *pool = &c.pool;
  return [=] {
    // Rows over the threads (dx and each row's mean and 1/std), then gamma's
    // and beta's gradients by columns over the threads, each column's sum
    // over the rows in order: the same sums whatever the threads.
    std::vector<double> means(rows), rstds(rows);
    pool->parallelFor(rows, double(6 * h), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float *xr = px + r * h, *dyr = dy + r * h;
        double mean = rms ? 0.0 : sumInterleaved(h, [&](int64_t j) { return double(xr[j]); }) / h;
        double var = sumInterleaved(h, [&](int64_t j) { return (xr[j] - mean) * (xr[j] - mean); }) / h;
        double rstd = 1.0 / std::sqrt(var + eps);
        double sumD = sumInterleaved(h, [&](int64_t j) { return double(dyr[j]) * g[j]; });
        double sumDX = sumInterleaved(h, [&](int64_t j) { return double(dyr[j]) * g[j] * ((xr[j] - mean) * rstd); });
        for (int64_t j = 0; j < h; ++j) {
          double xh = (xr[j] - mean) * rstd, d = double(dyr[j]) * g[j];
          double v = rstd * (d - (rms ? 0.0 : sumD / h) - xh * sumDX / h);
          dx[r * h + j] = res ? static_cast<float>(v) + res[r * h + j] : static_cast<float>(v);
        }
        means[r] = mean, rstds[r] = rstd;
      }
    });
    pool->parallelFor(h, double(3 * rows), [&](int64_t j0, int64_t j1) {
      std::vector<double> accG(j1 - j0, 0), accB(j1 - j0, 0);
      for (int64_t r = 0; r < rows; ++r) {
        const float *xr = px + r * h, *dyr = dy + r * h;
        double mean = means[r], rstd = rstds[r];
        for (int64_t j = j0; j < j1; ++j) {
          double xh = (xr[j] - mean) * rstd;
          accG[j - j0] += double(dyr[j]) * xh;
          accB[j - j0] += dyr[j];
        }
      }
      for (int64_t j = j0; j < j1; ++j) {
        dg[j] = static_cast<float>(accG[j - j0]);
        if (db)
          db[j] = static_cast<float>(accB[j - j0]);
      }
    });
  };
}
Kernel buildLayerNormGrad(const Ctx &c) { return buildNormGrad(c, false); }
Kernel buildRMSNormGrad(const Ctx &c) { return buildNormGrad(c, true); }

Kernel buildBatchNormGrad(const Ctx &c) {
  bool relu = batchNormRelu(c);
  c.arity(relu ? 4 : 3, 3);
  const Buffer &x = c.in(0);
  for (size_t i = 0; i < 3; ++i)
    c.needF32(c.in(i)), c.needF32(c.out(i));
  c.sameShape(x, c.in(2)), c.sameShape(x, c.out(0));
  if (relu)
    c.needF32(c.in(3)), c.sameShape(x, c.in(3));
  BatchNormLayout l = batchNormLayout(c, x.shape);
  int64_t n = l.n, ch = l.ch, inner = l.inner;
  double eps = c.attrFloat("eps");
  float *px = c.f32(x), *g = c.f32(c.in(1)), *pdy = c.f32(c.in(2)), *dx = c.f32(c.out(0));
  float *dg = c.f32(c.out(1)), *db = c.f32(c.out(2)), *py = relu ? c.f32(c.in(3)) : nullptr;
  ThreadPool *pool = &c.pool;
  return [=] {
    pool->parallelFor(ch, double(n * inner * 3), [&](int64_t c0, int64_t c1) {
      for (int64_t cc = c0; cc < c1; ++cc) {
        double cnt = double(n * inner), mean = 0, var = 0;
        auto at = [&](int64_t i, int64_t j) { return l.at(i, cc, j); };
        // With a fused ReLU, its gradient first (unary_grad's dy * relu'(y)).
        auto dyAt = [&](int64_t k) { return py ? pdy[k] * ew::derivative(ew::Fn::Relu, py[k], 0) : pdy[k]; };
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < inner; ++j)
            mean += px[at(i, j)];
        mean /= cnt;
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < inner; ++j)
            var += (px[at(i, j)] - mean) * (px[at(i, j)] - mean);
        var /= cnt;
        double rstd = 1.0 / std::sqrt(var + eps), sumD = 0, sumDX = 0, sumDy = 0, sumDyX = 0;
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < inner; ++j) {
            float dy = dyAt(at(i, j));
            double xh = (px[at(i, j)] - mean) * rstd, d = double(dy) * g[cc];
            sumD += d, sumDX += d * xh, sumDy += dy, sumDyX += dy * xh;
          }
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < inner; ++j) {
            double xh = (px[at(i, j)] - mean) * rstd, d = double(dyAt(at(i, j))) * g[cc];
            dx[at(i, j)] = static_cast<float>(rstd * (d - sumD / cnt - xh * sumDX / cnt));
          }
        dg[cc] = static_cast<float>(sumDyX);
        db[cc] = static_cast<float>(sumDy);
      }
    });
  };
}

Kernel buildEmbeddingGrad(const Ctx &c) {
  c.arity(2, 1);
  const Buffer &ids = c.in(0), &dy = c.in(1), &dt = c.out();
  c.needInt(ids), c.needF32(dy), c.needF32(dt);
  if (dt.shape.size() != 2)
    c.bad("the table gradient must be [vocab, hidden]");
  Shape want = ids.shape;
  want.push_back(dt.shape[1]);
  if (dy.shape != want)
    c.bad(cat("the output gradient must be ", shapeStr(want)));
  int64_t vocab = dt.shape[0], h = dt.shape[1], n = count(ids.shape);
  auto [start, parts] = vocabSlice(c, vocab);
  IndexReader read{c.arena + ids.offset, ids.dtype == LOOM_I64};
  float *pdy = c.f32(dy), *pdt = c.f32(dt);
  std::string where = c.where, name = ids.name;
  // `accumulate`: added into the table's gradient, not written over it;
  // `scale`: each row scaled first (loom-gather-embedding-rows: 1 / dp).
  bool accumulate = c.attrFlag("accumulate");
  float scale = static_cast<float>(c.attrFloat("scale", 1.0));
  if (accumulate && dt.dtype != LOOM_F32)
    c.bad("accumulates into f32 tables only");
  return [=] {
    checkIndices(where, "token id in '" + name + "'", read, n, vocab * parts);
    if (!accumulate)
      std::fill(pdt, pdt + vocab * h, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      int64_t row = read(i) - start;
      if (row >= 0 && row < vocab)
        for (int64_t j = 0; j < h; ++j)
          pdt[row * h + j] += scale * pdy[i * h + j];
    }
  };
}

Kernel buildAttentionGrad(const Ctx &c) {
  if (c.ins.attrs.contains("packed"))
    return buildPackedAttention(c, true);
  c.arity(4, 3);
  const Buffer &q = c.in(0), &k = c.in(1), &v = c.in(2), &dO = c.in(3);
  for (size_t i = 0; i < 4; ++i)
    c.needF32(c.in(i));
  for (size_t i = 0; i < 3; ++i)
    c.needF32(c.out(i)), c.sameShape(c.in(i), c.out(i));
  c.sameShape(q, dO);
  int64_t heads = c.attrInt("num_heads"), kvHeads = c.attrInt("num_kv_heads", heads);
  if (q.shape.size() != 3 || k.shape != v.shape || heads < 1 || kvHeads < 1 || heads % kvHeads ||
      q.shape[2] % heads || k.shape[2] != q.shape[2] / heads * kvHeads)
    c.bad("inconsistent attention gradient shapes");
  int64_t B = q.shape[0], S = q.shape[1], T = k.shape[1], D = q.shape[2] / heads, group = heads / kvHeads;
  bool causal = c.attrFlag("causal");
  float scale = static_cast<float>(c.attrFloat("scale", 1.0 / std::sqrt(double(D))));
  float *pq = c.f32(q), *pk = c.f32(k), *pv = c.f32(v), *pdo = c.f32(dO);
  float *dq = c.f32(c.out(0)), *dk = c.f32(c.out(1)), *dv = c.f32(c.out(2));
  AttentionDims d{B, S, T, heads, kvHeads, D, causal, scale};
  ThreadPool *pool = &c.pool;
  return [=] { attentionBackward(*pool, d, pq, pk, pv, pdo, dq, dk, dv); };
}

Kernel buildCrossEntropyGrad(const Ctx &c) {
  c.arity(3, 1);
  const Buffer &logits = c.in(0), &targets = c.in(1), &dl = c.in(2), &o = c.out();
  c.needF32(logits), c.needInt(targets), c.needF32(dl), c.needF32(o);
  c.sameShape(logits, o);
  if (logits.shape.empty() || Shape(logits.shape.begin(), logits.shape.end() - 1) != targets.shape ||
      count(dl.shape) != 1)
    c.bad("expects logits [..., V], targets [...] and a scalar loss gradient");
  int64_t V = logits.shape.back(), rows = count(targets.shape);
  IndexReader read{c.arena + targets.offset, targets.dtype == LOOM_I64};
  float *pl = c.f32(logits), *pdl = c.f32(dl), *po = c.f32(o);
  std::string where = c.where, name = targets.name;
  if (auto [start, parts] = vocabSlice(c, V); parts > 1) {
    VocabStats stats(c, V, rows, start, parts);
    return [=]() mutable {
      checkIndices(where, "target class in '" + name + "'", read, rows, V * parts);
      stats.compute(pl, read);
      stats.gradient(pl, po, *pdl / float(std::max<int64_t>(rows, 1)), read);
    };
  }
  ThreadPool *pool = &c.pool;
  return [=] {
    checkIndices(where, "target class in '" + name + "'", read, rows, V);
    float scale = *pdl / float(std::max<int64_t>(rows, 1));
    pool->parallelFor(rows, double(V * 20), [&](int64_t r0, int64_t r1) {
      std::vector<double> e(V);
      for (int64_t r = r0; r < r1; ++r) {
        const float *row = pl + r * V;
        float *out = po + r * V;
        float mx = *std::max_element(row, row + V);
        double sum = 0;
        for (int64_t j = 0; j < V; ++j)
          sum += (e[j] = std::exp(double(row[j]) - mx));
        for (int64_t j = 0; j < V; ++j)
          out[j] = static_cast<float>(e[j] / sum) * scale;
        out[read(r)] -= scale;
      }
    });
  };
}

Kernel buildSliceGrad(const Ctx &c) {
  c.arity(1, 1);
  const Buffer &dy = c.in(0), &dx = c.out();
  c.needF32(dy), c.needF32(dx);
  int64_t axis = c.axis(c.attrInt("axis"), dx.shape.size());
  int64_t start = c.attrInt("start"), size = c.attrInt("size");
  Shape shape = dx.shape;
  if (start < 0 || start + size > shape[axis])
    c.bad("slice is outside the input");
  shape[axis] = size;
  if (shape != dy.shape)
    c.bad(cat("the output gradient must be ", shapeStr(shape)));
  std::vector<int64_t> st = stridesOf(dx.shape), zero(shape.size(), 0);
  float *pdy = c.f32(dy), *pdx = c.f32(dx);
  int64_t n = count(dx.shape), base = start * st[axis];
  return [=] {
    std::fill(pdx, pdx + n, 0.0f);
    forEachBroadcast(shape, st, zero, [&](int64_t i, int64_t o, int64_t) { pdx[base + o] = pdy[i]; });
  };
}

Kernel buildReduceMaxGrad(const Ctx &c) {
  c.arity(3, 1);
  const Buffer &x = c.in(0), &y = c.in(1), &dy = c.in(2), &dx = c.out();
  for (size_t i = 0; i < 3; ++i)
    c.needF32(c.in(i));
  c.sameShape(x, dx), c.sameShape(y, dy);
  std::vector<bool> reduced(x.shape.size(), false);
  for (int64_t a : c.attrInts("axes"))
    reduced[c.axis(a, x.shape.size())] = true;
  Shape kept;
  for (size_t d = 0; d < x.shape.size(); ++d)
    if (!reduced[d])
      kept.push_back(x.shape[d]);
  if (count(kept) != count(y.shape))
    c.bad("the reduced value does not match the input");
  std::vector<int64_t> ks = stridesOf(kept), st(x.shape.size(), 0), unit = stridesOf(x.shape);
  for (size_t d = 0, kd = 0; d < x.shape.size(); ++d)
    if (!reduced[d])
      st[d] = ks[kd++];
  float *px = c.f32(x), *py = c.f32(y), *pdy = c.f32(dy), *pdx = c.f32(dx);
  Shape shape = x.shape;
  return [=] {
    forEachBroadcast(shape, unit, st, [&](int64_t, int64_t ix, int64_t io) {
      pdx[ix] = px[ix] == py[io] ? pdy[io] : 0.0f;
    });
  };
}

template <bool Max> Kernel buildPoolGrad(const Ctx &c) {
  c.arity(Max ? 2 : 1, 1);
  const Buffer &dy = c.in(Max ? 1 : 0), &dx = c.out();
  for (size_t i = 0; i < c.ins.in.size(); ++i)
    c.needF32(c.in(i));
  if (Max)
    c.sameShape(c.in(0), dx);
  int64_t k = c.attrInt("kernel"), stride = c.attrInt("stride", 1), pad = c.attrInt("padding", 0);
  bool nhwc = channelsLast(c);
  if (dx.shape.size() != 4 || dy.shape.size() != 4 || k < 1 || stride < 1)
    c.bad("inconsistent pooling gradient shapes");
  ImageLayout xl = imageLayout(dx.shape, nhwc), yl = imageLayout(dy.shape, nhwc);
  int64_t N = xl.n, C = xl.c, H = xl.h, W = xl.w, Ho = yl.h, Wo = yl.w;
  float *px = Max ? c.f32(c.in(0)) : nullptr, *pdy = c.f32(dy), *pdx = c.f32(dx);
  ThreadPool *pool = &c.pool;
  // One task per run of images: each image's gradient is its own, added in
  // the same order whatever the threads.
  return [=] {
    std::fill(pdx, pdx + N * C * H * W, 0.0f);
    pool->parallelFor(N, double(C * Ho * Wo * k * k), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t ch = 0; ch < C; ++ch)
          for (int64_t oh = 0; oh < Ho; ++oh)
            for (int64_t ow = 0; ow < Wo; ++ow) {
              float g = pdy[yl.at(n, ch, oh, ow)];
              int64_t best = -1;
              float bestV = -INFINITY;
              for (int64_t kh = 0; kh < k; ++kh)
                for (int64_t kw = 0; kw < k; ++kw) {
                  int64_t ih = oh * stride - pad + kh, iw = ow * stride - pad + kw;
                  if (ih < 0 || ih >= H || iw < 0 || iw >= W)
                    continue;
                  int64_t at = xl.at(n, ch, ih, iw);
                  if (Max) {
                    if (px[at] > bestV)
                      bestV = px[at], best = at;
                  } else {
                    pdx[at] += g / float(k * k);
                  }
                }
              if (Max && best >= 0)
                pdx[best] += g;
            }
    });
  };
}

} // namespace

void registerGradientBuilders(BuilderTable &table) {
  table.insert({
      {"fill", buildFill},
      {"unary_grad", buildUnaryGrad},
      {"softmax_grad", buildSoftmaxGrad},
      {"layernorm_grad", buildLayerNormGrad},
      {"rmsnorm_grad", buildRMSNormGrad},
      {"batchnorm_grad", buildBatchNormGrad},
      {"embedding_grad", buildEmbeddingGrad},
      {"attention_grad", buildAttentionGrad},
      {"cross_entropy_grad", buildCrossEntropyGrad},
      {"slice_grad", buildSliceGrad},
      {"reduce_max_grad", buildReduceMaxGrad},
      {"max_pool2d_grad", buildPoolGrad<true>},
      {"avg_pool2d_grad", buildPoolGrad<false>},
  });
}

} // namespace loom::rt::cpu
