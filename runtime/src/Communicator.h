//===- Communicator.h - Collectives between ranks of one process -*- C++ -*-===//
//
// The in-process implementation of the runtime's collectives and transfers,
// for CPU ranks run as threads. A collective names its group (the global
// ranks taking part, the same list on every member); every member calls it
// with its own buffer and it returns when all hold the result. Point-to-point
// send copies into the receiver's mailbox and returns; recv waits for the
// next message from that peer. A rank that fails calls abort, and every rank
// waiting (or arriving later) throws an Error that names the failed rank and
// its message, so nothing hangs; a rank that never arrives makes the others
// fail after the timeout.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_COMMUNICATOR_H
#define LOOM_RUNTIME_COMMUNICATOR_H

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace loom::rt {

enum class Reduction { Sum, Mean, Max };

/// How long a rank waits for its peers in one collective or transfer before
/// it fails and stops every rank (loom-run --timeout, the C API's
/// `timeout_seconds`); a day at most.
constexpr double kDefaultTimeoutSeconds = 300;
constexpr double kMaxTimeoutSeconds = 86400;

/// Throws Error unless `seconds` is finite, above 0 and at most
/// kMaxTimeoutSeconds; `option` names where it came from.
void checkTimeout(double seconds, const std::string &option);

/// What the CPU backend's collective and transfer instructions call. Every
/// call names the calling (global) rank; implementations: in-process
/// (threads) below, and MPI between processes (MpiCommunicator.h).
class Communicator {
public:
  virtual ~Communicator() = default;
  /// Number of ranks of the bundle.
  virtual int size() const = 0;
  /// Reduces `count` floats over `group` (global ranks, including `rank`).
  virtual void allReduce(int rank, const std::vector<int> &group, float *data, int64_t count,
                         Reduction op) = 0;
  /// Copies `root`'s buffer (a global rank of `group`) into every other member's.
  virtual void broadcast(int rank, const std::vector<int> &group, int root, float *data,
                         int64_t count) = 0;
  /// Sends `bytes` bytes to `peer` under `tag`; returns once they are copied.
  virtual void send(int rank, int peer, int64_t tag, const void *data, int64_t bytes) = 0;
  /// Receives the message from `peer` under `tag`, which must be `bytes` long.
  virtual void recv(int rank, int peer, int64_t tag, void *data, int64_t bytes) = 0;
  /// Stops every rank: those waiting (or arriving later) fail with `message`.
  virtual void abort(int rank, const std::string &message) = 0;
  /// Copies `bytes` bytes from `root` to every rank (all ranks call it);
  /// bootstraps NCCL across processes. Only the MPI communicator has it.
  virtual void broadcastBytes(int rank, int root, void *data, int64_t bytes);
  /// The peers known to be gone (their process exited or was killed),
  /// described for an error ("rank 1 closed its connection ..."), or "".
  /// For waits that are not the communicator's own (NCCL's on GPUs).
  virtual std::string lostPeers() { return ""; }
};

/// What a member of a group is about to do, as the communicators between
/// processes compare it before a collective: ranks whose programs disagree
/// would otherwise truncate or overrun each other's buffers.
struct CollectiveSignature {
  enum Kind : int64_t { AllReduce = 1, Broadcast, Bytes };
  int64_t kind = AllReduce;
  int64_t count = 0; // elements (bytes for Bytes)
  int64_t detail = 0; // the reduction, or the root
};

/// "" when `rank` and `other` of `group` agree, else the error that names
/// the difference ("all-reduce over ranks 0,1: rank 1 contributes 3
/// elements but rank 0 4 (the ranks' programs disagree)").
std::string disagreement(int rank, const CollectiveSignature &mine, int other,
                         const CollectiveSignature &theirs, const std::vector<int> &group);

/// A communicator for checking instructions without running them (another
/// backend validates its programs through the CPU builders); any call throws.
Communicator &validationCommunicator();

class InProcessCommunicator : public Communicator {
public:
  explicit InProcessCommunicator(int size, double timeoutSeconds = kDefaultTimeoutSeconds);
  int size() const override { return ranks; }
  void allReduce(int rank, const std::vector<int> &group, float *data, int64_t count,
                 Reduction op) override;
  /// Mean over every rank of the communicator.
  void allReduceMean(int rank, float *data, int64_t count);
  void broadcast(int rank, const std::vector<int> &group, int root, float *data,
                 int64_t count) override;
  void broadcast(int rank, int root, float *data, int64_t count);
  void send(int rank, int peer, int64_t tag, const void *data, int64_t bytes) override;
  void recv(int rank, int peer, int64_t tag, void *data, int64_t bytes) override;
  void abort(int rank, const std::string &message) override;

private:
  struct GroupState {
    int arrived = 0;
    uint64_t generation = 0;
    std::map<int, float *> buffers;
    std::map<int, int64_t> counts;
  };
  /// Waits until every member of the group arrives; throws if aborted or timed out.
  void barrier(int rank, GroupState &g, int members, std::unique_lock<std::mutex> &lock);
  GroupState &stateOf(int rank, const std::vector<int> &group, const char *what);
  [[noreturn]] void timedOut(int rank, const std::string &what);

  int ranks;
  double timeout;
  std::mutex mutex;
  std::condition_variable cv;
  std::map<std::vector<int>, GroupState> groups;
  std::map<std::tuple<int, int, int64_t>, std::deque<std::vector<char>>> mailboxes; // (from, to, tag)
  std::vector<int> everyone;
  bool aborted = false;
  std::string abortMessage;
};

} // namespace loom::rt

#endif
