//===- CostModel.h - Time and memory formulas of the planner ----*- C++ -*-===//
//
// Plain formulas, each unit-tested against hand-computed values:
// alpha-beta collectives, pipeline bubbles, microbatches in flight, and the
// bytes per parameter of a compiled training step (precision, ZeRO-1).
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_PLANNER_COSTMODEL_H
#define LOOM_COMPILER_PLANNER_COSTMODEL_H

#include <cstdint>
#include <string>

namespace loom::planner {

/// A link: bandwidth in bytes/s (one direction, per device) and latency in s.
struct Link {
  double bandwidth = 0;
  double latency = 0;
};

/// Ring all-reduce of `bytes` over n devices: 2(n-1)/n * S/B + 2(n-1) * alpha.
double allReduceTime(double bytes, int64_t n, const Link &link);
/// Ring all-gather or reduce-scatter (S = the full tensor): (n-1)/n * S/B + (n-1) * alpha.
double allGatherTime(double bytes, int64_t n, const Link &link);
double reduceScatterTime(double bytes, int64_t n, const Link &link);
/// Point-to-point transfer: S/B + alpha.
double p2pTime(double bytes, const Link &link);

/// ZeroBubbleH1 is ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism"
/// (ICLR 2024): 1F1B with each backward split into its input-gradient part
/// (B, on the critical path) and its weight-gradient part (W, deferred into
/// the bubble), holding no more microbatches than 1F1B's first stage.
enum class Schedule { GPipe, OneFOneB, Interleaved, ZeroBubbleH1 };
enum class Recompute { None, Selective, Full };
const char *scheduleName(Schedule s);
/// The schedule names parseSchedule accepts, for error messages.
const char *scheduleChoices();
const char *recomputeName(Recompute r);
bool parseSchedule(const std::string &text, Schedule &out);
bool parseRecompute(const std::string &text, Recompute &out);

/// Fraction of the ideal step lost to the pipeline bubble: (p-1)/m for GPipe
/// and 1F1B, (p-1)/(v m) for interleaved 1F1B with v virtual stages, and for
/// ZB-H1 (p-1)(F + max(B - W, 0)) / (m (F + B + W)), where `forwardShare`
/// F/(F+B+W) and `weightShare` W/(F+B+W) split a microbatch's work into
/// forward, input gradient B and weight gradient W: (p-1)/(3m) when F = B =
/// W, a third of 1F1B's (Qi et al. 2024, for m >= p).
double bubbleFraction(Schedule s, int64_t p, int64_t m, int64_t v, double forwardShare = 0,
                      double weightShare = 0);

/// Microbatches whose activations stage `stage` (0-based) holds at its peak:
/// GPipe all m; 1F1B min(m, p - stage); interleaved adds the warm-up of the
/// other chunks, (p - 1)/v more on stage 0 (Narayanan et al. 2021); ZB-H1
/// min(m, p) on every stage (later stages use that room to defer W).
double microbatchesInFlight(Schedule s, int64_t p, int64_t m, int64_t v, int64_t stage);

/// Element types of a compiled training step (loomc compile --precision):
/// bf16 computes in bf16 from f32 master parameters, f32 keeps everything in f32.
enum class Precision { Bf16, F32 };
const char *precisionName(Precision p);
bool parsePrecision(const std::string &text, Precision &out);
/// Bytes per activation element the compiled step keeps: 2 (bf16) or 4 (f32).
double activationWidth(Precision p);

/// Bytes per parameter as the compiled training step holds them: the
/// memory plan (passes/PlanMemory.cpp) puts persistent buffers in front of
/// the arena and packs the rest (activations, gradients, bf16 weight copies)
/// by lifetime into the space after them.
struct ParameterBytes {
  /// The f32 parameters (bf16: the master copy) and AdamW's f32 m and v,
  /// which ZeRO-1 shards over dp: 4 + 8 (or 8 / dp).
  double persistent = 0;
  /// The bf16 copy the step computes with (bf16 only): cast in the forward,
  /// kept while the backward still reads it; or, with copiesKept, written by
  /// the update and kept across steps (counted in `persistent` too).
  double workingCopy = 0;
  /// Whether the update writes the bf16 copies and they live through every
  /// step (passes/UpdateCopies.cpp: bf16 training but ZeRO-1 over dp > 1,
  /// which all-gathers them at the forward's start instead).
  bool copiesKept = false;
  /// The gradient, from the backward that makes it to the update: f32 where
  /// microbatches accumulate it or dp all-reduces it (and under f32), bf16
  /// where only the optimizer reads it.
  double gradient = 0;
  /// A weight gradient as the backward makes it, in the activations' type,
  /// before a step of several microbatches adds it to the f32 accumulator.
  double newGradient = 0;
  /// ZeRO-2: the whole gradients of the buckets not yet reduce-scattered
  /// (bytes; `gradient` is then the slices each rank keeps).
  double gradientsInFlight = 0;
  /// ZeRO-3: the weights gathered for the layers being computed and the
  /// bucket gathered ahead of them (bytes); each rank keeps only its slice
  /// of the f32 parameter in `persistent`, and no whole copies.
  double weightsInFlight = 0;
};
ParameterBytes parameterBytes(Precision precision, int zeroStage, int64_t dp, int64_t microbatches,
                              bool gradReduceBf16 = false);

} // namespace loom::planner

#endif
