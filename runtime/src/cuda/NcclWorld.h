//===- NcclWorld.h - The NCCL communicators of a multi-rank bundle -*- C++ -*-===//
//
// Made once per process (makeNcclWorld in runtime/src/Backend.h) before the
// ranks' backends are; each rank's CUDA backend takes its communicators from
// it. Defined in NcclWorld.cu.
//
//===----------------------------------------------------------------------===//

#ifndef LOOM_RUNTIME_CUDA_NCCLWORLD_H
#define LOOM_RUNTIME_CUDA_NCCLWORLD_H

#include "runtime/src/Backend.h"

#ifdef LOOM_HAVE_NCCL
#include <nccl.h>
#endif

#include <atomic>
#include <cstddef>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace loom::rt {

#ifdef LOOM_HAVE_NCCL
/// Fails with NCCL's message (and its last error) where `r` is an error.
void checkNccl(ncclResult_t r, const char *what, const char *file, int line);
#define LOOM_NCCL_CHECK(expr) ::loom::rt::checkNccl((expr), #expr, __FILE__, __LINE__)
#endif

/// Whether `ins` is one of ZeRO's collectives: a reduce-scatter or all-gather
/// of whole tensors' slices (not one along an axis). Their group's buffers
/// become NCCL windows and its communicator gets more channels.
inline bool isZeroCollective(const Instruction &ins) {
  return (ins.op == "reduce_scatter" || ins.op == "all_gather") && !ins.attrs.contains("axis");
}
/// The group an instruction's collective runs over ("dp" unless it names one).
inline std::string collectiveGroup(const Instruction &ins) {
  return ins.attrs.is_object() ? ins.attrs.value("group", std::string("dp")) : std::string("dp");
}

/// One rank's end of a two-rank data-parallel group whose GPUs reach each
/// other's memory and whose ranks run in this process
/// (CudaPeerCollectives.cu): the group's asynchronous all-reduces (its
/// gradient buckets) and ZeRO's reduce-scatters and all-gathers go over
/// it, the copy engines moving the bytes, so that no kernel holds SMs
/// while they cross the link.
struct PeerLink {
  int index = 0;               // this rank's place in the group: which half of each piece it reduces
  unsigned *counter = nullptr; // this rank's barriers so far (its GPU)
  unsigned *flag = nullptr;    // the peer's barriers so far, written by the peer (this rank's GPU)
  char *scratch = nullptr;     // this rank's GPU: the peer's halves pushed here, then its reduced ones
  size_t scratchBytes = 0;
  /// ZeRO's exchanges (peerExchange): this rank's releases of its scratch
  /// so far, and the peer's (written by the peer). Where `exchanges` is
  /// set, the all-reduces over the link wait for and make releases too.
  unsigned *released = nullptr;
  unsigned *peerReleased = nullptr;
  bool exchanges = false;
  /// Where the peer pushes its bf16 gradients whose mean the update makes
  /// itself (DeferredPart, LOOM_CUDA_PEER_DEFER): this rank's GPU, after
  /// the scratch; 0 bytes where no bucket defers.
  char *deferred = nullptr;
  size_t deferredBytes = 0;
  PeerLink *peer = nullptr; // the other rank's end
  /// The allocation behind counter, flag and scratch: made with CUDA's
  /// virtual memory calls and mapped for this rank's GPU and its peer's
  /// only (peer access for the whole device would make every allocation
  /// and module load wait on the peer).
  unsigned long long handle = 0;
  size_t bytes = 0;
  char *base = nullptr;
};

/// Communicators of every group (one per member list) and one per direction
/// of every pipeline transfer, so that a rank's sends (on their own stream)
/// never queue behind its receives.
class NcclWorld {
public:
#ifdef LOOM_HAVE_NCCL
  std::map<std::vector<int>, std::map<int, ncclComm_t>> groups; // members -> rank -> comm
  std::map<std::pair<int, int>, std::map<int, ncclComm_t>> links; // (from, to) -> rank -> comm
#endif
  std::vector<int> devices;
  /// Two-rank groups whose asynchronous all-reduces, and ZeRO collectives,
  /// go over peer memory: members -> rank -> its end (none under
  /// LOOM_CUDA_PEER_COLLECTIVES=0).
  std::map<std::vector<int>, std::map<int, PeerLink>> peerLinks;
  /// Host memory the GPUs read (mapped): set when the world is aborted, so
  /// that a peer barrier waiting for a rank that failed returns.
  volatile int *peerAbort = nullptr;
  std::atomic<bool> aborted{false};
  /// Why the world was aborted (guarded by mutex): the other ranks' errors
  /// name it, whichever rank's error is printed first.
  std::string reason;
  std::string abortReason() {
    std::lock_guard<std::mutex> lock(mutex);
    return reason.empty() ? std::string("another rank failed") : reason;
  }
  /// How long a rank waits for its collectives to finish (loom-run --timeout).
  double timeoutSeconds = 300;
  /// The processes' communicator (null: every rank in this process), asked
  /// while waiting whether a peer process is gone.
  Communicator *bootstrap = nullptr;
  /// Held while communicators are aborted or asked for their errors, since
  /// any rank's thread may abort them all.
  std::mutex mutex;

#ifdef LOOM_HAVE_NCCL
  /// Unique ids for every communicator, then every communicator this process
  /// holds, created together (one NCCL group, so no order among them can
  /// deadlock). One process: all ranks; under mpirun: `self` only, with ids
  /// broadcast from each group's first member over `bootstrap`.
  /// Fails after `timeoutSeconds` (or when `bootstrap` reports a lost peer)
  /// if a member never joins. `ctas[i]` = {min, max} with max > 0 sets list
  /// i's channels (NCCL's config.minCTAs and maxCTAs), and with them its
  /// buffers; {0, 0} leaves NCCL's choice.
  void createAll(const std::vector<std::vector<int>> &lists, int self, Communicator *bootstrap,
                 std::vector<std::map<int, ncclComm_t> *> targets, const std::vector<std::pair<int, int>> &ctas);
#endif
  ~NcclWorld();
};

/// Peer links for the two-rank "dp" groups of `manifest` with asynchronous
/// all-reduces or ZeRO collectives, where both ranks run in this process
/// (`self` < 0) on GPUs that reach each other. Made after the communicators; freed by the
/// world's destructor (freePeerLinks).
void makePeerLinks(NcclWorld &world, const Manifest &manifest, int self);
void freePeerLinks(NcclWorld &world);

} // namespace loom::rt

#endif
