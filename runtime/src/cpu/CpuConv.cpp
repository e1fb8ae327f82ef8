//===- CpuConv.cpp - Convolution, its gradients, and pooling --------------===//
//
// Grouped 2-D convolution and both its gradients as matrix products over each
// image's patches (im2col), NCHW or NHWC (`layout`), and max / average
// pooling; the pooling gradients are in CpuGradients.cpp.
//
// The products are channels last whatever the layout: a patch row holds its
// (kh, kw, ci) values in that order, the filter is the [O, KH*KW*Cg] matrix of
// those rows, and an NCHW image, output gradient or filter goes through a
// channels-last copy. Both layouts therefore make the same sgemm calls on the
// same values and add in the same order: their results are identical (the
// loom-nhwc-layout pass relies on it, test/training/nhwc-layout.test). Work
// is split so that no value depends on the number of threads: the forward and
// the input gradient by image, the filter gradient by fixed runs of images.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cpu/CpuKernels.h"

#include <algorithm>
#include <cmath>
#include <memory>

namespace loom::rt::cpu {

namespace {

/// The most scratch a task may hold for one image's patch matrix.
constexpr double kMaxPatchBytes = 2.0 * (1 << 30);
/// The most the filter gradient's partial sums may take together.
constexpr double kMaxPartialBytes = 1.0 * (1 << 30);

/// A convolution's sizes, checked once when the kernel is built.
struct ConvShape {
  int64_t N = 0, C = 0, H = 0, W = 0;   // image
  int64_t O = 0, Cg = 0, KH = 0, KW = 0; // filter
  int64_t Ho = 0, Wo = 0, stride = 1, pad = 0, groups = 1, Og = 0;
  bool nhwc = false;
  ImageLayout xl, wl, yl;

  int64_t P() const { return Ho * Wo; }        // rows of a patch matrix
  int64_t K() const { return KH * KW * Cg; }   // its columns
  /// 1x1, stride 1, no padding: an NHWC image is its own patch matrix.
  bool pointwise() const { return KH == 1 && KW == 1 && stride == 1 && pad == 0; }
};

/// Checks the shapes of x, w and y (the result or the output gradient) and
/// the attributes; `forward` picks the wording of the errors.
ConvShape convShape(const Ctx &c, const Buffer &x, const Buffer &w, const Buffer &y, bool forward) {
  ConvShape s;
  s.stride = c.attrInt("stride", 1), s.pad = c.attrInt("padding", 0), s.groups = c.attrInt("groups", 1);
  s.nhwc = channelsLast(c);
  std::string inconsistent = forward ? "inconsistent conv2d shapes or attributes" : "inconsistent conv2d gradient shapes";
  if (x.shape.size() != 4 || w.shape.size() != 4 || y.shape.size() != 4 || s.stride < 1 || s.pad < 0 || s.groups < 1)
    c.bad(inconsistent);
  s.xl = imageLayout(x.shape, s.nhwc), s.wl = imageLayout(w.shape, s.nhwc);
  if (s.xl.c != s.wl.c * s.groups || s.wl.n % s.groups || s.wl.c < 1 || s.wl.n < 1)
    c.bad(inconsistent);
  s.N = s.xl.n, s.C = s.xl.c, s.H = s.xl.h, s.W = s.xl.w;
  s.O = s.wl.n, s.Cg = s.wl.c, s.KH = s.wl.h, s.KW = s.wl.w, s.Og = s.O / s.groups;
  if (s.KH < 1 || s.KW < 1 || s.H + 2 * s.pad < s.KH || s.W + 2 * s.pad < s.KW)
    c.bad(forward ? cat("a ", s.KH, "x", s.KW, " filter does not fit a ", s.H, "x", s.W, " image padded by ", s.pad)
                  : inconsistent);
  s.Ho = (s.H + 2 * s.pad - s.KH) / s.stride + 1, s.Wo = (s.W + 2 * s.pad - s.KW) / s.stride + 1;
  Shape expected = imageShape(s.N, s.O, s.Ho, s.Wo, s.nhwc);
  if (y.shape != expected)
    c.bad(forward ? cat("result must be ", shapeStr(expected)) : "the output gradient does not match the convolution");
  s.yl = imageLayout(y.shape, s.nhwc);
  // Each task holds an image's patch matrix, which the buffers' sizes bound
  // but the arena does not (wide padding, many channels): refuse one past
  // kMaxPatchBytes rather than ask the system for it.
  double patchBytes = double(s.P()) * double(s.K()) * sizeof(float);
  if (patchBytes > kMaxPatchBytes)
    fail(LOOM_UNSUPPORTED, c.where, ": the CPU backend computes a convolution through each image's patch matrix, here ",
         s.P(), " pixels x ", s.K(), " taps (", patchBytes / double(1 << 30), " GiB); it takes at most ",
         kMaxPatchBytes / double(1 << 30), " GiB");
  return s;
}

/// Image n's patch matrix for group g, [P, K]: row p = (oh, ow) holds
/// x(n, g*Cg + ci, oh*stride - pad + kh, ow*stride - pad + kw) at column
/// (kh*KW + kw)*Cg + ci, zero in the padding.
void im2col(const ConvShape &s, const float *x, int64_t n, int64_t g, float *col) {
  int64_t K = s.K();
  for (int64_t oh = 0; oh < s.Ho; ++oh)
    for (int64_t ow = 0; ow < s.Wo; ++ow) {
      float *row = col + (oh * s.Wo + ow) * K;
      for (int64_t t = 0; t < s.KH * s.KW; ++t) {
        float *dst = row + t * s.Cg;
        int64_t ih = oh * s.stride - s.pad + t / s.KW, iw = ow * s.stride - s.pad + t % s.KW;
        if (ih < 0 || ih >= s.H || iw < 0 || iw >= s.W) {
          std::fill(dst, dst + s.Cg, 0.0f);
          continue;
        }
        const float *src = x + s.xl.at(n, g * s.Cg, ih, iw);
        for (int64_t ci = 0; ci < s.Cg; ++ci)
          dst[ci] = src[ci * s.xl.sc];
      }
    }
}

/// Image n's patch matrix for group g and its leading dimension: a
/// pointwise NHWC image in place (leading dimension C), im2col into `col`
/// otherwise.
const float *patches(const ConvShape &s, const float *x, int64_t n, int64_t g, std::vector<float> &col,
                     int64_t &ld) {
  if (s.nhwc && s.pointwise()) {
    ld = s.C;
    return x + s.xl.at(n, g * s.Cg, 0, 0);
  }
  ld = s.K();
  col.resize(s.P() * s.K());
  im2col(s, x, n, g, col.data());
  return col.data();
}

/// Adds image n's patch-matrix gradient (all K columns, group g) into dx.
void col2imAdd(const ConvShape &s, const float *dcol, int64_t n, int64_t g, float *dx) {
  int64_t K = s.K();
  for (int64_t oh = 0; oh < s.Ho; ++oh)
    for (int64_t ow = 0; ow < s.Wo; ++ow) {
      const float *row = dcol + (oh * s.Wo + ow) * K;
      for (int64_t t = 0; t < s.KH * s.KW; ++t) {
        int64_t ih = oh * s.stride - s.pad + t / s.KW, iw = ow * s.stride - s.pad + t % s.KW;
        if (ih < 0 || ih >= s.H || iw < 0 || iw >= s.W)
          continue;
        float *dst = dx + s.xl.at(n, g * s.Cg, ih, iw);
        for (int64_t ci = 0; ci < s.Cg; ++ci)
          dst[ci * s.xl.sc] += row[t * s.Cg + ci];
      }
    }
}

/// Image n's [P, Og] block of y (the result or its gradient) for group g:
/// NHWC in place (leading dimension O), NCHW copied channels last into tmp.
const float *rowsOf(const ConvShape &s, const float *y, int64_t n, int64_t g, std::vector<float> &tmp,
                    int64_t &ld) {
  if (s.nhwc) {
    ld = s.O;
    return y + s.yl.at(n, g * s.Og, 0, 0);
  }
  ld = s.Og;
  tmp.resize(s.P() * s.Og);
  for (int64_t j = 0; j < s.Og; ++j) {
    const float *src = y + s.yl.at(n, g * s.Og + j, 0, 0);
    for (int64_t p = 0; p < s.P(); ++p)
      tmp[p * s.Og + j] = src[p];
  }
  return tmp.data();
}

/// The filter as the [O, K] matrix of patch rows: NHWC's own storage, an
/// NCHW filter copied into `buf`.
const float *filterRows(const ConvShape &s, const float *w, std::vector<float> &buf) {
  if (s.nhwc)
    return w;
  buf.resize(s.O * s.K());
  for (int64_t oc = 0; oc < s.O; ++oc)
    for (int64_t ci = 0; ci < s.Cg; ++ci)
      for (int64_t t = 0; t < s.KH * s.KW; ++t)
        buf[oc * s.K() + t * s.Cg + ci] = w[s.wl.at(oc, ci, t / s.KW, t % s.KW)];
  return buf.data();
}

Kernel buildConv2D(const Ctx &c) {
  c.arity(2, 1);
  const Buffer &x = c.in(0), &w = c.in(1), &o = c.out();
  c.needF32(x), c.needF32(w), c.needF32(o);
  ConvShape s = convShape(c, x, w, o, true);
  float *px = c.f32(x), *pw = c.f32(w), *po = c.f32(o);
  ThreadPool *pool = &c.pool;
  return [=] {
    std::vector<float> wbuf;
    const float *wr = filterRows(s, pw, wbuf);
    int64_t P = s.P(), K = s.K(), Og = s.Og;
    pool->parallelFor(s.N, double(P * K * s.O), [&](int64_t n0, int64_t n1) {
      std::vector<float> col, out;
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t g = 0; g < s.groups; ++g) {
          int64_t lda = 0;
          const float *a = patches(s, px, n, g, col, lda);
          if (s.nhwc) {
            sgemm(false, true, P, Og, K, a, lda, wr + g * Og * K, K, 0.0f, po + s.yl.at(n, g * Og, 0, 0), s.O);
            continue;
          }
          out.resize(P * Og);
          sgemm(false, true, P, Og, K, a, lda, wr + g * Og * K, K, 0.0f, out.data(), Og);
          for (int64_t j = 0; j < Og; ++j) {
            float *dst = po + s.yl.at(n, g * Og + j, 0, 0);
            for (int64_t p = 0; p < P; ++p)
              dst[p] = out[p * Og + j];
          }
        }
    });
  };
}

/// grad_input: (dy, w) -> dx = dy's patch-matrix gradient folded back
/// (col2im); a pointwise NHWC convolution writes dy * w into dx directly.
Kernel buildConv2DGradInput(const Ctx &c) {
  c.arity(2, 1);
  const Buffer &dy = c.in(0), &w = c.in(1), &dx = c.out();
  c.needF32(dy), c.needF32(w), c.needF32(dx);
  ConvShape s = convShape(c, dx, w, dy, false);
  float *pdy = c.f32(dy), *pw = c.f32(w), *pdx = c.f32(dx);
  ThreadPool *pool = &c.pool;
  return [=] {
    std::vector<float> wbuf;
    const float *wr = filterRows(s, pw, wbuf);
    int64_t P = s.P(), K = s.K(), Og = s.Og;
    bool direct = s.nhwc && s.pointwise();
    pool->parallelFor(s.N, double(P * K * s.O), [&](int64_t n0, int64_t n1) {
      std::vector<float> dcol, tmp;
      for (int64_t n = n0; n < n1; ++n) {
        if (!direct)
          std::fill(pdx + n * s.xl.sn, pdx + (n + 1) * s.xl.sn, 0.0f);
        for (int64_t g = 0; g < s.groups; ++g) {
          int64_t ldy = 0;
          const float *a = rowsOf(s, pdy, n, g, tmp, ldy);
          if (direct) {
            sgemm(false, false, P, K, Og, a, ldy, wr + g * Og * K, K, 0.0f, pdx + s.xl.at(n, g * s.Cg, 0, 0), s.C);
            continue;
          }
          dcol.resize(P * K);
          sgemm(false, false, P, K, Og, a, ldy, wr + g * Og * K, K, 0.0f, dcol.data(), K);
          col2imAdd(s, dcol.data(), n, g, pdx);
        }
      }
    });
  };
}

/// The filter gradient is summed over the images in at most this many runs
/// (fewer where their partial sums would pass kMaxPartialBytes),
/// one task each, into partial sums added in order afterwards: the same
/// products whatever the threads (OpenBLAS does not give the same bits for a
/// column of the result when the product is split by columns).
constexpr int64_t kFilterGradientRuns = 16;

/// grad_filter: (x, dy) -> dw, each group's [Og, K] = sum over the images of
/// dy_n^T * patches_n.
Kernel buildConv2DGradFilter(const Ctx &c) {
  c.arity(2, 1);
  const Buffer &x = c.in(0), &dy = c.in(1), &dw = c.out();
  c.needF32(x), c.needF32(dy), c.needF32(dw);
  ConvShape s = convShape(c, x, dw, dy, false);
  float *px = c.f32(x), *pdy = c.f32(dy), *pw = c.f32(dw);
  ThreadPool *pool = &c.pool;
  return [=] {
    int64_t P = s.P(), K = s.K(), Og = s.Og, size = s.O * K;
    // Fewer runs where the partial sums would be large (a size, not the threads, decides).
    int64_t fit = std::max<int64_t>(1, int64_t(kMaxPartialBytes / (double(size) * sizeof(float))));
    int64_t runs = std::min({s.N, kFilterGradientRuns, fit});
    // Run 0 sums into the [O, K] patch rows (NHWC's storage, NCHW's through a
    // copy), the others into `partial`; each run's first product overwrites
    // its sums, so they are not cleared first (up to 1 GiB a call).
    std::unique_ptr<float[]> sums(new float[(s.nhwc ? 0 : size) + std::max<int64_t>(runs - 1, 0) * size]);
    float *rows = s.nhwc ? pw : sums.get(), *partial = sums.get() + (s.nhwc ? 0 : size);
    if (runs == 0)
      std::fill(rows, rows + size, 0.0f);
    pool->parallelFor(runs, double(s.N / std::max<int64_t>(runs, 1) * P * K * s.O), [&](int64_t r0, int64_t r1) {
      std::vector<float> col, tmp;
      for (int64_t r = r0; r < r1; ++r) {
        float *dst = r == 0 ? rows : partial + (r - 1) * size;
        for (int64_t n = s.N * r / runs; n < s.N * (r + 1) / runs; ++n)
          for (int64_t g = 0; g < s.groups; ++g) {
            int64_t ldy = 0;
            const float *a = rowsOf(s, pdy, n, g, tmp, ldy);
            int64_t ldb = 0;
            const float *b = patches(s, px, n, g, col, ldb);
            bool first = n == s.N * r / runs;
            sgemm(true, false, Og, K, P, a, ldy, b, ldb, first ? 0.0f : 1.0f, dst + g * Og * K, K);
          }
      }
    }, 1);
    if (runs > 1)
      pool->parallelFor(size, double(runs), [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          float acc = rows[i];
          for (int64_t r = 1; r < runs; ++r)
            acc += partial[(r - 1) * size + i];
          rows[i] = acc;
        }
      });
    if (!s.nhwc)
      for (int64_t oc = 0; oc < s.O; ++oc)
        for (int64_t ci = 0; ci < s.Cg; ++ci)
          for (int64_t t = 0; t < s.KH * s.KW; ++t)
            pw[s.wl.at(oc, ci, t / s.KW, t % s.KW)] = rows[oc * K + t * s.Cg + ci];
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
  ThreadPool *pool = &c.pool;
  return [=] {
    pool->parallelFor(N * C, double(Ho * Wo * k * k), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        int64_t n = t / C, ch = t % C;
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
      }
    });
  };
}

} // namespace

void registerConvBuilders(BuilderTable &table) {
  table.insert({
      {"conv2d", buildConv2D},
      {"conv2d_grad_input", buildConv2DGradInput},
      {"conv2d_grad_filter", buildConv2DGradFilter},
      {"max_pool2d", buildPool<true>},
      {"avg_pool2d", buildPool<false>},
  });
}

} // namespace loom::rt::cpu
