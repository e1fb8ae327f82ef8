//===- ThreadPool.h - Parallel loops for the CPU backend --------*- C++ -*-===//
#ifndef LOOM_RUNTIME_THREADPOOL_H
#define LOOM_RUNTIME_THREADPOOL_H

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace loom::rt {

/// The most threads a pool (a CPU session) may have: far above any machine's
/// cores, far below what starves a machine of processes.
constexpr int kMaxThreads = 1024;

/// A fixed set of workers that split [0, n) into contiguous chunks. The
/// calling thread takes a chunk too; small loops run inline.
class ThreadPool {
public:
  /// `threads` in [0, kMaxThreads]; 0 means one per hardware thread. Throws
  /// Error where the threads cannot be started.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool &) = delete;
  ThreadPool &operator=(const ThreadPool &) = delete;

  int size() const { return static_cast<int>(workers.size()) + 1; }

  /// Calls body(begin, end) over [0, n). `cost` is the rough work per index
  /// (in multiply-adds) used to decide whether threads pay off. The loop is
  /// cut into `chunksPerThread` chunks per thread, taken in turn: several
  /// balance uneven work, one suits bodies with a fixed cost per call (a
  /// matrix product packs its whole right-hand side for every call).
  void parallelFor(int64_t n, double cost, const std::function<void(int64_t, int64_t)> &body,
                   int chunksPerThread = 4);

private:
  void workerLoop(int index);
  void stopWorkers();

  std::vector<std::thread> workers;
  std::mutex mutex;
  std::condition_variable wake, done;
  const std::function<void(int64_t, int64_t)> *task = nullptr;
  int64_t taskSize = 0;
  int chunks = 0;
  int nextChunk = 0;
  int pending = 0;
  uint64_t generation = 0;
  bool stopping = false;
};

} // namespace loom::rt

#endif
