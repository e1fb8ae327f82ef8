//===- CpuShapes.cpp - Shape manipulation and casts -----------------------===//
//
// Transpose, slice, concatenation and broadcast copy bytes, so they run on any
// dtype (bf16 included, without widening); cast converts between dtypes.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cpu/CpuKernels.h"

#include <cstring>

namespace loom::rt::cpu {

namespace {

/// Copies runs of `run` elements (bytes per element `es`) from src + from[r]
/// to dst + to[r] (offsets in elements), the runs over the threads.
Kernel copyRuns(const Ctx &c, char *dst, const char *src, std::vector<int64_t> to, std::vector<int64_t> from,
                int64_t run, size_t es) {
  ThreadPool *pool = &c.pool;
  return [=] {
    pool->parallelFor(int64_t(to.size()), double(run * es) / 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        std::memcpy(dst + to[r] * es, src + from[r] * es, run * es);
    });
  };
}

/// Copies `in` (bytes per element `es`) read through strides `st` into `out`
/// laid out densely in `shape`.
Kernel stridedCopy(const Ctx &c, const Buffer &in, const Buffer &out, Shape shape,
                   std::vector<int64_t> st, int64_t base) {
  size_t es = dtypeSize(in.dtype);
  if (in.dtype != out.dtype)
    c.bad("input and result must have the same dtype");
  char *pi = c.arena + in.offset, *po = c.arena + out.offset;
  std::vector<int64_t> zero(shape.size(), 0);
  if (!shape.empty() && st.back() == 1 && shape.back() > 1) {
    // The last dimension is contiguous in both (a slice, a broadcast row):
    // whole rows at a time.
    Shape rows(shape.begin(), shape.end() - 1);
    std::vector<int64_t> rowStrides(st.begin(), st.end() - 1), to, from;
    forEachBroadcast(rows, rowStrides, std::vector<int64_t>(rows.size(), 0), [&](int64_t o, int64_t i, int64_t) {
      to.push_back(o * shape.back());
      from.push_back(base + i);
    });
    return copyRuns(c, po, pi, to, from, shape.back(), es);
  }
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
    // x's rows are runs of its last dimension in the result too.
    Shape rows(x.shape.begin(), x.shape.end() - 1);
    std::vector<int64_t> rowStrides(ost.begin(), ost.end() - 1), to, from;
    int64_t run = x.shape.back(), base = offset * ost[axis];
    forEachBroadcast(rows, rowStrides, std::vector<int64_t>(rows.size(), 0), [&](int64_t xi, int64_t oi, int64_t) {
      to.push_back(base + oi);
      from.push_back(xi * run);
    });
    parts.push_back(copyRuns(c, c.arena + o.offset, c.arena + x.offset, to, from, run, dtypeSize(x.dtype)));
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

} // namespace

void registerShapeBuilders(BuilderTable &table) {
  table.insert({
      {"transpose", buildTranspose},
      {"slice", buildSlice},
      {"concat", buildConcat},
      {"broadcast", buildBroadcast},
      {"cast", buildCast},
  });
}

} // namespace loom::rt::cpu
