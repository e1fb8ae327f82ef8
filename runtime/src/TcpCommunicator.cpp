//===- TcpCommunicator.cpp - Collectives between processes over TCP -------===//

#include "runtime/src/TcpCommunicator.h"
#include "loom/rt/Error.h"

#include <algorithm>
#include <arpa/inet.h>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <thread>
#include <tuple>
#include <unistd.h>
#include <vector>

namespace loom::rt {

namespace {

using Clock = std::chrono::steady_clock;

/// A whole number from the environment, or nullopt if unset; throws if malformed.
std::optional<long> envNumber(const char *name, long low, long high) {
  const char *v = std::getenv(name);
  if (!v)
    return std::nullopt;
  char *end = nullptr;
  errno = 0;
  long n = std::strtol(v, &end, 10);
  if (!*v || *end || errno == ERANGE || n < low || n > high)
    fail(LOOM_INVALID_ARGUMENT, "environment variable ", name, " must be a whole number from ", low,
         " to ", high, ", got '", v, "'");
  return n;
}

int millisecondsUntil(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return int(std::max<long long>(0, std::min<long long>(left, 1000)));
}

/// Waits until `fd` is ready for `events` or the deadline passes.
bool waitFor(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, millisecondsUntil(deadline));
    if (rc > 0)
      return true;
    if (rc < 0 && errno != EINTR)
      return false;
    if (Clock::now() >= deadline)
      return false;
  }
}

/// Writes all of `bytes`; false if the peer is gone or the deadline passes.
bool writeAll(int fd, const void *data, size_t bytes, Clock::time_point deadline) {
  const char *p = static_cast<const char *>(data);
  while (bytes > 0) {
    ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n, bytes -= size_t(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!waitFor(fd, POLLOUT, deadline))
        return false;
    } else {
      return false;
    }
  }
  return true;
}

/// Reads exactly `bytes`; false on end of stream or error.
bool readAll(int fd, void *data, size_t bytes) {
  char *p = static_cast<char *>(data);
  while (bytes > 0) {
    ssize_t n = ::recv(fd, p, bytes, 0);
    if (n > 0)
      p += n, bytes -= size_t(n);
    else if (n < 0 && errno == EINTR)
      continue;
    else
      return false;
  }
  return true;
}

std::string list(const std::vector<int> &group) {
  std::string s;
  for (int r : group)
    s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

constexpr uint32_t kMagic = 0x4c4f4f4d; // "LOOM"

/// What travels between two ranks: a point-to-point message (tag), one
/// member's part of a collective (group and sequence number), or an abort.
enum FrameType : uint32_t { kData = 1, kCollective, kAbort };
struct FrameHeader {
  uint32_t type;
  uint32_t members; // group members that follow the header (collectives)
  int64_t tag;      // message tag, or the group's collective sequence number
  CollectiveSignature signature; // collectives
  int64_t bytes;    // payload
};

struct Frame {
  FrameHeader header;
  std::vector<char> payload;
};

class TcpCommunicator : public Communicator {
public:
  TcpCommunicator(const LaunchedTask &task, double timeoutSeconds)
      : self(task.rank), ranks(task.size), timeout(timeoutSeconds),
        sockets(size_t(task.size), -1), closed(size_t(task.size), false), writing(size_t(task.size)) {
    try {
      connectAll(task);
    } catch (...) {
      for (int fd : sockets)
        if (fd >= 0)
          ::close(fd);
      throw;
    }
    if (::pipe(wakeup) != 0)
      fail(LOOM_INTERNAL, "pipe failed: ", std::strerror(errno));
    reader = std::thread([this] { readLoop(); });
  }

  ~TcpCommunicator() override {
    // Tell every peer this rank sends no more, then drain what they still
    // send until they close too (a peer reads what we sent before it exits),
    // for a few seconds at most.
    for (int fd : sockets)
      if (fd >= 0)
        ::shutdown(fd, SHUT_WR);
    {
      std::unique_lock<std::mutex> lock(mutex);
      cv.wait_for(lock, std::chrono::seconds(5), [&] {
        for (int r = 0; r < ranks; ++r)
          if (r != self && !closed[r])
            return false;
        return true;
      });
    }
    char byte = 0;
    (void)!::write(wakeup[1], &byte, 1);
    reader.join();
    for (int fd : sockets)
      if (fd >= 0)
        ::close(fd);
    ::close(wakeup[0]);
    ::close(wakeup[1]);
  }

  int size() const override { return ranks; }

  void allReduce(int rank, const std::vector<int> &group, float *data, int64_t count,
                 Reduction op) override {
    collective(rank, group, {CollectiveSignature::AllReduce, count, int64_t(op)}, data,
               count * int64_t(sizeof(float)),
               cat("in an all-reduce over ranks ", list(group)), [&](std::vector<Frame> &parts) {
                 // In group order, as the in-process communicator adds them.
                 std::vector<const float *> sources;
                 for (size_t i = 0; i < group.size(); ++i) {
                   const char *part = group[i] == rank ? reinterpret_cast<const char *>(data)
                                                       : parts[i].payload.data();
                   sources.push_back(reinterpret_cast<const float *>(part));
                 }
                 std::vector<float> result(static_cast<size_t>(count));
                 for (int64_t i = 0; i < count; ++i) {
                   float acc = sources[0][i];
                   for (size_t s = 1; s < sources.size(); ++s)
                     acc = op == Reduction::Max ? std::max(acc, sources[s][i]) : acc + sources[s][i];
                   result[i] = op == Reduction::Mean ? acc / static_cast<float>(group.size()) : acc;
                 }
                 std::memcpy(data, result.data(), result.size() * sizeof(float));
               });
  }

  void broadcast(int rank, const std::vector<int> &group, int root, float *data,
                 int64_t count) override {
    if (std::find(group.begin(), group.end(), root) == group.end())
      fail(LOOM_INVALID_BUNDLE, "broadcast: root ", root, " is not in the group");
    rootedBroadcast(rank, group, {CollectiveSignature::Broadcast, count, root}, data,
                    count * int64_t(sizeof(float)), cat("in a broadcast over ranks ", list(group)));
  }

  void broadcastBytes(int rank, int root, void *data, int64_t bytes) override {
    std::vector<int> everyone(static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r)
      everyone[r] = r;
    rootedBroadcast(rank, everyone, {CollectiveSignature::Bytes, bytes, root}, data, bytes,
                    cat("for bytes broadcast from rank ", root));
  }

  void send(int rank, int peer, int64_t tag, const void *data, int64_t bytes) override {
    checkPeer(rank, peer, "send", "send to");
    FrameHeader h{kData, 0, tag, {}, bytes};
    transmit(rank, peer, h, {}, data, cat("to send message ", tag, " to rank ", peer));
  }

  void recv(int rank, int peer, int64_t tag, void *data, int64_t bytes) override {
    checkPeer(rank, peer, "recv", "receive from");
    Frame f = take(rank, {peer, kData, {}, tag}, cat("to receive message ", tag, " from rank ", peer));
    if (f.header.bytes != bytes)
      fail(LOOM_INVALID_BUNDLE, "recv: rank ", rank, " expects ", bytes, " bytes from rank ", peer,
           " but got ", f.header.bytes, " (the ranks' programs disagree)");
    std::memcpy(data, f.payload.data(), size_t(bytes));
  }

  void abort(int rank, const std::string &message) override {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!aborted) {
        aborted = true;
        abortMessage = cat("rank ", rank, " failed: ", message);
      }
      cv.notify_all();
    }
    std::string text = cat("rank ", rank, " failed: ", message);
    FrameHeader h{kAbort, 0, 0, {}, int64_t(text.size())};
    for (int r = 0; r < ranks; ++r)
      if (r != self)
        sendFrame(r, h, {}, text.data(), Clock::now() + std::chrono::seconds(1));
  }

  std::string lostPeers() override {
    std::lock_guard<std::mutex> lock(mutex);
    std::string lost;
    for (int r = 0; r < ranks; ++r)
      if (r != self && closed[r])
        lost += cat(lost.empty() ? "" : ", ", "rank ", r);
    return lost.empty() ? lost : lost + " closed its connection (the process exited or was killed)";
  }

private:
  using Key = std::tuple<int, uint32_t, std::vector<int>, int64_t>; // from, type, group, tag

  void checkPeer(int rank, int peer, const char *op, const char *verb) {
    if (peer < 0 || peer >= ranks || peer == rank)
      fail(LOOM_INVALID_BUNDLE, op, ": rank ", rank, " cannot ", verb, " rank ", peer);
  }

  Clock::time_point deadline() const {
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout));
  }

  bool sendFrame(int peer, const FrameHeader &h, const std::vector<int> &group, const void *payload,
                 Clock::time_point until) {
    std::lock_guard<std::mutex> lock(writing[peer]);
    int fd = sockets[peer];
    return writeAll(fd, &h, sizeof h, until) &&
           writeAll(fd, group.data(), group.size() * sizeof(int), until) &&
           writeAll(fd, payload, size_t(h.bytes), until);
  }

  void transmit(int rank, int peer, const FrameHeader &h, const std::vector<int> &group,
                const void *payload, const std::string &what) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (aborted)
        fail(LOOM_INVALID_ARGUMENT, abortMessage);
    }
    if (!sendFrame(peer, h, group, payload, deadline())) {
      std::lock_guard<std::mutex> lock(mutex);
      if (aborted)
        fail(LOOM_INVALID_ARGUMENT, abortMessage);
      fail(LOOM_INVALID_ARGUMENT, "rank ", peer, " closed its connection (the process exited or was "
           "killed), or took more than ", timeout, " s to accept data, while rank ", rank, " tried ", what,
           "; stopping every rank");
    }
  }

  /// Waits for the frame `key` names; fails on abort, a closed peer or the timeout.
  Frame take(int rank, const Key &key, const std::string &what) {
    std::unique_lock<std::mutex> lock(mutex);
    int from = std::get<0>(key);
    auto &box = mailboxes[key];
    bool ready = cv.wait_for(lock, std::chrono::duration<double>(timeout),
                             [&] { return !box.empty() || aborted || closed[from]; });
    if (aborted)
      fail(LOOM_INVALID_ARGUMENT, abortMessage);
    if (box.empty() && closed[from])
      fail(LOOM_INVALID_ARGUMENT, "rank ", from, " closed its connection (the process exited or was "
           "killed) while rank ", rank, " waited ", what, "; stopping every rank");
    if (!ready)
      fail(LOOM_INVALID_ARGUMENT, "rank ", rank, " waited ", timeout, " s ", what, "; stopping every rank");
    Frame f = std::move(box.front());
    box.pop_front();
    if (box.empty()) // every collective has a key of its own: keep the map small
      mailboxes.erase(key);
    return f;
  }

  int64_t nextSequence(const std::vector<int> &group) {
    std::lock_guard<std::mutex> lock(mutex);
    return sequence[group]++;
  }

  /// Every member sends its part to the group's first member (the leader),
  /// which checks that all are in the same collective, combines the parts
  /// (`combine`, given every member's frame in group order; the leader's own
  /// is in `data`) and sends the result back.
  template <typename Combine>
  void collective(int rank, const std::vector<int> &group, CollectiveSignature mine, void *data,
                  int64_t bytes, const std::string &what, Combine combine, bool contributes = true) {
    if (std::find(group.begin(), group.end(), rank) == group.end())
      fail(LOOM_INVALID_BUNDLE, "rank ", rank, " is not in its own group ", list(group));
    for (int r : group)
      if (r < 0 || r >= ranks)
        fail(LOOM_INVALID_BUNDLE, "group member ", r, " is not one of the ", ranks, " ranks");
    int leader = group[0];
    int64_t seq = nextSequence(group);
    if (rank != leader) {
      FrameHeader h{kCollective, uint32_t(group.size()), seq, mine, contributes ? bytes : 0};
      transmit(rank, leader, h, group, data, what);
      Frame result = take(rank, {leader, kCollective, group, seq}, what);
      if (result.header.signature.kind < 0) // the leader found the members disagreeing
        fail(LOOM_INVALID_BUNDLE, std::string(result.payload.begin(), result.payload.end()));
      if (result.header.bytes != bytes)
        fail(LOOM_INTERNAL, "rank ", rank, " ", what, ": got ", result.header.bytes, " bytes back, not ",
             bytes);
      std::memcpy(data, result.payload.data(), size_t(bytes));
      return;
    }
    std::vector<Frame> parts(group.size());
    std::string error;
    for (size_t i = 1; i < group.size(); ++i) {
      parts[i] = take(rank, {group[i], kCollective, group, seq}, what);
      if (error.empty())
        error = disagreement(leader, mine, group[i], parts[i].header.signature, group);
    }
    if (error.empty())
      combine(parts);
    CollectiveSignature answer = mine;
    if (!error.empty())
      answer.kind = -1;
    FrameHeader reply{kCollective, uint32_t(group.size()), seq, answer,
                      error.empty() ? bytes : int64_t(error.size())};
    for (size_t i = 1; i < group.size(); ++i)
      transmit(rank, group[i], reply, group, error.empty() ? data : error.data(), what);
    if (!error.empty())
      fail(LOOM_INVALID_BUNDLE, error);
  }

  /// A broadcast from the signature's root through the leader: the root's
  /// part travels to the leader (unless it is the leader), then to every member.
  void rootedBroadcast(int rank, const std::vector<int> &group, CollectiveSignature mine, void *data,
                       int64_t bytes, const std::string &what) {
    int root = int(mine.detail);
    collective(rank, group, mine, data, bytes, what, [&](std::vector<Frame> &parts) {
      if (root != group[0])
        for (size_t i = 1; i < group.size(); ++i)
          if (group[i] == root)
            std::memcpy(data, parts[i].payload.data(), size_t(bytes));
    }, rank == root);
  }

  void readLoop() {
    std::vector<pollfd> fds;
    for (;;) {
      fds.clear();
      fds.push_back({wakeup[0], POLLIN, 0});
      {
        std::lock_guard<std::mutex> lock(mutex);
        for (int r = 0; r < ranks; ++r)
          if (r != self && !closed[r])
            fds.push_back({sockets[r], POLLIN, 0});
      }
      if (::poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR)
        return;
      if (fds[0].revents)
        return;
      for (size_t i = 1; i < fds.size(); ++i) {
        if (!fds[i].revents)
          continue;
        int from = int(std::find(sockets.begin(), sockets.end(), fds[i].fd) - sockets.begin());
        Frame f;
        std::vector<int> group;
        bool ok = readAll(fds[i].fd, &f.header, sizeof f.header) && f.header.bytes >= 0 &&
                  f.header.bytes < (int64_t(1) << 40) && f.header.members <= uint32_t(ranks);
        if (ok) {
          group.resize(f.header.members);
          f.payload.resize(size_t(f.header.bytes));
          ok = readAll(fds[i].fd, group.data(), group.size() * sizeof(int)) &&
               readAll(fds[i].fd, f.payload.data(), f.payload.size());
        }
        std::lock_guard<std::mutex> lock(mutex);
        if (!ok) {
          closed[from] = true;
        } else if (f.header.type == kAbort) {
          if (!aborted) {
            aborted = true;
            abortMessage = std::string(f.payload.begin(), f.payload.end());
          }
        } else {
          int64_t tag = f.header.tag;
          mailboxes[{from, f.header.type, std::move(group), tag}].push_back(std::move(f));
        }
        cv.notify_all();
      }
    }
  }

  /// The rendezvous: rank 0 listens at the master address and tells every
  /// rank where the others listen; then each rank connects to the ranks
  /// below it and accepts the ones above.
  void connectAll(const LaunchedTask &task) {
    auto until = deadline();
    int listener = listenOn(self == 0 ? task.port : 0, self == 0);
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } closeListener{listener};
    sockaddr_in mine{};
    socklen_t len = sizeof mine;
    ::getsockname(listener, reinterpret_cast<sockaddr *>(&mine), &len);
    struct Hello {
      uint32_t magic;
      int32_t rank, size;
      uint32_t address; // network order; filled in by rank 0 from the connection
      uint16_t port;
    };
    std::vector<Hello> table(static_cast<size_t>(ranks));
    if (self == 0) {
      for (int accepted = 1; accepted < ranks; ++accepted) {
        sockaddr_in peer{};
        int fd = acceptOne(listener, until, peer, cat("for rank ", accepted, " of ", ranks,
                                                       " to arrive at ", task.address, ":", task.port));
        Hello h{};
        if (!readAll(fd, &h, sizeof h) || h.magic != kMagic) {
          ::close(fd);
          fail(LOOM_INVALID_ARGUMENT, "something that is not a Loom rank connected to ", task.address, ":",
               task.port, " (MASTER_ADDR:MASTER_PORT); pick another MASTER_PORT");
        }
        if (h.size != ranks || h.rank < 1 || h.rank >= ranks || sockets[h.rank] >= 0) {
          ::close(fd);
          fail(LOOM_INVALID_ARGUMENT, "a task that says it is rank ", h.rank, " of ", h.size,
               " joined rank 0 of ", ranks, " at ", task.address, ":", task.port,
               " (SLURM_PROCID must be unique and SLURM_NTASKS the same on every task)");
        }
        h.address = peer.sin_addr.s_addr;
        table[h.rank] = h;
        sockets[h.rank] = fd;
      }
      for (int r = 1; r < ranks; ++r)
        if (!writeAll(sockets[r], table.data(), table.size() * sizeof(Hello), until))
          fail(LOOM_INVALID_ARGUMENT, "rank 0 could not send the rendezvous table to rank ", r);
    } else {
      int fd = connectTo(task.address, task.port, until, "rank 0");
      sockets[0] = fd;
      Hello h{kMagic, self, ranks, 0, mine.sin_port};
      if (!writeAll(fd, &h, sizeof h, until) || !waitFor(fd, POLLIN, until) ||
          !readAll(fd, table.data(), table.size() * sizeof(Hello)))
        fail(LOOM_INVALID_ARGUMENT, "rank ", self, " met rank 0 at ", task.address, ":", task.port,
             " but got no rendezvous table within ", timeout, " s (did rank 0 fail?)");
      for (int r = 1; r < self; ++r) { // connect to the ranks below, naming ourselves
        char text[INET_ADDRSTRLEN] = {};
        in_addr a{table[r].address};
        ::inet_ntop(AF_INET, &a, text, sizeof text);
        int peer = connectTo(text, ntohs(table[r].port), until, cat("rank ", r));
        Hello me{kMagic, self, ranks, 0, 0};
        if (!writeAll(peer, &me, sizeof me, until))
          fail(LOOM_INVALID_ARGUMENT, "rank ", self, " could not greet rank ", r);
        sockets[r] = peer;
      }
      for (int r = self + 1; r < ranks; ++r) { // and accept the ranks above
        sockaddr_in peer{};
        int fd = acceptOne(listener, until, peer, cat("for the ranks above ", self, " to connect"));
        Hello h{};
        if (!readAll(fd, &h, sizeof h) || h.magic != kMagic || h.rank <= self || h.rank >= ranks ||
            sockets[h.rank] >= 0) {
          ::close(fd);
          fail(LOOM_INVALID_ARGUMENT, "rank ", self,
               " was reached by something that is not a higher rank of this job");
        }
        sockets[h.rank] = fd;
      }
    }
    for (int fd : sockets)
      if (fd >= 0) {
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      }
  }

  int listenOn(int port, bool rendezvous) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
      fail(LOOM_INTERNAL, "socket failed: ", std::strerror(errno));
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(uint16_t(port));
    if (::bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0 || ::listen(fd, 128) != 0) {
      int e = errno;
      ::close(fd);
      fail(LOOM_INVALID_ARGUMENT, rendezvous ? cat("rank 0 cannot listen on MASTER_PORT ", port, ": ")
                                             : std::string("cannot listen on a TCP port: "),
           std::strerror(e), rendezvous ? " (is another job using it?)" : "");
    }
    return fd;
  }

  int acceptOne(int listener, Clock::time_point until, sockaddr_in &peer, const std::string &what) {
    if (!waitFor(listener, POLLIN, until))
      fail(LOOM_INVALID_ARGUMENT, "rank ", self, " waited ", timeout, " s ", what, "; stopping");
    socklen_t len = sizeof peer;
    int fd = ::accept4(listener, reinterpret_cast<sockaddr *>(&peer), &len, SOCK_CLOEXEC);
    if (fd < 0)
      fail(LOOM_INTERNAL, "accept failed: ", std::strerror(errno));
    if (!waitFor(fd, POLLIN, until)) {
      ::close(fd);
      fail(LOOM_INVALID_ARGUMENT, "rank ", self, " waited ", timeout, " s ", what, "; stopping");
    }
    return fd;
  }

  /// Connects to `host`:`port`, retrying until the deadline (the other side
  /// may not listen yet).
  int connectTo(const std::string &host, int port, Clock::time_point until, const std::string &who) {
    addrinfo hints{}, *found = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); rc != 0)
      fail(LOOM_INVALID_ARGUMENT, "cannot resolve '", host, "' (MASTER_ADDR): ", ::gai_strerror(rc));
    sockaddr_in a = *reinterpret_cast<sockaddr_in *>(found->ai_addr);
    ::freeaddrinfo(found);
    for (;;) {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0)
        fail(LOOM_INTERNAL, "socket failed: ", std::strerror(errno));
      if (::connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) == 0)
        return fd;
      int e = errno;
      ::close(fd);
      if (Clock::now() >= until)
        fail(LOOM_INVALID_ARGUMENT, "rank ", self, " could not reach ", who, " at ", host, ":", port,
             " within ", timeout, " s: ", std::strerror(e));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  int self, ranks;
  double timeout;
  std::vector<int> sockets;
  std::vector<bool> closed;
  std::deque<std::mutex> writing; // one per peer: whole frames, from any thread
  int wakeup[2] = {-1, -1};
  std::thread reader;
  std::mutex mutex;
  std::condition_variable cv;
  std::map<Key, std::deque<Frame>> mailboxes;
  std::map<std::vector<int>, int64_t> sequence;
  bool aborted = false;
  std::string abortMessage;
};

} // namespace

std::optional<LaunchedTask> launchedTaskFromEnvironment() {
  std::optional<long> size = envNumber("SLURM_NTASKS", 1, 1 << 20);
  std::optional<long> rank = envNumber("SLURM_PROCID", 0, 1 << 20);
  if (!size || !rank || *size < 2)
    return std::nullopt;
  const char *address = std::getenv("MASTER_ADDR");
  std::optional<long> port = envNumber("MASTER_PORT", 1, 65535);
  if (!address || !*address || !port) {
    if (std::getenv("SLURM_STEP_ID")) // a task of `srun -n N`: its peers are waiting
      fail(LOOM_INVALID_ARGUMENT, "task ", *rank, " of ", *size, " (SLURM_PROCID, SLURM_NTASKS) has no "
           "rendezvous: set MASTER_ADDR to the first node's address and MASTER_PORT to a free port, e.g. "
           "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1) MASTER_PORT=29500");
    return std::nullopt; // a batch script's own shell: one process
  }
  if (*rank >= *size)
    fail(LOOM_INVALID_ARGUMENT, "SLURM_PROCID is ", *rank, " but SLURM_NTASKS only ", *size);
  LaunchedTask task;
  task.rank = int(*rank);
  task.size = int(*size);
  task.localRank = int(envNumber("SLURM_LOCALID", 0, 1 << 20).value_or(0));
  task.address = address;
  task.port = int(*port);
  return task;
}

std::shared_ptr<Communicator> makeTcpCommunicator(const LaunchedTask &task, double timeoutSeconds) {
  return std::make_shared<TcpCommunicator>(task, timeoutSeconds);
}

} // namespace loom::rt
