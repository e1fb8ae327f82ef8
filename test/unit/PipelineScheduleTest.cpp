//===- PipelineScheduleTest.cpp - Schedules are complete and deadlock-free ===//

#include "compiler/planner/PipelineSchedule.h"

#include <gtest/gtest.h>

#include <set>

using namespace loom::planner;

TEST(PipelineSchedule, EveryTaskOnceAndNoDeadlock) {
  for (Schedule s : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved})
    for (int64_t p : {1, 2, 3, 4, 8})
      for (int64_t m : {1, 2, 4, 8, 12, 16})
        for (int64_t v : {1, 2, 3}) {
          if (s == Schedule::Interleaved && (v < 2 || m % p != 0))
            continue;
          int64_t chunks = s == Schedule::Interleaved ? v : 1;
          for (int64_t st = 0; st < p; ++st) {
            std::set<std::tuple<bool, int64_t, int64_t>> seen;
            for (const PipelineTask &t : stageOrder(s, p, m, v, st))
              EXPECT_TRUE(seen.insert({t.forward, t.microbatch, t.chunk}).second);
            EXPECT_EQ(seen.size(), size_t(2 * m * chunks));
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

TEST(PipelineSchedule, OneFOneBHoldsFewerActivations) {
  // Peak forwards outstanding on stage 0: p for 1F1B, m for GPipe.
  auto peak = [](const std::vector<PipelineTask> &order) {
    int64_t live = 0, most = 0;
    for (const PipelineTask &t : order) {
      live += t.forward ? 1 : -1;
      most = std::max(most, live);
    }
    return most;
  };
  EXPECT_EQ(peak(stageOrder(Schedule::OneFOneB, 4, 16, 1, 0)), 4);
  EXPECT_EQ(peak(stageOrder(Schedule::OneFOneB, 4, 16, 1, 3)), 1);
  EXPECT_EQ(peak(stageOrder(Schedule::GPipe, 4, 16, 1, 0)), 16);
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
