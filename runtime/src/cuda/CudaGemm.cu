//===- CudaGemm.cu - Matrix products through cuBLASLt ----------------------===//
//
// Row-major products planned once per shape (cuBLASLt's candidates timed
// on this GPU when a program is prepared), f32 on TF32 tensor cores or bf16,
// with their bias, GELU, residual and bias-gradient epilogues fused where
// cuBLASLt has an algorithm for them; batched and broadcast products; and
// the f32 attention's batched products (cuBLAS).
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>

namespace loom::rt::cuda {

namespace {

/// The algorithm each product got on a kind of GPU, shared by the process's
/// ranks: the first rank to plan a shape times its candidates and the others
/// take its choice (waiting while it times), so that the ranks of a group run
/// the same algorithms. Timed by each rank on its own, two H200s' dp2 ranks
/// of GPT-2 350M picked a 64x512 tile for one weight gradient's shape on one
/// rank (147.5 us a run) and a 128x256 one on the other (64.5 us): the
/// faster rank then waited 2 ms a step in its collectives (2026-11-29).
struct SharedGemmChoices {
  std::mutex mutex;
  std::condition_variable settled;
  std::map<std::string, std::optional<cublasLtMatmulAlgo_t>> chosen; // nullopt: a rank is timing it
  std::map<int, std::string> deviceNames;                            // asked once per device
};

SharedGemmChoices &sharedGemmChoices() {
  static SharedGemmChoices shared;
  return shared;
}

/// The kind of GPU `device` is (its name); the caller holds shared.mutex.
const std::string &deviceNameOf(SharedGemmChoices &shared, int device) {
  auto it = shared.deviceNames.find(device);
  if (it == shared.deviceNames.end()) {
    cudaDeviceProp prop{};
    std::string name = cudaGetDeviceProperties(&prop, device) == cudaSuccess ? std::string(prop.name)
                                                                              : cat("device ", device);
    it = shared.deviceNames.emplace(device, name).first;
  }
  return it->second;
}

} // namespace

cublasComputeType_t f32Compute() {
  static const bool tf32 = [] {
    return !envIs("LOOM_CUDA_TF32", "0");
  }();
  return tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

CudaBackendImpl::GemmTypes CudaBackendImpl::gemmTypes(const Buffer &a, const Buffer &b, const Buffer &c) {
  if (a.dtype != b.dtype)
    fail(LOOM_UNSUPPORTED, where, ": a matrix product of ", dtypeName(a.dtype), " and ", dtypeName(b.dtype),
         " (cast one operand first)");
  GemmTypes t;
  fp(a.id), fp(c.id); // f32 or bf16
  if (isBf16(a))
    t.ab = CUDA_R_16BF, t.abSize = 2, t.compute = CUBLAS_COMPUTE_32F;
  if (isBf16(c))
    t.c = CUDA_R_16BF, t.cSize = 2;
  return t;
}

std::shared_ptr<CudaBackendImpl::GemmPlan>
CudaBackendImpl::planGemm(const GemmTypes &t, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void *a,
                          int64_t lda, const void *b, int64_t ldb, void *c, int64_t ldc, int64_t offsetAlign,
                          const GemmEpilogue *epilogue) {
  // The alignment every pointer the plan will see has (cuBLASLt assumes 256).
  auto alignOf = [](uint64_t v) { return v == 0 ? uint64_t(256) : std::min<uint64_t>(256, v & (~v + 1)); };
  const void *residual = epilogue ? epilogue->residual : nullptr;
  uint32_t align[4];
  const void *ptrs[4] = {b, a, residual ? residual : c, c};
  for (int i = 0; i < 4; ++i)
    align[i] = uint32_t(std::min(alignOf(reinterpret_cast<uintptr_t>(ptrs[i])), alignOf(uint64_t(offsetAlign))));
  uint32_t auxAlign = epilogue && epilogue->aux ? uint32_t(alignOf(reinterpret_cast<uintptr_t>(epilogue->aux))) : 0;
  std::string key = cat(m, "x", n, "x", k, ta, tb, ":", lda, ",", ldb, ",", ldc, ":", int(t.ab), int(t.c), int(t.compute),
                        ":", align[0], ",", align[1], ",", align[2], ",", align[3], ":",
                        epilogue ? int(epilogue->kind) : 0, residual ? "+C" : "", ",",
                        auxAlign, ",", epilogue ? epilogue->auxLd : 0);
  if (auto it = gemmPlans.find(key); it != gemmPlans.end())
    return it->second;
  auto plan = std::shared_ptr<GemmPlan>(new GemmPlan, [](GemmPlan *p) {
    cublasLtMatrixLayoutDestroy(p->a), cublasLtMatrixLayoutDestroy(p->b), cublasLtMatrixLayoutDestroy(p->c);
    cublasLtMatmulDescDestroy(p->desc);
    delete p;
  });
  cublasOperation_t opA = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opB = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, t.compute, CUDA_R_32F));
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opA, sizeof opA));
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opB, sizeof opB));
  if (epilogue) { // the bias is a vector over the result's columns (cuBLAS's rows)
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue->kind,
                                                     sizeof epilogue->kind));
    if (epilogue->bias) {
      cudaDataType biasType = t.c;
      LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &biasType,
                                                       sizeof biasType));
      LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                       &epilogue->bias, sizeof epilogue->bias));
    }
    if (epilogue->aux) {
      LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                       &epilogue->aux, sizeof epilogue->aux));
      LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                       &epilogue->auxLd, sizeof epilogue->auxLd));
    }
  }
  // Stored shapes (column-major): cuBLAS's A is our B, its B our A.
  LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, t.ab, tb ? k : n, tb ? n : k, ldb));
  LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, t.ab, ta ? m : k, ta ? k : m, lda));
  LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, t.c, n, m, ldc));
  cublasLtMatmulPreference_t pref = nullptr;
  LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t wsBytes = kBlasWorkspace;
  LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsBytes,
                                                         sizeof wsBytes));
  const cublasLtMatmulPreferenceAttributes_t alignAttr[3] = {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                             CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                             CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES};
  for (int i = 0; i < 3; ++i)
    LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, alignAttr[i], &align[i], sizeof align[i]));
  LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align[3],
                                                         sizeof align[3]));
  // Products of a few rows (decoding) read their weights from memory each
  // time: more candidates (cuBLASLt's first picks are tuned for larger
  // products), each timed with the L2 cache flushed, as it will run.
  const bool fewRows = m <= 64;
  constexpr int kMaxCandidates = 32;
  cublasLtMatmulHeuristicResult_t found[kMaxCandidates];
  int returned = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, plan->desc, plan->a, plan->b, plan->c, plan->c, pref,
                                                     fewRows ? kMaxCandidates : 8, found, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  if ((st != CUBLAS_STATUS_SUCCESS || returned == 0) && epilogue)
    return nullptr;
  if (st != CUBLAS_STATUS_SUCCESS || returned == 0)
    fail(LOOM_UNSUPPORTED, where, ": cuBLASLt has no algorithm for a ", m, "x", n, "x", k, " product (",
         cublasGetStatusName(st), ")");
  // Time the candidates (the result buffer is overwritten by the real run),
  // unless another rank of this process on the same kind of GPU has: its
  // choice then, where it is one of this rank's candidates too.
  float best = INFINITY, alpha = 1.0f, beta = residual ? 1.0f : 0.0f;
  const void *cIn = residual ? residual : c;
  SharedGemmChoices &shared = sharedGemmChoices();
  static const bool sharing = !envIs("LOOM_CUDA_SHARED_GEMMS", "0");
  std::string sharedKey;
  bool timing = false; // this rank times the shape for the others
  if (sharing && !deterministic()) {
    std::unique_lock<std::mutex> lock(shared.mutex);
    sharedKey = cat(deviceNameOf(shared, device), "|", fewRows, "|", key);
    shared.settled.wait(lock, [&] {
      auto it = shared.chosen.find(sharedKey);
      return it == shared.chosen.end() || it->second.has_value();
    });
    if (auto it = shared.chosen.find(sharedKey); it != shared.chosen.end()) {
      for (int i = 0; i < returned; ++i)
        if (found[i].state == CUBLAS_STATUS_SUCCESS &&
            std::memcmp(&found[i].algo, &*it->second, sizeof(cublasLtMatmulAlgo_t)) == 0) {
          plan->algo = found[i].algo;
          best = 0;
          break;
        }
    } else {
      shared.chosen[sharedKey] = std::nullopt;
      timing = true;
    }
  }
  // Whatever happens below, the others stop waiting for this rank's timing:
  // its choice, or (on a failure) none, which the next rank times itself.
  struct Settle {
    SharedGemmChoices &shared;
    const std::string &key;
    const cublasLtMatmulAlgo_t *algo = nullptr;
    bool active;
    ~Settle() {
      if (!active)
        return;
      std::lock_guard<std::mutex> lock(shared.mutex);
      if (algo)
        shared.chosen[key] = *algo;
      else
        shared.chosen.erase(key);
      shared.settled.notify_all();
    }
  } settle{shared, sharedKey, nullptr, timing};
  for (int i = 0; i < returned && best != 0; ++i) { // best = 0: the shared choice
    if (found[i].state != CUBLAS_STATUS_SUCCESS)
      continue;
    auto launch = [&] {
      return cublasLtMatmul(lt, plan->desc, &alpha, b, plan->a, a, plan->b, &beta, cIn, plan->c, c, plan->c,
                            &found[i].algo, blasWorkspace, kBlasWorkspace, stream);
    };
    if (launch() != CUBLAS_STATUS_SUCCESS)
      continue;
    if (deterministic()) { // the heuristic's first that runs: the same in every process, unlike the fastest
      best = 0, plan->algo = found[i].algo;
      break;
    }
    float ms = timeOnStream([&] { launch(); }, fewRows);
    if (ms < best)
      best = ms, plan->algo = found[i].algo;
  }
  if (best == INFINITY && epilogue)
    return nullptr;
  if (best == INFINITY)
    fail(LOOM_INTERNAL, where, ": no cuBLASLt algorithm ran a ", m, "x", n, "x", k, " product");
  settle.algo = &plan->algo;
  gemmPlans[key] = plan;
  return plan;
}

float CudaBackendImpl::timeOnStream(const std::function<void()> &launch, bool fromMemory) {
  cudaEvent_t e0, e1;
  LOOM_CUDA_CHECK(cudaEventCreate(&e0));
  LOOM_CUDA_CHECK(cudaEventCreate(&e1));
  float total = 0;
  for (int r = 0; r < 3; ++r) {
    if (fromMemory)
      flushL2();
    float ms = 0;
    LOOM_CUDA_CHECK(cudaEventRecord(e0, stream));
    launch();
    LOOM_CUDA_CHECK(cudaEventRecord(e1, stream));
    LOOM_CUDA_CHECK(cudaEventSynchronize(e1));
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    total += ms;
  }
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  return total / 3;
}

void CudaBackendImpl::flushL2() {
  if (!l2Flush) {
    int l2 = 0;
    LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
    l2FlushBytes = std::max<size_t>(size_t(l2) * 2, 1 << 20);
    LOOM_CUDA_CHECK(cudaMalloc(&l2Flush, l2FlushBytes));
  }
  LOOM_CUDA_CHECK(cudaMemsetAsync(l2Flush, ++l2FlushValue, l2FlushBytes, stream));
}

void CudaBackendImpl::gemm(const GemmPlan &p, const void *a, const void *b, void *c, cudaStream_t s,
                           const GemmEpilogue *epilogue) {
  float alpha = 1.0f, beta = 0.0f;
  if (epilogue && epilogue->bias) // plans are shared by shape: the vectors are this call's
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &epilogue->bias,
                                                     sizeof epilogue->bias));
  if (epilogue && epilogue->aux)
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                     &epilogue->aux, sizeof epilogue->aux));
  const void *cIn = c;
  if (epilogue && epilogue->residual)
    beta = 1.0f, cIn = epilogue->residual;
  LOOM_CUBLAS_CHECK(cublasLtMatmul(lt, p.desc, &alpha, b, p.a, a, p.b, &beta, cIn, p.c, c, p.c, &p.algo,
                                   blasWorkspace, kBlasWorkspace, s));
}

void CudaBackendImpl::gemmBatched(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float **a,
                                  int64_t lda, const float **b, int64_t ldb, float beta, float **c, int64_t ldc,
                                  int64_t count) {
  LOOM_CUBLAS_CHECK(cublasGemmBatchedEx(
      blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, int(n), int(m), int(k), &alpha,
      reinterpret_cast<const void **>(b), CUDA_R_32F, int(ldb), reinterpret_cast<const void **>(a),
      CUDA_R_32F, int(lda), &beta, reinterpret_cast<void **>(c), CUDA_R_32F, int(ldc), int(count),
      f32Compute(), CUBLAS_GEMM_DEFAULT));
}

/// The GEMM and its epilogue (docs/bundle-format.md): one cuBLASLt call
/// where cuBLASLt has an algorithm for it (bias, GELU_BIAS/GELU_AUX_BIAS,
/// DGELU, BGRADA; a residual as C with beta = 1), else the product and then
/// our kernels for the rest.
/// LOOM_CUDA_EPILOGUES=0 always takes the second way (for comparing).
Launch CudaBackendImpl::buildMatmul(const Instruction &ins) {
  auto found = ins.attrs.find("epilogue");
  std::string epilogue = found != ins.attrs.end() && found->is_string() ? found->get<std::string>() : "";
  if (epilogue.empty())
    return buildGemm(ins);
  static const bool lt = [] {
    return !envIs("LOOM_CUDA_EPILOGUES", "0");
  }();
  const Buffer &a = buf(ins.in[0]), &b = buf(ins.in[1]), &o = buf(ins.out[0]);
  bool ta = flag(ins, "transpose_a"), tb = flag(ins, "transpose_b");
  size_t ra = a.shape.size(), rb = b.shape.size();
  int64_t batchB = count(b.shape) / (b.shape[rb - 1] * b.shape[rb - 2]);
  int64_t n = o.shape.back(), rows = count(o.shape) / n;
  // The product as one GEMM: A's batch folded into rows, or (bgrad) X^T dY.
  bool oneGemm = (!ta && batchB == 1) || (ta && ra == 2 && rb == 2 && o.shape.size() == 2);
  int64_t m = rows, k = ta ? a.shape[0] : a.shape[ra - 1], lda = a.shape[ra - 1];
  bool withBias = epilogue == "bias" || epilogue == "bias_gelu" || epilogue == "bias_residual";
  bool withResidual = epilogue == "residual" || epilogue == "bias_residual" || epilogue == "bgrad_residual";
  bool withBgrad = epilogue == "bgrad" || epilogue == "bgrad_residual";
  // The residual is the result itself: the product adds into it (a gradient
  // into its f32 sum, loom-accumulate-in-products).
  bool inPlace = withResidual && buf(ins.in.back()).offset == o.offset && buf(ins.in.back()).bytes == o.bytes;
  GemmEpilogue e;
  if (withBias) {
    e.kind = CUBLASLT_EPILOGUE_BIAS, e.bias = ptr(buf(ins.in[2]));
    oneGemm &= buf(ins.in[2]).dtype == o.dtype;
  }
  if (withResidual) {
    e.residual = ptr(buf(ins.in.back()));
    oneGemm &= buf(ins.in.back()).dtype == o.dtype;
  }
  // GELU's pre-activation: written (bias_gelu with two results) or read (dgelu).
  int64_t aux = epilogue == "dgelu" ? ins.in[2] : epilogue == "bias_gelu" && ins.out.size() == 2 ? ins.out[1] : -1;
  if (epilogue == "bias_gelu")
    e.kind = aux >= 0 ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_BIAS;
  if (epilogue == "dgelu")
    e.kind = CUBLASLT_EPILOGUE_DGELU;
  if (withBgrad) {
    e.kind = CUBLASLT_EPILOGUE_BGRADA, e.bias = ptr(buf(ins.out[1]));
    oneGemm &= buf(ins.out[1]).dtype == o.dtype;
  }
  if (aux >= 0) { // cuBLASLt keeps the auxiliary matrix in the result's type, ld a multiple of 8
    e.aux = ptr(buf(aux)), e.auxLd = n;
    oneGemm &= n % 8 == 0 && buf(aux).dtype == o.dtype;
  }
  std::shared_ptr<GemmPlan> plan;
  if (lt && oneGemm)
    plan = planGemm(gemmTypes(a, b, o), ta, tb, m, n, k, ptr(a), lda, ptr(b), b.shape[rb - 1], ptr(o), n, 256, &e);
  if (plan) {
    char *pa = ptr(a), *pb = ptr(b), *po = ptr(o);
    return [=](cudaStream_t s) { gemm(*plan, pa, pb, po, s, &e); };
  }
  // Apart: the product (with its bias in cuBLASLt's epilogue where it can
  // be), then our kernels for the rest.
  std::vector<Launch> steps;
  if (inPlace) { // the product added into the result (beta = 1), then the bias gradient
    bool twoD = ra == 2 && rb == 2 && o.shape.size() == 2;
    if (withBias || aux >= 0 || epilogue == "dgelu" || !twoD)
      fail(LOOM_UNSUPPORTED, where, ": a residual added in place takes 2-D operands and no epilogue but bgrad");
    GemmTypes t = gemmTypes(a, b, o);
    char *pa = ptr(a), *pb = ptr(b), *po = ptr(o);
    int64_t ldb = b.shape[rb - 1];
    steps.push_back([=](cudaStream_t) {
      float one = 1.0f;
      LOOM_CUBLAS_CHECK(cublasGemmEx(blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, int(n),
                                     int(m), int(k), &one, pb, t.ab, int(ldb), pa, t.ab, int(lda), &one, po, t.c,
                                     int(n), t.compute, CUBLAS_GEMM_DEFAULT));
    });
    if (withBgrad)
      steps.push_back(build(Instruction{"reduce_sum", {ins.in[1]}, {ins.out[1]}, nlohmann::json{{"axes", {0}}}}));
    return [steps](cudaStream_t s) {
      for (const Launch &step : steps)
        step(s);
    };
  }
  int64_t result = aux >= 0 && epilogue == "bias_gelu" ? aux : ins.out[0]; // the pre-activation lands in aux
  Instruction product{"matmul", {ins.in[0], ins.in[1]}, {result}, ins.attrs};
  product.attrs.erase("epilogue");
  if (epilogue == "bias") {
    steps.push_back(buildGemm(product));
    DPtr po = fp(ins.out[0]), bias = fp(ins.in[2]);
    int64_t cnt = count(o.shape);
    steps.push_back([=](cudaStream_t s) {
      binaryContiguousKernel<<<blocksFor(cnt), kThreads, 0, s>>>(kAdd, po, bias, po, cnt, cnt, n);
    });
  } else if (withBias) { // bias_gelu, bias_residual
    product.in.push_back(ins.in[2]);
    product.attrs["epilogue"] = "bias";
    steps.push_back(buildMatmul(product));
  } else {
    steps.push_back(buildGemm(product));
  }
  if (epilogue == "bias_gelu")
    steps.push_back(build(Instruction{"gelu", {result}, {ins.out[0]}, nlohmann::json{{"approximate", true}}}));
  if (withResidual)
    steps.push_back(build(Instruction{"add", {ins.out[0], ins.in.back()}, {ins.out[0]}, nlohmann::json::object()}));
  if (epilogue == "dgelu")
    steps.push_back(build(Instruction{"unary_grad", {ins.in[2], ins.in[2], ins.out[0]}, {ins.out[0]},
                                      nlohmann::json{{"fn", "gelu_tanh"}}}));
  if (withBgrad) // the column sums of B (2-D, [k, n])
    steps.push_back(build(Instruction{"reduce_sum", {ins.in[1]}, {ins.out[1]}, nlohmann::json{{"axes", {0}}}}));
  return [steps](cudaStream_t s) {
    for (const Launch &step : steps)
      step(s);
  };
}

Launch CudaBackendImpl::buildGemm(const Instruction &ins) {
  const Buffer &a = buf(ins.in[0]), &b = buf(ins.in[1]), &o = buf(ins.out[0]);
  bool ta = flag(ins, "transpose_a"), tb = flag(ins, "transpose_b");
  size_t ra = a.shape.size(), rb = b.shape.size();
  int64_t m = o.shape[o.shape.size() - 2], n = o.shape.back();
  int64_t k = ta ? a.shape[ra - 2] : a.shape[ra - 1];
  int64_t lda = a.shape[ra - 1], ldb = b.shape[rb - 1];
  GemmTypes t = gemmTypes(a, b, o);
  char *pa = ptr(a), *pb = ptr(b), *po = ptr(o);
  int64_t sz = t.abSize, osz = t.cSize;
  int64_t batch = count(o.shape) / (m * n);
  int64_t batchA = count(a.shape) / (a.shape[ra - 1] * a.shape[ra - 2]);
  int64_t batchB = count(b.shape) / (b.shape[rb - 1] * b.shape[rb - 2]);
  if (batchB == 1 && !ta) // fold A's batch into rows: one GEMM
  {
    auto plan = planGemm(t, false, tb, batch * m, n, k, pa, lda, pb, ldb, po, n);
    return [=](cudaStream_t s) { gemm(*plan, pa, pb, po, s); };
  }
  if (batchA == batch && batchB == batch) {
    int64_t sa = count(a.shape) / batch, sb = count(b.shape) / batch, so = m * n;
    return [=](cudaStream_t) {
      float one = 1.0f, zero = 0.0f;
      LOOM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
          blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, int(n), int(m), int(k), &one, pb,
          t.ab, int(ldb), sb, pa, t.ab, int(lda), sa, &zero, po, t.c, int(n), so, int(batch), t.compute,
          CUBLAS_GEMM_DEFAULT));
    };
  }
  // Other broadcasts: one GEMM per batch with the operands' own offsets.
  Shape ob(o.shape.begin(), o.shape.end() - 2), ab(a.shape.begin(), a.shape.end() - 2),
      bb(b.shape.begin(), b.shape.end() - 2);
  std::vector<int64_t> sa = broadcastTo(ab, ob), sbs = broadcastTo(bb, ob), offA, offB;
  std::vector<int64_t> unit = stridesOf(ob);
  for (int64_t i = 0; i < batch; ++i) {
    int64_t rem = i, oa = 0, obb = 0;
    for (int d = static_cast<int>(ob.size()) - 1; d >= 0; --d) {
      int64_t idx = rem % ob[d];
      rem /= ob[d];
      oa += idx * sa[d];
      obb += idx * sbs[d];
    }
    offA.push_back(oa * a.shape[ra - 1] * a.shape[ra - 2]);
    offB.push_back(obb * b.shape[rb - 1] * b.shape[rb - 2]);
  }
  int64_t offsets = m * n * osz;
  for (int64_t i = 0; i < batch; ++i)
    offsets |= offA[i] * sz | offB[i] * sz;
  auto plan = planGemm(t, ta, tb, m, n, k, pa, lda, pb, ldb, po, n, offsets);
  return [=](cudaStream_t s) {
    for (int64_t i = 0; i < batch; ++i)
      gemm(*plan, pa + offA[i] * sz, pb + offB[i] * sz, po + i * m * n * osz, s);
  };
}

void CudaBackendImpl::addGemmBuilders(BuilderTable &table) { table["matmul"] = &CudaBackendImpl::buildMatmul; }

} // namespace loom::rt::cuda
