//===- RuntimeTest.cpp - Runtime pieces that need no compiler -------------===//
//
// Built with -DLOOM_BUILD_COMPILER=OFF too (the GPU machine): safetensors,
// the thread pool, and the CPU backend on a hand-written program.
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Bundle.h"
#include "loom/rt/Checked.h"
#include "loom/rt/Error.h"
#include "loom/rt/Safetensors.h"
#include "runtime/src/StartLine.h"
#include "runtime/src/ThreadPool.h"
#include "runtime/src/cpu/CpuBackend.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <thread>

using namespace loom::rt;

TEST(Safetensors, RoundTrip) {
  std::string path = ::testing::TempDir() + "/rt-roundtrip.safetensors";
  std::vector<float> a = {1, 2, 3, 4, 5, 6};
  std::vector<int32_t> b = {7, 8};
  writeSafetensors(path, {{"a", LOOM_F32, {2, 3}, a.data(), 24}, {"b", LOOM_I32, {2}, b.data(), 8}},
                   {{"note", "x"}});
  SafetensorsFile f = readSafetensors(path);
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.tensors["a"].shape, (Shape{2, 3}));
  EXPECT_EQ(f.tensors["b"].dtype, LOOM_I32);
  EXPECT_EQ(0, std::memcmp(f.bytesOf("a"), a.data(), 24));
  EXPECT_EQ(0, std::memcmp(f.bytesOf("b"), b.data(), 8));
  EXPECT_EQ(f.metadata["note"], "x");
  std::remove(path.c_str());
}

TEST(Safetensors, RejectsLies) {
  std::string path = ::testing::TempDir() + "/rt-bad.safetensors";
  auto writeRaw = [&](const std::string &header, size_t dataBytes) {
    std::ofstream out(path, std::ios::binary);
    uint64_t n = header.size();
    out.write(reinterpret_cast<const char *>(&n), 8);
    out << header << std::string(dataBytes, '\0');
  };
  auto message = [&]() -> std::string {
    try {
      readSafetensors(path);
    } catch (const Error &e) {
      return e.what();
    }
    return "accepted";
  };
  writeRaw(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8);
  EXPECT_NE(message().find("lies outside the data"), std::string::npos) << message();
  writeRaw(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}})", 16);
  EXPECT_NE(message().find("covers 12 bytes but f32[4] needs 16"), std::string::npos) << message();
  writeRaw(R"({"a":{"dtype":"Q4","shape":[4],"data_offsets":[0,16]}})", 16);
  EXPECT_NE(message().find("unsupported dtype 'Q4'"), std::string::npos) << message();
  writeRaw("{not json", 0);
  EXPECT_NE(message().find("header is not a JSON object"), std::string::npos) << message();
  {
    std::ofstream out(path, std::ios::binary);
    uint64_t n = 1u << 30;
    out.write(reinterpret_cast<const char *>(&n), 8);
  }
  EXPECT_NE(message().find("exceeds the file size"), std::string::npos) << message();
  std::remove(path.c_str());
}

TEST(ParamShard, ZeroThreeChunksRoundTrip) {
  // A [3, 4] parameter split over tp=2 along axis 1 (a [3, 2] part), then
  // over three data-parallel ranks: chunks of ceil(6 / 3) = 2 elements of
  // the flattened part; over four, chunks of 2 with the last one zeros.
  std::vector<float> full(12);
  for (int i = 0; i < 12; ++i)
    full[i] = float(i + 1);
  ParamShard s;
  s.fullShape = {3, 4}, s.axis = 1, s.parts = 2, s.index = 1;
  EXPECT_EQ(s.partShape(), (Shape{3, 2}));
  std::vector<float> back(12, 0.0f);
  std::vector<float> seen;
  for (int64_t parts : {3, 4}) {
    s.zeroParts = parts;
    std::fill(back.begin(), back.end(), 0.0f);
    seen.clear();
    for (int64_t k = 0; k < parts; ++k) {
      s.zeroIndex = k;
      std::vector<float> chunk(2, -1.0f);
      extractShard(s, sizeof(float), reinterpret_cast<const char *>(full.data()),
                   reinterpret_cast<char *>(chunk.data()));
      seen.insert(seen.end(), chunk.begin(), chunk.end());
      insertShard(s, sizeof(float), reinterpret_cast<const char *>(chunk.data()),
                  reinterpret_cast<char *>(back.data()));
    }
    std::vector<float> want = {3, 4, 7, 8, 11, 12}; // columns 2 and 3
    if (parts == 4)
      want.insert(want.end(), {0, 0});
    EXPECT_EQ(seen, want);
    EXPECT_EQ(back, (std::vector<float>{0, 0, 3, 4, 0, 0, 7, 8, 0, 0, 11, 12}));
  }
  // Without tensor parallelism: chunks of the whole, flattened.
  ParamShard whole;
  whole.fullShape = {3, 4}, whole.zeroParts = 5, whole.zeroIndex = 4; // chunks of 3: [12, 0, 0]
  EXPECT_TRUE(whole.split());
  std::vector<float> last(3, -1.0f);
  extractShard(whole, sizeof(float), reinterpret_cast<const char *>(full.data()),
               reinterpret_cast<char *>(last.data()));
  EXPECT_EQ(last, (std::vector<float>{0, 0, 0}));
  whole.zeroIndex = 3;
  extractShard(whole, sizeof(float), reinterpret_cast<const char *>(full.data()),
               reinterpret_cast<char *>(last.data()));
  EXPECT_EQ(last, (std::vector<float>{10, 11, 12}));
}

TEST(Checked, RefusesOverflow) {
  EXPECT_EQ(checkedAdd(INT64_MAX - 1, 1), INT64_MAX);
  EXPECT_EQ(checkedAdd(INT64_MAX, 1), std::nullopt);
  EXPECT_EQ(checkedMul(int64_t(1) << 31, int64_t(1) << 31), int64_t(1) << 62);
  EXPECT_EQ(checkedMul(int64_t(1) << 32, int64_t(1) << 32), std::nullopt);
  EXPECT_EQ(checkedAlignUp(65, 64), 128);
  EXPECT_EQ(checkedAlignUp(INT64_MAX - 3, 64), std::nullopt);
  // Shapes whose element count wraps int64 (2^32 x 2^32 = 0 mod 2^64).
  EXPECT_EQ(numElements({int64_t(1) << 32, int64_t(1) << 32}), std::nullopt);
  EXPECT_EQ(numElements({kMaxElements, 2}), std::nullopt);
  EXPECT_EQ(numElements({kMaxElements}), kMaxElements);
  EXPECT_EQ(numElements({0, INT64_MAX}), 0);
}

TEST(StartLine, NoThreadLeavesBeforeEveryOneArrived) {
  constexpr int kThreads = 4;
  StartLine line(kThreads);
  std::atomic<int> arrived{0}, leftEarly{0}, passed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      std::this_thread::sleep_for(std::chrono::milliseconds(5 * t)); // staggered arrivals
      ++arrived;
      bool open = line.arriveAndWait();
      leftEarly += arrived.load() < kThreads;
      passed += open && std::chrono::steady_clock::now() >= line.released;
    });
  for (std::thread &t : threads)
    t.join();
  EXPECT_EQ(leftEarly.load(), 0);
  EXPECT_EQ(passed.load(), kThreads);
}

TEST(StartLine, AFailedRankReleasesTheOthersWithoutStarting) {
  StartLine line(3);
  std::atomic<int> started{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) // the third rank fails before it arrives
    threads.emplace_back([&] { started += line.arriveAndWait(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  line.fail();
  for (std::thread &t : threads)
    t.join(); // returns: a failure never leaves the others waiting
  EXPECT_EQ(started.load(), 0);
}

TEST(ThreadPool, CoversEveryIndexOnce) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> hits(100000);
  pool.parallelFor(hits.size(), 1e3, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      hits[i]++;
  });
  for (auto &h : hits)
    ASSERT_EQ(h.load(), 1);
  // One chunk per thread (the matrix products' split), and more threads than indices.
  for (int64_t n : {int64_t(100000), int64_t(3)}) {
    std::vector<std::atomic<int>> once(n);
    std::atomic<int> calls{0};
    pool.parallelFor(n, 1e6, [&](int64_t b, int64_t e) {
      ++calls;
      for (int64_t i = b; i < e; ++i)
        once[i]++;
    }, 1);
    for (auto &h : once)
      ASSERT_EQ(h.load(), 1);
    EXPECT_EQ(calls.load(), std::min<int64_t>(n, pool.size()));
  }
  // Reusable, and fine with tiny loops that run inline.
  int sum = 0;
  pool.parallelFor(3, 1.0, [&](int64_t b, int64_t e) { sum += int(e - b); });
  EXPECT_EQ(sum, 3);
}

/// out = gelu(x @ w + b), written by hand as the compiler would.
TEST(CpuBackend, HandWrittenProgram) {
  RankProgram r;
  auto buffer = [&](const char *name, Shape shape, int64_t offset) {
    Buffer b;
    b.id = static_cast<int64_t>(r.buffers.size());
    b.name = name;
    b.shape = shape;
    b.bytes = numElements(shape).value() * 4;
    b.offset = offset;
    r.buffers.push_back(b);
    return b.id;
  };
  int64_t x = buffer("x", {2, 3}, 0), w = buffer("w", {3, 2}, 32), bias = buffer("b", {2}, 64),
          y = buffer("y", {2, 2}, 96), z = buffer("z", {2, 2}, 128), o = buffer("o", {2, 2}, 160);
  r.arenaBytes = 192;
  std::vector<Instruction> prog = {{"matmul", {x, w}, {y}, {}},
                                   {"add", {y, bias}, {z}, {}},
                                   {"gelu", {z}, {o}, {{"approximate", true}}}};
  alignas(64) char arena[192] = {};
  float *f = reinterpret_cast<float *>(arena);
  float xs[] = {1, 2, 3, -1, 0, 1}, ws[] = {0.5, -1, 0.25, 0, 1, 0.5}, bs[] = {0.1f, -0.2f};
  std::memcpy(f + 0, xs, 24);
  std::memcpy(f + 8, ws, 24);
  std::memcpy(f + 16, bs, 8);
  ThreadPool pool(2);
  CpuProgram program(r, prog, arena, pool, "forward");
  program.run();
  float *out = f + 40;
  // x @ w = [[4, 0.5], [0.5, 1.5]]; + b = [[4.1, 0.3], [0.6, 1.3]]
  auto gelu = [](double v) { return 0.5 * v * (1 + std::tanh(0.7978845608 * (v + 0.044715 * v * v * v))); };
  EXPECT_NEAR(out[0], gelu(4.1), 1e-6);
  EXPECT_NEAR(out[1], gelu(0.3), 1e-6);
  EXPECT_NEAR(out[2], gelu(0.6), 1e-6);
  EXPECT_NEAR(out[3], gelu(1.3), 1e-6);

  // The same program with a mismatched shape is refused before it runs.
  prog[0].in = {x, x};
  try {
    CpuProgram bad(r, prog, arena, pool, "forward");
    FAIL() << "accepted a matmul of [2, 3] x [2, 3]";
  } catch (const Error &e) {
    EXPECT_NE(std::string(e.what()).find("instruction forward[0] 'matmul'"), std::string::npos)
        << e.what();
  }
}
