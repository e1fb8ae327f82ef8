//===- CpuBackend.cpp - Plain C++ execution of instruction streams --------===//

#include "runtime/src/cpu/CpuBackend.h"
#include "runtime/src/Backend.h"
#include "runtime/src/Elementwise.h"
#include "runtime/src/Error.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <set>

namespace loom::rt {

using json = nlohmann::json;

namespace {

/// What a kernel builder sees: the instruction, its buffers and the arena.
struct Ctx {
  const Instruction &ins;
  const RankProgram &rank;
  char *arena;
  ThreadPool &pool;
  std::string where;
  /// bf16 buffers of this instruction, computed on through f32 copies.
  const std::map<int64_t, float *> &widened;
  Communicator *comm;
  AsyncComm *async = nullptr; // null: "async" collectives run in place

  const Buffer &in(size_t i) const { return rank.buffers[ins.in[i]]; }
  const Buffer &out(size_t i = 0) const { return rank.buffers[ins.out[i]]; }
  float *f32(const Buffer &b) const {
    auto it = widened.find(b.id);
    return it != widened.end() ? it->second : reinterpret_cast<float *>(arena + b.offset);
  }
  template <typename T> T *ptr(const Buffer &b) const {
    return reinterpret_cast<T *>(arena + b.offset);
  }

  [[noreturn]] void bad(const std::string &msg) const {
    fail(LOOM_INVALID_BUNDLE, where, ": ", msg);
  }
  void arity(size_t nin, size_t nout) const {
    if (ins.in.size() != nin || ins.out.size() != nout)
      bad(cat("expects ", nin, " inputs and ", nout, " outputs, got ", ins.in.size(), " and ",
              ins.out.size()));
  }
  void needF32(const Buffer &b) const {
    if (b.dtype != LOOM_F32 && !widened.count(b.id))
      fail(LOOM_UNSUPPORTED, where, ": the CPU backend computes in f32; buffer '", b.name,
           "' is ", dtypeName(b.dtype));
  }
  void needInt(const Buffer &b) const {
    if (b.dtype != LOOM_I32 && b.dtype != LOOM_I64)
      bad(cat("buffer '", b.name, "' must hold i32 or i64 indices, got ", dtypeName(b.dtype)));
  }
  void sameShape(const Buffer &a, const Buffer &b) const {
    if (a.shape != b.shape)
      bad(cat("buffers '", a.name, "' ", shapeStr(a.shape), " and '", b.name, "' ",
              shapeStr(b.shape), " must have the same shape"));
  }
  int64_t attrInt(const char *name, std::optional<int64_t> dflt = std::nullopt) const {
    auto it = ins.attrs.find(name);
    if (it == ins.attrs.end()) {
      if (dflt)
        return *dflt;
      bad(cat("attribute '", name, "' is missing"));
    }
    if (!it->is_number_integer())
      bad(cat("attribute '", name, "' must be an integer"));
    return it->get<int64_t>();
  }
  double attrFloat(const char *name, std::optional<double> dflt = std::nullopt) const {
    auto it = ins.attrs.find(name);
    if (it == ins.attrs.end()) {
      if (dflt)
        return *dflt;
      bad(cat("attribute '", name, "' is missing"));
    }
    if (!it->is_number())
      bad(cat("attribute '", name, "' must be a number"));
    return it->get<double>();
  }
  bool attrFlag(const char *name) const {
    auto it = ins.attrs.find(name);
    return it != ins.attrs.end() && it->is_boolean() && it->get<bool>();
  }
  std::vector<int64_t> attrInts(const char *name) const {
    auto it = ins.attrs.find(name);
    if (it == ins.attrs.end() || !it->is_array())
      bad(cat("attribute '", name, "' must be a list of integers"));
    std::vector<int64_t> out;
    for (auto &v : *it) {
      if (!v.is_number_integer())
        bad(cat("attribute '", name, "' must be a list of integers"));
      out.push_back(v.get<int64_t>());
    }
    return out;
  }
  int64_t axis(int64_t a, size_t rank) const {
    int64_t r = static_cast<int64_t>(rank);
    int64_t n = a < 0 ? a + r : a;
    if (n < 0 || n >= r)
      bad(cat("axis ", a, " is out of range for rank ", rank));
    return n;
  }
};

using Kernel = std::function<void()>;
using Builder = Kernel (*)(const Ctx &);

int64_t count(const Shape &s) { return numElements(s).value_or(0); }

std::vector<int64_t> stridesOf(const Shape &s) {
  std::vector<int64_t> st(s.size(), 1);
  for (int i = static_cast<int>(s.size()) - 2; i >= 0; --i)
    st[i] = st[i + 1] * s[i + 1];
  return st;
}

/// Strides that read `in` broadcast to `out` (0 along broadcast dimensions);
/// empty when `in` does not broadcast to `out`.
std::optional<std::vector<int64_t>> broadcastStrides(const Shape &in, const Shape &out) {
  if (in.size() > out.size())
    return std::nullopt;
  std::vector<int64_t> inStrides = stridesOf(in), st(out.size(), 0);
  size_t off = out.size() - in.size();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] == out[off + i])
      st[off + i] = in[i] == 1 ? 0 : inStrides[i];
    else if (in[i] != 1)
      return std::nullopt;
  }
  return st;
}

/// Calls f(outIndex, offsetA, offsetB) over every element of `shape`.
template <typename F>
void forEachBroadcast(const Shape &shape, const std::vector<int64_t> &sa,
                      const std::vector<int64_t> &sb, F f) {
  int64_t n = count(shape);
  size_t rank = shape.size();
  if (rank == 0) {
    f(0, 0, 0);
    return;
  }
  std::vector<int64_t> idx(rank, 0);
  int64_t oa = 0, ob = 0;
  int64_t inner = shape[rank - 1], ia = sa[rank - 1], ib = sb[rank - 1];
  for (int64_t o = 0; o < n; o += inner) {
    for (int64_t j = 0; j < inner; ++j)
      f(o + j, oa + j * ia, ob + j * ib);
    for (int d = static_cast<int>(rank) - 2; d >= 0; --d) {
      ++idx[d];
      oa += sa[d];
      ob += sb[d];
      if (idx[d] < shape[d])
        break;
      oa -= sa[d] * shape[d];
      ob -= sb[d] * shape[d];
      idx[d] = 0;
    }
  }
}

//===--------------------------------------------------------------------===//
// Elementwise
//===--------------------------------------------------------------------===//

template <typename Op> Kernel binary(const Ctx &c, Op op) {
  c.arity(2, 1);
  const Buffer &a = c.in(0), &b = c.in(1), &o = c.out();
  c.needF32(a), c.needF32(b), c.needF32(o);
  auto sa = broadcastStrides(a.shape, o.shape), sb = broadcastStrides(b.shape, o.shape);
  if (!sa || !sb)
    c.bad(cat("cannot broadcast ", shapeStr(a.shape), " and ", shapeStr(b.shape), " to ",
              shapeStr(o.shape)));
  float *pa = c.f32(a), *pb = c.f32(b), *po = c.f32(o);
  Shape shape = o.shape;
  std::vector<int64_t> stA = *sa, stB = *sb;
  if (a.shape == o.shape && b.shape == o.shape) {
    int64_t n = count(shape);
    return [=] {
      for (int64_t i = 0; i < n; ++i)
        po[i] = op(pa[i], pb[i]);
    };
  }
  return [=] { forEachBroadcast(shape, stA, stB, [&](int64_t i, int64_t ia, int64_t ib) { po[i] = op(pa[ia], pb[ib]); }); };
}

template <typename Op> Kernel unary(const Ctx &c, Op op) {
  c.arity(1, 1);
  c.needF32(c.in(0)), c.needF32(c.out());
  c.sameShape(c.in(0), c.out());
  float *x = c.f32(c.in(0)), *y = c.f32(c.out());
  int64_t n = count(c.out().shape);
  return [=] {
    for (int64_t i = 0; i < n; ++i)
      y[i] = op(x[i]);
  };
}

using ew::geluErf;
using ew::geluTanh;

Kernel buildAdd(const Ctx &c) { return binary(c, [](float a, float b) { return a + b; }); }
Kernel buildSub(const Ctx &c) { return binary(c, [](float a, float b) { return a - b; }); }
Kernel buildMul(const Ctx &c) { return binary(c, [](float a, float b) { return a * b; }); }
Kernel buildDiv(const Ctx &c) { return binary(c, [](float a, float b) { return a / b; }); }
Kernel buildGelu(const Ctx &c) {
  return c.attrFlag("approximate") ? unary(c, geluTanh) : unary(c, geluErf);
}
Kernel buildRelu(const Ctx &c) { return unary(c, ew::relu); }
Kernel buildSilu(const Ctx &c) { return unary(c, ew::silu); }
Kernel buildExp(const Ctx &c) { return unary(c, [](float x) { return std::exp(x); }); }
Kernel buildTanh(const Ctx &c) { return unary(c, [](float x) { return std::tanh(x); }); }
Kernel buildRsqrt(const Ctx &c) { return unary(c, ew::rsqrt); }
Kernel buildNeg(const Ctx &c) { return unary(c, [](float x) { return -x; }); }
Kernel buildScale(const Ctx &c) {
  float f = static_cast<float>(c.attrFloat("factor"));
  return unary(c, [f](float x) { return x * f; });
}

//===--------------------------------------------------------------------===//
// Matmul
//===--------------------------------------------------------------------===//

/// C = op(A) op(B), then the epilogue (docs/bundle-format.md):
///   "bias"       inputs A, B, bias; C + bias over C's last dimension.
///   "bias_gelu"  inputs A, B, bias; outputs gelu_tanh(C + bias) and, when
///                given, the pre-activation C + bias (kept for the backward).
///   "dgelu"      inputs A, B, pre; C * gelu_tanh'(pre).
///   "residual"   inputs A, B, R; C + R (R of C's shape).
///   "bias_residual"  inputs A, B, bias, R; C + bias + R.
///   "bgrad"      inputs A, B; outputs C and the column sums of B over the
///                product's k dimension (a bias gradient; B is not transposed).
/// The epilogue works on C's f32 values before anything is rounded.
Kernel buildMatmul(const Ctx &c) {
  auto found = c.ins.attrs.find("epilogue");
  std::string epilogue = found != c.ins.attrs.end() && found->is_string() ? found->get<std::string>() : "";
  static const std::set<std::string> kEpilogues = {"", "bias", "bias_gelu", "dgelu", "bgrad", "residual",
                                                    "bias_residual"};
  if (!kEpilogues.count(epilogue))
    c.bad("unknown epilogue '" + epilogue +
          "'; the matmul epilogues are: bias, bias_gelu, dgelu, bgrad, residual, bias_residual");
  bool withBias = epilogue == "bias" || epilogue == "bias_gelu" || epilogue == "bias_residual";
  bool gelu = epilogue == "bias_gelu", dgelu = epilogue == "dgelu", bgrad = epilogue == "bgrad";
  bool residual = epilogue == "residual" || epilogue == "bias_residual";
  if (gelu)
    c.arity(3, c.ins.out.size() == 2 ? 2 : 1);
  else if (epilogue == "bias_residual")
    c.arity(4, 1);
  else
    c.arity(epilogue.empty() || bgrad ? 2 : 3, bgrad ? 2 : 1);
  const Buffer &a = c.in(0), &b = c.in(1), &o = c.out();
  c.needF32(a), c.needF32(b), c.needF32(o);
  if (a.shape.size() < 2 || b.shape.size() < 2 || o.shape.size() < 2)
    c.bad("operands and result need rank >= 2");
  bool ta = c.attrFlag("transpose_a"), tb = c.attrFlag("transpose_b");
  size_t ra = a.shape.size(), rb = b.shape.size(), ro = o.shape.size();
  int64_t m = ta ? a.shape[ra - 1] : a.shape[ra - 2], k = ta ? a.shape[ra - 2] : a.shape[ra - 1];
  int64_t kb = tb ? b.shape[rb - 1] : b.shape[rb - 2], n = tb ? b.shape[rb - 2] : b.shape[rb - 1];
  if (k != kb || o.shape[ro - 2] != m || o.shape[ro - 1] != n)
    c.bad(cat("shapes ", shapeStr(a.shape), " x ", shapeStr(b.shape), " -> ", shapeStr(o.shape),
              " do not form a matrix product"));
  Shape batch(o.shape.begin(), o.shape.end() - 2);
  Shape batchA(a.shape.begin(), a.shape.end() - 2), batchB(b.shape.begin(), b.shape.end() - 2);
  auto sa = broadcastStrides(batchA, batch), sb = broadcastStrides(batchB, batch);
  if (!sa || !sb)
    c.bad("batch dimensions do not broadcast to the result");
  // Element offsets of each batch's A and B matrices.
  std::vector<int64_t> offA, offB;
  forEachBroadcast(batch, *sa, *sb, [&](int64_t, int64_t ia, int64_t ib) {
    offA.push_back(ia * m * k);
    offB.push_back(ib * k * n);
  });
  float *pa = c.f32(a), *pb = c.f32(b), *po = c.f32(o);
  float *bias = nullptr, *pre = nullptr, *preIn = nullptr, *colSums = nullptr, *res = nullptr;
  if (residual) {
    const Buffer &r = c.in(c.ins.in.size() - 1);
    c.needF32(r), c.sameShape(r, o);
    if (r.offset < o.offset + o.bytes && o.offset < r.offset + r.bytes)
      c.bad("the residual input must not overlap the result");
    res = c.f32(r);
  }
  if (withBias) {
    c.needF32(c.in(2));
    if (c.in(2).shape != Shape{n})
      c.bad(cat("the bias must be [", n, "], got ", shapeStr(c.in(2).shape)));
    bias = c.f32(c.in(2));
  }
  if (gelu && c.ins.out.size() == 2) {
    c.needF32(c.out(1)), c.sameShape(c.out(1), o);
    pre = c.f32(c.out(1));
  }
  if (dgelu) {
    c.needF32(c.in(2));
    if (count(c.in(2).shape) != count(o.shape))
      c.bad(cat("the pre-activation ", shapeStr(c.in(2).shape), " must have as many elements as the result ",
                shapeStr(o.shape)));
    preIn = c.f32(c.in(2));
  }
  if (bgrad) {
    c.needF32(c.out(1));
    if (tb || batchB.size() != 0 || count(c.out(1).shape) != n)
      c.bad(cat("the bias gradient sums an untransposed 2-D B over k: B ", shapeStr(b.shape), " gives ", n,
                " columns, the gradient is ", shapeStr(c.out(1).shape)));
    colSums = c.f32(c.out(1));
  }
  ThreadPool *pool = &c.pool;
  int64_t batches = static_cast<int64_t>(offA.size());
  return [=] {
    // One task per (batch, row); each row of C is independent.
    pool->parallelFor(batches * m, double(n * k), [&](int64_t begin, int64_t end) {
      std::vector<float> arow(k);
      for (int64_t t = begin; t < end; ++t) {
        int64_t bi = t / m, i = t % m;
        const float *A = pa + offA[bi], *B = pb + offB[bi];
        float *C = po + (bi * m + i) * n;
        for (int64_t kk = 0; kk < k; ++kk)
          arow[kk] = ta ? A[kk * m + i] : A[i * k + kk];
        if (tb) {
          for (int64_t j = 0; j < n; ++j) {
            const float *brow = B + j * k;
            float acc = 0;
            for (int64_t kk = 0; kk < k; ++kk)
              acc += arow[kk] * brow[kk];
            C[j] = acc;
          }
        } else {
          std::fill(C, C + n, 0.0f);
          for (int64_t kk = 0; kk < k; ++kk) {
            float av = arow[kk];
            const float *brow = B + kk * n;
            for (int64_t j = 0; j < n; ++j)
              C[j] += av * brow[j];
          }
        }
        if (bias)
          for (int64_t j = 0; j < n; ++j)
            C[j] = C[j] + bias[j];
        if (res) {
          const float *x = res + (bi * m + i) * n;
          for (int64_t j = 0; j < n; ++j)
            C[j] = C[j] + x[j];
        }
        if (pre)
          std::copy(C, C + n, pre + (bi * m + i) * n);
        if (gelu)
          for (int64_t j = 0; j < n; ++j)
            C[j] = ew::geluTanh(C[j]);
        if (preIn) {
          const float *x = preIn + (bi * m + i) * n;
          for (int64_t j = 0; j < n; ++j)
            C[j] *= ew::derivative(ew::Fn::GeluTanh, x[j], 0.0f);
        }
      }
    });
    if (colSums) // B is [k, n]: sum its rows, in double, columns split over tasks
      pool->parallelFor(n, double(k), [&](int64_t begin, int64_t end) {
        for (int64_t j = begin; j < end; ++j) {
          double s = 0;
          for (int64_t kk = 0; kk < k; ++kk)
            s += pb[kk * n + j];
          colSums[j] = float(s);
        }
      });
  };
}

//===--------------------------------------------------------------------===//
// Reductions and normalisation
//===--------------------------------------------------------------------===//

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

/// Splits a shape at `axis` into (outer, axis extent, inner).
void splitAt(const Shape &s, int64_t axis, int64_t &outer, int64_t &len, int64_t &inner) {
  outer = 1, inner = 1, len = s[axis];
  for (int64_t d = 0; d < axis; ++d)
    outer *= s[d];
  for (size_t d = axis + 1; d < s.size(); ++d)
    inner *= s[d];
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
  return [=] {
    for (int64_t r = 0; r < rows; ++r) {
      const float *xr = px + r * h;
      float *yr = py + r * h;
      double mean = 0, var = 0;
      if (!rms) {
        for (int64_t j = 0; j < h; ++j)
          mean += xr[j];
        mean /= h;
      }
      for (int64_t j = 0; j < h; ++j)
        var += (xr[j] - mean) * (xr[j] - mean);
      var /= h;
      float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
      for (int64_t j = 0; j < h; ++j)
        yr[j] = (xr[j] - static_cast<float>(mean)) * inv * g[j] + (b ? b[j] : 0.0f);
    }
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
  if (x.shape.size() < 2)
    c.bad("input must be [N, C, ...]");
  int64_t n = x.shape[0], ch = x.shape[1], inner = count(x.shape) / std::max<int64_t>(n * ch, 1);
  if (c.in(1).shape != Shape{ch} || c.in(2).shape != Shape{ch})
    c.bad(cat("gamma and beta must be [", ch, "]"));
  float eps = static_cast<float>(c.attrFloat("eps"));
  float *px = c.f32(x), *g = c.f32(c.in(1)), *b = c.f32(c.in(2)), *py = c.f32(c.out());
  ThreadPool *pool = &c.pool;
  return [=] {
    pool->parallelFor(ch, double(n * inner), [&](int64_t c0, int64_t c1) {
      for (int64_t cc = c0; cc < c1; ++cc) {
        double mean = 0, var = 0;
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < inner; ++j)
            mean += px[(i * ch + cc) * inner + j];
        mean /= double(n * inner);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < inner; ++j) {
            double d = px[(i * ch + cc) * inner + j] - mean;
            var += d * d;
          }
        var /= double(n * inner);
        float inv = static_cast<float>(1.0 / std::sqrt(var + eps)), m = static_cast<float>(mean);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < inner; ++j) {
            int64_t at = (i * ch + cc) * inner + j;
            py[at] = (px[at] - m) * inv * g[cc] + b[cc];
          }
      }
    });
  };
}

//===--------------------------------------------------------------------===//
// Transformer pieces
//===--------------------------------------------------------------------===//

Communicator *needComm(const Ctx &c) {
  if (!c.comm)
    fail(LOOM_UNSUPPORTED, c.where, ": ", c.ins.op, " needs the other ranks; run multi-rank "
         "bundles with loom-run, which starts every rank");
  return c.comm;
}

/// The global ranks of the group an instruction names (attribute "group").
std::vector<int> groupOf(const Ctx &c, const std::string &name) {
  auto it = c.rank.groups.find(name);
  if (it == c.rank.groups.end()) {
    std::string known;
    for (auto &[n, _] : c.rank.groups)
      known += (known.empty() ? "" : ", ") + n;
    c.bad(cat("names group '", name, "', which rank ", c.rank.rank, " does not have (it has: ",
              known.empty() ? "none" : known, ")"));
  }
  return std::vector<int>(it->second.begin(), it->second.end());
}

std::string attrString(const Ctx &c, const char *name, const std::string &dflt) {
  auto it = c.ins.attrs.find(name);
  if (it == c.ins.attrs.end())
    return dflt;
  if (!it->is_string())
    c.bad(cat("attribute '", name, "' must be a string"));
  return it->get<std::string>();
}

/// Where this rank's slice of a vocabulary split over `vocab_group` starts
/// (0 and the whole group size 1 when the attribute is absent).
std::pair<int64_t, int64_t> vocabSlice(const Ctx &c, int64_t localRows) {
  std::string name = attrString(c, "vocab_group", "");
  if (name.empty())
    return {0, 1};
  std::vector<int> group = groupOf(c, name);
  int64_t index = std::find(group.begin(), group.end(), int(c.rank.rank)) - group.begin();
  return {index * localRows, int64_t(group.size())};
}

/// Reads index i of an i32 or i64 buffer.
struct IndexReader {
  const char *base;
  bool wide;
  int64_t operator()(int64_t i) const {
    return wide ? reinterpret_cast<const int64_t *>(base)[i]
                : reinterpret_cast<const int32_t *>(base)[i];
  }
};

void checkIndices(const std::string &where, const std::string &what, IndexReader ids, int64_t n,
                  int64_t limit) {
  for (int64_t i = 0; i < n; ++i) {
    int64_t v = ids(i);
    if (v < 0 || v >= limit)
      fail(LOOM_INVALID_ARGUMENT, where, ": ", what, " ", v, " at position ", i,
           " is outside [0, ", limit, ")");
  }
}

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
  c.arity(1, 1);
  const Buffer &x = c.in(0);
  c.needF32(x), c.needF32(c.out());
  c.sameShape(x, c.out());
  int64_t heads = c.attrInt("num_heads");
  if (x.shape.size() != 3 || heads < 1 || x.shape[2] % heads != 0 || (x.shape[2] / heads) % 2)
    c.bad("input must be [B, S, heads * even head_dim]");
  int64_t b = x.shape[0], s = x.shape[1], w = x.shape[2], d = w / heads;
  double theta = c.attrFloat("theta", 10000.0);
  double sign = c.attrFlag("inverse") ? -1.0 : 1.0; // the gradient rotates back
  float *px = c.f32(x), *py = c.f32(c.out());
  return [=] {
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t si = 0; si < s; ++si)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < d / 2; ++i) {
            double angle = sign * si * std::pow(theta, -2.0 * i / d);
            float cs = static_cast<float>(std::cos(angle)), sn = static_cast<float>(std::sin(angle));
            int64_t at = (bi * s + si) * w + h * d + 2 * i;
            float x0 = px[at], x1 = px[at + 1];
            py[at] = x0 * cs - x1 * sn;
            py[at + 1] = x0 * sn + x1 * cs;
          }
  };
}

/// Attention's sizes: B sequences of S queries and T keys, `heads` query
/// heads over kvHeads key/value heads of D each.
struct AttentionDims {
  int64_t B, S, T, heads, kvHeads, D;
  bool causal;
  float scale;
};

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

/// O from dense q [B,S,H*D], k, v [B,T,KV*D].
void attentionForward(ThreadPool &threads, const AttentionDims &d, const float *pq, const float *pk,
                      const float *pv, float *po) {
  ThreadPool *pool = &threads;
  auto [B, S, T, heads, kvHeads, D, causal, scale] = d;
  int64_t group = heads / kvHeads;
  pool->parallelFor(B * heads * S, double(2 * T * D), [&](int64_t begin, int64_t end) {
    std::vector<float> p(T);
    for (int64_t t = begin; t < end; ++t) {
      int64_t bi = t / (heads * S), h = (t / S) % heads, si = t % S, kh = h / group;
      const float *qrow = pq + (bi * S + si) * heads * D + h * D;
      int64_t last = causal ? std::min(T, si + 1 + (T - S)) : T;
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

/// dq, dk, dv of attentionForward's operands, given dO.
void attentionBackward(ThreadPool &threads, const AttentionDims &d, const float *pq, const float *pk,
                       const float *pv, const float *pdo, float *dq, float *dk, float *dv) {
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
          int64_t last = causal ? std::min(T, si + 1 + (T - S)) : T;
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

/// Attention reading q, k and v as columns of one tensor x [B, S, W]
/// (attrs "packed": the three starts along W; self-attention, T = S), and
/// its gradient writing dq|dk|dv into dx of x's shape (zero elsewhere): the
/// compiler's form of a fused q|k|v projection, without the slices and the
/// concatenation of their gradients.
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

/// Softmax statistics of logits whose vocabulary is split over a group:
/// the row maximum (all-reduced with max), then the sum of exponentials and
/// the target's logit (all-reduced with sum, together), so the loss and its
/// gradient never gather the logits.
struct VocabStats {
  VocabStats(const Ctx &c, int64_t V, int64_t rows, int64_t start, int64_t parts)
      : comm(needComm(c)), group(groupOf(c, attrString(c, "vocab_group", ""))),
        rank(int(c.rank.rank)), V(V), rows(rows), start(start) {
    (void)parts;
  }
  void compute(const float *logits, IndexReader read) {
    max.assign(rows, 0.0f);
    both.assign(2 * rows, 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      max[r] = *std::max_element(logits + r * V, logits + (r + 1) * V);
    comm->allReduce(rank, group, max.data(), rows, Reduction::Max);
    for (int64_t r = 0; r < rows; ++r) {
      const float *row = logits + r * V;
      double s = 0;
      for (int64_t j = 0; j < V; ++j)
        s += std::exp(double(row[j]) - max[r]);
      both[r] = static_cast<float>(s);
      int64_t t = read(r) - start;
      both[rows + r] = t >= 0 && t < V ? row[t] : 0.0f;
    }
    comm->allReduce(rank, group, both.data(), 2 * rows, Reduction::Sum);
    sum = both.data();
    target = both.data() + rows;
  }
  Communicator *comm;
  std::vector<int> group;
  int rank;
  int64_t V, rows, start;
  std::vector<float> max, both;
  const float *sum = nullptr, *target = nullptr;
};

Kernel buildCrossEntropy(const Ctx &c) {
  c.arity(2, 1);
  const Buffer &logits = c.in(0), &targets = c.in(1), &o = c.out();
  c.needF32(logits), c.needInt(targets), c.needF32(o);
  if (logits.shape.empty() || Shape(logits.shape.begin(), logits.shape.end() - 1) != targets.shape ||
      count(o.shape) != 1)
    c.bad("expects logits [..., V], targets [...] and a scalar result");
  int64_t V = logits.shape.back(), rows = count(targets.shape);
  IndexReader read{c.arena + targets.offset, targets.dtype == LOOM_I64};
  float *pl = c.f32(logits), *po = c.f32(o);
  std::string where = c.where, name = targets.name;
  if (auto [start, parts] = vocabSlice(c, V); parts > 1) {
    VocabStats stats(c, V, rows, start, parts);
    return [=]() mutable {
      checkIndices(where, "target class in '" + name + "'", read, rows, V * parts);
      stats.compute(pl, read);
      double total = 0;
      for (int64_t r = 0; r < rows; ++r)
        total += std::log(double(stats.sum[r])) + stats.max[r] - stats.target[r];
      *po = static_cast<float>(total / std::max<int64_t>(rows, 1));
    };
  }
  return [=] {
    checkIndices(where, "target class in '" + name + "'", read, rows, V);
    double total = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const float *row = pl + r * V;
      float mx = *std::max_element(row, row + V);
      double sum = 0;
      for (int64_t j = 0; j < V; ++j)
        sum += std::exp(double(row[j]) - mx);
      total += std::log(sum) + mx - row[read(r)];
    }
    *po = static_cast<float>(total / std::max<int64_t>(rows, 1));
  };
}

//===--------------------------------------------------------------------===//
// Shape manipulation
//===--------------------------------------------------------------------===//

/// Copies `in` (bytes per element `es`) read through strides `st` into `out`
/// laid out densely in `shape`.
Kernel stridedCopy(const Ctx &c, const Buffer &in, const Buffer &out, Shape shape,
                   std::vector<int64_t> st, int64_t base) {
  size_t es = dtypeSize(in.dtype);
  if (in.dtype != out.dtype)
    c.bad("input and result must have the same dtype");
  char *pi = c.arena + in.offset, *po = c.arena + out.offset;
  std::vector<int64_t> zero(shape.size(), 0);
  return [=] {
    forEachBroadcast(shape, st, zero, [&](int64_t o, int64_t i, int64_t) {
      std::memcpy(po + o * es, pi + (base + i) * es, es);
    });
  };
}

Kernel buildTranspose(const Ctx &c) {
  c.arity(1, 1);
  const Buffer &x = c.in(0), &o = c.out();
  std::vector<int64_t> perm = c.attrInts("permutation");
  if (perm.size() != x.shape.size())
    c.bad("permutation length must equal the input rank");
  std::vector<int64_t> in = stridesOf(x.shape), st;
  Shape shape;
  std::vector<bool> seen(perm.size(), false);
  for (int64_t p : perm) {
    if (p < 0 || p >= static_cast<int64_t>(perm.size()) || seen[p])
      c.bad("permutation must list each dimension once");
    seen[p] = true;
    shape.push_back(x.shape[p]);
    st.push_back(in[p]);
  }
  if (shape != o.shape)
    c.bad(cat("result must be ", shapeStr(shape)));
  return stridedCopy(c, x, o, shape, st, 0);
}

Kernel buildSlice(const Ctx &c) {
  c.arity(1, 1);
  const Buffer &x = c.in(0), &o = c.out();
  int64_t axis = c.axis(c.attrInt("axis"), x.shape.size());
  int64_t start = c.attrInt("start"), size = c.attrInt("size");
  if (start < 0 || size < 1 || start + size > x.shape[axis])
    c.bad(cat("slice [", start, ", ", start + size, ") is outside dimension ", axis, " of ",
              shapeStr(x.shape)));
  Shape shape = x.shape;
  shape[axis] = size;
  if (shape != o.shape)
    c.bad(cat("result must be ", shapeStr(shape)));
  std::vector<int64_t> st = stridesOf(x.shape);
  return stridedCopy(c, x, o, shape, st, start * st[axis]);
}

Kernel buildConcat(const Ctx &c) {
  if (c.ins.in.empty() || c.ins.out.size() != 1)
    c.bad("expects at least one input and one result");
  const Buffer &o = c.out();
  int64_t axis = c.axis(c.attrInt("axis"), o.shape.size());
  std::vector<Kernel> parts;
  int64_t offset = 0;
  std::vector<int64_t> ost = stridesOf(o.shape);
  for (size_t i = 0; i < c.ins.in.size(); ++i) {
    const Buffer &x = c.in(i);
    if (x.shape.size() != o.shape.size() || x.dtype != o.dtype)
      c.bad("inputs must match the result's rank and dtype");
    Shape expect = o.shape;
    expect[axis] = x.shape[axis];
    if (x.shape != expect || offset + x.shape[axis] > o.shape[axis])
      c.bad(cat("input ", i, " ", shapeStr(x.shape), " does not fit the result ", shapeStr(o.shape)));
    size_t es = dtypeSize(x.dtype);
    char *px = c.arena + x.offset, *po = c.arena + o.offset;
    Shape shape = x.shape;
    int64_t base = offset * ost[axis];
    std::vector<int64_t> zero(shape.size(), 0);
    parts.push_back([=] {
      forEachBroadcast(shape, ost, zero, [&](int64_t xi, int64_t oi, int64_t) {
        std::memcpy(po + (base + oi) * es, px + xi * es, es);
      });
    });
    offset += x.shape[axis];
  }
  if (offset != o.shape[axis])
    c.bad("inputs do not fill the result along the axis");
  return [parts] {
    for (const Kernel &k : parts)
      k();
  };
}

Kernel buildBroadcast(const Ctx &c) {
  c.arity(1, 1);
  auto st = broadcastStrides(c.in(0).shape, c.out().shape);
  if (!st)
    c.bad(cat("cannot broadcast ", shapeStr(c.in(0).shape), " to ", shapeStr(c.out().shape)));
  return stridedCopy(c, c.in(0), c.out(), c.out().shape, *st, 0);
}

Kernel buildCast(const Ctx &c) {
  c.arity(1, 1);
  const Buffer &x = c.in(0), &o = c.out();
  c.sameShape(x, o);
  int64_t n = count(x.shape);
  char *pi = c.arena + x.offset, *po = c.arena + o.offset;
  auto load = [](loom_dtype_t t, const char *p, int64_t i) -> double {
    switch (t) {
    case LOOM_F32: return reinterpret_cast<const float *>(p)[i];
    case LOOM_F64: return reinterpret_cast<const double *>(p)[i];
    case LOOM_BF16: return bf16ToFloat(reinterpret_cast<const uint16_t *>(p)[i]);
    case LOOM_I32: return reinterpret_cast<const int32_t *>(p)[i];
    case LOOM_I64: return static_cast<double>(reinterpret_cast<const int64_t *>(p)[i]);
    default: return 0;
    }
  };
  if (x.dtype == LOOM_F16 || o.dtype == LOOM_F16)
    fail(LOOM_UNSUPPORTED, c.where, ": the CPU backend does not convert f16 yet");
  loom_dtype_t ti = x.dtype, to = o.dtype;
  return [=] {
    for (int64_t i = 0; i < n; ++i) {
      double v = load(ti, pi, i);
      switch (to) {
      case LOOM_F32: reinterpret_cast<float *>(po)[i] = static_cast<float>(v); break;
      case LOOM_F64: reinterpret_cast<double *>(po)[i] = v; break;
      case LOOM_BF16: reinterpret_cast<uint16_t *>(po)[i] = floatToBf16(static_cast<float>(v)); break;
      case LOOM_I32: reinterpret_cast<int32_t *>(po)[i] = static_cast<int32_t>(v); break;
      case LOOM_I64: reinterpret_cast<int64_t *>(po)[i] = static_cast<int64_t>(v); break;
      default: break;
      }
    }
  };
}

//===--------------------------------------------------------------------===//
// Convolutional networks
//===--------------------------------------------------------------------===//

Kernel buildConv2D(const Ctx &c) {
  c.arity(2, 1);
  const Buffer &x = c.in(0), &w = c.in(1), &o = c.out();
  c.needF32(x), c.needF32(w), c.needF32(o);
  int64_t stride = c.attrInt("stride", 1), pad = c.attrInt("padding", 0), groups = c.attrInt("groups", 1);
  if (x.shape.size() != 4 || w.shape.size() != 4 || o.shape.size() != 4 || stride < 1 ||
      pad < 0 || groups < 1 || x.shape[1] != w.shape[1] * groups || w.shape[0] % groups)
    c.bad("inconsistent conv2d shapes or attributes");
  int64_t N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3];
  int64_t O = w.shape[0], Cg = w.shape[1], KH = w.shape[2], KW = w.shape[3];
  int64_t Ho = (H + 2 * pad - KH) / stride + 1, Wo = (W + 2 * pad - KW) / stride + 1;
  if (o.shape != Shape{N, O, Ho, Wo})
    c.bad(cat("result must be ", shapeStr({N, O, Ho, Wo})));
  float *px = c.f32(x), *pw = c.f32(w), *po = c.f32(o);
  int64_t Og = O / groups;
  ThreadPool *pool = &c.pool;
  return [=] {
    pool->parallelFor(N * O, double(Ho * Wo * Cg * KH * KW), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        int64_t n = t / O, oc = t % O, g = oc / Og;
        float *outF = po + (n * O + oc) * Ho * Wo;
        std::vector<double> acc(Ho * Wo, 0.0);
        double *out = acc.data();
        for (int64_t ci = 0; ci < Cg; ++ci) {
          const float *in = px + (n * C + g * Cg + ci) * H * W;
          const float *ker = pw + (oc * Cg + ci) * KH * KW;
          for (int64_t kh = 0; kh < KH; ++kh)
            for (int64_t kw = 0; kw < KW; ++kw) {
              float wv = ker[kh * KW + kw];
              for (int64_t oh = 0; oh < Ho; ++oh) {
                int64_t ih = oh * stride - pad + kh;
                if (ih < 0 || ih >= H)
                  continue;
                for (int64_t ow = 0; ow < Wo; ++ow) {
                  int64_t iw = ow * stride - pad + kw;
                  if (iw >= 0 && iw < W)
                    out[oh * Wo + ow] += double(wv) * in[ih * W + iw];
                }
              }
            }
        }
        for (int64_t i = 0; i < Ho * Wo; ++i)
          outF[i] = static_cast<float>(acc[i]);
      }
    });
  };
}

template <bool Max> Kernel buildPool(const Ctx &c) {
  c.arity(1, 1);
  const Buffer &x = c.in(0), &o = c.out();
  c.needF32(x), c.needF32(o);
  int64_t k = c.attrInt("kernel"), stride = c.attrInt("stride", 1), pad = c.attrInt("padding", 0);
  if (x.shape.size() != 4 || k < 1 || stride < 1 || pad < 0)
    c.bad("inconsistent pooling shapes or attributes");
  int64_t N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3];
  int64_t Ho = (H + 2 * pad - k) / stride + 1, Wo = (W + 2 * pad - k) / stride + 1;
  if (o.shape != Shape{N, C, Ho, Wo})
    c.bad(cat("result must be ", shapeStr({N, C, Ho, Wo})));
  float *px = c.f32(x), *po = c.f32(o);
  return [=] {
    for (int64_t nc = 0; nc < N * C; ++nc)
      for (int64_t oh = 0; oh < Ho; ++oh)
        for (int64_t ow = 0; ow < Wo; ++ow) {
          float acc = Max ? -INFINITY : 0.0f;
          for (int64_t kh = 0; kh < k; ++kh)
            for (int64_t kw = 0; kw < k; ++kw) {
              int64_t ih = oh * stride - pad + kh, iw = ow * stride - pad + kw;
              if (ih < 0 || ih >= H || iw < 0 || iw >= W)
                continue;
              float v = px[nc * H * W + ih * W + iw];
              acc = Max ? std::max(acc, v) : acc + v;
            }
          // Average pooling counts the padding, as PyTorch does by default.
          po[(nc * Ho + oh) * Wo + ow] = Max ? acc : acc / float(k * k);
        }
  };
}


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

//===--------------------------------------------------------------------===//
// Fused elementwise kernels
//===--------------------------------------------------------------------===//

/// A chain of elementwise instructions fused by the compiler: attrs
/// "steps" (each {op, args, and the op's own attributes}; args index the
/// values: the inputs first, then each step's result) and "results" (the
/// values written to the outputs, in order). Inputs broadcast to the
/// output shape; every output has it.
Kernel buildFused(const Ctx &c) {
  if (c.ins.out.empty())
    c.bad("writes at least one output");
  const Shape &shape = c.out(0).shape;
  struct Input {
    float *data;
    std::vector<int64_t> strides; // over `shape`; empty when dense (same shape)
    int64_t count;
  };
  std::vector<Input> inputs;
  for (size_t i = 0; i < c.ins.in.size(); ++i) {
    c.needF32(c.in(i));
    Input in{c.f32(c.in(i)), {}, count(c.in(i).shape)};
    if (c.in(i).shape != shape) {
      auto st = broadcastStrides(c.in(i).shape, shape);
      if (!st)
        c.bad(cat("input ", shapeStr(c.in(i).shape), " does not broadcast to ", shapeStr(shape)));
      in.strides = *st;
    }
    inputs.push_back(std::move(in));
  }
  struct Step {
    int op; // 0 add 1 sub 2 mul 3 div 4 neg 5 scale 6 exp 7 tanh 8 rsqrt 9 relu 10 silu 11 gelu 12 gelu_tanh 13 unary_grad
    int a = 0, b = 0, d = 0;
    float factor = 1;
    ew::Fn fn = ew::Fn::Unknown;
  };
  static const std::map<std::string, int> codes = {
      {"add", 0}, {"sub", 1}, {"mul", 2}, {"div", 3}, {"neg", 4}, {"scale", 5}, {"exp", 6},
      {"tanh", 7}, {"rsqrt", 8}, {"relu", 9}, {"silu", 10}, {"gelu", 11}, {"unary_grad", 13}};
  auto stepsIt = c.ins.attrs.find("steps");
  auto resultsIt = c.ins.attrs.find("results");
  if (stepsIt == c.ins.attrs.end() || !stepsIt->is_array() || resultsIt == c.ins.attrs.end() ||
      !resultsIt->is_array() || resultsIt->size() != c.ins.out.size())
    c.bad("needs 'steps' and one 'results' entry per output");
  std::vector<Step> steps;
  int values = static_cast<int>(inputs.size());
  for (const auto &js : *stepsIt) {
    std::string op = js.value("op", std::string());
    auto code = codes.find(op);
    if (code == codes.end())
      c.bad("cannot fuse op '" + op + "'");
    Step st{code->second};
    if (op == "gelu" && js.value("approximate", false))
      st.op = 12;
    st.factor = static_cast<float>(js.value("factor", 1.0));
    std::vector<int> args;
    for (const auto &a : js.value("args", nlohmann::json::array())) {
      int v = a.get<int>();
      if (v < 0 || v >= values)
        c.bad(cat("step argument ", v, " is not a value defined before it"));
      args.push_back(v);
    }
    size_t want = st.op <= 3 ? 2 : st.op == 13 ? 3 : 1;
    if (args.size() != want)
      c.bad(cat("step '", op, "' takes ", want, " arguments"));
    st.a = args[0], st.b = args.size() > 1 ? args[1] : 0, st.d = args.size() > 2 ? args[2] : 0;
    if (st.op == 13 && (st.fn = ew::parseFn(js.value("fn", std::string()))) == ew::Fn::Unknown)
      c.bad("unary_grad step needs a known 'fn'");
    steps.push_back(st);
    ++values;
  }
  std::vector<int> results;
  std::vector<float *> outs;
  for (size_t k = 0; k < c.ins.out.size(); ++k) {
    int v = (*resultsIt)[k].get<int>();
    if (v < 0 || v >= values)
      c.bad(cat("result ", v, " is not a value"));
    c.needF32(c.out(k));
    if (c.out(k).shape != shape)
      c.bad("every output must have the first output's shape");
    results.push_back(v);
    outs.push_back(c.f32(c.out(k)));
  }
  int64_t n = count(shape);
  std::vector<int64_t> dims(shape.begin(), shape.end());
  ThreadPool *pool = &c.pool;
  return [=] {
    pool->parallelFor(n, 20.0 * double(values), [&](int64_t begin, int64_t end) {
      std::vector<float> v(static_cast<size_t>(values));
      for (int64_t i = begin; i < end; ++i) {
        for (size_t k = 0; k < inputs.size(); ++k) {
          const Input &in = inputs[k];
          int64_t at = i;
          if (!in.strides.empty()) { // broadcast: walk the output index's digits
            at = 0;
            int64_t rest = i;
            for (int d = static_cast<int>(dims.size()) - 1; d >= 0; --d) {
              at += (rest % dims[d]) * in.strides[d];
              rest /= dims[d];
            }
          }
          v[k] = in.data[at];
        }
        size_t at = inputs.size();
        for (const Step &s : steps) {
          float x = v[s.a], y = v[s.b], r = 0;
          switch (s.op) {
          case 0: r = x + y; break;
          case 1: r = x - y; break;
          case 2: r = x * y; break;
          case 3: r = x / y; break;
          case 4: r = -x; break;
          case 5: r = x * s.factor; break;
          case 6: r = std::exp(x); break;
          case 7: r = std::tanh(x); break;
          case 8: r = ew::rsqrt(x); break;
          case 9: r = ew::relu(x); break;
          case 10: r = ew::silu(x); break;
          case 11: r = ew::geluErf(x); break;
          case 12: r = ew::geluTanh(x); break;
          default: r = v[s.d] * ew::derivative(s.fn, x, y); break; // unary_grad(x, y, dy)
          }
          v[at++] = r;
        }
        for (size_t k = 0; k < results.size(); ++k)
          outs[k][i] = v[results[k]];
      }
    });
  };
}

const std::map<std::string, Builder> &builders() {
  static const std::map<std::string, Builder> table = {
      {"add", buildAdd},
      {"sub", buildSub},
      {"mul", buildMul},
      {"div", buildDiv},
      {"gelu", buildGelu},
      {"relu", buildRelu},
      {"silu", buildSilu},
      {"exp", buildExp},
      {"tanh", buildTanh},
      {"rsqrt", buildRsqrt},
      {"neg", buildNeg},
      {"scale", buildScale},
      {"matmul", buildMatmul},
      {"reduce_sum", buildReduce<Reduce::Sum>},
      {"reduce_max", buildReduce<Reduce::Max>},
      {"reduce_mean", buildReduce<Reduce::Mean>},
      {"softmax", buildSoftmax},
      {"layernorm", buildLayerNorm},
      {"rmsnorm", buildRMSNorm},
      {"batchnorm", buildBatchNorm},
      {"embedding", buildEmbedding},
      {"rotary", buildRotary},
      {"attention", buildAttention},
      {"cross_entropy", buildCrossEntropy},
      {"transpose", buildTranspose},
      {"slice", buildSlice},
      {"concat", buildConcat},
      {"broadcast", buildBroadcast},
      {"cast", buildCast},
      {"conv2d", buildConv2D},
      {"max_pool2d", buildPool<true>},
      {"avg_pool2d", buildPool<false>},
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
      {"conv2d_grad_input", buildConv2DGradInput},
      {"conv2d_grad_filter", buildConv2DGradFilter},
      {"max_pool2d_grad", buildPoolGrad<true>},
      {"avg_pool2d_grad", buildPoolGrad<false>},
      {"step_increment", buildStepIncrement},
      {"all_reduce", buildAllReduce},
      {"broadcast_from", buildBroadcast1},
      {"send", buildSend},
      {"event_wait", buildEventWait},
      {"reduce_scatter", buildReduceScatter},
      {"all_gather", buildAllGather},
      {"shard_of", buildShardOf},
      {"recv", buildRecv},
      {"global_norm", buildGlobalNorm},
      {"adamw", buildAdamW},
      {"sgd", buildSGD},
      {"fused", buildFused},
  };
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
    Ctx ctx{ins, rank, arena, pool, where, widened, comm, async};
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
