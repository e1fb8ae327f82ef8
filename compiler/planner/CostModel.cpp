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

const char *scheduleName(Schedule s) {
  switch (s) {
  case Schedule::GPipe:
    return "gpipe";
  case Schedule::OneFOneB:
    return "1f1b";
  case Schedule::Interleaved:
    return "interleaved";
  case Schedule::ZeroBubbleH1:
    return "zb-h1";
  }
  return "?";
}

const char *scheduleChoices() { return "gpipe, 1f1b, interleaved or zb-h1"; }

const char *recomputeName(Recompute r) {
  switch (r) {
  case Recompute::None:
    return "none";
  case Recompute::Selective:
    return "selective";
  case Recompute::Full:
    return "full";
  }
  return "?";
}

bool parseSchedule(const std::string &text, Schedule &out) {
  if (text == "gpipe")
    out = Schedule::GPipe;
  else if (text == "1f1b")
    out = Schedule::OneFOneB;
  else if (text == "interleaved")
    out = Schedule::Interleaved;
  else if (text == "zb-h1")
    out = Schedule::ZeroBubbleH1;
  else
    return false;
  return true;
}

bool parseRecompute(const std::string &text, Recompute &out) {
  if (text == "none")
    out = Recompute::None;
  else if (text == "selective")
    out = Recompute::Selective;
  else if (text == "full")
    out = Recompute::Full;
  else
    return false;
  return true;
}

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

double bytesPerParameter(int zeroStage, int64_t dp) {
  double optimizer = 12.0;
  if (zeroStage >= 1)
    optimizer /= double(std::max<int64_t>(dp, 1));
  return 2.0 + 4.0 + optimizer;
}

double transformerActivationBytes(double s, double h, double a, int64_t t, Recompute r) {
  double tp = double(std::max<int64_t>(t, 1));
  switch (r) {
  case Recompute::None:
    return s * h * (10.0 + 24.0 / tp + 5.0 * a * s / (h * tp));
  case Recompute::Selective:
    return s * h * (10.0 + 24.0 / tp);
  case Recompute::Full:
    return 2.0 * s * h;
  }
  return 0;
}

} // namespace loom::planner
