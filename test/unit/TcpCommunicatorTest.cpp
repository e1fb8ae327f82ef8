//===- TcpCommunicatorTest.cpp - Ranks connected over loopback TCP --------===//
//
// Each rank is a thread with its own TcpCommunicator, met through a
// rendezvous on 127.0.0.1, as Slurm's tasks meet at MASTER_ADDR:MASTER_PORT.
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Error.h"
#include "runtime/src/Communicator.h"
#include "runtime/src/TcpCommunicator.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <netinet/in.h>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

namespace rt = ::loom::rt;

namespace {

int freePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr *>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

/// Runs `work(rank, comm)` on `n` ranks, each a thread with its own TCP
/// communicator; returns each rank's error message ("" if none).
std::vector<std::string> onTcpRanks(int n, double timeout,
                                    const std::function<void(int, rt::Communicator &)> &work) {
  int port = freePort();
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        rt::LaunchedTask task;
        task.rank = r, task.size = n, task.address = "127.0.0.1", task.port = port;
        std::shared_ptr<rt::Communicator> comm = rt::makeTcpCommunicator(task, timeout);
        work(r, *comm);
      } catch (const rt::Error &e) {
        errors[r] = e.what();
      }
    });
  for (std::thread &t : threads)
    t.join();
  return errors;
}

/// The same on the in-process communicator.
void onThreadRanks(int n, const std::function<void(int, rt::Communicator &)> &work) {
  rt::InProcessCommunicator comm(n, 10);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] { work(r, comm); });
  for (std::thread &t : threads)
    t.join();
}

} // namespace

TEST(TcpCommunicator, CollectivesAndTransfersEqualTheInProcessOnes) {
  constexpr int n = 3;
  using Results = std::vector<std::vector<float>>;
  auto exercise = [](Results &out) {
    return [&out](int r, rt::Communicator &c) {
      std::vector<float> x(1000), y(1000), z(1000);
      for (int i = 0; i < 1000; ++i)
        x[i] = 0.1f * float(r + 1) + 1e-3f * float(i), y[i] = float(r * i % 7), z[i] = float(r);
      c.allReduce(r, {0, 1, 2}, x.data(), 1000, rt::Reduction::Sum);
      if (r > 0)
        c.allReduce(r, {1, 2}, y.data(), 1000, rt::Reduction::Mean);
      c.allReduce(r, {0, 1, 2}, y.data(), 1000, rt::Reduction::Max);
      c.broadcast(r, {0, 1, 2}, 2, z.data(), 1000);
      // A ring of transfers, received in another order than sent.
      float a = float(10 * r), b = float(10 * r + 1), gotA = 0, gotB = 0;
      c.send(r, (r + 1) % n, 5, &a, sizeof a);
      c.send(r, (r + 1) % n, 7, &b, sizeof b);
      c.recv(r, (r + n - 1) % n, 7, &gotB, sizeof gotB);
      c.recv(r, (r + n - 1) % n, 5, &gotA, sizeof gotA);
      x.push_back(gotA), x.push_back(gotB);
      out[r] = x;
      out[r].insert(out[r].end(), y.begin(), y.end());
      out[r].insert(out[r].end(), z.begin(), z.end());
    };
  };
  Results tcp(n), threads(n);
  std::vector<std::string> errors = onTcpRanks(n, 20, exercise(tcp));
  for (int r = 0; r < n; ++r)
    EXPECT_EQ(errors[r], "") << "rank " << r;
  onThreadRanks(n, exercise(threads));
  for (int r = 0; r < n; ++r)
    EXPECT_EQ(tcp[r], threads[r]) << "rank " << r; // bit for bit: the same order of additions
  EXPECT_EQ(tcp[1][1000], 0.0f);  // rank 0's message 5
  EXPECT_EQ(tcp[1][1001], 1.0f);  // and 7
}

TEST(TcpCommunicator, DisagreeingCollectivesFailEveryMemberNamingTheDifference) {
  std::vector<std::string> errors = onTcpRanks(2, 20, [](int r, rt::Communicator &c) {
    std::vector<float> x(4);
    c.allReduce(r, {0, 1}, x.data(), r == 0 ? 4 : 3, rt::Reduction::Sum);
  });
  for (const std::string &e : errors)
    EXPECT_NE(e.find("all-reduce over ranks 0,1: rank 1 contributes 3 elements but rank 0 4 (the ranks' "
                     "programs disagree)"), std::string::npos) << e;
  errors = onTcpRanks(2, 20, [](int r, rt::Communicator &c) {
    float x = 0;
    if (r == 0)
      c.allReduce(r, {0, 1}, &x, 1, rt::Reduction::Sum);
    else
      c.broadcast(r, {0, 1}, 0, &x, 1);
  });
  EXPECT_NE(errors[0].find("rank 0 is in an all-reduce over ranks 0,1 but rank 1 in a broadcast"),
            std::string::npos) << errors[0];
}

TEST(TcpCommunicator, APeerThatGoesAwayFailsTheWaitingRankAtOnce) {
  auto start = std::chrono::steady_clock::now();
  std::vector<std::string> errors = onTcpRanks(2, 60, [](int r, rt::Communicator &c) {
    float x = 0;
    if (r == 0) // rank 1 leaves (its communicator closes) without sending
      c.recv(r, 1, 3, &x, sizeof x);
  });
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(errors[0].find("rank 1 closed its connection (the process exited or was killed) while rank 0 "
                           "waited to receive message 3 from rank 1"), std::string::npos) << errors[0];
  EXPECT_LT(seconds, 30); // not the 60 s timeout
}

TEST(TcpCommunicator, AFailedRankStopsTheOthersWithItsMessage) {
  std::vector<std::string> errors = onTcpRanks(3, 60, [](int r, rt::Communicator &c) {
    float x = 0;
    if (r == 2)
      c.abort(2, "out of cheese");
    else
      c.allReduce(r, {0, 1, 2}, &x, 1, rt::Reduction::Sum);
  });
  EXPECT_EQ(errors[0], "rank 2 failed: out of cheese");
  // Rank 1 hears of the failure through rank 0, the star's centre, which
  // passes the message on and then stops: rank 1 may read that close before
  // the message (a race seen once in CI). Either way it stops, naming why.
  EXPECT_TRUE(errors[1] == "rank 2 failed: out of cheese" ||
              errors[1].find("rank 0 closed its connection") != std::string::npos)
      << errors[1];
}

TEST(TcpCommunicator, ARankThatNeverArrivesTimesOut) {
  int port = freePort();
  rt::LaunchedTask task;
  task.rank = 0, task.size = 2, task.address = "127.0.0.1", task.port = port;
  try {
    rt::makeTcpCommunicator(task, 0.5);
    FAIL() << "rank 0 met nobody";
  } catch (const rt::Error &e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 waited 0.5 s for rank 1 of 2 to arrive at 127.0.0.1:"),
              std::string::npos) << e.what();
  }
}
