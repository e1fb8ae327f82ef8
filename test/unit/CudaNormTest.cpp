//===- CudaNormTest.cpp - Norm gradients: CUDA backend against CPU --------===//
//
// layernorm_grad and rmsnorm_grad (dx, and the scale's and bias's
// gradients), with and without the residual stream's gradient as a fourth
// input, on the GPU against the CPU backend: bf16 rows of 256 to 2048 (the
// one-pass kernel that sums the parameter gradients on the way, and with
// LOOM_CUDA_NORM_GRAD=two-pass the row and column kernels), other widths
// (the general kernels), row counts that fill a block's warps unevenly,
// and f32. Skips where there is no GPU.
//
//===----------------------------------------------------------------------===//

#include "test/unit/GpuAgainstCpu.h"

#include <gtest/gtest.h>

using namespace loom::rt;
using loom::rt::test::compare;
using loom::rt::test::haveGpu;
using loom::rt::test::Operands;

namespace {

void normGrads(loom_dtype_t dt, double tol) {
  for (const char *op : {"layernorm_grad", "rmsnorm_grad"})
    for (int64_t h : {256, 768, 1024, 2048, 96})
      for (int64_t rows : {8192, 37, 3})
        for (bool residual : {false, true}) {
          if (rows == 8192 && h == 96)
            continue;
          bool rms = std::string(op) == "rmsnorm_grad";
          Operands o{{{rows, h}, {h}, {rows, h}}, {{rows, h}, {h}}};
          if (residual)
            o.in.push_back({rows, h});
          if (!rms)
            o.out.push_back({h});
          compare(op, o, {{"eps", 1e-5}}, dt, tol);
        }
}

TEST(CudaNorm, GradientsBf16) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  normGrads(LOOM_BF16, 1e-2);
}

TEST(CudaNorm, GradientsF32) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device";
  normGrads(LOOM_F32, 1e-5);
}

} // namespace
