//===- FlashAttention.cu - Fused bf16 attention on tensor cores -----------===//
//
// Fragment layouts are those of PTX's mma.m16n8k16 (row.col, bf16 -> f32):
// with g = lane / 4 and c = lane % 4, a thread holds
//   A (16x16): a0 = (g, 2c..2c+1), a1 = (g+8, 2c..), a2 = (g, 2c+8..), a3 = (g+8, 2c+8..)
//   B (16x8):  b0 = (k 2c..2c+1, n g), b1 = (k 2c+8..2c+9, n g)
//   C (16x8):  c0, c1 = (g, 2c), (g, 2c+1); c2, c3 = (g+8, 2c), (g+8, 2c+1)
// so two adjacent C tiles of a score block, rounded to bf16, are exactly the
// A fragment of the next product (no shuffle through shared memory). Tiles
// sit row-major in shared memory (rows padded by 8 elements, so ldmatrix's
// eight 16-byte rows fall in distinct banks) and fragments come out with
// ldmatrix, transposing (.trans) where a B operand has k along its rows.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/FlashAttention.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

namespace loom::rt::flash {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kWarps = 4, kThreads = kWarps * 32;
constexpr int kRows = 64; // queries per forward block
constexpr int kCols = 64; // keys per forward step

__device__ inline void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
               "{%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ inline uint32_t pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}
/// The A fragment (16 x 16) made of C tiles t[2kk] and t[2kk+1], rounded to
/// bf16: the layouts line up, so this is a conversion, not a shuffle.
template <int N> __device__ inline void toA(uint32_t a[4], const float (&t)[N][4], int kk) {
  a[0] = pack(t[2 * kk][0], t[2 * kk][1]);
  a[1] = pack(t[2 * kk][2], t[2 * kk][3]);
  a[2] = pack(t[2 * kk + 1][0], t[2 * kk + 1][1]);
  a[3] = pack(t[2 * kk + 1][2], t[2 * kk + 1][3]);
}
__device__ inline uint32_t ld32(const bf16 *p) { return *reinterpret_cast<const uint32_t *>(p); }
__device__ inline void st32(bf16 *p, uint32_t v) { *reinterpret_cast<uint32_t *>(p) = v; }
__device__ inline void ldsm(uint32_t r[4], const bf16 *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
}
__device__ inline void ldsmT(uint32_t r[4], const bf16 *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
}
/// The A fragment of rows [r0, r0+16), columns [c0, c0+16) of a row-major tile.
__device__ inline void loadA(uint32_t a[4], const bf16 *tile, int ld, int r0, int c0) {
  int lane = threadIdx.x % 32, m = lane / 8;
  ldsm(a, tile + (r0 + (m & 1) * 8 + lane % 8) * ld + c0 + (m >> 1) * 8);
}
/// B fragments for n-tiles [n0, n0+8) (b[0], b[1]) and [n0+8, n0+16) (b[2],
/// b[3]), k in [k0, k0+16), of a tile stored [n][k] (keys by features: B = tile^T).
__device__ inline void loadBt(uint32_t b[4], const bf16 *tile, int ld, int n0, int k0) {
  int lane = threadIdx.x % 32, m = lane / 8;
  ldsm(b, tile + (n0 + (m >> 1) * 8 + lane % 8) * ld + k0 + (m & 1) * 8);
}
/// The same from a tile stored [k][n] (B itself row-major), transposing.
__device__ inline void loadB(uint32_t b[4], const bf16 *tile, int ld, int k0, int n0) {
  int lane = threadIdx.x % 32, m = lane / 8;
  ldsmT(b, tile + (k0 + (m & 1) * 8 + lane % 8) * ld + n0 + (m >> 1) * 8);
}

/// cp.async copies global -> shared (`valid` false: zeros), their commit
/// and wait (for all but the newest N groups).
__device__ inline void cpAsync16(void *dst, const void *src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(valid ? 16 : 0));
}
__device__ inline void cpAsync4(void *dst, const void *src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(valid ? 4 : 0));
}
__device__ inline void cpCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ inline void cpWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
/// Copies rows [row0, row0 + rows) of a [*, D] head slice (row stride `ld`
/// elements) into shared memory, row-major with stride D + 8, with cp.async
/// (16 bytes a copy, rows past `limit` zero-filled), so the next tile streams
/// in while the warps compute on the current one; the caller commits the
/// group and waits for it.
template <int D, int Threads = kThreads>
__device__ void stageAsync(const bf16 *src, int64_t ld, int row0, int limit, int rows, bf16 *dst) {
  constexpr int chunks = D / 8;
  for (int idx = threadIdx.x; idx < rows * chunks; idx += Threads) {
    int r = idx / chunks, col = (idx % chunks) * 8;
    bool valid = row0 + r < limit;
    cpAsync16(dst + r * (D + 8) + col, valid ? src + int64_t(row0 + r) * ld + col : src, valid);
  }
}

struct Shape {
  int s, t, heads, kvHeads;
  int64_t ldq, ldk;   // row strides of Q and of K, V (inputs)
  int64_t ldo, lddk;  // of O and dO; of the dK, dV results
  int64_t ldqw;       // of the f32 dQ accumulator (heads * D)
  float scaleLog2; // softmax scale times log2(e): exp(x * scale) = exp2(x * scaleLog2)
  bool causal;
};

/// One block: 64 queries of one (batch, head), a warp per 16 of them.
template <int D>
__global__ void __launch_bounds__(kThreads) forwardKernel(const bf16 *Q, const bf16 *K, const bf16 *V, bf16 *O,
                                                          float *lse, Shape sh) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int ld = D + 8;
  // Two stages of [kCols][ld] K and V tiles: the next streams in (cp.async)
  // while the current one is used.
  bf16 *Kbuf = reinterpret_cast<bf16 *>(smem), *Vbuf = Kbuf + 2 * kCols * ld;
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  // Causal blocks differ in work: the longest (last queries) start first.
  int qBlock = sh.causal ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  int bh = blockIdx.y, b = bh / sh.heads, h = bh % sh.heads, kvh = h / (sh.heads / sh.kvHeads);
  int q0 = qBlock * kRows + warp * 16;
  const bf16 *Qb = Q + int64_t(b) * sh.s * sh.ldq + h * D;
  const bf16 *Kb = K + int64_t(b) * sh.t * sh.ldk + kvh * D, *Vb = V + int64_t(b) * sh.t * sh.ldk + kvh * D;

  uint32_t qa[D / 16][4];
  for (int ks = 0; ks < D / 16; ++ks)
    for (int i = 0; i < 4; ++i) {
      int row = q0 + g + (i & 1) * 8, col = ks * 16 + 2 * c + (i >> 1) * 8;
      qa[ks][i] = row < sh.s ? ld32(Qb + int64_t(row) * sh.ldq + col) : 0u;
    }
  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0, 0};
  int shift = sh.t - sh.s; // causal: query i sees keys <= i + shift
  int end = sh.causal ? min(sh.t, qBlock * kRows + kRows + shift) : sh.t;
  if (end > 0) {
    stageAsync<D>(Kb, sh.ldk, 0, sh.t, kCols, Kbuf);
    stageAsync<D>(Vb, sh.ldk, 0, sh.t, kCols, Vbuf);
    cpCommit();
  }
  for (int k0 = 0, it = 0; k0 < end; k0 += kCols, ++it) {
    bf16 *Ks = Kbuf + (it & 1) * kCols * ld, *Vs = Vbuf + (it & 1) * kCols * ld;
    if (k0 + kCols < end) { // the other stage was last read an iteration ago (synced below)
      stageAsync<D>(Kb, sh.ldk, k0 + kCols, sh.t, kCols, Kbuf + ((it + 1) & 1) * kCols * ld);
      stageAsync<D>(Vb, sh.ldk, k0 + kCols, sh.t, kCols, Vbuf + ((it + 1) & 1) * kCols * ld);
      cpCommit();
      cpWait<1>();
    } else {
      cpWait<0>();
    }
    __syncthreads();
    float s[kCols / 8][4] = {};
    for (int j = 0; j < kCols / 8; j += 2)
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t kb[4];
        loadBt(kb, Ks, ld, j * 8, ks * 16);
        mma(s[j], qa[ks], kb[0], kb[1]);
        mma(s[j + 1], qa[ks], kb[2], kb[3]);
      }
    float mx[2] = {m[0], m[1]};
    for (int j = 0; j < kCols / 8; ++j)
      for (int i = 0; i < 4; ++i) {
        int row = q0 + g + (i >> 1) * 8, col = k0 + j * 8 + 2 * c + (i & 1);
        float x = s[j][i] * sh.scaleLog2;
        if (col >= sh.t || (sh.causal && col > row + shift))
          x = -INFINITY;
        s[j][i] = x;
        mx[i >> 1] = fmaxf(mx[i >> 1], x);
      }
    float ref[2], alpha[2];
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
      ref[r] = mx[r] == -INFINITY ? 0.0f : mx[r]; // a row masked so far stays all zeros
      alpha[r] = exp2f(m[r] - ref[r]);
      m[r] = mx[r];
      l[r] *= alpha[r];
    }
    for (int j = 0; j < kCols / 8; ++j)
      for (int i = 0; i < 4; ++i) {
        float p = exp2f(s[j][i] - ref[i >> 1]);
        s[j][i] = p;
        l[i >> 1] += p;
      }
    for (int dn = 0; dn < D / 8; ++dn)
      for (int i = 0; i < 4; ++i)
        o[dn][i] *= alpha[i >> 1];
    for (int kk = 0; kk < kCols / 16; ++kk) {
      uint32_t pa[4];
      toA(pa, s, kk);
      for (int dn = 0; dn < D / 8; dn += 2) {
        uint32_t vb[4];
        loadB(vb, Vs, ld, kk * 16, dn * 8);
        mma(o[dn], pa, vb[0], vb[1]);
        mma(o[dn + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads(); // every warp is done with this stage before it is refilled
  }
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
  }
  bf16 *Ob = O + int64_t(b) * sh.s * sh.ldo + h * D;
  for (int r = 0; r < 2; ++r) {
    int row = q0 + g + r * 8;
    if (row >= sh.s)
      continue;
    float inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;
    for (int dn = 0; dn < D / 8; ++dn)
      st32(Ob + int64_t(row) * sh.ldo + dn * 8 + 2 * c, pack(o[dn][2 * r] * inv, o[dn][2 * r + 1] * inv));
    if (lse && c == 0)
      lse[int64_t(bh) * sh.s + row] = l[r] > 0 ? m[r] + log2f(l[r]) : INFINITY;
  }
}

/// Di = rowsum(dO * O) per (batch, head, query): a warp per row.
template <int D>
__global__ void rowDotKernel(const bf16 *dO, const bf16 *O, float *di, int64_t rows, Shape sh) {
  int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; // (b * heads + h) * s + i
  if (row >= rows)
    return;
  int64_t i = row % sh.s, bh = row / sh.s, b = bh / sh.heads, h = bh % sh.heads;
  int64_t at = (b * sh.s + i) * sh.ldo + h * D;
  float acc = 0;
  for (int d = threadIdx.x % 32; d < D; d += 32)
    acc += __bfloat162float(dO[at + d]) * __bfloat162float(O[at + d]);
  for (int off = 16; off > 0; off >>= 1)
    acc += __shfl_xor_sync(0xffffffff, acc, off);
  if (threadIdx.x % 32 == 0)
    di[row] = acc;
}

/// One block: W warps over 16 MT W keys of one (batch, K/V head), a warp
/// taking 16 MT of them (MT m-tiles), streaming Qn queries at a time of
/// every query head that reads them; the next (head, query block) streams in
/// with cp.async while this one is used. dK and dV stay in registers; dQ is
/// accumulated in f32 with 16-byte atomics, once per block and query tile.
/// "narrow" (MT = 1, Qn = 64, W = 4): every head dim, bound by shared-memory
/// fragment loads (about two per tensor-core product); "wide" (MT = 2, Qn =
/// 32, W = 4): each Q / dO fragment feeds both m-tiles, fewer loads per
/// product, dK and dV of 64 floats each at D = 64 (hence D <= 64). W = 8
/// (narrow) halves the dQ atomics and query loads but fits one block per SM.
template <int D, int W, int MT, int Qn>
__global__ void __launch_bounds__(W * 32, MT == 2 ? 2 : 0)
    backwardKernel(const bf16 *Q, const bf16 *K, const bf16 *V, const bf16 *dO, const float *lse,
                   const float *di, float *dQ, bf16 *dK, bf16 *dV, Shape sh, float scale) {
  constexpr int Keys = 16 * MT * W, Threads = 32 * W, RowTiles = Qn / 16, Parts = W / RowTiles, Cols = D / Parts;
  static_assert(Parts >= 1 && Cols % 16 == 0, "dQ's columns split into parts of whole fragment pairs");
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int ld = D + 8, lds = Keys + 8;
  bf16 *Qbuf = reinterpret_cast<bf16 *>(smem); // 2 x [Qn][ld]
  bf16 *dObuf = Qbuf + 2 * Qn * ld;            // 2 x [Qn][ld]
  bf16 *Ks = dObuf + 2 * Qn * ld;              // [Keys][ld]
  bf16 *Vs = Ks + Keys * ld;                   // [Keys][ld]
  bf16 *dSs = Vs + Keys * ld;                  // [Qn][lds]: dS with queries as rows
  float *lseBuf = reinterpret_cast<float *>(dSs + Qn * lds), *diBuf = lseBuf + 2 * Qn;
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  int bk = blockIdx.y, b = bk / sh.kvHeads, kvh = bk % sh.kvHeads, group = sh.heads / sh.kvHeads;
  int k0 = blockIdx.x * Keys, kw = warp * 16 * MT; // the warp's keys: k0 + kw + [0, 16 MT)
  int shift = sh.t - sh.s;
  const bf16 *Kb = K + int64_t(b) * sh.t * sh.ldk + kvh * D, *Vb = V + int64_t(b) * sh.t * sh.ldk + kvh * D;
  stageAsync<D, Threads>(Kb, sh.ldk, k0, sh.t, Keys, Ks);
  stageAsync<D, Threads>(Vb, sh.ldk, k0, sh.t, Keys, Vs);

  float dk[MT][D / 8][4] = {}, dv[MT][D / 8][4] = {};
  int first = sh.causal ? max(0, k0 - shift) / Qn * Qn : 0;
  int perHead = first < sh.s ? (sh.s - first + Qn - 1) / Qn : 0, total = group * perHead;
  auto prefetch = [&](int it, int st) {
    int h = kvh * group + it / perHead, q0 = first + (it % perHead) * Qn;
    stageAsync<D, Threads>(Q + int64_t(b) * sh.s * sh.ldq + h * D, sh.ldq, q0, sh.s, Qn, Qbuf + st * Qn * ld);
    stageAsync<D, Threads>(dO + int64_t(b) * sh.s * sh.ldo + h * D, sh.ldo, q0, sh.s, Qn, dObuf + st * Qn * ld);
    for (int i = threadIdx.x; i < Qn; i += Threads) { // rows past s: zeros, masked below
      bool in = q0 + i < sh.s;
      int64_t at = (int64_t(b) * sh.heads + h) * sh.s + q0 + i;
      cpAsync4(lseBuf + st * Qn + i, in ? lse + at : lse, in);
      cpAsync4(diBuf + st * Qn + i, in ? di + at : di, in);
    }
  };
  if (total > 0)
    prefetch(0, 0);
  cpCommit();
  for (int it = 0; it < total; ++it) {
    int st = it & 1, h = kvh * group + it / perHead, q0 = first + (it % perHead) * Qn;
    if (it + 1 < total) {
      prefetch(it + 1, st ^ 1);
      cpCommit();
      cpWait<1>();
    } else {
      cpWait<0>();
    }
    __syncthreads();
    const bf16 *Qs = Qbuf + st * Qn * ld, *dOs = dObuf + st * Qn * ld;
    const float *lseS = lseBuf + st * Qn, *diS = diBuf + st * Qn;
    // S^T and dP^T for the warp's 16 MT keys x Qn queries.
    float p[MT][Qn / 8][4] = {}, dp[MT][Qn / 8][4] = {};
    #pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t ka[MT][4], va[MT][4];
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        loadA(ka[mt], Ks, ld, kw + mt * 16, ks * 16);
        loadA(va[mt], Vs, ld, kw + mt * 16, ks * 16);
      }
      for (int j = 0; j < Qn / 8; j += 2) {
        uint32_t qb[4], db[4];
        loadBt(qb, Qs, ld, j * 8, ks * 16);
        loadBt(db, dOs, ld, j * 8, ks * 16);
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(p[mt][j], ka[mt], qb[0], qb[1]);
          mma(p[mt][j + 1], ka[mt], qb[2], qb[3]);
          mma(dp[mt][j], va[mt], db[0], db[1]);
          mma(dp[mt][j + 1], va[mt], db[2], db[3]);
        }
      }
    }
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      for (int j = 0; j < Qn / 8; ++j)
        for (int i = 0; i < 4; ++i) {
          int key = k0 + kw + mt * 16 + g + (i >> 1) * 8, ql = j * 8 + 2 * c + (i & 1), query = q0 + ql;
          bool masked = key >= sh.t || query >= sh.s || (sh.causal && key > query + shift);
          float pv = masked ? 0.0f : exp2f(p[mt][j][i] * sh.scaleLog2 - lseS[ql]);
          p[mt][j][i] = pv;
          dp[mt][j][i] = pv * (dp[mt][j][i] - diS[ql]);
        }
    // dV += P^T dO and dK += dS^T Q (scaled at the end): each dO / Q fragment feeds every m-tile.
    #pragma unroll
    for (int kk = 0; kk < Qn / 16; ++kk) {
      uint32_t pa[MT][4], sa[MT][4];
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        toA(pa[mt], p[mt], kk);
        toA(sa[mt], dp[mt], kk);
      }
      #pragma unroll
      for (int dn = 0; dn < D / 8; dn += 2) {
        uint32_t db[4], qb[4];
        loadB(db, dOs, ld, kk * 16, dn * 8);
        loadB(qb, Qs, ld, kk * 16, dn * 8);
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(dv[mt][dn], pa[mt], db[0], db[1]);
          mma(dv[mt][dn + 1], pa[mt], db[2], db[3]);
          mma(dk[mt][dn], sa[mt], qb[0], qb[1]);
          mma(dk[mt][dn + 1], sa[mt], qb[2], qb[3]);
        }
      }
    }
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      for (int j = 0; j < Qn / 8; ++j)
        for (int i = 0; i < 4; ++i)
          dSs[(j * 8 + 2 * c + (i & 1)) * lds + kw + mt * 16 + g + (i >> 1) * 8] = __float2bfloat16_rn(dp[mt][j][i]);
    __syncthreads();
    // dQ (Qn queries x D) = dS K: warp w takes query rows (w % RowTiles) * 16
    // and column part w / RowTiles of D. Lanes c and c^1 trade halves so that
    // each holds four adjacent columns of one row (the even lane row g, the
    // odd one row g + 8) for a 16-byte atomic.
    int rowTile = warp % RowTiles, col0 = (warp / RowTiles) * Cols;
    float dq[Cols / 8][4] = {};
    #pragma unroll
    for (int kk = 0; kk < Keys / 16; ++kk) {
      uint32_t a[4];
      loadA(a, dSs, lds, rowTile * 16, kk * 16);
      #pragma unroll
      for (int dn = 0; dn < Cols / 8; dn += 2) {
        uint32_t kb[4];
        loadB(kb, Ks, ld, kk * 16, col0 + dn * 8);
        mma(dq[dn], a, kb[0], kb[1]);
        mma(dq[dn + 1], a, kb[2], kb[3]);
      }
    }
    float *dQb = dQ + int64_t(b) * sh.s * sh.ldqw + h * D + col0;
    bool even = (c & 1) == 0;
    int query = q0 + rowTile * 16 + g + (even ? 0 : 8), col = 2 * (c & ~1);
    #pragma unroll
    for (int dn = 0; dn < Cols / 8; ++dn) {
      float s0 = even ? dq[dn][2] : dq[dn][0], s1 = even ? dq[dn][3] : dq[dn][1];
      float r0 = __shfl_xor_sync(0xffffffff, s0, 1), r1 = __shfl_xor_sync(0xffffffff, s1, 1);
      float4 v = even ? make_float4(dq[dn][0], dq[dn][1], r0, r1) : make_float4(r0, r1, dq[dn][2], dq[dn][3]);
      if (query < sh.s)
        atomicAdd(reinterpret_cast<float4 *>(dQb + int64_t(query) * sh.ldqw + dn * 8 + col),
                  make_float4(v.x * scale, v.y * scale, v.z * scale, v.w * scale));
    }
  }
  cpWait<0>();
  bf16 *dKb = dK + int64_t(b) * sh.t * sh.lddk + kvh * D, *dVb = dV + int64_t(b) * sh.t * sh.lddk + kvh * D;
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    for (int r = 0; r < 2; ++r) {
      int key = k0 + kw + mt * 16 + g + r * 8;
      if (key >= sh.t)
        continue;
      #pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        int64_t at = int64_t(key) * sh.lddk + dn * 8 + 2 * c;
        st32(dKb + at, pack(dk[mt][dn][2 * r] * scale, dk[mt][dn][2 * r + 1] * scale));
        st32(dVb + at, pack(dv[mt][dn][2 * r], dv[mt][dn][2 * r + 1]));
      }
    }
}

/// dQ (bf16, rows `ld` apart) from the compact f32 accumulator, two at a time.
__global__ void toBf16Kernel(const float *x, bf16 *y, int64_t rows, int64_t width, int64_t ld) {
  int64_t pairs = rows * (width / 2);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pairs; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t r = i / (width / 2), c = (i % (width / 2)) * 2;
    float2 v = *reinterpret_cast<const float2 *>(x + r * width + c);
    *reinterpret_cast<__nv_bfloat162 *>(y + r * ld + c) = __floats2bfloat162_rn(v.x, v.y);
  }
}

template <int D> constexpr size_t forwardSmem() { return 4 * kCols * (D + 8) * sizeof(bf16); }
template <int D, int W, int MT, int Qn> constexpr size_t backwardSmem() {
  return (4 * Qn * (D + 8) + 2 * 16 * MT * W * (D + 8) + Qn * (16 * MT * W + 8)) * sizeof(bf16) +
         4 * Qn * sizeof(float);
}
/// Which backward kernel: "wide" (32-key warp tiles, head dims 32 and 64),
/// or "narrow" (16-key warp tiles, every head dim); LOOM_FLASH_BWD=narrow
/// forces the second.
bool backwardWide(int64_t headDim) {
  static const bool narrow = [] {
    const char *e = std::getenv("LOOM_FLASH_BWD");
    return e && std::string(e) == "narrow";
  }();
  return !narrow && (headDim == 32 || headDim == 64);
}
/// Warps per backward block: 4 (64 keys). LOOM_FLASH_BWD_WARPS=8 takes
/// 128-key blocks where the head is wide enough to split dQ's columns over
/// two warps: half the dQ atomics and query-tile loads, but one block per SM;
/// measured slower on GPT-2 350M (H200: 11.1 against 10.3 ms a step).
int backwardWarps(int64_t headDim) {
  static const int wanted = [] {
    const char *e = std::getenv("LOOM_FLASH_BWD_WARPS");
    return e && std::string(e) == "8" ? 8 : 4;
  }();
  return headDim >= 32 ? wanted : 4;
}

Shape shapeOf(const Params &p) {
  int64_t q = p.heads * p.headDim, kv = p.kvHeads * p.headDim;
  return {int(p.s),
          int(p.t),
          int(p.heads),
          int(p.kvHeads),
          p.ldq ? p.ldq : q,
          p.ldk ? p.ldk : kv,
          q,
          p.lddk ? p.lddk : kv,
          q,
          float(p.scale * 1.4426950408889634),
          p.causal};
}

template <int D> cudaError_t forwardD(const Params &p, void *o, float *lse, cudaStream_t stream) {
  // Per launch: the opt-in to large shared memory is per device.
  if (cudaError_t e = cudaFuncSetAttribute(forwardKernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(forwardSmem<D>()));
      e != cudaSuccess)
    return e;
  dim3 grid(unsigned((p.s + kRows - 1) / kRows), unsigned(p.batch * p.heads));
  forwardKernel<D><<<grid, kThreads, forwardSmem<D>(), stream>>>(
      static_cast<const bf16 *>(p.q), static_cast<const bf16 *>(p.k), static_cast<const bf16 *>(p.v),
      static_cast<bf16 *>(o), lse, shapeOf(p));
  return cudaGetLastError();
}

struct Workspace {
  bf16 *o;
  float *lse, *di, *dq;
};
Workspace carve(const Params &p, void *base) {
  auto align = [](size_t n) { return (n + 255) / 256 * 256; };
  size_t qElems = size_t(p.batch * p.s * p.heads * p.headDim), rows = size_t(p.batch * p.heads * p.s);
  char *at = static_cast<char *>(base);
  Workspace w;
  w.o = reinterpret_cast<bf16 *>(at), at += align(qElems * sizeof(bf16));
  w.lse = reinterpret_cast<float *>(at), at += align(rows * sizeof(float));
  w.di = reinterpret_cast<float *>(at), at += align(rows * sizeof(float));
  w.dq = reinterpret_cast<float *>(at);
  return w;
}

template <int D, int W, int MT, int Qn>
cudaError_t backwardDW(const Params &p, const void *dO, void *dQ, void *dK, void *dV, void *workspace,
                      cudaStream_t stream, const void *savedO, const float *savedLse) {
  constexpr int Keys = 16 * MT * W;
  constexpr size_t smem = backwardSmem<D, W, MT, Qn>();
  if (cudaError_t e = cudaFuncSetAttribute(backwardKernel<D, W, MT, Qn>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(smem));
      e != cudaSuccess)
    return e;
  Workspace w = carve(p, workspace);
  Shape sh = shapeOf(p);
  if (savedO) { // the forward's own output and statistics
    w.o = static_cast<bf16 *>(const_cast<void *>(savedO));
    w.lse = const_cast<float *>(savedLse);
  } else if (cudaError_t e = forwardD<D>(p, w.o, w.lse, stream); e != cudaSuccess) {
    return e;
  }
  int64_t rows = p.batch * p.heads * p.s, qElems = p.batch * p.s * p.heads * p.headDim;
  rowDotKernel<D><<<unsigned((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(static_cast<const bf16 *>(dO), w.o,
                                                                                   w.di, rows, sh);
  if (cudaError_t e = cudaMemsetAsync(w.dq, 0, qElems * sizeof(float), stream); e != cudaSuccess)
    return e;
  dim3 grid(unsigned((p.t + Keys - 1) / Keys), unsigned(p.batch * p.kvHeads));
  backwardKernel<D, W, MT, Qn><<<grid, 32 * W, smem, stream>>>(
      static_cast<const bf16 *>(p.q), static_cast<const bf16 *>(p.k), static_cast<const bf16 *>(p.v),
      static_cast<const bf16 *>(dO), w.lse, w.di, w.dq, static_cast<bf16 *>(dK), static_cast<bf16 *>(dV), sh, p.scale);
  toBf16Kernel<<<unsigned(std::min<int64_t>((qElems / 2 + 255) / 256, 65535)), 256, 0, stream>>>(
      w.dq, static_cast<bf16 *>(dQ), p.batch * p.s, p.heads * p.headDim, p.lddq ? p.lddq : p.heads * p.headDim);
  return cudaGetLastError();
}

template <int D>
cudaError_t backwardD(const Params &p, const void *dO, void *dQ, void *dK, void *dV, void *workspace,
                      cudaStream_t stream, const void *savedO, const float *savedLse) {
  if constexpr (D == 32 || D == 64)
    if (backwardWide(D))
      return backwardDW<D, 4, 2, 32>(p, dO, dQ, dK, dV, workspace, stream, savedO, savedLse);
  if constexpr (D >= 32)
    if (backwardWarps(D) == 8)
      return backwardDW<D, 8, 1, 64>(p, dO, dQ, dK, dV, workspace, stream, savedO, savedLse);
  return backwardDW<D, 4, 1, 64>(p, dO, dQ, dK, dV, workspace, stream, savedO, savedLse);
}

} // namespace

bool supported(int64_t headDim) { return headDim == 16 || headDim == 32 || headDim == 64 || headDim == 128; }

cudaError_t forward(const Params &p, void *o, float *lse, cudaStream_t stream) {
  switch (p.headDim) {
  case 16: return forwardD<16>(p, o, lse, stream);
  case 32: return forwardD<32>(p, o, lse, stream);
  case 64: return forwardD<64>(p, o, lse, stream);
  case 128: return forwardD<128>(p, o, lse, stream);
  default: return cudaErrorInvalidValue;
  }
}

size_t backwardWorkspace(const Params &p) {
  size_t qElems = size_t(p.batch * p.s * p.heads * p.headDim), rows = size_t(p.batch * p.heads * p.s);
  auto align = [](size_t n) { return (n + 255) / 256 * 256; };
  return align(qElems * sizeof(bf16)) + 2 * align(rows * sizeof(float)) + align(qElems * sizeof(float));
}

cudaError_t backward(const Params &p, const void *dO, void *dQ, void *dK, void *dV, void *workspace,
                     cudaStream_t stream, const void *o, const float *lse) {
  switch (p.headDim) {
  case 16: return backwardD<16>(p, dO, dQ, dK, dV, workspace, stream, o, lse);
  case 32: return backwardD<32>(p, dO, dQ, dK, dV, workspace, stream, o, lse);
  case 64: return backwardD<64>(p, dO, dQ, dK, dV, workspace, stream, o, lse);
  case 128: return backwardD<128>(p, dO, dQ, dK, dV, workspace, stream, o, lse);
  default: return cudaErrorInvalidValue;
  }
}

} // namespace loom::rt::flash
