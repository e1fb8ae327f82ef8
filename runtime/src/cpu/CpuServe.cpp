//===- CpuServe.cpp - The paged key/value cache: write and attend ---------===//
//
// A serving bundle's layers keep their keys and values in caches of
// [blocks x block_size, kv heads x head dim] rows. kv_write copies the
// step's rows into the cache rows the scheduler gave each token;
// paged_attention lets each token attend to its sequence's cached keys at
// positions 0..its own, finding position p in block table[p / block_size].
// Both read the caches in their own dtype (f32 or bf16), never widened: a
// cache is far larger than one step's rows.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cpu/CpuKernels.h"

#include <cstring>

namespace loom::rt::cpu {

namespace {

Kernel buildKvWrite(const Ctx &c) {
  c.arity(3, 2);
  const Buffer &k = c.in(0), &v = c.in(1), &slots = c.in(2), &kc = c.out(0), &vc = c.out(1);
  c.needInt(slots);
  if (k.shape != v.shape || k.shape.size() != 3 || kc.shape != vc.shape || kc.shape.size() != 2 ||
      kc.shape[1] != k.shape[2] || count(slots.shape) != k.shape[0] * k.shape[1] || k.dtype != kc.dtype ||
      v.dtype != vc.dtype)
    c.bad(cat("expects k, v [1, N, W], slots [N] and caches [rows, W] of the same dtype; got k ",
              shapeStr(k.shape), " ", dtypeName(k.dtype), ", cache ", shapeStr(kc.shape), " ",
              dtypeName(kc.dtype), ", slots ", shapeStr(slots.shape)));
  int64_t n = count(slots.shape), rows = kc.shape[0];
  size_t rowBytes = size_t(kc.shape[1]) * dtypeSize(kc.dtype);
  IndexReader slot{c.arena + slots.offset, slots.dtype == LOOM_I64};
  const char *pk = c.ptr<char>(k), *pv = c.ptr<char>(v);
  char *pkc = c.ptr<char>(kc), *pvc = c.ptr<char>(vc);
  std::string where = c.where;
  return [=] {
    for (int64_t i = 0; i < n; ++i) {
      int64_t s = slot(i);
      if (s < 0)
        continue; // a padding token
      if (s >= rows)
        fail(LOOM_INVALID_ARGUMENT, where, ": cache slot ", s, " of token ", i, " is outside [0, ", rows, ")");
      std::memcpy(pkc + s * rowBytes, pk + i * rowBytes, rowBytes);
      std::memcpy(pvc + s * rowBytes, pv + i * rowBytes, rowBytes);
    }
  };
}

/// Element e of a cache row, as f32.
inline float cacheAt(const char *row, int64_t e, bool bf16) {
  return bf16 ? bf16ToFloat(reinterpret_cast<const uint16_t *>(row)[e]) : reinterpret_cast<const float *>(row)[e];
}

Kernel buildPagedAttention(const Ctx &c) {
  c.arity(5, 1);
  const Buffer &q = c.in(0), &kc = c.in(1), &vc = c.in(2), &pos = c.in(3), &table = c.in(4), &o = c.out();
  c.needF32(q), c.needF32(o), c.needInt(pos), c.needInt(table);
  int64_t heads = c.attrInt("num_heads"), kvHeads = c.attrInt("num_kv_heads", heads);
  int64_t blockSize = c.attrInt("block_size");
  if (q.shape.size() != 3 || o.shape != q.shape || kc.shape != vc.shape || kc.shape.size() != 2 ||
      kc.dtype != vc.dtype || (kc.dtype != LOOM_F32 && kc.dtype != LOOM_BF16) || heads < 1 || kvHeads < 1 ||
      heads % kvHeads || q.shape[2] % heads || kc.shape[1] != q.shape[2] / heads * kvHeads || blockSize < 1 ||
      kc.shape[0] % blockSize || count(pos.shape) != q.shape[0] * q.shape[1] || table.shape.size() != 2 ||
      table.shape[0] != q.shape[0] * q.shape[1])
    c.bad(cat("inconsistent paged attention: q ", shapeStr(q.shape), ", caches ", shapeStr(kc.shape), " ",
              dtypeName(kc.dtype), ", positions ", shapeStr(pos.shape), ", block table ", shapeStr(table.shape),
              ", ", heads, " heads, ", kvHeads, " kv heads, blocks of ", blockSize));
  int64_t n = q.shape[0] * q.shape[1], D = q.shape[2] / heads, W = kc.shape[1];
  int64_t blocks = kc.shape[0] / blockSize, perSeq = table.shape[1], group = heads / kvHeads;
  float scale = static_cast<float>(c.attrFloat("scale", 1.0 / std::sqrt(double(D))));
  bool bf16 = kc.dtype == LOOM_BF16;
  size_t rowBytes = size_t(W) * dtypeSize(kc.dtype);
  IndexReader position{c.arena + pos.offset, pos.dtype == LOOM_I64};
  IndexReader blockOf{c.arena + table.offset, table.dtype == LOOM_I64};
  const float *pq = c.f32(q);
  float *po = c.f32(o);
  const char *pk = c.ptr<char>(kc), *pv = c.ptr<char>(vc);
  ThreadPool *pool = &c.pool;
  std::string where = c.where;
  return [=] {
    for (int64_t i = 0; i < n; ++i) {
      int64_t p = position(i);
      if (p < 0 || p >= perSeq * blockSize)
        fail(LOOM_INVALID_ARGUMENT, where, ": position ", p, " of token ", i, " is outside [0, ",
             perSeq * blockSize, ")");
      for (int64_t b = 0; b <= p / blockSize; ++b)
        if (int64_t id = blockOf(i * perSeq + b); id < 0 || id >= blocks)
          fail(LOOM_INVALID_ARGUMENT, where, ": block table entry ", id, " of token ", i, " is outside [0, ",
               blocks, ")");
    }
    pool->parallelFor(n * heads, double(4 * D * 64), [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t t = begin; t < end; ++t) {
        int64_t i = t / heads, h = t % heads, kh = h / group, keys = position(i) + 1;
        const float *qrow = pq + i * heads * D + h * D;
        auto row = [&](const char *cache, int64_t p) {
          return cache + (blockOf(i * perSeq + p / blockSize) * blockSize + p % blockSize) * rowBytes;
        };
        scores.resize(size_t(keys));
        float mx = -INFINITY;
        for (int64_t p = 0; p < keys; ++p) {
          const char *krow = row(pk, p);
          float acc = 0;
          for (int64_t d = 0; d < D; ++d)
            acc += qrow[d] * cacheAt(krow, kh * D + d, bf16);
          scores[p] = acc * scale;
          mx = std::max(mx, scores[p]);
        }
        double sum = 0;
        for (int64_t p = 0; p < keys; ++p)
          sum += (scores[p] = std::exp(scores[p] - mx));
        float *orow = po + i * heads * D + h * D;
        std::fill(orow, orow + D, 0.0f);
        for (int64_t p = 0; p < keys; ++p) {
          float w = static_cast<float>(scores[p] / sum);
          const char *vrow = row(pv, p);
          for (int64_t d = 0; d < D; ++d)
            orow[d] += w * cacheAt(vrow, kh * D + d, bf16);
        }
      }
    });
  };
}

} // namespace

void registerServeBuilders(BuilderTable &table) {
  table.insert({
      {"kv_write", buildKvWrite},
      {"paged_attention", buildPagedAttention},
  });
}

} // namespace loom::rt::cpu
