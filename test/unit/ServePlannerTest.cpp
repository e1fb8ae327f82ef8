//===- ServePlannerTest.cpp - The tensor-parallel degree of a serving bundle ===//

#include "compiler/planner/ServePlanner.h"

#include <gtest/gtest.h>

using namespace loom::planner;

namespace {

/// `layers` transformer layers of hidden width h (12 h^2 parameters each,
/// all split by tensor parallelism, two all-reduces each), 16 heads, and an
/// output head of `vocab` x h.
ModelSpec decoder(int layers, double h, double vocab, double seq = 1024) {
  ModelSpec spec;
  spec.name = "decoder";
  for (int i = 0; i < layers; ++i) {
    LayerSpec l;
    l.name = "layer." + std::to_string(i);
    l.params = l.shardedParams = 12 * h * h;
    l.isTransformer = true;
    l.hidden = h, l.heads = 16, l.seq = seq;
    l.tpAllReduces = 2, l.tpDivisor = 16;
    l.instructions = 17;
    spec.layers.push_back(l);
  }
  LayerSpec head;
  head.name = "head";
  head.params = head.shardedParams = vocab * h;
  head.hidden = h, head.seq = seq, head.tpDivisor = 16, head.instructions = 3;
  spec.layers.push_back(head);
  return spec;
}

Cluster node(int gpus) {
  Cluster c;
  std::string error;
  EXPECT_TRUE(parseCluster("h100:" + std::to_string(gpus), c, error)) << error;
  return c;
}

} // namespace

TEST(ServePlanner, SmallModelsStayOnOneGpuEitherWay) {
  // GPT-2 350M's shape: a step is bound by launches, which tp does not shrink.
  ModelSpec spec = decoder(24, 1024, 50304);
  for (const char *objective : {"latency", "throughput"}) {
    ServePlan p = planServing(spec, node(2), 32, 256, objective);
    ASSERT_TRUE(p.found) << p.error;
    EXPECT_EQ(p.tp, 1) << objective;
    ASSERT_EQ(p.candidates.size(), 2u);
    EXPECT_GT(p.candidates[1].latencySeconds, p.candidates[0].latencySeconds);
    // Memory halves with tp (all parameters are split here).
    EXPECT_NEAR(p.candidates[1].memoryBytes * 2, p.candidates[0].memoryBytes, 1.0);
  }
}

TEST(ServePlanner, LatencySplitsAModelWhoseReadsDominate) {
  // 80 layers of width 8192 (about 64B parameters, 129 GB of bf16): tp 1 and
  // 2 do not fit an 80 GB GPU; reads dominate, so latency takes the widest split.
  ModelSpec spec = decoder(80, 8192, 32000, 4096);
  ServePlan p = planServing(spec, node(8), 1, 4096, "latency");
  ASSERT_TRUE(p.found) << p.error;
  EXPECT_EQ(p.tp, 8);
  EXPECT_FALSE(p.candidates[0].fits);
  EXPECT_NE(p.candidates[0].why.find("needs"), std::string::npos) << p.candidates[0].why;
  // Throughput per GPU favours the narrowest split that fits.
  ServePlan q = planServing(spec, node(8), 4, 4096, "throughput");
  ASSERT_TRUE(q.found) << q.error;
  EXPECT_EQ(q.tp, 4);
  EXPECT_NE(describeServePlan(q, node(8)).find("<- chosen"), std::string::npos);
}

TEST(ServePlanner, RefusesWithTheReason) {
  ModelSpec spec = decoder(2, 256, 1000);
  EXPECT_FALSE(planServing(spec, node(2), 1, 64, "fastest").found);
  EXPECT_NE(planServing(spec, node(2), 1, 64, "fastest").error.find("latency or throughput"), std::string::npos);
  spec.layers[0].tpDivisor = 3; // three heads: only tp 1
  ServePlan p = planServing(spec, node(4), 1, 64, "latency");
  ASSERT_TRUE(p.found);
  EXPECT_EQ(p.tp, 1);
  EXPECT_NE(p.candidates[1].why.find("does not divide"), std::string::npos);
  // Nothing fits: the error lists every degree's reason.
  ModelSpec huge = decoder(200, 16384, 32000, 4096);
  ServePlan none = planServing(huge, node(2), 1, 4096, "latency");
  EXPECT_FALSE(none.found);
  EXPECT_NE(none.error.find("tp 2: needs"), std::string::npos) << none.error;
}

TEST(ServePlanner, GroupedQueryAttentionCachesItsKeyValueHeadsOnly) {
  // TinyLlama's attention: 32 query heads, 4 key/value heads, so each token
  // caches a key and a value row an eighth of the hidden width.
  const double h = 2048, batch = 32, seq = 256;
  ModelSpec mha = decoder(22, h, 32000), gqa = mha;
  for (LayerSpec &l : gqa.layers)
    if (l.isTransformer)
      l.kvWidth = h / 8;
  ServePlan a = planServing(mha, node(1), int64_t(batch), int64_t(seq), "latency");
  ServePlan b = planServing(gqa, node(1), int64_t(batch), int64_t(seq), "latency");
  ASSERT_TRUE(a.found && b.found) << a.error << b.error;
  double mhaCache = 22 * 2 * 2 * h * batch * seq; // k and v, bf16, every layer
  EXPECT_NEAR(a.candidates[0].memoryBytes - b.candidates[0].memoryBytes, mhaCache * 7 / 8, 1.0);
  EXPECT_LT(b.candidates[0].batchStepSeconds, a.candidates[0].batchStepSeconds); // fewer cached rows read
}
