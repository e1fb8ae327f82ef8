//===- ServePlanner.h - How far to split a decoder for serving -*- C++ -*-===//
//
// loomc compile --serve --cluster C --objective latency|throughput: the
// tensor-parallel degree of a serving bundle. A decoding step reads every
// weight and the cached keys and values once, launches a few hundred small
// kernels, and under tensor parallelism all-reduces each layer's output
// twice. Latency picks the degree with the shortest step at batch 1;
// throughput the most tokens per second per GPU at --max-batch (more
// replicas of a smaller split, one server each). Degrees whose weights and
// cache do not fit a GPU are refused with the reason.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_PLANNER_SERVEPLANNER_H
#define LOOM_COMPILER_PLANNER_SERVEPLANNER_H

#include "compiler/planner/Cluster.h"
#include "compiler/planner/Planner.h"

#include <string>
#include <vector>

namespace loom::planner {

struct ServeCandidate {
  int64_t tp = 1;
  bool fits = false;
  std::string why;             // why it does not apply, when it does not
  double memoryBytes = 0;      // weights and cache per GPU
  double latencySeconds = 0;   // a decoding step at batch 1
  double batchStepSeconds = 0; // a decoding step at --max-batch
  double tokensPerSecondPerGpu = 0;
  double launches = 0;         // kernels a step launches (the model's forward instructions)
};

struct ServePlan {
  bool found = false;
  std::string error;
  std::string objective;
  int64_t tp = 1;
  std::vector<ServeCandidate> candidates; // tp = 1, 2, 4, 8 where the node has them
};

/// What each operation of the model's forward pass (the planner's count,
/// before the compiler fuses them) costs a decoding step beyond its reads,
/// measured on an H200 (docs/benchmarks.md), the step's program captured
/// as a CUDA graph (NCCL's calls too, since the fifth session of
/// 2026-11-27). Fitted to GPT-2 350M at batch 1 (424 operations; the
/// step's program 0.812 ms against 0.196 ms of reads at 80% of the memory
/// bandwidth, sixth session of 2026-11-27). The independent check,
/// TinyLlama 1.1B, is predicted 14% long (1.096 ms against 0.962): the
/// runtime folds its norms and rotary into fewer kernels than GPT-2's per
/// operation, and its large products overlap their launches. Batch 32,
/// whose products run through cuBLASLt below the bandwidth, was predicted
/// about 20% short.
constexpr double kGraphLaunchSeconds = 1.45e-6;
/// One tensor-parallel all-reduce of a decoding step's rows beyond its
/// bytes (NCCL inside the step's graph, two H200s over NVLink): fitted to
/// GPT-2 350M tp2's program, 1.345 ms (48 all-reduces); TinyLlama tp2 is
/// then predicted 1.387 ms against 1.325 measured. Measured at tp 2 only.
constexpr double kGraphAllReduceSeconds = 13.2e-6;

/// `objective` is "latency" or "throughput"; maxSeq the tokens a sequence
/// holds (its cache), maxBatch the sequences decoding at once.
ServePlan planServing(const ModelSpec &spec, const Cluster &cluster, int64_t maxBatch, int64_t maxSeq,
                      const std::string &objective, const CostOptions &options = {});

/// The choice and every candidate, for loomc's output.
std::string describeServePlan(const ServePlan &plan, const Cluster &cluster);

} // namespace loom::planner

#endif
