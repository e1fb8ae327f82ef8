//===- CpuBackend.h - Plain C++ execution of instruction streams -*- C++ -*-===//
//
// The reference backend: every instruction of a rank's program as a plain,
// correct C++ kernel over the rank's arena (threads where it pays: GEMM,
// attention, convolution). Instructions are checked once when the program is
// prepared, so a corrupt bundle is refused before anything runs.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_CPU_CPUBACKEND_H
#define LOOM_RUNTIME_CPU_CPUBACKEND_H

#include "loom/rt/Bundle.h"
#include "runtime/src/Communicator.h"
#include "runtime/src/ThreadPool.h"

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <memory>
#include <string>
#include <vector>

namespace loom::rt {

/// Collectives that run beside the computation (the bundle's communication
/// stream): a worker thread takes them in the order they are submitted
/// (every rank submits in the same order); a task may record an event when
/// it is done, and `event_wait` blocks until that event (hence every task
/// before it) has happened, rethrowing the first failure. Data-parallel
/// gradient buckets go out this way while backward goes on.
class AsyncComm {
public:
  AsyncComm();
  ~AsyncComm();
  /// Queues `task`; when it is done, event `event` (if >= 0) is recorded.
  void submit(std::function<void()> task, int64_t event = -1);
  /// Waits for `event` (-1: for everything submitted).
  void wait(int64_t event = -1);

private:
  void loop();
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<std::pair<std::function<void()>, int64_t>> tasks;
  std::map<int64_t, int64_t> eventAt; // event -> the submission that records it
  int64_t submitted = 0, completed = 0;
  int64_t running = 0;
  bool stopping = false;
  std::exception_ptr error;
  std::thread worker;
};

class CpuProgram {
public:
  /// Validates `instrs` against `rank`'s buffers and builds the kernels.
  /// `arena` must hold rank.arenaBytes bytes and outlive the program.
  /// `allocate` false only validates (no scratch memory; never run it).
  CpuProgram(const RankProgram &rank, const std::vector<Instruction> &instrs, char *arena,
             ThreadPool &pool, const std::string &programName, bool allocate = true,
             Communicator *comm = nullptr, AsyncComm *async = nullptr);
  /// Runs every instruction in order; throws Error naming the instruction
  /// when a run-time check fails (a token id outside the vocabulary, say).
  void run();
  /// Runs every instruction, adding its time to `times` under its op name.
  void runProfiled(std::map<std::string, std::pair<double, int64_t>> &times);

  struct Step {
    std::string what; // "forward[12] attention" for error messages
    std::string op;
    std::function<void()> kernel;
  };
private:
  std::vector<Step> steps;
  std::vector<std::vector<float>> scratch; // f32 copies of bf16 operands
};

/// Names of the instructions the CPU backend runs (for docs and errors).
std::vector<std::string> cpuSupportedOps();

} // namespace loom::rt

#endif
