//===- Elementwise.h - One definition of each elementwise function -*- C++ -*-===//
//
// The scalar functions of the elementwise instructions, shared by the CPU
// backend's per-op kernels and its evaluator of fused kernels, so that a
// fused chain computes exactly what the unfused chain computes. The
// compiler's GPU code generator (compiler/bundle/Fusion.cpp) writes the same
// formulas in MLIR.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_ELEMENTWISE_H
#define LOOM_RUNTIME_ELEMENTWISE_H

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace loom::rt::ew {

/// tanh without a call, so that loops over it vectorise: for |x| <= 9,
/// sign(x) (1 - 2 / (e^{2|x|} + 1)), with e^y = 2^k e^r (k = round(y / ln 2),
/// |r| <= ln 2 / 2, ln 2 split in two for an exact r) and e^r by its Taylor
/// series to r^7 (truncation below 2e-8 relative); beyond 9, tanh rounds to
/// +-1 in f32. Within 1.2e-7 of tanh everywhere (absolute: near 0 the
/// subtraction loses relative accuracy, not absolute).
inline float tanhVectorizable(float x) {
  float y = 2.0f * std::min(std::fabs(x), 9.0f);
  int32_t k = static_cast<int32_t>(y * 1.44269504088896341f + 0.5f); // y >= 0: truncation rounds
  float r = (y - float(k) * 0.693145751953125f) - float(k) * 1.42860682030941723e-06f;
  float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 +
                                                   r * (1.0f / 720 + r * (1.0f / 5040)))))));
  int32_t bits = (k + 127) << 23; // 2^k, k <= 26
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  float t = 1.0f - 2.0f / (p * scale + 1.0f);
  return std::copysign(t, x);
}

inline float geluErf(float x) { return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f)); }
inline float geluTanh(float x) {
  return 0.5f * x * (1.0f + tanhVectorizable(0.79788456080286536f * (x + 0.044715f * x * x * x)));
}
inline float relu(float x) { return x > 0 ? x : 0.0f; }
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }

inline float geluTanhDerivative(float v) {
  const float k = 0.79788456080286536f, a = 0.044715f;
  float t = tanhVectorizable(k * (v + a * v * v * v));
  return 0.5f * (1 + t) + 0.5f * v * (1 - t * t) * k * (1 + 3 * a * v * v);
}

/// d f(x) / dx for unary_grad's `fn`, given the input x and output y.
enum class Fn { Gelu, GeluTanh, Silu, Relu, Tanh, Exp, Rsqrt, Unknown };
inline Fn parseFn(const std::string &fn) {
  return fn == "gelu" ? Fn::Gelu : fn == "gelu_tanh" ? Fn::GeluTanh : fn == "silu" ? Fn::Silu
       : fn == "relu" ? Fn::Relu : fn == "tanh" ? Fn::Tanh : fn == "exp" ? Fn::Exp
       : fn == "rsqrt" ? Fn::Rsqrt : Fn::Unknown;
}
inline float derivative(Fn fn, float v, float out) {
  switch (fn) {
  case Fn::Gelu:
    return 0.5f * (1.0f + std::erf(v * 0.70710678118654752f)) +
           v * 0.39894228040143268f * std::exp(-0.5f * v * v);
  case Fn::GeluTanh:
    return geluTanhDerivative(v);
  case Fn::Silu: {
    float sg = 1.0f / (1.0f + std::exp(-v));
    return sg * (1 + v * (1 - sg));
  }
  case Fn::Relu: return v > 0 ? 1.0f : 0.0f;
  case Fn::Tanh: return 1 - out * out;
  case Fn::Exp: return out;
  case Fn::Rsqrt: return -0.5f * out * out * out;
  default: return 0;
  }
}

} // namespace loom::rt::ew

#endif
