//===- PipelineScheduleTest.cpp - Schedules are complete and deadlock-free ===//

#include "compiler/planner/PipelineSchedule.h"
#include "compiler/planner/CostModel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

using namespace loom::planner;

TEST(PipelineSchedule, EveryTaskOnceAndNoDeadlock) {
  for (Schedule s : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved,
                     Schedule::ZeroBubbleH1})
    for (int64_t p : {1, 2, 3, 4, 8})
      for (int64_t m : {1, 2, 4, 8, 12, 16})
        for (int64_t v : {1, 2, 3}) {
          if (s == Schedule::Interleaved && (v < 2 || m % p != 0))
            continue;
          int64_t chunks = s == Schedule::Interleaved ? v : 1;
          int64_t kinds = s == Schedule::ZeroBubbleH1 ? 3 : 2; // F, B (and W)
          for (int64_t st = 0; st < p; ++st) {
            std::set<std::tuple<TaskKind, int64_t, int64_t>> seen;
            for (const PipelineTask &t : stageOrder(s, p, m, v, st))
              EXPECT_TRUE(seen.insert({t.kind, t.microbatch, t.chunk}).second);
            EXPECT_EQ(seen.size(), size_t(kinds * m * chunks));
          }
          std::vector<double> f(p, 1.0), b(p, 2.0);
          PipelineTimeline tl = simulatePipeline(s, p, m, v, f, b, 0.0);
          EXPECT_FALSE(tl.deadlocked) << scheduleName(s) << " p=" << p << " m=" << m << " v=" << v
                                      << ": " << tl.deadlock;
        }
}

TEST(PipelineSchedule, BubbleMatchesTheFormula) {
  // Uniform stages, no transfer: 1F1B and GPipe take (m + p - 1) slots.
  for (Schedule s : {Schedule::GPipe, Schedule::OneFOneB}) {
    int64_t p = 4, m = 8;
    PipelineTimeline tl = simulatePipeline(s, p, m, 1, std::vector<double>(p, 1.0),
                                           std::vector<double>(p, 2.0), 0.0);
    EXPECT_DOUBLE_EQ(tl.makespan, 3.0 * (m + p - 1));
    EXPECT_NEAR(tl.idleFraction(), double(p - 1) / (m + p - 1), 1e-12);
  }
  // Interleaving with v chunks cuts the bubble by about v.
  int64_t p = 4, m = 8, v = 2;
  PipelineTimeline plain = simulatePipeline(Schedule::OneFOneB, p, m, 1, std::vector<double>(p, 1.0),
                                            std::vector<double>(p, 2.0), 0.0);
  PipelineTimeline inter = simulatePipeline(Schedule::Interleaved, p, m, v,
                                            std::vector<double>(p, 1.0),
                                            std::vector<double>(p, 2.0), 0.0);
  double bubblePlain = plain.makespan - 3.0 * m, bubbleInter = inter.makespan - 3.0 * m;
  EXPECT_NEAR(bubbleInter / bubblePlain, 1.0 / v, 0.15);
}

TEST(PipelineSchedule, PerStageDurationsAreEvenChunks) {
  // The per-stage form is the per-chunk one with each stage's time split
  // evenly over its chunks, for every schedule.
  for (Schedule s : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved,
                     Schedule::ZeroBubbleH1}) {
    int64_t p = 4, m = 8, v = s == Schedule::Interleaved ? 2 : 1;
    std::vector<double> f = {1, 1.2, 0.9, 1.1}, b = {2, 2.5, 1.7, 2.1}, w = {0.8, 1, 0.7, 0.9};
    ChunkDurations d;
    for (int64_t st = 0; st < p; ++st) {
      d.forward.emplace_back(v, f[st] / v);
      d.backward.emplace_back(v, b[st] / v);
      d.weightGrad.emplace_back(v, w[st] / v);
    }
    PipelineTimeline stage = simulatePipeline(s, p, m, v, f, b, 0.05, w);
    PipelineTimeline chunk = simulatePipeline(s, p, m, v, d, 0.05);
    EXPECT_DOUBLE_EQ(stage.makespan, chunk.makespan) << scheduleName(s);
    EXPECT_DOUBLE_EQ(simulatePipeline(s, p, m, v, d, 0.05, /*keepTasks=*/false).makespan,
                     chunk.makespan);
  }
}

TEST(PipelineSchedule, UnevenChunksStallAtEveryBoundary) {
  // Interleaved, 2 stages of 2 chunks, 2 microbatches (one group of p):
  // while a microbatch's chunk runs on the other stage, a stage has only
  // the other microbatch's chunk to run, so where its chunk is the shorter
  // it waits for the difference, though both stages hold the same work (3
  // forward, 6 backward): 27 against 22.5 for even chunks.
  int64_t p = 2, m = 2, v = 2;
  ChunkDurations even{{{1.5, 1.5}, {1.5, 1.5}}, {{3, 3}, {3, 3}}, {}};
  ChunkDurations uneven{{{2, 1}, {1, 2}}, {{4, 2}, {2, 4}}, {}};
  PipelineTimeline a = simulatePipeline(Schedule::Interleaved, p, m, v, even, 0.0);
  PipelineTimeline b = simulatePipeline(Schedule::Interleaved, p, m, v, uneven, 0.0);
  ASSERT_FALSE(a.deadlocked || b.deadlocked) << a.deadlock << b.deadlock;
  EXPECT_DOUBLE_EQ(a.makespan, 22.5);
  EXPECT_DOUBLE_EQ(b.makespan, 27);
  // The per-stage form only sees the totals: it times both alike.
  EXPECT_DOUBLE_EQ(simulatePipeline(Schedule::Interleaved, p, m, v, {3, 3}, {6, 6}, 0.0).makespan,
                   a.makespan);
  // Transfers lengthen it; durations missing for a chunk are refused.
  EXPECT_GT(simulatePipeline(Schedule::Interleaved, p, m, v, uneven, 0.1).makespan, b.makespan);
  ChunkDurations missing{{{1, 2}, {2}}, {{2, 4}, {4, 2}}, {}};
  PipelineTimeline bad = simulatePipeline(Schedule::Interleaved, p, m, v, missing, 0.0);
  EXPECT_TRUE(bad.deadlocked);
  EXPECT_NE(bad.deadlock.find("durations"), std::string::npos);
  // Interleaving 3 microbatches over 2 stages has no order: refused, not run.
  PipelineTimeline odd = simulatePipeline(Schedule::Interleaved, p, 3, v, even, 0.0);
  EXPECT_TRUE(odd.deadlocked);
  EXPECT_NE(odd.deadlock.find("multiple of pp"), std::string::npos) << odd.deadlock;
}

TEST(PipelineSchedule, ZeroBubbleH1BubbleIsAThirdOfOneFOneB) {
  // Qi et al. 2024: with m >= p, 1F1B idles (p-1)(F + B + W) per stage and
  // ZB-H1 (p-1)(F + B - W); with F = B = W that is a third.
  for (int64_t p : {2, 4, 8})
    for (int64_t m : {8, 16, 32}) {
      std::vector<double> f(p, 1.0), b(p, 2.0), w(p, 1.0);
      PipelineTimeline plain = simulatePipeline(Schedule::OneFOneB, p, m, 1, f, b, 0.0);
      PipelineTimeline zb = simulatePipeline(Schedule::ZeroBubbleH1, p, m, 1, f, b, 0.0, w);
      ASSERT_FALSE(zb.deadlocked) << zb.deadlock;
      double bubblePlain = plain.makespan - 3.0 * m, bubbleZb = zb.makespan - 3.0 * m;
      EXPECT_DOUBLE_EQ(bubblePlain, 3.0 * (p - 1));
      EXPECT_DOUBLE_EQ(bubbleZb, 1.0 * (p - 1)) << "p=" << p << " m=" << m;
      EXPECT_NEAR(zb.idleFraction() * p * zb.makespan, p * bubbleZb, 1e-9);
    }
  // A smaller W fills less: F = 1, B = 1.4, W = 0.6 leaves (p-1)(F + B - W).
  int64_t p = 4, m = 16;
  PipelineTimeline zb = simulatePipeline(Schedule::ZeroBubbleH1, p, m, 1, std::vector<double>(p, 1.0),
                                         std::vector<double>(p, 2.0), 0.0,
                                         std::vector<double>(p, 0.6));
  EXPECT_NEAR(zb.makespan - 3.0 * m, (p - 1) * (1.0 + 1.4 - 0.6), 1e-9);
  // The cost model's formula says the same.
  EXPECT_NEAR(bubbleFraction(Schedule::ZeroBubbleH1, p, m, 1, 1.0 / 3, 0.6 / 3) * 3.0 * m,
              (p - 1) * (1.0 + 1.4 - 0.6), 1e-9);
}

TEST(PipelineSchedule, ZeroBubbleH1WaitsOnlyForTheInputGradient) {
  // Stage 0 of 2 runs B0 as soon as stage 1's B0 ends, before stage 1's W0.
  PipelineTimeline tl = simulatePipeline(Schedule::ZeroBubbleH1, 2, 4, 1, {1, 1}, {2, 2}, 0.0,
                                         {1, 1});
  auto find = [&](int64_t st, TaskKind kind, int64_t mb) {
    for (const TimedTask &t : tl.stages[st])
      if (t.task.kind == kind && t.task.microbatch == mb)
        return t;
    return TimedTask{};
  };
  EXPECT_DOUBLE_EQ(find(1, TaskKind::Backward, 0).end, 3.0);
  EXPECT_DOUBLE_EQ(find(0, TaskKind::Backward, 0).start, 3.0);
  EXPECT_GE(find(0, TaskKind::Weight, 0).start, find(0, TaskKind::Backward, 0).end);
}

TEST(PipelineSchedule, OneFOneBHoldsFewerActivations) {
  // Peak forwards outstanding on stage 0: p for 1F1B, m for GPipe.
  auto peak = [](const std::vector<PipelineTask> &order) {
    int64_t live = 0, most = 0;
    for (const PipelineTask &t : order) {
      // A microbatch holds its activations until its last backward task.
      bool last = t.kind == TaskKind::Weight ||
                  (t.kind == TaskKind::Backward &&
                   std::none_of(order.begin(), order.end(),
                                [](const PipelineTask &o) { return o.kind == TaskKind::Weight; }));
      live += t.kind == TaskKind::Forward ? 1 : last ? -1 : 0;
      most = std::max(most, live);
    }
    return most;
  };
  EXPECT_EQ(peak(stageOrder(Schedule::OneFOneB, 4, 16, 1, 0)), 4);
  EXPECT_EQ(peak(stageOrder(Schedule::OneFOneB, 4, 16, 1, 3)), 1);
  EXPECT_EQ(peak(stageOrder(Schedule::GPipe, 4, 16, 1, 0)), 16);
  // ZB-H1 never holds more than 1F1B's first stage: p on every stage.
  for (int64_t st = 0; st < 4; ++st)
    EXPECT_EQ(peak(stageOrder(Schedule::ZeroBubbleH1, 4, 16, 1, st)), 4) << "stage " << st;
  EXPECT_EQ(peak(stageOrder(Schedule::ZeroBubbleH1, 4, 2, 1, 3)), 2);
}

TEST(PipelineSchedule, SvgDrawsWeightGradientTasks) {
  PipelineTimeline tl =
      simulatePipeline(Schedule::ZeroBubbleH1, 2, 4, 1, {1, 1}, {2, 2}, 0.0, {1, 1});
  std::string svg = timelineSvg(tl, SvgExtras{});
  EXPECT_NE(svg.find("weight gradient microbatch 3"), std::string::npos);
  EXPECT_NE(svg.find(">W3<"), std::string::npos);
  std::string plain = timelineSvg(
      simulatePipeline(Schedule::OneFOneB, 2, 4, 1, {1, 1}, {2, 2}, 0.0), SvgExtras{});
  EXPECT_EQ(plain.find("weight gradient"), std::string::npos);
}

TEST(PipelineSchedule, SvgHasARowPerDevice) {
  PipelineTimeline tl = simulatePipeline(Schedule::OneFOneB, 3, 4, 1, {1, 1, 1}, {2, 2, 2}, 0.1);
  SvgExtras x;
  x.title = "test";
  x.weightBytes = {1e9, 1e9, 1e9};
  x.activationBytes = {2e9, 1e9, 5e8};
  x.deviceMemoryBytes = 8e9;
  std::string svg = timelineSvg(tl, x);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("device 2"), std::string::npos);
  EXPECT_EQ(svg.find("device 3"), std::string::npos);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
}
