//===- loom-devices.cpp - List the GPUs the runtime can use ---------------===//
//
// Prints each CUDA device with its compute capability, memory and which
// peers it can reach directly (NVLink or PCIe peer-to-peer). With no GPU or
// no driver it says so and exits 1 instead of failing later in a run.
//
//===----------------------------------------------------------------------===//

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

int main(int argc, char **argv) {
  if (argc > 1 && (!std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h"))) {
    std::printf("usage: loom-devices\n\nLists the CUDA devices Loom's runtime can use: compute "
                "capability, memory, and peer-to-peer reachability.\n");
    return 0;
  }
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    std::fprintf(stderr,
                 "loom-devices: error: no usable CUDA device (cudaGetDeviceCount: %s: %s).\n"
                 "Check that an NVIDIA GPU is present, that its driver is loaded (nvidia-smi), and "
                 "that CUDA_VISIBLE_DEVICES does not hide it; on a machine without a GPU use "
                 "loom-run --backend cpu.\n",
                 err == cudaSuccess ? "cudaSuccess" : cudaGetErrorName(err),
                 err == cudaSuccess ? "0 devices" : cudaGetErrorString(err));
    return 1;
  }
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::printf("%d CUDA device(s), driver %d.%d, runtime %d.%d\n", count, driver / 1000,
              (driver % 1000) / 10, runtime / 1000, (runtime % 1000) / 10);
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop;
    if ((err = cudaGetDeviceProperties(&prop, d)) != cudaSuccess) {
      std::fprintf(stderr, "loom-devices: error: cudaGetDeviceProperties(%d): %s\n", d,
                   cudaGetErrorString(err));
      return 1;
    }
    std::printf("  [%d] %s  sm_%d%d  %.1f GiB  %d SMs", d, prop.name, prop.major, prop.minor,
                prop.totalGlobalMem / double(1ull << 30), prop.multiProcessorCount);
    bool first = true;
    for (int peer = 0; peer < count; ++peer) {
      int can = 0;
      if (peer != d && cudaDeviceCanAccessPeer(&can, d, peer) == cudaSuccess && can) {
        std::printf(first ? "  peers: %d" : ",%d", peer);
        first = false;
      }
    }
    std::printf("\n");
  }
  return 0;
}
