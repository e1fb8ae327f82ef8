//===- CudaBackendImpl.h - The CUDA backend's class, by concern -*- C++ -*-===//
//
// Private to runtime/src/cuda/. The backend is one class whose member
// functions live in files by concern: the device, programs and their
// launches (CudaBackend.cu), CUDA graphs (CudaGraphs.cu), matrix products
// (CudaGemm.cu), attention (CudaAttention.cu), elementwise kernels
// (CudaElementwise.cu), copies, gathers and embedding lookups
// (CudaLayout.cu), norms and reductions (CudaNorms.cu), the loss
// (CudaLoss.cu), the optimizers (CudaOptimizer.cu), convolutional networks
// (CudaConv.cu, with cuDNN's convolutions in CudnnConv.cpp), the compiler's generated kernels (CudaGenerated.cu) and
// NCCL (CudaCollectives.cu; communicators and windows in NcclWorld.cu). Each file adds the instructions it builds to
// one table, which build() looks them up in.
//
//===----------------------------------------------------------------------===//

#ifndef LOOM_RUNTIME_CUDA_CUDABACKENDIMPL_H
#define LOOM_RUNTIME_CUDA_CUDABACKENDIMPL_H

#include "runtime/src/Backend.h"
#include "loom/rt/Error.h"
#include "runtime/src/cuda/CudaKernelsCommon.cuh"
#include "runtime/src/cuda/CudnnAttention.h"
#include "runtime/src/cuda/FlashAttention.h"
#include "runtime/src/cuda/NcclWorld.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace loom::rt::cuda {

/// One tensor of a ZeRO-1 bucket (CudaCollectives.cu): n elements, k =
/// ceil(n / parts) a part, its parts at `offset` of each rank's span of the
/// packed buffer.
struct PackedTensor {
  float *whole; // the gradient (reduce-scatter) or the parameter (all-gather, shard_of), n elements;
                // a bf16 copy's address for mixed-precision ZeRO-1's gathers
  float *shard; // this rank's part, k elements
  int64_t n, k, offset;
  int32_t bf16Whole = 0; // a bucket's all-reduce: `whole` holds bf16, widened as it is packed
};

/// Every CUDA and cuBLAS call is checked and becomes an Error naming the call.
void checkCuda(cudaError_t e, const char *what, const char *file, int line);
void checkCublas(cublasStatus_t s, const char *what, const char *file, int line);
#define LOOM_CUDA_CHECK(expr) ::loom::rt::cuda::checkCuda((expr), #expr, __FILE__, __LINE__)
#define LOOM_CUBLAS_CHECK(expr) ::loom::rt::cuda::checkCublas((expr), #expr, __FILE__, __LINE__)

inline int blocksFor(int64_t n) { return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 8)); }

/// One tensor of a two-rank all-reduce over peer memory: n elements at
/// data, reduced in place, or where `out` is set, a bf16 tensor whose f32
/// sum (or mean) goes to `out` (its bf16 halves cross the link, the
/// reduced f32 halves come back).
struct PeerPart {
  char *data;
  int64_t n;
  bool bf16;
  char *out = nullptr;
};
/// Reduces `parts` in place with the peer's (op 0 sum, 1 mean, 2 max) on
/// stream `s` through `link`, the copy engines moving the bytes
/// (CudaPeerCollectives.cu).
void peerAllReduce(const PeerLink &link, const volatile int *abort, const std::vector<PeerPart> &parts, int op,
                   cudaStream_t s);
/// ZeRO's two-rank exchange: waits until the peer has read what the last
/// collective over `link` left in its scratch (peerReleased), pushes each
/// piece (`bytes` at `from`, to `at` in the peer's scratch) with the copy
/// engines, and waits for the peer's: then link.scratch holds the peer's
/// pieces. The caller reads them on `s`, then calls peerReleased.
struct PeerPiece {
  size_t at;
  const void *from;
  size_t bytes;
};
void peerExchange(const PeerLink &link, const volatile int *abort, const std::vector<PeerPiece> &pieces,
                  cudaStream_t s);
void peerReleased(const PeerLink &link, cudaStream_t s);
/// Whether two-rank data-parallel groups' buckets may go over peer memory
/// (unless LOOM_CUDA_PEER_COLLECTIVES=0).
bool peerCollectives();
/// Whether ZeRO's reduce-scatters and all-gathers may too (unless
/// LOOM_CUDA_PEER_ZERO=0 as well).
bool peerZero();
/// Tensors under this many bytes go through NCCL even where a link exists.
int64_t peerMinBytes();
/// A bucket's tensors under this many bytes as f32 are packed into one
/// message (LOOM_CUDA_BUCKET_PACK_BELOW; 0 with LOOM_CUDA_BUCKET_PACKED=0).
int64_t bucketPackBelow();

/// Whether buckets may defer their sums (DeferredPart in Backend.h; unless
/// LOOM_CUDA_PEER_DEFER=0).
bool peerDefer();
/// A deferred bucket's transfers on `s`: `locals` (each rank's gradients
/// into its outputs' memory), a barrier (the peer has reached the bucket:
/// its update has read what the last step pushed), the pushes into the
/// peer's deferred region, and a barrier (the peer's have landed here).
struct PeerCopy {
  void *to;
  const void *from;
  size_t bytes;
};
void peerDeferredPush(const PeerLink &link, const volatile int *abort, const std::vector<PeerCopy> &locals,
                      const std::vector<PeerCopy> &pushes, cudaStream_t s);
/// Each copy on `s` (device to device, those of 0 bytes left out).
void copyAll(const std::vector<PeerCopy> &copies, cudaStream_t s);

/// Whether environment variable `name` is set to exactly `value` (the
/// backend's measurement switches: LOOM_CUDA_GRAPHS=0 and the like).
inline bool envIs(const char *name, const char *value) {
  const char *e = std::getenv(name);
  return e && std::string(e) == value;
}

/// LOOM_DETERMINISTIC=1 (`loom-run --deterministic`): the same bundle,
/// inputs and GPU give the same results bit for bit in every process.
/// Kernels that sum with atomics take ordered paths (the embedding's
/// gradient), cuDNN's attention backward its deterministic engine, and
/// cuBLASLt's first heuristic choice replaces the fastest timed candidate.
inline bool deterministic() {
  static const bool on = envIs("LOOM_DETERMINISTIC", "1");
  return on;
}

/// Whether an instruction's `layout` says channels last (CudaConv.cu);
/// `where` names it in the error for a layout other than nchw or nhwc.
bool channelsLast(const Instruction &ins, const std::string &where);

/// Whether kernels written for it (waitPrevious() first) are launched as
/// programmatic dependents of the kernel before them: on devices of compute
/// capability 9 and up, unless LOOM_CUDA_PDL=0.
bool dependentLaunches();

/// Launches `kernel` as a programmatic dependent of the stream's previous
/// kernel where `dependent` and dependentLaunches() say so; as a plain
/// launch otherwise.
template <typename... P, typename... A>
void launchAfter(bool dependent, void (*kernel)(P...), dim3 grid, dim3 block, size_t shared, cudaStream_t s,
                 A &&...args) {
  if (!dependent || !dependentLaunches()) {
    kernel<<<grid, block, shared, s>>>(std::forward<A>(args)...);
    return;
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid, config.blockDim = block, config.dynamicSmemBytes = shared, config.stream = s;
  config.attrs = attr, config.numAttrs = 1;
  LOOM_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<A>(args)...));
}

/// Row-major strides of a shape; those of `in` broadcast to `out` (0 along
/// broadcast dims); and the index map kernels walk `shape` with.
std::vector<int64_t> stridesOf(const Shape &s);
std::vector<int64_t> broadcastTo(const Shape &in, const Shape &out);
Strided strided(const Shape &shape, const std::vector<int64_t> &a, const std::vector<int64_t> &b = {});

/// f32 products run on TF32 tensor cores (10-bit mantissas) unless
/// LOOM_CUDA_TF32=0 asks for full f32 (slower; for checking numerics).
cublasComputeType_t f32Compute();
/// Whether the compiler's generated kernels (norms, softmax, loss, AdamW)
/// run where a bundle has them; LOOM_CUDA_GENERATED=0 runs ours instead.
bool generatedKernelsOn();
/// Launches a generated kernel: its parameters are bare pointers (MLIR's
/// bare-pointer convention for memrefs), in order.
void launchGenerated(cudaKernel_t fn, unsigned grid, unsigned block, std::vector<void *> pointers, cudaStream_t s);

struct OptimizerArgs; // CudaOptimizer.cu
/// A tensor of a multi-tensor update, and a chunk of one a block updates
/// (CudaOptimizer.cu).
struct AdamTensor {
  float *p;
  DPtr g; // f32, or bf16 (mixed precision's gradients, widened exactly here)
  float *m, *v; // v: AdamW's second moment (null for SGD)
  int64_t n;
  __nv_bfloat16 *copy; // the updated p as bf16 (loom-update-copies), or null
  /// A deferred gradient (DeferredPart): g is this rank's bf16 gradient, and
  /// the gradient combinePair(g, theirs, op) in f32.
  const __nv_bfloat16 *theirs = nullptr;
  int op = 0;
  float wd = 0; // AdamW's weight decay (a run's tensors may differ)
};
struct AdamChunk {
  int64_t tensor, begin, end; // elements [begin, end) of tensors[tensor]
};

using Launch = std::function<void(cudaStream_t)>;
/// Whether instruction `op` talks to other ranks through NCCL.
bool communicates(const std::string &op);

class CudaBackendImpl : public Backend {
public:
  CudaBackendImpl(const RankProgram &rank, int device, NcclWorld *world, const std::string &ptx);
  ~CudaBackendImpl() override;

  std::string name() const override { return "cuda"; }
  bool replaysGraphs() const override { return graphsWanted(); }

  void upload(const Buffer &b, const void *src) override;
  void uploadBeforeRun(const Buffer &b, const void *src) override;
  void download(const Buffer &b, void *dst) const override;
  int cudaDevice() const override { return device; }
  int64_t deviceBytesInUse() const override;
  char *arenaData(const Buffer &b) override { return ptr(b); }
  int ncclWindows() const override {
#ifdef LOOM_HAVE_NCCL
    return int(windows.size());
#else
    return 0;
#endif
  }
  void uploadFromDevice(const Buffer &b, const void *src, int srcDevice) override;
  void argmaxRows(const Buffer &b, int64_t rows, int64_t cols, int32_t *out) override; // CudaServe.cu
  bool has(const std::string &program) const override { return programs.count(program) > 0; }

  void prepare(const std::string &program, const std::vector<Instruction> &instrs) override;
  void run(const std::string &program) override;

private:
  char *ptr(const Buffer &b) { return arena + b.offset; }
  static char *ptr(DPtr p) { return static_cast<char *>(p.p); }
#ifdef LOOM_HAVE_NCCL
  ncclDataType_t ncclType(int64_t id) { return fp(id).bf ? ncclBfloat16 : ncclFloat32; }
#endif
  /// An f32 tensor (optimizer state, losses, workspaces of reductions).
  float *f(int64_t id) {
    if (buf(id).dtype != LOOM_F32)
      fail(LOOM_UNSUPPORTED, where, ": buffer '", buf(id).name, "' is ", dtypeName(buf(id).dtype),
           "; the CUDA backend runs this operation on f32 only");
    return reinterpret_cast<float *>(arena + rank.buffers[id].offset);
  }
  /// A floating-point tensor of either dtype the kernels read and write.
  DPtr fp(int64_t id) {
    const Buffer &b = buf(id);
    if (b.dtype != LOOM_F32 && b.dtype != LOOM_BF16)
      fail(LOOM_UNSUPPORTED, where, ": buffer '", b.name, "' is ", dtypeName(b.dtype),
           "; the CUDA backend computes on f32 and bf16 tensors only");
    return {arena + b.offset, b.dtype == LOOM_BF16};
  }
  static bool isBf16(const Buffer &b) { return b.dtype == LOOM_BF16; }
  /// Whether the 16-byte vector kernels apply to these tensors: one float
  /// dtype, 16-byte aligned, every count a multiple of the pack and n < 2^31.
  bool vectorizable(std::initializer_list<int64_t> ids, std::initializer_list<int64_t> counts) {
    loom_dtype_t dt = buf(*ids.begin()).dtype;
    if (dt != LOOM_F32 && dt != LOOM_BF16)
      return false;
    int64_t pack = 16 / dtypeSize(dt);
    for (int64_t id : ids)
      if (buf(id).dtype != dt || reinterpret_cast<uintptr_t>(ptr(buf(id))) % 16 != 0)
        return false;
    for (int64_t c : counts)
      if (c % pack != 0 || c <= 0 || c >= (int64_t(1) << 31))
        return false;
    return true;
  }
  /// Whether a norm's rows take the bf16 register kernels: bf16 tensors
  /// (the gamma and beta of either dtype), h a multiple of 256 up to 2048,
  /// every operand 16-byte aligned.
  bool bf16Rows(const Instruction &ins, int64_t h);
  static unsigned vecBlocks(int64_t n, int pack) {
    return unsigned(std::min<int64_t>((n / pack + kThreads - 1) / kThreads, 65535 * 8));
  }
  const Buffer &buf(int64_t id) const { return rank.buffers[id]; }
  /// Whether instrs[from..] read buffer `id`'s storage (it or a view).
  bool readAfter(const std::vector<Instruction> &instrs, size_t from, int64_t id);
  /// Whether two buffers share bytes of the arena.
  bool overlaps(int64_t a, int64_t b) const {
    const Buffer &p = buf(a), &q = buf(b);
    return p.offset < q.offset + q.bytes && q.offset < p.offset + p.bytes;
  }
  static int64_t count(const Shape &s) { return numElements(s).value_or(0); }

  /// Workspace bytes the program needs at most (one shared workspace).
  size_t reserve(size_t bytes) {
    workspaceBytes = std::max(workspaceBytes, (bytes + 255) / 256 * 256);
    return 0;
  }
  /// The same in the communication stream's workspace for an async
  /// collective (it runs beside compute that may use the shared one).
  void reserveFor(bool async, size_t bytes) {
    if (async)
      commWorkspaceBytes = std::max(commWorkspaceBytes, (bytes + 255) / 256 * 256);
    else
      reserve(bytes);
  }
  template <typename T> T *deviceArray(const std::vector<T> &host) {
    void *p = nullptr;
    LOOM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(host.size(), 1) * sizeof(T)));
    LOOM_CUDA_CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    allocations.push_back(p);
    return static_cast<T *>(p);
  }

  static bool flag(const Instruction &ins, const char *name) {
    auto it = ins.attrs.find(name);
    return it != ins.attrs.end() && it->is_boolean() && it->get<bool>();
  }
  static double num(const Instruction &ins, const char *name, double dflt) {
    auto it = ins.attrs.find(name);
    return it != ins.attrs.end() && it->is_number() ? it->get<double>() : dflt;
  }
  static int64_t axisOf(const Instruction &ins, const char *name, size_t rank, int64_t dflt) {
    auto it = ins.attrs.find(name);
    int64_t a = it != ins.attrs.end() && it->is_number_integer() ? it->get<int64_t>() : dflt;
    return a < 0 ? a + static_cast<int64_t>(rank) : a;
  }

  //===--- Matrix products (CudaGemm.cu) ----------------------------------===//
  /// Element types of a GEMM: f32 operands run on TF32 tensor cores, bf16
  /// operands on bf16 tensor cores; both accumulate in f32.
  struct GemmTypes {
    cudaDataType ab = CUDA_R_32F, c = CUDA_R_32F;
    cublasComputeType_t compute = f32Compute();
    int64_t abSize = 4, cSize = 4;
  };
  GemmTypes gemmTypes(const Buffer &a, const Buffer &b, const Buffer &c);
  /// A planned row-major C[M,N] = op(A) op(B): cuBLASLt descriptors and the
  /// fastest of cuBLASLt's candidate algorithms, timed once per shape on
  /// this GPU when the program is prepared (C = B^T A^T in column-major).
  struct GemmPlan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  std::map<std::string, std::shared_ptr<GemmPlan>> gemmPlans;
  /// A cuBLASLt epilogue: its kind, the bias vector (read, or written by a
  /// bias gradient) and the auxiliary matrix (GELU's pre-activation, ld
  /// elements apart).
  struct GemmEpilogue {
    cublasLtEpilogue_t kind = CUBLASLT_EPILOGUE_DEFAULT;
    const void *bias = nullptr, *aux = nullptr;
    int64_t auxLd = 0;
    const void *residual = nullptr; // C, added with beta = 1 (the result is D)
  };
  /// Null when `epilogue` is given and cuBLASLt has no algorithm for it
  /// (the caller runs the product and its epilogue apart).
  std::shared_ptr<GemmPlan> planGemm(const GemmTypes &t, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                                     const void *a, int64_t lda, const void *b, int64_t ldb, void *c, int64_t ldc,
                                     int64_t offsetAlign = 256, const GemmEpilogue *epilogue = nullptr);
  void gemm(const GemmPlan &p, const void *a, const void *b, void *c, cudaStream_t s,
            const GemmEpilogue *epilogue = nullptr);
  void gemmBatched(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float **a,
                   int64_t lda, const float **b, int64_t ldb, float beta, float **c, int64_t ldc, int64_t count);

  //===--- Instruction builders -------------------------------------------===//
  // build() looks an instruction up in builders(), the one table that each
  // file of the backend adds the instructions it builds to.
  using Builder = std::function<Launch(CudaBackendImpl &, const Instruction &)>;
  using BuilderTable = std::map<std::string, Builder>;
  static const BuilderTable &builders();
  static void addElementwiseBuilders(BuilderTable &table);
  static void addLayoutBuilders(BuilderTable &table);
  static void addNormBuilders(BuilderTable &table);
  static void addGemmBuilders(BuilderTable &table);
  static void addAttentionBuilders(BuilderTable &table);
  static void addLossBuilders(BuilderTable &table);
  static void addOptimizerBuilders(BuilderTable &table);
  static void addConvBuilders(BuilderTable &table);
  static void addGeneratedBuilders(BuilderTable &table);
  static void addCollectiveBuilders(BuilderTable &table);
  static void addServeBuilders(BuilderTable &table);
  Launch build(const Instruction &ins);
  // CudaElementwise.cu
  Launch buildFill(const Instruction &ins);
  Launch buildBinary(const Instruction &ins);
  Launch buildUnary(const Instruction &ins);
  Launch buildUnaryGrad(const Instruction &ins);
  Launch buildCast(const Instruction &ins);
  Launch buildRotary(const Instruction &ins);
  Launch buildKvWrite(const Instruction &ins);
  Launch buildPagedAttention(const Instruction &ins);
  /// rotary(q), rotary(k) and the kv_write of k and v (CudaServe.cu): one
  /// launch where instrs[i..i+2] are that and fit it.
  bool rotaryCacheTogether(const std::vector<Instruction> &instrs, size_t i);
  /// Whether anything but that kv_write reads rotary(k)'s result.
  bool rotaryKeysRead(const std::vector<Instruction> &instrs, size_t i);
  Launch buildRotaryCache(const std::vector<Instruction> &instrs, size_t i);
  // CudaLayout.cu
  Launch buildSliceOrConcat(const Instruction &ins);
  /// Whether two slices take the same input along the same axis (one
  /// launch copies a run of them: buildSlices, up to eight).
  bool slicesTogether(const Instruction &a, const Instruction &b);
  Launch buildSlices(const std::vector<Instruction> &instrs, size_t begin, size_t end);
  Launch buildTransposeOrBroadcast(const Instruction &ins);
  Launch buildEmbedding(const Instruction &ins);
  // CudaNorms.cu
  Launch buildReduce(const Instruction &ins);
  Launch buildNorm(const Instruction &ins);
  Launch buildNormGrad(const Instruction &ins);
  // CudaGemm.cu
  Launch buildMatmul(const Instruction &ins);
  /// Evicts the L2 cache (writes twice its size) on the stream: timing a
  /// product as decoding runs it, its weights coming from memory.
  void flushL2();
  /// Milliseconds `launch` takes on the stream, the mean of three runs
  /// (after the caller's warm-up); fromMemory flushes the L2 cache first.
  float timeOnStream(const std::function<void()> &launch, bool fromMemory);
  void *l2Flush = nullptr;
  size_t l2FlushBytes = 0;
  int l2FlushValue = 0;
  Launch buildGemm(const Instruction &ins);
  // CudaDecodeGemm.cu
  /// A bf16 product of at most 8 rows by [N, K] weights (transpose_b) with
  /// a matmul epilogue the decoding kernel has; nullopt otherwise.
  struct GemvShape {
    int64_t rows = 0, n = 0, k = 0;
    int epi = 0;
  };
  std::optional<GemvShape> decodeGemvShape(const Instruction &ins);
  /// Products of one input that may run as one launch (a, then b).
  bool productsTogether(const Instruction &a, const Instruction &b);
  Launch buildDecodeGemv(const std::vector<const Instruction *> &group, const Instruction *norm = nullptr);
  /// Whether instrs[i] is a layer or RMS norm whose result only the
  /// decoding products in instrs[i + 1, end) read: they then normalise
  /// their input themselves, and the norm's launch goes.
  bool normFeedsProducts(const std::vector<Instruction> &instrs, size_t i, size_t end);
  /// The products (one, or a run of one input): the decoding kernel or
  /// cuBLASLt, whichever runs faster here, timed now.
  Launch buildProducts(const std::vector<const Instruction *> &group, const Instruction *norm = nullptr);
  /// Where instrs[i] is a decoding product whose result only the slices
  /// after it read (q, k and v of one product), the end of those slices;
  /// i otherwise. The decoding kernel then writes each slice itself.
  /// `normFolded`: the product's input is a norm's result the kernel does
  /// not read (it normalises the norm's input, which normFeedsProducts
  /// checks), so the slices may take that result's place.
  size_t productSlicesEnd(const std::vector<Instruction> &instrs, size_t i, bool normFolded = false);
  Launch buildProductSlices(const std::vector<Instruction> &instrs, size_t i, size_t end,
                            const Instruction *norm = nullptr);
  /// A run of decoding products from instrs[i] (a product and its slices,
  /// or products of one input): its end, or i where there is none.
  size_t decodeGroupEnd(const std::vector<Instruction> &instrs, size_t i, bool normFolded = false);
  /// Whether no instruction of the program being built writes buffer id (a
  /// parameter, a prepared weight or an input the host uploads before the
  /// program runs): a programmatic dependent launch may read it before the
  /// kernel before it ends.
  bool readOnlyHere(int64_t id);
  Launch buildDecodeGroup(const std::vector<Instruction> &instrs, size_t i, size_t end, const Instruction *norm);
  /// `ours` or `theirs`, whichever is faster here (weights from memory).
  Launch fasterProducts(Launch ours, Launch theirs, const std::string &what);
  // CudaAttention.cu
  Launch buildAttention(const Instruction &ins, bool grad);
  using AttentionKey = std::tuple<int64_t, int64_t, int64_t>;
  Launch buildPackedAttention(const Instruction &ins, bool grad);
  Launch flashForward(const flash::Params &p, int64_t out, AttentionKey key);
  std::shared_ptr<cudnn::Attention> cudnnAttention(const flash::Params &p, bool backward);
  Launch flashBackward(const flash::Params &p, char *pdo, char *gq, char *gk, char *gv, AttentionKey key,
                       char *clear, int64_t clearBytes);
  // CudaLoss.cu
  Launch buildCrossEntropy(const Instruction &ins);
  Launch buildFusedCrossEntropy(const Instruction &ins);
  // CudaGenerated.cu
  Launch buildFused(const Instruction &ins);
  Launch buildRowKernel(const Instruction &ins);
  Launch buildCrossEntropyKernel(const Instruction &ins);
  Launch buildNormGradKernel(const Instruction &ins);
  cudaKernel_t generatedKernel(const Instruction &ins, const char *suffix = "");
  void requireVectorAligned(std::initializer_list<const std::vector<int64_t> *> lists, int64_t vector);
  // CudaCollectives.cu
  Launch buildCommunication(const Instruction &ins);
  Launch buildEventWait(const Instruction &ins);
  // CudaOptimizer.cu
  /// The device tables of a run of updates (CudaOptimizer.cu).
  struct UpdateTables {
    const AdamTensor *tensors = nullptr;
    const AdamChunk *chunks = nullptr;
    unsigned blocks = 0;
  };
  UpdateTables updateTables(const std::vector<const Instruction *> &group, bool second);
  __nv_bfloat16 *updateCopy(const Instruction &ins, size_t at);
  Launch buildSgdRun(const std::vector<const Instruction *> &group);
  Launch buildAdamw(const std::vector<const Instruction *> &group);
  Launch buildGeneratedAdamw(const std::vector<const Instruction *> &group);
  /// Whether this adamw runs in the compiler's generated kernel.
  bool generatedAdamw(const Instruction &ins) const {
    return kernelsLibrary && generatedKernelsOn() && ins.attrs.is_object() && ins.attrs.contains("kernel");
  }
  Launch buildCasts(const std::vector<Instruction> &instrs, size_t begin, size_t end);
  /// Gradient accumulations instrs[begin, end) (each an f32 sum += an f32
  /// or bf16 gradient, in place) in one launch (CudaOptimizer.cu).
  Launch buildAccumulates(const std::vector<Instruction> &instrs, size_t begin, size_t end);
  OptimizerArgs optimizerArgs(const Instruction &ins);
  Launch buildSgd(const Instruction &ins);
  Launch buildGlobalNorm(const Instruction &ins);
  Launch buildStepIncrement(const Instruction &ins);
  /// The sum of squares of the instruction's inputs (those not in `skip`),
  /// as a double at the start of the workspace: global_norm's first half,
  /// local or across a group.
  Launch buildSumOfSquares(const Instruction &ins, const std::set<int64_t> &skip);
  // CudaConv.cu
  Launch buildConv2d(const Instruction &ins);
  Launch buildIm2colConv2d(const Instruction &ins);
  Launch buildCudnnConv2d(const Instruction &ins); // conv2d and its two gradients
  Launch buildBatchNormPass(const Instruction &ins, bool grad);
  Launch buildBatchNorm(const Instruction &ins) { return buildBatchNormPass(ins, false); }
  Launch buildBatchNormGrad(const Instruction &ins) { return buildBatchNormPass(ins, true); }
  Launch buildPool(const Instruction &ins);
  Launch buildPoolGrad(const Instruction &ins);

  //===--- State ----------------------------------------------------------===//
  std::string kernelsPtx;
  cudaLibrary_t kernelsLibrary = nullptr;

  const RankProgram &rank;
  int device;
  NcclWorld *world = nullptr;
  cudaStream_t stream = nullptr, sendStream = nullptr;
  /// "async" collectives (data-parallel gradient buckets) run here, after
  /// an event marks their inputs ready on the compute stream; each records
  /// its bundle event, which an event_wait makes the compute stream wait for.
  cudaStream_t commStream = nullptr;
  std::map<int64_t, cudaEvent_t> commEvents;
  std::vector<cudaEvent_t> readyEvents;
  cudaEvent_t commEvent(int64_t id);
  /// Sends go out of staging copies on their own stream, so the compute
  /// stream never waits for a receiver and may reuse the sent buffer's
  /// memory at once. Each send instruction has its own copy, made when it is
  /// prepared: nothing is allocated and no host thread waits on a transfer
  /// while programs run (a host that blocks on its send while its peer
  /// blocks on its own deadlocks both once transfers outgrow NCCL's buffers).
  /// A copy is rewritten once its previous send is done (a wait on the GPU).
  struct Staging {
    char *data = nullptr;
    int64_t bytes = 0;
    cudaEvent_t copied = nullptr, sent = nullptr;
    bool used = false;
    bool sentInGraph = false; // `sent` last recorded in a capture: an eager run may not wait for it
  };
  std::deque<Staging> staging;
  int64_t startOf(const Instruction &ins, int64_t localRows, int64_t &parts) const {
    auto it = ins.attrs.find("vocab_group");
    parts = 1;
    if (it == ins.attrs.end() || !it->is_string())
      return 0;
    const std::vector<int64_t> &members = rank.groups.at(it->get<std::string>());
    parts = int64_t(members.size());
    return int64_t(std::find(members.begin(), members.end(), rank.rank) - members.begin()) * localRows;
  }
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;
  static constexpr size_t kBlasWorkspace = 32 << 20;
  void *blasWorkspace = nullptr;
  char *arena = nullptr;
  /// Device memory NCCL may read or write (the arena, both workspaces):
  /// through ncclMemAlloc with LOOM_NCCL_REGISTER=1 where this rank has an
  /// NCCL world, so that NCCL registers it when it captures a program's
  /// graph (its user-buffer registration: transfers from and into our
  /// buffers, not through its own); cudaMalloc otherwise. An experiment
  /// for dp2's cost beside NCCL's kernels, not yet run on a GPU.
  void *allocShared(size_t bytes, const char *what);
  void freeShared(void *p);
  bool sharedByNccl = false;
#ifdef LOOM_HAVE_NCCL
  /// The tensor-parallel group's communicator where this rank has one, or
  /// the data-parallel group's where its programs shard over it (ZeRO), and
  /// windowsWanted(): the arena and workspaces are then allocated with
  /// ncclMemAlloc and registered as symmetric NCCL windows on it, so that
  /// NCCL runs its symmetric kernels (peers' buffers read and written
  /// directly over NVLink) for the gathers and reduce-scatters. A
  /// collective call: the group's members allocate in the same order, sizes
  /// they have agreed on (agreeOnSizes).
  ncclComm_t windowComm = nullptr;
  std::string windowGroup; // its name, for messages
  std::map<void *, ncclWindow_t> windows;
  /// The largest of each of `sizes` over windowComm's group (a collective
  /// call, bounded by the world's timeout); `what` names them in errors.
  void agreeOnSizes(std::vector<uint64_t> &sizes, const std::string &what);
#endif
  static bool windowsWanted();
  long long *errorWord = nullptr;
  char *workspace = nullptr;
  size_t workspaceBytes = 0, workspaceAllocated = 0;
  /// The communication stream's own workspace (ZeRO-1's packed
  /// reduce-scatters run there, one after another, while compute goes on).
  char *commWorkspace = nullptr;
  size_t commWorkspaceBytes = 0, commWorkspaceAllocated = 0;
  /// ZeRO-1's reduce-scatter and all-gather of a bucket as one NCCL call
  /// each over packed slices (the default; LOOM_CUDA_ZERO_PACKED=0: per tensor).
  static bool zeroPacked();
  /// A bucket's all-reduce as one packed message (the default;
  /// LOOM_CUDA_BUCKET_PACKED=0: one NCCL call per tensor, in one group).
  static bool bucketPacked();
  /// Programs with NCCL calls captured as CUDA graphs too (the default;
  /// LOOM_CUDA_GRAPHS_NCCL=0: eager).
  static bool ncclGraphs();
  /// Pipeline sends and receives captured too (with ncclGraphs(); the
  /// default since 2026-11-29, LOOM_CUDA_GRAPHS_P2P=0: eager), each program
  /// with sends ending on their join.
  static bool p2pGraphs();
  /// Joins the sends' stream back into the compute stream (recorded there).
  cudaEvent_t sendsJoined = nullptr;
  /// A program whose async collectives are waited for by a later program
  /// (a data-parallel backward's buckets) ends by joining the communication
  /// stream, so that its capture is complete (buildJoinsComm while building).
  cudaEvent_t commJoined = nullptr;
  bool buildJoinsComm = false;
  /// Whether the program being built records `event` before the current
  /// instruction (recordedBefore) or waits for it after.
  bool eventInProgram(int64_t event, bool recordedBefore);
  /// This rank's index in a named group and the group's size.
  std::pair<int64_t, int64_t> placeIn(const std::string &group);
  /// The deferred part whose f32 output is `out` (DeferredPart), or null:
  /// its bucket only moves bytes, and the global norm and AdamW read the
  /// pair. Made once from the rank's programs where the "dp" link has a
  /// deferred region of their size.
  const DeferredPart *deferredOf(int64_t out);
  /// What the update reads for deferred part `d`: this rank's bf16 gradient
  /// (in the first half of its f32 output's memory), the peer's (in the
  /// deferred region), and how to combine them.
  std::tuple<DPtr, const __nv_bfloat16 *, int> deferredPair(const DeferredPart &d) {
    return {DPtr{ptr(buf(d.out)), true}, reinterpret_cast<const __nv_bfloat16 *>(deferredLink->deferred + d.at), d.op};
  }
  bool deferredKnown = false;
  std::map<int64_t, DeferredPart> deferred;
  const PeerLink *deferredLink = nullptr;
#ifdef LOOM_HAVE_NCCL
  /// This rank's end of `group`'s peer link, for an asynchronous all-reduce
  /// (null: NCCL's way; CudaPeerCollectives.cu).
  const PeerLink *peerLinkOf(const std::string &group, bool async) const;
  /// The link a ZeRO collective `ins` over `parts` ranks exchanges `bytes`
  /// a rank through (peerExchange), or null for NCCL's way: two ranks,
  /// async, peerZero(), at least peerMinBytes() and at most the scratch.
  const PeerLink *exchangeLinkOf(const Instruction &ins, int64_t parts, size_t bytes, ncclComm_t comm);
  /// In-place all-reduces of (data, elements, type) over `comm`: as one NCCL
  /// group, except the f32 and bf16 ones of at least peerMinBytes() where
  /// `link` is given, which go over peer memory with `wide` (bf16
  /// gradients summed into f32 outputs; only where `link` is given).
  using ReducePart = std::tuple<char *, int64_t, ncclDataType_t>;
  void allReduceParts(cudaStream_t s, ncclComm_t comm, const PeerLink *link, const std::vector<ReducePart> &parts,
                      ncclRedOp_t red, const std::vector<PeerPart> &wide = {});
#endif
  /// The device table of whole tensors and their shards (wholes[i] and
  /// shards[i]), packed one after another; `span` receives the shards'
  /// total length. The shards are f32; the wholes too, or every one bf16
  /// with `bf16Wholes` (its address then stands in PackedTensor::whole), or
  /// with `eitherWholes` each its own (bf16 ones flagged bf16Whole).
  const PackedTensor *packedTensors(const std::vector<int64_t> &wholes, const std::vector<int64_t> &shards,
                                    int64_t parts, int64_t &span, bool bf16Wholes = false,
                                    bool eitherWholes = false, std::vector<PackedTensor> *host = nullptr);
  /// An async collective (one with an event): `work` on the communication
  /// stream once the compute stream reaches it, recording the event.
  bool asyncCollective(const Instruction &ins);
  Launch onCommStream(const Instruction &ins, Launch work);
  /// With zeroPacked(): consecutive shard_of of one group as one launch.
  bool shardsTogether(const Instruction &a, const Instruction &b);
  Launch buildShardsOf(const std::vector<Instruction> &instrs, size_t begin, size_t end);
#ifdef LOOM_HAVE_NCCL
  /// `run` (which works in the communication stream's workspace) on that
  /// stream for an async collective, else on the compute stream after it.
  Launch inCommWorkspace(const Instruction &ins, Launch run);
  Launch buildPackedReduceScatter(const Instruction &ins, int64_t index, int64_t parts, ncclComm_t comm);
  /// ZeRO's reduce-scatter of gradients into f32 slices: pack every rank's
  /// parts (bf16 ones widened), NCCL's f32 reduce-scatter, unpack.
  Launch widenedScatterRun(const Instruction &ins, int64_t index, int64_t parts, ncclComm_t comm);
  /// The same for bf16 gradients with bf16 on the wire and f32 sums: each
  /// rank sends every other rank the bf16 part that rank keeps and adds the
  /// parts it receives to its own in f32. The slices are the f32
  /// reduce-scatter's of the widened gradients (exactly, over two ranks)
  /// with half of its bytes sent.
  Launch wideSumScatterRun(const Instruction &ins, int64_t index, int64_t parts, ncclComm_t comm);
  /// Whether ZeRO's reduce-scatters of bf16 gradients take wideSumScatterRun
  /// (unless LOOM_CUDA_WIDE_SUMS=0: NCCL's f32 reduce-scatter of the widened
  /// gradients).
  static bool wideSums();
  Launch buildPackedAllGather(const Instruction &ins, int64_t index, int64_t parts, ncclComm_t comm);
  /// A bucket of gradients all-reduced in f32: the small ones as one packed
  /// message, the large ones in place; a bf16 input is widened into its f32
  /// output.
  Launch buildPackedAllReduce(const Instruction &ins, ncclRedOp_t red, ncclComm_t comm);
  /// The same bucket with its bf16 gradients averaged as bf16 ("wire":
  /// "bf16"), then widened into their f32 outputs.
  Launch buildBf16WireAllReduce(const Instruction &ins, ncclRedOp_t red, ncclComm_t comm, int64_t below);
#endif
  int32_t *argmaxOut = nullptr; // argmaxRows' results on the device, argmaxCapacity of them
  int64_t argmaxCapacity = 0;
  std::vector<void *> allocations;
  std::string where;
  struct Step {
    std::string what, op;
    double flops;
    Launch launch;
    cudaEvent_t start, end;
    // CUDA graphs: whether the launch may be captured (no host-memory
    // copies, no second stream), whether a captured launch may replay now
    // (host state it read when captured still holds), and the host state a
    // replay must update in its stead.
    bool capturable = true;
    std::function<bool()> replayable;
    std::function<void()> replayed;
    // loom-run --trace: the stream where the step's work ends (null: the
    // compute stream) and the timeline track it is drawn on.
    cudaStream_t traceStream = nullptr;
    std::string track = "compute";
    // NCCL instructions of a multi-rank bundle: recorded where the
    // instruction's work ends, so a wait that times out names the first
    // collective that has not finished.
    cudaEvent_t communicated = nullptr;
  };
  /// What the instruction being built tells its Step (see Step).
  bool buildCapturable = true;
  cudaStream_t buildTraceStream = nullptr;
  std::string buildTrack = "compute";
  /// Tracing: an event at the start of each run, and the host's clock then.
  cudaEvent_t traceBase = nullptr;
  double traceBaseHost = 0;
  /// uploadFromDevice: the legacy default stream's work so far, which the
  /// copy waits for (made on first use).
  cudaEvent_t legacyStreamDone = nullptr;
  std::function<bool()> buildReplayable;
  std::function<void()> buildReplayed;
  /// A program's captured CUDA graph: the steady state replays it in one
  /// launch. Captured at the second run (the first warms up); off for
  /// --profile and with LOOM_CUDA_GRAPHS=0.
  struct Graph {
    bool capturable = false;   // every step's launch may be captured (set at prepare)
    std::vector<size_t> hooks; // the steps with host state to check or update on replay
    int eagerRuns = 0;
    int runs = 0; // every run, for LOOM_CUDA_PROFILE_RUN
    bool disabled = false;
    cudaGraphExec_t exec = nullptr;
    // LOOM_CUDA_PROGRAM_TIMES=1: the program's GPU time (events around its
    // launch on the compute stream, graphs left on), the host's from run()
    // to its streams' end and since the previous program's end, summed
    // after 3 runs and printed when the backend closes.
    cudaEvent_t began = nullptr, ended = nullptr;
    std::chrono::steady_clock::time_point hostStart{};
    double gpuMs = 0, hostMs = 0, gapMs = 0;
    int timed = 0;
  };
  std::map<std::string, Graph> graphs;
  std::chrono::steady_clock::time_point lastRunEnd{};
  static bool timePrograms();
  /// LOOM_CUDA_PROGRAM_TIMES's events and clocks around a run (nothing
  /// when it is off): before the launch; after it (streamsDone false) and
  /// after the streams' end (true).
  void startProgramTimer(Graph &g);
  void stopProgramTimer(Graph &g, bool streamsDone);
  static void destroyProgramTimer(Graph &g);
  void reportProgramTimes() const;
  //===--- CUDA graphs (CudaGraphs.cu) ------------------------------------===//
  void dropGraphs();
  static bool graphsWanted();
  /// LOOM_CUDA_TRACE_GRAPHS=1: --trace keeps CUDA graphs, its events captured as nodes.
  static bool traceGraphs();
  /// Records a trace or profile event (created on first use) on `s`.
  static void recordTraceEvent(cudaEvent_t &event, cudaStream_t s, bool capturing);
  void launchEager(std::vector<Step> &steps);
  /// Waits for the compute, send and communication streams after a run.
  /// With NCCL it polls them, and every communicator's asynchronous error;
  /// on an error or after the world's timeout it aborts every communicator
  /// and fails naming this rank and the first unfinished collective.
  void waitForStreams(const std::string &program, std::vector<Step> &steps);
  /// Captures the program's launches into a graph and launches it; false
  /// (nothing launched, graphs off for this program) where capture fails.
  bool captureAndLaunch(const std::string &program, std::vector<Step> &steps, Graph &g);
  double denseFlops(const Instruction &ins) const { return denseInstructionFlops(rank, ins); }
  std::map<std::string, std::vector<Step>> programs;

  /// What a bf16 attention forward leaves its backward: the rows'
  /// log-sum-exps (ours) and which buffer holds its output. `fresh` is set by
  /// the forward's launch and cleared by the backward's, on the host thread
  /// that issues both.
  struct AttentionSave {
    float *lse = nullptr; // our kernels' base-2 log-sum-exps, or cuDNN's statistics
    bool cudnnStats = false;
    int64_t out = -1;
    std::pair<std::string, size_t> at;
    bool fresh = false;
  };
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::shared_ptr<AttentionSave>> attentionSaves;
  std::map<std::string, std::vector<Instruction>> instructions; // as prepared
  std::pair<std::string, size_t> building;                      // the instruction being built
  /// Whether the save's output buffer still holds the forward's result when
  /// the instruction at `use` runs: nothing between them (in program order:
  /// one program, or "forward" then "backward") writes over its bytes.
  bool outputIntact(const AttentionSave &save, const std::pair<std::string, size_t> &use) const;
};

} // namespace loom::rt::cuda

#endif
