//===- Communicator.h - Collectives between ranks of one process -*- C++ -*-===//
//
// The in-process implementation of the runtime's collectives, for CPU ranks
// run as threads: every rank calls allReduceMean with its own buffer; the
// call returns when all ranks hold the mean. A rank that fails calls abort,
// and every rank waiting (or arriving later) throws an Error that names the
// failed rank and its message, so nothing hangs; a rank that never arrives
// makes the others fail after the timeout.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_COMMUNICATOR_H
#define LOOM_RUNTIME_COMMUNICATOR_H

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace loom::rt {

class InProcessCommunicator {
public:
  explicit InProcessCommunicator(int size, double timeoutSeconds = 300);
  int size() const { return ranks; }
  void allReduceMean(int rank, float *data, int64_t count);
  /// Copies `root`'s buffer into every other rank's.
  void broadcast(int rank, int root, float *data, int64_t count);
  void abort(int rank, const std::string &message);

private:
  /// Waits until all ranks arrive; throws if aborted or timed out.
  void barrier(int rank, std::unique_lock<std::mutex> &lock);

  int ranks;
  double timeout;
  std::mutex mutex;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  std::vector<float *> buffers;
  std::vector<int64_t> counts;
  bool aborted = false;
  std::string abortMessage;
};

} // namespace loom::rt

#endif
