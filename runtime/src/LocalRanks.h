//===- LocalRanks.h - Every rank of a bundle in this process ----*- C++ -*-===//
#ifndef LOOM_RUNTIME_LOCALRANKS_H
#define LOOM_RUNTIME_LOCALRANKS_H

#include "runtime/src/Session.h"

#include <memory>
#include <vector>

namespace loom::rt {

/// Opens every rank of the bundle at `bundleDir` in this process, side by
/// side: CPU ranks connected by an in-process communicator (threads split
/// between them unless `options.threads` says), GPU ranks k on device k over
/// NCCL. A failing rank's error names it. Throws Error.
std::vector<std::unique_ptr<Session>> openLocalRanks(const std::string &bundleDir, SessionOptions options);

} // namespace loom::rt

#endif
