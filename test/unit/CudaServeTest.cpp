//===- CudaServeTest.cpp - Decoding's kernels: CUDA backend against CPU ---===//
//
// The instructions a decoding step spends its time in run alone on random
// operands on the CUDA backend and on the CPU backend (the reference), and
// their results are compared: paged attention over a shuffled block table
// (one and several query heads per key/value head, f32 and bf16, decoding
// tokens and a prompt chunk), the slices of one tensor in one launch, and
// the products of a few rows by [N, K] weights (alone, with each epilogue,
// and the products of one input in one launch). Also the device argmax
// greedy decoding reads. Skips where there is no GPU.
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
  std::uniform_real_distribution<float> dist(-scale, scale);
  return loom::rt::test::floatBytes(b, [&](int64_t) { return dist(rng); });
}

template <typename T> std::vector<char> bytesOf(const std::vector<T> &v) {
  std::vector<char> out(v.size() * sizeof(T));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

/// The relative L2 distance between the GPU's and the CPU's copies of b.
double relativeL2(Backend &gpu, Backend &cpu, const Buffer &b) {
  std::vector<char> g(size_t(b.bytes)), c(size_t(b.bytes));
  gpu.download(b, g.data());
  cpu.download(b, c.data());
  double num = 0, den = 0;
  for (int64_t i = 0; i < numElements(b.shape).value(); ++i) {
    double got = loadAsDouble(b.dtype, g.data(), i), want = loadAsDouble(b.dtype, c.data(), i);
    if (!std::isfinite(got))
      return INFINITY;
    num += (got - want) * (got - want), den += want * want;
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

/// `prog` over `r` on both backends, the buffers `inputs` random (the same
/// bytes on each), prepared and run once.
struct BothBackends {
  std::unique_ptr<Backend> cpu, gpu;
};
BothBackends runBoth(const RankProgram &r, const std::vector<Instruction> &prog, const std::vector<int64_t> &inputs,
                     std::mt19937 &rng) {
  BothBackends b{makeCpuBackend(r, 2), makeCudaBackend(r, 0)};
  for (int64_t id : inputs) {
    std::vector<char> bytes = randomFloats(r.buffers[size_t(id)], rng);
    b.cpu->upload(r.buffers[size_t(id)], bytes.data());
    b.gpu->upload(r.buffers[size_t(id)], bytes.data());
  }
  for (Backend *be : {b.cpu.get(), b.gpu.get()}) {
    be->prepare("forward", prog);
    be->run("forward");
  }
  return b;
}

/// Runs the instruction on both backends with `inputs` (bytes per input)
/// and expects every output within `tol` (relative L2; a non-finite value
/// fails).
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
    double err = relativeL2(*gpu, *cpu, b);
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
      {6, 2, 16, {20, 33}},                 // groups of 3 (the general kernel's, or one head a block)
      {4, 4, 128, {64, 127}},               // head dimension 128
      // Many tokens (a prompt chunk): the decoding kernel takes two and four
      // query heads per block.
      {32, 8, 64, {0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120, 127, 64, 32, 16, 17, 18, 19, 100}},
      {32, 8, 64, {0,  1,  2,  3,  5,  8,  13, 21, 34, 55, 89, 120, 127, 64, 32, 16, 17, 18, 19, 100,
                   99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79}},
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
    // As in a serving bundle: the positions and block table are the step's
    // inputs (the decoding kernel reads them, and the cache rows of earlier
    // steps, before the previous kernel ends).
    p.rank.buffers[size_t(p.ins.in[1])].role = p.rank.buffers[size_t(p.ins.in[2])].role = BufferRole::Cache;
    p.rank.buffers[size_t(p.ins.in[3])].role = p.rank.buffers[size_t(p.ins.in[4])].role = BufferRole::Input;
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
    std::vector<std::vector<char>> inputs = {randomFloats(bufs[p.ins.in[0]], rng, 2.0f),
                                             randomFloats(bufs[p.ins.in[1]], rng),
                                             randomFloats(bufs[p.ins.in[2]], rng), bytesOf(pos), bytesOf(table)};
    // Each case through both kernels: the one the backend picks for its
    // size, and each forced.
    for (const char *kernel : {"", "vec", "decode"}) {
      SCOPED_TRACE(std::string("LOOM_CUDA_PAGED=") + kernel);
      setenv("LOOM_CUDA_PAGED", kernel, 1);
      compare(p, inputs, tol);
    }
    unsetenv("LOOM_CUDA_PAGED");
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

/// Products of a few rows by [N, K] bf16 weights (transpose_b), as
/// decoding runs them, in the decoding kernel (LOOM_CUDA_GEMV=1) against
/// the CPU backend: the epilogues, rows that do not fill the kernel's
/// tile, K not a multiple of the kernel's stride, f32 results, and three
/// products of one input in one launch.
TEST(CudaServe, DecodeProducts) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  struct Product {
    int64_t n;
    std::string epilogue;
  };
  struct Case {
    int64_t rows, k;
    std::vector<Product> products; // of one input
    loom_dtype_t out;
  };
  const Case cases[] = {
      {1, 1024, {{1000, ""}}, LOOM_BF16},
      {3, 2056, {{520, "residual"}}, LOOM_BF16},
      {8, 5632, {{64, "bias_gelu"}}, LOOM_BF16},
      {5, 64, {{300, "bias_residual"}}, LOOM_F32},
      {1, 2048, {{1000, "bias"}}, LOOM_F32},
      {2, 512, {{256, ""}, {64, ""}, {64, "residual"}}, LOOM_BF16}, // q, k and v: one launch
      // More output groups than blocks the GPU holds at once, K not a
      // whole number of steps.
      {1, 2048, {{11264, ""}}, LOOM_BF16},
      {2, 5632, {{4100, "residual"}}, LOOM_BF16},
      {1, 1024, {{8192, ""}, {1024, "bias"}}, LOOM_F32},
  };
  setenv("LOOM_CUDA_GEMV", "1", 1);
  std::mt19937 rng(21);
  for (const Case &c : cases) {
    ProgramBuilder builder;
    int64_t x = builder.add({1, c.rows, c.k}, LOOM_BF16, "x");
    std::vector<Instruction> prog;
    std::vector<int64_t> inputs = {x};
    for (const Product &p : c.products) {
      int64_t w = builder.add({p.n, c.k}, LOOM_BF16, "w");
      // A parameter no instruction writes: the kernel loads it before
      // the previous kernel ends (the other tests' weights are not).
      builder.rank.buffers[size_t(w)].role = BufferRole::Param;
      Instruction ins{"matmul", {x, w}, {}, {{"transpose_b", true}}};
      inputs.push_back(w);
      if (p.epilogue.rfind("bias", 0) == 0)
        ins.in.push_back(builder.add({p.n}, c.out, "bias"));
      if (p.epilogue.find("residual") != std::string::npos)
        ins.in.push_back(builder.add({1, c.rows, p.n}, c.out, "residual"));
      for (size_t i = 2; i < ins.in.size(); ++i)
        inputs.push_back(ins.in[i]);
      if (!p.epilogue.empty())
        ins.attrs["epilogue"] = p.epilogue;
      ins.out.push_back(builder.add({1, c.rows, p.n}, c.out, "out"));
      prog.push_back(ins);
    }
    RankProgram r = builder.finish(prog);
    BothBackends be = runBoth(r, prog, inputs, rng);
    for (const Instruction &ins : prog) {
      const Buffer &b = r.buffers[size_t(ins.out[0])];
      // bf16 results: their rounding; f32: the order of the sums.
      EXPECT_LE(relativeL2(*be.gpu, *be.cpu, b), c.out == LOOM_BF16 ? 1e-2 : 1e-5)
          << c.rows << " rows, K " << c.k << ", " << shapeStr(b.shape) << " " << ins.attrs.dump();
    }
  }
  unsetenv("LOOM_CUDA_GEMV");
}

/// A decoding layer's rotary embeddings of q and k and its cache write, one
/// launch on the GPU, against the three instructions on the CPU: both
/// rotated results and both caches (a padding slot left alone). Where only
/// the cache write reads rotated k, the memory planner may put it where q
/// was: the launch then leaves it out (Llama's decoding bundles).
TEST(CudaServe, RotaryAndCacheWrite) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  for (loom_dtype_t dt : {LOOM_F32, LOOM_BF16})
    for (bool keysRead : {true, false}) {
      const int64_t n = 3, heads = 8, kvHeads = 2, d = 64, rows = 48;
      ProgramBuilder builder;
      int64_t q = builder.add({1, n, heads * d}, dt), k = builder.add({1, n, kvHeads * d}, dt);
      int64_t v = builder.add({1, n, kvHeads * d}, dt), pos = builder.add({1, n}, LOOM_I32);
      int64_t slots = builder.add({n}, LOOM_I32);
      int64_t qr = builder.add({1, n, heads * d}, dt), kr = builder.add({1, n, kvHeads * d}, dt);
      int64_t kc = builder.add({rows, kvHeads * d}, dt), vc = builder.add({rows, kvHeads * d}, dt);
      if (keysRead)
        builder.rank.buffers[size_t(kr)].role = BufferRole::Output;
      else
        builder.rank.buffers[size_t(kr)].offset = builder.rank.buffers[size_t(q)].offset;
      std::vector<Instruction> prog = {
          {"rotary", {q, pos}, {qr}, {{"num_heads", heads}, {"theta", 10000.0}}},
          {"rotary", {k, pos}, {kr}, {{"num_heads", kvHeads}, {"theta", 10000.0}}},
          {"kv_write", {kr, v, slots}, {kc, vc}, nlohmann::json::object()},
      };
      RankProgram r = builder.finish(prog);
      auto cpu = makeCpuBackend(r, 1);
      auto gpu = makeCudaBackend(r, 0);
      std::mt19937 rng(5);
      std::vector<int32_t> positions = {0, 17, 200}, slotIds = {40, -1, 7};
      for (int64_t id : {q, k, v, kc, vc}) {
        std::vector<char> bytes = randomFloats(r.buffers[size_t(id)], rng);
        cpu->upload(r.buffers[size_t(id)], bytes.data());
        gpu->upload(r.buffers[size_t(id)], bytes.data());
      }
      for (Backend *be : {cpu.get(), gpu.get()}) {
        be->upload(r.buffers[size_t(pos)], positions.data());
        be->upload(r.buffers[size_t(slots)], slotIds.data());
        be->prepare("forward", prog);
        be->run("forward");
      }
      for (int64_t id : {qr, kr, kc, vc}) {
        if (id == kr && !keysRead)
          continue;
        const Buffer &b = r.buffers[size_t(id)];
        int64_t count = numElements(b.shape).value();
        std::vector<char> g(size_t(b.bytes)), w(size_t(b.bytes));
        gpu->download(b, g.data());
        cpu->download(b, w.data());
        double worst = 0;
        for (int64_t i = 0; i < count; ++i)
          worst = std::max(worst, std::fabs(loadAsDouble(b.dtype, g.data(), i) - loadAsDouble(b.dtype, w.data(), i)));
        // The same arithmetic; the CPU's sine and cosine may differ in the last bits.
        EXPECT_LE(worst, dt == LOOM_BF16 ? 1e-2 : 1e-5)
            << b.name << " (" << dtypeName(dt) << (keysRead ? ")" : ", rotated k where q was)");
      }
    }
}

/// A decoding product whose result only slices read (GPT-2's q, k and v
/// with their bias): the decoding kernel writes each slice itself.
TEST(CudaServe, DecodeProductSlices) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  setenv("LOOM_CUDA_GEMV", "1", 1);
  for (int64_t rows : {1, 3}) {
    const int64_t k = 1024, n = 3 * 256;
    ProgramBuilder builder;
    int64_t x = builder.add({1, rows, k}, LOOM_BF16), w = builder.add({n, k}, LOOM_BF16);
    int64_t bias = builder.add({n}, LOOM_BF16), y = builder.add({1, rows, n}, LOOM_BF16);
    std::vector<Instruction> prog = {
        {"matmul", {x, w, bias}, {y}, {{"transpose_b", true}, {"epilogue", "bias"}}}};
    std::vector<int64_t> outs;
    for (int64_t start : {0, 256, 512}) {
      outs.push_back(builder.add({1, rows, 256}, LOOM_BF16));
      prog.push_back({"slice", {y}, {outs.back()}, {{"axis", 2}, {"start", start}, {"size", 256}}});
    }
    RankProgram r = builder.finish(prog);
    std::mt19937 rng(31);
    BothBackends be = runBoth(r, prog, {x, w, bias}, rng);
    for (int64_t id : outs)
      EXPECT_LE(relativeL2(*be.gpu, *be.cpu, r.buffers[size_t(id)]), 1e-2) << rows << " rows, slice " << id;
  }
  unsetenv("LOOM_CUDA_GEMV");
}

/// A norm whose result only decoding products read: the products
/// normalise their input themselves (RMS norm before three products of one
/// input, as Llama's q, k and v; layer norm before a product and its slices,
/// as GPT-2's, the first slice where the norm's result was, as the memory
/// planner lays GPT-2's decoding out).
TEST(CudaServe, DecodeNormProducts) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  setenv("LOOM_CUDA_GEMV", "1", 1);
  setenv("LOOM_CUDA_GEMV_NORM", "1", 1); // both kinds (=layer keeps RMS norms apart)
  for (bool rms : {true, false})
    for (int64_t rows : {1, 5}) {
      const int64_t k = 2048;
      ProgramBuilder builder;
      int64_t x = builder.add({1, rows, k}, LOOM_BF16), g = builder.add({k}, LOOM_BF16);
      int64_t b = rms ? -1 : builder.add({k}, LOOM_BF16), xn = builder.add({1, rows, k}, LOOM_BF16);
      std::vector<int64_t> inputs = {x, g}, outs;
      if (!rms)
        inputs.push_back(b);
      std::vector<Instruction> prog = {{rms ? "rmsnorm" : "layernorm", rms ? std::vector<int64_t>{x, g}
                                                                            : std::vector<int64_t>{x, g, b},
                                        {xn}, {{"eps", 1e-5}}}};
      if (rms) {
        for (int64_t n : {512, 128, 128}) {
          int64_t w = builder.add({n, k}, LOOM_BF16);
          inputs.push_back(w);
          outs.push_back(builder.add({1, rows, n}, LOOM_BF16));
          prog.push_back({"matmul", {xn, w}, {outs.back()}, {{"transpose_b", true}}});
        }
      } else {
        int64_t w = builder.add({768, k}, LOOM_BF16), bias = builder.add({768}, LOOM_BF16);
        int64_t y = builder.add({1, rows, 768}, LOOM_BF16);
        inputs.push_back(w), inputs.push_back(bias);
        prog.push_back({"matmul", {xn, w, bias}, {y}, {{"transpose_b", true}, {"epilogue", "bias"}}});
        for (int64_t start : {0, 256, 512}) {
          outs.push_back(builder.add({1, rows, 256}, LOOM_BF16));
          prog.push_back({"slice", {y}, {outs.back()}, {{"axis", 2}, {"start", start}, {"size", 256}}});
        }
        builder.rank.buffers[size_t(outs[0])].offset = builder.rank.buffers[size_t(xn)].offset;
      }
      RankProgram r = builder.finish(prog);
      std::mt19937 rng(41);
      BothBackends be = runBoth(r, prog, inputs, rng);
      for (int64_t id : outs)
        EXPECT_LE(relativeL2(*be.gpu, *be.cpu, r.buffers[size_t(id)]), 1e-2)
            << (rms ? "rmsnorm" : "layernorm") << ", " << rows << " rows, output " << id;
    }
  unsetenv("LOOM_CUDA_GEMV");
  unsetenv("LOOM_CUDA_GEMV_NORM");
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
