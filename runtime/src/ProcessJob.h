//===- ProcessJob.h - One rank per process, from the launcher --*- C++ -*-===//
//
// `mpirun -np N` or Slurm (`srun -n N`, with MASTER_ADDR and MASTER_PORT)
// starts one process per rank; joinProcessJob makes a session's options this
// process's rank, connected to the others over MPI or, without MPI, over TCP
// (TcpCommunicator.h), and with the cuda backend over NCCL, whose unique ids
// the communicator hands out.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_PROCESSJOB_H
#define LOOM_RUNTIME_PROCESSJOB_H

#include "runtime/src/Session.h"

#include <string>

namespace loom::rt {

/// True when a launcher started this process as one rank of several: an MPI
/// launcher (with Loom built with MPI), or Slurm's variables with a
/// rendezvous. Throws Error when Slurm's variables are malformed.
bool launchedAsProcesses();

/// Makes `options` this process's rank of the bundle at `bundleDir`
/// (`manifest`: one rank per process), connected to the others, and with the
/// cuda backend over NCCL between the processes' GPUs (GPU = the local rank,
/// or 0 where CUDA_VISIBLE_DEVICES leaves one). The communicator is made once
/// per process (MPI finalises at exit); the first call's
/// `options.timeoutSeconds` holds for the process. Returns the rank; throws
/// when the process count is not the rank count.
int joinProcessJob(const Manifest &manifest, const std::string &bundleDir, SessionOptions &options);

} // namespace loom::rt

#endif
