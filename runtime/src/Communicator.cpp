//===- Communicator.cpp - Collectives between ranks of one process --------===//

#include "runtime/src/Communicator.h"
#include "loom/rt/Error.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>

namespace loom::rt {

void checkTimeout(double seconds, const std::string &option) {
  if (!(std::isfinite(seconds) && seconds > 0 && seconds <= kMaxTimeoutSeconds))
    fail(LOOM_INVALID_ARGUMENT, option, " must be above 0 and at most ", kMaxTimeoutSeconds,
         " seconds, got ", seconds);
}

InProcessCommunicator::InProcessCommunicator(int size, double timeoutSeconds)
    : ranks(size), timeout(timeoutSeconds), everyone(static_cast<size_t>(size)) {
  std::iota(everyone.begin(), everyone.end(), 0);
}

void InProcessCommunicator::abort(int rank, const std::string &message) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!aborted) {
    aborted = true;
    abortMessage = cat("rank ", rank, " failed: ", message);
  }
  cv.notify_all();
}

void InProcessCommunicator::timedOut(int rank, const std::string &what) {
  aborted = true;
  abortMessage = cat("rank ", rank, " waited ", timeout, " s ", what, "; stopping every rank");
  cv.notify_all();
  fail(LOOM_INVALID_ARGUMENT, abortMessage);
}

InProcessCommunicator::GroupState &
InProcessCommunicator::stateOf(int rank, const std::vector<int> &group, const char *what) {
  if (aborted)
    fail(LOOM_INVALID_ARGUMENT, abortMessage);
  bool member = false;
  for (int r : group) {
    if (r < 0 || r >= ranks)
      fail(LOOM_INVALID_BUNDLE, what, ": group member ", r, " is not one of the ", ranks, " ranks");
    member |= r == rank;
  }
  if (!member)
    fail(LOOM_INVALID_BUNDLE, what, ": rank ", rank, " is not in its own group");
  return groups[group];
}

void InProcessCommunicator::barrier(int rank, GroupState &g, int members,
                                    std::unique_lock<std::mutex> &lock) {
  if (aborted)
    fail(LOOM_INVALID_ARGUMENT, abortMessage);
  uint64_t mine = g.generation;
  if (++g.arrived == members) {
    g.arrived = 0;
    ++g.generation;
    cv.notify_all();
    return;
  }
  bool done = cv.wait_for(lock, std::chrono::duration<double>(timeout),
                          [&] { return g.generation != mine || aborted; });
  if (aborted)
    fail(LOOM_INVALID_ARGUMENT, abortMessage);
  if (!done)
    timedOut(rank, cat("in a collective for the other ", members - g.arrived, " rank(s)"));
}

void InProcessCommunicator::allReduce(int rank, const std::vector<int> &group, float *data,
                                      int64_t count, Reduction op) {
  std::unique_lock<std::mutex> lock(mutex);
  GroupState &g = stateOf(rank, group, "all_reduce");
  int members = static_cast<int>(group.size());
  g.buffers[rank] = data;
  g.counts[rank] = count;
  barrier(rank, g, members, lock); // every member's buffer is registered
  for (int r : group)
    if (g.counts[r] != count)
      fail(LOOM_INVALID_BUNDLE, "all_reduce: rank ", r, " contributes ", g.counts[r],
           " elements but rank ", rank, " ", count);
  std::vector<const float *> sources;
  for (int r : group) // in group order on every rank: the same sum everywhere
    sources.push_back(g.buffers[r]);
  lock.unlock();
  // Everyone reads every buffer before anyone writes its own.
  std::vector<float> result(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    float acc = sources[0][i];
    for (size_t s = 1; s < sources.size(); ++s)
      acc = op == Reduction::Max ? std::max(acc, sources[s][i]) : acc + sources[s][i];
    result[i] = op == Reduction::Mean ? acc / static_cast<float>(members) : acc;
  }
  lock.lock();
  barrier(rank, g, members, lock);
  lock.unlock();
  std::copy(result.begin(), result.end(), data);
  lock.lock();
  barrier(rank, g, members, lock); // nobody reuses a buffer while another rank still reads it
}

void InProcessCommunicator::allReduceMean(int rank, float *data, int64_t count) {
  allReduce(rank, everyone, data, count, Reduction::Mean);
}

void InProcessCommunicator::broadcast(int rank, const std::vector<int> &group, int root,
                                      float *data, int64_t count) {
  std::unique_lock<std::mutex> lock(mutex);
  GroupState &g = stateOf(rank, group, "broadcast");
  int members = static_cast<int>(group.size());
  g.buffers[rank] = data;
  g.counts[rank] = count;
  barrier(rank, g, members, lock);
  if (std::find(group.begin(), group.end(), root) == group.end() || g.counts[root] != count)
    fail(LOOM_INVALID_BUNDLE, "broadcast: root ", root, " is not in the group or does not hold ",
         count, " elements");
  const float *source = g.buffers[root];
  lock.unlock();
  if (rank != root)
    std::copy(source, source + count, data);
  lock.lock();
  barrier(rank, g, members, lock); // the root's buffer stays untouched until everyone has copied it
}

void InProcessCommunicator::broadcast(int rank, int root, float *data, int64_t count) {
  broadcast(rank, everyone, root, data, count);
}

void InProcessCommunicator::send(int rank, int peer, int64_t tag, const void *data, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex);
  if (aborted)
    fail(LOOM_INVALID_ARGUMENT, abortMessage);
  if (peer < 0 || peer >= ranks || peer == rank)
    fail(LOOM_INVALID_BUNDLE, "send: rank ", rank, " cannot send to rank ", peer);
  const char *p = static_cast<const char *>(data);
  mailboxes[{rank, peer, tag}].emplace_back(p, p + bytes);
  cv.notify_all();
}

void InProcessCommunicator::recv(int rank, int peer, int64_t tag, void *data, int64_t bytes) {
  std::unique_lock<std::mutex> lock(mutex);
  if (peer < 0 || peer >= ranks || peer == rank)
    fail(LOOM_INVALID_BUNDLE, "recv: rank ", rank, " cannot receive from rank ", peer);
  auto &box = mailboxes[{peer, rank, tag}];
  bool ready = cv.wait_for(lock, std::chrono::duration<double>(timeout),
                           [&] { return !box.empty() || aborted; });
  if (aborted)
    fail(LOOM_INVALID_ARGUMENT, abortMessage);
  if (!ready)
    timedOut(rank, cat("to receive message ", tag, " from rank ", peer));
  std::vector<char> message = std::move(box.front());
  box.pop_front();
  if (static_cast<int64_t>(message.size()) != bytes)
    fail(LOOM_INVALID_BUNDLE, "recv: rank ", rank, " expects ", bytes, " bytes from rank ", peer,
         " but got ", message.size(), " (the ranks' programs disagree)");
  std::memcpy(data, message.data(), message.size());
}

std::string disagreement(int rank, const CollectiveSignature &mine, int other,
                         const CollectiveSignature &theirs, const std::vector<int> &group) {
  auto name = [](int64_t kind) {
    return kind == CollectiveSignature::AllReduce ? "all-reduce"
           : kind == CollectiveSignature::Broadcast ? "broadcast" : "byte broadcast";
  };
  auto withArticle = [&](int64_t kind) {
    return (kind == CollectiveSignature::AllReduce ? "an " : "a ") + std::string(name(kind));
  };
  std::string members;
  for (int r : group)
    members += (members.empty() ? "" : ",") + std::to_string(r);
  const char *why = " (the ranks' programs disagree)";
  if (theirs.kind != mine.kind)
    return cat("rank ", rank, " is in ", withArticle(mine.kind), " over ranks ", members, " but rank ", other,
               " in ", withArticle(theirs.kind), why);
  if (theirs.count != mine.count)
    return cat(name(mine.kind), " over ranks ", members, ": rank ", other, " contributes ", theirs.count,
               " elements but rank ", rank, " ", mine.count, why);
  if (theirs.detail != mine.detail)
    return cat(name(mine.kind), " over ranks ", members, ": rank ", other,
               mine.kind == CollectiveSignature::AllReduce ? " reduces differently than rank "
                                                           : " names another root than rank ",
               rank, why);
  return "";
}

void Communicator::broadcastBytes(int, int, void *, int64_t) {
  fail(LOOM_INTERNAL, "broadcastBytes is for communicators that span processes (MPI)");
}

namespace {
class ValidationCommunicator : public Communicator {
public:
  int size() const override { return 1 << 20; }
  [[noreturn]] static void never() {
    fail(LOOM_INTERNAL, "a communicator used only to validate instructions was asked to communicate");
  }
  void allReduce(int, const std::vector<int> &, float *, int64_t, Reduction) override { never(); }
  void broadcast(int, const std::vector<int> &, int, float *, int64_t) override { never(); }
  void send(int, int, int64_t, const void *, int64_t) override { never(); }
  void recv(int, int, int64_t, void *, int64_t) override { never(); }
  void abort(int, const std::string &) override {}
};
} // namespace

Communicator &validationCommunicator() {
  static ValidationCommunicator instance;
  return instance;
}

} // namespace loom::rt
