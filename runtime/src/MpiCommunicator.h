//===- MpiCommunicator.h - Collectives between processes over MPI -*- C++ -*-===//
//
// `mpirun -np N loom-run OUT.loom` runs one rank of an N-rank bundle per
// process; this communicator connects them. Built when CMake finds MPI.
// Every wait polls with a timeout, so a stalled peer fails the rank with a
// message instead of hanging, and while it waits it checks that the peers on
// its host still run, so a killed one is named within a fraction of a second.
// Before each collective the members compare what they are about to do, so
// ranks whose programs disagree fail with the difference, not inside MPI.
// abort (a failed rank) ends the whole job through MPI_Abort after printing why.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_MPICOMMUNICATOR_H
#define LOOM_RUNTIME_MPICOMMUNICATOR_H

#include "runtime/src/Communicator.h"

#include <memory>

namespace loom::rt {

/// True when this process was started by an MPI launcher with more than one
/// process (and Loom was built with MPI).
bool launchedByMpi();

/// Initialises MPI (once) and returns the communicator of this job; throws
/// Error when Loom was built without MPI. `rank` receives this process's rank.
std::shared_ptr<Communicator> makeMpiCommunicator(int &rank, int &size,
                                                  double timeoutSeconds = kDefaultTimeoutSeconds);

/// Finalises MPI if it was initialised (call before exit).
void finalizeMpi();

/// The ranks of this MPI job that ran on this host and are no longer
/// running ("rank 1 (pid 4242 on node7) is no longer running (killed or
/// crashed)"), or "" if none is known to be gone. Safe from any thread, and
/// from a signal-waiting thread: it makes no MPI call.
std::string describeLostMpiRanks();

} // namespace loom::rt

#endif
