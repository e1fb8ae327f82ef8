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
  /// `label` names it on the timeline (loom-run --trace).
  void submit(std::function<void()> task, int64_t event = -1, std::string label = "");
  /// Called with each labelled task's label, start and end (traceClock
  /// seconds) while set; null: no timing.
  void setTracer(std::function<void(const std::string &, double, double)> tracer);
  /// Waits for `event` (-1: for everything submitted).
  void wait(int64_t event = -1);

private:
  void loop();
  std::mutex mutex;
  std::condition_variable cv;
  struct Task {
    std::function<void()> run;
    int64_t event;
    std::string label;
  };
  std::deque<Task> tasks;
  std::function<void(const std::string &, double, double)> tracer;
  std::map<int64_t, int64_t> eventAt; // event -> the submission that records it
  int64_t submitted = 0, completed = 0;
  int64_t running = 0;
  bool stopping = false;
  std::exception_ptr error;
  std::thread worker;
};

struct CpuProgramStep {
  std::string what; // "forward[12] attention" for error messages
  std::string op;
  std::function<void()> kernel;
  bool queues = false; // an async collective: the kernel queues it on the communication thread
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
  /// Runs every instruction, calling `timed(step, start, end)` (seconds of
  /// Backend::traceClock) after each.
  void runTimed(const std::function<void(const CpuProgramStep &, double, double)> &timed);

  using Step = CpuProgramStep;

private:
  std::vector<Step> steps;
  std::vector<std::vector<float>> scratch; // f32 copies of bf16 operands
};

/// Names of the instructions the CPU backend runs (for docs and errors).
std::vector<std::string> cpuSupportedOps();

} // namespace loom::rt

#endif
