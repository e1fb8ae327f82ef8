//===- CostModel.h - Time and memory formulas of the planner ----*- C++ -*-===//
//
// Plain formulas, each unit-tested against hand-computed values:
// alpha-beta collectives, pipeline bubbles, optimizer-state memory under
// ZeRO, and the activation memory of a transformer layer (Korthikanti et al.,
// "Reducing Activation Recomputation in Large Transformer Models", 2022).
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

/// Bytes per parameter for weights, gradients and Adam state under mixed
/// precision: 2 (bf16 weights) + 4 (fp32 gradients) + 12 (fp32 master, m, v).
/// ZeRO-1 divides the 12 bytes of optimizer state by the data-parallel degree.
double bytesPerParameter(int zeroStage, int64_t dp);

/// Activation bytes a transformer layer keeps for backward, per sequence of
/// s tokens (16-bit activations), with tensor parallelism t (no sequence
/// parallelism): none: s h (10 + 24/t + 5 a s / (h t)); selective: s h (10 +
/// 24/t); full: 2 s h (only the layer input).
double transformerActivationBytes(double s, double h, double a, int64_t t, Recompute r);

} // namespace loom::planner

#endif
