//===- MpiCommunicator.cpp - Collectives between processes over MPI -------===//

#include "runtime/src/MpiCommunicator.h"
#include "loom/rt/Error.h"

#include <cstdlib>

#ifdef LOOM_HAVE_MPI
#include <mpi.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <unistd.h>
#include <vector>
#endif

namespace loom::rt {

bool launchedByMpi() {
#ifdef LOOM_HAVE_MPI
  for (const char *var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"})
    if (const char *v = std::getenv(var); v && std::atoi(v) > 1)
      return true;
#endif
  return false;
}

#ifndef LOOM_HAVE_MPI

std::shared_ptr<Communicator> makeMpiCommunicator(int &, int &, double) {
  fail(LOOM_UNSUPPORTED, "this Loom was built without MPI; install Open MPI (scripts/install-deps.sh) "
       "and rebuild, or run every rank in one process (loom-run without mpirun)");
}
void finalizeMpi() {}
std::string describeLostMpiRanks() { return ""; }

#else

namespace {

bool initialised = false;

/// Where every rank of the job runs, so that a waiting rank can tell a peer
/// that died (kill -9, a crash) from one that is slow.
struct Peer {
  std::string host;
  long pid = 0;
};
std::vector<Peer> peers;
std::string hostName;

std::string thisHost() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  return name;
}

/// True when `pid` on this host has exited (gone, or a zombie not yet reaped).
bool processGone(long pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)
    return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string field;
  for (int i = 0; i < 3 && stat >> field; ++i) {
  }
  return field == "Z";
}

class MpiCommunicator : public Communicator {
public:
  MpiCommunicator(int size, double timeout) : ranks(size), timeout(timeout) {
    int flag = 0;
    void *value = nullptr;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &value, &flag);
    tagLimit = flag ? *static_cast<int *>(value) : 32767;
  }
  int size() const override { return ranks; }

  void allReduce(int rank, const std::vector<int> &group, float *data, int64_t count,
                 Reduction op) override {
    std::string what = cat("in an all-reduce over ranks ", list(group));
    MPI_Comm comm = commOf(rank, group);
    agree(rank, group, comm, {CollectiveSignature::AllReduce, count, int64_t(op)}, what);
    MPI_Request request;
    call([&] {
      return MPI_Iallreduce(MPI_IN_PLACE, data, int(count), MPI_FLOAT,
                            op == Reduction::Max ? MPI_MAX : MPI_SUM, comm, &request);
    }, "MPI_Iallreduce", rank, what);
    wait(rank, request, what);
    if (op == Reduction::Mean)
      for (int64_t i = 0; i < count; ++i)
        data[i] /= float(group.size());
  }

  void broadcast(int rank, const std::vector<int> &group, int root, float *data,
                 int64_t count) override {
    std::string what = cat("in a broadcast over ranks ", list(group));
    MPI_Comm comm = commOf(rank, group);
    int index = 0;
    while (index < int(group.size()) && group[index] != root)
      ++index;
    if (index == int(group.size()))
      fail(LOOM_INVALID_BUNDLE, "broadcast: root ", root, " is not in the group");
    agree(rank, group, comm, {CollectiveSignature::Broadcast, count, root}, what);
    MPI_Request request;
    call([&] { return MPI_Ibcast(data, int(count), MPI_FLOAT, index, comm, &request); }, "MPI_Ibcast",
         rank, what);
    wait(rank, request, what);
  }

  void send(int rank, int peer, int64_t tag, const void *data, int64_t bytes) override {
    std::string what = cat("to send message ", tag, " to rank ", peer);
    checkCount(bytes, rank, what);
    checkPeer(rank, peer, "send", "send to");
    std::lock_guard<std::mutex> sending(outgoingMutex);
    reap(rank);
    // Sends never block the sender: the bytes are copied and go out while
    // the rank computes on (pipeline schedules rely on it).
    outgoing.push_back({MPI_REQUEST_NULL, std::vector<char>(static_cast<const char *>(data),
                                                            static_cast<const char *>(data) + bytes)});
    Outgoing &o = outgoing.back();
    call([&] {
      return MPI_Isend(o.bytes.data(), int(bytes), MPI_BYTE, peer, int(tag % tagLimit), MPI_COMM_WORLD,
                       &o.request);
    }, "MPI_Isend", rank, what);
  }

  void recv(int rank, int peer, int64_t tag, void *data, int64_t bytes) override {
    std::string what = cat("to receive message ", tag, " from rank ", peer);
    checkCount(bytes, rank, what);
    checkPeer(rank, peer, "recv", "receive from");
    {
      std::lock_guard<std::mutex> sending(outgoingMutex);
      reap(rank);
    }
    // Probe first: a message longer than expected would be an MPI error
    // (truncation) instead of the ranks' disagreement it is.
    MPI_Status status;
    int got = 0;
    poll(rank, what, [&] {
      int ready = 0;
      int rc = MPI_Iprobe(peer, int(tag % tagLimit), MPI_COMM_WORLD, &ready, &status);
      return std::make_pair(rc, ready != 0);
    }, "MPI_Iprobe");
    MPI_Get_count(&status, MPI_BYTE, &got);
    if (got != bytes)
      fail(LOOM_INVALID_BUNDLE, "recv: rank ", rank, " expects ", bytes, " bytes from rank ", peer,
           " but got ", got, " (the ranks' programs disagree)");
    MPI_Request request;
    call([&] {
      return MPI_Irecv(data, int(bytes), MPI_BYTE, peer, int(tag % tagLimit), MPI_COMM_WORLD, &request);
    }, "MPI_Irecv", rank, what);
    wait(rank, request, what);
  }

  void broadcastBytes(int rank, int root, void *data, int64_t bytes) override {
    std::string what = cat("for bytes broadcast from rank ", root);
    std::vector<int> everyone(static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r)
      everyone[r] = r;
    agree(rank, everyone, MPI_COMM_WORLD, {CollectiveSignature::Bytes, bytes, root}, what);
    MPI_Request request;
    call([&] { return MPI_Ibcast(data, int(bytes), MPI_BYTE, root, MPI_COMM_WORLD, &request); },
         "MPI_Ibcast", rank, what);
    wait(rank, request, what);
  }

  std::string lostPeers() override { return describeLostMpiRanks(); }

  void abort(int rank, const std::string &message) override {
    const char *stopping = "; stopping every rank";
    bool said = message.size() >= std::strlen(stopping) &&
                message.compare(message.size() - std::strlen(stopping), std::string::npos, stopping) == 0;
    std::fprintf(stderr, "loom-run: rank %d failed: %s%s\n", rank, message.c_str(), said ? "" : stopping);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

private:
  struct Outgoing {
    MPI_Request request;
    std::vector<char> bytes;
  };

  static std::string list(const std::vector<int> &group) {
    std::string s;
    for (int r : group)
      s += (s.empty() ? "" : ",") + std::to_string(r);
    return s;
  }
  /// Runs one MPI call under the lock (a rank's communication thread and its
  /// main thread both call MPI) and turns an error code into an Error.
  template <typename Call>
  int call(Call mpiCall, const char *name, int rank, const std::string &what) {
    int rc;
    {
      std::lock_guard<std::mutex> lock(mpiMutex);
      rc = mpiCall();
    }
    if (rc != MPI_SUCCESS) {
      char text[MPI_MAX_ERROR_STRING];
      int len = 0;
      MPI_Error_string(rc, text, &len);
      fail(LOOM_INTERNAL, "rank ", rank, " ", what, ": ", name, " failed: ", std::string(text, len));
    }
    return rc;
  }
  void checkCount(int64_t count, int rank, const std::string &what) {
    if (count < 0 || count > INT32_MAX)
      fail(LOOM_UNSUPPORTED, "rank ", rank, " ", what, ": ", count,
           " elements, more than one MPI call moves (2^31 - 1)");
  }
  void checkPeer(int rank, int peer, const char *op, const char *verb) {
    if (peer < 0 || peer >= ranks || peer == rank)
      fail(LOOM_INVALID_BUNDLE, op, ": rank ", rank, " cannot ", verb, " rank ", peer);
  }
  /// Before a collective, every member of the group shares what it is about
  /// to do (kind, count, root or reduction); members that disagree would make
  /// MPI truncate or overrun a buffer, so each fails naming the difference.
  void agree(int rank, const std::vector<int> &group, MPI_Comm comm, CollectiveSignature mine,
             const std::string &what) {
    checkCount(mine.count, rank, what);
    std::vector<CollectiveSignature> all(group.size());
    MPI_Request request;
    call([&] {
      return MPI_Iallgather(&mine, 3, MPI_INT64_T, all.data(), 3, MPI_INT64_T, comm, &request);
    }, "MPI_Iallgather", rank, what);
    wait(rank, request, what);
    for (size_t i = 0; i < group.size(); ++i)
      if (std::string error = disagreement(rank, mine, group[i], all[i], group); !error.empty())
        fail(LOOM_INVALID_BUNDLE, error);
  }
  /// Polls `test` (returning an MPI code and whether it is done) until it is
  /// done, the timeout passes or a peer on this host is gone.
  template <typename Test> void poll(int rank, const std::string &what, Test test, const char *name) {
    auto start = std::chrono::steady_clock::now();
    auto lastCheck = start;
    for (int spins = 0;; ++spins) {
      int rc;
      bool done;
      {
        std::lock_guard<std::mutex> lock(mpiMutex);
        std::tie(rc, done) = test();
      }
      if (rc != MPI_SUCCESS)
        call([rc] { return rc; }, name, rank, what);
      if (done)
        return;
      auto now = std::chrono::steady_clock::now();
      if (std::chrono::duration<double>(now - start).count() > timeout)
        fail(LOOM_INVALID_ARGUMENT, "rank ", rank, " waited ", timeout, " s ", what,
             "; stopping every rank");
      if (now - lastCheck > std::chrono::milliseconds(200)) {
        lastCheck = now;
        if (std::string lost = describeLostMpiRanks(); !lost.empty())
          fail(LOOM_INVALID_ARGUMENT, lost, " while rank ", rank, " waited ", what,
               "; stopping every rank");
      }
      if (spins > 1000)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  void wait(int rank, MPI_Request &request, const std::string &what) {
    poll(rank, what, [&] {
      int done = 0;
      int rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      return std::make_pair(rc, done != 0);
    }, "MPI_Test");
  }
  /// Frees the sends that have gone out (outgoingMutex held).
  void reap(int rank) {
    while (!outgoing.empty()) {
      int done = 0;
      call([&] { return MPI_Test(&outgoing.front().request, &done, MPI_STATUS_IGNORE); }, "MPI_Test",
           rank, "sending");
      if (!done)
        return;
      outgoing.pop_front();
    }
  }
  /// One MPI communicator per group, created the first time the group is
  /// used (every member reaches that point in the same program order).
  MPI_Comm commOf(int rank, const std::vector<int> &group) {
    for (int r : group)
      if (r < 0 || r >= ranks)
        fail(LOOM_INVALID_BUNDLE, "group member ", r, " is not one of the ", ranks, " ranks");
    if (group.size() == size_t(ranks))
      return MPI_COMM_WORLD;
    std::lock_guard<std::mutex> lock(commsMutex);
    auto it = comms.find(group);
    if (it != comms.end())
      return it->second;
    bool member = false;
    for (int r : group)
      member |= r == rank;
    if (!member)
      fail(LOOM_INVALID_BUNDLE, "rank ", rank, " is not in its own group ", list(group));
    MPI_Group world, sub;
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    std::string what = cat("creating the communicator of ranks ", list(group));
    call([&] { return MPI_Group_incl(world, int(group.size()), group.data(), &sub); }, "MPI_Group_incl",
         rank, what);
    MPI_Comm comm;
    call([&] { return MPI_Comm_create_group(MPI_COMM_WORLD, sub, 77, &comm); }, "MPI_Comm_create_group",
         rank, what);
    MPI_Group_free(&sub);
    MPI_Group_free(&world);
    comms[group] = comm;
    return comm;
  }

  int ranks;
  double timeout;
  int tagLimit = 32767;
  std::mutex mpiMutex, outgoingMutex, commsMutex;
  std::map<std::vector<int>, MPI_Comm> comms;
  std::deque<Outgoing> outgoing;
};

} // namespace

std::shared_ptr<Communicator> makeMpiCommunicator(int &rank, int &size, double timeoutSeconds) {
  if (!initialised) {
    // A rank's communication thread (async all-reduces) calls MPI beside its
    // main thread; the communicator serialises the calls.
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    initialised = true;
    if (provided < MPI_THREAD_SERIALIZED)
      fail(LOOM_UNSUPPORTED, "this MPI gives thread level ", provided, ", below MPI_THREAD_SERIALIZED, "
           "which Loom's communication thread needs");
    // Errors come back as codes that Loom reports with the rank and the
    // collective, not as MPI's own abort.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (peers.empty()) { // every rank's host and process id (blocking: all ranks start here)
    hostName = thisHost();
    char mine[256] = {};
    std::snprintf(mine, sizeof mine, "%ld %.200s", long(::getpid()), hostName.c_str());
    std::vector<char> all(sizeof mine * size_t(size));
    MPI_Allgather(mine, int(sizeof mine), MPI_CHAR, all.data(), int(sizeof mine), MPI_CHAR, MPI_COMM_WORLD);
    for (int r = 0; r < size; ++r) {
      const char *entry = all.data() + r * sizeof mine;
      Peer p;
      p.pid = std::strtol(entry, nullptr, 10);
      const char *space = std::strchr(entry, ' ');
      p.host = space ? space + 1 : "";
      peers.push_back(p);
    }
  }
  return std::make_shared<MpiCommunicator>(size, timeoutSeconds);
}

void finalizeMpi() {
  if (initialised) {
    MPI_Finalize();
    initialised = false;
  }
}

std::string describeLostMpiRanks() {
  std::string lost;
  int count = 0;
  for (size_t r = 0; r < peers.size(); ++r)
    if (peers[r].host == hostName && peers[r].pid != long(::getpid()) && processGone(peers[r].pid))
      lost += cat(count++ ? ", " : "", "rank ", r, " (pid ", peers[r].pid, " on ", peers[r].host, ")");
  return count ? lost + (count > 1 ? " are" : " is") + " no longer running (killed or crashed)" : lost;
}

#endif

} // namespace loom::rt
