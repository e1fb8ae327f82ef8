//===- CpuCollectivesTest.cpp - Buckets over two CPU ranks -----------------===//
//
// A data-parallel bucket averages its gradients over the ranks; since the
// ninth session of 2026-11-27 it may read bf16 gradients and write their
// f32 means (the casts folded into it). Two ranks in threads over an
// in-process communicator: a bucket mixing widened and in-place tensors,
// then a bucket of one that widens (the split last bucket), both async,
// the second waited for by the next program. The values are chosen so that
// every mean is exact in f32.
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
using loom::rt::test::floatBytes;

TEST(CpuCollectives, BucketsWidenBf16GradientsIntoTheirMeans) {
  loom::rt::test::ProgramBuilder p;
  std::vector<std::pair<int64_t, loom_dtype_t>> first = {{5, LOOM_BF16}, {3, LOOM_F32}, {1, LOOM_BF16}};
  Instruction bucket{"all_reduce", {}, {}, {{"reduction", "mean"}, {"group", "dp"}, {"async", true}, {"event", 0}}};
  for (auto [n, dt] : first) {
    int64_t in = p.add({n}, dt, "g");
    bucket.in.push_back(in);
    bucket.out.push_back(dt == LOOM_F32 ? in : p.add({n}, LOOM_F32, "m"));
  }
  int64_t last = p.add({7}, LOOM_BF16, "g"), lastMean = p.add({7}, LOOM_F32, "m");
  Instruction one{"all_reduce", {last}, {lastMean}, {{"reduction", "mean"}, {"group", "dp"}, {"async", true}, {"event", 1}}};
  RankProgram r = p.finish({});
  r.programs.erase("forward");
  r.programs["backward"] = {bucket, one};
  r.programs["update"] = {Instruction{"event_wait", {}, {}, {{"event", 1}}}};
  r.groups["dp"] = {0, 1};
  InProcessCommunicator comm(2, /*timeoutSeconds=*/20);
  // Rank k's element i of tensor t: (k + 1) * (i + 1) * (t + 1); the mean
  // over both ranks is 1.5 * (i + 1) * (t + 1).
  std::vector<int64_t> ins = bucket.in, outs = bucket.out;
  ins.push_back(last), outs.push_back(lastMean);
  std::vector<std::vector<std::vector<float>>> got(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int k = 0; k < 2; ++k)
    ranks.emplace_back([&, k] {
      try {
        RankProgram mine = r;
        mine.rank = k;
        auto be = makeCpuBackend(mine, 1, &comm);
        for (size_t t = 0; t < ins.size(); ++t) {
          const Buffer &b = mine.buffers[ins[t]];
          std::vector<char> bytes = floatBytes(b, [&](int64_t i) { return float((k + 1) * (i + 1) * (t + 1)); });
          be->upload(b, bytes.data());
        }
        for (const char *name : {"backward", "update"}) {
          be->prepare(name, mine.programs[name]);
          be->run(name);
        }
        for (int64_t id : outs) {
          std::vector<float> v(size_t(numElements(mine.buffers[id].shape).value()));
          be->download(mine.buffers[id], v.data());
          got[k].push_back(v);
        }
      } catch (const Error &e) {
        errors[k] = e.what();
        comm.abort(k, e.what());
      }
    });
  for (auto &t : ranks)
    t.join();
  for (int k = 0; k < 2; ++k) {
    ASSERT_EQ(errors[k], "") << "rank " << k;
    for (size_t t = 0; t < outs.size(); ++t)
      for (size_t i = 0; i < got[k][t].size(); ++i)
        ASSERT_EQ(got[k][t][i], 1.5f * float((i + 1) * (t + 1))) << "rank " << k << ", tensor " << t << "[" << i << "]";
  }
}
