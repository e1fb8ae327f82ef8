//===- contention.cu - What slows a product beside data-parallel transfers -===//
//
// Both GPUs run the same loop of cuBLASLt bf16 products (a GPT-2 350M weight
// gradient's shape by default) on their compute streams, as dp2's backward
// does, while one kind of background work runs on a second stream of each
// GPU for the loop's whole length:
//   alone                nothing
//   nccl f32 / bf16      NCCL all-reduces of --mb MiB between the two GPUs
//   peer copies (CE)     cudaMemcpyAsync of --mb MiB each way (copy engines
//                        over NVLink, no SMs)
//   ce all-reduce        the two-rank all-reduce of CudaPeerCollectives.cu:
//                        copy-engine pushes, one-thread barriers, adds in a
//                        full grid of blocks (or 16)
//   local copies (CE)    copies of --mb MiB within the GPU (HBM only)
//   stream K CTAs        K blocks copying within the GPU (HBM from few SMs)
//   hog K SMs            K blocks that hold an SM each (all its shared
//                        memory) and spin: SMs taken, no bytes
//   tiny spin K CTAs     K one-warp blocks that spin without shared memory
//   for N SMs            the product chosen for N SMs
//                        (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), alone and
//                        beside NCCL
// Prints each case's mean product time on GPU 0 and 1 against `alone`, and
// the time of one background unit alone before its row.
//
// Not built by CMake (a measurement for the GPU machine). Build and run:
//   nvcc -O2 -std=c++17 -arch=sm_90 bench/contention.cu -lcublasLt -lnccl -o /tmp/contention
//   NCCL_NVLS_ENABLE=0 /tmp/contention [--m 1024 --n 4096 --k 8192 --mb 64 --loop 200]
// Results: docs/benchmarks/multi-gpu.md (twenty-eighth session).
//
//===----------------------------------------------------------------------===//

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// Every CUDA, cuBLASLt and NCCL call is checked; a failure names the call and exits.
static void check(bool ok, const char *file, int line, const char *call, const std::string &why) {
  if (ok)
    return;
  std::fprintf(stderr, "%s:%d %s: %s\n", file, line, call, why.c_str());
  std::exit(1);
}
#define CK(x)                                                                                          \
  do {                                                                                                 \
    cudaError_t e_ = (x);                                                                              \
    check(e_ == cudaSuccess, __FILE__, __LINE__, #x, e_ == cudaSuccess ? "" : cudaGetErrorString(e_)); \
  } while (0)
#define CL(x)                                                                                          \
  do {                                                                                                 \
    cublasStatus_t s_ = (x);                                                                           \
    check(s_ == CUBLAS_STATUS_SUCCESS, __FILE__, __LINE__, #x, "cublas status " + std::to_string(s_)); \
  } while (0)
#define CN(x)                                                                                          \
  do {                                                                                                 \
    ncclResult_t r_ = (x);                                                                             \
    check(r_ == ncclSuccess, __FILE__, __LINE__, #x, ncclGetErrorString(r_));                          \
  } while (0)

// Holds its SM (all the shared memory it can get) and spins until *stop is set.
__global__ void hogKernel(volatile int *stop) {
  extern __shared__ char smem[];
  smem[threadIdx.x] = 0;
  while (*stop == 0)
    __nanosleep(1000);
}

// One warp that spins without shared memory: a barrier kernel waiting for its peer.
__global__ void tinyKernel(volatile int *stop) {
  while (*stop == 0)
    __nanosleep(1000);
}

// The two-rank barrier: raise my count in the peer's flag, wait for the peer's in mine.
__global__ void barrierKernel(unsigned *counter, const unsigned *mine, unsigned *theirs) {
  unsigned e = *counter + 1;
  *counter = e;
  __threadfence_system();
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(theirs), "r"(e) : "memory");
  for (;;) {
    unsigned seen;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(seen) : "l"(mine) : "memory");
    if (int(seen - e) >= 0)
      break;
    __nanosleep(128);
  }
  __threadfence_system();
}

// mine[i] += theirs[i]
__global__ void combineKernel(float *mine, const float *theirs, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    mine[i] += theirs[i];
}

// Copies n floats with a grid-stride loop (few CTAs: HBM traffic from a few SMs).
__global__ void streamKernel(const float4 *src, float4 *dst, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

struct Gpu {
  int dev = 0;
  cudaStream_t compute = nullptr, side = nullptr;
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  cublasLtMatmulDesc_t descSm = nullptr; // the same product chosen for fewer SMs
  cublasLtMatmulAlgo_t algoSm{};
  bool useSm = false;
  void *a = nullptr, *b = nullptr, *c = nullptr, *work = nullptr;
  size_t workBytes = 64 << 20;
  void *buf = nullptr, *buf2 = nullptr, *peerBuf = nullptr; // background buffers
  int *stop = nullptr;                                      // mapped host flag for hogKernel
  unsigned *flags = nullptr;                                // [counter, flag] for barrierKernel
  cudaEvent_t t0 = nullptr, t1 = nullptr;
  ncclComm_t comm = nullptr;
};

/// cuBLASLt's first choice for `desc` over g's layouts and workspace.
static cublasLtMatmulAlgo_t heuristicAlgo(Gpu &g, cublasLtMatmulDesc_t desc, const char *what) {
  cublasLtMatmulPreference_t pref;
  CL(cublasLtMatmulPreferenceCreate(&pref));
  CL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &g.workBytes,
                                          sizeof(g.workBytes)));
  cublasLtMatmulHeuristicResult_t res[1];
  int found = 0;
  CL(cublasLtMatmulAlgoGetHeuristic(g.lt, desc, g.la, g.lb, g.lc, g.lc, pref, 1, res, &found));
  CL(cublasLtMatmulPreferenceDestroy(pref));
  if (found < 1) {
    std::fprintf(stderr, "no cuBLASLt algorithm for %s\n", what);
    std::exit(1);
  }
  return res[0].algo;
}

static void setupGemm(Gpu &g, int m, int n, int k) {
  CK(cudaSetDevice(g.dev));
  CL(cublasLtCreate(&g.lt));
  CK(cudaMalloc(&g.a, size_t(m) * k * 2));
  CK(cudaMalloc(&g.b, size_t(k) * n * 2));
  CK(cudaMalloc(&g.c, size_t(m) * n * 2));
  CK(cudaMemset(g.a, 0, size_t(m) * k * 2));
  CK(cudaMemset(g.b, 0, size_t(k) * n * 2));
  CK(cudaMalloc(&g.work, g.workBytes));
  CL(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Column-major C[m,n] = A[m,k] * B[k,n]
  CL(cublasLtMatrixLayoutCreate(&g.la, CUDA_R_16BF, m, k, m));
  CL(cublasLtMatrixLayoutCreate(&g.lb, CUDA_R_16BF, k, n, k));
  CL(cublasLtMatrixLayoutCreate(&g.lc, CUDA_R_16BF, m, n, m));
  g.algo = heuristicAlgo(g, g.desc, "the product");
}

static void setupGemmSm(Gpu &g, int target) {
  CK(cudaSetDevice(g.dev));
  if (g.descSm)
    CL(cublasLtMatmulDescDestroy(g.descSm));
  CL(cublasLtMatmulDescCreate(&g.descSm, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CL(cublasLtMatmulDescSetAttribute(g.descSm, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &target, sizeof(target)));
  g.algoSm = heuristicAlgo(g, g.descSm, "the product for fewer SMs");
}

static void gemm(Gpu &g) {
  float alpha = 1.0f, beta = 0.0f;
  CL(cublasLtMatmul(g.lt, g.useSm ? g.descSm : g.desc, &alpha, g.a, g.la, g.b, g.lb, &beta, g.c, g.lc, g.c, g.lc,
                    g.useSm ? &g.algoSm : &g.algo, g.work, g.workBytes, g.compute));
}

int main(int argc, char **argv) {
  int m = 1024, n = 4096, k = 8192, loop = 200;
  size_t mb = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string f = argv[i];
    int v = std::atoi(argv[i + 1]);
    if (f == "--m") m = v;
    else if (f == "--n") n = v;
    else if (f == "--k") k = v;
    else if (f == "--loop") loop = v;
    else if (f == "--mb") mb = size_t(v);
    else {
      std::fprintf(stderr, "unknown flag %s\n", f.c_str());
      return 2;
    }
  }
  int count = 0;
  CK(cudaGetDeviceCount(&count));
  if (count < 2) {
    std::fprintf(stderr, "needs two GPUs (found %d)\n", count);
    return 2;
  }
  size_t bytes = mb << 20;
  std::vector<Gpu> gpus(2);
  int sms = 0;
  for (int d = 0; d < 2; ++d) {
    Gpu &g = gpus[d];
    g.dev = d;
    CK(cudaSetDevice(d));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d));
    CK(cudaStreamCreateWithFlags(&g.compute, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&g.side, cudaStreamNonBlocking));
    CK(cudaEventCreate(&g.t0));
    CK(cudaEventCreate(&g.t1));
    setupGemm(g, m, n, k);
    CK(cudaMalloc(&g.buf, bytes));
    CK(cudaMalloc(&g.buf2, bytes));
    CK(cudaMalloc(&g.peerBuf, bytes));
    CK(cudaMemset(g.buf, 0, bytes));
    CK(cudaHostAlloc(reinterpret_cast<void **>(&g.stop), sizeof(int), cudaHostAllocMapped));
    CK(cudaMalloc(&g.flags, 2 * sizeof(unsigned)));
    CK(cudaMemset(g.flags, 0, 2 * sizeof(unsigned)));
  }
  int devs[2] = {0, 1};
  ncclComm_t comms[2];
  CN(ncclCommInitAll(comms, 2, devs));
  gpus[0].comm = comms[0], gpus[1].comm = comms[1];
  for (int w = 0; w < 3; ++w) { // NCCL connects at its first collective: not part of any timing
    CN(ncclGroupStart());
    for (Gpu &g : gpus)
      CN(ncclAllReduce(g.buf, g.buf, bytes / 4, ncclFloat32, ncclSum, g.comm, g.side));
    CN(ncclGroupEnd());
  }
  for (Gpu &g : gpus) {
    CK(cudaSetDevice(g.dev));
    CK(cudaDeviceSynchronize());
  }
  int canPeer = 0;
  CK(cudaDeviceCanAccessPeer(&canPeer, 0, 1));
  if (canPeer) // direct copies over NVLink; NCCL may have enabled it already
    for (int d = 0; d < 2; ++d) {
      CK(cudaSetDevice(d));
      cudaError_t e = cudaDeviceEnablePeerAccess(1 - d, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
        CK(e);
      (void)cudaGetLastError();
    }

  // Times the product loop on both GPUs at once; `background(g)` enqueues one unit of the
  // background work on g's side stream, `units` of them before the loop starts.
  auto timeLoop = [&](auto background, int units, auto finish) {
    for (Gpu &g : gpus) {
      CK(cudaSetDevice(g.dev));
      CK(cudaDeviceSynchronize());
    }
    for (int u = 0; u < units; ++u)
      background(u);
    for (Gpu &g : gpus) {
      CK(cudaSetDevice(g.dev));
      CK(cudaEventRecord(g.t0, g.compute));
      for (int i = 0; i < loop; ++i)
        gemm(g);
      CK(cudaEventRecord(g.t1, g.compute));
    }
    std::vector<double> us(2);
    for (Gpu &g : gpus) {
      CK(cudaSetDevice(g.dev));
      CK(cudaEventSynchronize(g.t1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, g.t0, g.t1));
      us[size_t(g.dev)] = 1e3 * ms / loop;
    }
    finish();
    for (Gpu &g : gpus) {
      CK(cudaSetDevice(g.dev));
      CK(cudaDeviceSynchronize());
    }
    return us;
  };
  auto nothing = [] {};
  for (int warm = 0; warm < 2; ++warm) // warm-up, cuBLASLt's first launches
    timeLoop([](int) {}, 0, nothing);
  std::vector<double> alone = timeLoop([](int) {}, 0, nothing);
  double loopUs = alone[0] * loop;

  // One unit of each background kind, timed alone on both GPUs, sets how many cover the loop
  // twice over.
  auto unitsFor = [&](auto background) {
    for (Gpu &g : gpus) {
      CK(cudaSetDevice(g.dev));
      CK(cudaDeviceSynchronize());
    }
    auto start = std::chrono::steady_clock::now();
    for (int u = 0; u < 4; ++u)
      background(u);
    for (Gpu &g : gpus) {
      CK(cudaSetDevice(g.dev));
      CK(cudaDeviceSynchronize());
    }
    double unitUs = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / 4;
    std::printf("  (one unit alone: %.1f us)\n", unitUs);
    return std::max(1, int(2 * loopUs / unitUs) + 1);
  };

  std::printf("product %dx%dx%d bf16 (cuBLASLt's first heuristic), %d a loop; background units of %zu MiB; "
              "%d SMs; peer access %s\n",
              m, n, k, loop, mb, sms, canPeer ? "yes" : "no");
  std::printf("%-22s %12s %12s %10s\n", "beside", "GPU 0 us", "GPU 1 us", "vs alone");
  auto row = [&](const char *name, const std::vector<double> &us) {
    std::printf("%-22s %12.1f %12.1f %9.2fx\n", name, us[0], us[1], std::max(us[0] / alone[0], us[1] / alone[1]));
  };
  row("alone", alone);

  auto ncclUnit = [&](ncclDataType_t type, size_t elems) {
    return [&, type, elems](int) {
      CN(ncclGroupStart());
      for (Gpu &g : gpus)
        CN(ncclAllReduce(g.buf, g.buf, elems, type, ncclSum, g.comm, g.side));
      CN(ncclGroupEnd());
    };
  };
  auto nccl32 = ncclUnit(ncclFloat32, bytes / 4);
  row("nccl f32 all-reduce", timeLoop(nccl32, unitsFor(nccl32), nothing));
  auto nccl16 = ncclUnit(ncclBfloat16, bytes / 2);
  row("nccl bf16 all-reduce", timeLoop(nccl16, unitsFor(nccl16), nothing));

  auto peer = [&](int) {
    for (Gpu &g : gpus) {
      CK(cudaSetDevice(g.dev));
      CK(cudaMemcpyPeerAsync(gpus[1 - g.dev].peerBuf, 1 - g.dev, g.buf, g.dev, bytes, g.side));
    }
  };
  row("peer copies (CE)", timeLoop(peer, unitsFor(peer), nothing));

  // A two-rank f32 all-reduce of --mb MiB by the copy engines: each GPU sends the half its peer
  // reduces into the peer's scratch, a barrier, adds the peer's copy of its half, pushes its
  // reduced half into the peer's buffer, a barrier. `combineCtas` CTAs add (0: a full grid).
  for (int combineCtas : {0, 16}) {
    auto ce = [&, combineCtas](int) {
      size_t halfElems = bytes / 8, halfBytes = bytes / 2;
      for (Gpu &g : gpus) {
        Gpu &p = gpus[1 - g.dev];
        CK(cudaSetDevice(g.dev));
        char *buf = static_cast<char *>(g.buf), *peerBuf = static_cast<char *>(p.buf);
        size_t mineAt = g.dev == 0 ? 0 : halfBytes, otherAt = halfBytes - mineAt;
        CK(cudaMemcpyAsync(p.peerBuf, buf + otherAt, halfBytes, cudaMemcpyDeviceToDevice, g.side));
        barrierKernel<<<1, 1, 0, g.side>>>(g.flags, g.flags + 1, p.flags + 1);
        int blocks = combineCtas ? combineCtas : int((halfElems + 255) / 256);
        combineKernel<<<blocks, 256, 0, g.side>>>(reinterpret_cast<float *>(buf + mineAt),
                                                  static_cast<const float *>(g.peerBuf), halfElems);
        CK(cudaMemcpyAsync(peerBuf + mineAt, buf + mineAt, halfBytes, cudaMemcpyDeviceToDevice, g.side));
        barrierKernel<<<1, 1, 0, g.side>>>(g.flags, g.flags + 1, p.flags + 1);
        CK(cudaGetLastError());
      }
    };
    std::string name = "ce all-reduce " + (combineCtas ? std::to_string(combineCtas) + " CTAs" : std::string("grid"));
    row(name.c_str(), timeLoop(ce, unitsFor(ce), nothing));
  }

  auto local = [&](int) {
    for (Gpu &g : gpus) {
      CK(cudaSetDevice(g.dev));
      CK(cudaMemcpyAsync(g.buf2, g.buf, bytes, cudaMemcpyDeviceToDevice, g.side));
    }
  };
  row("local copies (CE)", timeLoop(local, unitsFor(local), nothing));

  int smem = 0;
  CK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  for (Gpu &g : gpus) {
    CK(cudaSetDevice(g.dev));
    CK(cudaFuncSetAttribute(hogKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  for (int ctas : {1, 8, 24}) {
    auto hog = [&](int u) {
      if (u > 0)
        return;
      for (Gpu &g : gpus) {
        *g.stop = 0;
        CK(cudaSetDevice(g.dev));
        int *flag = nullptr;
        CK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&flag), g.stop, 0));
        hogKernel<<<ctas, 128, smem, g.side>>>(flag);
        CK(cudaGetLastError());
      }
    };
    auto release = [&] {
      for (Gpu &g : gpus)
        *reinterpret_cast<volatile int *>(g.stop) = 1;
    };
    std::string name = "hog " + std::to_string(ctas) + " SMs";
    row(name.c_str(), timeLoop(hog, 1, release));
  }
  for (int ctas : {8, 24}) {
    auto stream = [&, ctas](int) {
      for (Gpu &g : gpus) {
        CK(cudaSetDevice(g.dev));
        streamKernel<<<ctas, 512, 0, g.side>>>(static_cast<const float4 *>(g.buf), static_cast<float4 *>(g.buf2),
                                               bytes / 16);
      }
    };
    std::string name = "stream " + std::to_string(ctas) + " CTAs";
    row(name.c_str(), timeLoop(stream, unitsFor(stream), nothing));
  }
  for (int ctas : {1, 8}) {
    auto tiny = [&](int u) {
      if (u > 0)
        return;
      for (Gpu &g : gpus) {
        *g.stop = 0;
        CK(cudaSetDevice(g.dev));
        int *flag = nullptr;
        CK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&flag), g.stop, 0));
        tinyKernel<<<ctas, 32, 0, g.side>>>(flag);
        CK(cudaGetLastError());
      }
    };
    auto release = [&] {
      for (Gpu &g : gpus)
        *reinterpret_cast<volatile int *>(g.stop) = 1;
    };
    std::string name = "tiny spin " + std::to_string(ctas) + " CTAs";
    row(name.c_str(), timeLoop(tiny, 1, release));
  }
  // The product chosen for fewer SMs (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), alone and beside NCCL.
  for (int target : {sms - 4, sms - 8, sms - 24}) {
    for (Gpu &g : gpus)
      setupGemmSm(g, target), g.useSm = true;
    timeLoop([](int) {}, 0, nothing); // warm-up
    std::string name = "for " + std::to_string(target) + " SMs, alone";
    row(name.c_str(), timeLoop([](int) {}, 0, nothing));
    name = "for " + std::to_string(target) + " SMs, nccl f32";
    row(name.c_str(), timeLoop(nccl32, unitsFor(nccl32), nothing));
    for (Gpu &g : gpus)
      g.useSm = false;
  }
  for (Gpu &g : gpus)
    ncclCommDestroy(g.comm);
  return 0;
}
