//===- GpuAgainstCpu.h - One instruction on the GPU against the CPU -*- C++ -*-===//
//
// What the GPU instruction tests share (CudaConvTest.cpp, CudaNormTest.cpp):
// an instruction runs alone on random operands on the CUDA backend and on
// the CPU backend (the reference that defines the instructions), and every
// output is compared by relative L2 error. f32 products run in full f32
// (TF32 off for the whole binary).
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_TEST_UNIT_GPUAGAINSTCPU_H
#define LOOM_TEST_UNIT_GPUAGAINSTCPU_H

#include "loom/rt/Bundle.h"
#include "loom/rt/Tensor.h"
#include "runtime/src/Backend.h"
#include "test/unit/SingleInstruction.h"

#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace loom::rt::test {

// f32 products in full f32 (the backend reads this once, on first use).
inline const bool kTf32Off = [] { return setenv("LOOM_CUDA_TF32", "0", 1) == 0; }();

inline bool haveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

inline double relativeL2(const std::vector<double> &got, const std::vector<double> &want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

/// Runs `op` on both backends with the same random inputs (uniform in
/// [mean - 1, mean + 1]) and expects every output within `tol` (relative L2).
inline void compare(const std::string &op, const Operands &o, nlohmann::json attrs, loom_dtype_t dt, double tol,
                    double mean = 0) {
  SCOPED_TRACE(op + " " + attrs.dump() + (dt == LOOM_BF16 ? " bf16" : " f32"));
  Instruction ins;
  RankProgram r = programFor(op, o, dt, ins, std::move(attrs));
  auto cpu = makeCpuBackend(r, 2);
  auto gpu = makeCudaBackend(r, 0);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(float(mean) - 1.0f, float(mean) + 1.0f);
  for (int64_t id : ins.in) {
    std::vector<char> bytes = floatBytes(r.buffers[id], [&](int64_t) { return dist(rng); });
    cpu->upload(r.buffers[id], bytes.data());
    gpu->upload(r.buffers[id], bytes.data());
  }
  for (Backend *be : {cpu.get(), gpu.get()}) {
    be->prepare("forward", {ins});
    be->run("forward");
  }
  for (int64_t id : ins.out) {
    const Buffer &b = r.buffers[id];
    int64_t n = numElements(b.shape).value();
    std::vector<char> a(b.bytes), c(b.bytes);
    gpu->download(b, a.data());
    cpu->download(b, c.data());
    std::vector<double> got(n), want(n);
    for (int64_t i = 0; i < n; ++i) {
      got[i] = loadAsDouble(dt, a.data(), i);
      want[i] = loadAsDouble(dt, c.data(), i);
      ASSERT_TRUE(std::isfinite(got[i])) << b.name << "[" << i << "]";
    }
    double err = relativeL2(got, want);
    EXPECT_LE(err, tol) << b.name << " " << shapeStr(b.shape) << ": relative L2 error " << err;
  }
}

} // namespace loom::rt::test

#endif
