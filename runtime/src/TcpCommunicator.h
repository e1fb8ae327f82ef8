//===- TcpCommunicator.h - Collectives between processes over TCP -*- C++ -*-===//
//
// Ranks started by Slurm (`srun -n N loom-run OUT.loom`) or any launcher that
// sets the same variables, without MPI: each process reads its rank from
// SLURM_PROCID, the rank count from SLURM_NTASKS and its GPU from
// SLURM_LOCALID, and meets the others at MASTER_ADDR:MASTER_PORT, where rank
// 0 listens and hands out every rank's address; then every pair of ranks
// holds one TCP connection. Collectives go through the group's first member,
// which adds the contributions in group order (the sums of the in-process
// communicator, bit for bit) and checks that every member is in the same
// collective with the same count. A peer whose connection closes (it exited
// or was killed) fails the ranks waiting for it at once, naming it; every
// wait is bounded by the timeout.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_TCPCOMMUNICATOR_H
#define LOOM_RUNTIME_TCPCOMMUNICATOR_H

#include "runtime/src/Communicator.h"

#include <memory>
#include <optional>
#include <string>

namespace loom::rt {

/// One task of a multi-process job, from the launcher's environment.
struct LaunchedTask {
  int rank = 0;      // SLURM_PROCID
  int size = 1;      // SLURM_NTASKS
  int localRank = 0; // SLURM_LOCALID: the GPU on its node
  std::string address; // MASTER_ADDR: where rank 0 listens
  int port = 0;        // MASTER_PORT
};

/// The task this process is, when SLURM_PROCID and SLURM_NTASKS (above 1)
/// are set and MASTER_ADDR and MASTER_PORT name the rendezvous; nullopt
/// when they are not set (a single process). Throws Error when they are
/// set but malformed, or when the rendezvous is missing inside a Slurm step.
std::optional<LaunchedTask> launchedTaskFromEnvironment();

/// Meets the other tasks (every wait bounded by `timeoutSeconds`) and
/// returns the communicator that connects them. Throws Error.
std::shared_ptr<Communicator> makeTcpCommunicator(const LaunchedTask &task, double timeoutSeconds);

} // namespace loom::rt

#endif
