//===- CpuMatmul.cpp - Matrix products and their epilogues ----------------===//
//
// The batched matrix product, runs of C's rows split over the session's
// threads, each through sgemm (below: OpenBLAS's where the build has it, the
// backend's own loops otherwise; the convolutions use it too), with the
// epilogues the compiler fuses into it (bias, GELU, residual, bias gradient)
// applied to C's f32 values before anything is rounded.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cpu/CpuKernels.h"
#include "runtime/src/Elementwise.h"

#include <algorithm>
#include <mutex>
#include <set>

#ifdef LOOM_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace loom::rt::cpu {

namespace {

/// C = op(A) op(B), then the epilogue (docs/bundle-format.md):
///   "bias"       inputs A, B, bias; C + bias over C's last dimension.
///   "bias_gelu"  inputs A, B, bias; outputs gelu_tanh(C + bias) and, when
///                given, the pre-activation C + bias (kept for the backward).
///   "dgelu"      inputs A, B, pre; C * gelu_tanh'(pre).
///   "residual"   inputs A, B, R; C + R (R of C's shape).
///   "bias_residual"  inputs A, B, bias, R; C + bias + R.
///   "bgrad"      inputs A, B; outputs C and the column sums of B over the
///                product's k dimension (a bias gradient; B is not transposed).
///   "bgrad_residual"  inputs A, B, R; outputs C + R and those column sums.
/// R may be the result itself (a gradient added into its sum in place,
/// loom-accumulate-in-products): the product then adds into it (beta = 1).
/// The epilogue works on C's f32 values before anything is rounded.
Kernel buildMatmul(const Ctx &c) {
  auto found = c.ins.attrs.find("epilogue");
  std::string epilogue = found != c.ins.attrs.end() && found->is_string() ? found->get<std::string>() : "";
  static const std::set<std::string> kEpilogues = {"", "bias", "bias_gelu", "dgelu", "bgrad", "residual",
                                                    "bias_residual", "bgrad_residual"};
  if (!kEpilogues.count(epilogue))
    c.bad("unknown epilogue '" + epilogue +
          "'; the matmul epilogues are: bias, bias_gelu, dgelu, bgrad, residual, bias_residual, bgrad_residual");
  bool withBias = epilogue == "bias" || epilogue == "bias_gelu" || epilogue == "bias_residual";
  bool gelu = epilogue == "bias_gelu", dgelu = epilogue == "dgelu";
  bool bgrad = epilogue == "bgrad" || epilogue == "bgrad_residual";
  bool residual = epilogue == "residual" || epilogue == "bias_residual" || epilogue == "bgrad_residual";
  if (gelu)
    c.arity(3, c.ins.out.size() == 2 ? 2 : 1);
  else if (epilogue == "bias_residual")
    c.arity(4, 1);
  else if (epilogue == "bgrad_residual")
    c.arity(3, 2);
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
  bool accumulate = false; // the residual is the result: add the product into it
  if (residual) {
    const Buffer &r = c.in(c.ins.in.size() - 1);
    c.needF32(r), c.sameShape(r, o);
    accumulate = r.offset == o.offset && r.bytes == o.bytes;
    if (!accumulate && r.offset < o.offset + o.bytes && o.offset < r.offset + r.bytes)
      c.bad("the residual input must be the result or not overlap it");
    if (accumulate && (gelu || dgelu || withBias))
      c.bad("a residual added in place takes no other epilogue than bgrad");
    res = accumulate ? nullptr : c.f32(r);
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
    // C's rows after the product: the epilogue, on f32 values.
    auto epilogueRow = [&](int64_t bi, int64_t i) {
      float *C = po + (bi * m + i) * n;
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
    };
    // Tasks take contiguous runs of (batch, row); each row of C is independent.
    // One run per thread: every sgemm call packs all of B again, which costs
    // a quarter of the product at 64 rows a call.
    pool->parallelFor(batches * m, double(n * k), [&](int64_t begin, int64_t end) {
      // One product per batch's run of rows (single-threaded: the pool's
      // tasks are the threads, so a result does not depend on them).
      for (int64_t t = begin; t < end;) {
        int64_t bi = t / m, i0 = t % m, rows = std::min(end - t, m - i0);
        const float *A = pa + offA[bi], *B = pb + offB[bi];
        sgemm(ta, tb, rows, n, k, ta ? A + i0 : A + i0 * k, ta ? m : k, B, tb ? k : n, accumulate ? 1.0f : 0.0f,
              po + (bi * m + i0) * n, n);
        for (int64_t i = i0; i < i0 + rows; ++i)
          epilogueRow(bi, i);
        t += rows;
      }
    }, 1);
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

} // namespace

void sgemm(bool transA, bool transB, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
           int64_t ldb, float beta, float *C, int64_t ldc) {
  if (M <= 0 || N <= 0)
    return;
  if (K <= 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j)
        C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
#ifdef LOOM_HAVE_OPENBLAS
  // The session's pool splits the work; OpenBLAS's own threads would only
  // compete with it (and with other ranks' pools in the same process).
  static std::once_flag single;
  std::call_once(single, [] { openblas_set_num_threads(1); });
  cblas_sgemm(CblasRowMajor, transA ? CblasTrans : CblasNoTrans, transB ? CblasTrans : CblasNoTrans, blasint(M),
              blasint(N), blasint(K), 1.0f, A, blasint(lda), B, blasint(ldb), beta, C, blasint(ldc));
#else
  // A row of A at a time; each C value adds its k terms in order from zero.
  std::vector<float> arow(K), crow(N);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t k = 0; k < K; ++k)
      arow[k] = transA ? A[k * lda + i] : A[i * lda + k];
    if (transB) {
      for (int64_t j = 0; j < N; ++j) {
        const float *brow = B + j * ldb;
        float acc = 0.0f;
        for (int64_t k = 0; k < K; ++k)
          acc += arow[k] * brow[k];
        crow[j] = acc;
      }
    } else {
      std::fill(crow.begin(), crow.end(), 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        float av = arow[k];
        const float *brow = B + k * ldb;
        for (int64_t j = 0; j < N; ++j)
          crow[j] += av * brow[j];
      }
    }
    float *c = C + i * ldc;
    for (int64_t j = 0; j < N; ++j)
      c[j] = beta == 0.0f ? crow[j] : beta * c[j] + crow[j];
  }
#endif
}

void registerMatmulBuilders(BuilderTable &table) {
  table.insert({
      {"matmul", buildMatmul},
  });
}

} // namespace loom::rt::cpu
