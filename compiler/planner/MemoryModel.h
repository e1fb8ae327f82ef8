//===- MemoryModel.h - A stage's memory as the compiler plans it -*- C++ -*-===//
//
// What one device of a pipeline stage holds during a training step, modelled
// on what the compiler does rather than on a published formula: the memory
// plan (passes/PlanMemory.cpp) puts the parameters and optimizer state in
// front of one arena and packs everything else by lifetime behind them, so
// gradients, born as the backward goes down the layers, take the memory that
// the activations it frees leave; the peak is the largest sum of what is live
// at one point of the backward.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_PLANNER_MEMORYMODEL_H
#define LOOM_COMPILER_PLANNER_MEMORYMODEL_H

#include "compiler/planner/CostModel.h"

#include <string>
#include <utility>
#include <vector>

namespace loom::planner {

/// One layer on one device of a plan: elements are per device (tensor
/// parallelism applied), bytes per microbatch.
struct LayerMemory {
  double params = 0;             // parameter elements
  double backwardReadParams = 0; // of them, those whose working copy the backward reads
  double keptBytes = 0;          // kept from the forward for the backward
  double backwardBytes = 0;      // held only while the layer's backward runs
  double deferredBytes = 0;      // held from the backward to ZB-H1's deferred weight gradients
  bool recomputed = false;       // full recomputation redoes its forward in backward
  std::vector<std::pair<std::string, double>> tied; // shared tensors: name, elements
};

struct StageMemory {
  double persistentBytes = 0; // parameters and optimizer state
  double peakBytes = 0;       // the arena's activation region at its peak
};

/// How a stage's schedule keeps microbatches.
struct StageSchedule {
  double inFlight = 1; // microbatches holding their activations at the peak
  double deferred = 0; // more holding what their deferred weight gradients read
  /// The step sums several microbatches' gradients into accumulators, which,
  /// with every weight copy, live through the whole step; the model keeps a
  /// microbatch's own weight gradients until the end of its chunk's
  /// backward. (passes/PipelineSchedule.cpp adds each to its sum as soon as
  /// it is made since the sixteenth session of 2026-11-28; GPT-2 350M's
  /// microbatched arenas did not change, the peak falling elsewhere.)
  bool microbatched = false;
  bool weightTaskApart = false; // ZB-H1: weight gradients in a task after the backward
};

/// The memory of a device holding `chunks` (their layers in forward order;
/// one chunk but with interleaving).
StageMemory stageMemory(const std::vector<std::vector<LayerMemory>> &chunks, const ParameterBytes &bytes,
                        const StageSchedule &schedule);

} // namespace loom::planner

#endif
