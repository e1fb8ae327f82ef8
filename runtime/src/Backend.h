//===- Backend.h - Where a rank's programs run ------------------*- C++ -*-===//
//
// A backend owns a rank's arena (host memory for the CPU, device memory for
// CUDA), prepares its programs (validating every instruction first) and runs
// them; the session moves data in and out only through upload/download.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_BACKEND_H
#define LOOM_RUNTIME_BACKEND_H

#include "loom/rt/Bundle.h"

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace loom::rt {

class Backend {
public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual void upload(const Buffer &b, const void *src) = 0;         // b.bytes bytes
  virtual void download(const Buffer &b, void *dst) const = 0;       // b.bytes bytes
  /// upload, for an input the next run of this backend's programs reads
  /// (and nothing else before it): `src` may be reused when it returns, but
  /// the copy may finish later, ordered before that run (CUDA: no wait).
  virtual void uploadBeforeRun(const Buffer &b, const void *src) { upload(b, src); }
  virtual void prepare(const std::string &program, const std::vector<Instruction> &instrs) = 0;
  virtual bool has(const std::string &program) const = 0;
  virtual void run(const std::string &program) = 0;
  /// Host address of a buffer, or null when the arena is not host memory.
  virtual char *hostData(const Buffer &) { return nullptr; }
  /// The CUDA device whose memory holds the arena; -1 for host memory.
  virtual int cudaDevice() const { return -1; }
  /// Bytes in use on that device, by every allocation on it (the arena,
  /// workspaces, cuBLAS, cuDNN, NCCL and the CUDA context: cudaMemGetInfo);
  /// -1 for host memory.
  virtual int64_t deviceBytesInUse() const { return -1; }
  /// Address of a buffer in the arena, host or device memory (the C API's
  /// views of outputs).
  virtual char *arenaData(const Buffer &b) { return hostData(b); }
  /// Copies b.bytes bytes from memory of CUDA device `device` into `b`,
  /// after the work queued on that device's legacy default stream, and
  /// returns when the copy is done.
  virtual void uploadFromDevice(const Buffer &b, const void *src, int device);
  /// The column of the largest value in each of the first `rows` rows of
  /// `b` (f32 or bf16, rows of `cols`): the first on ties, NaN never. Greedy
  /// decoding reads these instead of whole rows of logits.
  virtual void argmaxRows(const Buffer &b, int64_t rows, int64_t cols, int32_t *out);
  /// How many of this rank's device allocations (arena, workspaces) are
  /// symmetric NCCL windows of its tensor-parallel or ZeRO group.
  virtual int ncclWindows() const { return 0; }
  /// Whether programs replay as CUDA graphs once warm (those without
  /// collectives or transfers), so launches cost the host nothing.
  virtual bool replaysGraphs() const { return false; }

  /// Per-op timing of every instruction run while enabled (seconds, count).
  struct OpTime {
    double seconds = 0;
    int64_t count = 0;
    double flops = 0; // dense work of the timed matmuls
  };
  void setProfiling(bool on) { profiling = on; }
  const std::map<std::string, OpTime> &profile() const { return times; }

  /// One interval of the timeline (loom-run --trace): an instruction on one
  /// of the rank's tracks ("compute", "communication"), in seconds of
  /// traceClock(), which every rank of the process shares.
  struct TraceEvent {
    std::string name, track, where;
    double start = 0, seconds = 0;
  };
  /// The op of a step's label ("instruction backward[12] 'all_reduce'"
  /// -> "all_reduce"); the label itself where it names none.
  static std::string opOfLabel(const std::string &label) {
    size_t close = label.rfind('\'');
    size_t open = close == std::string::npos || close == 0 ? std::string::npos : label.rfind('\'', close - 1);
    return open == std::string::npos ? label : label.substr(open + 1, close - open - 1);
  }
  static double traceClock() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  /// Records every instruction run while on (CUDA: in eager launches).
  void setTracing(bool on) { tracing = on; }
  std::vector<TraceEvent> takeTrace() {
    std::lock_guard<std::mutex> lock(traceMutex);
    return std::move(traceEvents);
  }

protected:
  /// Thread-safe: the communication thread records its own events.
  void addTrace(TraceEvent e) {
    std::lock_guard<std::mutex> lock(traceMutex);
    traceEvents.push_back(std::move(e));
  }
  bool profiling = false, tracing = false;
  std::map<std::string, OpTime> times;
  std::mutex traceMutex;
  std::vector<TraceEvent> traceEvents;
};

/// Dense FLOPs of a matrix instruction (matmul, attention and its gradient),
/// 0 for the rest: the profile's achieved rates count these.
double denseInstructionFlops(const RankProgram &rank, const Instruction &ins);

class Communicator;
/// `comm` connects the rank to the others of a multi-rank bundle (may be null).
std::unique_ptr<Backend> makeCpuBackend(const RankProgram &rank, int threads,
                                        Communicator *comm = nullptr);
/// NCCL communicators for every group and pipeline transfer of a bundle
/// whose ranks all run in this process, rank r on GPU devices[r].
class NcclWorld;
class Communicator;
/// Throws Error with the reason (built without CUDA or NCCL, too few GPUs).
/// Under mpirun (or Slurm), `self` is this process's rank (only its
/// communicators are made, devices[self] its GPU) and `bootstrap` spreads
/// NCCL's unique ids. A rank waits `timeoutSeconds` at most for its
/// collectives before it aborts every communicator.
std::shared_ptr<NcclWorld> makeNcclWorld(const Manifest &manifest, const std::vector<int> &devices,
                                         int self = -1, Communicator *bootstrap = nullptr,
                                         double timeoutSeconds = 300);
/// "ranks 0-1" for each two-rank group whose gradient buckets go over peer
/// memory (CudaPeerCollectives.cu), "(ZeRO's slices too)" after it where
/// its ZeRO collectives do as well, joined by ", "; "" where none do.
std::string describePeerLinks(const NcclWorld &world);
/// A two-rank bucket's large bf16 gradient whose f32 mean (or sum) is never
/// written (the CUDA runtime's deferred sums, LOOM_CUDA_PEER_DEFER): the
/// bucket only moves bytes, with the copy engines. Each rank copies its own
/// bf16 gradient into the first half of the f32 output's memory and pushes
/// it into the peer's deferred region (at `at`); the update's global norm
/// and AdamW, the output's only readers, combine the two in f32 as they
/// read them: the same bits as the peer all-reduce's outputs, without its
/// sums beside the backward's products, the reduced halves' return and
/// their copy into place (runtime/src/cuda/CudaPeerCollectives.cu).
struct DeferredPart {
  int64_t in = 0, out = 0, n = 0; // the bf16 gradient, its f32 output (buffer ids), elements
  size_t at = 0;                  // bytes into the link's deferred region
  int op = 0;                     // 0 sum, 1 mean of the two
};
/// Rank program `r`'s deferred parts, in program order with their places:
/// the wide parts (bf16 gradients of at least LOOM_CUDA_PEER_BELOW bytes,
/// and not packed as small) of its asynchronous two-rank "dp" all-reduces
/// (sum or mean, f32 wire) whose outputs nothing reads but global norms
/// without a group and AdamW's gradient operand, and nothing else writes,
/// views or names (inputs, outputs, parameters, state). Empty where the
/// runtime has no CUDA, under LOOM_CUDA_PEER_DEFER=0, LOOM_CUDA_PEER_WIDE=0,
/// LOOM_CUDA_PEER_COLLECTIVES=0 or LOOM_CUDA_COLLECTIVES=skip.
std::vector<DeferredPart> deferredParts(const RankProgram &r);
/// The deferred region's size for `parts` (each 256-byte aligned).
size_t deferredBytes(const std::vector<DeferredPart> &parts);
/// Aborts every communicator (a rank failed): ranks blocked in NCCL return,
/// and fail naming `reason` (the first one given).
void abortNcclWorld(NcclWorld &world, const std::string &reason = "");

/// Throws Error with the reason (no GPU, no driver, built without CUDA).
/// `world` connects the ranks of a multi-rank bundle (may be null).
/// `kernelsPtx` holds the bundle's generated kernels (its kernels.ptx).
std::unique_ptr<Backend> makeCudaBackend(const RankProgram &rank, int device,
                                         NcclWorld *world = nullptr,
                                         const std::string &kernelsPtx = "");

} // namespace loom::rt

#endif
