//===- CpuKernels.h - What the CPU backend's kernel files share -*- C++ -*-===//
//
// The CPU backend is a folder of kernel files, one per family of instructions
// (CpuElementwise.cpp, CpuMatmul.cpp, ...). Each registers its instruction
// builders into the one table that CpuBackend.cpp builds, and shares through
// this header the context a builder sees, the index helpers, and the few
// pieces that one family's kernels reuse from another's (the attention
// backward and the vocabulary statistics, for the gradients).
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_CPU_CPUKERNELS_H
#define LOOM_RUNTIME_CPU_CPUKERNELS_H

#include "runtime/src/cpu/CpuBackend.h"
#include "loom/rt/Error.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace loom::rt::cpu {

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

/// Marks a kernel's loop function to be compiled twice, for AVX2 and for the
/// baseline, the loader choosing by the CPU: the baseline (SSE2) vectorises
/// half as wide. AVX2 without FMA, so the operations and results are the same.
/// (The loader's ifunc is ELF's; ASan starts after it runs.)
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__)
#define LOOM_AVX2_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define LOOM_AVX2_CLONES
#endif

/// C[M, N] = op(A) op(B) + beta C on row-major f32 matrices (op transposes
/// where asked), on the calling thread: OpenBLAS's sgemm where the build has
/// it (kept to one thread: the session's pool splits the work), loops adding
/// over k in order otherwise. CpuMatmul.cpp.
void sgemm(bool transA, bool transB, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
           int64_t ldb, float beta, float *C, int64_t ldc);

using Kernel = std::function<void()>;
using Builder = Kernel (*)(const Ctx &);

/// Instruction name -> builder; CpuBackend.cpp fills it once from the
/// register*Builders functions below.
using BuilderTable = std::map<std::string, Builder>;

void registerElementwiseBuilders(BuilderTable &table);
void registerMatmulBuilders(BuilderTable &table);
void registerNormBuilders(BuilderTable &table);
void registerTransformerBuilders(BuilderTable &table);
void registerServeBuilders(BuilderTable &table);
void registerShapeBuilders(BuilderTable &table);
void registerConvBuilders(BuilderTable &table);
void registerGradientBuilders(BuilderTable &table);
void registerOptimizerBuilders(BuilderTable &table);
void registerCommunicationBuilders(BuilderTable &table);
void registerFusedBuilders(BuilderTable &table);

inline int64_t count(const Shape &s) { return numElements(s).value_or(0); }

/// The sum of term(j) over j in [0, n), in double, as four interleaved sums:
/// one chain of dependent additions waits on each. The order is fixed, so
/// the result does not depend on the threads.
template <typename Term> double sumInterleaved(int64_t n, Term term) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    s0 += term(j);
    s1 += term(j + 1);
    s2 += term(j + 2);
    s3 += term(j + 3);
  }
  for (; j < n; ++j)
    s0 += term(j);
  return (s0 + s1) + (s2 + s3);
}

inline std::vector<int64_t> stridesOf(const Shape &s) {
  std::vector<int64_t> st(s.size(), 1);
  for (int i = static_cast<int>(s.size()) - 2; i >= 0; --i)
    st[i] = st[i + 1] * s[i + 1];
  return st;
}

/// Strides that read `in` broadcast to `out` (0 along broadcast dimensions);
/// empty when `in` does not broadcast to `out`.
inline std::optional<std::vector<int64_t>> broadcastStrides(const Shape &in, const Shape &out) {
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

/// Splits a shape at `axis` into (outer, axis extent, inner).
inline void splitAt(const Shape &s, int64_t axis, int64_t &outer, int64_t &len, int64_t &inner) {
  outer = 1, inner = 1, len = s[axis];
  for (int64_t d = 0; d < axis; ++d)
    outer *= s[d];
  for (size_t d = axis + 1; d < s.size(); ++d)
    inner *= s[d];
}

inline Communicator *needComm(const Ctx &c) {
  if (!c.comm)
    fail(LOOM_UNSUPPORTED, c.where, ": ", c.ins.op, " needs the other ranks; run multi-rank "
         "bundles with loom-run, which starts every rank");
  return c.comm;
}

/// The global ranks of the group an instruction names (attribute "group").
inline std::vector<int> groupOf(const Ctx &c, const std::string &name) {
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

inline std::string attrString(const Ctx &c, const char *name, const std::string &dflt) {
  auto it = c.ins.attrs.find(name);
  if (it == c.ins.attrs.end())
    return dflt;
  if (!it->is_string())
    c.bad(cat("attribute '", name, "' must be a string"));
  return it->get<std::string>();
}

/// An image-like tensor's sizes as [N, C, H, W] and the element strides of
/// those dimensions: NCHW, or channels last (NHWC) for the instructions that
/// carry `layout = "nhwc"`. Filters read the same way: OIHW, or OHWI.
struct ImageLayout {
  int64_t n = 0, c = 0, h = 0, w = 0;
  int64_t sn = 0, sc = 0, sh = 0, sw = 0;
  int64_t at(int64_t i, int64_t ch, int64_t y, int64_t x) const { return i * sn + ch * sc + y * sh + x * sw; }
};

/// Whether the instruction's `layout` says channels last; anything but
/// nchw or nhwc is an invalid bundle.
inline bool channelsLast(const Ctx &c) {
  std::string layout = attrString(c, "layout", "nchw");
  if (layout != "nchw" && layout != "nhwc")
    c.bad(cat("layout must be nchw or nhwc, got '", layout, "'"));
  return layout == "nhwc";
}

/// The [N, C, H, W] view of a rank-4 `shape` stored NCHW or NHWC.
inline ImageLayout imageLayout(const Shape &shape, bool nhwc) {
  ImageLayout l;
  if (nhwc) {
    l.n = shape[0], l.h = shape[1], l.w = shape[2], l.c = shape[3];
    l.sc = 1, l.sw = l.c, l.sh = l.w * l.c, l.sn = l.h * l.w * l.c;
  } else {
    l.n = shape[0], l.c = shape[1], l.h = shape[2], l.w = shape[3];
    l.sw = 1, l.sh = l.w, l.sc = l.h * l.w, l.sn = l.c * l.h * l.w;
  }
  return l;
}

/// The sizes [N, C, H, W] as a stored shape of that layout.
inline Shape imageShape(int64_t n, int64_t c, int64_t h, int64_t w, bool nhwc) {
  return nhwc ? Shape{n, h, w, c} : Shape{n, c, h, w};
}

/// A batch norm's input as [N, C, inner] (inner: the positions of an
/// image): the channel is dimension 1, or the last with `layout = "nhwc"`.
struct BatchNormLayout {
  int64_t n = 0, ch = 0, inner = 0;
  int64_t sc = 0, sj = 0; // strides of the channel and the position; N's is ch * inner
  int64_t at(int64_t i, int64_t cc, int64_t j) const { return i * ch * inner + cc * sc + j * sj; }
};

/// Whether a batch norm (or its gradient) has ReLU fused after it
/// (`activation = "relu"`, loom-fuse-elementwise's bn + relu).
inline bool batchNormRelu(const Ctx &c) {
  std::string act = attrString(c, "activation", "");
  if (!act.empty() && act != "relu")
    c.bad(cat("activation must be relu, got '", act, "'"));
  return act == "relu";
}

inline BatchNormLayout batchNormLayout(const Ctx &c, const Shape &x) {
  if (x.size() < 2)
    c.bad("input must be [N, C, ...]");
  bool nhwc = channelsLast(c);
  BatchNormLayout l;
  l.n = x[0], l.ch = nhwc ? x.back() : x[1];
  l.inner = count(x) / std::max<int64_t>(l.n * l.ch, 1);
  l.sc = nhwc ? 1 : l.inner, l.sj = nhwc ? l.ch : 1;
  return l;
}

/// Where this rank's slice of a vocabulary split over `vocab_group` starts
/// (0 and the whole group size 1 when the attribute is absent).
inline std::pair<int64_t, int64_t> vocabSlice(const Ctx &c, int64_t localRows) {
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

inline void checkIndices(const std::string &where, const std::string &what, IndexReader ids, int64_t n,
                         int64_t limit) {
  for (int64_t i = 0; i < n; ++i) {
    int64_t v = ids(i);
    if (v < 0 || v >= limit)
      fail(LOOM_INVALID_ARGUMENT, where, ": ", what, " ", v, " at position ", i,
           " is outside [0, ", limit, ")");
  }
}

/// Attention's sizes: B sequences of S queries and T keys, `heads` query
/// heads over kvHeads key/value heads of D each.
struct AttentionDims {
  int64_t B, S, T, heads, kvHeads, D;
  bool causal;
  float scale;
};

/// dq, dk, dv of attentionForward's operands, given dO.
void attentionBackward(ThreadPool &threads, const AttentionDims &d, const float *pq, const float *pk,
                       const float *pv, const float *pdo, float *dq, float *dk, float *dv);

/// Attention reading q, k and v as columns of one tensor x [B, S, W]
/// (attrs "packed": the three starts along W; self-attention, T = S), and
/// its gradient writing dq|dk|dv into dx of x's shape (zero elsewhere): the
/// compiler's form of a fused q|k|v projection, without the slices and the
/// concatenation of their gradients.
Kernel buildPackedAttention(const Ctx &c, bool grad);

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
  /// The loss, the mean over the rows, from the group's statistics.
  float meanLoss() const {
    double total = 0;
    for (int64_t r = 0; r < rows; ++r)
      total += std::log(double(sum[r])) + max[r] - target[r];
    return static_cast<float>(total / std::max<int64_t>(rows, 1));
  }
  /// Each row's part of the gradient (its softmax less the one-hot target,
  /// times `scale`) into `out`, which may be `logits` itself.
  void gradient(const float *logits, float *out, float scale, IndexReader read) const {
    for (int64_t r = 0; r < rows; ++r) {
      const float *row = logits + r * V;
      float *o = out + r * V;
      for (int64_t j = 0; j < V; ++j)
        o[j] = static_cast<float>(std::exp(double(row[j]) - max[r]) / sum[r]) * scale;
      int64_t t = read(r) - start;
      if (t >= 0 && t < V)
        o[t] -= scale;
    }
  }
  Communicator *comm;
  std::vector<int> group;
  int rank;
  int64_t V, rows, start;
  std::vector<float> max, both;
  const float *sum = nullptr, *target = nullptr;
};

} // namespace loom::rt::cpu

#endif
