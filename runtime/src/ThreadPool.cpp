//===- ThreadPool.cpp - Parallel loops for the CPU backend ----------------===//

#include "runtime/src/ThreadPool.h"
#include "loom/rt/Error.h"

#include <algorithm>
#include <system_error>

namespace loom::rt {

ThreadPool::ThreadPool(int threads) {
  if (threads < 0 || threads > kMaxThreads)
    fail(LOOM_INVALID_ARGUMENT, "the thread count must be from 0 (one per core) to ", kMaxThreads,
         ", got ", threads);
  if (threads == 0)
    threads = std::min(kMaxThreads, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  try {
    for (int i = 1; i < threads; ++i)
      workers.emplace_back([this, i] { workerLoop(i); });
  } catch (const std::system_error &e) {
    stopWorkers(); // no destructor runs for a pool whose constructor throws
    fail(LOOM_INVALID_ARGUMENT, "cannot start ", threads, " CPU threads (", e.what(),
         "); ask for fewer");
  }
}

ThreadPool::~ThreadPool() { stopWorkers(); }

void ThreadPool::stopWorkers() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    stopping = true;
  }
  wake.notify_all();
  for (std::thread &t : workers)
    t.join();
  workers.clear();
}

void ThreadPool::workerLoop(int) {
  uint64_t seen = 0;
  for (;;) {
    std::unique_lock<std::mutex> lock(mutex);
    wake.wait(lock, [&] { return stopping || generation != seen; });
    if (stopping)
      return;
    seen = generation;
    while (nextChunk < chunks) {
      int chunk = nextChunk++;
      const auto *body = task;
      int64_t n = taskSize;
      int total = chunks;
      lock.unlock();
      (*body)(n * chunk / total, n * (chunk + 1) / total);
      lock.lock();
      if (--pending == 0)
        done.notify_all();
    }
  }
}

void ThreadPool::parallelFor(int64_t n, double cost, const std::function<void(int64_t, int64_t)> &body,
                             int chunksPerThread) {
  if (n <= 0)
    return;
  int threads = size();
  // Below ~50k multiply-adds the wake-up costs more than it saves.
  if (threads == 1 || n == 1 || static_cast<double>(n) * cost < 5e4) {
    body(0, n);
    return;
  }
  std::unique_lock<std::mutex> lock(mutex);
  task = &body;
  taskSize = n;
  chunks = static_cast<int>(std::min<int64_t>(n, int64_t(threads) * std::max(1, chunksPerThread)));
  nextChunk = 0;
  pending = chunks;
  ++generation;
  wake.notify_all();
  while (nextChunk < chunks) {
    int chunk = nextChunk++;
    int total = chunks;
    lock.unlock();
    body(n * chunk / total, n * (chunk + 1) / total);
    lock.lock();
    --pending;
  }
  done.wait(lock, [&] { return pending == 0; });
  task = nullptr;
}

} // namespace loom::rt
