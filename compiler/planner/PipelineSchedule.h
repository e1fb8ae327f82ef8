//===- PipelineSchedule.h - Per-stage task orders and their timing -*- C++ -*-===//
//
// The order in which each pipeline stage runs its forward and backward
// microbatch tasks under GPipe, 1F1B and interleaved 1F1B (Narayanan et al.
// 2021), and an event-driven simulation of all stages together that times
// them and detects a deadlock (a state where no stage can run its next task).
// The partitioner uses the same orders for each rank's instruction stream.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_PLANNER_PIPELINESCHEDULE_H
#define LOOM_COMPILER_PLANNER_PIPELINESCHEDULE_H

#include "compiler/planner/CostModel.h"

#include <string>
#include <vector>

namespace loom::planner {

struct PipelineTask {
  bool forward = true;
  int64_t microbatch = 0;
  int64_t chunk = 0; // virtual stage index on this device (0 unless interleaved)
};

/// Task order of `stage` (0-based) for p stages, m microbatches, v chunks.
std::vector<PipelineTask> stageOrder(Schedule s, int64_t p, int64_t m, int64_t v, int64_t stage);

struct TimedTask {
  PipelineTask task;
  double start = 0, end = 0;
};

struct PipelineTimeline {
  std::vector<std::vector<TimedTask>> stages;
  double makespan = 0;
  bool deadlocked = false;
  std::string deadlock; // which tasks wait on which, when deadlocked
  /// Fraction of stage-time idle inside the makespan.
  double idleFraction() const;
};

/// Simulates every stage; forward/backward durations are per chunk and
/// microbatch on each stage, `transfer` the send time between stages.
PipelineTimeline simulatePipeline(Schedule s, int64_t p, int64_t m, int64_t v,
                                  const std::vector<double> &forward,
                                  const std::vector<double> &backward, double transfer);

/// The timeline as an SVG: one row per stage, forward boxes blue, backward
/// green (darker for later chunks), idle time visible, the gradient reduction
/// and optimizer step marked after the flush, and a memory bar per stage.
struct SvgExtras {
  std::string title;
  double dpCommSeconds = 0, optimizerSeconds = 0;
  std::vector<double> weightBytes, activationBytes;
  double deviceMemoryBytes = 0;
};
std::string timelineSvg(const PipelineTimeline &timeline, const SvgExtras &extras);

} // namespace loom::planner

#endif
