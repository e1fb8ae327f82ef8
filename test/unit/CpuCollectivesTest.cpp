//===- CpuCollectivesTest.cpp - Buckets over two CPU ranks -----------------===//
//
// A data-parallel bucket averages its gradients over the ranks; since the
// ninth session of 2026-11-27 it may read bf16 gradients and write their
// f32 means (the casts folded into it). Two ranks in threads over an
// in-process communicator: a bucket mixing widened and in-place tensors,
// then a bucket of one that widens (the split last bucket), both async,
// the second waited for by the next program. The values are chosen so that
// every mean is exact in f32; averaged in bf16 ("wire" = "bf16"), a bf16
// gradient's mean is rounded to bf16 before it is widened.
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Bundle.h"
#include "loom/rt/Error.h"
#include "loom/rt/Tensor.h"
#include "runtime/src/Backend.h"
#include "runtime/src/Communicator.h"
#include "test/unit/SingleInstruction.h"

#include <gtest/gtest.h>

#include <thread>

using namespace loom::rt;
using loom::rt::test::downloadFloats;
using loom::rt::test::floatBytes;

namespace {

/// The buckets above over two ranks, rank k's element i of tensor t being
/// value(k, i, t); each rank's outputs (the means), or a failed test.
struct TwoRankBuckets {
  std::vector<int64_t> ins, outs;
  std::vector<loom_dtype_t> dtypes; // of each input
  RankProgram program;
};

TwoRankBuckets bucketsOf(const std::string &wire, bool bf16InPlace = false) {
  loom::rt::test::ProgramBuilder p;
  std::vector<std::pair<int64_t, loom_dtype_t>> first = {{5, LOOM_BF16}, {3, LOOM_F32}, {1, LOOM_BF16}};
  Instruction bucket{"all_reduce", {}, {}, {{"reduction", "mean"}, {"group", "dp"}, {"async", true}, {"event", 0}}};
  TwoRankBuckets b;
  for (auto [n, dt] : first) {
    int64_t in = p.add({n}, dt, "g");
    bucket.in.push_back(in);
    bucket.out.push_back(dt == LOOM_F32 || bf16InPlace ? in : p.add({n}, LOOM_F32, "m"));
    b.dtypes.push_back(dt);
  }
  int64_t last = p.add({7}, LOOM_BF16, "g"), lastMean = bf16InPlace ? last : p.add({7}, LOOM_F32, "m");
  Instruction one{"all_reduce", {last}, {lastMean}, {{"reduction", "mean"}, {"group", "dp"}, {"async", true}, {"event", 1}}};
  if (wire != "f32")
    bucket.attrs["wire"] = wire, one.attrs["wire"] = wire;
  b.program = p.finish({});
  b.program.programs.erase("forward");
  b.program.programs["backward"] = {bucket, one};
  b.program.programs["update"] = {Instruction{"event_wait", {}, {}, {{"event", 1}}}};
  b.program.groups["dp"] = {0, 1};
  b.ins = bucket.in, b.outs = bucket.out;
  b.ins.push_back(last), b.outs.push_back(lastMean), b.dtypes.push_back(LOOM_BF16);
  return b;
}

template <typename Value>
std::vector<std::vector<std::vector<float>>> runOnTwoRanks(const TwoRankBuckets &b, Value value) {
  InProcessCommunicator comm(2, /*timeoutSeconds=*/20);
  std::vector<std::vector<std::vector<float>>> got(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int k = 0; k < 2; ++k)
    ranks.emplace_back([&, k] {
      try {
        RankProgram mine = b.program;
        mine.rank = k;
        auto be = makeCpuBackend(mine, 1, &comm);
        for (size_t t = 0; t < b.ins.size(); ++t) {
          const Buffer &buf = mine.buffers[b.ins[t]];
          std::vector<char> bytes = floatBytes(buf, [&](int64_t i) { return value(k, i, int64_t(t)); });
          be->upload(buf, bytes.data());
        }
        for (const char *name : {"backward", "update"}) {
          be->prepare(name, mine.programs[name]);
          be->run(name);
        }
        for (int64_t id : b.outs) // f32 means, or bf16 ones reduced in place
          got[k].push_back(downloadFloats(*be, mine.buffers[id]));
      } catch (const Error &e) {
        errors[k] = e.what();
        comm.abort(k, e.what());
      }
    });
  for (auto &t : ranks)
    t.join();
  for (int k = 0; k < 2; ++k)
    EXPECT_EQ(errors[k], "") << "rank " << k;
  return got;
}

} // namespace

TEST(CpuCollectives, BucketsWidenBf16GradientsIntoTheirMeans) {
  // Rank k's element i of tensor t: (k + 1) * (i + 1) * (t + 1); the mean
  // over both ranks is 1.5 * (i + 1) * (t + 1).
  TwoRankBuckets b = bucketsOf("f32");
  auto got = runOnTwoRanks(b, [](int k, int64_t i, int64_t t) { return float((k + 1) * (i + 1) * (t + 1)); });
  for (int k = 0; k < 2; ++k)
    for (size_t t = 0; t < b.outs.size() && got[k].size() == b.outs.size(); ++t)
      for (size_t i = 0; i < got[k][t].size(); ++i)
        ASSERT_EQ(got[k][t][i], 1.5f * float((i + 1) * (t + 1))) << "rank " << k << ", tensor " << t << "[" << i << "]";
}

/// Both ranks' values are bf16 numbers 2^-7 apart, so each mean, 1 + (2 i +
/// 3) 2^-8, needs one bit more than bf16 has: a bf16 input's mean must be
/// rounded to nearest even (every other one up), an f32 input's exact.
static void expectBf16MeansRounded(const TwoRankBuckets &b) {
  auto value = [](int k, int64_t i, int64_t) { return 1.0f + float(i + 1 + k) / 128.0f; };
  auto got = runOnTwoRanks(b, value);
  int roundedUp = 0, checked = 0;
  for (int k = 0; k < 2; ++k)
    for (size_t t = 0; t < b.outs.size() && got[k].size() == b.outs.size(); ++t)
      for (size_t i = 0; i < got[k][t].size(); ++i) {
        float mean = (value(0, int64_t(i), 0) + value(1, int64_t(i), 0)) / 2;
        float want = b.dtypes[t] == LOOM_BF16 ? bf16ToFloat(floatToBf16(mean)) : mean;
        ASSERT_EQ(got[k][t][i], want) << "rank " << k << ", tensor " << t << "[" << i << "]";
        roundedUp += want > mean, ++checked;
      }
  EXPECT_EQ(checked, 2 * (5 + 3 + 1 + 7)); // every tensor of both ranks
  EXPECT_GT(roundedUp, 0);                 // the rounding happened
}

TEST(CpuCollectives, BucketsAveragedInBf16RoundTheirMeansToBf16) {
  // "wire" = "bf16" (loomc compile --grad-reduce bf16): the means widened
  // into f32 copies.
  expectBf16MeansRounded(bucketsOf("bf16"));
}

TEST(CpuCollectives, Bf16GradientsAveragedInPlaceHoldTheirRoundedMeans) {
  // loomc compile --grad-reduce bf16 where only the update reads the means:
  // each bf16 gradient is averaged in place, the update reading the bf16
  // mean. The bucket is async: its results come after the instruction has
  // returned, and the reduction writes them to the bf16 storage itself.
  expectBf16MeansRounded(bucketsOf("f32", /*bf16InPlace=*/true));
}

/// Sequence parallelism's pair over two ranks: `reduce_scatter` along an
/// axis keeps this rank's part of the sum, `all_gather` along it puts the
/// parts back in group order, so gathering the scattered sum gives every
/// rank the whole sum. Rank k's element i is (k + 1) * (i + 1) (integers:
/// every sum exact in f32 and in bf16 below 256); axis 0 (the parts
/// contiguous, as the compiler splits the tokens) and axis 1 (each part a
/// run per leading index).
static void expectScatterThenGather(loom_dtype_t dtype, Shape shape, int64_t axis) {
  loom::rt::test::ProgramBuilder p;
  Shape partShape = shape;
  partShape[size_t(axis)] /= 2;
  int64_t x = p.add(shape, dtype, "x"), part = p.add(partShape, dtype, "part"), whole = p.add(shape, dtype, "whole");
  nlohmann::json attrs = {{"group", "tp"}, {"axis", axis}, {"parts", 2}};
  nlohmann::json sum = attrs;
  sum["reduction"] = "sum";
  RankProgram program = p.finish({Instruction{"reduce_scatter", {x}, {part}, sum},
                                  Instruction{"all_gather", {part}, {whole}, attrs}});
  program.groups["tp"] = {0, 1};
  InProcessCommunicator comm(2, /*timeoutSeconds=*/20);
  std::vector<std::vector<float>> parts(2), wholes(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int k = 0; k < 2; ++k)
    ranks.emplace_back([&, k] {
      try {
        RankProgram mine = program;
        mine.rank = k;
        auto be = makeCpuBackend(mine, 1, &comm);
        const Buffer &in = mine.buffers[x];
        std::vector<char> bytes = floatBytes(in, [&](int64_t i) { return float((k + 1) * (i + 1)); });
        be->upload(in, bytes.data());
        be->prepare("forward", mine.programs["forward"]);
        be->run("forward");
        parts[k] = downloadFloats(*be, mine.buffers[part]);
        wholes[k] = downloadFloats(*be, mine.buffers[whole]);
      } catch (const Error &e) {
        errors[k] = e.what();
        comm.abort(k, e.what());
      }
    });
  for (auto &t : ranks)
    t.join();
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < axis; ++d)
    outer *= shape[size_t(d)];
  for (size_t d = size_t(axis); d < shape.size(); ++d)
    inner *= shape[d];
  inner /= 2; // one part's run per leading index
  for (int k = 0; k < 2; ++k) {
    ASSERT_EQ(errors[k], "") << "rank " << k;
    ASSERT_EQ(int64_t(wholes[k].size()), outer * inner * 2);
    for (size_t i = 0; i < wholes[k].size(); ++i)
      ASSERT_EQ(wholes[k][i], 3.0f * float(i + 1)) << "rank " << k << " whole[" << i << "]";
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t j = 0; j < inner; ++j) {
        int64_t from = (o * 2 + k) * inner + j; // the element of the whole it holds
        ASSERT_EQ(parts[k][size_t(o * inner + j)], 3.0f * float(from + 1))
            << "rank " << k << " part [" << o << ", " << j << "]";
      }
  }
}

TEST(CpuCollectives, SequenceParallelScatterAndGatherAlongTheTokens) {
  expectScatterThenGather(LOOM_F32, {4, 3, 5}, 0);
  expectScatterThenGather(LOOM_BF16, {4, 3, 5}, 0);
}

TEST(CpuCollectives, SequenceParallelScatterAndGatherAlongAnInnerAxis) {
  expectScatterThenGather(LOOM_F32, {2, 4, 3}, 1);
}

TEST(CpuCollectives, ReduceScatterRefusesPartsThatDoNotDivide) {
  loom::rt::test::ProgramBuilder p;
  int64_t x = p.add({3, 2}, LOOM_F32, "x"), part = p.add({1, 2}, LOOM_F32, "part");
  RankProgram program =
      p.finish({Instruction{"reduce_scatter", {x}, {part}, {{"group", "tp"}, {"axis", 0}, {"parts", 2}}}});
  program.groups["tp"] = {0, 1};
  InProcessCommunicator comm(2, /*timeoutSeconds=*/5);
  try {
    auto be = makeCpuBackend(program, 1, &comm);
    be->prepare("forward", program.programs["forward"]);
    FAIL() << "a [3, 2] tensor scattered over two ranks was accepted";
  } catch (const Error &e) {
    EXPECT_NE(std::string(e.what()).find("needs 2 equal parts"), std::string::npos) << e.what();
  }
}
