//===- MpiCommunicator.cpp - Collectives between processes over MPI -------===//

#include "runtime/src/MpiCommunicator.h"
#include "loom/rt/Error.h"

#include <cstdlib>

#ifdef LOOM_HAVE_MPI
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
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

#else

namespace {

bool initialised = false;

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
    MPI_Comm comm = commOf(rank, group);
    MPI_Request request;
    check(MPI_Iallreduce(MPI_IN_PLACE, data, int(count), MPI_FLOAT,
                         op == Reduction::Max ? MPI_MAX : MPI_SUM, comm, &request),
          "MPI_Iallreduce");
    wait(rank, request, cat("in an all-reduce over ranks ", list(group)));
    if (op == Reduction::Mean)
      for (int64_t i = 0; i < count; ++i)
        data[i] /= float(group.size());
  }

  void broadcast(int rank, const std::vector<int> &group, int root, float *data,
                 int64_t count) override {
    MPI_Comm comm = commOf(rank, group);
    int index = 0;
    while (index < int(group.size()) && group[index] != root)
      ++index;
    if (index == int(group.size()))
      fail(LOOM_INVALID_BUNDLE, "broadcast: root ", root, " is not in the group");
    MPI_Request request;
    check(MPI_Ibcast(data, int(count), MPI_FLOAT, index, comm, &request), "MPI_Ibcast");
    wait(rank, request, cat("in a broadcast over ranks ", list(group)));
  }

  void send(int rank, int peer, int64_t tag, const void *data, int64_t bytes) override {
    reap();
    // Sends never block the sender: the bytes are copied and go out while
    // the rank computes on (pipeline schedules rely on it).
    outgoing.push_back({MPI_REQUEST_NULL, std::vector<char>(static_cast<const char *>(data),
                                                            static_cast<const char *>(data) + bytes)});
    check(MPI_Isend(outgoing.back().bytes.data(), int(bytes), MPI_BYTE, peer, int(tag % tagLimit),
                    MPI_COMM_WORLD, &outgoing.back().request),
          "MPI_Isend");
    (void)rank;
  }

  void recv(int rank, int peer, int64_t tag, void *data, int64_t bytes) override {
    reap();
    MPI_Request request;
    check(MPI_Irecv(data, int(bytes), MPI_BYTE, peer, int(tag % tagLimit), MPI_COMM_WORLD, &request),
          "MPI_Irecv");
    MPI_Status status;
    wait(rank, request, cat("to receive message ", tag, " from rank ", peer), &status);
    int got = 0;
    MPI_Get_count(&status, MPI_BYTE, &got);
    if (got != bytes)
      fail(LOOM_INVALID_BUNDLE, "recv: rank ", rank, " expects ", bytes, " bytes from rank ", peer,
           " but got ", got, " (the ranks' programs disagree)");
  }

  void broadcastBytes(int rank, int root, void *data, int64_t bytes) override {
    MPI_Request request;
    check(MPI_Ibcast(data, int(bytes), MPI_BYTE, root, MPI_COMM_WORLD, &request), "MPI_Ibcast");
    wait(rank, request, cat("for bytes broadcast from rank ", root));
  }

  void abort(int rank, const std::string &message) override {
    std::fprintf(stderr, "loom-run: rank %d failed: %s; stopping every rank\n", rank, message.c_str());
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
  static void check(int rc, const char *call) {
    if (rc != MPI_SUCCESS) {
      char text[MPI_MAX_ERROR_STRING];
      int len = 0;
      MPI_Error_string(rc, text, &len);
      fail(LOOM_INTERNAL, call, " failed: ", std::string(text, len));
    }
  }
  /// Polls a request until it completes or the timeout passes.
  void wait(int rank, MPI_Request &request, const std::string &what, MPI_Status *status = nullptr) {
    auto start = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      int done = 0;
      check(MPI_Test(&request, &done, status ? status : MPI_STATUS_IGNORE), "MPI_Test");
      if (done)
        return;
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout)
        fail(LOOM_INVALID_ARGUMENT, "rank ", rank, " waited ", timeout, " s ", what,
             "; stopping every rank");
      if (spins > 1000)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  void reap() {
    while (!outgoing.empty()) {
      int done = 0;
      check(MPI_Test(&outgoing.front().request, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (!done)
        return;
      outgoing.pop_front();
    }
  }
  /// One MPI communicator per group, created the first time the group is
  /// used (every member reaches that point in the same program order).
  MPI_Comm commOf(int rank, const std::vector<int> &group) {
    if (group.size() == size_t(ranks))
      return MPI_COMM_WORLD;
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
    check(MPI_Group_incl(world, int(group.size()), group.data(), &sub), "MPI_Group_incl");
    MPI_Comm comm;
    check(MPI_Comm_create_group(MPI_COMM_WORLD, sub, 77, &comm), "MPI_Comm_create_group");
    MPI_Group_free(&sub);
    MPI_Group_free(&world);
    comms[group] = comm;
    return comm;
  }

  int ranks;
  double timeout;
  int tagLimit = 32767;
  std::map<std::vector<int>, MPI_Comm> comms;
  std::deque<Outgoing> outgoing;
};

} // namespace

std::shared_ptr<Communicator> makeMpiCommunicator(int &rank, int &size, double timeoutSeconds) {
  if (!initialised) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    initialised = true;
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return std::make_shared<MpiCommunicator>(size, timeoutSeconds);
}

void finalizeMpi() {
  if (initialised) {
    MPI_Finalize();
    initialised = false;
  }
}

#endif

} // namespace loom::rt
