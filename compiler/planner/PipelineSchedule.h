//===- PipelineSchedule.h - Per-stage task orders and their timing -*- C++ -*-===//
//
// The order in which each pipeline stage runs its forward and backward
// microbatch tasks under GPipe, 1F1B, interleaved 1F1B (Narayanan et al.
// 2021) and ZB-H1 (Qi et al. 2024, backward split into input-gradient and
// weight-gradient tasks), and an event-driven simulation of all stages
// together that times them and detects a deadlock (a state where no stage can
// run its next task).
// The partitioner uses the same orders for each rank's instruction stream.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_PLANNER_PIPELINESCHEDULE_H
#define LOOM_COMPILER_PLANNER_PIPELINESCHEDULE_H

#include "compiler/planner/CostModel.h"

#include <string>
#include <vector>

namespace loom::planner {

/// Forward; Backward: the whole backward, or under ZB-H1 only its
/// input-gradient part (what the previous stage waits for); Weight: the
/// weight-gradient part that ZB-H1 runs later, on the same stage.
enum class TaskKind { Forward, Backward, Weight };

struct PipelineTask {
  TaskKind kind = TaskKind::Forward;
  int64_t microbatch = 0;
  int64_t chunk = 0; // virtual stage index on this device (0 unless interleaved)
};

/// "F", "B" or "W".
const char *taskLetter(TaskKind kind);

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

/// Durations of one microbatch's tasks, [stage][chunk]: each stage's v
/// chunks (interleaved) or its one (other schedules). `weightGrad` is the
/// weight-gradient part of each backward, which ZB-H1 runs as its own task
/// (W) and the other schedules ignore; empty means half the backward.
struct ChunkDurations {
  std::vector<std::vector<double>> forward, backward, weightGrad;
};

/// Simulates every stage, each running its stageOrder: a task starts when
/// its stage is free and what it needs has arrived, `transfer` (the send
/// time between devices) after the neighbouring chunk's task ends. Chunks of
/// uneven length stall their neighbours at every boundary, which a
/// stage's total over v cannot show. A deadlock, or a stage or chunk
/// without durations, is reported in `deadlocked` and `deadlock`. Time and
/// memory are linear in the number of tasks; without `keepTasks` only the
/// makespan (and any deadlock) is kept, `stages` holding no tasks.
/// `orders`, where given, must be stageOrders(s, p, m, v): simulations of
/// one pipeline shape may share them.
PipelineTimeline simulatePipeline(Schedule s, int64_t p, int64_t m, int64_t v,
                                  const ChunkDurations &durations, double transfer,
                                  bool keepTasks = true,
                                  const std::vector<std::vector<PipelineTask>> *orders = nullptr);

/// stageOrder of every stage (v is 1 unless the schedule is interleaved).
std::vector<std::vector<PipelineTask>> stageOrders(Schedule s, int64_t p, int64_t m, int64_t v);

/// The same with each stage's durations per microbatch, split evenly over
/// its chunks (the forward/backward of one chunk is the stage's over v).
PipelineTimeline simulatePipeline(Schedule s, int64_t p, int64_t m, int64_t v,
                                  const std::vector<double> &forward,
                                  const std::vector<double> &backward, double transfer,
                                  const std::vector<double> &weightGrad = {});

/// The timeline as an SVG: one row per stage, forward boxes blue, backward
/// green (darker for later chunks), weight-gradient tasks purple, idle time
/// visible, the gradient reduction and optimizer step marked after the
/// flush, and a memory bar per stage.
struct SvgExtras {
  std::string title;
  double dpCommSeconds = 0, optimizerSeconds = 0;
  std::vector<double> weightBytes, activationBytes;
  double deviceMemoryBytes = 0;
};
std::string timelineSvg(const PipelineTimeline &timeline, const SvgExtras &extras);

} // namespace loom::planner

#endif
