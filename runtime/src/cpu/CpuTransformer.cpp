//===- CpuTransformer.cpp - Embedding, rotary, attention, cross-entropy ---===//
//
// The transformer's own kernels. A vocabulary may be split over ranks
// (attribute vocab_group): the embedding reads the rows it holds and the loss
// all-reduces softmax statistics instead of gathering logits. The attention
// backward and the packed (q|k|v columns) attention are declared in
// CpuKernels.h, for attention_grad in CpuGradients.cpp.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cpu/CpuKernels.h"

#include <algorithm>
#include <array>
#include <cmath>

#ifdef LOOM_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace loom::rt::cpu {

namespace {

Kernel buildEmbedding(const Ctx &c) {
  c.arity(2, 1);
  const Buffer &table = c.in(0), &ids = c.in(1), &o = c.out();
  c.needF32(table), c.needInt(ids), c.needF32(o);
  if (table.shape.size() != 2)
    c.bad("table must be [vocab, hidden]");
  Shape want = ids.shape;
  want.push_back(table.shape[1]);
  if (o.shape != want)
    c.bad(cat("result must be ", shapeStr(want)));
  int64_t vocab = table.shape[0], h = table.shape[1], n = count(ids.shape);
  auto [start, parts] = vocabSlice(c, vocab);
  IndexReader read{c.arena + ids.offset, ids.dtype == LOOM_I64};
  float *pt = c.f32(table), *po = c.f32(o);
  std::string where = c.where, name = ids.name;
  return [=] {
    checkIndices(where, "token id in '" + name + "'", read, n, vocab * parts);
    // A vocabulary split over ranks: rows held elsewhere contribute zeros,
    // and the all-reduce that follows sums the parts.
    for (int64_t i = 0; i < n; ++i) {
      int64_t row = read(i) - start;
      if (row >= 0 && row < vocab)
        std::copy(pt + row * h, pt + (row + 1) * h, po + i * h);
      else
        std::fill(po + i * h, po + (i + 1) * h, 0.0f);
    }
  };
}

Kernel buildRotary(const Ctx &c) {
  if (c.ins.in.size() != 1 && c.ins.in.size() != 2)
    c.arity(1, 1);
  const Buffer &x = c.in(0);
  c.needF32(x), c.needF32(c.out());
  c.sameShape(x, c.out());
  int64_t heads = c.attrInt("num_heads");
  if (x.shape.size() != 3 || heads < 1 || x.shape[2] % heads != 0 || (x.shape[2] / heads) % 2)
    c.bad("input must be [B, S, heads * even head_dim]");
  int64_t b = x.shape[0], s = x.shape[1], w = x.shape[2], d = w / heads;
  // Each row's position: given (serving: tokens of several sequences at
  // their own positions), or its index along the sequence.
  std::optional<IndexReader> given;
  if (c.ins.in.size() == 2) {
    c.needInt(c.in(1));
    if (count(c.in(1).shape) != b * s)
      c.bad(cat("positions ", shapeStr(c.in(1).shape), " must hold one per row of ", shapeStr(x.shape)));
    given = IndexReader{c.arena + c.in(1).offset, c.in(1).dtype == LOOM_I64};
  }
  double theta = c.attrFloat("theta", 10000.0);
  double sign = c.attrFlag("inverse") ? -1.0 : 1.0; // the gradient rotates back
  float *px = c.f32(x), *py = c.f32(c.out());
  return [=] {
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t si = 0; si < s; ++si)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < d / 2; ++i) {
            double position = given ? double((*given)(bi * s + si)) : double(si);
            double angle = sign * position * std::pow(theta, -2.0 * i / d);
            float cs = static_cast<float>(std::cos(angle)), sn = static_cast<float>(std::sin(angle));
            int64_t at = (bi * s + si) * w + h * d + 2 * i;
            float x0 = px[at], x1 = px[at + 1];
            py[at] = x0 * cs - x1 * sn;
            py[at + 1] = x0 * sn + x1 * cs;
          }
  };
}

/// Query row si's keys: all T, or with a causal mask those up to its position
/// (queries are the last S of T positions); none where that is before 0.
int64_t visibleKeys(const AttentionDims &d, int64_t si) {
  return d.causal ? std::max<int64_t>(0, std::min(d.T, si + 1 + (d.T - d.S))) : d.T;
}

/// exp(q . k_t * scale - max) for keys t < last of one query row (`keys`:
/// the row's batch and key/value head; rows KV*D apart), into p; their sum.
double expScores(const AttentionDims &d, const float *qrow, const float *keys, int64_t last, float *p) {
  float mx = -INFINITY;
  for (int64_t ti = 0; ti < last; ++ti) {
    const float *krow = keys + ti * d.kvHeads * d.D;
    float acc = 0;
    for (int64_t dd = 0; dd < d.D; ++dd)
      acc += qrow[dd] * krow[dd];
    p[ti] = acc * d.scale;
    mx = std::max(mx, p[ti]);
  }
  double sum = 0;
  for (int64_t ti = 0; ti < last; ++ti)
    sum += (p[ti] = std::exp(p[ti] - mx));
  return sum;
}

/// O from dense q [B,S,H*D], k, v [B,T,KV*D], row by row.
[[maybe_unused]] void attentionForwardRows(ThreadPool &threads, const AttentionDims &d, const float *pq, const float *pk,
                      const float *pv, float *po) {
  ThreadPool *pool = &threads;
  auto [B, S, T, heads, kvHeads, D, causal, scale] = d;
  int64_t group = heads / kvHeads;
  pool->parallelFor(B * heads * S, double(2 * T * D), [&](int64_t begin, int64_t end) {
    std::vector<float> p(T);
    for (int64_t t = begin; t < end; ++t) {
      int64_t bi = t / (heads * S), h = (t / S) % heads, si = t % S, kh = h / group;
      const float *qrow = pq + (bi * S + si) * heads * D + h * D;
      int64_t last = visibleKeys(d, si);
      double sum = expScores(d, qrow, pk + bi * T * kvHeads * D + kh * D, last, p.data());
      float *orow = po + (bi * S + si) * heads * D + h * D;
      std::fill(orow, orow + D, 0.0f);
      for (int64_t ti = 0; ti < last; ++ti) {
        float w = static_cast<float>(p[ti] / sum);
        const float *vrow = pv + (bi * T + ti) * kvHeads * D + kh * D;
        for (int64_t dd = 0; dd < D; ++dd)
          orow[dd] += w * vrow[dd];
      }
    }
  });
}

#ifdef LOOM_HAVE_OPENBLAS
/// Queries per block of a causal attention's products: a block's rows see
/// only the keys up to its last row's, so the products skip the masked
/// corner (a quarter of them at two blocks). Products only drop terms that
/// are exact zeros.
constexpr int64_t kCausalBlock = 64;

/// Query blocks [s0, s1) of `d` and the keys [0, keys) that block sees.
template <typename F> void forEachQueryBlock(const AttentionDims &d, F f) {
  int64_t block = d.causal ? kCausalBlock : std::max<int64_t>(d.S, 1);
  for (int64_t s0 = 0; s0 < d.S; s0 += block) {
    int64_t s1 = std::min(d.S, s0 + block);
    f(s0, s1, visibleKeys(d, s1 - 1));
  }
}

/// Key blocks [t0, t1) of `d` and the first query that sees any of them.
template <typename F> void forEachKeyBlock(const AttentionDims &d, F f) {
  int64_t block = d.causal ? kCausalBlock : std::max<int64_t>(d.T, 1);
  for (int64_t t0 = 0; t0 < d.T; t0 += block)
    f(t0, std::min(d.T, t0 + block), d.causal ? std::max<int64_t>(0, t0 - (d.T - d.S)) : 0);
}

/// One (batch, head)'s probabilities P [S, T] = softmax(q k^T * scale) with
/// the mask's entries 0, the scores through sgemm.
void probabilities(const AttentionDims &d, const float *q, const float *k, float *P) {
  forEachQueryBlock(d, [&](int64_t s0, int64_t s1, int64_t keys) {
    if (keys > 0)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blasint(s1 - s0), blasint(keys), blasint(d.D), d.scale,
                  q + s0 * d.heads * d.D, blasint(d.heads * d.D), k, blasint(d.kvHeads * d.D), 0.0f,
                  P + s0 * d.T, blasint(d.T));
  });
  for (int64_t si = 0; si < d.S; ++si) {
    float *row = P + si * d.T;
    int64_t last = visibleKeys(d, si);
    float mx = -INFINITY;
    for (int64_t ti = 0; ti < last; ++ti)
      mx = std::max(mx, row[ti]);
    double sum = 0;
    for (int64_t ti = 0; ti < last; ++ti)
      sum += (row[ti] = std::exp(row[ti] - mx));
    for (int64_t ti = 0; ti < last; ++ti)
      row[ti] = static_cast<float>(row[ti] / sum);
    std::fill(row + last, row + d.T, 0.0f);
  }
}

/// C [S, D] (rows ldc apart) = P X for P [S, T] of `d`'s mask and X [T, D]
/// (rows ldx apart), skipping each query block's masked keys.
void maskedTimes(const AttentionDims &d, const float *P, const float *X, blasint ldx, float *C, blasint ldc) {
  forEachQueryBlock(d, [&](int64_t s0, int64_t s1, int64_t keys) {
    float *c = C + s0 * ldc;
    if (keys == 0) {
      for (int64_t si = s0; si < s1; ++si)
        std::fill(C + si * ldc, C + si * ldc + d.D, 0.0f);
      return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, blasint(s1 - s0), blasint(d.D), blasint(keys), 1.0f,
                P + s0 * d.T, blasint(d.T), X, ldx, 0.0f, c, ldc);
  });
}

/// C [T, D] (rows ldc apart) += P^T Y for P [S, T] of `d`'s mask and Y [S, D]
/// (rows ldy apart), skipping each key block's queries that do not see it.
void maskedTransposeTimesAdd(const AttentionDims &d, const float *P, const float *Y, blasint ldy, float *C,
                             blasint ldc) {
  forEachKeyBlock(d, [&](int64_t t0, int64_t t1, int64_t first) {
    if (first < d.S)
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, blasint(t1 - t0), blasint(d.D), blasint(d.S - first),
                  1.0f, P + first * d.T + t0, blasint(d.T), Y + first * ldy, ldy, 1.0f, C + t0 * ldc, ldc);
  });
}

/// O = P v per (batch, head), through sgemm.
void attentionForwardBlas(ThreadPool &threads, const AttentionDims &d, const float *pq, const float *pk,
                          const float *pv, float *po) {
  int64_t group = d.heads / d.kvHeads;
  threads.parallelFor(d.B * d.heads, double(4 * d.S * d.T * d.D), [&](int64_t begin, int64_t end) {
    std::vector<float> P(size_t(d.S * d.T));
    for (int64_t task = begin; task < end; ++task) {
      int64_t bi = task / d.heads, h = task % d.heads, kh = h / group;
      const float *q = pq + bi * d.S * d.heads * d.D + h * d.D;
      const float *k = pk + bi * d.T * d.kvHeads * d.D + kh * d.D;
      const float *v = pv + bi * d.T * d.kvHeads * d.D + kh * d.D;
      probabilities(d, q, k, P.data());
      maskedTimes(d, P.data(), v, blasint(d.kvHeads * d.D), po + bi * d.S * d.heads * d.D + h * d.D,
                  blasint(d.heads * d.D));
    }
  });
}

/// The backward per (batch, key/value head), its query heads in turn:
/// dP = dO v^T, dS = P (dP - rowsum(P dP)) scale, dq = dS k, dk += dS^T q,
/// dv += P^T dO, each product through sgemm.
void attentionBackwardBlas(ThreadPool &threads, const AttentionDims &d, const float *pq, const float *pk,
                           const float *pv, const float *pdo, float *dq, float *dk, float *dv) {
  int64_t group = d.heads / d.kvHeads;
  blasint ldq = blasint(d.heads * d.D), ldk = blasint(d.kvHeads * d.D), T = blasint(d.T), D = blasint(d.D);
  threads.parallelFor(d.B * d.kvHeads, double(group * d.S * d.T * d.D * 10), [&](int64_t begin, int64_t end) {
    std::vector<float> P(size_t(d.S * d.T)), dS(size_t(d.S * d.T));
    for (int64_t task = begin; task < end; ++task) {
      int64_t bi = task / d.kvHeads, kh = task % d.kvHeads;
      const float *k = pk + bi * d.T * d.kvHeads * d.D + kh * d.D;
      const float *v = pv + bi * d.T * d.kvHeads * d.D + kh * d.D;
      float *dkb = dk + bi * d.T * d.kvHeads * d.D + kh * d.D;
      float *dvb = dv + bi * d.T * d.kvHeads * d.D + kh * d.D;
      for (int64_t ti = 0; ti < d.T; ++ti) {
        std::fill(dkb + ti * ldk, dkb + ti * ldk + d.D, 0.0f);
        std::fill(dvb + ti * ldk, dvb + ti * ldk + d.D, 0.0f);
      }
      for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
        const float *q = pq + bi * d.S * d.heads * d.D + h * d.D;
        const float *dout = pdo + bi * d.S * d.heads * d.D + h * d.D;
        float *dqb = dq + bi * d.S * d.heads * d.D + h * d.D;
        probabilities(d, q, k, P.data());
        forEachQueryBlock(d, [&](int64_t s0, int64_t s1, int64_t keys) {
          if (keys > 0)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blasint(s1 - s0), blasint(keys), D, 1.0f,
                        dout + s0 * ldq, ldq, v, ldk, 0.0f, dS.data() + s0 * d.T, T);
        });
        for (int64_t si = 0; si < d.S; ++si) {
          const float *p = P.data() + si * d.T;
          float *ds = dS.data() + si * d.T;
          int64_t last = visibleKeys(d, si);
          double dot = 0;
          for (int64_t ti = 0; ti < last; ++ti)
            dot += double(p[ti]) * ds[ti];
          for (int64_t ti = 0; ti < last; ++ti)
            ds[ti] = static_cast<float>(p[ti] * (ds[ti] - dot)) * d.scale;
          std::fill(ds + last, ds + d.T, 0.0f);
        }
        maskedTimes(d, dS.data(), k, ldk, dqb, ldq);
        maskedTransposeTimesAdd(d, dS.data(), q, ldq, dkb, ldk);
        maskedTransposeTimesAdd(d, P.data(), dout, ldq, dvb, ldk);
      }
    }
  });
}
#endif

/// O from dense q [B,S,H*D], k, v [B,T,KV*D].
void attentionForward(ThreadPool &threads, const AttentionDims &d, const float *pq, const float *pk,
                      const float *pv, float *po) {
#ifdef LOOM_HAVE_OPENBLAS
  if (d.S > 0 && d.T > 0 && d.D > 0)
    return attentionForwardBlas(threads, d, pq, pk, pv, po);
#endif
  attentionForwardRows(threads, d, pq, pk, pv, po);
}

} // namespace

void attentionBackward(ThreadPool &threads, const AttentionDims &d, const float *pq, const float *pk,
                       const float *pv, const float *pdo, float *dq, float *dk, float *dv) {
#ifdef LOOM_HAVE_OPENBLAS
  if (d.S > 0 && d.T > 0 && d.D > 0)
    return attentionBackwardBlas(threads, d, pq, pk, pv, pdo, dq, dk, dv);
#endif
  ThreadPool *pool = &threads;
  auto [B, S, T, heads, kvHeads, D, causal, scale] = d;
  int64_t group = heads / kvHeads;
  // One task per (batch, key/value head): its query heads only touch its dk, dv.
  pool->parallelFor(B * kvHeads, double(group * S * T * D * 4), [&](int64_t begin, int64_t end) {
    std::vector<float> p(T), dp(T);
    for (int64_t task = begin; task < end; ++task) {
      int64_t bi = task / kvHeads, kh = task % kvHeads;
      for (int64_t ti = 0; ti < T; ++ti)
        for (int64_t dd = 0; dd < D; ++dd) {
          dk[(bi * T + ti) * kvHeads * D + kh * D + dd] = 0;
          dv[(bi * T + ti) * kvHeads * D + kh * D + dd] = 0;
        }
      for (int64_t h = kh * group; h < (kh + 1) * group; ++h)
        for (int64_t si = 0; si < S; ++si) {
          const float *qrow = pq + (bi * S + si) * heads * D + h * D;
          const float *dorow = pdo + (bi * S + si) * heads * D + h * D;
          float *dqrow = dq + (bi * S + si) * heads * D + h * D;
          int64_t last = visibleKeys(d, si);
          double sum = expScores(d, qrow, pk + bi * T * kvHeads * D + kh * D, last, p.data());
          double dot = 0;
          for (int64_t ti = 0; ti < last; ++ti) {
            p[ti] = static_cast<float>(p[ti] / sum);
            const float *vrow = pv + (bi * T + ti) * kvHeads * D + kh * D;
            float acc = 0;
            for (int64_t dd = 0; dd < D; ++dd)
              acc += dorow[dd] * vrow[dd];
            dp[ti] = acc;
            dot += double(p[ti]) * acc;
          }
          std::fill(dqrow, dqrow + D, 0.0f);
          for (int64_t ti = 0; ti < last; ++ti) {
            float ds = static_cast<float>(p[ti] * (dp[ti] - dot)) * scale;
            const float *krow = pk + (bi * T + ti) * kvHeads * D + kh * D;
            float *dkrow = dk + (bi * T + ti) * kvHeads * D + kh * D;
            float *dvrow = dv + (bi * T + ti) * kvHeads * D + kh * D;
            for (int64_t dd = 0; dd < D; ++dd) {
              dqrow[dd] += ds * krow[dd];
              dkrow[dd] += ds * qrow[dd];
              dvrow[dd] += p[ti] * dorow[dd];
            }
          }
        }
    }
  });
}

Kernel buildPackedAttention(const Ctx &c, bool grad) {
  c.arity(grad ? 2 : 1, 1);
  const Buffer &x = c.in(0);
  const Buffer &dense = grad ? c.in(1) : c.out(); // O or dO: [B, S, H*D]
  c.needF32(x), c.needF32(dense), c.needF32(c.out());
  int64_t heads = c.attrInt("num_heads"), kvHeads = c.attrInt("num_kv_heads", heads);
  std::vector<int64_t> starts = c.attrInts("packed");
  if (x.shape.size() != 3 || dense.shape.size() != 3 || dense.shape[0] != x.shape[0] ||
      dense.shape[1] != x.shape[1] || heads < 1 || kvHeads < 1 || heads % kvHeads || dense.shape[2] % heads ||
      starts.size() != 3)
    c.bad(cat("inconsistent packed attention: x ", shapeStr(x.shape), ", ", grad ? "dO " : "O ",
              shapeStr(dense.shape), ", ", heads, " heads, ", kvHeads, " kv heads, ", starts.size(), " starts"));
  if (grad)
    c.sameShape(x, c.out());
  int64_t B = x.shape[0], S = x.shape[1], W = x.shape[2], D = dense.shape[2] / heads;
  int64_t widths[3] = {heads * D, kvHeads * D, kvHeads * D};
  for (int i = 0; i < 3; ++i)
    if (starts[i] < 0 || starts[i] + widths[i] > W)
      c.bad(cat("packed part ", i, " [", starts[i], ", ", starts[i] + widths[i], ") is outside x's ", W, " columns"));
  AttentionDims d{B, S, S, heads, kvHeads, D, c.attrFlag("causal"),
                  static_cast<float>(c.attrFloat("scale", 1.0 / std::sqrt(double(D))))};
  const float *px = c.f32(x), *pdense = c.f32(dense);
  float *out = c.f32(c.out());
  ThreadPool *pool = &c.pool;
  std::array<int64_t, 3> at{starts[0], starts[1], starts[2]}, width{widths[0], widths[1], widths[2]};
  return [=] {
    std::vector<float> parts[3], grads[3];
    for (int i = 0; i < 3; ++i) {
      parts[i].resize(size_t(B * S * width[i]));
      for (int64_t r = 0; r < B * S; ++r)
        std::copy_n(px + r * W + at[i], width[i], parts[i].data() + r * width[i]);
    }
    if (!grad) {
      attentionForward(*pool, d, parts[0].data(), parts[1].data(), parts[2].data(), out);
      return;
    }
    for (int i = 0; i < 3; ++i)
      grads[i].resize(parts[i].size());
    attentionBackward(*pool, d, parts[0].data(), parts[1].data(), parts[2].data(), pdense, grads[0].data(),
                      grads[1].data(), grads[2].data());
    std::fill(out, out + B * S * W, 0.0f);
    for (int i = 0; i < 3; ++i)
      for (int64_t r = 0; r < B * S; ++r)
        for (int64_t j = 0; j < width[i]; ++j)
          out[r * W + at[i] + j] += grads[i][r * width[i] + j];
  };
}

namespace {

Kernel buildAttention(const Ctx &c) {
  if (c.ins.attrs.contains("packed"))
    return buildPackedAttention(c, false);
  c.arity(3, 1);
  const Buffer &q = c.in(0), &k = c.in(1), &v = c.in(2), &o = c.out();
  for (const Buffer *buf : {&q, &k, &v, &o})
    c.needF32(*buf);
  int64_t heads = c.attrInt("num_heads"), kvHeads = c.attrInt("num_kv_heads", heads);
  if (q.shape.size() != 3 || k.shape.size() != 3 || k.shape != v.shape || o.shape != q.shape ||
      heads < 1 || kvHeads < 1 || heads % kvHeads || q.shape[2] % heads ||
      k.shape[2] != q.shape[2] / heads * kvHeads || k.shape[0] != q.shape[0])
    c.bad(cat("inconsistent attention shapes q ", shapeStr(q.shape), ", k ", shapeStr(k.shape),
              ", v ", shapeStr(v.shape), " with ", heads, " heads and ", kvHeads, " kv heads"));
  int64_t B = q.shape[0], S = q.shape[1], T = k.shape[1], D = q.shape[2] / heads;
  bool causal = c.attrFlag("causal");
  float scale = static_cast<float>(c.attrFloat("scale", 1.0 / std::sqrt(double(D))));
  float *pq = c.f32(q), *pk = c.f32(k), *pv = c.f32(v), *po = c.f32(o);
  AttentionDims d{B, S, T, heads, kvHeads, D, causal, scale};
  ThreadPool *pool = &c.pool;
  return [=] { attentionForward(*pool, d, pq, pk, pv, po); };
}

/// With a second output (loom-fuse-loss-gradient), the logits themselves,
/// each row is overwritten by its gradient once its loss is taken: the
/// values cross_entropy_grad computes with a seed of grad_scale.
Kernel buildCrossEntropy(const Ctx &c) {
  bool withGrad = c.ins.out.size() == 2;
  c.arity(2, withGrad ? 2 : 1);
  const Buffer &logits = c.in(0), &targets = c.in(1), &o = c.out();
  c.needF32(logits), c.needInt(targets), c.needF32(o);
  if (logits.shape.empty() || Shape(logits.shape.begin(), logits.shape.end() - 1) != targets.shape ||
      count(o.shape) != 1)
    c.bad("expects logits [..., V], targets [...] and a scalar result");
  if (withGrad && c.ins.out[1] != c.ins.in[0])
    c.bad("writes the loss's gradient over the logits: its second output must be its first input");
  int64_t V = logits.shape.back(), rows = count(targets.shape);
  IndexReader read{c.arena + targets.offset, targets.dtype == LOOM_I64};
  float *pl = c.f32(logits), *po = c.f32(o);
  std::string where = c.where, name = targets.name;
  if (auto [start, parts] = vocabSlice(c, V); withGrad && parts > 1) {
    // A vocabulary split over ranks: the loss from the group's statistics,
    // then each row overwritten by its gradient from the same ones, as
    // cross_entropy_grad computes it.
    float seed = static_cast<float>(c.attrFloat("grad_scale"));
    VocabStats stats(c, V, rows, start, parts);
    return [=]() mutable {
      checkIndices(where, "target class in '" + name + "'", read, rows, V * parts);
      stats.compute(pl, read);
      *po = stats.meanLoss();
      stats.gradient(pl, pl, seed / float(std::max<int64_t>(rows, 1)), read);
    };
  }
  if (withGrad) {
    float seed = static_cast<float>(c.attrFloat("grad_scale"));
    ThreadPool *pool = &c.pool;
    return [=] {
      checkIndices(where, "target class in '" + name + "'", read, rows, V);
      // As cross_entropy and cross_entropy_grad compute them, row by row.
      float scale = seed / float(std::max<int64_t>(rows, 1));
      std::vector<double> losses(rows);
      pool->parallelFor(rows, double(V * 20), [&](int64_t r0, int64_t r1) {
        std::vector<double> e(V);
        for (int64_t r = r0; r < r1; ++r) {
          float *row = pl + r * V;
          float mx = *std::max_element(row, row + V);
          double sum = 0;
          for (int64_t j = 0; j < V; ++j)
            sum += (e[j] = std::exp(double(row[j]) - mx));
          losses[r] = std::log(sum) + mx - row[read(r)];
          for (int64_t j = 0; j < V; ++j)
            row[j] = static_cast<float>(e[j] / sum) * scale;
          row[read(r)] -= scale;
        }
      });
      double total = 0;
      for (double l : losses)
        total += l;
      *po = static_cast<float>(total / std::max<int64_t>(rows, 1));
    };
  }
  if (auto [start, parts] = vocabSlice(c, V); parts > 1) {
    VocabStats stats(c, V, rows, start, parts);
    return [=]() mutable {
      checkIndices(where, "target class in '" + name + "'", read, rows, V * parts);
      stats.compute(pl, read);
      *po = stats.meanLoss();
    };
  }
  ThreadPool *pool = &c.pool;
  return [=] {
    checkIndices(where, "target class in '" + name + "'", read, rows, V);
    // Each row's loss over the threads, then their sum in order.
    std::vector<double> losses(rows);
    pool->parallelFor(rows, double(V * 20), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float *row = pl + r * V;
        float mx = *std::max_element(row, row + V);
        double sum = 0;
        for (int64_t j = 0; j < V; ++j)
          sum += std::exp(double(row[j]) - mx);
        losses[r] = std::log(sum) + mx - row[read(r)];
      }
    });
    double total = 0;
    for (double l : losses)
      total += l;
    *po = static_cast<float>(total / std::max<int64_t>(rows, 1));
  };
}

} // namespace

void registerTransformerBuilders(BuilderTable &table) {
  table.insert({
      {"embedding", buildEmbedding},
      {"rotary", buildRotary},
      {"attention", buildAttention},
      {"cross_entropy", buildCrossEntropy},
  });
}

} // namespace loom::rt::cpu
