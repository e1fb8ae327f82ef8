//===- CudaServeTest.cpp - Decoding's kernels: CUDA backend against CPU ---===//
//
// The instructions a decoding step spends its time in run alone on random
// operands on the CUDA backend and on the CPU backend (the reference), and
// their results are compared: paged attention over a shuffled block table
// (one and several query heads per key/value head, f32 and bf16, decoding
// tokens and a prompt chunk), and the slices of one tensor in one launch.
// Also the device argmax greedy decoding reads. Skips where there is no GPU.
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Bundle.h"
#include "loom/rt/Tensor.h"
#include "runtime/src/Backend.h"
#include "test/unit/SingleInstruction.h"

#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

using namespace loom::rt;

namespace {

const bool kTf32Off = [] { return setenv("LOOM_CUDA_TF32", "0", 1) == 0; }(); // f32 products in full f32

bool haveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

using loom::rt::test::ProgramBuilder;

struct Operand {
  Shape shape;
  loom_dtype_t dtype;
};

/// A program of one instruction over fresh 256-byte aligned buffers.
struct OneInstruction {
  RankProgram rank;
  Instruction ins;
  OneInstruction(const std::string &op, const std::vector<Operand> &in, const std::vector<Operand> &out,
                 nlohmann::json attrs) {
    std::vector<std::pair<Shape, loom_dtype_t>> i, o;
    for (const Operand &x : in)
      i.push_back({x.shape, x.dtype});
    for (const Operand &x : out)
      o.push_back({x.shape, x.dtype});
    rank = loom::rt::test::programFor(op, i, o, ins, std::move(attrs));
  }
};

std::vector<char> randomFloats(const Buffer &b, std::mt19937 &rng, float scale = 1.0f) {
  int64_t n = numElements(b.shape).value();
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<char> bytes(size_t(b.bytes));
  for (int64_t i = 0; i < n; ++i) {
    float v = dist(rng);
    if (b.dtype == LOOM_BF16) {
      uint16_t h = floatToBf16(v);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    } else {
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    }
  }
  return bytes;
}

template <typename T> std::vector<char> bytesOf(const std::vector<T> &v) {
  std::vector<char> out(v.size() * sizeof(T));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

/// Runs the instruction on both backends with `inputs` (bytes per input)
/// and expects every output within `tol` (relative L2).
void compare(OneInstruction &p, const std::vector<std::vector<char>> &inputs, double tol) {
  auto cpu = makeCpuBackend(p.rank, 2);
  auto gpu = makeCudaBackend(p.rank, 0);
  for (size_t i = 0; i < p.ins.in.size(); ++i) {
    const Buffer &b = p.rank.buffers[p.ins.in[i]];
    cpu->upload(b, inputs[i].data());
    gpu->upload(b, inputs[i].data());
  }
  for (Backend *be : {cpu.get(), gpu.get()}) {
    be->prepare("forward", {p.ins});
    be->run("forward");
  }
  for (int64_t id : p.ins.out) {
    const Buffer &b = p.rank.buffers[id];
    int64_t n = numElements(b.shape).value();
    std::vector<char> g(size_t(b.bytes)), c(size_t(b.bytes));
    gpu->download(b, g.data());
    cpu->download(b, c.data());
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; ++i) {
      double got = loadAsDouble(b.dtype, g.data(), i), want = loadAsDouble(b.dtype, c.data(), i);
      ASSERT_TRUE(std::isfinite(got)) << b.name << "[" << i << "]";
      num += (got - want) * (got - want), den += want * want;
    }
    double err = std::sqrt(num / std::max(den, 1e-30));
    EXPECT_LE(err, tol) << b.name << " " << shapeStr(b.shape) << ": relative L2 error " << err;
  }
}

struct PagedCase {
  int heads, kvHeads, D;
  std::vector<int> positions; // one token each
};

void pagedAttention(loom_dtype_t dt, double tol) {
  const int blockSize = 16, perSeq = 8, numBlocks = 24;
  const PagedCase cases[] = {
      {16, 16, 64, {127}},                  // GPT-2 decoding one token
      {8, 2, 16, {5, 40, 0, 100}},          // grouped, four sequences decoding
      {32, 4, 64, {3, 4, 5, 6, 7, 8, 9}},   // TinyLlama's groups of 8, a prompt chunk
      {6, 2, 16, {20, 33}},                 // groups of 3 (the general kernel)
      {4, 4, 128, {64, 127}},               // head dimension 128
  };
  std::mt19937 rng(11);
  for (const PagedCase &c : cases) {
    SCOPED_TRACE("heads " + std::to_string(c.heads) + "/" + std::to_string(c.kvHeads) + " D " +
                 std::to_string(c.D) + (dt == LOOM_BF16 ? " bf16" : " f32"));
    int64_t n = int64_t(c.positions.size()), W = int64_t(c.kvHeads) * c.D;
    OneInstruction p("paged_attention",
                     {{{1, n, int64_t(c.heads) * c.D}, dt},
                      {{numBlocks * blockSize, W}, dt},
                      {{numBlocks * blockSize, W}, dt},
                      {{n}, LOOM_I32},
                      {{n, perSeq}, LOOM_I32}},
                     {{{1, n, int64_t(c.heads) * c.D}, dt}},
                     {{"num_heads", c.heads}, {"num_kv_heads", c.kvHeads}, {"block_size", blockSize}});
    // Each token's blocks: a shuffled choice of the cache's.
    std::vector<int32_t> table;
    for (int64_t t = 0; t < n; ++t) {
      std::vector<int32_t> all(numBlocks);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      table.insert(table.end(), all.begin(), all.begin() + perSeq);
    }
    std::vector<int32_t> pos(c.positions.begin(), c.positions.end());
    const auto &bufs = p.rank.buffers;
    compare(p,
            {randomFloats(bufs[p.ins.in[0]], rng, 2.0f), randomFloats(bufs[p.ins.in[1]], rng),
             randomFloats(bufs[p.ins.in[2]], rng), bytesOf(pos), bytesOf(table)},
            tol);
  }
}

TEST(CudaServe, PagedAttentionF32) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  pagedAttention(LOOM_F32, 1e-5);
}

TEST(CudaServe, PagedAttentionBf16) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  pagedAttention(LOOM_BF16, 1e-2);
}

// Slices of one tensor along one axis run as one launch (q, k and v of the
// packed product): every output equals the CPU's, aligned or not.
TEST(CudaServe, SlicesOfOneTensor) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  struct Case {
    Shape x;
    int64_t axis;
    std::vector<std::pair<int64_t, int64_t>> parts; // start, size
    loom_dtype_t dt;
    int64_t skew; // bytes the outputs sit past a 256-byte boundary
  };
  const Case cases[] = {
      {{1, 3, 3072}, 2, {{0, 1024}, {1024, 1024}, {2048, 1024}}, LOOM_BF16, 0}, // sixteen-byte units
      {{1, 3, 3072}, 2, {{0, 1024}, {1024, 1024}, {2048, 1024}}, LOOM_BF16, 2}, // outputs unaligned: two
      {{2, 5, 21}, 2, {{0, 7}, {7, 7}, {14, 7}}, LOOM_BF16, 0},                // two-byte units
      {{4, 6, 3}, 1, {{1, 2}, {3, 3}}, LOOM_F32, 0},                          // a middle axis, a gap
  };
  std::mt19937 rng(9);
  for (const Case &c : cases) {
    ProgramBuilder builder;
    auto add = [&](const Shape &s) { return builder.add(s, c.dt, "b", builder.rank.buffers.empty() ? 0 : c.skew); };
    int64_t x = add(c.x);
    std::vector<Instruction> prog;
    for (auto [start, size] : c.parts) {
      Shape s = c.x;
      s[size_t(c.axis)] = size;
      prog.push_back(Instruction{"slice", {x}, {add(s)}, {{"axis", c.axis}, {"start", start}, {"size", size}}});
    }
    RankProgram r = builder.finish(prog);
    auto cpu = makeCpuBackend(r, 1);
    auto gpu = makeCudaBackend(r, 0);
    std::vector<char> bytes = randomFloats(r.buffers[size_t(x)], rng);
    cpu->upload(r.buffers[size_t(x)], bytes.data());
    gpu->upload(r.buffers[size_t(x)], bytes.data());
    for (Backend *be : {cpu.get(), gpu.get()}) {
      be->prepare("forward", prog);
      be->run("forward");
    }
    for (const Instruction &ins : prog) {
      const Buffer &b = r.buffers[size_t(ins.out[0])];
      std::vector<char> g(size_t(b.bytes)), w(size_t(b.bytes));
      gpu->download(b, g.data());
      cpu->download(b, w.data());
      EXPECT_EQ(g, w) << shapeStr(c.x) << " slice " << ins.attrs.dump();
    }
  }
}

TEST(CudaServe, ArgmaxRows) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  for (loom_dtype_t dt : {LOOM_F32, LOOM_BF16}) {
    OneInstruction p("copy", {{{5, 50304}, dt}}, {{{5, 50304}, dt}}, nlohmann::json::object());
    const Buffer &b = p.rank.buffers[0];
    std::mt19937 rng(3);
    std::vector<char> bytes = randomFloats(b, rng);
    // Row 1: a tie (the first wins); row 2: the largest in the last column.
    auto put = [&](int64_t i, float v) {
      if (dt == LOOM_BF16) {
        uint16_t h = floatToBf16(v);
        std::memcpy(bytes.data() + 2 * i, &h, 2);
      } else {
        std::memcpy(bytes.data() + 4 * i, &v, 4);
      }
    };
    put(50304 + 700, 4.0f), put(50304 + 9000, 4.0f), put(2 * 50304 + 50303, 8.0f);
    auto cpu = makeCpuBackend(p.rank, 1);
    auto gpu = makeCudaBackend(p.rank, 0);
    cpu->upload(b, bytes.data());
    gpu->upload(b, bytes.data());
    std::vector<int32_t> want(5), got(5);
    cpu->argmaxRows(b, 5, 50304, want.data());
    gpu->argmaxRows(b, 5, 50304, got.data());
    EXPECT_EQ(got, want);
    EXPECT_EQ(want[1], 700);
    EXPECT_EQ(want[2], 50303);
  }
}

} // namespace
