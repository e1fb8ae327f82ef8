//===- CudaDeviceTest.cpp - The GPU is reachable from the runtime ---------===//
//
// Skips where there is no GPU (CI); on the GPU machine it checks that
// memory round-trips through every device.
//
//===----------------------------------------------------------------------===//

#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <vector>

TEST(CudaDevice, MemoryRoundTrip) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    GTEST_SKIP() << "no CUDA device";
  for (int d = 0; d < count; ++d) {
    ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
    std::vector<float> host(1 << 20), back(host.size());
    for (size_t i = 0; i < host.size(); ++i)
      host[i] = static_cast<float>(i) * 0.5f;
    void *dev = nullptr;
    ASSERT_EQ(cudaMalloc(&dev, host.size() * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dev, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(back.data(), dev, back.size() * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(host, back) << "device " << d;
    cudaFree(dev);
  }
}
