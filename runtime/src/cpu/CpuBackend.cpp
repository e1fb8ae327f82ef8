//===- CpuBackend.cpp - Plain C++ execution of instruction streams --------===//
//
// CpuProgram checks every instruction once and turns it into a kernel through
// the one builder table, which the kernel files (CpuElementwise.cpp,
// CpuMatmul.cpp, ...; see CpuKernels.h) fill; bf16 operands are widened into
// f32 copies around each kernel. Also here: the communication stream
// (AsyncComm) and the backend that owns the arena.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cpu/CpuBackend.h"
#include "runtime/src/Backend.h"
#include "runtime/src/Elementwise.h"
#include "runtime/src/Error.h"
#include "runtime/src/cpu/CpuKernels.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>

namespace loom::rt {

namespace cpu {
namespace {

//===--------------------------------------------------------------------===//
// Gradient kernels (training)
//===--------------------------------------------------------------------===//

Kernel buildFill(const Ctx &c) {
  c.arity(0, 1);
  c.needF32(c.out());
  float v = static_cast<float>(c.attrFloat("value"));
  float *y = c.f32(c.out());
  int64_t n = count(c.out().shape);
  return [=] { std::fill(y, y + n, v); };
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
  return [=] {
    for (int64_t i = 0; i < n; ++i)
      dx[i] = dy[i] * ew::derivative(d, x[i], y[i]);
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
  return [=] {
    std::vector<double> accG(h, 0), accB(h, 0);
    for (int64_t r = 0; r < rows; ++r) {
      const float *xr = px + r * h, *dyr = dy + r * h;
      double mean = 0, var = 0;
      if (!rms) {
        for (int64_t j = 0; j < h; ++j)
          mean += xr[j];
        mean /= h;
      }
      for (int64_t j = 0; j < h; ++j)
        var += (xr[j] - mean) * (xr[j] - mean);
      var /= h;
      double rstd = 1.0 / std::sqrt(var + eps), sumD = 0, sumDX = 0;
      for (int64_t j = 0; j < h; ++j) {
        double xh = (xr[j] - mean) * rstd, d = double(dyr[j]) * g[j];
        sumD += d, sumDX += d * xh;
        accG[j] += double(dyr[j]) * xh;
        accB[j] += dyr[j];
      }
      for (int64_t j = 0; j < h; ++j) {
        double xh = (xr[j] - mean) * rstd, d = double(dyr[j]) * g[j];
        double v = rstd * (d - (rms ? 0.0 : sumD / h) - xh * sumDX / h);
        dx[r * h + j] = res ? static_cast<float>(v) + res[r * h + j] : static_cast<float>(v);
      }
    }
    for (int64_t j = 0; j < h; ++j) {
      dg[j] = static_cast<float>(accG[j]);
      if (db)
        db[j] = static_cast<float>(accB[j]);
    }
  };
}
Kernel buildLayerNormGrad(const Ctx &c) { return buildNormGrad(c, false); }
Kernel buildRMSNormGrad(const Ctx &c) { return buildNormGrad(c, true); }

Kernel buildBatchNormGrad(const Ctx &c) {
  c.arity(3, 3);
  const Buffer &x = c.in(0);
  for (size_t i = 0; i < 3; ++i)
    c.needF32(c.in(i)), c.needF32(c.out(i));
  c.sameShape(x, c.in(2)), c.sameShape(x, c.out(0));
  if (x.shape.size() < 2)
    c.bad("input must be [N, C, ...]");
  int64_t n = x.shape[0], ch = x.shape[1], inner = count(x.shape) / std::max<int64_t>(n * ch, 1);
  double eps = c.attrFloat("eps");
  float *px = c.f32(x), *g = c.f32(c.in(1)), *dy = c.f32(c.in(2)), *dx = c.f32(c.out(0));
  float *dg = c.f32(c.out(1)), *db = c.f32(c.out(2));
  ThreadPool *pool = &c.pool;
  return [=] {
    pool->parallelFor(ch, double(n * inner * 3), [&](int64_t c0, int64_t c1) {
      for (int64_t cc = c0; cc < c1; ++cc) {
        double cnt = double(n * inner), mean = 0, var = 0;
        auto at = [&](int64_t i, int64_t j) { return (i * ch + cc) * inner + j; };
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
            double xh = (px[at(i, j)] - mean) * rstd, d = double(dy[at(i, j)]) * g[cc];
            sumD += d, sumDX += d * xh, sumDy += dy[at(i, j)], sumDyX += dy[at(i, j)] * xh;
          }
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < inner; ++j) {
            double xh = (px[at(i, j)] - mean) * rstd, d = double(dy[at(i, j)]) * g[cc];
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
  return [=] {
    checkIndices(where, "token id in '" + name + "'", read, n, vocab * parts);
    std::fill(pdt, pdt + vocab * h, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      int64_t row = read(i) - start;
      if (row >= 0 && row < vocab)
        for (int64_t j = 0; j < h; ++j)
          pdt[row * h + j] += pdy[i * h + j];
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
      float scale = *pdl / float(std::max<int64_t>(rows, 1));
      for (int64_t r = 0; r < rows; ++r) {
        const float *row = pl + r * V;
        float *out = po + r * V;
        for (int64_t j = 0; j < V; ++j)
          out[j] = static_cast<float>(std::exp(double(row[j]) - stats.max[r]) / stats.sum[r]) * scale;
        int64_t t = read(r) - start;
        if (t >= 0 && t < V)
          out[t] -= scale;
      }
    };
  }
  return [=] {
    checkIndices(where, "target class in '" + name + "'", read, rows, V);
    float scale = *pdl / float(std::max<int64_t>(rows, 1));
    for (int64_t r = 0; r < rows; ++r) {
      const float *row = pl + r * V;
      float *out = po + r * V;
      float mx = *std::max_element(row, row + V);
      double sum = 0;
      for (int64_t j = 0; j < V; ++j)
        sum += std::exp(double(row[j]) - mx);
      for (int64_t j = 0; j < V; ++j)
        out[j] = static_cast<float>(std::exp(double(row[j]) - mx) / sum) * scale;
      out[read(r)] -= scale;
    }
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

Kernel buildConv2DGrad(const Ctx &c, bool filter) {
  c.arity(2, 1);
  // grad_input: (dy, w) -> dx; grad_filter: (x, dy) -> dw.
  const Buffer &dy = filter ? c.in(1) : c.in(0), &w = filter ? c.out() : c.in(1);
  const Buffer &x = filter ? c.in(0) : c.out();
  c.needF32(c.in(0)), c.needF32(c.in(1)), c.needF32(c.out());
  int64_t stride = c.attrInt("stride", 1), pad = c.attrInt("padding", 0), groups = c.attrInt("groups", 1);
  if (x.shape.size() != 4 || w.shape.size() != 4 || dy.shape.size() != 4 || groups < 1 ||
      x.shape[1] != w.shape[1] * groups)
    c.bad("inconsistent conv2d gradient shapes");
  int64_t N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3];
  int64_t O = w.shape[0], Cg = w.shape[1], KH = w.shape[2], KW = w.shape[3];
  int64_t Ho = dy.shape[2], Wo = dy.shape[3], Og = O / groups;
  if (dy.shape != Shape{N, O, (H + 2 * pad - KH) / stride + 1, (W + 2 * pad - KW) / stride + 1})
    c.bad("the output gradient does not match the convolution");
  float *px = c.f32(x), *pw = c.f32(w), *pdy = c.f32(dy);
  ThreadPool *pool = &c.pool;
  if (filter)
    return [=] {
      pool->parallelFor(O, double(N * Cg * KH * KW * Ho * Wo), [&](int64_t o0, int64_t o1) {
        for (int64_t oc = o0; oc < o1; ++oc) {
          int64_t g = oc / Og;
          for (int64_t ci = 0; ci < Cg; ++ci)
            for (int64_t kh = 0; kh < KH; ++kh)
              for (int64_t kw = 0; kw < KW; ++kw) {
                double acc = 0;
                for (int64_t n = 0; n < N; ++n)
                  for (int64_t oh = 0; oh < Ho; ++oh) {
                    int64_t ih = oh * stride - pad + kh;
                    if (ih < 0 || ih >= H)
                      continue;
                    for (int64_t ow = 0; ow < Wo; ++ow) {
                      int64_t iw = ow * stride - pad + kw;
                      if (iw >= 0 && iw < W)
                        acc += double(pdy[((n * O + oc) * Ho + oh) * Wo + ow]) *
                               px[((n * C + g * Cg + ci) * H + ih) * W + iw];
                    }
                  }
                pw[((oc * Cg + ci) * KH + kh) * KW + kw] = static_cast<float>(acc);
              }
        }
      });
    };
  return [=] {
    pool->parallelFor(N * C, double(Og * KH * KW * Ho * Wo), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        int64_t n = t / C, cin = t % C, g = cin / Cg, ci = cin % Cg;
        float *dx = px + (n * C + cin) * H * W;
        std::fill(dx, dx + H * W, 0.0f);
        for (int64_t oc = g * Og; oc < (g + 1) * Og; ++oc)
          for (int64_t kh = 0; kh < KH; ++kh)
            for (int64_t kw = 0; kw < KW; ++kw) {
              float wv = pw[((oc * Cg + ci) * KH + kh) * KW + kw];
              for (int64_t oh = 0; oh < Ho; ++oh) {
                int64_t ih = oh * stride - pad + kh;
                if (ih < 0 || ih >= H)
                  continue;
                for (int64_t ow = 0; ow < Wo; ++ow) {
                  int64_t iw = ow * stride - pad + kw;
                  if (iw >= 0 && iw < W)
                    dx[ih * W + iw] += wv * pdy[((n * O + oc) * Ho + oh) * Wo + ow];
                }
              }
            }
      }
    });
  };
}
Kernel buildConv2DGradInput(const Ctx &c) { return buildConv2DGrad(c, false); }
Kernel buildConv2DGradFilter(const Ctx &c) { return buildConv2DGrad(c, true); }

template <bool Max> Kernel buildPoolGrad(const Ctx &c) {
  c.arity(Max ? 2 : 1, 1);
  const Buffer &dy = c.in(Max ? 1 : 0), &dx = c.out();
  for (size_t i = 0; i < c.ins.in.size(); ++i)
    c.needF32(c.in(i));
  if (Max)
    c.sameShape(c.in(0), dx);
  int64_t k = c.attrInt("kernel"), stride = c.attrInt("stride", 1), pad = c.attrInt("padding", 0);
  if (dx.shape.size() != 4 || dy.shape.size() != 4 || k < 1 || stride < 1)
    c.bad("inconsistent pooling gradient shapes");
  int64_t NC = dx.shape[0] * dx.shape[1], H = dx.shape[2], W = dx.shape[3];
  int64_t Ho = dy.shape[2], Wo = dy.shape[3];
  float *px = Max ? c.f32(c.in(0)) : nullptr, *pdy = c.f32(dy), *pdx = c.f32(dx);
  return [=] {
    std::fill(pdx, pdx + NC * H * W, 0.0f);
    for (int64_t nc = 0; nc < NC; ++nc)
      for (int64_t oh = 0; oh < Ho; ++oh)
        for (int64_t ow = 0; ow < Wo; ++ow) {
          float g = pdy[(nc * Ho + oh) * Wo + ow];
          int64_t best = -1;
          float bestV = -INFINITY;
          for (int64_t kh = 0; kh < k; ++kh)
            for (int64_t kw = 0; kw < k; ++kw) {
              int64_t ih = oh * stride - pad + kh, iw = ow * stride - pad + kw;
              if (ih < 0 || ih >= H || iw < 0 || iw >= W)
                continue;
              int64_t at = nc * H * W + ih * W + iw;
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
  };
}

//===--------------------------------------------------------------------===//
// Optimizer
//===--------------------------------------------------------------------===//

//===--------------------------------------------------------------------===//
// Communication
//===--------------------------------------------------------------------===//

/// Reduces a buffer over a group: out = reduction of every member's in. A
/// bucket of several buffers (gradients, reduced in place) travels as one
/// message.
Kernel buildAllReduce(const Ctx &c) {
  if (c.ins.in.empty() || c.ins.in.size() != c.ins.out.size())
    c.bad("expects as many outputs as inputs (at least one)");
  Communicator *comm = needComm(c);
  std::vector<int> group = groupOf(c, attrString(c, "group", "dp"));
  std::string kind = attrString(c, "reduction", "sum");
  if (kind != "sum" && kind != "mean" && kind != "max")
    c.bad("reduction must be sum, mean or max, got '" + kind + "'");
  Reduction op = kind == "sum" ? Reduction::Sum : kind == "mean" ? Reduction::Mean : Reduction::Max;
  int64_t rank = c.rank.rank;
  if (c.ins.in.size() == 1 && !(c.attrFlag("async") && c.ins.in[0] == c.ins.out[0])) {
    c.needF32(c.in(0)), c.needF32(c.out());
    c.sameShape(c.in(0), c.out());
    float *in = c.f32(c.in(0)), *out = c.f32(c.out());
    int64_t n = count(c.in(0).shape);
    return [=] {
      if (in != out)
        std::copy(in, in + n, out);
      comm->allReduce(static_cast<int>(rank), group, out, n, op);
    };
  }
  std::vector<std::pair<float *, int64_t>> parts;
  int64_t total = 0;
  for (size_t i = 0; i < c.ins.in.size(); ++i) {
    if (c.ins.in[i] != c.ins.out[i])
      c.bad("reduces a bucket of buffers in place");
    c.needF32(c.in(i));
    parts.push_back({c.f32(c.in(i)), count(c.in(i).shape)});
    total += parts.back().second;
  }
  auto reduce = [=] {
    std::vector<float> bucket(static_cast<size_t>(total));
    float *p = bucket.data();
    for (auto [data, n] : parts)
      p = std::copy(data, data + n, p);
    comm->allReduce(static_cast<int>(rank), group, bucket.data(), total, op);
    p = bucket.data();
    for (auto [data, n] : parts)
      std::copy(p, p + n, data), p += n;
  };
  // "async": the bucket goes out on the communication thread while the
  // program goes on; a later event_wait joins it. Its buffers are final
  // gradients that nothing writes before then.
  if (c.attrFlag("async") && c.async) {
    AsyncComm *async = c.async;
    int64_t event = c.attrInt("event", -1);
    return [=] { async->submit(reduce, event); };
  }
  return reduce;
}

/// This rank's index in a group and the group's size.
std::pair<int64_t, int64_t> placeIn(const Ctx &c, const std::vector<int> &group) {
  int64_t index = std::find(group.begin(), group.end(), int(c.rank.rank)) - group.begin();
  return {index, int64_t(group.size())};
}

/// A ZeRO-1 slice of a tensor of n elements over `parts` ranks has ceil(n / parts).
void checkSlice(const Ctx &c, int64_t k, int64_t n, int64_t parts) {
  if (k != (n + parts - 1) / parts)
    c.bad(cat("a slice of ", k, " elements does not fit ", n, " over ", parts, " ranks, which needs ",
              (n + parts - 1) / parts));
}

/// ZeRO-1: the mean over the group of each gradient (n elements, padded with
/// zeros to parts x k), of which this rank keeps slice `index` of k =
/// ceil(n / parts) elements. On one process the exchange is an all-reduce.
Kernel buildReduceScatter(const Ctx &c) {
  if (c.ins.in.empty() || c.ins.in.size() != c.ins.out.size())
    c.bad("expects one slice per gradient");
  Communicator *comm = needComm(c);
  std::vector<int> group = groupOf(c, attrString(c, "group", "dp"));
  auto [index, parts] = placeIn(c, group);
  struct Part {
    float *in, *out;
    int64_t n, k;
  };
  std::vector<Part> list;
  for (size_t i = 0; i < c.ins.in.size(); ++i) {
    c.needF32(c.in(i)), c.needF32(c.out(i));
    int64_t n = count(c.in(i).shape), k = count(c.out(i).shape);
    checkSlice(c, k, n, parts);
    list.push_back({c.f32(c.in(i)), c.f32(c.out(i)), n, k});
  }
  int64_t rank = c.rank.rank, at = index;
  Reduction op = attrString(c, "reduction", "mean") == "sum" ? Reduction::Sum : Reduction::Mean;
  auto work = [=] {
    for (const Part &p : list) {
      std::vector<float> padded(static_cast<size_t>(p.k * parts), 0.0f);
      std::copy(p.in, p.in + p.n, padded.begin());
      comm->allReduce(int(rank), group, padded.data(), int64_t(padded.size()), op);
      std::copy(padded.begin() + at * p.k, padded.begin() + (at + 1) * p.k, p.out);
    }
  };
  if (c.attrFlag("async") && c.async) {
    AsyncComm *async = c.async;
    int64_t event = c.attrInt("event", -1);
    return [=] { async->submit(work, event); };
  }
  return work;
}

/// The rank's slice of a parameter (zero-padded), as reduce_scatter cuts it.
Kernel buildShardOf(const Ctx &c) {
  c.arity(1, 1);
  c.needF32(c.in(0)), c.needF32(c.out());
  std::vector<int> group = groupOf(c, attrString(c, "group", "dp"));
  auto [index, parts] = placeIn(c, group);
  int64_t n = count(c.in(0).shape), k = count(c.out().shape);
  checkSlice(c, k, n, parts);
  float *in = c.f32(c.in(0)), *out = c.f32(c.out());
  int64_t begin = index * k;
  return [=] {
    for (int64_t j = 0; j < k; ++j)
      out[j] = begin + j < n ? in[begin + j] : 0.0f;
  };
}

/// Every rank's slices put back into the whole parameters (pairs of
/// slice and whole, one collective for all of them).
Kernel buildAllGather(const Ctx &c) {
  if (c.ins.attrs.contains("axis")) { // parts along an axis, concatenated in group order
    c.arity(1, 1);
    c.needF32(c.in(0)), c.needF32(c.out());
    Communicator *comm = needComm(c);
    std::vector<int> group = groupOf(c, attrString(c, "group", "tp"));
    auto [index, parts] = placeIn(c, group);
    const Shape &in = c.in(0).shape, &out = c.out().shape;
    int64_t axis = c.axis(c.attrInt("axis"), in.size());
    Shape want = in;
    want[axis] *= parts;
    if (out != want)
      c.bad(cat("gathering ", parts, " parts of ", shapeStr(in), " along axis ", axis, " gives ",
                shapeStr(want), ", not ", shapeStr(out)));
    int64_t outer = 1, inner = 1;
    for (int64_t d = 0; d < axis; ++d)
      outer *= in[d];
    for (size_t d = axis; d < in.size(); ++d)
      inner *= in[d]; // the part's contiguous run per outer index
    float *src = c.f32(c.in(0)), *dst = c.f32(c.out());
    int64_t rank = c.rank.rank, total = count(out), at = index;
    return [=] {
      std::vector<float> whole(static_cast<size_t>(total), 0.0f);
      for (int64_t o = 0; o < outer; ++o)
        std::copy(src + o * inner, src + (o + 1) * inner, whole.begin() + (o * parts + at) * inner);
      comm->allReduce(int(rank), group, whole.data(), total, Reduction::Sum);
      std::copy(whole.begin(), whole.end(), dst);
    };
  }
  if (c.ins.in.empty() || c.ins.in.size() != c.ins.out.size())
    c.bad("expects one whole tensor per slice");
  Communicator *comm = needComm(c);
  std::vector<int> group = groupOf(c, attrString(c, "group", "dp"));
  auto [index, parts] = placeIn(c, group);
  struct Part {
    float *in, *out;
    int64_t k, n;
  };
  std::vector<Part> list;
  int64_t total = 0;
  for (size_t i = 0; i < c.ins.in.size(); ++i) {
    c.needF32(c.in(i)), c.needF32(c.out(i));
    int64_t k = count(c.in(i).shape), n = count(c.out(i).shape);
    checkSlice(c, k, n, parts);
    list.push_back({c.f32(c.in(i)), c.f32(c.out(i)), k, n});
    total += k * parts;
  }
  int64_t rank = c.rank.rank, at = index;
  return [=] {
    std::vector<float> whole(static_cast<size_t>(total), 0.0f);
    int64_t offset = 0;
    for (const Part &p : list) {
      std::copy(p.in, p.in + p.k, whole.begin() + offset + at * p.k);
      offset += p.k * parts;
    }
    comm->allReduce(int(rank), group, whole.data(), total, Reduction::Sum);
    offset = 0;
    for (const Part &p : list) {
      std::copy(whole.begin() + offset, whole.begin() + offset + p.n, p.out);
      offset += p.k * parts;
    }
  };
}

/// Waits until event `event` of the communication stream has happened: the
/// async collective that records it, and every one before it, is done.
Kernel buildEventWait(const Ctx &c) {
  c.arity(0, 0);
  AsyncComm *async = c.async;
  int64_t event = c.attrInt("event");
  return [=] {
    if (async)
      async->wait(event);
  };
}

/// Copies the buffer of member `root` (an index into the group) to every member.
Kernel buildBroadcast1(const Ctx &c) {
  c.arity(1, 1);
  if (c.ins.in[0] != c.ins.out[0])
    c.bad("broadcasts into its buffer in place");
  c.needF32(c.in(0));
  Communicator *comm = needComm(c);
  std::vector<int> group = groupOf(c, attrString(c, "group", "dp"));
  int64_t root = c.attrInt("root");
  if (root < 0 || root >= int64_t(group.size()))
    c.bad(cat("root ", root, " is not a member of the group of ", group.size()));
  int rootRank = group[root];
  float *data = c.f32(c.in(0));
  int64_t n = count(c.in(0).shape), rank = c.rank.rank;
  return [=] { comm->broadcast(static_cast<int>(rank), group, rootRank, data, n); };
}

int64_t peerOf(const Ctx &c) {
  int64_t peer = c.attrInt("peer");
  if (peer < 0 || peer == c.rank.rank)
    c.bad(cat("peer ", peer, " is not another rank"));
  return peer;
}

/// Sends a buffer to rank `peer` (pipeline activations and their gradients).
Kernel buildSend(const Ctx &c) {
  c.arity(1, 0);
  Communicator *comm = needComm(c);
  int64_t peer = peerOf(c), rank = c.rank.rank, bytes = c.in(0).bytes, tag = c.attrInt("tag", 0);
  const char *data = c.ptr<char>(c.in(0));
  return [=] { comm->send(int(rank), int(peer), tag, data, bytes); };
}

Kernel buildRecv(const Ctx &c) {
  c.arity(0, 1);
  Communicator *comm = needComm(c);
  int64_t peer = peerOf(c), rank = c.rank.rank, bytes = c.out().bytes, tag = c.attrInt("tag", 0);
  char *data = c.ptr<char>(c.out());
  return [=] { comm->recv(int(rank), int(peer), tag, data, bytes); };
}

Kernel buildStepIncrement(const Ctx &c) {
  c.arity(1, 1);
  if (c.ins.in[0] != c.ins.out[0] || count(c.in(0).shape) != 1)
    c.bad("updates the scalar step counter in place");
  c.needF32(c.in(0));
  float *step = c.f32(c.in(0));
  return [=] { *step += 1; };
}

Kernel buildGlobalNorm(const Ctx &c) {
  if (c.ins.out.size() != 1 || count(c.out().shape) != 1)
    c.bad("writes one scalar");
  c.needF32(c.out());
  std::vector<std::pair<float *, int64_t>> grads;
  for (size_t i = 0; i < c.ins.in.size(); ++i) {
    c.needF32(c.in(i));
    grads.push_back({c.f32(c.in(i)), count(c.in(i).shape)});
  }
  // A model split over ranks: each rank sums the squares of the gradients it
  // counts ("skip" lists inputs another rank counts, such as replicas), and
  // the sums are added over "group".
  std::vector<bool> counted(grads.size(), true);
  if (c.ins.attrs.contains("skip"))
    for (int64_t i : c.attrInts("skip")) {
      if (i < 0 || i >= int64_t(grads.size()))
        c.bad(cat("skip names input ", i, " of ", grads.size()));
      counted[i] = false;
    }
  std::string groupName = attrString(c, "group", "");
  Communicator *comm = groupName.empty() ? nullptr : needComm(c);
  std::vector<int> group = groupName.empty() ? std::vector<int>() : groupOf(c, groupName);
  int rank = int(c.rank.rank);
  float *out = c.f32(c.out());
  return [=] {
    double sum = 0;
    for (size_t k = 0; k < grads.size(); ++k)
      if (counted[k])
        for (int64_t i = 0; i < grads[k].second; ++i)
          sum += double(grads[k].first[i]) * grads[k].first[i];
    if (comm) {
      float total = static_cast<float>(sum);
      comm->allReduce(rank, group, &total, 1, Reduction::Sum);
      sum = total;
    }
    *out = static_cast<float>(std::sqrt(sum));
  };
}

/// Learning rate at 0-based step t: linear warm-up, then cosine decay to
/// min_lr over total_steps (constant when total_steps is 0).
double scheduledRate(double lr, double minLr, double warmup, double total, double t) {
  if (warmup > 0 && t < warmup)
    return lr * (t + 1) / warmup;
  if (total <= 0)
    return lr;
  double progress = std::min(1.0, (t - warmup) / std::max(1.0, total - warmup));
  return minLr + 0.5 * (lr - minLr) * (1 + std::cos(M_PI * progress));
}

Kernel buildOptimizer(const Ctx &c, bool adam) {
  // adamw: (param, grad, m, v, step, norm) -> (param, m, v), in place.
  // sgd:   (param, grad, momentum, step, norm) -> (param, momentum), in place.
  c.arity(adam ? 6 : 5, adam ? 3 : 2);
  for (size_t i = 0; i < c.ins.in.size(); ++i)
    c.needF32(c.in(i));
  if (c.ins.out[0] != c.ins.in[0] || c.ins.out[1] != c.ins.in[2] || (adam && c.ins.out[2] != c.ins.in[3]))
    c.bad("updates the parameter and its state in place");
  for (size_t i = 1; i < (adam ? 4u : 3u); ++i)
    c.sameShape(c.in(0), c.in(i));
  double lr = c.attrFloat("lr"), minLr = c.attrFloat("min_lr", 0), wd = c.attrFloat("weight_decay", 0);
  double clip = c.attrFloat("clip", 0), warmup = c.attrFloat("warmup", 0), total = c.attrFloat("total_steps", 0);
  double b1 = adam ? c.attrFloat("beta1") : 0, b2 = adam ? c.attrFloat("beta2") : 0;
  double eps = adam ? c.attrFloat("eps") : 0, momentum = adam ? 0 : c.attrFloat("momentum", 0);
  int64_t n = count(c.in(0).shape);
  float *p = c.f32(c.in(0)), *g = c.f32(c.in(1)), *m = c.f32(c.in(2));
  float *v = adam ? c.f32(c.in(3)) : nullptr, *step = c.f32(c.in(adam ? 4 : 3));
  float *norm = c.f32(c.in(adam ? 5 : 4));
  return [=] {
    double t = *step; // already counts this step (1-based)
    double rate = scheduledRate(lr, minLr, warmup, total, t - 1);
    double scale = clip > 0 && *norm > clip ? clip / *norm : 1.0;
    if (adam) {
      double c1 = 1 - std::pow(b1, t), c2 = 1 - std::pow(b2, t);
      for (int64_t i = 0; i < n; ++i) {
        double gi = g[i] * scale;
        m[i] = static_cast<float>(b1 * m[i] + (1 - b1) * gi);
        v[i] = static_cast<float>(b2 * v[i] + (1 - b2) * gi * gi);
        double update = (m[i] / c1) / (std::sqrt(v[i] / c2) + eps) + wd * p[i];
        p[i] = static_cast<float>(p[i] - rate * update);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        double gi = g[i] * scale + wd * p[i];
        m[i] = static_cast<float>(momentum * m[i] + gi);
        p[i] = static_cast<float>(p[i] - rate * m[i]);
      }
    }
  };
}
Kernel buildAdamW(const Ctx &c) { return buildOptimizer(c, true); }
Kernel buildSGD(const Ctx &c) { return buildOptimizer(c, false); }

} // namespace
} // namespace cpu

namespace {

const cpu::BuilderTable &builders() {
  static const cpu::BuilderTable table = [] {
    cpu::BuilderTable t = {
        {"fill", cpu::buildFill},
        {"unary_grad", cpu::buildUnaryGrad},
        {"softmax_grad", cpu::buildSoftmaxGrad},
        {"layernorm_grad", cpu::buildLayerNormGrad},
        {"rmsnorm_grad", cpu::buildRMSNormGrad},
        {"batchnorm_grad", cpu::buildBatchNormGrad},
        {"embedding_grad", cpu::buildEmbeddingGrad},
        {"attention_grad", cpu::buildAttentionGrad},
        {"cross_entropy_grad", cpu::buildCrossEntropyGrad},
        {"slice_grad", cpu::buildSliceGrad},
        {"reduce_max_grad", cpu::buildReduceMaxGrad},
        {"conv2d_grad_input", cpu::buildConv2DGradInput},
        {"conv2d_grad_filter", cpu::buildConv2DGradFilter},
        {"max_pool2d_grad", cpu::buildPoolGrad<true>},
        {"avg_pool2d_grad", cpu::buildPoolGrad<false>},
        {"step_increment", cpu::buildStepIncrement},
        {"all_reduce", cpu::buildAllReduce},
        {"broadcast_from", cpu::buildBroadcast1},
        {"send", cpu::buildSend},
        {"event_wait", cpu::buildEventWait},
        {"reduce_scatter", cpu::buildReduceScatter},
        {"all_gather", cpu::buildAllGather},
        {"shard_of", cpu::buildShardOf},
        {"recv", cpu::buildRecv},
        {"global_norm", cpu::buildGlobalNorm},
        {"adamw", cpu::buildAdamW},
        {"sgd", cpu::buildSGD},
    };
    cpu::registerElementwiseBuilders(t);
    cpu::registerMatmulBuilders(t);
    cpu::registerNormBuilders(t);
    cpu::registerTransformerBuilders(t);
    cpu::registerShapeBuilders(t);
    cpu::registerConvBuilders(t);
    cpu::registerFusedBuilders(t);
    return t;
  }();
  return table;
}

} // namespace

AsyncComm::AsyncComm() : worker([this] { loop(); }) {}

AsyncComm::~AsyncComm() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    stopping = true;
  }
  cv.notify_all();
  worker.join();
}

void AsyncComm::submit(std::function<void()> task, int64_t event) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    tasks.push_back({std::move(task), event});
    ++submitted;
    if (event >= 0)
      eventAt[event] = submitted;
  }
  cv.notify_all();
}

void AsyncComm::wait(int64_t event) {
  std::unique_lock<std::mutex> lock(mutex);
  int64_t until = submitted;
  if (event >= 0) {
    auto it = eventAt.find(event);
    until = it == eventAt.end() ? 0 : it->second; // never recorded: nothing to wait for
  }
  cv.wait(lock, [&] { return completed >= until; });
  if (error) {
    std::exception_ptr e = error;
    error = nullptr;
    std::rethrow_exception(e);
  }
}

void AsyncComm::loop() {
  std::unique_lock<std::mutex> lock(mutex);
  for (;;) {
    cv.wait(lock, [&] { return stopping || !tasks.empty(); });
    if (tasks.empty())
      return; // stopping
    std::function<void()> task = std::move(tasks.front().first);
    tasks.pop_front();
    ++running;
    bool failed = error != nullptr;
    lock.unlock();
    try {
      if (!failed)
        task();
    } catch (...) {
      std::lock_guard<std::mutex> relock(mutex);
      if (!error)
        error = std::current_exception();
    }
    lock.lock();
    --running;
    ++completed;
    cv.notify_all();
  }
}

std::vector<std::string> cpuSupportedOps() {
  std::vector<std::string> ops;
  for (auto &[name, _] : builders())
    ops.push_back(name);
  return ops;
}

CpuProgram::CpuProgram(const RankProgram &rank, const std::vector<Instruction> &instrs,
                       char *arena, ThreadPool &pool, const std::string &programName,
                       bool allocate, Communicator *comm, AsyncComm *async) {
  static const std::set<std::string> bytewise = {"cast", "slice", "transpose", "concat",
                                                 "broadcast", "send", "recv"};
  // Collectives may still read their operands after the next instructions
  // start (asynchronous ones): their f32 copies are their own. Every other
  // instruction's copies live only while it runs, so they share one buffer
  // sized for the largest (instructions run one after another).
  static const std::set<std::string> collectives = {"all_reduce", "reduce_scatter", "all_gather",
                                                    "broadcast_from", "shard_of"};
  auto widenedCount = [&](const Instruction &ins) {
    std::set<int64_t> ids(ins.in.begin(), ins.in.end());
    ids.insert(ins.out.begin(), ins.out.end());
    int64_t n = 0;
    for (int64_t id : ids)
      if (rank.buffers[id].dtype == LOOM_BF16)
        n += std::max<int64_t>(numElements(rank.buffers[id].shape).value_or(0), 1);
    return n;
  };
  int64_t sharedCount = 0;
  if (allocate)
    for (const Instruction &ins : instrs)
      if (!bytewise.count(ins.op) && !collectives.count(ins.op))
        sharedCount = std::max(sharedCount, widenedCount(ins));
  if (sharedCount > 0)
    scratch.emplace_back(static_cast<size_t>(sharedCount));
  float *shared = sharedCount > 0 ? scratch.back().data() : nullptr;
  for (size_t i = 0; i < instrs.size(); ++i) {
    const Instruction &ins = instrs[i];
    std::string where = cat("instruction ", programName, "[", i, "] '", ins.op, "'");
    auto it = builders().find(ins.op);
    if (it == builders().end())
      fail(LOOM_UNSUPPORTED, where, ": the CPU backend has no kernel for this op");
    // bf16 storage, f32 compute: each bf16 operand is widened into an f32
    // copy before the kernel and each bf16 result narrowed after it. Casts
    // convert themselves and data movement (slice, transpose, concat,
    // broadcast) copies bytes of any dtype, so those run on bf16 directly.
    std::map<int64_t, float *> widened;
    struct Copy {
      char *bf16;
      float *f32;
      int64_t count;
    };
    std::vector<Copy> widen, narrow; // operands in, results out
    if (!bytewise.count(ins.op)) {
      bool own = collectives.count(ins.op) > 0;
      int64_t next = 0; // in the shared buffer
      auto add = [&](int64_t id, std::vector<Copy> &list) {
        const Buffer &b = rank.buffers[id];
        if (b.dtype != LOOM_BF16 || widened.count(id))
          return;
        int64_t n = numElements(b.shape).value_or(0);
        float *copy = reinterpret_cast<float *>(arena); // validation only: never run
        if (allocate && own) {
          scratch.emplace_back(static_cast<size_t>(std::max<int64_t>(n, 1)));
          copy = scratch.back().data();
        } else if (allocate) {
          copy = shared + next;
          next += std::max<int64_t>(n, 1);
        }
        widened[id] = copy;
        list.push_back({arena + b.offset, copy, n});
      };
      for (int64_t id : ins.in)
        add(id, widen);
      for (int64_t id : ins.out)
        add(id, narrow);
    }
    cpu::Ctx ctx{ins, rank, arena, pool, where, widened, comm, async};
    std::function<void()> kernel = it->second(ctx);
    if (!widened.empty())
      kernel = [kernel, widen, narrow] {
        for (const Copy &c : widen)
          for (int64_t e = 0; e < c.count; ++e)
            c.f32[e] = bf16ToFloat(reinterpret_cast<const uint16_t *>(c.bf16)[e]);
        kernel();
        for (const Copy &c : narrow)
          for (int64_t e = 0; e < c.count; ++e)
            reinterpret_cast<uint16_t *>(c.bf16)[e] = floatToBf16(c.f32[e]);
      };
    steps.push_back(Step{where, ins.op, std::move(kernel)});
  }
}

/// Runs one step; an error that does not yet say where it happened (a
/// collective that timed out, a peer that failed) gets the instruction.
static void runStep(CpuProgram::Step &step) {
  try {
    step.kernel();
  } catch (const Error &e) {
    if (std::string(e.what()).find(step.what) != std::string::npos)
      throw;
    throw Error(e.code, cat(step.what, ": ", e.what()));
  }
}

void CpuProgram::run() {
  for (Step &step : steps)
    runStep(step);
}

void CpuProgram::runProfiled(std::map<std::string, std::pair<double, int64_t>> &times) {
  for (Step &step : steps) {
    auto t0 = std::chrono::steady_clock::now();
    runStep(step);
    auto &slot = times[step.op];
    slot.first += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    slot.second += 1;
  }
}

} // namespace loom::rt

namespace loom::rt {

double denseInstructionFlops(const RankProgram &rank, const Instruction &ins) {
  auto count = [](const Shape &s) { return double(numElements(s).value_or(0)); };
  if (ins.op == "matmul" && ins.in.size() >= 2 && ins.in.size() <= 4 && !ins.out.empty()) { // 3, 4: epilogue inputs
    const Buffer &a = rank.buffers[ins.in[0]], &o = rank.buffers[ins.out[0]];
    if (a.shape.size() < 2)
      return 0;
    auto it = ins.attrs.find("transpose_a");
    bool ta = it != ins.attrs.end() && it->is_boolean() && it->get<bool>();
    return 2.0 * count(o.shape) * double(ta ? a.shape[a.shape.size() - 2] : a.shape.back());
  }
  if ((ins.op == "attention" || ins.op == "attention_grad") && ins.attrs.contains("packed") && !ins.out.empty()) {
    // Self-attention over q|k|v columns: q's shape is O's (dO's for the gradient).
    const Buffer &q = rank.buffers[ins.op == "attention" ? ins.out[0] : ins.in.back()];
    if (q.shape.size() != 3)
      return 0;
    double fwd = 4.0 * count(q.shape) * double(q.shape[1]);
    return ins.op == "attention" ? fwd : 3 * fwd;
  }
  if ((ins.op == "attention" || ins.op == "attention_grad") && ins.in.size() >= 2) {
    const Buffer &q = rank.buffers[ins.in[0]], &k = rank.buffers[ins.in[1]];
    if (k.shape.size() != 3)
      return 0;
    double fwd = 4.0 * count(q.shape) * double(k.shape[1]);
    return ins.op == "attention" ? fwd : 3 * fwd; // recompute + three products
  }
  return 0;
}

namespace {
class CpuBackendImpl : public Backend {
public:
  CpuBackendImpl(const RankProgram &rank, int threads, Communicator *comm)
      : rank(rank), pool(threads), comm(comm) {
    size_t bytes = (static_cast<size_t>(rank.arenaBytes) + 63) / 64 * 64;
    arena.reset(static_cast<char *>(std::aligned_alloc(64, std::max<size_t>(bytes, 64))));
    if (!arena)
      fail(LOOM_INVALID_ARGUMENT, "cannot allocate the arena of ", rank.arenaBytes,
           " bytes that the bundle asks for");
    std::memset(arena.get(), 0, bytes);
  }
  std::string name() const override { return "cpu"; }
  void upload(const Buffer &b, const void *src) override {
    std::memcpy(arena.get() + b.offset, src, b.bytes);
  }
  void download(const Buffer &b, void *dst) const override {
    std::memcpy(dst, arena.get() + b.offset, b.bytes);
  }
  void prepare(const std::string &program, const std::vector<Instruction> &instrs) override {
    programs[program] =
        std::make_unique<CpuProgram>(rank, instrs, arena.get(), pool, program, true, comm, &async);
    programFlops[program].clear();
    for (const Instruction &ins : instrs)
      programFlops[program][ins.op] += denseInstructionFlops(rank, ins);
  }
  bool has(const std::string &program) const override { return programs.count(program) > 0; }
  void run(const std::string &program) override {
    if (!profiling)
      return programs.at(program)->run();
    std::map<std::string, std::pair<double, int64_t>> local;
    programs.at(program)->runProfiled(local);
    for (auto &[op, t] : local) {
      times[op].seconds += t.first;
      times[op].count += t.second;
      times[op].flops += programFlops[program][op];
    }
  }
  char *hostData(const Buffer &b) override { return arena.get() + b.offset; }

private:
  const RankProgram &rank;
  ThreadPool pool;
  Communicator *comm;
  AsyncComm async;
  std::unique_ptr<char, decltype(&std::free)> arena{nullptr, &std::free};
  std::map<std::string, std::unique_ptr<CpuProgram>> programs;
  std::map<std::string, std::map<std::string, double>> programFlops; // program -> op -> FLOPs
};
} // namespace

std::unique_ptr<Backend> makeCpuBackend(const RankProgram &rank, int threads,
                                        Communicator *comm) {
  return std::make_unique<CpuBackendImpl>(rank, threads, comm);
}

} // namespace loom::rt
