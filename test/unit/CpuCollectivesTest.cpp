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
