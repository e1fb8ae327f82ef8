//===- Session.h - A loaded bundle, ready to run ----------------*- C++ -*-===//
#ifndef LOOM_RUNTIME_SESSION_H
#define LOOM_RUNTIME_SESSION_H

#include "runtime/src/Bundle.h"
#include "runtime/src/ThreadPool.h"
#include "runtime/src/cpu/CpuBackend.h"

#include <cstdlib>
#include <memory>
#include <string>

namespace loom::rt {

struct SessionOptions {
  std::string backend = "cpu";
  int threads = 0;
};

class Session {
public:
  /// Reads and validates the bundle, allocates the arena, loads the weights
  /// and prepares every program. Throws Error on any problem.
  Session(const std::string &bundleDir, const SessionOptions &options);

  const Manifest &manifest() const { return bundle; }
  const RankProgram &rank() const { return bundle.ranks.front(); }

  const Buffer &input(const std::string &name) const;
  const Buffer &output(const std::string &name) const;
  void bindInput(const std::string &name, const void *data, size_t bytes);
  void readOutput(const std::string &name, void *data, size_t bytes) const;
  void runForward();
  /// Forward, backward and update of a training bundle; returns the loss.
  float trainStep();
  bool canTrain() const { return backward != nullptr; }
  /// Optimizer steps taken (the "step" state of a training bundle).
  int64_t step() const;
  /// Parameters, optimizer state and step, atomically, with a checksum.
  void saveCheckpoint(const std::string &path) const;
  void loadCheckpoint(const std::string &path);
  /// Runs one program by name ("forward", "backward", "update").
  void runProgram(const std::string &name);
  float loss() const;

  void loadWeights(const std::string &path);
  void saveWeights(const std::string &path) const;

  char *data(const Buffer &b) const { return arena.get() + b.offset; }

private:
  std::string dir;
  Manifest bundle;
  std::unique_ptr<char, decltype(&std::free)> arena{nullptr, &std::free};
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<CpuProgram> forward, backward, update;
};

} // namespace loom::rt

#endif
