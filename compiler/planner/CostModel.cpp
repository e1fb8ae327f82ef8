//===- CostModel.cpp - Time and memory formulas of the planner ------------===//

#include "compiler/planner/CostModel.h"

#include <algorithm>

namespace loom::planner {

double allReduceTime(double bytes, int64_t n, const Link &link) {
  if (n <= 1)
    return 0;
  return 2.0 * (n - 1) / n * bytes / link.bandwidth + 2.0 * (n - 1) * link.latency;
}

double allGatherTime(double bytes, int64_t n, const Link &link) {
  if (n <= 1)
    return 0;
  return double(n - 1) / n * bytes / link.bandwidth + double(n - 1) * link.latency;
}

double reduceScatterTime(double bytes, int64_t n, const Link &link) {
  return allGatherTime(bytes, n, link);
}

double p2pTime(double bytes, const Link &link) { return bytes / link.bandwidth + link.latency; }

namespace {

/// One table per option: its names, both ways.
template <typename E> struct Named {
  const char *name;
  E value;
};
constexpr Named<Schedule> kSchedules[] = {{"gpipe", Schedule::GPipe},
                                          {"1f1b", Schedule::OneFOneB},
                                          {"interleaved", Schedule::Interleaved},
                                          {"zb-h1", Schedule::ZeroBubbleH1}};
constexpr Named<Recompute> kRecomputes[] = {
    {"none", Recompute::None}, {"selective", Recompute::Selective}, {"full", Recompute::Full}};
constexpr Named<Precision> kPrecisions[] = {{"f32", Precision::F32}, {"bf16", Precision::Bf16}};

template <typename E, size_t N> const char *nameIn(const Named<E> (&table)[N], E value) {
  for (const Named<E> &n : table)
    if (n.value == value)
      return n.name;
  return "?";
}

template <typename E, size_t N> bool parseIn(const Named<E> (&table)[N], const std::string &text, E &out) {
  for (const Named<E> &n : table)
    if (text == n.name) {
      out = n.value;
      return true;
    }
  return false;
}

} // namespace

const char *scheduleName(Schedule s) { return nameIn(kSchedules, s); }

const char *scheduleChoices() { return "gpipe, 1f1b, interleaved or zb-h1"; }

const char *recomputeName(Recompute r) { return nameIn(kRecomputes, r); }

bool parseSchedule(const std::string &text, Schedule &out) { return parseIn(kSchedules, text, out); }

bool parseRecompute(const std::string &text, Recompute &out) { return parseIn(kRecomputes, text, out); }

double bubbleFraction(Schedule s, int64_t p, int64_t m, int64_t v, double forwardShare,
                      double weightShare) {
  if (p <= 1 || m <= 0)
    return 0;
  double bubble = double(p - 1) / double(m);
  if (s == Schedule::Interleaved)
    return bubble / double(std::max<int64_t>(v, 1));
  if (s == Schedule::ZeroBubbleH1)
    return bubble * (forwardShare + std::max(1 - forwardShare - 2 * weightShare, 0.0));
  return bubble;
}

double microbatchesInFlight(Schedule s, int64_t p, int64_t m, int64_t v, int64_t stage) {
  switch (s) {
  case Schedule::GPipe:
    return double(m);
  case Schedule::OneFOneB:
    return double(std::min<int64_t>(m, p - stage));
  case Schedule::Interleaved: {
    double inFlight = double(p - stage) + double(p - 1) / double(std::max<int64_t>(v, 1));
    return std::min(inFlight, double(m));
  }
  case Schedule::ZeroBubbleH1:
    return double(std::min<int64_t>(m, p));
  }
  return double(m);
}

const char *precisionName(Precision p) { return nameIn(kPrecisions, p); }

bool parsePrecision(const std::string &text, Precision &out) { return parseIn(kPrecisions, text, out); }

double activationWidth(Precision p) { return p == Precision::F32 ? 4.0 : 2.0; }

ParameterBytes parameterBytes(Precision precision, int zeroStage, int64_t dp, int64_t microbatches,
                              bool gradReduceBf16) {
  ParameterBytes bytes;
  double adam = 8.0; // f32 m and v
  if (zeroStage >= 1)
    adam /= double(std::max<int64_t>(dp, 1));
  bool bf16 = precision == Precision::Bf16;
  // Mixed-precision ZeRO-1 keeps each rank's slice of the f32 masters
  // beside the whole (passes/ZeroGatherCopies.cpp).
  double masterSlice = bf16 && zeroStage >= 1 && dp > 1 ? 4.0 / double(dp) : 0.0;
  bytes.workingCopy = bf16 ? 2.0 : 0.0;
  // The update writes the bf16 copies, kept across steps
  // (passes/UpdateCopies.cpp), where ZeRO-1 does not gather them.
  bytes.copiesKept = bf16 && !(zeroStage >= 1 && dp > 1);
  bytes.persistent = 4.0 + adam + masterSlice + (bytes.copiesKept ? bytes.workingCopy : 0.0);
  // passes/Bf16StepCasts.cpp leaves a gradient in bf16 where the optimizer
  // is its only reader: no sum over microbatches, and no all-reduce, or
  // one that averages it in place as bf16 (--grad-reduce bf16 without
  // ZeRO-1).
  bool averagedInPlace = dp <= 1 || (gradReduceBf16 && zeroStage == 0);
  bytes.gradient = bf16 && averagedInPlace && microbatches <= 1 ? 2.0 : 4.0;
  bytes.newGradient = activationWidth(precision);
  if (zeroStage == 3 && dp > 1 && microbatches <= 1) {
    // ZeRO-3: the parameter is the slice (passes/ZeroGatherCopies.cpp), and
    // a layer's weights exist only from their bucket's gather, issued where
    // the bucket before it is first read, to their last read: about two
    // buckets (25 MiB of gathered weights each) at a time.
    bytes.persistent = (4.0 + 8.0) / double(dp);
    bytes.workingCopy = 0;
    bytes.copiesKept = false;
    bytes.weightsInFlight = 2.0 * double(25 << 20);
  }
  if (zeroStage >= 2 && dp > 1 && microbatches <= 1) {
    // ZeRO-2: each rank keeps the f32 slices; a bucket's whole gradients
    // (25 MiB of f32 gradients: 6.5M of them, in the activations' type) live
    // until the next bucket goes out, so at most two buckets' worth.
    bytes.gradient = 4.0 / double(dp);
    bytes.gradientsInFlight = 2.0 * double(25 << 20) / 4.0 * activationWidth(precision);
  }
  return bytes;
}

} // namespace loom::planner
