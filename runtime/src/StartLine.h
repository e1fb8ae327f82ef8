//===- StartLine.h - Threads that start a step together --------*- C++ -*-===//
#ifndef LOOM_RUNTIME_STARTLINE_H
#define LOOM_RUNTIME_STARTLINE_H

#include <atomic>
#include <chrono>
#include <cstddef>
#include <thread>

namespace loom::rt {

/// The ranks' threads leave it together once each has bound its inputs: a
/// barrier that spins, then yields, and never sleeps (a thread woken from
/// sleep would start its step late); left early when a rank failed before
/// reaching it.
class StartLine {
public:
  explicit StartLine(size_t ranks) : ranks(ranks) {}
  /// False where another rank failed: this one stops too.
  bool arriveAndWait() {
    if (arrived.fetch_add(1) + 1 == ranks) {
      released = std::chrono::steady_clock::now();
      open.store(true, std::memory_order_release);
    }
    // Spins a few microseconds, then yields (a CPU backend's ranks may
    // outnumber the cores).
    for (int spins = 0; !open.load(std::memory_order_acquire) && !failed.load(std::memory_order_acquire); ++spins) {
#if defined(__x86_64__)
      if (spins < 4096) {
        __builtin_ia32_pause();
        continue;
      }
#endif
      std::this_thread::yield();
    }
    return open.load(std::memory_order_acquire);
  }
  void fail() { failed.store(true, std::memory_order_release); }
  std::chrono::steady_clock::time_point released;

private:
  size_t ranks;
  std::atomic<size_t> arrived{0};
  std::atomic<bool> open{false}, failed{false};
};

} // namespace loom::rt

#endif
