//===- Tensor.h - Element types and shapes ----------------------*- C++ -*-===//
#ifndef LOOM_RUNTIME_TENSOR_H
#define LOOM_RUNTIME_TENSOR_H

#include "loom/runtime.h"

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace loom::rt {

using Shape = std::vector<int64_t>;

inline size_t dtypeSize(loom_dtype_t t) {
  switch (t) {
  case LOOM_F64:
  case LOOM_I64:
    return 8;
  case LOOM_F32:
  case LOOM_I32:
    return 4;
  case LOOM_BF16:
  case LOOM_F16:
    return 2;
  }
  return 0;
}

/// Names as the bundle and safetensors spell them ("f32", "F32").
const char *dtypeName(loom_dtype_t t);
std::optional<loom_dtype_t> parseDtype(const std::string &name);
const char *safetensorsDtype(loom_dtype_t t);
std::optional<loom_dtype_t> parseSafetensorsDtype(const std::string &name);

/// The most elements a tensor may have (2^48): its size in bytes, at most 8
/// an element, stays far inside int64.
constexpr int64_t kMaxElements = int64_t(1) << 48;

/// Element count; nullopt on a negative extent or more than kMaxElements.
std::optional<int64_t> numElements(const Shape &shape);
std::string shapeStr(const Shape &shape);

/// bf16 <-> f32 (round to nearest even).
inline float bf16ToFloat(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t floatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000)
    return 0x7fc0; // NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return uint16_t(bits >> 16);
}

/// Element i of a buffer of `dtype` as a double (for summaries and comparisons).
inline double loadAsDouble(loom_dtype_t dtype, const void *data, int64_t i) {
  switch (dtype) {
  case LOOM_F32: return static_cast<const float *>(data)[i];
  case LOOM_F64: return static_cast<const double *>(data)[i];
  case LOOM_BF16: return bf16ToFloat(static_cast<const uint16_t *>(data)[i]);
  case LOOM_I32: return static_cast<const int32_t *>(data)[i];
  case LOOM_I64: return static_cast<double>(static_cast<const int64_t *>(data)[i]);
  case LOOM_F16: break;
  }
  return 0.0 / 0.0;
}

} // namespace loom::rt

#endif
