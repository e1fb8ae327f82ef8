//===- Communicator.cpp - Collectives between ranks of one process --------===//

#include "runtime/src/Communicator.h"
#include "runtime/src/Error.h"

#include <chrono>

namespace loom::rt {

InProcessCommunicator::InProcessCommunicator(int size, double timeoutSeconds)
    : ranks(size), timeout(timeoutSeconds), buffers(size, nullptr), counts(size, 0) {}

void InProcessCommunicator::abort(int rank, const std::string &message) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!aborted) {
    aborted = true;
    abortMessage = cat("rank ", rank, " failed: ", message);
  }
  cv.notify_all();
}

void InProcessCommunicator::barrier(int rank, std::unique_lock<std::mutex> &lock) {
  if (aborted)
    fail(LOOM_INVALID_ARGUMENT, abortMessage);
  uint64_t mine = generation;
  if (++arrived == ranks) {
    arrived = 0;
    ++generation;
    cv.notify_all();
    return;
  }
  bool done = cv.wait_for(lock, std::chrono::duration<double>(timeout),
                          [&] { return generation != mine || aborted; });
  if (aborted)
    fail(LOOM_INVALID_ARGUMENT, abortMessage);
  if (!done) {
    aborted = true;
    abortMessage = cat("rank ", rank, " waited ", timeout, " s in a collective for the other ",
                       ranks - arrived, " rank(s); stopping every rank");
    cv.notify_all();
    fail(LOOM_INVALID_ARGUMENT, abortMessage);
  }
}

void InProcessCommunicator::allReduceMean(int rank, float *data, int64_t count) {
  std::unique_lock<std::mutex> lock(mutex);
  buffers[rank] = data;
  counts[rank] = count;
  barrier(rank, lock); // every rank's buffer is registered
  for (int r = 0; r < ranks; ++r)
    if (counts[r] != count)
      fail(LOOM_INVALID_BUNDLE, "all_reduce: rank ", r, " contributes ", counts[r],
           " elements but rank ", rank, " ", count);
  lock.unlock();
  // Everyone reads every buffer before anyone writes its own.
  std::vector<float> mean(static_cast<size_t>(count), 0.0f);
  for (int r = 0; r < ranks; ++r)
    for (int64_t i = 0; i < count; ++i)
      mean[i] += buffers[r][i];
  for (float &v : mean)
    v /= static_cast<float>(ranks);
  lock.lock();
  barrier(rank, lock);
  lock.unlock();
  std::copy(mean.begin(), mean.end(), data);
  lock.lock();
  barrier(rank, lock); // nobody reuses a buffer while another rank still reads it
}

void InProcessCommunicator::broadcast(int rank, int root, float *data, int64_t count) {
  std::unique_lock<std::mutex> lock(mutex);
  buffers[rank] = data;
  counts[rank] = count;
  barrier(rank, lock);
  if (root < 0 || root >= ranks || counts[root] != count)
    fail(LOOM_INVALID_BUNDLE, "broadcast: root ", root, " does not hold ", count, " elements");
  const float *source = buffers[root];
  lock.unlock();
  if (rank != root)
    std::copy(source, source + count, data);
  lock.lock();
  barrier(rank, lock); // the root's buffer stays untouched until everyone has copied it
}

} // namespace loom::rt
