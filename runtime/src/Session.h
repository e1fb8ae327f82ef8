//===- Session.h - A loaded bundle, ready to run ----------------*- C++ -*-===//
#ifndef LOOM_RUNTIME_SESSION_H
#define LOOM_RUNTIME_SESSION_H

#include "runtime/src/Backend.h"
#include "loom/rt/Bundle.h"
#include "runtime/src/Communicator.h"

#include <memory>
#include <string>

namespace loom::rt {

struct SessionOptions {
  std::string backend = "cpu"; // cpu or cuda
  int threads = 0;             // CPU backend
  int device = 0;              // CUDA backend
  int rank = 0;                // which rank of the bundle this session runs
  /// How long a rank waits for its peers (the communicator joinProcessJob makes).
  double timeoutSeconds = kDefaultTimeoutSeconds;
  std::shared_ptr<Communicator> comm; // shared by the ranks of one process
  /// CUDA backend, several ranks: NCCL communicators of every rank in this process.
  std::shared_ptr<NcclWorld> nccl;
  /// CUDA backend, a measurement only (loom-run's LOOM_MEASURE_ONE_RANK):
  /// this rank of a multi-rank bundle runs alone, without NCCL; every
  /// collective is a local copy, as for a group of one.
  bool aloneForMeasurement = false;
};

class Session {
public:
  /// Reads and validates the bundle, sets up the backend, loads (or
  /// initialises) the weights and prepares every program. Throws Error.
  Session(const std::string &bundleDir, const SessionOptions &options);

  const Manifest &manifest() const { return bundle; }
  const RankProgram &rank() const { return bundle.ranks[rankIndex]; }
  const std::string &backendName() const { return backendKind; }

  const Buffer &input(const std::string &name) const;
  const Buffer &output(const std::string &name) const;
  void bindInput(const std::string &name, const void *data, size_t bytes);
  /// bindInput from the memory of CUDA device `device` (device to device).
  void bindInputFromDevice(const std::string &name, const void *data, size_t bytes, int device);
  /// The CUDA device that holds the arena; -1 for host memory.
  int cudaDevice() const { return backend->cudaDevice(); }
  /// Bytes in use on that device (Backend::deviceBytesInUse); -1 on the host.
  int64_t deviceBytesInUse() const { return backend->deviceBytesInUse(); }
  /// The address of an output in the arena, host or device memory.
  char *outputData(const std::string &name) const;
  void readOutput(const std::string &name, void *data, size_t bytes) const;
  void runForward();
  /// Forward, backward and update of a training bundle; returns the loss.
  float trainStep();
  bool canTrain() const;
  /// Optimizer steps taken (the "step" state of a training bundle).
  int64_t step() const;
  /// Parameters, optimizer state and step, atomically, with a checksum.
  void saveCheckpoint(const std::string &path) const;
  void loadCheckpoint(const std::string &path);
  /// Stops the other ranks of a multi-rank bundle after this one failed.
  void abortPeers(const std::string &message);
  /// Runs one program by name ("forward", "backward", "update").
  void runProgram(const std::string &name);
  /// Mixed-precision ZeRO-1 bundles keep each rank's slice of the f32
  /// masters up to date, not the whole (loom-zero-gather-copies): this runs
  /// their `gather_parameters` program if a step ran since the last time, a
  /// collective every rank of the data-parallel group must join. Saving
  /// checkpoints and weights call it (so with such bundles every rank saves,
  /// as loom-run does, gathering on every rank at once first); reading or
  /// writing a parameter buffer before it is refused.
  void gatherParameters() const;
  float loss() const;

  void loadWeights(const std::string &path);
  void saveWeights(const std::string &path) const;

  /// Copies of buffers, whichever memory they live in.
  std::vector<char> read(const Buffer &b) const;
  void write(const Buffer &b, const void *src);
  /// The column of the largest value of each of `b`'s first `rows` rows of
  /// `cols` (f32 or bf16; the first on ties), computed where `b` lives.
  /// bindInput for an input only the next runProgram reads: the copy may
  /// still be under way when it returns (`src` may be reused).
  void bindInputBeforeRun(const std::string &name, const void *src, size_t bytes);
  void argmaxRows(const Buffer &b, int64_t rows, int64_t cols, int32_t *out) {
    backend->argmaxRows(b, rows, cols, out);
  }
  /// Times every instruction by op from now on (loom-run --profile).
  void setProfiling(bool on) { backend->setProfiling(on); }
  /// Records every instruction's interval from now on (loom-run --trace).
  void setTracing(bool on) { backend->setTracing(on); }
  std::vector<Backend::TraceEvent> takeTrace() { return backend->takeTrace(); }
  bool replaysGraphs() const { return backend->replaysGraphs(); }
  const std::map<std::string, Backend::OpTime> &profile() const { return backend->profile(); }

  /// Host address of a buffer on the CPU backend (tests poke parameters).
  char *data(const Buffer &b) const;

private:
  std::string dir;
  std::string backendKind;
  Manifest bundle;
  size_t rankIndex = 0;
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<NcclWorld> nccl;
  std::unique_ptr<Backend> backend;
  /// Weights were written (initialised, loaded, poked): the bundle's
  /// `prepare` program runs before the next step or forward.
  mutable bool prepareDue = false;
  /// A step updated the master slices since gather_parameters last ran.
  mutable bool mastersStale = false;
  void prepareIfDue();
};

} // namespace loom::rt

#endif
