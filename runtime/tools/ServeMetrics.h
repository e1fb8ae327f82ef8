//===- ServeMetrics.h - loom-serve's Prometheus metrics ---------*- C++ -*-===//
//
// What loom-serve measures beside the engine's own counters: latency
// summaries over a window of recent samples (p50 and p99 of the last ones,
// so that a long-running server reports its present, not its history), the
// token rate over the last seconds, and the HTTP answers by status code.
// Thread-safe. render() writes the Prometheus text format.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_TOOLS_SERVEMETRICS_H
#define LOOM_RUNTIME_TOOLS_SERVEMETRICS_H

#include "runtime/src/serve/Engine.h"

#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace loom::rt {

/// The last `capacity` samples of a latency, and the sum and count of all.
class LatencyWindow {
public:
  explicit LatencyWindow(size_t capacity = 1024) : capacity(capacity) {}
  void add(double seconds);
  /// The q-quantile (0..1) of the window; 0 when it is empty.
  double quantile(double q) const;
  double sum = 0;
  uint64_t count = 0;

private:
  size_t capacity;
  std::deque<double> recent;
};

class ServeMetrics {
public:
  using Clock = std::chrono::steady_clock;

  void timeToFirstToken(double seconds);
  void interTokenLatency(double seconds);
  void response(int status);
  /// The Prometheus text exposition of `stats` and what this object measured.
  std::string render(const serve::EngineStats &stats, bool draining);

private:
  std::mutex mu;
  LatencyWindow firstToken, perToken;
  std::deque<Clock::time_point> tokenTimes; // of the last rateWindow seconds
  std::map<int, uint64_t> responses;
  Clock::time_point started = Clock::now();
  static constexpr double rateWindow = 10;
  void pruneTokens(Clock::time_point now);
};

} // namespace loom::rt

#endif
