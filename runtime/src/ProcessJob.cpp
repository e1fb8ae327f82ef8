//===- ProcessJob.cpp - One rank per process, from the launcher -----------===//

#include "runtime/src/ProcessJob.h"
#include "loom/rt/Error.h"
#include "runtime/src/MpiCommunicator.h"
#include "runtime/src/TcpCommunicator.h"

#include <cstdlib>
#include <cstring>

namespace loom::rt {

bool launchedAsProcesses() { return launchedByMpi() || launchedTaskFromEnvironment().has_value(); }

int joinProcessJob(const Manifest &manifest, const std::string &bundleDir, SessionOptions &options) {
  static std::shared_ptr<Communicator> comm;
  static int rank = 0, size = 1, local = 0;
  static bool mpi = false;
  if (!comm) {
    if (launchedByMpi()) {
      comm = makeMpiCommunicator(rank, size, options.timeoutSeconds);
      std::atexit(finalizeMpi);
      mpi = true;
      const char *l = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
      if (!l)
        l = std::getenv("MPI_LOCALRANKID");
      local = l ? std::atoi(l) : rank;
    } else if (std::optional<LaunchedTask> task = launchedTaskFromEnvironment()) {
      comm = makeTcpCommunicator(*task, options.timeoutSeconds);
      rank = task->rank, size = task->size, local = task->localRank;
    } else {
      fail(LOOM_INTERNAL, "this process was not started as one rank of several (mpirun, or Slurm "
           "with MASTER_ADDR and MASTER_PORT)");
    }
  }
  int64_t ranks = static_cast<int64_t>(manifest.ranks.size());
  if (size != ranks) {
    if (mpi)
      fail(LOOM_INVALID_ARGUMENT, bundleDir, " has ", ranks, " ranks but mpirun started ", size,
           " processes; run mpirun -np ", ranks, " (one rank per process)");
    fail(LOOM_INVALID_ARGUMENT, bundleDir, " has ", ranks, " ranks but the job has ", size,
         " tasks (SLURM_NTASKS); run srun -n ", ranks, " (one rank per task)");
  }
  options.rank = rank;
  options.comm = comm;
  if (options.backend == "cuda") {
    // A launcher that gives each task its own GPU leaves it one device.
    const char *visible = std::getenv("CUDA_VISIBLE_DEVICES");
    bool one = visible && *visible && !std::strchr(visible, ',');
    options.device = one ? 0 : local;
    std::vector<int> devices(static_cast<size_t>(ranks), -1);
    devices[rank] = options.device;
    options.nccl = makeNcclWorld(manifest, devices, rank, comm.get(), options.timeoutSeconds);
  }
  return rank;
}

} // namespace loom::rt
